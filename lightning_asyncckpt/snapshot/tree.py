"""A checkpoint dict as a ``skeleton`` and a flat ``{fqn: tensor}`` dict, and the rank shares of the
tensors: pure structure, no copies (the copies are :mod:`lightning_asyncckpt.snapshot.staging`'s).

- ``tensors``: the fqn is the dotted path of keys (``state_dict.layer.weight``,
  ``optimizer_states.0.state.0.exp_avg``), made unique in traversal order;
- ``skeleton``: the same nested structure with every tensor replaced by a ``meta`` tensor of the same
  shape and dtype. It keeps every key type (int keys of optimizer state), lists, tuples, dataclasses and
  non-tensor objects, and loading it needs nothing but torch.

Only dense strided tensors are split out (:func:`stageable`). Sparse, nested and ``torch.quantize_*``
tensors, and tensor subclasses that are neither traceable wrappers nor TransformerEngine's, stay in the
skeleton as they are: serialized with it, by ``torch.save`` itself, at save time. A traceable wrapper
subclass (torchao's low-bit optimizer states) is walked into: its inner tensors are the leaves, and the
skeleton holds the wrapper rebuilt around their placeholders (:mod:`lightning_asyncckpt.snapshot.subclasses`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from lightning_asyncckpt.snapshot import subclasses

SKELETON_KEY = "lightning_asyncckpt.skeleton"
Leaf = TypeVar("Leaf")  # what walk replaces: a tensor, or a type a caller names (a tier's LocalShard)


def stageable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be copied into a staging buffer of its shape and dtype: dense, strided, and plain
    (:func:`subclasses.is_plain`). The others (sparse COO/CSR/..., nested, ``torch.quantize_per_tensor``,
    other tensor subclasses) are left to ``torch.save``; :func:`walk` takes wrapper subclasses apart first."""
    return t.layout is torch.strided and not t.is_nested and not t.is_quantized and subclasses.is_plain(t)


def walk(obj: object, path: tuple, on_tensor: Callable[[tuple, Leaf], object], objects: bool = False,
         leaf: type[Leaf] = torch.Tensor) -> object:
    """Rebuilds ``obj`` with every stageable tensor leaf replaced by ``on_tensor(path, tensor)``; dicts,
    lists and tuples (namedtuples) are descended into, keeping their types, and with ``objects`` dataclass
    instances too (a ``torch.save`` file: its tensors are then staged like any other, and one that is also
    held elsewhere stays one object; a DCP directory keeps a dataclass whole, as one item). ``leaf``: the
    type ``on_tensor`` is called for instead of tensors (the writer's placeholders). A wrapper subclass
    (:func:`subclasses.is_wrapper`) is walked into when ``leaf`` is ``torch.Tensor``: its inner tensors are
    named ``<path>.<attribute>`` and the wrapper is rebuilt around what ``on_tensor`` returns for them."""
    if leaf is torch.Tensor and subclasses.is_wrapper(obj):
        inner = {n: walk(getattr(obj, n), (*path, n), on_tensor, objects, leaf) for n in subclasses.inner_names(obj)}
        return subclasses.rebuild(obj, inner)
    if isinstance(obj, leaf):
        return on_tensor(path, obj) if leaf is not torch.Tensor or stageable(obj) else obj
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict subclass (OrderedDict, AttributeDict, defaultdict)
        for k, v in obj.items():
            out[k] = walk(v, (*path, k), on_tensor, objects, leaf)
        return out
    if isinstance(obj, list):
        return [walk(v, (*path, i), on_tensor, objects, leaf) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [walk(v, (*path, i), on_tensor, objects, leaf) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if objects and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)  # frozen ones too: fields are set past their __setattr__
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                object.__setattr__(out, f.name, walk(getattr(obj, f.name), (*path, f.name), on_tensor, objects, leaf))
        return out
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


def split(checkpoint: dict[str, object], objects: bool = False) -> tuple[object, dict[str, torch.Tensor]]:
    """Splits a checkpoint into its skeleton and its flat tensors (no copies made); ``objects``: see
    :func:`walk`."""
    namer = FqnNamer()
    tensors: dict[str, torch.Tensor] = {}

    def take(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        if t.device.type == "meta":
            return t
        tensors[name] = t.detach()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    skeleton = walk(checkpoint, (), take, objects)
    return skeleton, tensors


def join(skeleton: object, tensors: dict[str, torch.Tensor], objects: bool = False) -> object:
    """Inverse of :func:`split`: puts loaded tensors back in place of the skeleton's placeholders."""
    namer = FqnNamer()

    def put(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        return tensors.get(name, t)

    return walk(skeleton, (), put, objects)


def wrapper_of(checkpoint: object, objects: bool = False) -> dict[str, tuple]:
    """The name (as :func:`split` gives it) of each inner tensor of a wrapper subclass, mapped to the path of
    the outermost wrapper that holds it: the one item a DCP save writes for them all, as stock's does."""
    out: dict[str, tuple] = {}
    namer = FqnNamer()

    def note(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name, node = namer(path), checkpoint
        for i, key in enumerate(path[:-1]):
            node = getattr(node, key) if isinstance(node, torch.Tensor) or not isinstance(node, (dict, list, tuple)) \
                else node[key]
            if subclasses.is_wrapper(node):
                out[name] = path[:i + 1]
                break
        return t

    walk(checkpoint, (), note, objects)
    return out


def partition(tensors: dict[str, torch.Tensor], world_size: int, groups: dict[str, tuple] | None = None) -> list[set[str]]:
    """Assigns each tensor to one rank so that every rank writes about the same number of bytes; the tensors of
    one group (``groups``: the inner tensors of one wrapper subclass, :func:`wrapper_of`) to the same rank.

    Deterministic: every rank computes the same assignment from the same (replicated) state.
    """
    units: dict[str | tuple, list[str]] = {}
    for name in tensors:
        units.setdefault(groups.get(name, name) if groups else name, []).append(name)
    sizes = {unit: sum(tensors[n].numel() * tensors[n].element_size() for n in names) for unit, names in units.items()}
    loads = [0] * world_size
    parts: list[set[str]] = [set() for _ in range(world_size)]
    for unit in sorted(units, key=lambda u: (-sizes[u], str(u))):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        parts[r].update(units[unit])
        loads[r] += sizes[unit]
    return parts


def share(tensors: dict[str, torch.Tensor], rank: int, world_size: int,
          groups: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """This rank's share of replicated tensors (all of them on one rank); see :func:`partition`."""
    if world_size <= 1:
        return tensors
    mine = partition(tensors, world_size, groups)[rank]
    return {k: v for k, v in tensors.items() if k in mine}
