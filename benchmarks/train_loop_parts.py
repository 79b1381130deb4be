"""The pieces of ``bench_train_loop.py`` that run inside one variant's process: the model, the saving
variants (this library, torch DCP's ``async_save``, stock ``torch.save``) as Trainer plugins and callbacks,
and the ``LoopTimer`` callback that times every step, save call, wait and commit.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Any

import lightning as L
import psutil
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

OURS_ENGINES = ("nvrx", "mcore")
# The peer first, the synchronous reference last: a run cut short still compares ours with the peer.
VARIANTS = [
    "dcp_async",
    "nvrx_persistent_eager",
    "nvrx_persistent_lazy",
    "nvrx_persistent_lazy_nice10",  # AsyncCheckpointIO(worker_nice=10), as nvrx 0.6+ runs its worker
    "mcore_persistent_eager",
    "mcore_persistent_lazy",
    "nvrx_fork_eager",
    "mcore_fork_eager",
    "torch_save",
]


# -------------------------------------------------------------------------------------------------
# The model: ``layers`` Linear(width, width) without bias, SGD with momentum (state = 2 x parameters)
class Net(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)


class SameBatch(Dataset):
    """``length`` times the same input batch: no data loading cost, no collation."""

    def __init__(self, batch: int, width: int, length: int) -> None:
        self.x, self.length = torch.randn(batch, width), length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x


def loader(batch: int, width: int, length: int) -> DataLoader:
    return DataLoader(SameBatch(batch, width, length), batch_size=None, shuffle=False)


def state_like(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors of the checkpoint's size before the first step: the parameters and one momentum each."""
    params = [p.detach() for p in model.parameters()]
    return params + [torch.ones_like(p) for p in params]


def fwd_bwd_seconds(model: torch.nn.Module, x: torch.Tensor, reps: int = 3) -> float:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every process below this one: live ones as they are now, exited
    ones as their reaper recorded them (this process's and each live child's ``children_*`` times)."""
    me = psutil.Process()
    ct = me.cpu_times()
    total = ct.children_user + ct.children_system
    for p in me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # exited between the listing and the read: its time went to its reaper
    return total


# -------------------------------------------------------------------------------------------------
# What the timer records, shared with the variants
class Clock:
    """Save calls, waits and commits, by checkpoint file name."""

    def __init__(self) -> None:
        self.saves: dict[str, dict] = {}
        self.last: dict | None = None
        self.draining = False

    def save_started(self, path: Any, batch: int) -> dict:
        rec = {"name": os.path.basename(str(path)), "batch": batch, "t0": time.perf_counter(), "call_s": None,
               "wait_s": 0.0, "commit_s": None}
        self.saves[rec["name"]] = self.last = rec
        return rec

    def waited(self, seconds: float) -> None:
        """A wait of the training thread before an optimizer step (not during a drain): the latest save's."""
        if self.last is not None and not self.draining:
            self.last["wait_s"] += seconds

    def committed(self, path: Any) -> None:
        rec = self.saves.get(os.path.basename(str(path)))
        if rec is not None and rec["commit_s"] is None:
            rec["commit_s"] = time.perf_counter() - rec["t0"]


