"""The global step of a persistent checkpoint, read without loading its tensors: the recovery compares it
with the local tier's newest complete step."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def global_step(path: Any) -> int | None:
    """``global_step`` of the checkpoint at ``path`` (this package's directory or file, a stock DCP
    directory, a ``torch.save`` file), or None where it cannot be read cheaply (a remote URL). A checkpoint
    without ``global_step`` (a Fabric loop's state) gives its ``step``, as this package's save records do."""
    if path is None or "://" in str(path):
        return None
    p = Path(path)
    try:
        if (p / ".asyncckpt.json").is_file():
            return int(json.loads((p / ".asyncckpt.json").read_text())["global_step"])
        if (p / "meta.pt").is_file():
            return _step(torch.load(p / "meta.pt", map_location="cpu", weights_only=False))
        if p.is_file():  # mmap: only the pickle is read, not the tensors
            return _step(torch.load(p, map_location="cpu", mmap=True, weights_only=False))
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:
        log.warning("lightning-asyncckpt: cannot read the global step of %s (%s)", path, e)
    return None


def _step(state: dict[str, Any]) -> int:
    return int(state["global_step"] if "global_step" in state else state["step"])
