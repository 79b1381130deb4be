import os

from lightning_asyncckpt import commit


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


def test_cleanup_leftovers_keeps_what_is_asked(tmp_path):
    keep = commit.tmp_for(tmp_path / "b.ckpt", "run9-1")
    keep.mkdir()
    stale = commit.tmp_for(tmp_path / "a.ckpt", "run1-1")
    stale.mkdir()
    (tmp_path / "a.ckpt").mkdir()
    removed = commit.cleanup_leftovers(tmp_path, keep_prefix=commit.tmp_for(tmp_path, "run9-").name)
    assert removed == [stale]
    assert sorted(os.listdir(tmp_path)) == sorted([keep.name, "a.ckpt"])
