"""Real checkpoints for the ``lightning-asyncckpt`` command's tests (``test_cli*.py``): written once per test
module by ``AsyncCheckpointIO`` and ``torch.save``, and copied before a test damages one."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import clone_tree
from lightning_asyncckpt import AsyncCheckpointIO


def _checkpoint(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {
            "layer.weight": torch.randn(64, 32, generator=g) * scale,
            "layer.bias": torch.randn(64, generator=g).to(torch.bfloat16),
            "head.weight": torch.randn(10, 64, generator=g),
            "head.bias": torch.zeros(10, dtype=torch.float16),
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(64, 16, generator=g)}},
                "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}],
            }
        ],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 3}}}},
        "hyper_parameters": {"width": 64, "names": ["a", "b"]},
    }


def _save_dir(ckpt: dict, path: Path, thread_count: int = 2) -> None:
    io = AsyncCheckpointIO(worker="fork", thread_count=thread_count, format="dcp")
    try:
        io.save_checkpoint(ckpt, path)
        io.finalize(blocking=True)
    finally:
        io.teardown()


@pytest.fixture(scope="module", name="ckpts")
def ckpts_fixture(tmp_path_factory):
    """Real checkpoints, written once for the module: a single-writer directory (two shard files), a sharded
    one (``meta.pt``), a stock DCP one without CRC32 records, and a plain ``torch.save`` file."""
    root = tmp_path_factory.mktemp("cli")
    ckpt = _checkpoint()
    _save_dir(clone_tree(ckpt), root / "single.ckpt")
    # stock DCP, written in this thread without CRC32 records (the option does not reach the library's
    # writer threads: its checkpoints have CRCs)
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        state = {"state_dict": clone_tree(ckpt["state_dict"]), "global_step": 120, "epoch": 3}
        dcp.save(state, checkpoint_id=root / "nocrc.ckpt", no_dist=True)
    finally:
        torch.serialization.set_crc32_options(crc)
    sharded_state = {"model": {"w": torch.randn(8, 4)}, "optimizer": {"state": {"w": {"exp_avg": torch.ones(8, 4)}}}}
    meta = {"global_step": 7, "epoch": 1, "loops": {}}
    io = AsyncCheckpointIO(worker="fork")
    try:
        io.save_checkpoint_sharded(clone_tree(sharded_state), root / "sharded.ckpt", meta=meta)
        io.finalize(blocking=True)
    finally:
        io.teardown()
    torch.save(_checkpoint(scale=2.0), root / "plain.ckpt")
    return SimpleNamespace(
        root=root, ckpt=ckpt, single=root / "single.ckpt", nocrc=root / "nocrc.ckpt",
        sharded=root / "sharded.ckpt", sharded_state=sharded_state, meta=meta, plain=root / "plain.ckpt",
    )


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
