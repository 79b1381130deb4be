"""Remote checkpoint paths: ``s3://``, ``gs://``, ``memory://`` and every other fsspec URL stock accepts.

Where a remote checkpoint is written, and by whom:
- The worker streams the ``torch.save`` file straight to the object store (:func:`write_object`), from
  the staged copies: the training thread does no remote I/O for the write. Object stores have no
  rename, so the object is opened with ``autocommit=False``: it becomes visible only when the whole
  upload completes (one ``PUT``, or a completed multipart upload), and a failed write is discarded.
  An existing object at that URL (``last.ckpt``) stays as it was until the new one completes.
- The trainer's commit then only records the save; top-k removals run in a background thread
  (``Run.remove``), never on the training thread.
- A DCP directory (``AsyncDDPStrategy``, sharded saves, ``format="dcp"``) is written by each rank's
  worker into a local spool directory, then uploaded by that worker, object by object, after it has
  deleted the ``.metadata`` of a checkpoint it replaces (so a reader never sees old metadata over new
  shards). At the commit, the coordinator uploads ``.metadata`` last, in the run's background thread
  (``committer.settle_publishing`` records it once done). Loads download the directory into a
  temporary local one first. The spool (``<TMPDIR>/asyncckpt-spool-<uid>``) is this user's own, mode 0700,
  and refused where another user made it or it is a link (:mod:`~lightning_asyncckpt.storage.private_dirs`).
- Credentials and endpoints come from fsspec's own configuration, as for stock Lightning: the backend's
  environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), its config files, or
  fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables. The worker inherits the environment.

Runs in the trainer and in the writer process; fsspec is imported lazily.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from lightning_asyncckpt.storage import private_dirs

if TYPE_CHECKING:
    from datetime import datetime

    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

# Object stores whose first path component is a bucket that must exist (fsspec would create it).
BUCKET_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})
# Part size of a streamed upload: S3 allows 10,000 parts, so 64 MiB parts reach 640 GB per file.
BLOCK_SIZE = 64 << 20
# Filesystems that live in one process's memory: the background writer, another process, cannot reach them
PROCESS_LOCAL = frozenset({"memory"})
# What to install for the common schemes, for the error of a missing backend
# How to move the spool and a load's download out of a temporary directory that others could tamper with
_TMPDIR_FIX = "set TMPDIR to a directory of your own (`mkdir -m 700 ~/tmp; export TMPDIR=~/tmp`)"
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}


METADATA = ".metadata"


def is_remote(path: str | os.PathLike) -> bool:
    """A URL that is not a local file: ``s3://bucket/x.ckpt`` yes, ``file:///x`` and ``/x`` no."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = text.decode()
    return "://" in text and not text.startswith("file://")


def protocol(url: str) -> str:
    return url.split("://", 1)[0]


def parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def filesystem(url: str, writing: bool = True) -> tuple[AbstractFileSystem, str]:
    """(any process) The fsspec filesystem for ``url`` and the path within it; a clear error for an
    unknown scheme, a backend that is not installed, or (``writing``) one the worker cannot reach."""
    import fsspec

    scheme = protocol(url)
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as e:
        raise ValueError(
            f"Cannot use the checkpoint path {url!r}: fsspec knows no filesystem for '{scheme}://' ({e})."
            " Use a local path or an fsspec URL such as s3://bucket/dir/x.ckpt."
        ) from None
    except ImportError as e:
        package = _BACKENDS.get(scheme, "the fsspec backend for this scheme")
        raise ImportError(
            f"Cannot use the checkpoint path {url!r}: the fsspec backend for '{scheme}://' is not installed"
            f" ({e}). Install it (`pip install {package}`), as stock Lightning would need too."
        ) from None
    if writing and scheme in PROCESS_LOCAL:
        raise ValueError(
            f"Cannot save to {url!r}: '{scheme}://' lives in the memory of this process, which the background"
            " writer (another process) cannot reach. Save to a local path or an object store, or use"
            " Lightning's `TorchCheckpointIO` for in-memory checkpoints."
        )
    return fsspec.core.url_to_fs(url)


def check_directory(dirpath: str) -> None:
    """(the saving rank, on the training thread, once per directory and run) A clear error at save time
    for a bucket that does not exist; other remote filesystems get the directory made, as stock does."""
    fs, path = filesystem(dirpath)
    if protocol(dirpath) in BUCKET_STORES:
        bucket = path.split("/", 1)[0]
        if not fs.exists(bucket):
            raise FileNotFoundError(
                f"Cannot save to {dirpath!r}: the bucket {bucket!r} does not exist (or these credentials cannot"
                " see it). Create the bucket, or fix the path or the credentials."
            )
    else:
        fs.makedirs(path, exist_ok=True)


def write_object(url: str, write: Callable[[IO[bytes]], None]) -> int:
    """(writer) Streams ``write(f)`` to ``url``; the object appears only once complete. Returns its size."""
    fs, path = filesystem(url)
    f = fs.open(path, "wb", block_size=BLOCK_SIZE, autocommit=False)
    try:
        write(f)
        nbytes = f.tell()
        f.close()
        f.commit()
    except BaseException:
        try:
            f.discard()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            log.debug("lightning-asyncckpt: could not discard the unfinished upload to %s", url, exc_info=True)
        raise
    return nbytes


