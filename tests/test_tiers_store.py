"""The local tier's node-local store: which shares it lists, the files it reuses and makes ahead, how a
restored checkpoint maps them, and a full directory (real files, a real tmpfs where one is needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.tiers import packing
from lightning_asyncckpt.tiers.store import Held, LocalStore

TOPO = (4, 2, 2)


def _write(store, step, owner, data, run=""):
    head = b"header"
    store.write(Held(step, owner, data.numel(), packing.crc32(data), TOPO, "replicated", len(head),
                     packing.crc32(head), run), data, head)


def test_store_lists_complete_shares_only_and_removes_only_older_steps_of_its_own_holder(tmp_path):
    store, other = LocalStore(tmp_path, 0, keep_free=1), LocalStore(tmp_path, 1)
    for step in (8, 10):
        _write(store, step, 0, torch.full((100,), step, dtype=torch.uint8))
    _write(other, 8, 1, torch.ones(1, dtype=torch.uint8))
    (store.dir / "step-0000000012.owner-0.pt").write_bytes(b"unfinished: no manifest")
    (tmp_path / "user-file.ckpt").write_bytes(b"not ours")
    assert [(h.step, h.owner) for h in store.holdings(TOPO)] == [(8, 0), (10, 0)]
    assert store.holdings((8, 2, 2)) == []  # saved under another topology: not usable
    head, flat = store.map(store.holdings(TOPO)[1])
    assert head == b"header" and torch.equal(flat, torch.full((100,), 10, dtype=torch.uint8))
    store.remove_older(10)
    assert [h.step for h in store.holdings(TOPO)] == [10]
    assert sorted(p.name for p in store.dir.glob("step-0000000008*")) == []
    assert (store.dir / "step-0000000012.owner-0.pt").exists()  # newer: may still be being written
    assert [h.step for h in other.holdings(TOPO)] == [8] and (tmp_path / "user-file.ckpt").exists()


def test_a_removed_steps_file_is_reused_by_the_next_share_of_its_size(tmp_path):
    """The pool keeps a removed step's tensor file (mapped) and gives it to the next share of that size:
    the same inode, now under the new step's name, with the new bytes."""
    store = LocalStore(tmp_path, 0, keep_free=1)
    _write(store, 2, 0, torch.full((4096,), 2, dtype=torch.uint8))
    inode = (store.dir / "step-0000000002.owner-0.pt").stat().st_ino
    _write(store, 4, 0, torch.full((4096,), 4, dtype=torch.uint8))
    store.remove_older(4)
    assert not list(store.dir.glob("step-0000000002*"))
    _write(store, 6, 0, torch.full((4096,), 6, dtype=torch.uint8))
    assert (store.dir / "step-0000000006.owner-0.pt").stat().st_ino == inode
    assert (store.dir / "step-0000000006.owner-0.pt").read_bytes() == bytes([6]) * 4096
    store.close()
    assert not list(store.dir.glob(".free-*"))


def test_a_spare_of_another_size_is_resized_for_the_next_share_not_replaced(tmp_path):
    """No spare of the share's size: the closest one is renamed and resized (the same inode, the new size,
    the new bytes), so a first save whose files were sized a few bytes off still takes no new file."""
    store = LocalStore(tmp_path, 0, keep_free=1)
    assert store.pool.prepare([4096], uses=1) == 1
    (spare,) = store.dir.glob(".free-*")
    inode = spare.stat().st_ino
    _write(store, 2, 0, torch.full((4000,), 7, dtype=torch.uint8))
    pt = store.dir / "step-0000000002.owner-0.pt"
    assert pt.stat().st_ino == inode and pt.read_bytes() == bytes([7]) * 4000
    assert [(h.step, h.nbytes) for h in store.holdings(TOPO)] == [(2, 4000)]


def test_after_the_first_save_the_next_saves_files_are_made_ahead_then_reused(tmp_path):
    store = LocalStore(tmp_path, 0, keep_free=1)
    _write(store, 2, 0, torch.full((4096,), 2, dtype=torch.uint8))
    assert store.pool.prepare([4096]) == 1  # the file of step 2 in use, and one spare for step 4
    assert store.pool.prepare([4096]) == 0  # already there
    (spare,) = store.dir.glob(".free-*")
    inode = spare.stat().st_ino
    _write(store, 4, 0, torch.full((4096,), 4, dtype=torch.uint8))
    assert (store.dir / "step-0000000004.owner-0.pt").stat().st_ino == inode
    assert not list(store.dir.glob(".free-*"))