# -------------------------------------------------------------------------------------------------
# The peer: torch DCP async_save, a process writer, background staging into reused shared memory
class DCPAsyncSaveIO(CheckpointIO):
    """Lightning's checkpoint dict through ``dcp.async_save`` (process writer, ``DefaultStager`` with async
    staging into reused shared memory). As torchtitan does, a save first waits for the previous upload;
    ``DCPStagingCallback`` waits for the staging before the optimizer step changes the state."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.stager, self.pending = clock, None, None

    def start(self) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not dist.is_initialized():  # its process executor joins a process group of its own
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=1)
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                   use_async_staging=True, use_non_blocking_copy=False))

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.wait_upload()
        resp = dcp.async_save(checkpoint, checkpoint_id=str(path), async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self.stager, no_dist=True)
        resp.upload_completion.add_done_callback(lambda _f, p=path: self.clock.committed(p))
        self.pending = resp

    def wait_staging(self) -> None:
        if self.pending is not None and not self.pending.staging_completion.done():
            t0 = time.perf_counter()
            self.pending.staging_completion.result()
            self.clock.waited(time.perf_counter() - t0)

    def wait_upload(self) -> None:
        if self.pending is not None:
            self.pending.upload_completion.result()
            self.pending = None

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
        raise NotImplementedError("bench_train_loop never loads")

    def remove_checkpoint(self, path: Any) -> None:
        shutil.rmtree(path, ignore_errors=True)  # ModelCheckpoint removes the previous one, already uploaded

    def teardown(self) -> None:
        import torch.distributed as dist

        self.wait_upload()
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if dist.is_initialized():
            dist.destroy_process_group()


class DCPStagingCallback(Callback):
    def __init__(self, io: DCPAsyncSaveIO) -> None:
        self.io = io

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.io.start()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.io.wait_staging()


# -------------------------------------------------------------------------------------------------
# One variant's plugin, callbacks, and how to wait for everything it has in flight
class Saver:
    """``plugins`` and ``callbacks`` for the Trainer; ``drain()`` waits until every save is durable."""

    def __init__(self, name: str, clock: Clock, fmt: str = "auto") -> None:
        self.name, self.clock, self.io = name, clock, None
        self.sync = name == "torch_save"
        self.plugins: list = []
        self.callbacks: list = []
        if name == "dcp_async":
            self.io = DCPAsyncSaveIO(clock)
            self.plugins, self.callbacks = [self.io], [DCPStagingCallback(self.io)]
        elif name.split("_")[0] in OURS_ENGINES:
            from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback

            engine, worker, snapshot, *nice = name.split("_")  # "..._nice10": worker_nice=10
            options = {"worker_nice": int(nice[0].removeprefix("nice"))} if nice else {}
            self.io = AsyncCheckpointIO(engine, worker=worker, snapshot=snapshot, format=fmt, **options)
            self._wrap_ours()
            self.plugins, self.callbacks = [self.io], [AsyncFinalizerCallback()]
        elif name != "torch_save":
            raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")

    def _wrap_ours(self) -> None:
        io, clock = self.io, self.clock
        session = io.session  # what the callback calls after every batch and before the optimizer step
        wait, finalize_step, save = session.wait_for_snapshot, session.finalize, io.save_checkpoint

        def timed_wait() -> None:
            t0 = time.perf_counter()
            wait()
            clock.waited(time.perf_counter() - t0)

        def noting_commits(*args: Any, **kwargs: Any) -> None:
            try:
                finalize_step(*args, **kwargs)
            finally:
                self._note_commits()

        def saving(*args: Any, **kwargs: Any) -> None:
            # a save call may commit the previous save first (no room for another in flight): a loaded
            # machine does that, and that commit would otherwise never be noted
            try:
                save(*args, **kwargs)
            finally:
                self._note_commits()

        session.wait_for_snapshot, session.finalize, io.save_checkpoint = timed_wait, noting_commits, saving

    def _note_commits(self) -> None:
        """Every save in our plugin's history is committed (``Clock.committed`` keeps the first time seen)."""
        for rec in self.io.history:
            self.clock.committed(rec.path)

    def drain(self) -> None:
        """Untimed, between phases: every save committed, nothing in flight."""
        self.clock.draining = True
        try:
            if isinstance(self.io, DCPAsyncSaveIO):
                self.io.wait_staging()
                self.io.wait_upload()
            elif self.io is not None:
                self.io.finalize(blocking=True)
                self._note_commits()
        finally:
            self.clock.draining = False

    def history(self) -> list[dict]:
        """Our plugin's own records (stall and write time as it logs them); empty for the other variants."""
        hist = getattr(self.io, "history", None) or []
        return [{"name": os.path.basename(r.path), "stall_s": r.stall_s, "write_s": r.write_s, "nbytes": r.nbytes,
                 "lazy_nbytes": r.lazy_nbytes} for r in hist]


# -------------------------------------------------------------------------------------------------
# The schedule and the timer
WARM_SAVE = 1  # the batch of the warm-up save; the next batch drains it; phases start after that


