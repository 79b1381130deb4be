"""Shared pieces of the test suite: a tiny model, data, and recorders. No fakes of the library."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

ENGINES = ["nvrx", "mcore"]
WORKERS = ["persistent", "fork"]
COMBOS = [(e, w) for e in ENGINES for w in WORKERS]
# The default run covers both engines and both worker modes with two of the four combinations; the other
# two run with `make test-all` (marked `slow`).
MAIN_COMBOS = {("nvrx", "persistent"), ("mcore", "fork")}
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def run_fabric_case(args: Any, fabric: Any, io: Any, cases: dict) -> None:
    """The ``main`` of a Fabric job script after ``fabric.launch()``: runs ``case_<args.case>`` from ``cases``
    on this rank, then writes its ``reports.RankReport`` to ``<out>/rank<r>.json`` (``reports.reported``),
    with the traceback, if it raised."""
    from reports import report_path, reported

    rank = fabric.global_rank
    reported(rank, report_path(args.out, rank), lambda report: cases[f"case_{args.case}"](args, fabric, io, report),
             lambda: fabric.world_size)


def combo_params(single: bool = False, fast: Any = MAIN_COMBOS, combos: Any = COMBOS) -> list:
    """``(engine, worker)`` parameters for ``combos`` (all four by default); those not in ``fast`` are
    marked ``slow`` (``make test-all`` runs them, ``make test`` does not). ``single`` for a fixture's one
    value. Tests whose subject does not depend on the engine run one combination in ``make test``,
    chosen so that every combination still runs there somewhere."""
    import pytest

    return [
        pytest.param(*([(e, w)] if single else [e, w]), id=f"{e}-{w}",
                     marks=() if (e, w) in fast else pytest.mark.slow)
        for e, w in combos
    ]


class TinyModel(L.LightningModule):
    """A BoringModel-like module; ``width`` sets the size of the state (4 * width**2 bytes per layer)."""

    def __init__(self, width: int = 64, layers: int = 2, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0].to(self.net[0].weight.dtype)).float().pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.net(batch[0]).pow(2).mean())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.net(batch[0]).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class ShardedModel(TinyModel):
    """``TinyModel`` with FSDP2 (``fully_shard``) over the strategy's data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def loader(width: int = 64, n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, width, generator=g)), batch_size=batch_size, shuffle=False)


def trainer(tmp_path: Any, plugins: list, callbacks: list, **kw: Any) -> L.Trainer:
    opts = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), num_sanity_val_steps=0,
    )
    opts.update(kw)
    return L.Trainer(plugins=plugins, callbacks=callbacks, **opts)


def clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def assert_tree_equal(a: Any, b: Any, where: str = "", strict: bool = False) -> None:
    """Bit-for-bit equality of nested checkpoint content, key types included. ``strict``: the same types
    (dict subclasses, namedtuples, namespaces) and tensors on the same device, too."""
    same_kind = type(a) is type(b) or (not strict and isinstance(a, dict) and isinstance(b, dict))
    assert same_kind, f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert not strict or a.device == b.device, f"{where}: device {a.device} != {b.device}"
        assert torch.equal(a, b), f"{where}: tensor values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a.keys())} != {list(b.keys())}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}.{k!r}", strict)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]", strict)
    elif strict and hasattr(a, "__dict__") and not callable(a):
        assert_tree_equal(vars(a), vars(b), f"{where}(namespace)", strict)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


class SnapshotRecorder(L.Callback):
    """Keeps an exact copy of what each save was handed, and how many steps overlapped a write."""

    def __init__(self) -> None:
        self.copies: dict[int, dict] = {}
        self.steps_while_pending = 0

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.copies[checkpoint["global_step"]] = clone_tree(
            {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]}
        )

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        from lightning_asyncckpt.integration.io import find_async_io

        io = find_async_io(trainer.strategy)
        if io is not None and io.session.num_pending:
            self.steps_while_pending += 1


class FailOnRankFrom(L.Callback):
    """From training step ``step`` on, background writes fail (ENOSPC) on global rank ``rank`` only."""

    def __init__(self, io: Any, step: int, rank: int) -> None:
        self.io, self.step, self.rank = io, step, rank

    def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
        from lightning_asyncckpt import testing

        if trainer.global_step == self.step - 1 and trainer.global_rank == self.rank:
            self.io.write_hook = testing.FailWrite()


def latest_raise_step(failed_save_step: int, every: int = 4, max_pending: int = 2) -> int:
    """The last ``global_step`` at which a Trainer saving every ``every`` steps can still be running after
    the save at ``failed_save_step`` failed. The finalizer raises at the first batch end after the failure
    is known, usually before the next save; how much sooner depends on the worker's speed. At the latest,
    the ``max_pending``-th save after it finds that many saves in flight and waits for the failed one to
    end, so the batch end right after that save raises."""
    return failed_save_step + every * max_pending + 1


