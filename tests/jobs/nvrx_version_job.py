"""Run with a newer nvidia-resiliency-ext first on PYTHONPATH (see scripts/nvrx_versions.sh): saves and
loads with both workers, then a real ENOSPC through that version's writer. Writes its ``reports.RankReport``
to ``<out>/rank0.json``. Its test starts it with ``PYTHONWARNINGS=ignore``: that release's import-time
warnings stay out of its log."""

import json
import sys
from pathlib import Path

import torch

from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError
from lightning_asyncckpt.engines.base import engine_version
from reports import RankReport, report_path, reported


def main() -> None:
    out, full = Path(sys.argv[1]), (Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None)
    reported(0, report_path(out, 0), lambda report: run(out, full, report))


def run(out: Path, full: Path | None, report: RankReport) -> None:
    import nvidia_resiliency_ext

    report["version"] = engine_version("nvidia-resiliency-ext")
    report["module"] = nvidia_resiliency_ext.__file__
    for worker in ("fork", "persistent"):
        # format="dcp": the directory layout goes through this release's own DCP writer (write_preloaded_data)
        io = AsyncCheckpointIO("nvrx", worker=worker, thread_count=2, timeout_s=120, format="dcp")
        ckpt = {"global_step": 3, "state_dict": {"w": torch.randn(64, 64), "b": torch.randn(3).bfloat16()},
                "hyper_parameters": {"a": [1, 2]}}
        try:
            io.save_checkpoint(ckpt, out / worker)
            ckpt["state_dict"]["w"].zero_()  # the save is a snapshot
            io.finalize(blocking=True)
            loaded = io.load_checkpoint(out / worker, weights_only=False)
            exact = (not torch.equal(loaded["state_dict"]["w"], ckpt["state_dict"]["w"])
                     and torch.equal(loaded["state_dict"]["b"], ckpt["state_dict"]["b"])
                     and loaded["hyper_parameters"] == {"a": [1, 2]})
            raised = None
            if full is not None:  # a real disk-full error, raised by this version's writer
                io.save_checkpoint({"state_dict": {"big": torch.ones(2 << 20)}}, full / f"{worker}.ckpt")
                try:
                    io.finalize(blocking=True)
                except CheckpointWriteError as e:
                    raised = e.errno
        finally:
            io.teardown()
        info = json.loads((out / worker / ".asyncckpt.json").read_text())
        report[worker] = {"exact": exact, "enospc_errno": raised, "engine_version": info["engine_version"]}


if __name__ == "__main__":
    main()
