"""A 2-rank DDP (gloo, CPU) training job for the multi-process tests. Run by tests/test_ddp.py.

Each rank writes ``<out>/rank<r>.json`` with what it saw. Lightning relaunches this script for rank 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from helpers import (  # noqa: E402
    FailOnRankFrom,
    HoldWriteAt,
    SlowSteps,
    SnapshotRecorder,
    TinyModel,
    assert_tree_equal,
    clone_tree,
    live_children,
    loader,
    other_children,
    run_job,
)
from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback, CheckpointWriteError, testing  # noqa: E402


def _trainer(args, plugins, callbacks, **kw):
    opts = dict(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=args.out, num_sanity_val_steps=0,
    )
    opts.update(kw)
    t = L.Trainer(plugins=plugins, callbacks=callbacks, **opts)
    return t


_PEERS: set = set()


def _own_children(trainer):
    """Child processes other than the DDP ranks Lightning launched (rank 0 is their parent)."""
    launcher = getattr(trainer.strategy, "launcher", None)
    _PEERS.update(p.pid for p in getattr(launcher, "procs", []))
    return other_children(lambda pid, line: pid in _PEERS)


def _no_kill(trainer):
    # Lightning kills the other ranks when rank 0 fails; we want to see every rank raise by itself.
    launcher = getattr(trainer.strategy, "launcher", None)
    if launcher is not None:
        launcher.kill = lambda *a, **k: None


def _recorded_checkpointing(args, top_k):
    """A plugin whose writes outlast a few steps, a snapshot recorder, and a top-k ModelCheckpoint."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(0.1)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), monitor="step", mode="max", save_top_k=top_k,
                         every_n_train_steps=4, save_last=True)
    return io, SnapshotRecorder(), ck


def case_fit(args, report):
    io, rec, ck = _recorded_checkpointing(args, top_k=3)
    data = dict(width=64, n=64, batch_size=4)  # 8 steps per epoch per rank
    L.seed_everything(1)
    model = TinyModel(width=64)
    t = _trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16)
    t.fit(model, loader(**data))
    report["children_after_fit"] = _own_children(t)
    report["files"] = sorted(os.listdir(ck.dirpath))
    report["steps_while_pending"] = rec.steps_while_pending
    if t.global_rank == 0:
        for name in report["files"]:
            loaded = io.load_checkpoint(os.path.join(ck.dirpath, name), weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], name)
        report["verified"] = report["files"]

    # Resume from our checkpoint with the same plugin, and, for reference, with stock Lightning from a
    # torch.save copy of the same checkpoint: the two continuations must be bit-identical.
    path = os.path.join(ck.dirpath, "epoch=0-step=8.ckpt")
    saved = io.load_checkpoint(path, weights_only=False)
    finals = []
    for plugin, ckpt_path in ((io, path), (TorchCheckpointIO(), os.path.join(args.out, "stock.ckpt"))):
        if plugin is not io and t.global_rank == 0:
            torch.save(saved, ckpt_path)
        torch.distributed.barrier()
        L.seed_everything(99)
        resumed = TinyModel(width=64)
        check = ResumeCheck()
        cbs = [check] + ([AsyncFinalizerCallback()] if plugin is io else [])
        t2 = _trainer(args, [plugin], cbs, max_steps=16, enable_checkpointing=False)
        t2.fit(resumed, loader(**data), ckpt_path=ckpt_path)
        assert check.step == 8
        assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
        assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
        finals.append(clone_tree(resumed.state_dict()))
        report.setdefault("resumed_steps", []).append(t2.global_step)
        report["children_after_resume"] = _own_children(t2)
    assert_tree_equal(finals[0], finals[1], "ours vs stock resume")
    report["resume_exact"] = True


class ResumeCheck(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step
        self.weights = clone_tree(pl_module.state_dict())
        self.optim = clone_tree(trainer.optimizers[0].state_dict()["state"])


def case_die(args, report):
    """Every rank raises at step 6 while rank 0 is still writing the step-4 save: it must land."""
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    io.write_hook = testing.DelayWrite(1.5)
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=4, save_top_k=-1)

    class Dies(TinyModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 6:
                raise ValueError(f"boom on rank {self.global_rank}")
            return super().training_step(batch, batch_idx)

    t = _trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16)
    _no_kill(t)
    try:
        t.fit(Dies(width=64), loader(width=64, n=64, batch_size=4))
    except ValueError as e:
        report["raised"] = str(e)
    report["children_after_fit"] = _own_children(t)
    if t.global_rank == 0:
        report["files"] = sorted(os.listdir(ck.dirpath))
        loaded = io.load_checkpoint(os.path.join(ck.dirpath, "epoch=0-step=4.ckpt"), weights_only=False)
        got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
        assert_tree_equal(got, rec.copies[4], "step 4")
        report["verified"] = True


