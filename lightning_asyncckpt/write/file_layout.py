"""What the staged copies of a ``torch.save`` file's tensors no longer know about the originals, and how
the writer gives it back, so that its file is stock's file for every dict stock can save.

- **In the trainer, before the snapshot** (:func:`prepare`): a tensor that does not own its storage
  exactly (a view of another tensor, a slice with an offset, a strided or transposed or expanded one, two
  different views of one storage) is replaced in the dict by a :class:`StorageView`, and the storage
  behind it is staged once, whole, as bytes (under :data:`STORAGES_KEY`). Everything else is staged as a
  tensor, as before. :func:`layout` then records which tensors are the same view (tied weights) or the
  same object, which were ``Parameter``\\ s or required grad, and their devices.
- **In the writer** (:func:`rebuild`): each staged storage is one storage again, and each ``StorageView``
  the very view of it the original was (offset, shape, stride, dtype); ``Parameter``\\ s and
  ``requires_grad`` come back; tied and identical tensors are one storage and one object again.
  ``torch.save`` then writes what it writes for the original dict: the same storages, whole, in the same
  order, byte for byte for a CPU checkpoint.

Sparse, nested and ``torch.quantize_*`` tensors, and subclasses other than wrappers and TransformerEngine's,
are not staged (``tree.stageable``): they are serialized with the skeleton at save time, by ``torch.save``
itself. A wrapper subclass (torchao's optimizer states) is staged through its inner tensors and rebuilt by
``staging.join``: ``torch.save`` then pickles it as stock's does. Runs in the trainer and the writer (no Lightning).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import torch

from lightning_asyncckpt.snapshot import staging, subclasses, tree

STORAGES_KEY = "lightning_asyncckpt.storages"  # the staged whole storages, in the dict being staged only
log = logging.getLogger(__name__)
_warned: list[bool] = []


@dataclass(frozen=True)
class StorageView:
    """(in the skeleton) A tensor that is a view into the storage staged as ``storage``."""

    storage: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    kind: str = ""  # "param", "frozen" (a Parameter without grad), "grad" (requires grad), or "" (plain)


@dataclass
class FileLayout:
    """What the staged copies no longer know about the original tensors (computed in the trainer).

    ``aliases``: fqn -> the first fqn that is the same view of the same storage (tied weights).
    ``same_object``: those aliases that are the very same tensor object as their target (a dict holding
    one tensor twice), which pickle stores once and loads as one object.
    ``locations``: fqn -> device location tag (``"cuda:0"``) for tensors not on the CPU.
    ``kinds``: fqn -> ``"param"``, ``"frozen"`` or ``"grad"`` for a ``Parameter`` (with or without grad)
    or a tensor that requires grad; plain tensors are not listed.
    """

    aliases: dict[str, str] = field(default_factory=dict)
    same_object: set[str] = field(default_factory=set)
    locations: dict[str, str] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)


def _kind(t: torch.Tensor) -> str:
    if type(t) is torch.nn.Parameter:
        return "param" if t.requires_grad else "frozen"
    return "grad" if t.requires_grad else ""


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def prepare(checkpoint: dict[str, object]) -> tuple[dict[str, object], FileLayout]:
    """(trainer, at save time, before the snapshot) The dict to stage for a ``torch.save`` file, and its
    :class:`FileLayout`. Reads metadata only: no tensor data is touched or copied."""
    by_storage: dict[tuple, list[torch.Tensor]] = {}
    unstaged = 0

    def collect(path: tuple, t: torch.Tensor) -> torch.Tensor:
        nonlocal unstaged
        if subclasses.is_wrapper(t):
            pass  # staged through its inner tensors (tree.walk), never a StorageView
        elif not tree.stageable(t):
            unstaged += 1
        elif t.device.type != "meta" and type(t) in (torch.Tensor, torch.nn.Parameter):
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(t)
        return t

    tree.walk(checkpoint, (), collect, objects=True, leaf=(torch.Tensor,))  # a tuple: every tensor, stageable or not
    if unstaged and not _warned:
        _warned.append(True)
        log.warning("lightning-asyncckpt: %d sparse, nested, quantized or subclass tensor(s) are copied inside the save call by"
                    " torch.save itself, not staged for the background write (the file is stock's either way;"
                    " said once per process)", unstaged)

    def one_view(ts: list[torch.Tensor]) -> bool:  # tied weights: every member the same whole-storage tensor
        first = ts[0]
        return _owns_storage(first) and all(
            (t.storage_offset(), t.shape, t.stride(), t.dtype) == (0, first.shape, first.stride(), first.dtype) for t in ts)

    whole = {key for key, ts in by_storage.items() if ts[0].numel() and not one_view(ts)}
    storages: dict[str, torch.Tensor] = {}
    names: dict[tuple, str] = {}
    views: dict[int, StorageView] = {}  # one placeholder per tensor object: pickle keeps it one object

    def swap(path: tuple, t: torch.Tensor) -> torch.Tensor | StorageView:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in whole or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return t
        if id(t) not in views:
            if key not in names:
                names[key] = name = str(len(names))
                storages[name] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            views[id(t)] = StorageView(names[key], t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()), _kind(t))
        return views[id(t)]

    staged = tree.walk(checkpoint, (), swap, objects=True) if whole else checkpoint
    if storages:  # walk made a copy of the dict (of its own type): the caller's is untouched
        staged[STORAGES_KEY] = storages
    return staged, layout(staged)


def layout(checkpoint: dict[str, object]) -> FileLayout:
    """(trainer) The aliases, kinds and devices of ``checkpoint``'s tensors, named as ``staging.split``
    names them for a file (``objects=True``). Reads metadata only."""
    out = FileLayout()
    first: dict[tuple, tuple[str, torch.Tensor]] = {}
    namer = tree.FqnNamer()

    def visit(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        if t.device.type == "meta":
            return t
        if t.device.type != "cpu":
            out.locations[name] = str(t.device)
        if _kind(t):
            out.kinds[name] = _kind(t)
        if t.numel() == 0 or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return t  # a tensor subclass is written as its own plain (dequantized) copy: never an alias
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        target, obj = first.setdefault(key, (name, t))
        if target != name:
            out.aliases[name] = target
            if obj is t:
                out.same_object.add(name)
        return t

    tree.walk(checkpoint, (), visit, objects=True)
    return out


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on a storage holding exactly its bytes, so that ``torch.save`` writes no more than them.

    A contiguous slice of a larger host buffer is re-wrapped in place (no copy); the caller keeps the
    buffer alive while the result is in use. Other views (gaps between elements) are copied."""
    nbytes = t.numel() * t.element_size()
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    if t.untyped_storage().nbytes() == nbytes:
        return t  # the whole storage (possibly permuted strides): written as it is
    if t.device.type == "cpu" and t.is_contiguous():
        raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
        return torch.frombuffer(raw, dtype=t.dtype, count=t.numel()).view(t.shape)
    return t.contiguous() if not t.is_contiguous() else t.clone()


