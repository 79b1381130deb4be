"""A checkpoint dict as a ``skeleton`` and a flat ``{fqn: tensor}`` dict, and the rank shares of the
tensors: pure structure, no copies (the copies are :mod:`lightning_asyncckpt.snapshot.staging`'s).

- ``tensors``: the fqn is the dotted path of keys (``state_dict.layer.weight``,
  ``optimizer_states.0.state.0.exp_avg``), made unique in traversal order;
- ``skeleton``: the same nested structure with every tensor replaced by a ``meta`` tensor of the same
  shape and dtype. It keeps every key type (int keys of optimizer state), lists, tuples and non-tensor
  objects, and loading it needs nothing but torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

SKELETON_KEY = "lightning_asyncckpt.skeleton"


def walk(obj: Any, path: tuple, on_tensor: Callable[[tuple, torch.Tensor], Any]) -> Any:
    """Rebuilds ``obj`` with every tensor leaf replaced by ``on_tensor(path, tensor)``."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(path, obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict subclass (OrderedDict, AttributeDict, defaultdict)
        for k, v in obj.items():
            out[k] = walk(v, (*path, k), on_tensor)
        return out
    if isinstance(obj, list):
        return [walk(v, (*path, i), on_tensor) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [walk(v, (*path, i), on_tensor) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class FqnNamer:
    """Dotted names for tensor paths, made unique in traversal order (same on save and on load)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, path: tuple) -> str:
        name = ".".join(str(k) for k in path) or "tensor"
        base, n = name, 1
        while name in self.seen or name == SKELETON_KEY:
            name = f"{base}#{n}"
            n += 1
        self.seen.add(name)
        return name


def split(checkpoint: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """Splits a checkpoint into its skeleton and its flat tensors (no copies made)."""
    namer = FqnNamer()
    tensors: dict[str, torch.Tensor] = {}

    def take(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        if t.device.type == "meta":
            return t
        tensors[name] = t.detach()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    skeleton = walk(checkpoint, (), take)
    return skeleton, tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`: puts loaded tensors back in place of the skeleton's placeholders."""
    namer = FqnNamer()

    def put(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        return tensors.get(name, t)

    return walk(skeleton, (), put)


def partition(tensors: dict[str, torch.Tensor], world_size: int) -> list[set[str]]:
    """Assigns each tensor to one rank so that every rank writes about the same number of bytes.

    Deterministic: every rank computes the same assignment from the same (replicated) state.
    """
    loads = [0] * world_size
    parts: list[set[str]] = [set() for _ in range(world_size)]
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].numel() * kv[1].element_size(), kv[0])):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        parts[r].add(name)
        loads[r] += t.numel() * t.element_size()
    return parts


def share(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of replicated tensors (all of them on one rank)."""
    if world_size <= 1:
        return tensors
    mine = partition(tensors, world_size)[rank]
    return {k: v for k, v in tensors.items() if k in mine}