def case_parallel(args, report):
    """AsyncDDPStrategy: every rank writes a share of the replicated state."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io, rec, ck = _recorded_checkpointing(args, top_k=2)
    data = dict(width=96, n=64, batch_size=4)
    L.seed_everything(1)
    t = _trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=16, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=96, layers=3), loader(**data))
    report["children_after_fit"] = _own_children(t)
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))
    report["steps_while_pending"] = rec.steps_while_pending
    if t.global_rank == 0:
        for name in report["files"]:
            path = os.path.join(ck.dirpath, name)
            loaded = io.load_checkpoint(path, weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], name)
            report.setdefault("shards", {})[name] = {
                f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
            }
        state = rec.copies[16]
        report["state_bytes"] = sum(
            t.numel() * t.element_size() for t in _tensors(state)
        )
    # resume on 2 ranks with the same strategy: exact at the start of training
    saved = io.load_checkpoint(os.path.join(ck.dirpath, "epoch=1-step=12.ckpt"), weights_only=False)
    check = ResumeCheck()
    t2 = _trainer(args, [io], [AsyncFinalizerCallback(), check], max_steps=16, enable_checkpointing=False,
                  strategy=AsyncDDPStrategy())
    t2.fit(TinyModel(width=96, layers=3), loader(**data), ckpt_path=os.path.join(ck.dirpath, "epoch=1-step=12.ckpt"))
    assert check.step == 12
    assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
    assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
    report["resume_exact"] = True
    report["children_after_resume"] = _own_children(t2)


def case_load1(args, report):
    """Resume on 2 ranks (AsyncDDPStrategy) from a checkpoint written on 1 rank (``--dir``)."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    saved = io.load_checkpoint(args.dir, weights_only=False)
    check = ResumeCheck()
    t = _trainer(args, [io], [AsyncFinalizerCallback(), check], max_steps=saved["global_step"] + 2,
                 enable_checkpointing=False, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=96, layers=3), loader(width=96, n=64, batch_size=4), ckpt_path=args.dir)
    assert check.step == saved["global_step"]
    assert_tree_equal(check.weights, clone_tree(dict(saved["state_dict"])), "weights at resume")
    assert_tree_equal(check.optim, saved["optimizer_states"][0]["state"], "optimizer at resume")
    report["resume_exact"] = True
    report["children_after_fit"] = _own_children(t)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _failing_run(args, report, callbacks, explicit_callback=True, weights_only=False, snapshot="eager", **kw):
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot=snapshot)
    dirpath = os.path.join(args.dir or args.out, "c")
    ck = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=4, save_top_k=-1, save_weights_only=weights_only)
    cbs = ([AsyncFinalizerCallback()] if explicit_callback else []) + [SlowSteps()] + [cb(io) for cb in callbacks] + [ck]
    t = _trainer(args, [io], cbs, max_steps=40, **kw)
    _no_kill(t)
    t0 = time.monotonic()
    try:
        t.fit(TinyModel(width=128), loader(width=128))
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"type": type(e).__name__, "path": e.path, "ranks": list(e.ranks), "errno": e.errno,
                            "error_type": e.error_type, "message": str(e)}
    report["fit_s"] = time.monotonic() - t0
    report["global_step"] = t.global_step
    report["children_after_fit"] = _own_children(t)
    torch.distributed.barrier()  # rank 0 has finished cleaning up before anyone looks at the directory
    report["files"] = sorted(os.listdir(dirpath)) if os.path.isdir(dirpath) else []


class FillDiskAt(L.Callback):
    def __init__(self, io, mnt, step):
        self.io, self.mnt, self.step = io, mnt, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            self.io.wait_for_local_writes()  # the step-4 checkpoint is written first
            st = os.statvfs(self.mnt)
            with open(os.path.join(self.mnt, "filler"), "wb") as f:
                f.write(b"\0" * (st.f_bavail * st.f_frsize - 4096))


class KillWorkerAt(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            self.io.write_hook = None
            for pid in self.io.worker_pids():
                os.kill(pid, signal.SIGKILL)


class SlowWritesFrom(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1:
            if trainer.global_rank == 0:
                self.io.wait_for_local_writes()  # earlier saves are written before the slow one
            self.io.write_hook = testing.DelayWrite(30.0)


class FailWritesFrom(L.Callback):
    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1:
            self.io.write_hook = testing.FailWrite()


class UnpicklableAt(L.Callback):
    """Puts an object that cannot be pickled into the checkpoint at one save (bad input, on rank 0)."""

    def __init__(self, io, step):
        self.io, self.step = io, step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_step == self.step:
            import threading

            if trainer.global_rank == 0:
                self.io.wait_for_local_writes()  # the earlier save is committed first
            checkpoint["bad"] = threading.Lock()


def case_badinput(args, report):
    _failing_run(args, report, [lambda io: UnpicklableAt(io, 8)])


def case_parallel_fail(args, report):
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: FailOnRankFrom(io, 8, rank=1)], strategy=AsyncDDPStrategy())


