"""The directories the package makes in shared places (``/tmp``, ``/dev/shm``): a remote save's spool, the
writer's scratch directory, a remote load's download. Each is this user's own, mode 0700, made without
following a link; one that another user made or planted as a link is refused, naming the path, its owner and
mode, and the fix. Real files; another local user is ``setpriv --reuid=65534`` (skipped where refused)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from helpers import OTHER_USER, as_other_user
from lightning_asyncckpt.pipeline import scratch
from lightning_asyncckpt.storage import private_dirs, remote

NOBODY = OTHER_USER
_REAL_TMP = tempfile.gettempdir()  # pytest's own would follow the tests' own tempfile.tempdir


@pytest.fixture
def shared_tmp(monkeypatch):
    """A sticky world-writable directory owned by root, like /tmp, as the temporary directory."""
    d = Path(tempfile.mkdtemp(prefix="asyncckpt-shared-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(d, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def own(request):
    """A directory of this user's own (mode 0700) outside the temporary directory the tests change."""
    d = Path(tempfile.mkdtemp(prefix="asyncckpt-own-", dir=_REAL_TMP))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _spool_name() -> str:
    return f"asyncckpt-spool-{os.geteuid()}"


def test_the_spool_is_this_users_own_and_private_under_any_umask(shared_tmp):
    old = os.umask(0o002)
    try:
        spool = remote.spool_root()
    finally:
        os.umask(old)
    st = os.lstat(spool)
    assert spool == shared_tmp / _spool_name() and stat.S_ISDIR(st.st_mode)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert remote.spool_root() == spool  # made once, then reused


def test_a_spool_made_by_another_user_is_refused_naming_owner_mode_and_fix(shared_tmp):
    as_other_user("mkdir", "-m", "777", str(shared_tmp / _spool_name()))
    with pytest.raises(private_dirs.UntrustedDirectoryError,
                       match=rf"{_spool_name()} \(owner uid 65534 \(.*\), mode 0777\) is not this user's own.*Fix:"
                             r" remove it.*Or set TMPDIR"):
        remote.spool_root()


def test_a_spool_planted_as_a_link_is_refused_and_its_target_untouched(shared_tmp, own):
    target = own / "victim"  # a directory of ours the other user wants our uploads' parts written over
    target.mkdir()
    (target / "keep").write_text("x")
    mode = stat.S_IMODE(target.stat().st_mode)
    as_other_user("ln", "-s", str(target), str(shared_tmp / _spool_name()))
    with pytest.raises(private_dirs.UntrustedDirectoryError,
                       match=rf"{_spool_name()} is a symbolic link or not a directory \(owner uid 65534"):
        remote.spool_root()
    assert os.listdir(target) == ["keep"] and stat.S_IMODE(target.stat().st_mode) == mode
    assert os.path.islink(shared_tmp / _spool_name())


def test_a_group_writable_spool_of_our_own_is_refused(shared_tmp):
    (shared_tmp / _spool_name()).mkdir()
    os.chmod(shared_tmp / _spool_name(), 0o770)
    with pytest.raises(private_dirs.UntrustedDirectoryError, match=r"mode 0770\) is not this user's own.*or is writable"):
        remote.spool_root()


def test_a_temporary_directory_others_can_rename_in_is_refused_for_the_spool_and_a_remote_load(own, monkeypatch):
    base = own / "tmp"
    base.mkdir()
    os.chmod(base, 0o777)  # world-writable, no sticky bit: anyone can rename our spool away and put theirs
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    with pytest.raises(private_dirs.UntrustedDirectoryError, match=r"writable by its group and others without the"
                       r" sticky bit \(owner uid \d+ \(.*\), mode 0777\).*Fix:.*set TMPDIR"):
        remote.spool_root()
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/private-dirs-test/last.ckpt", b"x")
    try:
        with pytest.raises(private_dirs.UntrustedDirectoryError, match="without the sticky bit"), \
                remote.localize("memory://private-dirs-test/last.ckpt"):
            pass
    finally:
        fs.rm("/private-dirs-test", recursive=True)
    assert os.listdir(base) == []  # nothing made there


def test_the_scratch_directory_leaves_a_dev_shm_that_others_can_rename_in(own, shared_tmp):
    unsafe = own / "shm"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    made = scratch.make_scratch_dir(unsafe)
    try:
        assert made.parent == shared_tmp and stat.S_IMODE(made.stat().st_mode) == 0o700
        assert os.listdir(unsafe) == []
    finally:
        shutil.rmtree(made)
