"""The single-file checkpoint format: stock Lightning's one ``torch.save`` file, written by the worker.

Stock ``TorchCheckpointIO`` writes ``torch.save(checkpoint)`` at the checkpoint path. Here the
background writer rebuilds the same checkpoint dict from a snapshot (``staging.join`` of the skeleton
and the staged shared-memory copies) and ``torch.save``\\ s it into a hidden sibling of the final path
(``commit.tmp_for``, so that ``commit.cleanup_leftovers`` removes the remains of an interrupted save),
flushed and fsync'd; the trainer then publishes it with one ``os.replace`` and an fsync of the directory.

For a CPU checkpoint written with its ``layout``, the file is byte for byte stock's: both ``torch.save``
into a Python file object (stock into a ``BytesIO``), so the zip records are named alike. A file object
is also needed because torch's own path writer refuses a file name starting with ``.`` (the hidden
temporary name). What the file holds, compared with stock's file for the same checkpoint dict:

- the same keys, nesting and non-tensor values (the skeleton keeps dict subclasses, namedtuples,
  ``AttributeDict`` hyper-parameters, int keys), the same tensor values, dtypes and shapes;
- devices: each storage is tagged with the device of the tensor it was copied from when ``locations``
  is given (``file_layout``), so ``torch.load`` without ``map_location`` puts tensors where stock's
  file would; without it every tensor is tagged ``cpu`` (the staged copies' device). Lightning's own
  loader maps every storage to CPU either way, and for CPU training both are the same;
- storage sharing, views and parameters: as stock's (:mod:`lightning_asyncckpt.write.file_layout`: tied
  weights, views, offsets, strides and expanded tensors on the same storages, written whole;
  ``Parameter``\\ s and ``requires_grad`` kept; one object held twice is one object);
- no bloat from a staged copy: a staged tensor that is a slice of a larger buffer is re-wrapped, without
  a copy, as a tensor whose storage is exactly its bytes.

Runs in the writer process: imports torch and this package's Lightning-free modules only.
"""

from __future__ import annotations

import io
import os
import threading
import time

import torch

from lightning_asyncckpt.faults.policy import after_write
from lightning_asyncckpt.storage import commit, remote
from lightning_asyncckpt.write import fast_file, file_layout, worker
from lightning_asyncckpt.write import gate as _gate
from lightning_asyncckpt.write.jobs import FileJob

# Stock ``torch.save``'s defaults: pickle protocol 2 and the zip format.
_PICKLE_PROTOCOL = 2


# Storage location tags for one write: the tagger below answers from this map (data_ptr -> location),
# before torch's own taggers, while a write with ``locations`` runs in this thread.
class _Tags(threading.local):
    """The current thread's map for the tagger (``None``: no write with ``locations`` in progress)."""

    by_ptr: dict[int, str] | None = None

    def set(self, by_ptr: dict[int, str] | None) -> None:
        self.by_ptr = by_ptr


_tags = _Tags()
_tagger_lock = threading.Lock()
_tagger_registered = False


def _tag(storage: torch.types.Storage) -> str | None:
    tags = _tags.by_ptr
    if not tags:
        return None
    return tags.get(storage.data_ptr())


def _no_restore(storage: torch.types.Storage, location: str) -> None:
    return None  # loading is left to torch's own deserializers


def _register_tagger() -> None:
    global _tagger_registered
    with _tagger_lock:
        if not _tagger_registered:
            torch.serialization.register_package(1, _tag, _no_restore)  # before "cpu" (10) and "cuda" (20)
            _tagger_registered = True


def write_file(
    skeleton: object, tensors: dict[str, torch.Tensor], tmp_path: str | os.PathLike,
    aliases: dict[str, str] | None = None, locations: dict[str, str] | None = None,
    same_object: set[str] | frozenset[str] = frozenset(), kinds: dict[str, str] | None = None,
) -> int:
    """(writer) Writes the checkpoint as stock's ``torch.save`` file at ``tmp_path`` (the hidden sibling
    of the final path), flushed and fsync'd; or streams it to a remote URL, where it appears only once
    complete (:func:`remote.write_object`). Returns the file's size in bytes."""
    checkpoint, used = file_layout.rebuild(skeleton, tensors, aliases, same_object, kinds)
    by_ptr = {}
    if locations:
        _register_tagger()
        by_ptr = {used[n].untyped_storage().data_ptr(): loc for n, loc in locations.items()
                  if n in used and used[n].numel() > 0}
    _tags.set(by_ptr)
    try:
        if remote.is_remote(tmp_path):
            return remote.write_object(str(tmp_path), lambda f: torch.serialization.save(checkpoint, f, pickle_protocol=_PICKLE_PROTOCOL))
        os.makedirs(os.path.dirname(os.path.abspath(tmp_path)), exist_ok=True)
        # fast by default: staged bytes straight to the disk, CRC32s by ISA-L (fast_file); the same bytes as plain
        return fast_file.save(checkpoint, str(tmp_path), used.values(), _PICKLE_PROTOCOL)
    finally:
        _tags.set(None)


def hook_buckets(tmp_path: str | os.PathLike) -> list:
    """What a write hook (``testing`` faults, a user's ``write_hook``) receives for a file write: one
    bucket shaped like DCP's ``(path, name, data)``, its path the file about to be written."""
    tmp_path = str(tmp_path)
    return [(tmp_path, os.path.basename(tmp_path), None)]


def write_file_job(job: FileJob) -> None:
    """(writer) The async function handed to the engine's queue (like ``dcp_writer.write_job``): waits at
    the job's gate (a lazy snapshot still being copied, :mod:`lightning_asyncckpt.write.gate`), runs its
    hook, writes the file, then reports in the same result file: ``ok``, ``results`` (empty: no DCP write
    results), ``nbytes`` (the file's size), ``write_s``, ``pid``; or ``ok=False`` with ``error_type``,
    ``message`` and ``errno``."""
    t0, buckets, hook, skeleton = time.monotonic(), hook_buckets(job.tmp_path), job.hook, job.skeleton
    worker.keep_mapped(job.tensors.values())
    try:
        if job.gate is not None:
            _gate.wait(*job.gate)
            t0 = time.monotonic()  # the write's own time counts from the moment its bytes may be read
        if isinstance(skeleton, (bytes, bytearray)):  # the trainer's own bytes: trusted
            skeleton = torch.load(io.BytesIO(skeleton), weights_only=False)
        if hook is not None:
            hook(buckets)
        nbytes = write_file(skeleton, job.tensors, job.tmp_path, job.aliases, job.locations, job.same_object, job.kinds)
        if hook is not None:
            after_write(hook, buckets)
        outcome: dict[str, object] = {"ok": True, "results": [], "nbytes": nbytes}
    except BaseException as e:  # noqa: BLE001 - reported as a value, raised by the trainer
        outcome = {"ok": False, **worker.describe_failure(e, buckets)}
    worker.report(job.result_path, outcome, t0)


publish_file = commit.publish_file  # (trainer) a file's commit, where tests and tools look for it
