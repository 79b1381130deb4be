"""The harness for tests that run code in other processes. ``launch`` starts a command (a job) in its own
session, with its output in a log file, its own ``MASTER_PORT`` and a hard timeout, and kills the job's
whole process group when its block ends. Job scripts are modules of the package ``jobs`` (``tests/jobs``),
started as ``python -m jobs.<name>`` (``job_command``) with ``tests/`` on their ``PYTHONPATH``: they import
the test helpers as the tests do, without path hacks. ``run_ranks`` runs a multi-rank job that way and
returns the typed report that each rank wrote (``reports.RankReport``; job scripts write it with
``run_job``, the tests read it with ``rank_reports``). A job still running at its timeout fails the test
with its log and the stacks of all its processes (``hang_report``).
``live_children``, ``other_children`` and ``wait_no_children`` check that no child process is left
behind. ``two_ranks`` runs a function in two forked processes of one gloo group."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from reports import RankReport, read_report, report_path, reported

# tests/: job scripts live under it, and launch puts it on the jobs' PYTHONPATH
TESTS = os.path.dirname(os.path.abspath(__file__))

# the interpreter of the pytorch_lightning-alone environment that `make test` builds beside .venv (the jobs of
# tests/test_distributions.py and the tier tests that run under either distribution)
PL_PYTHON = Path(os.environ.get("LIGHTNING_ASYNCCKPT_PL_PYTHON", Path(TESTS).parent / ".venv-pl" / "bin" / "python"))

STACKS_AFTER_VAR = "ASYNCCKPT_TEST_STACKS_AFTER_S"
STACKS_PREFIX = "stacks-"


def job_command(name: str, python: str | os.PathLike = sys.executable) -> list[str]:
    """The command that runs the job script ``tests/jobs/<name>.py`` as the module ``jobs.<name>`` (Lightning
    and Fabric relaunch it the same way for their other ranks); ``launch`` puts ``tests/`` on its path.

    Args:
        name: the job's module in ``tests/jobs``, without ``.py``.
        python: the interpreter (another environment's, e.g. ``.venv-pl``'s).
    """
    return [str(python), "-m", f"jobs.{name}"]


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


def run_job(run: Any, extra: tuple = ("--dir",), seen: dict | None = None) -> None:
    """The ``main`` of a job script: ``run(args, report)`` on this rank, then ``<out>/rank<r>.json`` with the
    report (and the traceback, if it raised; ``reports.reported``). ``seen``: the report's first values."""
    import faulthandler

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

    def world_size() -> int | None:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else None

    reported(rank, report_path(args.out, rank), lambda report: run(args, report), world_size,
             RankReport(rank=rank, seen=dict(seen or {})))


def _gloo_rank(rank: int, module: str, world: int) -> None:
    import importlib

    import torch.distributed as dist

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cases = importlib.import_module(module)
        run_job(lambda args, report: getattr(cases, f"case_{args.case}")(args, report), extra=())
    finally:
        dist.destroy_process_group()


def run_gloo_cases(module: str, world: int) -> None:
    """The ``main`` of a job script whose ``case_<name>(args, report)`` functions run on ``world`` ranks it
    spawns itself, in one gloo group on 127.0.0.1 (``MASTER_PORT`` from the environment); ``module`` is the
    job's importable name (``jobs.<name>``)."""
    import torch.multiprocessing

    torch.multiprocessing.start_processes(_gloo_rank, args=(module, world), nprocs=world, start_method="spawn")


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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now: each job gets its own ``MASTER_PORT``.

    Taken below the kernel's ephemeral range: a port the kernel picks (``bind(("", 0))``) is free now, but
    the kernel also hands such ports to other tests' outgoing connections and gloo listeners, one of which
    could take it before this job's store binds it, seconds later. And each pytest-xdist worker takes its
    ports in turn from a slice of its own, so that two tests running side by side never pick the same one
    (both were seen as ``EADDRINUSE`` or "Connection reset by peer" at init under 3 workers)."""
    low, _high = _ephemeral_range()
    base = max(low - 12000, 10000)
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % workers
    size = (low - base) // workers
    start = base + worker * size
    for _ in range(size):
        port = start + next(_PORTS) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every one taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORTS = itertools.count(random.randrange(1 << 20))  # this process's next port, from a random start


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


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


def _script(cmd: list) -> str:
    """What names the job in ``cmd``'s process command lines: the module after ``-m``, else the ``.py``
    file, else the program."""
    words = [str(c) for c in cmd]
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return next((w for w in words if w.endswith(".py")), words[0])


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
    script = _script(cmd)
    with open(out / log_name, "w") as log:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            yield Job(proc, script, out, log, timeout)
        finally:
            end_group(proc)


def _group(pgid: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The live processes of process group ``pgid``: (multiprocessing's resource trackers, the others)."""
    trackers, others = [], []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                (trackers if "resource_tracker" in " ".join(p.info["cmdline"] or []) else others).append(p)
    return trackers, others


