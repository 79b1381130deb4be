"""The job that writes this rank's part of a DCP directory: the shards through the engine's own
``write_preloaded_data``, the small files beside them, an upload where the directory is remote, then
the report. Runs in the writer process (no Lightning imports).
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from lightning_asyncckpt.faults.policy import after_write
from lightning_asyncckpt.storage import remote
from lightning_asyncckpt.write import fast_file
from lightning_asyncckpt.write import gate as _gate
from lightning_asyncckpt.write.jobs import DcpJob
from lightning_asyncckpt.write.worker import describe_failure, keep_mapped, report

if TYPE_CHECKING:
    import inspect


def write_call_kwargs(params: Mapping[str, inspect.Parameter], transforms: list, idx: int, bucket: tuple,
                      outcomes: queue.Queue, count: queue.Queue, open_file: Callable[..., object] = open) -> dict:
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
def _engine_open(writer_cls: type, params: Mapping[str, inspect.Parameter], opener: Callable[..., object]) -> Iterator[None]:
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

    The engine writes each shard through the file :func:`fast_file.shard_opener` gives: its tensor bytes go from the
    staged copies to the disk with ``O_DIRECT``, never through the page cache (whose copy and writeback
    cost 1.5 to 3.5 CPU-seconds per GiB on the machines measured; ``benchmarks/results/findings-profile-write.md``), and each
    item's CRC32 is computed by ISA-L rather than inside ``torch.save``. The engine's code, items, offsets
    and results are its own; only the file object is ours."""
    import inspect

    outcomes: queue.Queue[tuple[int, object]] = queue.Queue()
    params = inspect.signature(writer_cls.write_preloaded_data).parameters
    # a bucket is (file, storage key, (bytes_data, tensor_data)); its tensors are the staged copies
    opener = fast_file.shard_opener(buckets)

    def run(i: int, bucket: tuple) -> None:
        count: queue.Queue = queue.Queue()
        count.put(i)
        try:  # fast: torch.save's CRC32 off (a per-thread setting), each archive gets its CRC32 from the shard file
            with fast_file.shard_crc(transforms):
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


def write_job(job: DcpJob) -> None:
    """(writer) The async function handed to the engine's queue: waits at the job's gate (a lazy snapshot
    being copied, :mod:`lightning_asyncckpt.write.gate`), writes the shards and the small extra files (such as
    a sharded checkpoint's ``meta.pt``), uploads them where the directory is remote
    (``remote.upload_dir``), then reports."""
    t0, buckets, hook = time.monotonic(), job.buckets, job.hook
    keep_mapped(t for b in buckets for _, t in b[2][1])
    try:
        if job.gate is not None:
            _gate.wait(*job.gate)
            t0 = time.monotonic()  # the write's own time counts from the moment its bytes may be read
        if hook is not None:
            hook(buckets)
        outcome: dict[str, object] = {"ok": True, "results": _write_all(job.writer_cls, job.transforms, buckets)}
        for path, data in job.extra_files:
            _write_file(path, data)
        if job.upload is not None:
            remote.upload_dir(*job.upload)
        if hook is not None:
            after_write(hook, buckets)
    except BaseException as e:  # noqa: BLE001
        outcome = {"ok": False, **describe_failure(e, buckets)}
    report(job.result_path, outcome, t0)
    # Each write leaves reference cycles (torch.save of tensors rebuilt from shared memory). In a
    # long-lived worker they are otherwise only freed by a rare full collection, and memory grows by
    # kilobytes per save; collecting the young generations (well under a millisecond) frees them.
    gc.collect(1)