def _resident_kib(path) -> int:
    """Kilobytes of ``path``'s pages mapped into this process (its mappings' Rss in /proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_spare_made_ahead_is_faulted_in_and_a_file_written_at_once_is_faulted_by_its_write(tmp_path):
    """The save call that takes a spare takes no page fault (the writer thread took them); a file reserved
    with no spare (a recovery's received share) is not faulted in twice, first empty, then by the write."""
    store = LocalStore(tmp_path, 0, keep_free=1)
    nbytes = 1 << 20
    assert store.pool.prepare([nbytes], uses=1) == 1
    (spare,) = store.dir.glob(".free-*")
    assert _resident_kib(spare) == nbytes // 1024
    store.pool.close()
    fresh = LocalStore(tmp_path / "other", 0, keep_free=0)
    mapped = fresh.reserve(2, 0, nbytes)
    assert _resident_kib(mapped.path) == 0
    mapped.tensor.fill_(7)
    assert _resident_kib(mapped.path) == nbytes // 1024


def test_before_the_first_save_its_files_are_made_in_the_background_and_the_save_reuses_them(tmp_path):
    """TierRun.prepare (called at a step boundary before the first local save) makes the first save's files
    in the writer thread; the save then renames them (the same inodes) instead of creating its own."""
    from lightning_asyncckpt.tiers.setup import open_tier

    run = open_tier(LocalTier(tmp_path, replication_factor=1, emergency_signals=()), node_rank=0, local_world_size=1)
    try:
        state = {"w": torch.ones(10_000), "global_step": 2}
        assert run.wants_files
        run.prepare(state)
        assert not run.wants_files
        assert run.writer.wait(60)
        holder = run.store.dir
        spares = {p.stat().st_ino for p in holder.glob(".free-*")}
        assert len(spares) == 1
        run.save(2, state)
        assert run.finish() == 2
        assert (holder / "step-0000000002.owner-0.pt").stat().st_ino in spares
        assert run.take(run.latest(None))["w"].equal(state["w"])
    finally:
        run.close()


def test_a_restored_checkpoint_maps_its_files_privately_and_later_saves_never_write_into_them(tmp_path):
    """The restored tensors view private mappings of the step's files (no copy): writing them leaves the
    files as saved, and the saves after the restore take new files instead of reusing these (a reused file
    would show the new bytes through every page the checkpoint has not written)."""
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(tmp_path, replication_factor=1, emergency_signals=())
    run = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        state = {"w": torch.full((50_000,), 2.0), "global_step": 2}
        run.save(2, state)
        assert run.finish() == 2
        restored = run.take(run.latest(None))
        for step in (4, 6, 8):  # step 2's files are removed after 4 and, without the retirement, reused by 6
            state["w"].fill_(float(step))
            state["global_step"] = step
            run.save(step, state)
            assert run.finish() == step
        assert restored["global_step"] == 2 and torch.equal(restored["w"], torch.full((50_000,), 2.0))
        restored["w"].fill_(-1.0)  # copy-on-write: the newest step's files keep their bytes
        again = run.take(run.latest(None))
        assert again["global_step"] == 8 and torch.equal(again["w"], torch.full((50_000,), 8.0))
    finally:
        run.close()


def test_a_resized_job_does_not_use_steps_saved_under_another_topology_and_says_so(tmp_path, caplog):
    """Step 10 was saved by 4 ranks (replication 2 x 2); a job of 1 rank finds it in its holder directory but
    cannot reshard it: it resumes from the persistent tier, and the log line names both layouts and the fix."""
    from lightning_asyncckpt.tiers import run_identity
    from lightning_asyncckpt.tiers.setup import open_tier

    tier = LocalTier(tmp_path, replication_factor=1, emergency_signals=())
    old = LocalStore(tier.root, 0)
    _write(old, 10, 0, torch.arange(10, dtype=torch.uint8), run="r1")  # this run's, before it was resized
    run_identity.write_record(old.dir, run_identity.RunRecord("r1", "", 1))
    old.close()
    run = open_tier(tier, node_rank=0, local_world_size=1)
    try:
        with caplog.at_level("WARNING"):
            assert run.latest("persistent.ckpt") == "persistent.ckpt"
    finally:
        run.close()
    assert ("resuming from the persistent tier, persistent.ckpt: local tier: step 10 was saved by 4"
            " rank(s) with replication_jump=2, replication_factor=2, and this run has 1 with replication_jump=1,"
            " replication_factor=1: the local tier does not reshard") in caplog.text
    assert (old.dir / "step-0000000010.owner-0.pt").exists()  # nothing removed by looking


def test_a_share_cut_short_is_not_listed(tmp_path):
    store = LocalStore(tmp_path, 0)
    _write(store, 4, 0, torch.arange(10, dtype=torch.uint8))
    (store.dir / "step-0000000004.owner-0.pt").write_bytes(b"01234")
    assert store.holdings(TOPO) == []


def test_a_full_directory_fails_the_reservation_cleanly_not_with_sigbus(tmpfs_1m):
    """posix_fallocate reserves a share's file before the copy: on a full filesystem the reservation
    raises ENOSPC and leaves no file; a mapping is never written past the space there is."""
    store = LocalStore(tmpfs_1m, 0)
    with pytest.raises(OSError, match="No space left"):
        store.reserve(2, 0, 4 << 20)
    assert not [p for p in tmpfs_1m.rglob("*") if p.is_file()]



def test_replicas_left_for_later_that_do_not_all_fit_are_left_out_and_their_space_given_back(tmpfs_1m):
    """A rank that holds two peers' replicas after a sharded restore reserves their files after the resume:
    on a 1 MiB tmpfs the first (400 kB) fits, the second (800 kB) does not. Both are left out (a replica
    kept alone would not be sent), and the first one's space is free again for the next local save."""
    from lightning_asyncckpt.tiers import deferred_refill

    store = LocalStore(tmpfs_1m, rank=1)
    topology = (3, 1, 3)
    moves = [(0, 0, 1, Held(2, 0, 400_000, 0, topology, "sharded")),
             (2, 2, 1, Held(2, 2, 800_000, 0, topology, "sharded"))]
    assert deferred_refill.run(deferred_refill.Deferred(moves), 1, store, None) == 0
    assert [p.name for p in tmpfs_1m.rglob("*") if p.is_file()] == []
    store.write(Held(4, 1, 900_000, 0, topology, "sharded"), torch.zeros(900_000, dtype=torch.uint8), b"h")
