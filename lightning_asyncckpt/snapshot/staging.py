"""Snapshot of a checkpoint dict: the only module that touches tensor data on the save path.

A checkpoint is split (:mod:`lightning_asyncckpt.snapshot.tree`) into a ``skeleton`` and flat ``tensors``.

The tensors handed to the writer are copies taken at save time into reused host buffers, so the
training step may change every parameter as soon as ``snapshot`` returns. CUDA tensors are copied into
pinned buffers on a side stream (ordered after the kernels already queued on the current stream).
TransformerEngine's quantized tensors (FP8 / MXFP8 / NVFP4) are written dequantized, in the dtype they
report, so that the checkpoint holds plain tensors that any reader can load; other tensor subclasses
(torchao's low-bit optimizer states) are written as they are (:mod:`lightning_asyncckpt.snapshot.subclasses`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from lightning_asyncckpt.snapshot import subclasses
from lightning_asyncckpt.snapshot.buffer_pool import BufferPool, Lease
from lightning_asyncckpt.snapshot.tree import (
    SKELETON_KEY,
    FqnNamer,
    join,
    partition,
    share,
    split,
    walk,
    wrapper_of,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["SKELETON_KEY", "Deferred", "Snapshot", "Stager", "dequantized", "is_quantized", "join", "partition", "split"]

def is_quantized(t: torch.Tensor) -> bool:
    """Whether ``t`` is written dequantized: one of TransformerEngine's quantized tensors (``Float8Tensor``,
    ``MXFP8Tensor``, blockwise and NVFP4 tensors), recognized by its type's module
    (:func:`subclasses.is_transformer_engine`). Having a ``dequantize`` of its own is not the test: torchao's
    low-bit optimizer states have one too, and stock writes them as they are (so do we)."""
    return subclasses.is_transformer_engine(t)


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the values of quantized ``t``, in the dtype ``t`` reports (MXFP8 reports bf16),
    so that the checkpoint's metadata and data agree. Plain tensors are returned as they are."""
    if not is_quantized(t):
        return t
    with torch.no_grad():
        out = t.dequantize()
    if type(out) is not torch.Tensor:  # a subclass that dequantizes into another wrapper
        out = out.as_subclass(torch.Tensor) if not is_quantized(out) else dequantized(out)
    if out.dtype != t.dtype:
        out = out.to(t.dtype)
    return out.detach()


def _pin_shared(buf: torch.Tensor) -> torch.Tensor:
    """Page-locks a shared-memory buffer in place (``cudaHostRegister``), so that a device-to-host copy
    into it is a fast asynchronous DMA and a spawned worker still maps the same pages. The registration
    is dropped when the buffer is freed."""
    nbytes = buf.numel() * buf.element_size()
    if nbytes == 0:
        return buf
    cudart = torch.cuda.cudart()
    ptr = buf.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"lightning-asyncckpt: pinning a {nbytes}-byte staging buffer failed (cudaError {err})")
    weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, ptr)
    return buf


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


def _rewrap(dt: DTensor, local: torch.Tensor) -> DTensor:
    """A ``DTensor`` like ``dt`` (mesh, placements, global shape and stride) whose local shard is the
    host copy ``local``. ``DTensor.from_local`` would move the copy back to the mesh's device (a CUDA
    mesh), so the DTensor is built from ``dt``'s spec, as torch's own CPU offload of state dicts does."""
    from torch.distributed.tensor import DTensor

    try:
        return DTensor(local, dt._spec, requires_grad=False)
    except (AttributeError, TypeError):  # a torch whose DTensor constructor differs
        if local.device.type != dt.device_mesh.device_type:
            raise
        return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                                  stride=dt.stride())


# a lazy snapshot's rule: the tensors that prove a checkpoint tensor unchanged, or None to copy it now
Defer = Callable[[torch.Tensor], "list[torch.Tensor] | None"]


class Deferred(NamedTuple):
    """A tensor left to a lazy snapshot's background copy (:mod:`lightning_asyncckpt.snapshot.lazy`)."""

    name: str
    source: torch.Tensor
    buffer: torch.Tensor  # allocated, filled by the copy
    watch: list[torch.Tensor]  # whose version counters prove the source unchanged until it is copied


