"""The emulated cluster itself (``netcluster.NetCluster``): nodes reach the shared storage only through their
rate-limited links, a file written on one node is read on another, and the storage's own counters see the
bytes it served."""

from __future__ import annotations

import subprocess
import sys

import pytest

import netcluster

MIB = 1 << 20


def _on_node(cluster: netcluster.NetCluster, node: int, shared, code: str) -> str:
    cmd = cluster.node_command(node, shared, [sys.executable, "-c", code])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


@pytest.fixture
def cluster():
    why = netcluster.refused()
    if why:
        pytest.skip(why)
    with netcluster.NetCluster(nodes=2, nic_mbit=400, storage_mbit=400) as c:
        yield c


def test_a_file_written_on_one_node_is_read_on_another_through_the_storage_link(cluster, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    write = ("import os, hashlib\n"
             f"data = os.urandom({4 * MIB})\n"
             f"with open({str(shared / 'x.bin')!r}, 'wb') as f:\n"
             "    f.write(data); f.flush(); os.fsync(f.fileno())\n"
             "print(hashlib.sha256(data).hexdigest())")
    written = _on_node(cluster, 0, shared, write)
    assert not (shared / "x.bin").exists(), "the shared storage leaked into the host's directory"
    before = cluster.storage_bytes_sent()
    read = f"import hashlib; print(hashlib.sha256(open({str(shared / 'x.bin')!r}, 'rb').read()).hexdigest())"
    assert _on_node(cluster, 1, shared, read) == written
    served = cluster.storage_bytes_sent() - before
    # the storage's own counter: the file once, plus HTTP and TCP/IP headers (jumbo frames), not a copy more
    assert 4 * MIB <= served <= 4 * MIB * 1.05, served


def test_every_link_is_rate_limited_and_nodes_reach_each_other(cluster):
    for node in range(2):
        qdisc = subprocess.run(["tc", "-n", cluster.ns(node), "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout
        assert "tbf" in qdisc and "rate 400Mbit" in qdisc, qdisc
    qdisc = subprocess.run(["tc", "-n", cluster.switch_ns, "qdisc", "show", "dev", "vst"], capture_output=True,
                           text=True, check=True).stdout
    assert "rate 400Mbit" in qdisc, qdisc
    probe = (f"import socket; s = socket.create_connection(({cluster.storage_ip!r}, 5000), timeout=10); print('ok')")
    assert cluster.exec(1, sys.executable, "-c", probe).strip() == "ok"


def test_leaving_deletes_every_namespace(tmp_path):
    why = netcluster.refused()
    if why:
        pytest.skip(why)
    with netcluster.NetCluster(nodes=1) as c:
        names = [c.ns(0), c.storage_ns, c.switch_ns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(n in listed for n in names), listed
