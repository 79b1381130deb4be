"""Reading a checkpoint back: a directory this library (or DCP, or stock Lightning) wrote, or a
``torch.save`` file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.fabric.plugins import TorchCheckpointIO

from lightning_asyncckpt import commit, dcp_format, remote


def load(path: Path | str, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
    """(any rank) The checkpoint at ``path`` (a remote one: a file, read as stock reads it, through
    fsspec); a clear error for a missing or incomplete one."""
    if isinstance(path, str):
        remote.forget(path)
    if isinstance(path, str) or path.is_file():  # stock's file: read as stock reads it (onto the CPU unless told otherwise)
        kwargs = {} if map_location is None else {"map_location": map_location}
        return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kwargs)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint at {str(path)!r} not found.")
    if not commit.is_committed(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {commit.METADATA_FILE}).")
    return dcp_format.load(path, map_location=map_location, weights_only=weights_only)
