"""``lightning-asyncckpt local``: a node's local-tier files as a real single-device fit leaves them, listed,
checked against their CRC32s, and removed (refused while a live process maps them)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers import TinyModel, assert_user_error, loader, trainer
from helpers import run_cli as run
from lightning_asyncckpt import AsyncCheckpointIO, LocalTier

SHARE = "step-0000000004.owner-0"


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A local tier after 4 steps saving every 2: step 4 held, step 2's file kept as a spare."""
    base = tmp_path_factory.mktemp("fit")
    (base / "local").mkdir()
    io = AsyncCheckpointIO("nvrx", local=LocalTier(base / "local", every_n_train_steps=2, replication_factor=1))
    ck = ModelCheckpoint(dirpath=base / "c", every_n_train_steps=8)
    trainer(base, [io], [ck], max_steps=4).fit(TinyModel(), loader())
    return base / "local"


@pytest.fixture
def local(fitted, tmp_path):
    shutil.copytree(fitted, tmp_path / "local")
    return tmp_path / "local"


def _holder(local):
    return local / "asyncckpt-local" / "default" / "holder-0"


def test_lists_each_step_and_the_ranks_whose_shares_this_node_holds(capsys, local):
    code, out, err = run(capsys, "local", local)
    assert code == 0, err
    root = local / "asyncckpt-local" / "default"
    assert out.startswith(f"{root}: 1 share(s) of 1 step(s),"), out
    assert "step 4: shares of 1 of 1 ranks (holder-0: 0); every rank's share is on this node" in out
    # the tier's own directory and one session's are accepted too, and say the same
    assert run(capsys, "local", local / "asyncckpt-local")[1] == out
    assert run(capsys, "local", root)[1] == out
    code, out, _ = run(capsys, "local", local, "--json")
    [session] = json.loads(out)
    assert code == 0 and session["name"] == "default"
    assert [(s["holder"], s["manifest"]["step"], s["manifest"]["owner"]) for s in session["shares"]] == [(0, 4, 0)]
    assert session["nbytes"] == sum(p.stat().st_size for p in _holder(local).iterdir())