def plan(every: list[int], warmup: int, baseline: int, saves: int) -> list[dict]:
    """Phases, one per N: at least ``baseline`` steps without saving (a few more where needed, so that the
    saves fall where ``ModelCheckpoint(every_n_train_steps=N)`` saves: batch b saves iff (b + 1) % N == 0,
    global_step being b + 1 then), then ``saves`` saves N steps apart, then one drain step (untimed).
    ``base`` is the baseline's batch range [start, end), ``end`` being the first save's batch."""
    if warmup < WARM_SAVE + 2:
        raise ValueError(f"warmup={warmup}: at least {WARM_SAVE + 2} steps (a warm-up save and its drain)")
    phases, b = [], warmup
    for n in every:
        first = b + baseline
        first += -(first + 1) % n
        save_batches = [first + k * n for k in range(saves)]
        phases.append({"every": n, "base": (b, first), "saves": save_batches, "drain": save_batches[-1] + 1})
        b = save_batches[-1] + 2
    return phases


def tail(phases: list[dict], baseline: int) -> tuple[int, int]:
    """The batch range [start, end) of the baseline steps after the last phase's drain: every overhead is
    measured against the baseline steps before, between and after the phases together, so that one
    baseline block disturbed by something else on the machine does not skew a whole phase."""
    start = phases[-1]["drain"] + 1
    return start, start + baseline


class PhaseCheckpoint(ModelCheckpoint):
    """Stock ``ModelCheckpoint(every_n_train_steps=N, save_top_k=1)``, active only in its phase's batches."""

    def __init__(self, window: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.window = window

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.window[0] <= batch_idx <= self.window[1]:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class LoopTimer(Callback):
    """Times every batch (batch start to the next batch start: fetch, forward, backward, optimizer step and
    every batch-end hook, the save included), its forward + backward (batch start to
    ``on_before_optimizer_step``; this callback comes first), every save call (``trainer.save_checkpoint``, as
    ``ModelCheckpoint`` calls it), and the writer processes' CPU time per phase. Drains at the end of each
    phase's drain step, and of step ``WARM_SAVE + 1`` after the warm-up save (``ckpt_dirs[0]``), which pays
    first-time costs (DCP's writer process start, staging buffers) outside every phase."""

    def __init__(self, phases: list[dict], saver: Saver, clock: Clock, ckpt_dirs: dict[int, str]) -> None:
        self.phases, self.saver, self.clock, self.ckpt_dirs = phases, saver, clock, ckpt_dirs
        self.t_start: dict[int, float] = {}
        self.fwd_bwd: dict[int, float] = {}
        self.cpu: dict[int, list[float]] = {}  # N -> [at the phase's first save period, after its drain]
        self._batch = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        save, clock, timer = trainer.save_checkpoint, self.clock, self

        def timed_save(filepath: Any, *args: Any, **kwargs: Any) -> None:
            rec = clock.save_started(filepath, timer._batch)
            save(filepath, *args, **kwargs)
            rec["call_s"] = time.perf_counter() - rec["t0"]
            if self.saver.sync:
                clock.committed(filepath)

        trainer.save_checkpoint = timed_save

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch = batch_idx
        self.t_start[batch_idx] = time.perf_counter()
        for ph in self.phases:
            if batch_idx == ph["base"][1]:
                self.cpu[ph["every"]] = [children_cpu_s()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Drains after a drain step's optimizer step, so that the waits before it count for the last save."""
        if batch_idx == WARM_SAVE + 1:
            self.saver.drain()
            shutil.rmtree(self.ckpt_dirs[0], ignore_errors=True)
        for ph in self.phases:
            if batch_idx == ph["drain"]:
                self.saver.drain()
                self.cpu[ph["every"]].append(children_cpu_s())
                shutil.rmtree(self.ckpt_dirs[ph["every"]], ignore_errors=True)  # bounded disk use

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.fwd_bwd[self._batch] = time.perf_counter() - self.t_start[self._batch]

    def interval(self, b: int) -> float:
        """Batch ``b``'s start to the next batch's start (never asked of a drain step)."""
        return self.t_start[b + 1] - self.t_start[b]
