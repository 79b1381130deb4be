"""Code that runs inside the background worker process (spawned or forked).

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
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from lightning_asyncckpt import direct_io, parent_watch, remote, shard_file
from lightning_asyncckpt import gate as _gate
from lightning_asyncckpt.errors import RankFailure
from lightning_asyncckpt.faults import after_write


def _describe(exc: BaseException, buckets: list) -> dict[str, Any]:
    failure = RankFailure.from_exception(0, exc)
    out = {"error_type": failure.error_type, "message": failure.message, "errno": failure.errno}
    if failure.errno is None:
        out.update(_diagnose_os_cause(buckets, failure.message))
    return out


def _diagnose_os_cause(buckets: list, message: str) -> dict[str, Any]:
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


def keep_mapped(tensors: Iterable[Any]) -> None:
    """(writer, at the start of each job) Keeps the job's staged storages mapped for the jobs after it."""
    _MAPPED.append([t.untyped_storage() for t in tensors])


def write_call_kwargs(params: Any, transforms: list, idx: int, bucket: Any, outcomes: Any, count: Any,
                      open_file: Any = open) -> dict:
    """Keyword arguments for the engine's ``write_preloaded_data``, whose signature differs by version:

    - nvrx 0.4.1, Megatron-Core: ``(transform_list, local_proc_idx, write_bucket, results_queue,
      count_queue, use_fsync, **kwargs)``;
    - nvrx 0.5: ``open_file`` is added after ``transform_list``; 0.6 and 0.7 rename ``local_proc_idx``
      to ``local_thread_idx``.

    ``params`` is the function's ``inspect.signature(...).parameters``. Raises for a required parameter
    we do not know, rather than passing a value in the wrong place.
    """
    known = {
        "transform_list": transforms,
        "open_file": open_file,
        "local_proc_idx": idx,
        "local_thread_idx": idx,
        "write_bucket": bucket,
        "results_queue": outcomes,
        "count_queue": count,
        "use_fsync": True,
    }
    kwargs = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in known:
            kwargs[name] = known[name]
        elif p.default is p.empty:
            raise RuntimeError(f"unsupported engine version: write_preloaded_data needs {name!r}")
    return kwargs


@contextlib.contextmanager
def _engine_open(writer_cls: type, params: Any, opener: Any) -> Iterator[None]:
    """Engines whose ``write_preloaded_data`` takes no ``open_file`` (nvrx 0.4.1, Megatron-Core) open the
    shard with their module's ``open``: it is ``opener`` for the duration of the write (this process runs
    one write at a time). ``opener`` opens any file it does not know with the builtin ``open``."""
    module = sys.modules[writer_cls.__module__]
    if "open_file" in params or getattr(module, "open", open) is not open:
        yield
        return
    module.open = opener
    try:
        yield
    finally:
        del module.open


def _write_all(writer_cls: type, transforms: list, buckets: list) -> list:
    """Writes every bucket with the engine's ``write_preloaded_data``, one thread per shard file.

    The engine writes each shard through a :class:`shard_file.ShardFile`: its tensor bytes go from the
    staged copies to the disk with ``O_DIRECT``, never through the page cache (whose copy and writeback
    cost 1.5 to 3.5 CPU-seconds per GiB on the machines measured; ``benchmarks/README.md``), and each
    item's CRC32 is computed by ISA-L rather than inside ``torch.save``. The engine's code, items, offsets
    and results are its own; only the file object is ours."""
    import inspect

    outcomes: queue.Queue[tuple[int, Any]] = queue.Queue()
    params = inspect.signature(writer_cls.write_preloaded_data).parameters
    # a bucket is (file, storage key, (bytes_data, tensor_data)); its tensors are the staged copies
    opener = direct_io.Opener({b[0]: direct_io.storage_regions(t for _, t in b[2][1]) for b in buckets},
                              shard_file.ShardFile)

    def run(i: int, bucket: Any) -> None:
        count: queue.Queue = queue.Queue()
        count.put(i)
        try:  # torch.save's CRC32 off (a per-thread setting): each archive gets its CRC32 from ShardFile
            with shard_file.crc32_off_for(transforms):
                writer_cls.write_preloaded_data(**write_call_kwargs(params, transforms, i, bucket, outcomes, count, opener))
        except BaseException as e:  # noqa: BLE001 - reported as a value, raised by the trainer
            outcomes.put((i, e))

    threads = [threading.Thread(target=run, args=(i, b), daemon=True) for i, b in enumerate(buckets)]
    with _engine_open(writer_cls, params, opener):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    results: list = []
    by_idx = dict(outcomes.get() for _ in range(outcomes.qsize()))
    for i in range(len(buckets)):
        out = by_idx.get(i)
        if isinstance(out, BaseException):
            raise out
        if out is None:
            raise RuntimeError(f"shard writer {i} reported no result")
        results.extend(out)
    return results


