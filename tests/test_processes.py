"""The test harness itself (``processes.launch``): what a job leaves behind when its block ends; the reports
its ranks write (``reports``): whole or not at all, and a crashed rank fails the test with its traceback."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import reports
from processes import launch, rank_reports
from reports import RankReport, read_report, report_path, reported

# A job that holds a spawn-context queue (its semaphores are named, in /dev/shm, and registered with the
# resource tracker this starts), reports their names, and then waits to be killed.
JOB = """
import json, multiprocessing as mp, sys, time
q = mp.get_context("spawn").Queue()
names = [lock._semlock.name for lock in (q._rlock, q._wlock, q._sem)]
open(sys.argv[1] + ".tmp", "w").write(json.dumps(names))
__import__("os").rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_a_job_killed_at_the_end_of_its_block_leaves_no_semaphore_in_dev_shm(tmp_path):
    ready = tmp_path / "names.json"
    with launch([sys.executable, "-c", JOB, str(ready)], tmp_path / "out", timeout=60) as job:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert job.running, job.log_text()[-3000:]
            assert time.monotonic() < deadline, "the job never reported its semaphores"
            time.sleep(0.05)
        names = json.loads(ready.read_text())
        assert all(Path("/dev/shm", f"sem.{n.lstrip('/')}").exists() for n in names)
    # the block has ended: the job is dead, and its resource tracker had the time to unlink what it left
    left = [n for n in names if Path("/dev/shm", f"sem.{n.lstrip('/')}").exists()]
    assert not left, f"semaphores left in /dev/shm by the killed job: {left}"


def test_a_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A writer that fails half way (a full disk) leaves the report before it as it was, and no temp file: a
    test that reads the report (or polls for it while a node is killed) never sees half of one."""
    path = report_path(tmp_path, 0)
    RankReport(rank=0, seen={"step": 1}).write(path)

    def half_then_full(obj, f, **kw):
        f.write('{"rank": 0, "se')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reports.json, "dump", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        RankReport(rank=0, seen={"step": 2}).write(path)
    assert read_report(path) == RankReport(rank=0, seen={"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]


def test_a_crashed_rank_fails_the_test_with_its_traceback(tmp_path):
    """``reported`` keeps what the rank saw before it raised, with the traceback and the world size, and
    ``rank_reports`` fails the test with that traceback."""
    def body(report):
        report["step"] = 3
        raise ValueError("boom at step 3")

    reported(0, report_path(tmp_path, 0), body, world_size=lambda: 2)
    (r,) = rank_reports(tmp_path, 1, lambda: "the log", crashed_ok=True)
    assert (r.rank, r.world_size, r["step"]) == (0, 2, 3) and "ValueError: boom at step 3" in r.crash
    with pytest.raises(AssertionError, match=r"(?s)rank 0 crashed:.*boom at step 3.*the log"):
        rank_reports(tmp_path, 1, lambda: "the log")
    with pytest.raises(AssertionError, match=r"(?s)rank 1 wrote no report.*the log"):
        rank_reports(tmp_path, 2, lambda: "the log", crashed_ok=True)