class SlowSteps(L.Callback):
    """Makes each training step take ``seconds``, so that "within N steps" means something."""

    def __init__(self, seconds: float = 0.03) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def hold_write(folder: Any) -> Any:
    """A ``testing.HoldWrite`` whose release and started files live in ``folder`` (made if missing; keep it
    apart from the folders a test lists)."""
    from lightning_asyncckpt import testing

    os.makedirs(folder, exist_ok=True)
    return testing.HoldWrite(os.path.join(folder, "release"), started_file=os.path.join(folder, "started"))


def dir_entries(path: Any) -> list[str]:
    return sorted(os.listdir(path))


@contextlib.contextmanager
def log_lines(name: str = "lightning_asyncckpt") -> Iterator[list[str]]:
    """Every message logged under ``name`` in this process while the block runs (a forked rank: its own)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def mounted_tmpfs(path: Any, size: str, options: str = "") -> Iterator[Path]:
    """A real tmpfs of ``size`` (``"4m"``) mounted at ``path`` (made here), for real ENOSPC; ``options``: more
    mount options (``"huge=within_size"``). Skips the test where mounting is refused. Unmounted after."""
    import pytest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(filter(None, (f"size={size}", options))), "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_cli(capsys: Any, *args: object) -> tuple[int, str, str]:
    """Runs the command line in this process: (exit status, stdout, stderr)."""
    from lightning_asyncckpt.tools import cli

    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, expected_code: int, *fragments: str) -> None:
    """A user error of the command line: the expected exit status, one line on stderr naming the problem,
    no traceback."""
    assert code == expected_code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-asyncckpt: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


class RecordPriority:
    """A write hook (picklable) that appends ``<pid> <nice>`` of the process running the write to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, buckets: list) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {os.nice(0)}\n")


class RecordImported:
    """A write hook (picklable) that appends to ``path`` whether the writer process has imported ``module``
    (``True`` or ``False``, a line per write)."""

    def __init__(self, path: str, module: str) -> None:
        self.path, self.module = path, module

    def __call__(self, buckets: list) -> None:
        import sys

        with open(self.path, "a") as f:
            f.write(f"{self.module in sys.modules}\n")


class RecordGcFreeze:
    """A write hook (picklable) that appends the number of objects the writer process has frozen out of
    garbage collection (``gc.get_freeze_count()``) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, buckets: list) -> None:
        import gc

        with open(self.path, "a") as f:
            f.write(f"{gc.get_freeze_count()}\n")


class HoldWriteAt(L.Callback):
    """Holds every rank's write of the save at ``step`` until the save at ``step + 2`` was made (a slow disk:
    that save finds the write in flight), and records the staging memory with one and with both in flight."""

    def __init__(self, io, out, step):
        self.io, self.step, self.staged = io, step, {}
        from lightning_asyncckpt import testing

        self.hold = testing.HoldWrite(os.path.join(out, f"release-{os.environ.get('LOCAL_RANK', '0')}"))

    def _staged(self):
        return sum(b.numel() * b.element_size() for b in self.io.session.staging_buffers())

    def on_train_batch_end(self, trainer, *a):  # runs before ModelCheckpoint's save of this step
        if trainer.global_step == self.step - 1:
            self.staged["one"] = self._staged()
            self.io.write_hook = self.hold
        elif trainer.global_step == self.step + 1:
            self.io.write_hook = None

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == self.step + 2:  # both saves made: the second one follows the held write
            self.staged["both"], self.staged["pending"] = self._staged(), self.io.session.num_pending
            self.hold.release()


def slurm_job(monkeypatch: Any, bin_dir: Any) -> None:
    """This process as the single task of SLURM job 4242, as Lightning's ``SLURMEnvironment`` reads it; ``PATH``
    is ``bin_dir``, which holds no ``scontrol``, so Lightning's requeue logs that it failed."""
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", str(bin_dir))


FRESH_VAR = "ASYNCCKPT_TEST_FRESH_PROCESS"


def in_fresh_process(request: Any, timeout: float = 200) -> bool:
    """For a test about what the whole process holds (a class-level wrapper exists only while a plugin is
    alive): True in a fresh interpreter, where the test's body runs; in pytest's own process (an xdist worker
    may still hold an earlier test's plugin), runs this one test in a fresh interpreter, fails with its output
    if it failed there, and returns False.

        def test_x(request):
            if not in_fresh_process(request):
                return
            ...
    """
    if os.environ.get(FRESH_VAR) == request.node.nodeid:
        return True
    import sys

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", request.node.nodeid]
    env = {**os.environ, FRESH_VAR: request.node.nodeid}
    done = subprocess.run(cmd, cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"in a fresh process:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    return False


OTHER_USER = 65534  # nobody: "another local user" in the trust tests


def as_other_user(*cmd: str) -> None:
    """Runs ``cmd`` as another local user (uid/gid 65534, no groups); skips the test where that is refused."""
    import shutil
    import subprocess

    import pytest

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as another local user needs root and setpriv")
    r = subprocess.run(["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}", "--clear-groups", *cmd],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and r.stderr.startswith("setpriv"):
        pytest.skip(f"setpriv refused here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