def test_verify_passes_then_names_the_share_whose_bytes_changed(capsys, local):
    code, out, err = run(capsys, "local", local, "--verify")
    assert code == 0 and out.endswith("verified 1 share(s): OK\n"), (out, err)
    pt = _holder(local) / f"{SHARE}.pt"
    data = bytearray(pt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pt.write_bytes(bytes(data))
    code, out, err = run(capsys, "local", local, "--verify")
    assert "BAD: rank 0's share in holder-0 has CRC32" in out, out
    assert_user_error(code, err, 1, "1 share(s) failed their CRC32 check")


def test_a_share_without_its_manifest_is_listed_as_unfinished_not_as_a_step(capsys, local):
    (_holder(local) / f"{SHARE}.json").rename(_holder(local) / f"{SHARE}.json.tmp")
    code, out, err = run(capsys, "local", local)
    assert code == 0, err
    assert "0 share(s) of 0 step(s)" in out and "step 4" not in out
    assert "not part of a complete share (an unfinished save or transfer): 3 file(s)" in out, out


def test_remove_lists_first_then_removes_the_session_and_nothing_else(capsys, local):
    (local / "mine.txt").write_text("not the tier's")
    (local / "asyncckpt-local" / "other").mkdir()
    code, out, err = run(capsys, "local", local, "--session", "default", "--remove")
    assert code == 0 and "would remove" in out and "--yes" in out, (out, err)
    assert _holder(local).is_dir()
    code, out, err = run(capsys, "local", local, "--session", "default", "--remove", "--yes")
    assert code == 0 and "removed" in out, (out, err)
    assert not (local / "asyncckpt-local" / "default").exists()
    assert (local / "mine.txt").read_text() == "not the tier's" and (local / "asyncckpt-local" / "other").is_dir()


def test_remove_is_refused_while_a_process_maps_the_files(capsys, local):
    pt = _holder(local) / f"{SHARE}.pt"
    holder = ("import mmap, sys\nf = open(sys.argv[1], 'rb')\nm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
              "f.close()\nprint('mapped', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", holder, str(pt)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "mapped", "the holding process did not map the file"
        code, _, err = run(capsys, "local", local, "--remove", "--yes")
        assert_user_error(code, err, 1, f"pid {proc.pid}", "stop that job first (nothing removed)")
        assert pt.is_file()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    code, out, err = run(capsys, "local", local, "--remove", "--yes")
    assert code == 0 and not pt.exists(), (out, err)


def test_bad_paths_and_sessions_are_user_errors_naming_the_fix(capsys, tmp_path, local):
    code, _, err = run(capsys, "local", tmp_path / "nope")
    assert_user_error(code, err, 2, "nope: no such file or directory")
    code, _, err = run(capsys, "local", tmp_path)
    assert_user_error(code, err, 2, f"{tmp_path}: no local tier here", "pass that DIR")
    code, _, err = run(capsys, "local", local, "--session", "run9")
    assert_user_error(code, err, 2, "no session 'run9'; sessions here: default")
    code, _, err = run(capsys, "local", local, "--yes")
    assert_user_error(code, err, 2, "--yes confirms --remove")
    code, _, err = run(capsys, "local", local, "--remove", "--yes", "--json")
    assert_user_error(code, err, 2, "--json only lists")
    assert os.listdir(_holder(local))  # nothing removed by a refused call


def test_a_node_holding_part_of_a_step_says_whose_shares_are_elsewhere(capsys, tmp_path):
    """Node 0 of 2 (ranks 0 and 1, cliques {0, 2} and {1, 3}) after its peers' holder directories were lost:
    written with the tier's own store."""
    import torch

    from lightning_asyncckpt.tiers import packing
    from lightning_asyncckpt.tiers.store import Held, LocalStore

    root = tmp_path / "asyncckpt-local" / "run1"
    flat = torch.arange(64, dtype=torch.uint8)
    for holder, owners in ((0, (0, 2)), (1, (1,))):
        store = LocalStore(root, holder)
        for owner in owners:
            store.write(Held(6, owner, 64, packing.crc32(flat), (4, 2, 2), head_nbytes=1, head_crc32=packing.crc32(b"h")),
                        flat, b"h")
        store.close()
    code, out, err = run(capsys, "local", tmp_path, "--verify")
    assert code == 0, err
    assert "step 6: shares of 3 of 4 ranks (holder-0: 0, 2; holder-1: 1); rank 3: on other nodes only" in out, out


def test_says_whether_the_tmpfs_it_is_on_has_huge_pages(capsys, fitted, tmp_path):
    """The same files copied onto a real tmpfs without huge pages, then onto one mounted huge=within_size."""
    from helpers import mounted_tmpfs
    from lightning_asyncckpt.tiers import huge_pages

    if any(f"[{k}]" in huge_pages.SHMEM_ENABLED.read_text() for k in ("deny", "force")):
        pytest.skip("this kernel decides huge pages for every tmpfs, whatever the mount says")
    code, out, _ = run(capsys, "local", fitted)
    if huge_pages.tmpfs_huge(fitted) is None:
        assert code == 0 and "huge" not in out, out  # not on a tmpfs: nothing said
    for options, line in (("", "on a tmpfs without huge pages: a recovery moves and checks these files about twice"),
                          ("huge=within_size", "on a tmpfs with huge=within_size")):
        with mounted_tmpfs(tmp_path / f"m{len(options)}", "16m", options) as mnt:
            shutil.copytree(fitted, mnt / "local")
            code, out, err = run(capsys, "local", mnt / "local")
            assert code == 0 and line in out, (err, out)
            code, out, _ = run(capsys, "local", mnt / "local", "--json")
            assert json.loads(out)[0]["tmpfs_huge"] == (options.removeprefix("huge=") or "never")


def _others_tree(root):
    """A directory that is not the tier's, shaped like it (subdirectories, share-named files): must survive."""
    (root / "default" / "holder-0").mkdir(parents=True)
    (root / "default" / "holder-0" / f"{SHARE}.pt").write_bytes(b"p" * 100)
    (root / "projects").mkdir()
    (root / "projects" / "thesis.tex").write_text("years of work")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_remove_never_follows_a_linked_tier_directory(capsys, tmp_path):
    other = tmp_path / "other"
    before = _others_tree(other)
    local = tmp_path / "local"
    local.mkdir()
    (local / "asyncckpt-local").symlink_to(other)
    code, out, err = run(capsys, "local", local, "--remove", "--yes")
    assert_user_error(code, err, 2, f"{local / 'asyncckpt-local'} is a symbolic link", "never makes one")
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    code, _, err = run(capsys, "local", local / "asyncckpt-local", "--remove", "--yes")
    assert_user_error(code, err, 2, "is a symbolic link")
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before


def test_remove_takes_a_linked_session_or_holder_as_a_link_only(capsys, local, tmp_path):
    other = tmp_path / "other"
    before = _others_tree(other)
    tier = local / "asyncckpt-local"
    (tier / "run2").symlink_to(other / "default")  # a session that is a link: not one of the tier's sessions
    (tier / "default" / "holder-1").symlink_to(other / "default" / "holder-0")  # a holder that is a link
    (_holder(local) / f"{SHARE}.json.tmp").symlink_to(other / "projects" / "thesis.tex")
    code, out, err = run(capsys, "local", local, "--remove", "--yes")
    assert code == 0, (out, err)
    assert f"removed {tier / 'default'} (" in out and "(0 B)" not in out, out
    assert not (tier / "default").exists()
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before
    assert (other / "projects" / "thesis.tex").read_text() == "years of work"
    assert (tier / "run2").is_symlink()  # not a session of the tier: never listed, never removed
    assert "run2" not in out


def test_remove_keeps_what_is_not_the_tiers_and_says_so(capsys, local):
    mine = _holder(local) / "notes.txt"
    mine.write_text("mine")
    code, out, err = run(capsys, "local", local, "--remove", "--yes")
    assert code == 0, (out, err)
    assert f"kept {mine} (not a file the local tier makes)" in out, out
    assert mine.read_text() == "mine" and sorted(os.listdir(_holder(local))) == ["notes.txt"]