def remove(url: str, what: str) -> bool:
    """(a background thread of the trainer) Removes the object (or prefix) at ``url`` if it exists; on
    failure logs a warning that names it."""
    try:
        fs, path = filesystem(url)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:  # noqa: BLE001 - retention is best effort, as for local files
        log.warning("lightning-asyncckpt: could not remove %s %s (%s); it is left in the store", what, url, e)
        return False
    return True


def forget(url: str) -> None:
    """(trainer) Drops what this process's fsspec cache knows of ``url``: the worker (another process) may
    have replaced it, and a stale listing would make the read fail (``FileExpired``) or miss it."""
    fs, path = filesystem(url, writing=False)
    fs.invalidate_cache(path)


def last_checkpoint(dirpath: str) -> str | None:
    """The URL of the newest ``last*.ckpt`` in ``dirpath`` (any rank, before ``fit``), or ``None``.

    For ``trainer.fit(model, ckpt_path=last_checkpoint("s3://bucket/run1"))``: Lightning's own
    ``ckpt_path="last"`` finds no checkpoint on an object store (through Lightning 2.6,
    ``ModelCheckpoint._find_last_checkpoints`` returns the paths without their ``s3://``, which are then
    looked up on the local disk), with this plugin as with stock ``TorchCheckpointIO``."""
    import re

    fs, path = filesystem(dirpath, writing=False)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return None
    def complete(e: dict) -> bool:  # a file, or a DCP directory (a prefix) with its metadata
        return e.get("type") == "file" or fs.exists(f"{e['name']}/{METADATA}")

    def modified(e: dict) -> datetime:
        return fs.modified(e["name"] if e.get("type") == "file" else f"{e['name']}/{METADATA}")

    found = [e for e in fs.ls(path, detail=True)
             if re.fullmatch(r"last(-v?\d+)?\.ckpt", e["name"].rsplit("/", 1)[-1]) and complete(e)]
    if not found:
        return None
    newest = max(found, key=modified)
    return fs.unstrip_protocol(newest["name"])


def spool_root() -> Path:
    """(any rank, before a remote directory save) The local directory where this node's workers write DCP
    parts before uploading them: ``asyncckpt-spool-<uid>`` in the temporary directory, this user's own (made
    0700, never through a link). Another user's, a link, or one writable by group or others is refused
    (:class:`~lightning_asyncckpt.storage.private_dirs.UntrustedDirectoryError`): the parts in it are
    uploaded as the checkpoint, so whoever could write there could plant weights (or a pickle) in it."""
    return private_dirs.private_dir(Path(tempfile.gettempdir()), f"asyncckpt-spool-{os.geteuid()}",
                                    "the remote save's spool", _TMPDIR_FIX)


def upload_dir(local: str | os.PathLike, url: str) -> None:
    """(writer) Uploads every file under ``local`` to ``url`` (same relative names), then deletes the local
    copies. The ``.metadata`` of a checkpoint already at ``url`` goes first: its shards are about to be
    overwritten, and a checkpoint without metadata is incomplete rather than torn."""
    fs, root = filesystem(url)
    meta = f"{root}/{METADATA}"
    if fs.exists(meta):
        fs.rm(meta)
    local = Path(local)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{root}/{path.relative_to(local).as_posix()}")
        path.unlink()


def publish_metadata(local: Path, url: str) -> None:
    """(coordinator, at the commit) Uploads ``.metadata`` last: from now on the checkpoint is complete."""
    fs, root = filesystem(url)
    fs.put_file(str(local / METADATA), f"{root}/{METADATA}")


@contextlib.contextmanager
def localize(url: str) -> Iterator[Path]:
    """(any rank, to load) The checkpoint at ``url`` in a temporary local copy (a file, or a directory),
    removed afterwards. A directory without ``.metadata`` is an incomplete checkpoint: a clear error."""
    fs, path = filesystem(url, writing=False)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        raise FileNotFoundError(f"Checkpoint at {url!r} not found.")
    problem = private_dirs.base_problem(Path(tempfile.gettempdir()), "a remote load", _TMPDIR_FIX)
    if problem is not None:  # mkdtemp's own directory is 0700 and new, but others could rename it here
        raise private_dirs.UntrustedDirectoryError(f"lightning-asyncckpt: {problem}")
    tmp = Path(tempfile.mkdtemp(prefix="asyncckpt-load-"))
    try:
        local = tmp / (path.rstrip("/").rsplit("/", 1)[-1] or "checkpoint")
        if fs.isdir(path):
            if not fs.exists(f"{path}/{METADATA}"):
                raise FileNotFoundError(f"{url!r} is not a complete checkpoint (no {METADATA}).")
            fs.get(f"{path}/", str(local) + "/", recursive=True)
        else:
            fs.get_file(path, str(local))
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
