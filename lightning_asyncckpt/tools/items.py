"""Reading single items of a checkpoint directory without DCP's planner: a byte range, DCP's storage
transforms undone, an object unpickled (``weights_only`` unless allowed), and one-line reasons for failures;
and reading a whole ``torch.save`` checkpoint file (memory-mapped where torch can).

torch is imported when a function needs it, so that importing this module stays cheap (the CLI's ``--help``).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_asyncckpt.format.integrity import decode as decode
from lightning_asyncckpt.storage import commit

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

META_FILE = "meta.pt"  # dcp_format.META_FILE, without importing torch for it
PICKLE_HINT = "pass allow_pickle=True if you trust this checkpoint"
ZIP_MAGIC = b"PK\x03\x04"  # how a torch.save file (and every item DCP's planner writes) begins
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


class ItemError(Exception):
    """An item or file of a checkpoint that cannot be read; the message (one line) names it and says why."""


def read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def torch_load(data: bytes | Path, allow_pickle: bool, what: str, hint: str = PICKLE_HINT) -> object:
    """``torch.load`` (``weights_only`` unless ``allow_pickle``) on CPU; raises :class:`ItemError` naming ``what``."""
    import torch

    source = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(source, map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:  # noqa: BLE001 - a corrupt file: any error of torch.load
        raise _load_error(e, allow_pickle, what, hint) from None


def _load_error(e: Exception, allow_pickle: bool, what: str, hint: str) -> ItemError:
    if isinstance(e, pickle.UnpicklingError) and not allow_pickle:
        return ItemError(f"cannot read {what} with weights_only=True ({weights_only_reason(e)}); {hint}")
    return ItemError(f"cannot read {what}: {first_line(e)}")


def is_zip_file(path: Path) -> bool:
    """Whether the file ``path`` begins like a ``torch.save`` file (a zip archive); raises ``OSError``."""
    with open(path, "rb") as f:
        return f.read(4) == ZIP_MAGIC


def load_file(path: Path, allow_pickle: bool, what: str, hint: str = PICKLE_HINT) -> object:
    """:func:`torch_load` of the ``torch.save`` file ``path``, memory-mapped (``mmap=True``: tensor data is
    not read until used) where torch can, else read whole (a legacy, non-zip file; a filesystem without mmap)."""
    import torch

    try:
        return torch.load(str(path), map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except pickle.UnpicklingError as e:  # what the file holds, not how it was read: the same without mmap
        raise _load_error(e, allow_pickle, what, hint) from None
    except Exception:  # noqa: BLE001 - retried without mmap; a corrupt file fails there too
        return torch_load(path, allow_pickle, what, hint)


def read_object(path: Path, metadata: Metadata, fqn: str, allow_pickle: bool, hint: str = PICKLE_HINT) -> object:
    """Unpickles the bytes item ``fqn`` (an object that DCP's planner stored with ``torch.save``)."""
    for index, storage in metadata.storage_data.items():
        if index.fqn == fqn:
            try:
                raw = read_range(path / storage.relative_path, storage.offset, storage.length)
            except OSError as e:
                raise ItemError(f"cannot read {path / storage.relative_path}: {e.strerror or e}") from None
            return torch_load(decode(path, storage, raw), allow_pickle, f"{fqn!r} in {path}", hint)
    raise ItemError(f"{path}: {fqn!r} has no storage entry in {commit.METADATA_FILE}")


def weights_only_reason(e: BaseException) -> str:
    """The cause in torch's long ``weights_only`` message (``Unsupported global: GLOBAL m.C ...``)."""
    text = _ANSI_RE.sub("", str(e))
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    return m.group(1).split(". ")[0].rstrip(".") if m else first_line(e)


def first_line(e: BaseException) -> str:
    lines = _ANSI_RE.sub("", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")
