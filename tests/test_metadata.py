"""``.metadata`` is read by one restricted unpickler: loading with ``weights_only=True`` (or unset) runs no
code from the file; legitimate checkpoints (this library's, stock DCP's, FSDP2's) still load."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.format import dcp as dcp_format


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def crafted(tmp_path):
    """A stock DCP checkpoint whose ``.metadata`` would create ``marker`` when unpickled without restriction."""
    path = tmp_path / "a.ckpt"
    dcp.save({"w": torch.randn(4, 2), "step": 3}, checkpoint_id=path, no_dist=True)
    metadata = dcp_format.read_metadata(path)
    marker = tmp_path / "code-ran"
    metadata.planner_data = _RunsCode(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return path, marker


@pytest.mark.parametrize("weights_only", [True, None])
def test_load_checkpoint_refuses_metadata_that_would_run_code(crafted, weights_only):
    path, marker = crafted
    with pytest.raises(pickle.UnpicklingError, match=rf"cannot read {path / '.metadata'}: it references posix\.mkdir"):
        AsyncCheckpointIO().load_checkpoint(path, weights_only=weights_only)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        dcp_format.load(path, weights_only=weights_only)
    assert not marker.exists()


def test_weights_only_false_reads_it_unrestricted(crafted):
    path, marker = crafted
    assert dcp_format.load(path, weights_only=False)["step"] == 3
    assert marker.exists()  # as torch.load(weights_only=False) would: only for trusted checkpoints


def test_stock_and_library_checkpoints_load_with_weights_only(tmp_path):
    w = torch.randn(4, 2)
    dcp.save({"model": {"w": w}, "step": 3}, checkpoint_id=tmp_path / "stock", no_dist=True)
    assert torch.equal(dcp_format.load(tmp_path / "stock", weights_only=True)["model"]["w"], w)
    io = AsyncCheckpointIO(worker="fork")
    try:
        io.save_checkpoint({"state_dict": {"w": w.to(torch.bfloat16)}, "epoch": 1}, tmp_path / "lib")
        io.save_checkpoint_sharded({"model": {"w": w}}, tmp_path / "sharded", meta={"global_step": 1})
        io.finalize(blocking=True)
        assert io.load_checkpoint(tmp_path / "lib", weights_only=True)["epoch"] == 1
        loaded = io.load_checkpoint(tmp_path / "sharded", weights_only=True)
        assert torch.equal(loaded["model"]["w"], w) and loaded["global_step"] == 1
    finally:
        io.teardown()


def test_fsdp2_checkpoint_metadata_is_allowed(tmp_path):
    """An FSDP2 (DTensor) model's and optimizer's state, saved by stock DCP in a one-process group."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from processes import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "fsdp2")
    finally:
        dist.destroy_process_group()
    loaded = dcp_format.load(tmp_path / "fsdp2", weights_only=True)
    assert torch.equal(loaded["model"]["0.weight"], msd["0.weight"].full_tensor())
