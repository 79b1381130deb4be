"""How the writer processes run, seen from inside the real write. ``AsyncCheckpointIO(worker_nice=...)``: the
writer processes (persistent worker, forked writer) run at that nice value; the trainer's own priority
never changes. The persistent worker's startup heap is frozen out of garbage collection, and it keeps the
staging buffers mapped from one save to the next."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

import helpers
from helpers import ROOT, TESTS, RecordGcFreeze, RecordImported, RecordPriority
from lightning_asyncckpt import AsyncCheckpointIO


def _written_at(tmp_path, **options) -> list[tuple[int, int]]:
    record = tmp_path / "priority.txt"
    with AsyncCheckpointIO("nvrx", **options) as io:
        io.write_hook = RecordPriority(str(record))
        for i in range(2):
            io.save_checkpoint({"w": torch.randn(1000), "step": i}, tmp_path / f"s{i}.ckpt")
            io.finalize(blocking=True)
    assert torch.load(tmp_path / "s1.ckpt", weights_only=True)["step"] == 1
    return [tuple(map(int, line.split())) for line in record.read_text().splitlines()]


# the persistent worker at 12, not 19: it imports torch and writes at that priority, and beside the other
# pytest processes of `make test` a worker at 19 took 33 s to do so (12: a value other than the default 10)
@pytest.mark.parametrize("worker, nice", [("persistent", None), ("persistent", 12), ("fork", 19),
                                          pytest.param("fork", None, marks=pytest.mark.slow),
                                          pytest.param("persistent", 0, marks=pytest.mark.slow)],
                         ids=["persistent-default", "persistent-12", "fork-19", "fork-default", "persistent-0"])
def test_writers_run_at_the_nice_value_given(tmp_path, worker, nice):
    before = os.nice(0)
    options = {} if nice is None else {"worker_nice": nice}
    seen = _written_at(tmp_path, worker=worker, **options)
    assert len(seen) == 2 and all(pid != os.getpid() for pid, _ in seen)
    assert {n for _, n in seen} == {max(before, 0 if nice is None else nice)}
    assert os.nice(0) == before  # the trainer's priority is left alone


@pytest.mark.slow
def test_a_trainer_already_at_lower_priority_keeps_its_writers_there(tmp_path):
    """Nice only rises: writers of a trainer started with ``nice -n 15`` stay at 15, not 10."""
    code = (
        "import os, sys, pathlib; os.nice(15);"
        "import test_worker_priority as t; print(t._written_at(pathlib.Path(sys.argv[1]), worker='persistent', worker_nice=10))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])  # the (pid, nice) pairs the child printed
    assert [n for _, n in seen] == [15, 15]


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True, "10"])
def test_a_bad_nice_value_is_refused_at_construction(bad):
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO\(worker_nice=.*from 0 .* to 19"):
        AsyncCheckpointIO("nvrx", worker_nice=bad)


def test_the_persistent_workers_startup_heap_is_left_out_of_every_collection(tmp_path):
    """Megatron-Core's loop runs a full ``gc.collect()`` after each save; with torch and Megatron-Core's
    imports in the heap that was 0.25 CPU-seconds per save. The worker freezes its startup heap, so that
    the collection scans only what the jobs made."""
    record = tmp_path / "frozen.txt"
    with AsyncCheckpointIO("mcore", worker="persistent") as io:
        io.write_hook = RecordGcFreeze(str(record))
        for i in range(2):
            io.save_checkpoint({"w": torch.randn(1000), "step": i}, tmp_path / f"s{i}.ckpt")
            io.finalize(blocking=True)
    frozen = [int(line) for line in record.read_text().splitlines()]
    assert len(frozen) == 2 and all(n > 100_000 for n in frozen), frozen  # torch's own objects alone are more


def test_the_worker_of_a_trainer_that_saves_files_never_imports_dcp_and_a_users_warmup_readies_it(tmp_path):
    """The callback starts the worker at the start of fit. Where every save is one ``torch.save`` file (a
    single writer), the worker never imports ``torch.distributed.checkpoint`` (0.6 CPU-seconds in every
    rank's worker, taken from the training's cores); a user's ``warmup``, before any save says what kind
    it is, imports it ahead of the first DCP save as before."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    dcp = "torch.distributed.checkpoint"
    record = tmp_path / "trainer.txt"
    io = AsyncCheckpointIO("nvrx")
    io.write_hook = RecordImported(str(record), dcp)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    helpers.trainer(tmp_path, [io], [ckpt], max_steps=4).fit(helpers.TinyModel(width=8), helpers.loader(width=8))
    assert record.read_text().split() == ["False", "False"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]

    record = tmp_path / "warmup.txt"
    with AsyncCheckpointIO("nvrx") as io:
        io.write_hook = RecordImported(str(record), dcp)
        io.warmup()
        io.save_checkpoint({"w": torch.randn(10)}, tmp_path / "user.ckpt")
        io.finalize(blocking=True)
    assert record.read_text().split() == ["True"]


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _faults_of_a_repeated_save(folder, engine: str, mib: int) -> int:
    """The persistent worker's minor page faults over a save of ``mib`` MiB whose buffers it wrote before."""
    state = {"w": [torch.randn(mib << 16) for _ in range(4)], "step": 0}  # 4 tensors of mib / 4 MiB
    with AsyncCheckpointIO(engine, worker="persistent") as io:
        for i in range(3):
            if i == 2:
                (pid,) = io.session.worker_pids()
                before = _minor_faults(pid)
            io.save_checkpoint(state, folder / f"s{i}.ckpt")
            io.finalize(blocking=True)
        return _minor_faults(pid) - before


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads page faults from /proc")
# Megatron-Core's loop is the one that dropped each job (see the docstring), so its run stays in `make test`;
# nvrx's (about 19 s on 2 cores) is in `make test-all`, to keep `make test` under 15 minutes
@pytest.mark.parametrize("engine", [pytest.param("nvrx", marks=pytest.mark.slow), "mcore"])
def test_a_repeated_save_maps_nothing_new_in_the_worker(tmp_path, engine):
    """The staging buffers reach the worker as shared-memory handles with every job; torch maps a handle anew
    unless the same buffer is still alive in the worker. Megatron-Core's loop dropped each job before the
    next, so every save mapped and faulted in the whole staging copy again (twice nvrx's system CPU per GiB).
    The worker's faults per save must not grow with the state once its buffers were written."""
    (tmp_path / "small").mkdir()
    (tmp_path / "big").mkdir()
    small = _faults_of_a_repeated_save(tmp_path / "small", engine, 32)
    big = _faults_of_a_repeated_save(tmp_path / "big", engine, 160)
    blocks = (128 << 20) // 65536  # the 64 KiB blocks a shared mapping of the extra 128 MiB faults in at least
    assert big - small < blocks // 2, (small, big)
