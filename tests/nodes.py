"""Simulated nodes: one job script launched once per node on this machine, exactly as a multi-node launch
does (``NODE_RANK``, a shared ``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE``), with Lightning's own launcher
(``_SubprocessScriptLauncher`` under ``LightningEnvironment``) starting each node's local ranks.

Each node gets node-local state, so that nothing can silently rely on a shared host: its own ``/dev/shm``
(a tmpfs in a private mount namespace: ``unshare --mount --propagation private``), its own ``TMPDIR`` and
its own scratch directory (``NODE_SCRATCH``; the working directory and Lightning's ``default_root_dir``). The shared directory (``<tmp_path>/out``) is what a
parallel filesystem is to a real job: checkpoints and the ranks' reports go there.

Job scripts (modules of ``tests/jobs``, started as ``python -m jobs.<name>``) read ``--nodes`` and ``--devices``
and write a ``reports.RankReport`` to ``<out>/rank<global rank>.json`` (``run_and_report``, ``jobs/nodes_job.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from helpers import TESTS
from netcluster import NetCluster
from processes import STACKS_AFTER_VAR, free_port, hang_report, job_command, rank_reports
from reports import RankReport, report_path, reported

# the node's own /dev/shm, then the job: `sh` execs it, so the node's leader keeps the pid Popen returned
_NODE_SHELL = 'mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && exec "$@"'
# with node_local: the node's own directory, kept across launches, appears as /dev/shm/local (what survives a
# restart of the job on a node that is still up)
_NODE_LOCAL_SHELL = ('mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && mkdir /dev/shm/local'
                     ' && mount --bind "$NODE_LOCAL" /dev/shm/local && exec "$@"')
_UNSHARE = ["unshare", "--mount", "--propagation", "private", "--"]
# launcher variables a node must not inherit from the test's own environment (e.g. a test run under torchrun)
_CLEARED = ("LOCAL_RANK", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "WORLD_SIZE", "PL_GLOBAL_SEED")


@functools.lru_cache(maxsize=1)
def namespaces_refused() -> str | None:
    """Why a private mount namespace with its own ``/dev/shm`` cannot be made here (``None`` if it can):
    the tests skip with this reason (they need root or user namespaces, and ``unshare`` from util-linux)."""
    try:
        p = subprocess.run([*_UNSHARE, "sh", "-c", _NODE_SHELL, "sh", "true"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"simulated nodes need `unshare --mount` and `mount -t tmpfs` (node-local /dev/shm): {e}"
    if p.returncode != 0:
        return ("simulated nodes need `unshare --mount` and `mount -t tmpfs` (node-local /dev/shm), refused here:"
                f" {p.stderr.strip()[:300]}")
    return None


def node_job_args(**defaults: str | None) -> argparse.Namespace:
    """(each rank of a node job) What :func:`launch_nodes` passes (``--case``, ``--out``, ``--engine``,
    ``--worker``, ``--nodes``, ``--devices``), and ``--<name>`` for each of ``defaults``, with its default."""
    p = argparse.ArgumentParser()
    p.add_argument("--case")
    p.add_argument("--out", required=True)
    for name, default in {"engine": "nvrx", "worker": "persistent", **defaults}.items():
        p.add_argument(f"--{name}", default=default)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--devices", type=int, required=True)
    return p.parse_args()


def global_rank(devices: int) -> int:
    """(each rank of a node job) ``NODE_RANK * devices + LOCAL_RANK``: what Lightning's launcher makes it."""
    return int(os.environ["NODE_RANK"]) * devices + int(os.environ.get("LOCAL_RANK", "0"))


def run_and_report(out: str, devices: int, body: Callable[[RankReport], None]) -> None:
    """(each rank of a node job) Runs ``body(report)`` and writes the report to ``<out>/rank<global
    rank>.json`` (:func:`read_reports`), with the traceback as ``crash`` if ``body`` raised. The report
    appears whole (``reports.reported``): the test may be polling for it while a node is being killed."""
    rank = global_rank(devices)
    reported(rank, report_path(out, rank), body)


def skip_without_namespaces() -> None:
    import pytest

    reason = namespaces_refused()
    if reason:
        pytest.skip(reason)


