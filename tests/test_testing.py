"""``lightning_asyncckpt.testing``'s write holds, against the real writer process."""

from __future__ import annotations

import torch

from lightning_asyncckpt import AsyncCheckpointIO, testing
from lightning_asyncckpt.storage import commit


def test_a_write_held_at_its_end_is_whole_on_disk_and_not_yet_committed(tmp_path):
    """``HoldWrite(at="end")`` holds the writer after its last byte and before its report: the hidden file
    is complete (it loads), the checkpoint is not at its path yet, and the release commits it."""
    hold = testing.HoldWrite(str(tmp_path / "release"), started_file=str(tmp_path / "written"), at="end", timeout_s=60)
    state = {"w": torch.arange(50_000, dtype=torch.float32), "step": 3}
    path = tmp_path / "c" / "a.ckpt"
    with AsyncCheckpointIO("nvrx", worker="persistent") as io:
        io.write_hook = hold
        io.save_checkpoint(state, path)
        hold.wait_started()
        io.finalize()  # not blocking: the held write has not reported
        assert not path.exists() and io.session.num_pending == 1
        hidden = [p for p in path.parent.iterdir() if commit.is_leftover(p.name)]
        assert len(hidden) == 1
        assert torch.equal(torch.load(hidden[0], weights_only=True)["w"], state["w"])
        hold.release()
        io.finalize(blocking=True)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
