"""A 2-rank Fabric DDP job (gloo, CPU) driving ``AsyncCheckpointIO``'s collective saves directly, for the
cross-rank protocol's edge cases in tests/test_pipeline.py. Each rank writes <out>/rank<r>.json."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch

from helpers import run_fabric_case
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError, testing
from lightning_asyncckpt.faults.injected import EnvironmentFaults
from lightning_asyncckpt.faults.policy import SaveFaults
from lightning_asyncckpt.storage import commit
from processes import job_args


def _state(value: float) -> dict:
    return {"w": torch.full((64, 64), value), "b": torch.full((64,), value), "global_step": int(value)}


def _names(out: Path) -> list[str]:
    return sorted(os.listdir(out)) if out.is_dir() else []


def case_earlier_commits(args, fabric, io, report):
    """Save 1 is written by both ranks; save 2 fails on rank 1 alone at save time (``args.stage``: before
    the snapshot, or at the handover after the ranks planned it). Save 1 still commits; save 2 is raised
    on both ranks; nothing of save 2 is left."""
    ckpts = Path(args.out) / "ckpts"
    io.save_checkpoint_distributed(_state(1.0), ckpts / "one.ckpt")
    with testing.inject_faults(testing.Fault(args.stage, ranks=[1], saves=[2])):
        io.save_checkpoint_distributed(_state(2.0), ckpts / "two.ckpt")
    try:
        io.finalize(blocking=True)
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"path": e.path, "ranks": list(e.ranks), "message": str(e)}
    report["one_committed"] = commit.is_complete(ckpts / "one.ckpt")
    io.teardown()
    report["entries"] = _names(ckpts)


def case_warmup_on_some_ranks(args, fabric, io, report):
    """``warmup`` is local: called on rank 0 alone between two collective saves, the next save still
    lands (the ranks' names for its directory must not diverge)."""
    ckpts = Path(args.out) / "ckpts"
    io.save_checkpoint_distributed(_state(1.0), ckpts / "one.ckpt")
    io.finalize(blocking=True)
    if fabric.global_rank == 0:
        io.warmup()
    io.save_checkpoint_distributed(_state(2.0), ckpts / "two.ckpt")
    io.finalize(blocking=True)
    report["two_committed"] = commit.is_complete(ckpts / "two.ckpt")
    report["two_w"] = io.load_checkpoint(ckpts / "two.ckpt")["w"].mean().item()
    io.teardown()
    report["entries"] = _names(ckpts)


class InterruptCommit(EnvironmentFaults):
    """Ctrl-C lands on the coordinator while it commits (before ``.metadata``), between the gathers."""

    fired = False

    def for_save(self, rank, save, engine, worker):
        return SaveFaults(before_metadata=self._interrupt) if rank == 0 else super().for_save(rank, save, engine, worker)

    @staticmethod
    def _interrupt(path):
        InterruptCommit.fired = True
        raise KeyboardInterrupt(f"interrupted while committing {path}")


def case_drain_interrupted(args, fabric, io, report):
    """Both ranks leave through ``abort`` with a collective save in flight; the coordinator is interrupted
    in the middle of committing it, and rank 1 then waits for it in vain (the exit group gives up). The
    save's directory is removed: nothing partial stays beside the checkpoints."""
    ckpts = Path(args.out) / "ckpts"
    io.faults = InterruptCommit()
    io.save_checkpoint_distributed(_state(1.0), ckpts / "one.ckpt")
    io.session.wait_for_local_writes()  # both parts written: the drain goes on to commit it
    io.abort()
    report["interrupted"] = InterruptCommit.fired
    fabric.barrier()
    report["entries"] = _names(ckpts)


def main():
    args = job_args(extra=("--stage",))
    io = AsyncCheckpointIO(args.engine, worker=args.worker, drain_timeout_s=5)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    run_fabric_case(args, fabric, io, globals())


if __name__ == "__main__":
    main()
