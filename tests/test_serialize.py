"""``torch.save`` as stock calls it: once per save, in the training process, so that code patching it
(Lightning's own tests count checkpoints with ``mock.patch("torch.save")``) sees every save; a patch that
writes nothing breaks no checkpoint, with either worker (a forked writer inherits the patch)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightning_asyncckpt import AsyncCheckpointIO


@pytest.mark.parametrize("worker", ["persistent", "fork"])
def test_a_mocked_torch_save_counts_every_save_and_breaks_none(tmp_path, worker):
    with mock.patch("torch.save") as save_mock, AsyncCheckpointIO("nvrx", worker=worker) as io:
        io.save_checkpoint({"w": torch.ones(3), "step": 1}, tmp_path / "a.ckpt")
        io.save_checkpoint({"w": torch.full((3,), 2.0), "step": 2}, tmp_path / "b.ckpt")
        io.finalize(blocking=True)
        assert save_mock.call_count == 2
    for name, step in (("a.ckpt", 1), ("b.ckpt", 2)):
        loaded = torch.load(tmp_path / name, weights_only=True)
        assert loaded["step"] == step and torch.equal(loaded["w"], torch.full((3,), float(step)))
