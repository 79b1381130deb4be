import os
import subprocess
import sys

import pytest

from lightning_asyncckpt.storage import commit


def _complete(tmp, payload):
    tmp.mkdir()
    (tmp / commit.METADATA_FILE).write_text("md")
    (tmp / "data").write_text(payload)


def test_publish_makes_path_appear_only_complete(tmp_path):
    path = tmp_path / "a.ckpt"
    tmp = commit.tmp_for(path, "1")
    assert commit.is_leftover(tmp.name) and not commit.is_leftover(path.name)
    tmp.mkdir()
    try:
        commit.publish(tmp, path)
        raise AssertionError("publish must refuse a directory without metadata")
    except FileNotFoundError:
        pass
    assert not path.exists()
    (tmp / commit.METADATA_FILE).write_text("md")
    commit.publish(tmp, path)
    assert commit.is_committed(path) and not tmp.exists()


def test_publish_replaces_existing_checkpoint_and_link(tmp_path):
    path = tmp_path / "last.ckpt"
    _complete(commit.tmp_for(path, "1"), "old")
    commit.publish(commit.tmp_for(path, "1"), path)
    _complete(commit.tmp_for(path, "2"), "new")
    commit.publish(commit.tmp_for(path, "2"), path)
    assert (path / "data").read_text() == "new"
    assert os.listdir(tmp_path) == ["last.ckpt"]
    # a symlink left by ModelCheckpoint(save_last="link") is replaced, its target kept
    target = tmp_path / "other.ckpt"
    _complete(target, "target")
    path2 = tmp_path / "linked.ckpt"
    path2.symlink_to(target)
    _complete(commit.tmp_for(path2, "3"), "fresh")
    commit.publish(commit.tmp_for(path2, "3"), path2)
    assert not path2.is_symlink() and (path2 / "data").read_text() == "fresh"
    assert (target / "data").read_text() == "target"


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it now (a reuse in between would only keep a leftover)


def test_cleanup_leftovers_keeps_what_is_asked(tmp_path):
    mine = commit.new_token()
    keep = commit.tmp_for(tmp_path / "b.ckpt", f"{mine}-1")
    keep.mkdir()
    stale = commit.tmp_for(tmp_path / "a.ckpt", f"{commit.new_token(_dead_pid())}-1")
    stale.mkdir()
    (tmp_path / "a.ckpt").mkdir()
    removed = commit.cleanup_leftovers(tmp_path, keep_prefix=commit.tmp_for(tmp_path, mine).name)
    assert removed == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([keep.name, "a.ckpt"])


def test_cleanup_keeps_the_saves_in_flight_of_another_live_job(tmp_path):
    """Two jobs save into one directory: the first save of the second job removes only what is provably
    dead, never the first job's save in flight (its process lives), nor another host's."""
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as other:
        try:
            live = commit.tmp_for(tmp_path / "x.ckpt", f"{commit.new_token(other.pid)}-3")
            elsewhere = commit.tmp_for(tmp_path / "y.ckpt", "0badc0de.1.abcdef-1")  # another host's
            dead = commit.tmp_for(tmp_path / "z.ckpt", f"{commit.new_token(_dead_pid())}-c2")
            for d in (live, elsewhere, dead):
                d.mkdir()
            removed = commit.cleanup_leftovers(tmp_path, keep_prefix=commit.tmp_for(tmp_path, commit.new_token()).name)
            assert removed == [dead]
            assert sorted(os.listdir(tmp_path)) == sorted([live.name, elsewhere.name])
        finally:
            other.stdin.close()


def test_a_crash_between_the_fallback_renames_never_loses_the_last_checkpoint(tmp_path, monkeypatch):
    """Where RENAME_EXCHANGE is unsupported (NFS, Lustre, FUSE), replacing last.ckpt takes two renames. A
    crash between them leaves nothing at last.ckpt; the next run's cleanup puts the old one back."""
    last = tmp_path / "last.ckpt"
    _complete(commit.tmp_for(last, "old"), "old")
    commit.publish(commit.tmp_for(last, "old"), last)
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)  # the filesystem cannot exchange
    crashed = commit.tmp_for(last, f"{commit.new_token(_dead_pid())}-7")  # a process that died mid-publish
    _complete(crashed, "new")
    real_rename = os.rename

    def crash_on_second(src, dst):
        if os.fspath(src) == os.fspath(crashed):
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        commit.publish(crashed, last)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not last.exists()
    commit.cleanup_leftovers(tmp_path, keep_prefix=commit.tmp_for(tmp_path, commit.new_token()).name)
    assert (last / "data").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_fallback_publish_replaces_and_leaves_nothing(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    _complete(commit.tmp_for(last, "a"), "old")
    commit.publish(commit.tmp_for(last, "a"), last)
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    _complete(commit.tmp_for(last, commit.new_token()), "new")
    tmp = next(p for p in tmp_path.iterdir() if commit.is_leftover(p.name))
    commit.publish(tmp, last)
    assert (last / "data").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_leftover_whose_name_points_elsewhere_is_never_put_back_there(tmp_path):
    """An aside's name says where it belongs (the target's name in hex); one naming a path outside its
    directory (``../x``, ``/x``, ``a/b``) is a leftover like any other, never moved there."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for i, target in enumerate(("../outside", str(tmp_path / "abs"), "sub/x", "..", ".")):
        aside = ckpts / f"{commit.REPLACED_PREFIX}{commit.new_token(_dead_pid())}-{i}-{target.encode().hex()}"
        aside.mkdir()
        (aside / commit.METADATA_FILE).write_text("md")
    (ckpts / "sub").mkdir()
    commit.cleanup_leftovers(ckpts)
    assert sorted(os.listdir(ckpts)) == ["sub"] and os.listdir(ckpts / "sub") == []
    assert sorted(os.listdir(tmp_path)) == ["ckpts"]


def test_the_sweep_never_follows_a_link_and_removes_only_leftover_names(tmp_path):
    target = tmp_path / "precious"
    (target / "d").mkdir(parents=True)
    (target / "d" / "f").write_text("keep")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    dead = commit.new_token(_dead_pid())
    (ckpts / f"{commit.INCOMPLETE_PREFIX}{dead}-1").symlink_to(target)
    inner = ckpts / f"{commit.INCOMPLETE_PREFIX}{dead}-2"
    inner.mkdir()
    (inner / "link").symlink_to(target)
    (ckpts / "notes").symlink_to(target)
    assert len(commit.cleanup_leftovers(ckpts)) == 2
    assert sorted(os.listdir(ckpts)) == ["notes"] and (target / "d" / "f").read_text() == "keep"
