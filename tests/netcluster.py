"""An emulated cluster's network and shared storage, for the simulated nodes of ``nodes.launch_nodes``.

Each node gets its own network namespace whose one interface (``eth0``) is a veth pair to a bridge in a
switch namespace, with a ``tc`` token-bucket rate limit on both directions: the node's NIC. The shared storage
is moto's S3-protocol server in its own namespace, behind its own rate-limited link, mounted on every node
at the same path with ``s3fs`` (FUSE): a shared file system whose every byte crosses the storage's link. The
bytes the storage sent are read from its link's counters in the switch namespace: the storage's own view,
not the client's.

Nothing here is routed to or from the host: the namespaces' addresses (``10.213.<n>.0/24``) exist only
inside them, and the test process reaches them only through ``ip netns exec``. Leaving :class:`NetCluster`
stops the server and deletes every namespace (their interfaces go with them).

Needs root, ``ip`` and ``tc`` (iproute2), ``/dev/fuse`` and Debian's ``s3fs``; :func:`refused` says why not.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "shared"
_PORT = 5000
_MTU = 9000  # jumbo frames: TCP/IP headers add ~0.6% to the bytes counted at the storage's link, not ~4%
_tags = itertools.count()


def _run(*cmd: str, timeout: float = 30) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()[:500]}")
    return p.stdout


def port_bytes(switch_ns: str, port: str, direction: str) -> int:
    """The bytes counted at the switch's ``port`` (``"rx"``: sent by the host behind it); any process that may
    enter ``switch_ns`` may call it, a rank inside a node's namespace included (root)."""
    link = json.loads(_run("ip", "-n", switch_ns, "-s", "-j", "link", "show", port))[0]
    stats = link.get("stats64") or link["stats"]
    return int(stats[direction]["bytes"])


def storage_bytes_sent(switch_ns: str) -> int:
    """Bytes the storage of the cluster whose switch is ``switch_ns`` has sent (:func:`port_bytes`)."""
    return port_bytes(switch_ns, "vst", "rx")


