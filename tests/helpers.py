"""Shared pieces of the test suite: a tiny model, data, and recorders. No fakes of the library."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import psutil
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
    on this rank, then writes ``<out>/rank<r>.json`` (whole: temp file, then rename) with its report and
    the traceback, if it raised."""
    import traceback

    report = {"rank": fabric.global_rank}
    try:
        cases[f"case_{args.case}"](args, fabric, io, report)
    except BaseException as e:  # noqa: BLE001
        report["crash"] = "".join(traceback.format_exception(e))
    report["world_size"] = fabric.world_size
    path = os.path.join(args.out, f"rank{fabric.global_rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def job_script(name: str) -> str:
    """The path of a job script in ``tests/jobs`` (the scripts the tests start in their own processes)."""
    return os.path.join(TESTS, "jobs", name)


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
        if io is not None and io.num_pending:
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


def live_children() -> list[psutil.Process]:
    """This process's live descendants, but for Open MPI's ``orted``: where mpi4py is installed, Lightning's
    MPI detection starts it (a singleton ``MPI_Init``) and it lives as long as this process (seen on a GPU
    machine); it is not ours."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.name() != "orted":
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def cmdline(p: psutil.Process) -> str:
    """A child's command line; empty if it exited (or became a zombie) since it was listed."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def other_children(exclude: Any, timeout: float = 3.0) -> list:
    """``(pid, command line)`` of live child processes not matched by ``exclude(pid, cmdline)``; waits up to
    ``timeout`` for ones that are already exiting."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in live_children():
            line = cmdline(p)
            if line and not exclude(p.pid, line):
                left.append((p.pid, line[:120]))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_no_children(timeout: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    kids = live_children()
    while kids and time.monotonic() < deadline:
        time.sleep(0.05)
        kids = live_children()
    return kids


def dir_entries(path: Any) -> list[str]:
    return sorted(os.listdir(path))


def job_args(extra: tuple = ()) -> Any:
    """Arguments of the job scripts that ``run_ranks`` starts."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--engine", default="nvrx")
    p.add_argument("--worker", default="persistent")
    p.add_argument("--out", required=True)
    for name in extra:
        p.add_argument(name, default=None)
    return p.parse_args()


def run_job(run: Any, extra: tuple = ("--dir",), report: dict | None = None) -> None:
    """The ``main`` of a job script: ``run(args, report)`` on this rank, then ``<out>/rank<r>.json`` with the
    report (and the traceback, if it raised)."""
    import faulthandler
    import json
    import traceback

    import torch

    args = job_args(extra=extra)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    # On a hang, run_ranks shows every process's stacks. Each rank writes its own just before the harness
    # gives up (a watchdog thread: Lightning resets signal handlers at teardown); forked writers inherit a
    # SIGUSR1 handler, and run_ranks signals them.
    stacks_after = os.environ.get(STACKS_AFTER_VAR)
    if stacks_after:
        stacks = open(os.path.join(args.out, f"{STACKS_PREFIX}{os.getpid()}.txt"), "w")  # noqa: SIM115 - kept open
        faulthandler.dump_traceback_later(float(stacks_after), exit=False, file=stacks)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    report = {"rank": rank, **(report or {})}
    try:
        run(args, report)
    except BaseException as e:  # noqa: BLE001
        report["crash"] = "".join(traceback.format_exception(e))
    if torch.distributed.is_initialized():
        report["world_size"] = torch.distributed.get_world_size()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


STACKS_AFTER_VAR = "ASYNCCKPT_TEST_STACKS_AFTER_S"
STACKS_PREFIX = "stacks-"


