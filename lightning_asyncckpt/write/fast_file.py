"""The writer's file writes, fast or plain, behind one interface: ``torch_file`` and ``dcp_writer`` never
name ``direct_io``, ``zip_crc`` or ``shard_file``.

- **Fast** (the default): the file is recorded by ``torch.save`` with its CRC32 off, each record's CRC32
  is computed by ISA-L (``zip_crc``), and the bytes go from the staged copies to the disk in aligned
  ``O_DIRECT`` chunks (``direct_io``; buffered where the filesystem refuses ``O_DIRECT``), never copied
  through the page cache. Measured in ``benchmarks/results/findings-profile-write.md``.
- **Plain** (``LIGHTNING_ASYNCCKPT_FAST_WRITE=0`` in the trainer's environment, which its writers inherit):
  the builtin ``open``, ``torch.save`` with its own CRC32, a flush and an fsync. For a filesystem or
  platform where the fast path misbehaves, and as the reference the fast path is tested against.

The bytes of every file are the same either way (``tests/test_fast_file.py``). Runs in the writer, which
calls torch's serializer by its own module (``torch.serialization.save``): a forked writer inherits the
trainer's patches of ``torch.save`` (a test's mock), which must not decide what is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable

import torch

from lightning_asyncckpt.write import direct_io, shard_file, zip_crc

ENV_VAR = "LIGHTNING_ASYNCCKPT_FAST_WRITE"


def enabled() -> bool:
    """(writer, at each write) Whether the fast path is on: unless ``LIGHTNING_ASYNCCKPT_FAST_WRITE=0``."""
    return os.environ.get(ENV_VAR, "1").strip() not in ("0", "false", "False", "no")


def save(obj: object, path: str, tensors: Iterable[torch.Tensor], pickle_protocol: int) -> int:
    """(writer) ``torch.save(obj)`` into the local file ``path``, complete and fsync'd when it returns;
    ``tensors``: the staged tensors ``obj`` holds (their memory is written from directly). Returns the
    file's size."""
    if not enabled():
        with open(path, "wb") as f:
            torch.serialization.save(obj, f, pickle_protocol=pickle_protocol)
            f.flush()
            os.fsync(f.fileno())
            return f.tell()
    with direct_io.DirectFile(path, direct_io.storage_regions(tensors), hold=True) as f:
        with zip_crc.crc32_off():
            torch.serialization.save(obj, f, pickle_protocol=pickle_protocol)
        zip_crc.fill(f.recorded, f.release)
    return f.tell()


def shard_opener(buckets: list) -> Callable[..., object]:
    """(writer) The ``open`` an engine's ``write_preloaded_data`` writes a DCP part's shards with: each
    shard of ``buckets`` (``(path, name, (bytes items, tensor items))``) as a :class:`shard_file.ShardFile`
    over its staged tensors, anything else the builtin ``open``; plain: the builtin ``open``."""
    if not enabled():
        return open
    regions = {b[0]: direct_io.storage_regions(t for _, t in b[2][1]) for b in buckets}
    return direct_io.Opener(regions, shard_file.ShardFile)


def shard_crc(transforms: list) -> contextlib.AbstractContextManager:
    """(each shard writer thread) Around the engine's write of one shard: ``torch.save``'s own CRC32 off
    where the fast shard file computes it (unless a storage transform hides the archives from it)."""
    return shard_file.crc32_off_for(transforms) if enabled() else contextlib.nullcontext()