class SnapshotFailsOnRank(L.Callback):
    """From ``step`` on, taking the snapshot fails on one rank only (as an out-of-memory would)."""

    def __init__(self, io, step, rank):
        self.io, self.step, self.rank = io, step, rank

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.faults = testing.FaultList([testing.Fault("snapshot")])


def case_parallel_snapfail(args, report):
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: SnapshotFailsOnRank(io, 8, rank=1)], strategy=AsyncDDPStrategy())


def case_enospc(args, report):
    _failing_run(args, report, [lambda io: FillDiskAt(io, args.dir, 6)])


def case_kill(args, report):
    _failing_run(args, report, [lambda io: SlowWritesFrom(io, 8), lambda io: KillWorkerAt(io, 9)])


def case_weights_only(args, report):
    """Lightning runs no callback hook for weights-only saves: their errors must still stop every rank."""
    _failing_run(args, report, [lambda io: FailWritesFrom(io, 8)], weights_only=True)


class EditAfterLazySave(L.Callback):
    """On ``rank``, holds the lazy copy of the save at ``step`` and edits a weight in place before letting it
    go (a callback editing weights right after a save): that save must fail on every rank."""

    def __init__(self, io, step, rank=0):
        self.io, self.step, self.rank, self.hold = io, step, rank, testing.HoldCopy()

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.copy_hook = self.hold  # runs before ModelCheckpoint (checkpoint callbacks run last)

    def on_train_batch_start(self, trainer, pl_module, *a):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.hold.wait_started()
            with torch.no_grad():  # rank 0 writes every tensor; another rank its share: edit every weight there
                for layer in pl_module.net if self.rank else pl_module.net[:1]:
                    layer.weight.add_(1)
            self.hold.release()


def case_lazy_torn(args, report):
    _failing_run(args, report, [lambda io: EditAfterLazySave(io, 8)], snapshot="lazy")


def case_lazy_torn_parallel(args, report):
    """AsyncDDPStrategy: rank 1 edits a weight while its lazy copy of its share is held."""
    from lightning_asyncckpt import AsyncDDPStrategy

    _failing_run(args, report, [lambda io: EditAfterLazySave(io, 8, rank=1)], snapshot="lazy", strategy=AsyncDDPStrategy())


def case_lazy(args, report):
    """snapshot="lazy": DDP from rank 0 and AsyncDDPStrategy (each rank its share) copy lazily and exactly."""
    from lightning_asyncckpt import AsyncDDPStrategy

    data = dict(width=160, n=64, batch_size=4)  # 100 KiB weights: above the lazy threshold
    for name, strategy in (("ddp", "ddp"), ("parallel", AsyncDDPStrategy())):
        io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
        rec = SnapshotRecorder()
        dirpath = os.path.join(args.out, name)
        ck = ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4,
                             save_last=True)
        L.seed_everything(1)
        t = _trainer(args, [io], [AsyncFinalizerCallback(), rec, ck], max_steps=12, strategy=strategy)
        t.fit(TinyModel(width=160), loader(**data))
        torch.distributed.barrier()
        report[f"{name}_files"] = sorted(os.listdir(dirpath))
        report[f"{name}_lazy_bytes"] = [r.lazy_nbytes for r in io.history]
        report[f"{name}_children_after_fit"] = _own_children(t)
        if t.global_rank == 0:
            for f in report[f"{name}_files"]:
                loaded = io.load_checkpoint(os.path.join(dirpath, f), weights_only=False)
                got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
                assert_tree_equal(got, rec.copies[loaded["global_step"]], f"{name} {f}")
            report[f"{name}_verified"] = report[f"{name}_files"]


def case_lazy_follow(args, report):
    """AsyncDDPStrategy, snapshot="lazy": a save made while the previous write is in flight follows it into
    the one staging copy on every rank; every checkpoint is exact."""
    from lightning_asyncckpt import AsyncDDPStrategy

    data = dict(width=160, n=64, batch_size=4)
    io = AsyncCheckpointIO(args.engine, worker=args.worker, snapshot="lazy")
    rec, hold = SnapshotRecorder(), HoldWriteAt(io, args.out, 4)
    dirpath = os.path.join(args.out, "ckpts")
    ck = ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=2)
    L.seed_everything(1)
    t = _trainer(args, [io], [AsyncFinalizerCallback(), rec, hold, ck], max_steps=8, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=160), loader(**data))
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(dirpath))
    report["staged"] = hold.staged
    report["lazy_bytes"] = [r.lazy_nbytes for r in io.history]
    report["children_after_fit"] = _own_children(t)
    if t.global_rank == 0:
        for f in report["files"]:
            loaded = io.load_checkpoint(os.path.join(dirpath, f), weights_only=False)
            got = {"state_dict": loaded["state_dict"], "optimizer_states": loaded["optimizer_states"]}
            assert_tree_equal(got, rec.copies[loaded["global_step"]], f)
        report["verified"] = report["files"]


