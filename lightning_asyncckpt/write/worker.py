"""The writer process itself (spawned or forked): its entry points, its CPU priority, and how it reports
a write's outcome to the trainer. The jobs it runs are ``dcp_writer`` and ``torch_file``.

Kept free of Lightning imports so that a spawned worker starts fast. The worker reports its outcome
through a small result file in a private directory (never on the checkpoint's filesystem, which may
be full), written atomically; a worker that dies writes nothing, which the trainer reads as a failure.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import gc
import os
import pickle
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING

from lightning_asyncckpt.errors import RankFailure
from lightning_asyncckpt.write import parent_watch

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.synchronize import Event

    import torch

    Target = Callable[..., object] | tuple[str, str]  # a function, or its (module, qualified name)


def describe_failure(exc: BaseException, buckets: list) -> dict[str, object]:
    """(writer) A failed write as a report: the error's type, message and errno; where the error dropped
    its OS cause, the cause the target directory shows (a disk full, the directory gone)."""
    failure = RankFailure.from_exception(0, exc)
    out = {"error_type": failure.error_type, "message": failure.message, "errno": failure.errno}
    if failure.errno is None:
        out.update(_diagnose_os_cause(buckets, failure.message))
    return out


def _diagnose_os_cause(buckets: list, message: str) -> dict[str, object]:
    """torch.save's stream writer reports a failed write as ``RuntimeError: unexpected pos ...`` and
    drops the OS error. Look at the target directory to name the real cause."""
    if not buckets:
        return {}
    shard_dir = os.path.dirname(buckets[0][0])
    if not os.path.isdir(shard_dir):
        return {"error_type": "FileNotFoundError", "errno": errno.ENOENT,
                "message": f"the checkpoint directory {shard_dir} disappeared during the write ({message})"}
    try:
        st = os.statvfs(shard_dir)
    except OSError:
        return {}
    if st.f_bavail * st.f_frsize < 1 << 20:
        return {"error_type": "OSError", "errno": errno.ENOSPC,
                "message": f"No space left on device while writing {shard_dir} ({message})"}
    return {}


# The staging buffers come with every job as shared-memory handles, and torch maps a handle anew unless a
# storage of the same shared-memory file is still alive in this process (its sharing cache, keyed by the
# file). Megatron-Core's loop drops each job before the next one arrives: every save mapped the whole
# staging copy again and faulted it in page by page, 16k more page faults and twice the system CPU per GiB
# than nvidia-resiliency-ext's loop, which happens to keep the last job alive (benchmarks/worker_cpu.py).
# Keeping the storages of the last jobs here (two: eager saves alternate between two staging copies when
# writes overlap) makes every later job of the same buffers a cache hit. They are the trainer's own
# buffers, so nothing is copied; a set the trainer drops stays mapped here until two more jobs came.
_MAPPED: collections.deque = collections.deque(maxlen=2)


def keep_mapped(tensors: Iterable[torch.Tensor]) -> None:
    """(writer, at the start of each job) Keeps the job's staged storages mapped for the jobs after it."""
    _MAPPED.append([t.untyped_storage() for t in tensors])


def report(result_path: str, outcome: dict[str, object], t0: float) -> None:
    """Tells the trainer how a write went: ``outcome`` with the write's time and this process's pid,
    written whole (temp file, then rename), so that the trainer never reads half a report."""
    outcome["write_s"] = time.monotonic() - t0
    outcome["pid"] = os.getpid()
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)


def run_forked(started_fd: int, fn: Target, args: tuple, kwargs: dict, nice: int = 0, trainer_pid: int | None = None,
               scratch_dir: str | None = None) -> None:
    """Entry point of a fork-per-save writer: first tells the trainer it runs (it got past ``fork``),
    then runs ``fn`` at CPU priority ``nice`` (:func:`lower_priority`), ending early if the trainer
    ``trainer_pid`` exits first (:func:`parent_watch.exit_with`)."""
    before_start()
    os.write(started_fd, b"1")
    os.close(started_fd)
    if trainer_pid is not None:
        parent_watch.exit_with(trainer_pid, scratch_dir)
    lower_priority(nice)
    fn(*args, **kwargs)


