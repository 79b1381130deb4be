"""A share as bytes: a small header and one flat buffer that holds every tensor's bytes.

The header is ``ACKLOCAL`` and ``torch.save`` of the share's structure (its tensors as placeholders) with
where each tensor's bytes are in the flat buffer (64-byte aligned). The snapshot copy itself fills the
flat buffer (a mapped file, :mod:`lightning_asyncckpt.tiers.mapped`), on the training thread: one copy,
and no tensor bytes go through pickling. CRC32 uses ISA-L where it is installed (about 25 GB/s here,
against zlib's 4; the same checksum) and releases the GIL either way.

The header is read as stock reads a checkpoint: ``torch.load(weights_only=True)`` unless the caller asked for
``weights_only=False``, so that no code runs from a file on disk that the caller did not say it trusts. The
tier's own types (:class:`~lightning_asyncckpt.tiers.shares.LocalShard` and the ``DTensor`` placements it
holds) are allowed by name.
"""

from __future__ import annotations

import io
import pickle
import re
import zlib
from dataclasses import dataclass

import torch

from lightning_asyncckpt.snapshot import staging, tree

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency where it has wheels
    _crc32 = zlib.crc32

MAGIC = b"ACKLOCAL"
ALIGN = 64


class UnsafeShareError(pickle.UnpicklingError):
    """A share's header holds what ``torch.load(weights_only=True)`` refuses (stock raises the same type)."""

    @classmethod
    def of_step(cls, problems: list[str], root: object, dir: object) -> UnsafeShareError:
        """(every rank, alike) A restore of the tier at ``root`` (under ``LocalTier.dir``) refused for ``problems``
        (each naming a header file), with how to opt out, as ``torch.load`` and Lightning put it."""
        return cls(f"lightning-asyncckpt: the local tier's step in {root} was not loaded: its header(s) hold more"
                   " than torch.load(weights_only=True) allows, which is how a checkpoint's pickle runs code: "
                   + "; ".join(problems) + ". Nothing of it was run. The tier makes its directories 0700, so only"
                   " your own user (or root) can have written it. Fix: if you trust these files, resume with"
                   " weights_only=False (`trainer.fit(..., weights_only=False)`, `fabric.load(...,"
                   f" weights_only=False)`); otherwise remove them (`lightning-asyncckpt local {dir} --remove`) and"
                   " resume from the persistent tier.")


def _safe_types() -> list:
    """The classes a sharded share's header holds besides what ``weights_only`` allows: plain data."""
    from torch.distributed.tensor import placement_types

    from lightning_asyncckpt.tiers.shares import LocalShard

    return [LocalShard, *(getattr(placement_types, n) for n in ("Shard", "Replicate", "Partial", "_StridedShard")
                          if hasattr(placement_types, n))]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Layout:
    """Where each tensor of a share goes in its flat buffer: ``entries`` (name, dtype, shape, offset,
    nbytes, parameter: ``requires_grad`` of an ``nn.Parameter``, else None), ``nbytes`` in all; ``skeleton``
    is the share with placeholders for its tensors."""

    skeleton: object
    entries: list[tuple[str, torch.dtype, tuple, int, int, bool | None]]
    nbytes: int
    mode: str

    def header(self) -> bytes:
        buf = io.BytesIO()
        torch.serialization.save((self.skeleton, self.entries), buf)
        return MAGIC + buf.getvalue()


def layout(share: dict[str, object]) -> tuple[Layout, dict[str, torch.Tensor]]:
    """(the training thread) The share's layout, and its tensors by name (the live ones: not copied)."""
    skeleton, tensors = tree.split(share, objects=True)
    parameters = _parameters(share)
    entries, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries.append((name, t.dtype, tuple(t.shape), offset, n, parameters.get(name)))
        offset = _align(offset + n)
    return Layout(skeleton, entries, offset, share["mode"]), tensors


def _parameters(share: dict[str, object]) -> dict[str, bool]:
    """``requires_grad`` of each ``nn.Parameter`` of the share, by the name :func:`tree.split` gives it (which
    hands out detached tensors): unpacked as a ``Parameter`` again, as ``torch.load`` gives one back."""
    namer, found = tree.FqnNamer(), {}

    def see(path: tuple, t: torch.Tensor) -> torch.Tensor:
        name = namer(path)
        if isinstance(t, torch.nn.Parameter):
            found[name] = t.requires_grad
        return t

    tree.walk(share, (), see, objects=True)
    return found


def copy_into(lay: Layout, tensors: dict[str, torch.Tensor], flat: torch.Tensor,
              defer: staging.Defer | None = None) -> list[staging.Deferred]:
    """(the training thread) The one copy: every tensor into its place in ``flat`` (``lay.nbytes``). With
    ``defer`` (a lazy snapshot's rule), the tensors it watches are left out and returned, each with its place,
    for a :class:`~lightning_asyncckpt.snapshot.lazy.BackgroundCopy`."""
    deferred = []
    for name, dtype, shape, off, n, _parameter in lay.entries:
        if n:
            place = flat[off:off + n].view(dtype).view(shape)
            watch = defer(tensors[name]) if defer is not None else None
            if watch:
                deferred.append(staging.Deferred(name, tensors[name], place, watch))
            else:
                place.copy_(tensors[name])
    return deferred


def crc32(data: torch.Tensor | bytes, value: int = 0) -> int:
    """CRC32 of a ``uint8`` tensor's bytes (or of ``bytes``), continuing from ``value``."""
    if isinstance(data, torch.Tensor):
        if not data.numel():
            return value & 0xFFFFFFFF
        data = memoryview(data.numpy())
    return _crc32(data, value) & 0xFFFFFFFF


def _reason(e: BaseException) -> str:
    """The cause in torch's long ``weights_only`` message (between its boilerplate paragraphs)."""
    parts = [p.strip() for p in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).split("\n\n") if p.strip()]
    cause = next((p for p in parts[1:] if not p.startswith("Check the documentation")), parts[0] if parts else "")
    return cause.removeprefix("WeightsUnpickler error: ").splitlines()[0].rstrip(".") if cause else type(e).__name__


def unpack(head: bytes, flat: torch.Tensor, weights_only: bool = True) -> object:
    """The share from its header and flat buffer (a ``uint8`` tensor, which its tensors then view). The header
    is read with ``torch.load(weights_only=...)``: raises :class:`UnsafeShareError` where it holds more than
    ``weights_only=True`` allows (a pickle that would run code is never run)."""
    if head[:len(MAGIC)] != MAGIC:
        raise ValueError("not a local-tier share (bad magic)")
    data = io.BytesIO(head[len(MAGIC):])
    if weights_only:
        try:
            with torch.serialization.safe_globals(_safe_types()):
                skeleton, entries = torch.load(data, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeShareError(_reason(e)) from None
    else:
        skeleton, entries = torch.load(data, map_location="cpu", weights_only=False)
    tensors = {}
    for name, dtype, shape, off, n, *parameter in entries:  # shares written before 2026-12-06: 5 fields
        t = flat[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
        if parameter and parameter[0] is not None:
            t = torch.nn.Parameter(t, requires_grad=parameter[0])
        tensors[name] = t
    return tree.join(skeleton, tensors, objects=True)
