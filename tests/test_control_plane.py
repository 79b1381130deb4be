"""Rank agreement runs on the device that suits the process group's backend: CPU on gloo, CUDA on NCCL.

World size 1 is enough to prove the device choice: the collective itself runs (``_all_max``), and a
tensor on the wrong device makes the backend raise.
"""

import pytest
import torch
import torch.distributed as dist

from lightning_asyncckpt.collectives import Agreement, control_device


@pytest.fixture
def world_of_one(tmp_path, request):
    backend = request.param
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        pytest.skip("NCCL needs a CUDA device")
    if backend == "nccl":
        torch.cuda.set_device(0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world_of_one", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)], indirect=True
)
def test_agreement_tensors_live_where_the_backend_wants_them(world_of_one):
    expected = "cuda" if world_of_one == "nccl" else "cpu"
    assert control_device().type == expected
    agreement = Agreement()
    assert agreement._all_max([3, -1, 7]) == [3, -1, 7]
    assert agreement.all_gather({"rank": 0}) == [{"rank": 0}]


@pytest.mark.gpu
def test_a_gloo_group_on_a_gpu_machine_still_agrees_on_the_cpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert control_device().type == "cpu"
        assert Agreement()._all_max([1]) == [1]
    finally:
        dist.destroy_process_group()


def test_a_group_of_a_destroyed_process_group_is_not_used_again(tmp_path):
    """The exit group outlives a process group that a script destroys and makes anew (a second Trainer):
    it must then be made again, not used."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s1"), 1), rank=0, world_size=1)
    exit_side = Agreement().exit_side(5.0)
    assert exit_side.group_alive()
    dist.destroy_process_group()
    assert not exit_side.group_alive()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s2"), 1), rank=0, world_size=1)
    try:
        assert Agreement().group_alive()
        assert not exit_side.group_alive() and not exit_side.active
    finally:
        dist.destroy_process_group()