def hang_report(pgid: int, script: str, out: Any, log: Any) -> str:
    """Every stack of a hung job that runs ``script``: the ranks' own (written by their watchdog, see
    ``run_job``), and those of the other processes (forked writers), which print them into ``log`` on
    SIGUSR1, one by one."""
    ranks = {int(f.name[len(STACKS_PREFIX):-4]) for f in out.glob(f"{STACKS_PREFIX}*.txt")}
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid not in ranks and os.getpgid(p.pid) == pgid and script in " ".join(p.info["cmdline"] or []):
                log.write(f"\n--- stacks of pid {p.pid} (parent {p.ppid()}) ---\n")
                log.flush()  # the job's processes share this file offset
                p.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
    parts = [Path(log.name).read_text()[-8000:]]
    for f in sorted(out.glob(f"{STACKS_PREFIX}*.txt")):
        if f.stat().st_size:
            parts.append(f"--- stacks of rank process {f.name[len(STACKS_PREFIX):-4]} ---\n{f.read_text()[-6000:]}")
    return "\n".join(parts)


@contextlib.contextmanager
def mounted_tmpfs(path: Any, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``"4m"``) mounted at ``path`` (made here), for real ENOSPC; skips the test
    where mounting is refused. Unmounted after."""
    import pytest

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it): each job gets its own ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A process that ``launch`` started: the leader of its own session, with its output in ``log``."""

    def __init__(self, proc: subprocess.Popen, script: str, out: Path, log: Any, timeout: float) -> None:
        self.proc, self.script, self.out, self.log, self.timeout = proc, script, out, log, timeout
        self.deadline = time.monotonic() + timeout

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def wait(self) -> int:
        """The job's exit status; a job still running at its hard timeout fails the test with its log and
        every stack of its processes."""
        import pytest

        try:
            return self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            report = hang_report(self.proc.pid, self.script, self.out, self.log)
            pytest.fail(f"{self.script} hung for {self.timeout}s; log, and every stack:\n{report}")


@contextlib.contextmanager
def launch(cmd: list, out: Any, timeout: float, cwd: Any = None, env: dict | None = None,
           log_name: str = "log.txt") -> Iterator[Job]:
    """The one way the tests start a process: ``cmd`` in its own session, stdout and stderr in
    ``<out>/<log_name>``, its own free ``MASTER_PORT``, ``tests/`` importable (``helpers``), and ``env`` on
    top of this environment. ``Job.wait`` bounds it by ``timeout`` (a hang fails the test with every
    stack: job scripts that use ``run_job`` write theirs into ``out``); leaving the block kills the job's
    whole process group, whatever is still running in it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()),
               **{STACKS_AFTER_VAR: str(max(timeout - 8, timeout * 0.8))}, **(env or {}))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [TESTS] * (TESTS not in paths))
    script = next((str(c) for c in cmd if str(c).endswith(".py")), str(cmd[0]))
    with open(out / log_name, "w") as log:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            yield Job(proc, script, out, log, timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_ranks(
    script: str, tmp_path: Any, case: str, engine: str, worker: str, timeout: float = 180, ranks: int = 2, **extra: Any
) -> list:
    """Runs a ``ranks``-rank job script with ``launch`` and returns each rank's JSON report (a rank that
    crashed fails the test with its traceback)."""
    out = tmp_path / "out"
    cmd = [sys.executable, script, "--case", case, "--engine", engine, "--worker", worker, "--out", str(out)]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    with launch(cmd, out, timeout, cwd=tmp_path) as job:
        job.wait()
    reports = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report; log:\n{(out / 'log.txt').read_text()[-4000:]}"
        reports.append(json.loads(path.read_text()))
    for r in reports:
        assert "crash" not in r, f"rank {r['rank']} crashed:\n{r['crash']}"
        assert r["world_size"] == ranks
    return reports


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
        return sum(b.numel() * b.element_size() for b in self.io.staging_buffers())

    def on_train_batch_end(self, trainer, *a):  # runs before ModelCheckpoint's save of this step
        if trainer.global_step == self.step - 1:
            self.staged["one"] = self._staged()
            self.io.write_hook = self.hold
        elif trainer.global_step == self.step + 1:
            self.io.write_hook = None

    def on_train_batch_start(self, trainer, *a):
        if trainer.global_step == self.step + 2:  # both saves made: the second one follows the held write
            self.staged["both"], self.staged["pending"] = self._staged(), self.io.num_pending
            self.hold.release()