@functools.lru_cache(maxsize=1)
def refused() -> str | None:
    """Why an emulated cluster cannot be made here (``None`` if it can): tests skip with this reason."""
    missing = [tool for tool in ("ip", "tc", "s3fs", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs {', '.join(missing)} (iproute2, Debian's s3fs, util-linux)"
    if not os.path.exists("/dev/fuse"):
        return "the emulated cluster's shared storage is a FUSE mount (s3fs): /dev/fuse is missing"
    name = f"ackprobe{os.getpid()}"
    try:
        _run("ip", "netns", "add", name)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"the emulated cluster needs network namespaces (root): {e}"
    with contextlib.suppress(Exception):
        _run("ip", "netns", "del", name)
    return None


class NetCluster:
    """``nodes`` node namespaces and one storage namespace on one bridge (a context manager).

    Args:
        nodes: how many nodes.
        nic_mbit: each node's link rate, both ways, in Mbit/s.
        storage_mbit: the storage's link rate, both ways, in Mbit/s (all nodes share it).
    """

    def __init__(self, nodes: int, nic_mbit: float = 200, storage_mbit: float = 200) -> None:
        self.nodes, self.nic_mbit, self.storage_mbit = nodes, nic_mbit, storage_mbit
        n = (os.getpid() * 7 + next(_tags)) % 250 + 1
        self.prefix = f"ack{os.getpid()}x{n}"
        self.subnet = f"10.213.{n}"
        self._made: list[str] = []
        self._server: subprocess.Popen | None = None
        self._private = Path(tempfile.mkdtemp(prefix="asyncckpt-net-"))  # 0700: the s3fs password file
        self.passwd = self._private / "s3.passwd"

    # names and addresses
    def ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @property
    def storage_ns(self) -> str:
        return f"{self.prefix}-st"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    def ip(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    @property
    def storage_ip(self) -> str:
        return f"{self.subnet}.200"

    @property
    def storage_url(self) -> str:
        return f"http://{self.storage_ip}:{_PORT}"

    def __enter__(self) -> NetCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _link(self, ns: str, port: str, address: str, mbit: float) -> None:
        """A veth from the switch's ``port`` to ``eth0`` in ``ns``, rate-limited both ways to ``mbit``."""
        sw = self.switch_ns
        _run("ip", "-n", sw, "link", "add", port, "mtu", str(_MTU), "type", "veth", "peer", "name", "eth0",
             "mtu", str(_MTU), "netns", ns)
        _run("ip", "-n", sw, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        # a token bucket on each end's egress: what leaves the node and what the switch sends it. The burst
        # must hold at least one jumbo frame, and a few ms of traffic so that the rate is met on average
        burst = max(int(mbit * 1e6 / 8 * 0.004), 4 * _MTU)
        for where, dev in ((ns, "eth0"), (sw, port)):
            _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", str(burst), "latency", "100ms")

    def _build(self) -> None:
        for ns in (self.switch_ns, self.storage_ns, *map(self.ns, range(self.nodes))):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
        _run("ip", "-n", self.switch_ns, "link", "add", "br0", "mtu", str(_MTU), "type", "bridge")
        _run("ip", "-n", self.switch_ns, "link", "set", "br0", "up")
        self._link(self.storage_ns, "vst", self.storage_ip, self.storage_mbit)
        for k in range(self.nodes):
            self._link(self.ns(k), f"v{k}", self.ip(k), self.nic_mbit)
        self.passwd.write_text("asyncckpt:asyncckpt\n")
        self.passwd.chmod(0o600)
        self._server = subprocess.Popen(
            ["ip", "netns", "exec", self.storage_ns, sys.executable, "-m", "moto.server", "-H", self.storage_ip,
             "-p", str(_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # the handshake: from node 0's namespace, the server answers and the bucket exists (bounded)
        ready = (
            "import time, boto3\n"
            f"s3 = boto3.client('s3', endpoint_url={self.storage_url!r}, aws_access_key_id='asyncckpt',\n"
            "                  aws_secret_access_key='asyncckpt', region_name='us-east-1')\n"
            "end = time.monotonic() + 60\n"
            "while True:\n"
            "    try:\n"
            f"        s3.create_bucket(Bucket={BUCKET!r}); break\n"
            "    except Exception:\n"
            "        if time.monotonic() > end: raise\n"
            "        time.sleep(0.2)\n"
        )
        self.exec(0, sys.executable, "-c", ready, timeout=90)

    def exec(self, node: int, *cmd: str, timeout: float = 60) -> str:
        """Runs ``cmd`` in node ``node``'s network namespace and returns its output (raises on failure)."""
        return _run("ip", "netns", "exec", self.ns(node), *cmd, timeout=timeout)

    def node_command(self, node: int, mountpoint: Path, command: list[str]) -> list[str]:
        """``command`` as node ``node`` runs it: in its network namespace, in a private mount namespace with
        the shared storage mounted at ``mountpoint`` (the same path on every node) and its own ``/dev/shm``.
        The FUSE daemon is the command's sibling in the node's process group; it is stopped when the command
        ends, and the command's exit status is the node's."""
        # s3fs reads ahead up to multipart_size x parallel_count past each read (50 MB by default): a rank that
        # reads its quarter of a file would pull tens of MiB of its neighbour's. One 5 MB part at a time keeps
        # that to about a part, as a parallel file system client's readahead of a few MiB does.
        mount = (
            f"s3fs {BUCKET} {shlex.quote(str(mountpoint))} -f -o passwd_file={shlex.quote(str(self.passwd))}"
            f",url={self.storage_url},use_path_request_style,allow_other,parallel_count=1,multipart_size=5,dbglevel=crit 1>&2 & fs=$!; "
            f"i=0; until mountpoint -q {shlex.quote(str(mountpoint))}; do i=$((i+1)); "
            f"[ $i -gt 600 ] && {{ echo 's3fs did not mount' >&2; kill $fs; exit 97; }}; "
            "kill -0 $fs 2>/dev/null || { echo 's3fs exited' >&2; exit 97; }; sleep 0.05; done; "
        )
        shell = ("mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && " + mount +
                 '"$@"; rc=$?; kill $fs 2>/dev/null; wait $fs; exit $rc')
        return ["ip", "netns", "exec", self.ns(node), "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", shell, "node", *command]

    def node_env(self, node: int) -> dict[str, str]:
        """What node ``node``'s ranks need in their environment: the rendezvous on node 0's address, and
        gloo on the node's one interface."""
        return {"MASTER_ADDR": self.ip(0), "GLOO_SOCKET_IFNAME": "eth0", "NODE_IP": self.ip(node)}

    def run_on_every_node(self, shared: Path, command: list[str], logs: Path, timeout: float,
                          env: dict[str, str] | None = None) -> list[int | str]:
        """Runs ``command`` on every node at once (:meth:`node_command`, with ``NODE_INDEX`` and
        :meth:`node_env` in its environment), each node's output in ``logs/node<k>.log``; returns their exit
        statuses, ``"timeout"`` for a node still running at ``timeout`` seconds (then killed, as every node
        left running is)."""
        procs: list[subprocess.Popen] = []
        codes: list[int | str] = []
        try:
            for k in range(self.nodes):
                node_env = {**os.environ, **(env or {}), **self.node_env(k), "NODE_INDEX": str(k)}
                with open(logs / f"node{k}.log", "w") as log:  # the child holds its own descriptor
                    procs.append(subprocess.Popen(self.node_command(k, shared, command), env=node_env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    codes.append(p.wait(timeout=max(deadline - time.monotonic(), 1)))
                except subprocess.TimeoutExpired:
                    codes.append("timeout")
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, 9)
                    p.wait()
        return codes

    def storage_bytes_sent(self) -> int:
        """Bytes the storage has sent since the cluster was made, counted at the switch's port to it."""
        return storage_bytes_sent(self.switch_ns)

    def storage_bytes_received(self) -> int:
        """Bytes the storage has received (what was written to it, with the protocol's own bytes)."""
        return port_bytes(self.switch_ns, "vst", "tx")

    def node_bytes_received(self, node: int) -> int:
        """Bytes node ``node`` has received (from the storage and from other nodes)."""
        return port_bytes(self.switch_ns, f"v{node}", "tx")

    def close(self) -> None:
        """Stops the server and deletes the namespaces (idempotent)."""
        if self._server is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._server.pid, 9)
            self._server.wait()
            self._server = None
        for ns in reversed(self._made):  # the nodes' processes are their launcher's to kill
            with contextlib.suppress(Exception):
                _run("ip", "netns", "del", ns)
        self._made.clear()
        shutil.rmtree(self._private, ignore_errors=True)
