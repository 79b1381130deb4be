"""The package's one reader of DCP's ``.metadata``: an unpickler that builds only the types DCP's metadata
is made of, so that reading a checkpoint's index runs no code from the file.

``.metadata`` legitimately holds the classes of ``torch.distributed.checkpoint.metadata``, DCP's
``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, and (stock DCP's ``storage_meta``) a path;
sharded (FSDP2, DTensor) checkpoints hold nothing more. Anything else is refused unless
``allow_pickle`` is given, as ``torch.load(weights_only=True)`` refuses it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

from lightning_asyncckpt.storage import commit


class MetadataError(pickle.UnpicklingError):
    """``.metadata`` is not DCP metadata, or names a type that DCP metadata is not made of (``refused``).
    The message names the file."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only the types it is made of (no code from the file runs)."""

    _GLOBALS = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        # stock DCP records the checkpoint's path in ``storage_meta``
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
    _MODULES = ("torch.distributed.checkpoint.metadata",)

    def find_class(self, module: str, name: str) -> object:
        import torch

        if (module, name) in self._GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise _Refused(f"it references {module}.{name}, which is not a type of DCP metadata")


def read_metadata(path: Path, allow_pickle: bool = False, hint: str = "") -> Metadata:
    """DCP's ``Metadata`` of the checkpoint directory ``path``, unpickled with the restricted unpickler unless
    ``allow_pickle`` (which runs any code the file names: only for checkpoints you trust).

    Raises ``OSError`` if the file cannot be read, and :class:`MetadataError` if it is not DCP metadata or
    names other types; ``hint`` (how to allow them) is appended to the message of a refusal.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    meta_path = Path(path) / commit.METADATA_FILE
    with open(meta_path, "rb") as f:
        try:
            metadata = pickle.load(f) if allow_pickle else _MetadataUnpickler(f).load()
        except _Refused as e:
            raise MetadataError(f"cannot read {meta_path}: {e}" + (f"; {hint}" if hint else ""), refused=True) from None
        except pickle.UnpicklingError as e:
            raise MetadataError(f"cannot read {meta_path}: {e}") from None
        except Exception as e:  # noqa: BLE001 - garbage: any error of the unpickler
            raise MetadataError(f"cannot read {meta_path}: not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise MetadataError(f"cannot read {meta_path}: not DCP metadata (a {type(metadata).__name__})")
    return metadata
