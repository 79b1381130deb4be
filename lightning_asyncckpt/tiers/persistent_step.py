"""The global step of a persistent checkpoint, read without loading its tensors: the recovery compares it
with the local tier's newest complete step.

A ``torch.save`` file is a zip archive whose ``data.pkl`` holds everything but the tensors' bytes. Only that
entry is read (on an object store: the archive's directory and that entry, by range requests), and it is
unpickled as a skeleton: every class it names becomes an inert placeholder and no tensor is loaded, so
reading the step neither imports nor runs anything of the checkpoint's (a model's hyperparameters may name
classes of the user's code).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import zipfile
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

log = logging.getLogger(__name__)

_BLOCK = 1 << 20  # an object store's reads: the archive's directory at its end, data.pkl at its start


def global_step(path: str | Path | None) -> int | None:
    """``global_step`` of the checkpoint at ``path`` (this package's directory or file, a stock DCP
    directory, a ``torch.save`` file; local, or a URL fsspec opens, such as ``s3://``), or None where it
    cannot be read. A checkpoint without ``global_step`` (a Fabric loop's state) gives its ``step``, as this
    package's save records do."""
    if path is None:
        return None
    try:
        if "://" in str(path):
            import fsspec

            fs, p = fsspec.core.url_to_fs(str(path))
            return _step_in(fs, p.rstrip("/"))
        return _step_in(None, str(Path(path)))
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the resume goes on: it loads it next
        log.warning("lightning-asyncckpt: cannot read the global step of %s (%s: %s)", path, type(e).__name__, e)
    return None


def _step_in(fs: AbstractFileSystem | None, p: str) -> int | None:
    """The step of the directory or file ``p`` on ``fs`` (None: the local file system)."""
    isdir = fs.isdir(p) if fs is not None else Path(p).is_dir()
    if isdir:
        record, meta = f"{p}/.asyncckpt.json", f"{p}/meta.pt"
        if _exists(fs, record):
            return int(json.loads(_read(fs, record))["global_step"])
        if _exists(fs, meta):
            return _step(skeleton(io.BytesIO(_read(fs, meta))))
        return None
    if not _exists(fs, p):
        return None
    with (fs.open(p, "rb", block_size=_BLOCK) if fs is not None else open(p, "rb")) as f:
        return _step(skeleton(f))


def skeleton(f: IO[bytes]) -> object:
    """The object a ``torch.save`` archive (a seekable binary file) holds, without its tensors: tensors are
    None and every other class an inert placeholder; dicts, lists and plain values are themselves."""
    with zipfile.ZipFile(f) as archive:
        names = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if not names:
            raise ValueError("not a torch.save archive (no data.pkl)")
        return _Skeleton(io.BytesIO(archive.read(names[0]))).load()


class _Opaque:
    """Whatever a checkpoint's pickle builds from a class: accepts any arguments and state, holds none."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


class _Dict(dict):
    """An ``OrderedDict`` of the checkpoint's (a module's state dict carries ``_metadata`` as its state)."""

    def __setstate__(self, state: object) -> None:
        pass


_PLAIN = {("collections", "OrderedDict"): _Dict, ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}


class _Skeleton(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        return _PLAIN.get((module, name), _Opaque)

    def persistent_load(self, pid: object) -> None:  # a tensor's storage: not read
        return None


def _exists(fs: AbstractFileSystem | None, p: str) -> bool:
    return fs.exists(p) if fs is not None else Path(p).is_file()


def _read(fs: AbstractFileSystem | None, p: str) -> bytes:
    return fs.cat_file(p) if fs is not None else Path(p).read_bytes()


def _step(state: object) -> int:
    if not isinstance(state, dict):
        raise TypeError(f"the checkpoint holds a {type(state).__name__}, not a dict")
    return int(state["global_step"] if "global_step" in state else state["step"])
