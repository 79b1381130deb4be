"""Reading a checkpoint back: a directory this library (or DCP, or stock Lightning) wrote, or a
``torch.save`` file."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from lightning_asyncckpt.format import commit, integrity, remote
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.integration.lightning_api import TorchCheckpointIO
from lightning_asyncckpt.integration.map_location import for_file as map_location_for_file


def load(path: Path | str, map_location: Any | None = None, weights_only: bool | None = None,
         verify: bool = True) -> dict[str, Any]:
    """(any rank) The checkpoint at ``path`` (a remote one: a file, read as stock reads it, through
    fsspec); a clear error for a missing or incomplete one. A local one is checked first
    (:mod:`~lightning_asyncckpt.format.integrity`: a regular file, inside the checkpoint; with ``verify`` every
    record's CRC32): a damaged one raises ``CorruptCheckpointError`` naming the file and the record."""
    if isinstance(path, str):
        remote.forget(path)
        fs, inner = remote.filesystem(path, writing=False)
        if fs.isdir(inner):  # a DCP directory: read from a local copy
            with remote.localize(path) as local:
                return load(local, map_location=map_location, weights_only=weights_only, verify=verify)
    if isinstance(path, str) or not path.is_dir() and path.exists():
        # stock's file: read as stock reads it (onto the CPU unless told otherwise), once checked
        # Lightning's callable map_location as "cpu", so that tensor subclasses (torchao's) load too
        kwargs = {"map_location": map_location_for_file(map_location)}
        if not isinstance(path, str):
            integrity.check_file(path, crc=False)  # a regular file, before it is opened for the load
        try:
            if isinstance(path, str) or not verify:
                return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
            return integrity.while_loading(lambda: integrity.check_file(path),
                                           lambda: TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs))
        except pickle.UnpicklingError as e:  # torch's message does not say which file
            raise pickle.UnpicklingError(f"{path}: {e}") from None
        except Exception as e:
            if isinstance(path, str) or integrity.is_torch_zip(path):
                raise
            # a legacy (not zip) file, unchecked: random bytes fail in any way; say which file
            raise integrity.CorruptCheckpointError(f"{path}: not a checkpoint ({integrity.first_line(e)})") from e
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint at {str(path)!r} not found.")
    if not commit.is_committed(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {commit.METADATA_FILE}).")
    return dcp_format.load(path, map_location=map_location, weights_only=weights_only, verify=verify)
