"""The Destination interface: where a local path and an fsspec URL each put a save's hidden copy, how each
publishes and discards, and that the remote-vs-local decision is made by ``destination.of`` alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_asyncckpt.storage import commit, destination, remote
from lightning_asyncckpt.storage.destination import LocalDestination, RemoteDestination


def test_of_decides_local_or_remote_once(tmp_path):
    assert destination.of(tmp_path / "a.ckpt") == LocalDestination(tmp_path / "a.ckpt")
    assert destination.of(f"file://{tmp_path}/a.ckpt").location == tmp_path / "a.ckpt"
    assert destination.of(str(tmp_path / "a.ckpt").encode()).is_remote is False
    url = destination.of("s3://bucket/run/a.ckpt")
    assert url == RemoteDestination("s3://bucket/run/a.ckpt") and url.is_remote
    assert url.location == "s3://bucket/run/a.ckpt" and url.parent().location == "s3://bucket/run"
    assert destination.of(tmp_path / "a.ckpt").parent().location == tmp_path
    with pytest.raises(TypeError, match=r"must be a str or os.PathLike.*got int 3"):
        destination.of(3)
    assert destination.plain_path(str(tmp_path)) == tmp_path
    assert destination.plain_path(f"file://{tmp_path}") is None and destination.plain_path(None) is None


def test_a_local_save_is_written_beside_its_target_and_published_by_rename(tmp_path):
    target = destination.of(tmp_path / "run" / "a.ckpt")
    token = commit.new_token()
    assert target.parent().open_directory(0, token) is None  # saves go beside their target: no spool
    tmp = target.temp_path(f"{token}-1", writes_file=True)
    assert tmp.parent == tmp_path / "run" and commit.is_leftover(tmp.name)
    assert target.upload_from(tmp) is None
    tmp.write_bytes(b"new")
    (tmp_path / "run" / "a.ckpt").write_bytes(b"old")
    target.publish(tmp, writes_file=True)
    assert (tmp_path / "run" / "a.ckpt").read_bytes() == b"new" and not tmp.exists() and target.exists()
    with target.localize() as local:
        assert local == tmp_path / "run" / "a.ckpt"
    assert target.discard("the test's checkpoint") and not target.exists()


def test_a_local_directory_is_swept_of_dead_saves_on_rank_0_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    leftover = commit.tmp_for(tmp_path / "x", commit.new_token(pid=int(dead)))
    leftover.mkdir()
    where = destination.of(tmp_path)
    where.open_directory(1, commit.new_token())
    assert leftover.exists()  # another rank leaves the sweep to rank 0
    where.open_directory(0, commit.new_token())
    assert not leftover.exists()


def test_a_local_save_refuses_what_it_cannot_replace(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(IsADirectoryError, match="is a directory that is not a checkpoint"):
        destination.of(tmp_path / "dir").check_for_save(writes_file=True)
    with pytest.raises(FileExistsError, match="existing regular file"):
        destination.of(tmp_path / "file").check_for_save(writes_file=False)
    destination.of(tmp_path / "dir").check_for_save(writes_file=False)  # a DCP directory replaces a directory


def test_a_remote_file_is_written_at_its_url_and_a_directory_in_the_spool(s3):
    target = destination.of("s3://ckpt/run1/a.ckpt")
    target.check_for_save(writes_file=True)
    spool = target.parent().open_directory(0, "tok")  # the bucket exists: checked, no error
    assert spool == remote.spool_root()
    assert target.temp_path("tok-1", writes_file=True) == "s3://ckpt/run1/a.ckpt"
    part = target.temp_path("tok-c1", writes_file=False, rank=3)
    assert isinstance(part, Path) and part.parent == spool and part.name.endswith("tok-c1-r3")
    assert target.upload_from(part) == (str(part), "s3://ckpt/run1/a.ckpt")
    assert not target.exists()
    s3.fs.pipe("ckpt/run1/a.ckpt", b"bytes")
    assert target.exists() and not target.is_directory()
    assert target.discard("the test's checkpoint") and not target.exists()
    with pytest.raises(FileNotFoundError, match="bucket 'nope' does not exist"):
        destination.of("s3://nope/run").open_directory(0, "tok")
