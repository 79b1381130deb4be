"""Snapshot of a checkpoint dict: the only module that touches tensor data on the save path.

A checkpoint is split into
- ``tensors``: a flat ``{fqn: tensor}`` dict, the fqn being the dotted path of keys
  (``state_dict.layer.weight``, ``optimizer_states.0.state.0.exp_avg``);
- a ``skeleton``: the same nested structure with every tensor replaced by a ``meta`` tensor of the
  same shape and dtype. It keeps every key type (int keys of optimizer state), lists, tuples and
  non-tensor objects, and loading it needs nothing but torch.

The tensors handed to the writer are copies taken at save time into reused host buffers, so the
training step may change every parameter as soon as ``snapshot`` returns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

SKELETON_KEY = "lightning_asyncckpt.skeleton"


def _walk(obj: Any, path: tuple, on_tensor: Callable[[tuple, torch.Tensor], Any]) -> Any:
    """Rebuilds ``obj`` with every tensor leaf replaced by ``on_tensor(path, tensor)``."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(path, obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict subclass (OrderedDict, AttributeDict, defaultdict)
        for k, v in obj.items():
            out[k] = _walk(v, (*path, k), on_tensor)
        return out
    if isinstance(obj, list):
        return [_walk(v, (*path, i), on_tensor) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_walk(v, (*path, i), on_tensor) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class _FqnNamer:
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
    namer = _FqnNamer()
    tensors: dict[str, torch.Tensor] = {}

    def take(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        if t.device.type == "meta":
            return t
        tensors[name] = t.detach()
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    skeleton = _walk(checkpoint, (), take)
    return skeleton, tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`: puts loaded tensors back in place of the skeleton's placeholders."""
    namer = _FqnNamer()

    def put(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        return tensors.get(name, t)

    return _walk(skeleton, (), put)


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


def _share(tensors: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's share of replicated tensors (all of them on one rank)."""
    if world_size <= 1:
        return tensors
    mine = partition(tensors, world_size)[rank]
    return {k: v for k, v in tensors.items() if k in mine}


def _shared_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in shared memory, allocated there directly (``share_memory_`` would
    allocate private memory first, then copy it into a new shared segment)."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
    except (AttributeError, RuntimeError):  # a torch without the private constructor
        return torch.empty(shape, dtype=dtype).share_memory_()
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def _is_whole_storage(t: torch.Tensor) -> bool:
    # torch.save of a view writes its whole storage: such tensors must be copied before writing.
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


@dataclass
class BufferSet:
    """Host buffers for one in-flight save, reused by a later save once this one is written."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    busy: bool = False

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass
class Snapshot:
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    nbytes: int
    buffer_set: BufferSet | None


class Stager:
    """Takes snapshots into reused host buffers.

    Args:
        shared: put buffers in shared memory, so that a spawned worker maps them instead of
            receiving (and moving) a copy. Needed for the persistent worker.
        copy_cpu: copy CPU tensors. A fork-per-save worker gets a copy-on-write snapshot of CPU memory
            from ``fork`` itself, so it only needs CUDA tensors and views copied.
    """

    def __init__(self, shared: bool, copy_cpu: bool):
        self.shared = shared
        self.copy_cpu = copy_cpu
        self._sets: list[BufferSet] = []

    def _acquire(self) -> BufferSet:
        for s in self._sets:
            if not s.busy:
                s.busy = True
                return s
        s = BufferSet(busy=True)
        self._sets.append(s)
        return s

    def release(self, buffer_set: BufferSet | None) -> None:
        """The write that used ``buffer_set`` finished: a later save may overwrite it."""
        if buffer_set is not None:
            buffer_set.busy = False

    def clear(self) -> None:
        self._sets = [s for s in self._sets if s.busy]

    def _buffer(self, bs: BufferSet, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = bs.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if self.shared:
                buf = _shared_empty(t.shape, t.dtype)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                if t.device.type == "cuda":
                    buf = buf.pin_memory()
            bs.buffers[name] = buf
        return buf

    def prepare(self, checkpoint: dict[str, Any], rank: int = 0, world_size: int = 1) -> int:
        """Allocates (and faults in) the buffers that a snapshot of a checkpoint like this one needs, so
        that the first save costs what later ones do. Returns the bytes prepared."""
        _, tensors = split(checkpoint)
        tensors = _share(tensors, rank, world_size)
        bs = self._acquire()
        nbytes = 0
        for name, t in tensors.items():
            if not self.copy_cpu and t.device.type == "cpu":
                continue
            self._buffer(bs, name, t).zero_()
            nbytes += t.numel() * t.element_size()
        self.release(bs)
        return nbytes

    def _stage(self, bs: BufferSet, name: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copies ``t`` into ``bs`` (or keeps it, when fork's copy-on-write is the snapshot).
        Returns the staged tensor and whether a CUDA copy is still in flight."""
        if not self.copy_cpu and t.device.type == "cpu" and _is_whole_storage(t):
            return t, False
        buf = self._buffer(bs, name, t)
        non_blocking = t.device.type == "cuda" and buf.is_pinned()
        buf.copy_(t, non_blocking=non_blocking)
        return buf, non_blocking

    @staticmethod
    def _drop_unused(bs: BufferSet, used: set[str]) -> None:
        # drop buffers of tensors that are gone, so that memory does not grow with changing states
        for name in list(bs.buffers):
            if name not in used:
                del bs.buffers[name]

    def snapshot_tree(self, state: dict[str, Any]) -> Snapshot:
        """Copies every tensor of ``state`` in place of the original, keeping the structure (for a save
        that DCP plans as is, e.g. a sharded model's state). A ``DTensor`` keeps its mesh, placements and
        global shape; only its local shard is copied. ``skeleton`` is the copied tree."""
        from torch.distributed.tensor import DTensor

        bs = self._acquire()
        namer = _FqnNamer()
        staged: dict[str, torch.Tensor] = {}
        nbytes = 0
        pending_cuda = False

        def take(path: tuple, t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes, pending_cuda
            name = namer(path)
            local = t.to_local() if isinstance(t, DTensor) else t
            local = local.detach()
            if local.device.type == "meta":
                return t
            nbytes += local.numel() * local.element_size()
            copy, in_flight = self._stage(bs, name, local)
            pending_cuda |= in_flight
            staged[name] = copy
            if isinstance(t, DTensor):
                return DTensor.from_local(
                    copy, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )
            return copy

        try:
            tree = _walk(state, (), take)
            return self._finish(bs, tree, staged, nbytes, pending_cuda)
        except BaseException:
            self.release(bs)
            raise

    def snapshot(self, checkpoint: dict[str, Any], rank: int = 0, world_size: int = 1) -> Snapshot:
        """Splits ``checkpoint`` and copies its tensors; returns once the copy is complete.

        With ``world_size > 1`` only this rank's share of the (replicated) tensors is copied.
        """
        skeleton, tensors = split(checkpoint)
        tensors = _share(tensors, rank, world_size)
        bs = self._acquire()
        staged: dict[str, torch.Tensor] = {}
        nbytes = 0
        pending_cuda = False
        try:
            for name, t in tensors.items():
                nbytes += t.numel() * t.element_size()
                staged[name], in_flight = self._stage(bs, name, t)
                pending_cuda |= in_flight
            return self._finish(bs, skeleton, staged, nbytes, pending_cuda)
        except BaseException:
            self.release(bs)
            raise

    def _finish(self, bs: BufferSet, skeleton: Any, staged: dict, nbytes: int, pending_cuda: bool) -> Snapshot:
        if pending_cuda:
            torch.cuda.synchronize()
        self._drop_unused(bs, set(staged))
        return Snapshot(skeleton=skeleton, tensors=staged, nbytes=nbytes, buffer_set=bs)
