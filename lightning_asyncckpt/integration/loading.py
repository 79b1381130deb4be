"""Reading a checkpoint back: a directory this library (or DCP, or stock Lightning) wrote, or a
``torch.save`` file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_asyncckpt.format import commit, remote
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.integration.lightning_api import TorchCheckpointIO
from lightning_asyncckpt.integration.map_location import for_file as map_location_for_file


def load(path: Path | str, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
    """(any rank) The checkpoint at ``path`` (a remote one: a file, read as stock reads it, through
    fsspec); a clear error for a missing or incomplete one."""
    if isinstance(path, str):
        remote.forget(path)
        fs, inner = remote.filesystem(path, writing=False)
        if fs.isdir(inner):  # a DCP directory: read from a local copy
            with remote.localize(path) as local:
                return load(local, map_location=map_location, weights_only=weights_only)
    if isinstance(path, str) or path.is_file():  # stock's file: read as stock reads it (onto the CPU unless told otherwise)
        # Lightning's callable map_location as "cpu", so that tensor subclasses (torchao's) load too
        kwargs = {"map_location": map_location_for_file(map_location)}
        return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint at {str(path)!r} not found.")
    if not commit.is_committed(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {commit.METADATA_FILE}).")
    return dcp_format.load(path, map_location=map_location, weights_only=weights_only)