def _as_kind(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("param", "frozen"):
        return torch.nn.Parameter(t, requires_grad=kind == "param")
    if kind == "grad":
        return t.requires_grad_(True)
    return t


def rebuild(
    skeleton: object, tensors: dict[str, torch.Tensor], aliases: dict[str, str] | None = None,
    same_object: set[str] | frozenset[str] = frozenset(), kinds: dict[str, str] | None = None,
) -> tuple[object, dict[str, torch.Tensor]]:
    """(writer) The checkpoint dict to save: the skeleton with the staged tensors put back (each on an exact
    storage, aliases on their target's storage, views on their staged storage, kinds given back). Also
    returns the tensors used, by fqn."""
    kinds = kinds or {}
    used = {name: _as_kind(_exact(t), kinds.get(name, "")) for name, t in tensors.items()}
    for name, target in (aliases or {}).items():
        if target in used:
            # The storage is written once either way. Tied weights in a state_dict are two tensor objects
            # on one storage (a new one here); one object held twice is pickled once (the same one here).
            same = used[target] if name in same_object else _as_kind(used[target].detach(), kinds.get(name, ""))
            used[name] = same
    checkpoint = staging.join(skeleton, used, objects=True)
    if not isinstance(checkpoint, dict) or STORAGES_KEY not in checkpoint:
        return checkpoint, used
    raw = checkpoint.pop(STORAGES_KEY)
    storages = {name: t.untyped_storage() for name, t in raw.items()}
    made: dict[int, torch.Tensor] = {}

    def view(ref: StorageView) -> torch.Tensor:
        if id(ref) not in made:
            t = torch.empty(0, dtype=ref.dtype).set_(storages[ref.storage], ref.offset, ref.size, ref.stride)
            made[id(ref)] = _as_kind(t, ref.kind)
        return made[id(ref)]

    return tree.walk(checkpoint, (), lambda _path, ref: view(ref), objects=True, leaf=StorageView), used
