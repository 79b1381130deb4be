"""The test harness itself (``processes.launch``): what a job leaves behind when its block ends."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from processes import launch

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
