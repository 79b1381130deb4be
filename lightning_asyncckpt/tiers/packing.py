"""A share as bytes: a small header and one flat buffer that holds every tensor's bytes.

The header is ``ACKLOCAL`` and ``torch.save`` of the share's structure (its tensors as placeholders) with
where each tensor's bytes are in the flat buffer (64-byte aligned). The snapshot copy itself fills the
flat buffer (a mapped file, :mod:`lightning_asyncckpt.tiers.mapped`), on the training thread: one copy,
and no tensor bytes go through pickling. CRC32 uses ISA-L where it is installed (about 25 GB/s here,
against zlib's 4; the same checksum) and releases the GIL either way.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from lightning_asyncckpt.snapshot import staging, tree

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency where it has wheels
    _crc32 = zlib.crc32

MAGIC = b"ACKLOCAL"
ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Layout:
    """Where each tensor of a share goes in its flat buffer: ``entries`` (name, dtype, shape, offset,
    nbytes, parameter: ``requires_grad`` of an ``nn.Parameter``, else None), ``nbytes`` in all; ``skeleton``
    is the share with placeholders for its tensors."""

    skeleton: Any
    entries: list[tuple[str, torch.dtype, tuple, int, int, bool | None]]
    nbytes: int
    mode: str

    def header(self) -> bytes:
        buf = io.BytesIO()
        torch.serialization.save((self.skeleton, self.entries), buf)
        return MAGIC + buf.getvalue()


def layout(share: dict[str, Any]) -> tuple[Layout, dict[str, torch.Tensor]]:
    """(the training thread) The share's layout, and its tensors by name (the live ones: not copied)."""
    skeleton, tensors = tree.split(share, objects=True)
    parameters = _parameters(share)
    entries, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries.append((name, t.dtype, tuple(t.shape), offset, n, parameters.get(name)))
        offset = _align(offset + n)
    return Layout(skeleton, entries, offset, share["mode"]), tensors


def _parameters(share: dict[str, Any]) -> dict[str, bool]:
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


def unpack(head: bytes, flat: torch.Tensor) -> Any:
    """The share from its header and flat buffer (a ``uint8`` tensor, which its tensors then view)."""
    if head[:len(MAGIC)] != MAGIC:
        raise ValueError("not a local-tier share (bad magic)")
    skeleton, entries = torch.load(io.BytesIO(head[len(MAGIC):]), map_location="cpu", weights_only=False)
    tensors = {}
    for name, dtype, shape, off, n, *parameter in entries:  # shares written before 2026-12-06: 5 fields
        t = flat[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
        if parameter and parameter[0] is not None:
            t = torch.nn.Parameter(t, requires_grad=parameter[0])
        tensors[name] = t
    return tree.join(skeleton, tensors, objects=True)
