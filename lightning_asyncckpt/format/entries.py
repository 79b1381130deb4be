"""The entries of a DCP ``.metadata`` are consistent with each other and with the bytes stored for them, checked
before anything is allocated for a load.

A load allocates each tensor at the size ``.metadata`` declares (this package's reader and stock DCP's alike)
before it reads a byte of it: a damaged or crafted ``.metadata`` declaring a tensor of 2**40 elements would make
the load allocate terabytes, or grow the process until the kernel kills it. :func:`entry_problems` accepts a
tensor only if its chunks lie within its size and tile it exactly, each chunk has its stored item, and each
chunk's elements fit in the bytes stored for it at one bit each (``length`` in ``storage_data``; an item that
DCP's storage transforms wrote is compared with its decoded bytes, :func:`chunk_elements`). One bit, not the
dtype's size: stock DCP stores a tensor subclass as it is, and torchao's 4-bit optimizer states hold a float32
tensor's elements in half a byte each. With the items' byte ranges disjoint (``integrity`` checks that), a load
allocates at most ``8 x element size`` times the bytes the checkpoint holds, however its ``.metadata`` was made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )


def _dims(value: object) -> list[int] | None:
    """``value`` as a list of non-negative ints (a ``torch.Size``, tuple or list), or None."""
    if not isinstance(value, (tuple, list)):
        return None
    dims = list(value)
    return dims if all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims) else None


def _numel(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _itemsize(md: TensorStorageMetadata) -> int | None:
    import torch

    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


BITS_PER_BYTE = 8  # the densest a tensor's elements are stored without a storage transform: one bit each


def chunk_elements(metadata: Metadata) -> dict[MetadataIndex, int]:
    """{storage index: elements of the tensor chunk it holds} for every chunk whose entry is well formed: the
    stored item must hold at least one bit for each."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or _itemsize(md) is None \
                or not isinstance(getattr(md, "chunks", None), list):
            continue
        for i, c in enumerate(md.chunks):
            offsets, sizes = _dims(getattr(c, "offsets", None)), _dims(getattr(c, "sizes", None))
            if offsets is not None and sizes is not None:
                out[MetadataIndex(fqn, tuple(offsets), i)] = _numel(sizes)
    return out


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    return all(ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1]))


def _tiling_problem(md: TensorStorageMetadata) -> str | None:
    """Why the chunks of the tensor entry ``md`` do not lie within its size or do not tile it exactly, or None."""
    size = _dims(getattr(md, "size", None))
    if size is None:
        return f" has the size {getattr(md, 'size', None)!r}"
    if _itemsize(md) is None:
        return f" has the dtype {getattr(getattr(md, 'properties', None), 'dtype', None)!r}"
    if not isinstance(getattr(md, "chunks", None), list):
        return f" has the chunks {getattr(md, 'chunks', None)!r}"
    boxes = []
    for c in md.chunks:
        offsets, sizes = _dims(getattr(c, "offsets", None)), _dims(getattr(c, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            return f" has a chunk {c!r} that is not one of its {len(size)}-dimensional size {size}"
        if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            return f" has a chunk of size {sizes} at {offsets}, outside its size {size}"
        if _numel(sizes):
            boxes.append((offsets, sizes))
    total = sum(_numel(b[1]) for b in boxes)
    if total != _numel(size):
        return (f": its chunks {[list(c.sizes) for c in md.chunks]} at {[list(c.offsets) for c in md.chunks]} do not "
                f"fill its size {size} ({_numel(size)} elements, the chunks hold {total})")
    if size:  # the same total and no two chunks overlapping: they tile the size (a sweep along dimension 0)
        boxes.sort(key=lambda b: b[0][0])
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if b[0][0] >= a[0][0] + a[1][0]:
                    break
                if _overlap(a, b):
                    return f" has overlapping chunks at {a[0]} and {b[0]}"
    return None


def too_large(where: str, chunk: ChunkStorageMetadata, elements: int, stored: int) -> str:
    return (f"{where}: its chunk of size {list(chunk.sizes)} at {list(chunk.offsets)} declares {elements} elements, "
            f"more than the {stored} bytes stored for it hold at one bit each: refused before anything is allocated")


def _name(path: object) -> str:
    return str(path).rsplit("/", 1)[-1]


def entry_problems(metadata_file: object, metadata: Metadata) -> list[str]:
    """(any rank, before a load allocates anything) What is wrong with the entries of ``metadata`` (read from
    ``metadata_file``, which each problem names with the item): tensors whose chunks do not tile their size,
    chunks or objects with no stored item, chunks larger than the bytes stored for them."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    problems = []
    for name in ("state_dict_metadata", "storage_data"):  # fields a damaged pickle may have renamed
        if not isinstance(getattr(metadata, name, None), dict):
            return [f"{metadata_file}: its {name} is a {type(getattr(metadata, name, None)).__name__}, not a dict"]
    storage = metadata.storage_data
    need = chunk_elements(metadata)
    for fqn, md in metadata.state_dict_metadata.items():
        where = f"{metadata_file}: item {fqn!r}"
        if not isinstance(md, TensorStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                problems.append(f"{where} has no storage entry in {_name(metadata_file)}")
            continue
        problem = _tiling_problem(md)
        if problem is not None:
            problems.append(f"{where}{problem}: refused before anything is allocated for it")
            continue
        for i, c in enumerate(md.chunks):
            key = MetadataIndex(fqn, tuple(c.offsets), i)
            stored = storage.get(key)
            if stored is None:
                problems.append(f"{where} chunk at {list(c.offsets)} has no storage entry in {_name(metadata_file)}")
            elif not getattr(stored, "transform_descriptors", None) and isinstance(stored.length, int) \
                    and need[key] > BITS_PER_BYTE * stored.length:
                problems.append(too_large(where, c, need[key], stored.length))
    return problems