def _alive(p: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.status() != psutil.STATUS_ZOMBIE
    return False


class Node:
    """One simulated node: its leader process (local rank 0, the leader of its own session), its directory
    (``tmp``, ``scratch``, ``log.txt``) and everything it started."""

    def __init__(self, rank: int, proc: subprocess.Popen, home: Path, log: Any) -> None:
        self.rank, self.proc, self.home, self.log = rank, proc, home, log

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """Every live process of this node: the leader, its descendants and whatever else is in its group."""
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(self.proc.pid)
            found[leader.pid] = leader
            found.update((c.pid, c) for c in leader.children(recursive=True))
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid not in found and os.getpgid(p.pid) == self.proc.pid:
                    found[p.pid] = p
        return [p for p in found.values() if _alive(p)]

    def kill(self) -> list[int]:
        """SIGKILLs every process of the node at once (a node lost); returns their pids."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return [p.pid for p in procs]

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")


class Cluster:
    """The nodes of one launch, under one hard deadline."""

    def __init__(self, nodes: list[Node], script: str, out: Path, timeout: float) -> None:
        self.nodes, self.script, self.out, self.timeout = nodes, script, out, timeout
        self.deadline = time.monotonic() + timeout

    def wait(self, nodes: list[Node] | None = None) -> list[int]:
        """Exit statuses of the leaders of ``nodes`` (all by default), once every process of each has exited:
        Lightning's launcher does not wait for the local ranks it started, so a leader can exit while another
        rank of its node still writes its report. A node still running at the hard timeout fails the test
        with every node's log and every stack."""
        import pytest

        codes = []
        for node in nodes or self.nodes:
            try:
                codes.append(node.proc.wait(timeout=max(self.deadline - time.monotonic(), 0)))
                while node.processes():  # the leader's orphans: reparented and reaped, or still running
                    if time.monotonic() > self.deadline:
                        raise subprocess.TimeoutExpired(node.proc.args, self.timeout)
                    time.sleep(0.05)
            except subprocess.TimeoutExpired:
                reports = [f"=== node {n.rank} ===\n{hang_report(n.proc.pid, self.script, self.out, n.log)}"
                           for n in self.nodes]
                pytest.fail(f"{self.script} on node {node.rank} hung for {self.timeout}s:\n" + "\n".join(reports))
        return codes

    def logs(self) -> str:
        return "\n".join(f"=== node {n.rank} log ===\n{n.log_text()[-6000:]}" for n in self.nodes)


@contextlib.contextmanager
def launch_nodes(job: str, args: list, tmp_path: Path, nodes: int = 2, devices: int = 2, timeout: float = 300,
                 env: dict | None = None, node_local: bool = False, network: NetCluster | None = None,
                 shared: Path | None = None) -> Iterator[Cluster]:
    """Starts the job ``jobs.<job>`` once per node (``NODE_RANK`` 0..``nodes``-1) with ``--nodes``/``--devices`` and the
    reports' directory ``--out <tmp_path>/out``; each node in its own session and mount namespace, with its
    log in ``<tmp_path>/node<k>/log.txt``, its scratch in ``<tmp_path>/node<k>/scratch`` and its own
    ``TMPDIR`` (a short directory under the system's temp directory, removed afterwards). Leaving the block
    kills every process of every node. ``node_local``: each node's ``<tmp_path>/node<k>/local`` is its
    ``/dev/shm/local`` (see :func:`node_local_dir`). ``network``: each node runs in that emulated cluster's
    network namespace (rendezvous and gloo over its rate-limited links), with the cluster's shared storage
    mounted at ``shared`` (``netcluster.NetCluster.node_command``)."""
    if network is not None and (shared is None or node_local):
        raise ValueError("launch_nodes(network=...) needs shared=<mount point> and does not take node_local")
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    started: list[Node] = []
    logs, tmpdirs = [], []
    try:
        for k in range(nodes):
            home = tmp_path / f"node{k}"
            (home / "scratch").mkdir(parents=True, exist_ok=True)
            # TMPDIR short: shared-memory tensors reach the persistent worker through a Unix socket
            # under it, whose path must stay under 108 bytes (pytest's tmp_path can be longer)
            tmpdirs.append(tempfile.mkdtemp(prefix=f"asyncckpt-node{k}-"))
            node_env = {key: v for key, v in os.environ.items() if key not in _CLEARED}
            paths = [p for p in node_env.get("PYTHONPATH", "").split(os.pathsep) if p]
            node_env.update(
                PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(k),
                WORLD_SIZE=str(nodes * devices), TMPDIR=tmpdirs[-1], NODE_SCRATCH=str(home / "scratch"),
                PYTHONPATH=os.pathsep.join(paths + [TESTS] * (TESTS not in paths)),
                **{STACKS_AFTER_VAR: str(max(timeout - 10, timeout * 0.8))}, **(env or {}),
            )
            if node_local:
                (home / "local").mkdir(exist_ok=True)
                node_env["NODE_LOCAL"] = str(home / "local")
            job_cmd = [*job_command(job), *map(str, args), "--out", str(out), "--nodes", str(nodes),
                       "--devices", str(devices)]
            if network is not None and shared is not None:
                node_env.update(network.node_env(k))
                cmd = network.node_command(k, shared, job_cmd)
            else:
                cmd = [*_UNSHARE, "sh", "-c", _NODE_LOCAL_SHELL if node_local else _NODE_SHELL, "node", *job_cmd]
            log = open(home / "log.txt", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            proc = subprocess.Popen(cmd, cwd=home / "scratch", stdout=log, stderr=subprocess.STDOUT, env=node_env,
                                    start_new_session=True)
            started.append(Node(k, proc, home, log))
        yield Cluster(started, f"jobs.{job}", out, timeout)
    finally:
        for node in started:
            node.kill()
        for node in started:
            node.proc.wait()
        for log in logs:
            log.close()
        for d in tmpdirs:
            shutil.rmtree(d, ignore_errors=True)


def node_local_dir(tmp_path: Path, node: int) -> Path:
    """The directory that node ``node`` sees as ``/dev/shm/local`` under ``launch_nodes(..., node_local=True)``."""
    return tmp_path / f"node{node}" / "local"


def run_nodes(job: str, tmp_path: Path, case: str, nodes: int = 2, devices: int = 2, timeout: float = 300,
              engine: str = "nvrx", worker: str = "persistent", **extra: Any) -> list[RankReport]:
    """Runs ``case`` of the job ``jobs.<job>`` on ``nodes`` x ``devices`` ranks and returns every rank's report in global
    rank order (a missing report or a crashed rank fails the test with its traceback and the logs)."""
    args = ["--case", case, "--engine", engine, "--worker", worker]
    for k, v in extra.items():
        args += [f"--{k}", str(v)]
    with launch_nodes(job, args, tmp_path, nodes=nodes, devices=devices, timeout=timeout) as cluster:
        cluster.wait()
        return read_reports(cluster, nodes * devices)


def read_reports(cluster: Cluster, ranks: int, crashed_ok: bool = False) -> list[RankReport]:
    """The reports of global ranks ``0..ranks-1`` (``processes.rank_reports``), failing with every node's log."""
    return rank_reports(cluster.out, ranks, cluster.logs, crashed_ok)
