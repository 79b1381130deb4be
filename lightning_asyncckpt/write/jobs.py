"""What the trainer hands the writer for one save: a typed job, pickled through the engine's queue (its
tensors travel as shared-memory handles, never copied).

Made on the training thread (``pipeline.write_jobs``); run in the writer process by
``torch_file.write_file_job`` or ``dcp_writer.write_job``. No Lightning imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    WriteHook = Callable[[list], object]  # called with the job's buckets before and after the write

Gate = tuple[str, float]  # (gate file, timeout_s): a lazy snapshot still being copied (``gate.py``)


@dataclass(frozen=True)
class FileJob:
    """One ``torch.save`` file: stock's file, rebuilt from the staged copies.

    Attributes:
        skeleton: the checkpoint dict without its tensors; ``torch.save`` bytes made at save time (so that
            it holds that step's non-tensor state), or the object itself.
        tensors: fqn -> staged copy.
        tmp_path: the hidden sibling of the final path it is written into, or a remote URL.
        result_path: where the writer reports (``worker.report``).
        hook: picklable writer hook (``testing`` faults, a user's ``write_hook``), or None.
        aliases, locations, same_object: what the staged copies no longer know (``torch_file.FileLayout``).
        gate: waited at before the buffers are read, or None.
    """

    skeleton: object
    tensors: dict[str, torch.Tensor]
    tmp_path: str
    result_path: str
    hook: WriteHook | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    locations: dict[str, str] = field(default_factory=dict)
    same_object: frozenset[str] = frozenset()
    gate: Gate | None = None
    kinds: dict[str, str] = field(default_factory=dict)  # ``Parameter``s and tensors that require grad


@dataclass(frozen=True)
class DcpJob:
    """This rank's planned part of a DCP directory.

    Attributes:
        writer_cls: the engine's ``FileSystemWriterAsync`` (its ``write_preloaded_data`` writes each shard).
        transforms: DCP storage transforms that ``write_preloaded_data`` expects.
        buckets: ``(shard path, shard name, (bytes items, tensor items))`` per shard file.
        result_path: where the writer reports.
        hook: picklable writer hook, or None.
        extra_files: ``(path, bytes)`` small files beside the shards (skeleton, provenance, ``meta.pt``).
        upload: ``(local dir, url)``: the written files go to the object store before the report.
        gate: waited at before the buffers are read, or None.
    """

    writer_cls: type
    transforms: list
    buckets: list
    result_path: str
    hook: WriteHook | None = None
    extra_files: tuple[tuple[str, bytes], ...] | list = ()
    upload: tuple[str, str] | None = None
    gate: Gate | None = None
