"""A share as bytes: a small header and one flat buffer that holds every tensor's bytes.

``ACKLOCAL`` | header length (8 bytes, little endian) | header | padding to 64 | flat buffer. The header is
``torch.save`` of the share's structure (its tensors as placeholders) and where each tensor's bytes are
in the flat buffer (64-byte aligned). The snapshot copy itself fills the flat buffer, on the training
thread: one copy, and no tensor bytes go through pickling. The writer thread then pickles the small
header, checksums and writes, and the large parts (CRC32, file writes, gloo) release the GIL, so the
copy's thread does not hold up training's Python.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from lightning_asyncckpt.snapshot import tree

MAGIC = b"ACKLOCAL"
ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Packed:
    """A share copied into ``flat``; ``skeleton`` and ``layout`` (name, dtype, shape, offset, nbytes) say
    where each tensor is."""

    skeleton: Any
    layout: list[tuple[str, torch.dtype, tuple, int, int]]
    flat: torch.Tensor
    mode: str

    def prefix(self) -> torch.Tensor:
        """(the writer thread) The magic, the header's length, the header and the padding, as a tensor."""
        buf = io.BytesIO()
        torch.serialization.save((self.skeleton, self.layout), buf)
        header = buf.getvalue()
        head = MAGIC + len(header).to_bytes(8, "little") + header
        return torch.frombuffer(bytearray(head + bytes(_align(len(head)) - len(head))), dtype=torch.uint8)


def pack(share: Any, reuse: torch.Tensor | None = None) -> Packed:
    """(the training thread) Copies every tensor of ``share`` into one flat buffer (``reuse`` where it has
    the size; the previous save's buffer, once its write is done)."""
    skeleton, tensors = tree.split(share, objects=True)
    layout, offset = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        layout.append((name, t.dtype, tuple(t.shape), offset, n))
        offset = _align(offset + n)
    flat = reuse if reuse is not None and reuse.numel() == offset else torch.empty(offset, dtype=torch.uint8)
    for name, dtype, shape, off, n in layout:
        if n:
            flat[off:off + n].view(dtype).view(shape).copy_(tensors[name])
    return Packed(skeleton, layout, flat, share["mode"])


def crc32(parts: list[torch.Tensor]) -> int:
    crc = 0
    for p in parts:
        if p.numel():
            crc = zlib.crc32(memoryview(p.numpy()), crc)
    return crc & 0xFFFFFFFF


def unpack(data: torch.Tensor) -> Any:
    """The share from its bytes (a ``uint8`` tensor, which its tensors then view: no copy)."""
    raw = data.numpy()
    if bytes(raw[:8]) != MAGIC:
        raise ValueError("not a local-tier share (bad magic)")
    size = int.from_bytes(bytes(raw[8:16]), "little")
    skeleton, layout = torch.load(io.BytesIO(bytes(raw[16:16 + size])), map_location="cpu", weights_only=False)
    flat = data[_align(16 + size):]
    tensors = {name: flat[off:off + n].view(dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
               for name, dtype, shape, off, n in layout}
    return tree.join(skeleton, tensors, objects=True)
