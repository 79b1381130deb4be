"""Read-once resume on 2 simulated nodes x 2 ranks (tests/nodes.py: each node in its own mount namespace),
counted at the storage: the shared directory is read through a counting FUSE passthrough
(tests/counting_fs.py, ``direct_io``: every read reaches it), so the bytes are the storage's own count, not
our client's. DDP with the plugin saves; the same ranks resume with the plugin and with stock Lightning from
hard links of that file (``jobs/read_once_job.py``): both start from exactly the saved state, the plugin's
resume reads the file's bytes once (within 5%), stock's once per rank. The same for AsyncDDPStrategy's
checkpoint directory, against each rank reading it alone (the plugin's load before read-once)."""

from __future__ import annotations

import contextlib

import pytest
from counting_fs import MountRefused, counting_mount, fuse_refused
from nodes import launch_nodes, read_reports, skip_without_namespaces

pytestmark = [pytest.mark.scale]
NODES, DEVICES = 2, 2


def _run(tmp_path, case):
    """Every rank's report of ``case`` on 2 x 2 ranks, and the bytes the shared directory served, per file."""
    skip_without_namespaces()
    reason = fuse_refused()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--case", case, "--engine", "nvrx", "--worker", "persistent", "--shared", tmp_path / "shared"]
    with contextlib.ExitStack() as stack:
        try:
            counts = stack.enter_context(counting_mount(out, tmp_path / "shared"))
        except MountRefused as e:
            pytest.skip(str(e))
        with launch_nodes("read_once_job", args, tmp_path, nodes=NODES, devices=DEVICES, timeout=240) as cluster:
            cluster.wait()  # every process of every node has exited: every read it made was answered, and counted
            reports = read_reports(cluster, NODES * DEVICES)
        return reports, counts.read()


def test_a_ddp_resume_reads_the_checkpoint_from_shared_storage_once(tmp_path):
    reports, served = _run(tmp_path, "file")
    assert all(r["ours_exact"] and r["stock_exact"] for r in reports)
    size = reports[0]["size"]
    ours, stock = served.get("ours.ckpt", 0) / size, served.get("stock.ckpt", 0) / size
    print(f"\nbytes served per resume, in files of {size} bytes: ours {ours:.3f}x, stock {stock:.3f}x; "
          f"a load by every rank: ours {[round(r['ours_load_s'], 3) for r in reports]} s, "
          f"stock {[round(r['stock_load_s'], 3) for r in reports]} s ({served})")
    assert stock >= NODES * DEVICES * 0.95, served  # the baseline: every rank reads the whole file
    assert abs(ours - 1.0) <= 0.05, served


@pytest.mark.slow
def test_an_async_ddp_strategy_directory_is_read_from_shared_storage_once(tmp_path):
    """AsyncDDPStrategy's directory: read once as the resume reads it; each rank alone reads all of it."""
    reports, served = _run(tmp_path, "directory")
    assert all(r["dir_exact"] for r in reports)
    size = reports[0]["dir_size"]
    ours = sum(n for f, n in served.items() if f.startswith("dir-ours/")) / size
    alone = sum(n for f, n in served.items() if f.startswith("dir-alone/")) / size
    print(f"\ndirectory of {size} bytes: read once {ours:.3f}x, each rank alone {alone:.3f}x; a load: "
          f"{[round(r['dir_ours_load_s'], 3) for r in reports]} s against "
          f"{[round(r['dir_alone_load_s'], 3) for r in reports]} s")
    assert alone >= NODES * DEVICES * 0.95, served
    assert abs(ours - 1.0) <= 0.05, served