def end_group(proc: subprocess.Popen, tracker_grace_s: float = 10.0) -> None:
    """Ends the whole process group that ``proc`` leads: every process in it is SIGKILLed, but for
    multiprocessing's resource trackers, which are left ``tracker_grace_s`` to exit by themselves first.

    A tracker exits when the last process that holds its pipe is gone, and on its way out it unlinks the
    named semaphores (``/dev/shm/sem.mp-*``) of the processes that died without doing it. Killed in the
    same instant as them, it leaves those files behind for good: 24 per killed trainer's persistent
    writer queues, seen after whole runs of the suite."""
    for _ in range(50):  # a process may start another while we kill: again until only trackers are left
        trackers, others = _group(proc.pid)
        if not others:
            break
        for p in others:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(others, timeout=5)
    proc.wait()
    psutil.wait_procs(_group(proc.pid)[0], timeout=tracker_grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_ranks(
    job: str, tmp_path: Any, case: str, engine: str, worker: str, timeout: float = 180, ranks: int = 2, **extra: Any
) -> list[RankReport]:
    """Runs the ``ranks``-rank job ``jobs.<job>`` with ``launch`` and returns each rank's report (a rank that
    crashed fails the test with its traceback)."""
    out = tmp_path / "out"
    cmd = [*job_command(job), "--case", case, "--engine", engine, "--worker", worker, "--out", str(out)]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    with launch(cmd, out, timeout, cwd=tmp_path) as job_:
        job_.wait()
    reports = rank_reports(out, ranks, lambda: (out / "log.txt").read_text()[-4000:])
    for r in reports:
        assert r.world_size == ranks
    return reports


def rank_reports(out: Any, ranks: int, logs: Any, crashed_ok: bool = False, prefix: str = "rank") -> list[RankReport]:
    """The reports of ranks ``0..ranks-1`` of a job that ended, from ``<out>/<prefix><r>.json``: a missing one
    fails the test with ``logs()``, and so does a rank that crashed, with its traceback (unless
    ``crashed_ok``)."""
    reports = []
    for rank in range(ranks):
        path = report_path(out, rank, prefix)
        assert path.exists(), f"rank {rank} wrote no report; log:\n{logs()}"
        reports.append(read_report(path))
    for r in reports:
        assert crashed_ok or r.crash is None, f"rank {r.rank} crashed:\n{r.crash}\n{logs()}"
    return reports


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


def _forked(target, rank, port, path, q):
    """One of :func:`two_ranks`' processes: a gloo group of two, ``target(rank, path)``'s result (or the
    error) put on the queue."""
    import torch
    import torch.distributed as dist

    # one intra-op thread: OpenMP's pool, used by an earlier test in the parent, can hang a forked child
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        try:
            q.put((rank, _as_bytes(target(rank, path))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def _as_bytes(result) -> bytes:
    """``result`` serialized to plain bytes. A tensor put on a queue as it is travels as a file descriptor
    that the parent fetches from the child later; when the child has exited by then, the parent's
    ``get`` fails with ``ConnectionResetError`` (seen in CI)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _from_bytes(value):
    import io

    import torch

    return torch.load(io.BytesIO(value), weights_only=False) if isinstance(value, bytes) else value


def two_ranks(target, tmp_path):
    """Runs ``target(rank, str(tmp_path))`` in two forked processes of one gloo group (a hard timeout,
    killed after); returns what each returned (or its error, as text), by rank."""
    ctx = mp.get_context("fork")  # no resource tracker left behind (spawn starts one)
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_forked, args=(target, r, port, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {rank: _from_bytes(value) for rank, value in (q.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def two_nodes(target, tmp_path):
    """:func:`two_ranks` with each rank's own "node" directory (``node0``, ``node1`` under ``tmp_path``, made
    here); fails the test with a rank's error if one raised, else returns what each returned, by rank."""
    for r in range(2):
        (tmp_path / f"node{r}").mkdir()
    got = two_ranks(target, tmp_path)
    for rank in (0, 1):
        assert isinstance(got[rank], tuple), got[rank]
    return got