def lower_priority(nice: int) -> None:
    """(writer) Runs this process, and the threads it starts from now on, at nice value ``nice`` or lower
    priority: where the trainer's threads keep every core busy, the scheduler gives them the CPU first,
    and the write uses what they leave (the GPU waits, data loading, Python between kernels). A write
    still progresses beside them (nice 10 gets about a tenth of a contended core), never stops. Nice only
    rises here, which needs no privilege; a process already at ``nice`` or above is left as it is."""
    current = os.nice(0)
    if nice > current:
        os.nice(nice - current)


def before_start() -> None:
    """(forked writer) Nothing; a test makes it hang, as a fork of a multi-threaded process can."""


def engine_loop(loop_fn: Target, preload: tuple, ready: Event, nice: int = 0, trainer_pid: int | None = None,
                scratch_dir: str | None = None, failed: Connection | None = None, **kwargs: object) -> None:
    """Entry point of the persistent worker: the engine's own loop, made to run without CUDA, at CPU
    priority ``nice`` (:func:`lower_priority`), until the trainer asks it to stop or the trainer
    ``trainer_pid`` is gone (:func:`parent_watch.exit_with`: then ``scratch_dir`` is removed too).

    ``preload`` names modules the write jobs need; importing them here, while training has not
    reached its first save, keeps that cost out of the first save. ``loop_fn``: the loop, or its
    ``(module, qualified name)``. Anything that fails before the worker is ready is sent through the
    connection ``failed`` (the trainer's error names it), then raised.
    """
    try:
        loop_fn = _start(loop_fn, preload, nice, trainer_pid, scratch_dir)
    except BaseException as e:
        if failed is not None:
            with contextlib.suppress(Exception):
                failed.send(_cause(e))
        raise
    finally:
        if failed is not None:
            failed.close()
    ready.set()
    loop_fn(**kwargs)


def _start(loop_fn: Target, preload: tuple, nice: int, trainer_pid: int | None,
           scratch_dir: str | None) -> Callable[..., object]:
    import importlib

    if trainer_pid is not None:
        parent_watch.exit_with(trainer_pid, scratch_dir)
    # The writer only reads host memory. Hiding the GPUs keeps it from creating a CUDA context (hundreds
    # of MB of device memory per rank) when an engine's loop pins a device, and runs it the same way on
    # GPU machines as on CPU ones. CUDA reads this at its first use, which has not happened yet.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    lower_priority(nice)
    import torch

    loop_fn = resolve(loop_fn)
    for name in preload:
        importlib.import_module(name)
    # Megatron-Core's loop runs a full gc.collect() after every save: with torch and its own imports in the
    # heap that scan costs about 0.25 CPU-seconds, taken from the training's cores once per save. Frozen
    # here, the startup heap is left out of every collection, which then scans only what the jobs made.
    gc.collect()
    gc.freeze()
    _one_unused_device(torch)
    return loop_fn


def _one_unused_device(torch: ModuleType) -> None:
    """(the persistent writer process, at its start) Replaces two functions of this process's ``torch.cuda``:
    Megatron-Core's loop pins ``rank % device_count()`` first, a ZeroDivisionError without CUDA. This process
    only writes files (its GPUs are hidden), so it may pretend to have one device it never uses."""
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_a, **_k: None


def resolve(fn: Target) -> Callable[..., object]:
    """A function given as ``(module, qualified name)``, imported; anything else as it is."""
    if not isinstance(fn, tuple):
        return fn
    import importlib

    module, qualname = fn
    found: object = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def _cause(e: BaseException) -> str:
    """An exception as one line: its type and message, and where it was raised."""
    import traceback

    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ is not None else []
    at = f" (at {where[0].filename}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {e}{at}"
