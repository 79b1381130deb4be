"""What the worker is given for one save: the job that writes a ``torch.save`` file, or this rank's planned
part of a DCP directory, with the small files beside it (provenance, skeleton, ``meta.pt``).

Runs on the training thread of each saving rank, inside the hand-over (``scheduler``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.engines import Ticket
from lightning_asyncckpt.faults.policy import with_hook
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.format.layout import Layout
from lightning_asyncckpt.pipeline import dcp_plan
from lightning_asyncckpt.pipeline.dcp_plan import DcpPlan
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.save import ExtraFile, Save
from lightning_asyncckpt.pipeline.serialize import torch_bytes
from lightning_asyncckpt.pipeline.settings import Settings
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.version import __version__
from lightning_asyncckpt.write import dcp_writer, torch_file
from lightning_asyncckpt.write.jobs import DcpJob, FileJob


def file_job(run: Run, save: Save, result_path: Path, gate: tuple[str, float] | None) -> Ticket:
    r"""The worker rebuilds the checkpoint dict and ``torch.save``\ s it: stock's file, byte for byte on CPU.
"""
    skeleton, shape, snapshot = save.staged.skeleton, save.staged.shape, save.snapshot
    assert run.engine is not None and skeleton is not None and shape is not None and snapshot is not None
    # The non-tensor state was serialized at save time, once: it is then a snapshot of this step (the
    # worker's queue would pickle it later, in a feeder thread, while training may change a leaf object).
    save.faults.check(save.faults.at_handover, save.path)
    job = FileJob(skeleton, snapshot.tensors, str(save.tmp), str(result_path),
                  with_hook(save.faults, save.write_hook), shape.aliases, shape.locations,
                  frozenset(shape.same_object), gate, shape.kinds)
    return run.engine.schedule(torch_file.write_file_job, (job,))


def plan_dcp(run: Run, agreement: Agreement, settings: Settings, save: Save) -> DcpPlan:
    """Plans this rank's part of a DCP directory (collectively when all ranks write: every rank calls it
    for the same save, at save time)."""
    snapshot, tmp, rank = save.snapshot, save.tmp, save.rank
    assert run.engine is not None and isinstance(tmp, Path) and snapshot is not None
    extra = [(str(tmp / name), data) for name, data in save.extra_files]
    planner_data = None
    if save.layout is Layout.SHARDED:
        state: dict[str, object] = snapshot.skeleton  # the copied tree, flattened by DCP as stock does
    else:  # flat items; where they sit in the dict for plain DCP readers; the exact skeleton beside them
        state, planner_data = dcp_plan.replicated_items(snapshot.skeleton, snapshot.tensors, everything=rank == 0)
        if rank == 0:
            assert save.staged.skeleton is not None
            extra.append((str(tmp / dcp_format.SKELETON_FILE), save.staged.skeleton))
    plan = dcp_plan.plan_save(
        state, tmp, run.engine.writer_cls, settings.thread_count, run.engine.split_by_size,
        save.collective, flatten=save.layout is Layout.SHARDED, planner_data=planner_data if rank == 0 else None,
        cache=run.plans,
    )
    if rank == 0:  # who wrote it, written by the worker before the commit (off the training thread)
        extra.append((str(tmp / commit.INFO_FILE), commit.info_bytes(writer_info(run, agreement, settings, save))))
    return DcpPlan(plan, extra)


def dcp_job(run: Run, save: Save, planned: DcpPlan, result_path: Path, gate: tuple[str, float] | None) -> Ticket:
    """Hands this rank's planned part of a DCP directory to the worker (its buffers hold the snapshot)."""
    tmp = save.tmp
    assert run.engine is not None
    save.faults.check(save.faults.at_handover, save.path)
    plan = planned.plan
    job = DcpJob(run.engine.writer_cls, plan.transforms, plan.buckets, str(result_path),
                 with_hook(save.faults, save.write_hook), planned.extra,
                 save.destination.upload_from(tmp), gate)
    return run.engine.schedule(dcp_writer.write_job, (job,))


def meta_file(meta: dict[str, object]) -> ExtraFile:
    """(global rank 0 of a sharded save) ``meta.pt``, serialized now: a snapshot of the non-tensor state."""
    return ExtraFile(dcp_format.META_FILE, torch_bytes(meta))


def writer_info(run: Run, agreement: Agreement, settings: Settings, save: Save) -> dict[str, object]:
    """The provenance file's content: who wrote the checkpoint, how, and when."""
    world = agreement.world_size
    return {
        "writer": f"lightning-asyncckpt {__version__}",
        "engine": settings.engine,
        "engine_version": getattr(run.engine, "version", None),
        "worker": settings.worker,
        "layout": (save.layout if save.layout is Layout.SHARDED or save.collective else Layout.SINGLE_WRITER).value,
        "world_size": world,
        "writing_ranks": world if save.collective else 1,
        "global_step": save.step,
        "torch": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