def _write_file(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_job(
    writer_cls: type, transforms: list, buckets: list, result_path: str, hook: Any | None = None,
    extra_files: list | tuple = (), upload: tuple[str, str] | None = None, gate: tuple[str, float] | None = None,
) -> None:
    """The async function handed to the engine's queue: writes the shards (and small extra files,
    such as a sharded checkpoint's ``meta.pt``), then reports. ``upload``: ``(local dir, url)``, the
    written files go to the object store (``remote.upload_dir``) before the report. ``gate``:
    ``(path, timeout_s)``, waited at first (:mod:`lightning_asyncckpt.gate`: a lazy snapshot being copied)."""
    t0 = time.monotonic()
    keep_mapped(t for b in buckets for _, t in b[2][1])
    try:
        if gate is not None:
            _gate.wait(*gate)
            t0 = time.monotonic()  # the write's own time counts from the moment its bytes may be read
        if hook is not None:
            hook(buckets)
        outcome: dict[str, Any] = {"ok": True, "results": _write_all(writer_cls, transforms, buckets)}
        for path, data in extra_files:
            _write_file(path, data)
        if upload is not None:
            remote.upload_dir(*upload)
        if hook is not None:
            after_write(hook, buckets)
    except BaseException as e:  # noqa: BLE001
        outcome = {"ok": False, **_describe(e, buckets)}
    report(result_path, outcome, t0)
    # Each write leaves reference cycles (torch.save of tensors rebuilt from shared memory). In a
    # long-lived worker they are otherwise only freed by a rare full collection, and memory grows by
    # kilobytes per save; collecting the young generations (well under a millisecond) frees them.
    gc.collect(1)


def report(result_path: str, outcome: dict[str, Any], t0: float) -> None:
    """Tells the trainer how a write went: ``outcome`` with the write's time and this process's pid,
    written whole (temp file, then rename), so that the trainer never reads half a report."""
    outcome["write_s"] = time.monotonic() - t0
    outcome["pid"] = os.getpid()
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)


def run_forked(started_fd: int, fn: Any, args: tuple, kwargs: dict, nice: int = 0, trainer_pid: int | None = None,
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


def engine_loop(loop_fn: Any, preload: tuple, ready: Any, nice: int = 0, trainer_pid: int | None = None,
                scratch_dir: str | None = None, **kwargs: Any) -> None:
    """Entry point of the persistent worker: the engine's own loop, made to run without CUDA, at CPU
    priority ``nice`` (:func:`lower_priority`), until the trainer asks it to stop or the trainer
    ``trainer_pid`` is gone (:func:`parent_watch.exit_with`: then ``scratch_dir`` is removed too).

    ``preload`` names modules the write jobs need; importing them here, while training has not
    reached its first save, keeps that cost out of the first save.
    """
    import importlib

    if trainer_pid is not None:
        parent_watch.exit_with(trainer_pid, scratch_dir)
    # The writer only reads host memory. Hiding the GPUs keeps it from creating a CUDA context (hundreds
    # of MB of device memory per rank) when an engine's loop pins a device, and runs it the same way on
    # GPU machines as on CPU ones. CUDA reads this at its first use, which has not happened yet.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    lower_priority(nice)
    import torch

    for name in preload:
        importlib.import_module(name)
    # Megatron-Core's loop runs a full gc.collect() after every save: with torch and its own imports in the
    # heap that scan costs about 0.25 CPU-seconds, taken from the training's cores once per save. Frozen
    # here, the startup heap is left out of every collection, which then scans only what the jobs made.
    gc.collect()
    gc.freeze()
    ready.set()

    # Megatron-Core's loop pins `rank % device_count()` first: a ZeroDivisionError without CUDA.
    # This process only writes files, so it may pretend to have one device it never uses.
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *_a, **_k: None
    loop_fn(**kwargs)