def case_auto(args, report):
    _failing_run(args, report, [lambda io: FailWritesFrom(io, 8)], explicit_callback=False)


def _resources(io):
    import psutil

    me = psutil.Process()
    workers = [psutil.Process(pid) for pid in io.worker_pids()]
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "children": len(live_children()),
        "shm": len(os.listdir("/dev/shm")),
        "rss": me.memory_info().rss + sum(w.memory_info().rss for w in workers),
        "worker_rss": sum(w.memory_info().rss for w in workers),
        # shared-memory segments mapped by this rank and its workers (the staging buffers among them)
        "shm_maps": sum(_shm_maps(p.pid) for p in [me, *workers]),
    }


def _shm_maps(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[-1] for line in f if "/dev/shm/" in line or "(deleted)" in line and "torch_" in line})
    except OSError:
        return 0


class Measure(L.Callback):
    """At the given steps, commits everything (all ranks), then records this rank's resources."""

    def __init__(self, io, steps):
        self.io, self.steps, self.seen = io, steps, {}

    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step in self.steps:
            self.io.finalize(blocking=True)
            self.seen[trainer.global_step] = _resources(self.io)


def case_soak(args, report):
    """100 saves (and 100 of `last`) with save_top_k=2 under AsyncDDPStrategy: nothing may grow."""
    from lightning_asyncckpt import AsyncDDPStrategy

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=os.path.join(args.out, "c"), every_n_train_steps=1, save_top_k=2, monitor="step",
                         mode="max", save_last=True)
    steps = int(os.environ.get("SOAK_STEPS", 100))
    measure = Measure(io, (10, steps // 3, 2 * steps // 3, steps))
    t = _trainer(args, [io], [measure, ck], max_steps=steps, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=int(os.environ.get("SOAK_WIDTH", 64))), loader(width=int(os.environ.get("SOAK_WIDTH", 64)), n=512, batch_size=2))
    report["saves"] = len(io.history)
    report["resources"] = measure.seen
    report["children_after_fit"] = _own_children(t)
    torch.distributed.barrier()
    report["files"] = sorted(os.listdir(ck.dirpath))


def case_remote(args, report):
    """Two DDP ranks save to an S3 URL (``--dir``; the endpoint comes from the environment): rank 0 writes."""
    import fsspec

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    ck = ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4, save_last=True)
    t = _trainer(args, [io], [AsyncFinalizerCallback(), ck], max_steps=8)
    t.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4))
    torch.distributed.barrier()
    fs, root = fsspec.core.url_to_fs(args.dir)
    fs.invalidate_cache()
    report["objects"] = sorted(os.path.basename(p) for p in fs.ls(root))
    with fs.open(f"{root}/last.ckpt", "rb") as f:
        report["last_step"] = torch.load(f, weights_only=False)["global_step"]
    report["children_after_fit"] = _own_children(t)


def case_remote_dcp(args, report):
    """``AsyncDDPStrategy`` (every rank writes a share of one DCP directory) to an S3 URL; then resume."""
    from lightning_asyncckpt import AsyncDDPStrategy, last_checkpoint

    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    rec = SnapshotRecorder()
    ck = ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, every_n_train_steps=4, save_last=True)
    L.seed_everything(1)
    t = _trainer(args, [io], [rec, ck], max_steps=8, strategy=AsyncDDPStrategy())
    t.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4))
    torch.distributed.barrier()
    import fsspec

    fs, root = fsspec.core.url_to_fs(args.dir)
    fs.invalidate_cache()
    report["objects"] = sorted(os.path.basename(p) for p in fs.ls(root))
    for name in report["objects"]:
        got = io.load_checkpoint(f"{args.dir}/{name}", weights_only=False)
        assert_tree_equal({"state_dict": got["state_dict"], "optimizer_states": got["optimizer_states"]},
                          rec.copies[got["global_step"]], name)
    report["verified"] = report["objects"]
    started = []

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    t2 = _trainer(args, [AsyncCheckpointIO(args.engine, worker=args.worker)], [AtStart()], max_steps=10,
                  strategy=AsyncDDPStrategy(), enable_checkpointing=False)
    t2.fit(TinyModel(width=32), loader(width=32, n=64, batch_size=4), ckpt_path=last_checkpoint(args.dir))
    report["resumed_at"] = started
    report["children_after_fit"] = _own_children(t)


def main():
    run_job(lambda args, report: globals()[f"case_{args.case}"](args, report))


if __name__ == "__main__":
    main()