@dataclass
class Snapshot:
    skeleton: object
    tensors: dict[str, torch.Tensor]
    nbytes: int
    buffer_set: Lease | None  # this save's hold on its buffers, released when its write ends
    # tensors left for a lazy copy (``snapshot(defer=...)``); their buffers in ``tensors`` hold nothing yet
    deferred: list[Deferred] = field(default_factory=list)


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
        self._pool = BufferPool()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one side stream per CUDA device, for the copies
        self._in_flight: list[torch.Tensor] = []  # sources of copies still running on a side stream
        self._ordered: set[torch.device] = set()  # side streams already after the current stream's work

    def release(self, lease: Lease | None) -> None:
        """The write that used ``lease``'s buffers ended (or its save was dropped): the save following it,
        or a later one, may overwrite them."""
        self._pool.release(lease)

    def clear(self) -> None:
        self._pool.clear()

    def buffers(self) -> list[torch.Tensor]:
        """Every host buffer held for reuse, busy or not (what staging costs in host memory)."""
        return self._pool.buffers()

    def _buffer(self, bs: Lease, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = bs.buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            cuda = t.device.type == "cuda"
            if self.shared:
                buf = _shared_empty(t.shape, t.dtype)
                if cuda:
                    buf = _pin_shared(buf)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
            bs.buffers[name] = buf
        return buf

    def prepare(self, checkpoint: dict[str, object], rank: int = 0, world_size: int = 1) -> int:
        """Allocates (and faults in) the buffers that a snapshot of a checkpoint like this one needs, so
        that the first save costs what later ones do. Returns the bytes prepared."""
        _, tensors = split(checkpoint)
        tensors = share(tensors, rank, world_size, wrapper_of(checkpoint) if world_size > 1 else None)
        bs = self._pool.acquire()
        nbytes = 0
        for name, t in tensors.items():
            t = dequantized(t)  # a buffer for what will be copied: the dequantized values
            if not self.copy_cpu and t.device.type == "cpu":
                continue
            self._buffer(bs, name, t).zero_()
            nbytes += t.numel() * t.element_size()
        self.release(bs)
        return nbytes

    def _stage(self, bs: Lease, name: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copies ``t`` into ``bs`` (or keeps it, when fork's copy-on-write is the snapshot).
        Returns the staged tensor and whether a CUDA copy is still in flight."""
        quantized = is_quantized(t)
        if quantized:
            subclasses.warn_dequantized(name, t)
            t = dequantized(t)  # on the current stream, like the training step's kernels
            self._ordered.discard(t.device)  # the side stream must wait for this kernel too
        if not self.copy_cpu and t.device.type == "cpu" and (quantized or _is_whole_storage(t)):
            return t, False  # fork's copy-on-write keeps it (a dequantized tensor is ours alone)
        buf = self._buffer(bs, name, t)
        if t.device.type != "cuda":
            buf.copy_(t)
            return buf, False
        # A side stream, so that the copies overlap nothing the training step queues later; it waits for
        # the kernels already queued (the step that produced ``t``, and a dequantization): once per
        # snapshot and device, again only after a dequantization.
        side = self._streams.get(t.device)
        if side is None:
            side = self._streams[t.device] = torch.cuda.Stream(device=t.device)
        if t.device not in self._ordered:
            side.wait_stream(torch.cuda.current_stream(t.device))
            self._ordered.add(t.device)
        with torch.cuda.stream(side):
            buf.copy_(t, non_blocking=True)
        self._in_flight.append(t)  # kept alive until the copy is done
        return buf, True

    @staticmethod
    def _drop_unused(bs: Lease, used: set[str]) -> None:
        # drop buffers of tensors that are gone, so that memory does not grow with changing states
        for name in list(bs.buffers):
            if name not in used:
                del bs.buffers[name]

    def snapshot_tree(self, state: dict[str, object], defer: Defer | None = None, after: Lease | None = None) -> Snapshot:
        """Copies every tensor of ``state`` in place of the original, keeping the structure (for a save
        that DCP plans as is, e.g. a sharded model's state). A ``DTensor`` keeps its mesh, placements and
        global shape; only its local shard is copied. A wrapper subclass (torchao's optimizer states) is kept,
        rebuilt around copies of its inner tensors. ``skeleton`` is the copied tree. ``defer`` and
        ``after`` as in :meth:`snapshot`; ``defer`` is asked about each local shard."""
        from torch.distributed.tensor import DTensor

        bs = self._pool.acquire(after=after if defer is not None else None)
        namer = FqnNamer()
        staged: dict[str, torch.Tensor] = {}
        deferred: list[Deferred] = []
        nbytes = 0
        pending_cuda = False

        def take(path: tuple, t: torch.Tensor) -> torch.Tensor:
            nonlocal nbytes, pending_cuda
            local = t.to_local() if isinstance(t, DTensor) else t
            local = local.detach()
            if subclasses.is_wrapper(local):  # a DTensor's local wrapper (torchao's state under FSDP2)
                copy = walk(local, path, take)  # its inner tensors are staged; the wrapper is kept
                return _rewrap(t, copy) if isinstance(t, DTensor) else copy
            name = namer(path)
            if local.device.type == "meta":
                return t
            nbytes += local.numel() * local.element_size()
            copy, in_flight = self._take(bs, name, local, defer, deferred)
            pending_cuda |= in_flight
            staged[name] = copy
            if isinstance(t, DTensor):
                return _rewrap(t, copy)
            return copy

        try:
            return self._finish(bs, walk(state, (), take), staged, nbytes, pending_cuda, deferred)
        except BaseException:
            self._abandon(bs, pending_cuda)
            raise

    def snapshot(self, checkpoint: dict[str, object], rank: int = 0, world_size: int = 1,
                 defer: Defer | None = None, after: Lease | None = None, objects: bool = False) -> Snapshot:
        """Splits ``checkpoint`` (``objects``: see :func:`tree.walk`) and copies its tensors; returns once the
        copy is complete.

        With ``world_size > 1`` only this rank's share of the (replicated) tensors is copied. ``defer``
        (the lazy snapshot, :mod:`lightning_asyncckpt.snapshot.lazy`) picks plain tensors whose buffers are
        allocated but left empty, listed in ``Snapshot.deferred`` for the caller to fill.

        ``after`` (with ``defer``): the lease of the newest write in flight. When no set is free, this
        snapshot follows it into its set instead of making a second copy of the state
        (:mod:`lightning_asyncckpt.snapshot.buffer_pool`); the set is not ready (``buffer_set.ready``) until that
        write ends, so every tensor is then left to the caller's background copy, those copied at save
        time as private copies (no version to watch: they are ours).
        """
        skeleton, tensors = split(checkpoint, objects)
        tensors = share(tensors, rank, world_size, wrapper_of(checkpoint, objects) if world_size > 1 else None)
        bs = self._pool.acquire(after=after if defer is not None else None)
        staged: dict[str, torch.Tensor] = {}
        deferred: list[Deferred] = []
        nbytes = 0
        pending_cuda = False
        try:
            for name, t in tensors.items():
                nbytes += t.numel() * t.element_size()
                staged[name], in_flight = self._take(bs, name, t, defer, deferred)
                pending_cuda |= in_flight
            return self._finish(bs, skeleton, staged, nbytes, pending_cuda, deferred)
        except BaseException:
            self._abandon(bs, pending_cuda)
            raise

    def _take(self, bs: Lease, name: str, t: torch.Tensor, defer: Defer | None,
              deferred: list[Deferred]) -> tuple[torch.Tensor, bool]:
        """Stages ``t`` (see :meth:`_stage`), or leaves it to the background copy (listed in ``deferred``):
        a tensor that ``defer`` picks, and, while ``bs`` is still read by the write before it, every other
        tensor as a private copy taken now."""
        watch = self._deferred(defer, t)
        if watch is None and bs.ready.is_set():
            return self._stage(bs, name, t)
        buf = self._buffer(bs, name, t)
        if watch is None:  # it may change before the optimizer step (a buffer, a scalar): copied now
            if is_quantized(t):
                subclasses.warn_dequantized(name, t)
            with torch.no_grad():
                t, watch = dequantized(t).detach().to("cpu", copy=True), []
        deferred.append(Deferred(name, t, buf, watch))
        return buf, False

    def _deferred(self, defer: Defer | None, t: torch.Tensor) -> list[torch.Tensor] | None:
        # a fork writer's snapshot is the fork; a quantized tensor is dequantized, a new tensor, at save time
        if defer is None or not self.copy_cpu or is_quantized(t):
            return None
        return defer(t)

    def _wait_copies(self) -> None:
        """Blocks until every device-to-host copy of this snapshot is in its host buffer."""
        for side in self._streams.values():
            side.synchronize()
        self._in_flight.clear()
        self._ordered.clear()

    def _finish(self, bs: Lease, skeleton: object, staged: dict, nbytes: int, pending_cuda: bool,
                deferred: list[Deferred]) -> Snapshot:
        if pending_cuda:
            self._wait_copies()
        self._drop_unused(bs, set(staged))
        return Snapshot(skeleton=skeleton, tensors=staged, nbytes=nbytes, buffer_set=bs, deferred=deferred)

    def _abandon(self, bs: Lease, pending_cuda: bool) -> None:
        # a snapshot that failed half-way: its copies in flight land first, then its buffers are free again
        if pending_cuda:
            self._wait_copies()
        self.release(bs)
