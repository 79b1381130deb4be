"""The local tier trusts only what its own user made: directories another user made or can write, links,
file modes, a header whose pickle would run code, and the bad settings and full directory that used to get no
clear error. Real files; another local user is ``setpriv --reuid=65534`` (skipped where refused)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import OTHER_USER, as_other_user
from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.tiers import packing, trusted_dirs
from lightning_asyncckpt.tiers.cliques import TierConfigError
from lightning_asyncckpt.tiers.store import Held, LocalStore

NOBODY = OTHER_USER


@pytest.fixture
def shared():
    """A sticky world-writable directory owned by root, like /dev/shm (in it: pytest's own are 0700, which
    another user cannot enter): ``dir`` may be one."""
    d = Path(tempfile.mkdtemp(prefix="asyncckpt-trust-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(dir, **kw):
    from lightning_asyncckpt.tiers.setup import open_tier

    return open_tier(LocalTier(dir, emergency_signals=(), **kw), node_rank=0, local_world_size=1)


def _save_step(dir, step=2, **kw):
    run = _run(dir, **kw)
    run.save(step, {"state_dict": {"w": torch.arange(4.0)}, "global_step": step, "hp": {"lr": 0.1}})
    assert run.finish() == step
    run.close()


# 1. directories --------------------------------------------------------------------------------------------
def test_a_tier_directory_planted_by_another_user_is_refused_at_setup_naming_owner_and_mode(shared):
    as_other_user("mkdir", "-m", "755", str(shared / "asyncckpt-local"))
    with pytest.raises(TierConfigError, match=r"asyncckpt-local was not made by this job's user.*owner uid 65534"
                       r" \(.*\), mode 0755.*Fix: remove it"):
        _run(shared)
    assert os.listdir(shared / "asyncckpt-local") == []  # nothing written into it


def test_a_dir_of_another_user_is_refused_even_where_we_can_write_it(shared):
    as_other_user("mkdir", "-m", "777", str(shared / "ckpt"))  # the README's `mkdir -p /dev/shm/ckpt`, done first
    with pytest.raises(TierConfigError, match=r"ckpt belongs to another user \(owner uid 65534 .*mode 0777\).*Fix"):
        _run(shared / "ckpt")
    assert os.listdir(shared / "ckpt") == []


def test_a_link_as_dir_is_followed_only_where_it_is_ours_or_roots(shared, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "link").symlink_to(mine)
    _run(tmp_path / "link").close()  # our own link to our own directory: the user named it
    assert (mine / "asyncckpt-local" / "default" / "holder-0").is_dir()
    as_other_user("ln", "-s", str(mine), str(shared / "theirs"))  # another user's link: they can repoint it
    with pytest.raises(TierConfigError, match=r"theirs is a symbolic link of another user \(owner uid 65534"):
        _run(shared / "theirs")


def test_a_sticky_shared_dir_is_used_and_everything_the_tier_makes_is_private(shared):
    old = os.umask(0o002)
    try:
        _save_step(shared)
    finally:
        os.umask(old)
    made = list((shared / "asyncckpt-local").rglob("*"))
    assert made and all(stat.S_IMODE(p.lstat().st_mode) == (0o700 if p.is_dir() else 0o600) for p in made), \
        {p.name: oct(p.lstat().st_mode) for p in made}
    assert {p.suffix for p in made if p.is_file()} >= {".pt", ".head", ".json"}


def test_under_umask_000_the_tiers_files_are_still_private(tmp_path):
    old = os.umask(0)
    try:
        _save_step(tmp_path)
    finally:
        os.umask(old)
    made = list((tmp_path / "asyncckpt-local").rglob("*"))
    assert made and all(stat.S_IMODE(p.lstat().st_mode) == (0o700 if p.is_dir() else 0o600) for p in made), \
        {p.name: oct(p.lstat().st_mode) for p in made}


def test_a_group_writable_tier_directory_is_refused(tmp_path):
    (tmp_path / "asyncckpt-local" / "default").mkdir(parents=True)
    os.chmod(tmp_path / "asyncckpt-local" / "default", 0o775)
    with pytest.raises(TierConfigError, match=r"default is writable by its group \(.*mode 0775\).*chmod 700"):
        _run(tmp_path)


def test_a_group_writable_dir_without_sticky_bit_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)
    with pytest.raises(TierConfigError, match=r"writable by its group and others without the sticky bit.*chmod \+t"):
        _run(tmp_path)


def test_a_symlinked_tier_directory_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    (target / "default" / "holder-0").mkdir(parents=True)
    (target / "default" / "holder-0" / "keep.txt").write_text("x")
    base = tmp_path / "dir"
    base.mkdir()
    (base / "asyncckpt-local").symlink_to(target)
    with pytest.raises(TierConfigError, match=r"asyncckpt-local is a symbolic link .*never follows a link"):
        _run(base)
    assert os.listdir(target / "default" / "holder-0") == ["keep.txt"]


def test_the_tier_never_makes_a_directory_or_file_through_a_link(tmp_path):
    """After setup (a link made while it runs): the store refuses the link, never writes through it."""
    store = LocalStore(tmp_path, 0)
    store.dir.rmdir()
    target = tmp_path / "target"
    target.mkdir()
    store.dir.symlink_to(target)
    with pytest.raises(trusted_dirs.UntrustedDirectoryError, match="holder-0 is a symbolic link"):
        store.reserve(2, 0, 16)
    assert list(target.iterdir()) == []


# 3. the header ---------------------------------------------------------------------------------------------
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(holder: Path, marker: Path) -> Path:
    """Replaces the newest .head in ``holder`` with one whose pickle would run code, its manifest made to match."""
    head = sorted(holder.glob("*.head"))[-1]
    buf = io.BytesIO()
    torch.save((_RunsCode(marker), []), buf)
    data = packing.MAGIC + buf.getvalue()
    head.write_bytes(data)
    manifest = head.with_suffix(".json")
    raw = json.loads(manifest.read_text())
    raw.update(head_nbytes=len(data), head_crc32=packing.crc32(data))
    manifest.write_text(json.dumps(raw))
    return head


def test_a_planted_header_that_would_run_code_is_refused_naming_the_file(tmp_path):
    _save_step(tmp_path)
    marker = tmp_path / "ran"
    head = _plant(tmp_path / "asyncckpt-local" / "default" / "holder-0", marker)
    run = _run(tmp_path)
    try:
        with pytest.raises(packing.UnsafeShareError, match=rf"weights_only=True.*{head}: .*GLOBAL posix.system.*Nothing of it was run.*weights_only=False"):
            run.latest(None)
    finally:
        run.close()
    assert not marker.exists()


def test_a_step_restores_with_weights_only_and_with_weights_only_false(tmp_path):
    _save_step(tmp_path)
    for weights_only in (None, True, False):
        run = _run(tmp_path)
        try:
            key = run.latest(None, weights_only=weights_only)
            assert torch.equal(run.take(key)["state_dict"]["w"], torch.arange(4.0))
        finally:
            run.close()


def test_fit_last_refuses_a_planted_local_step_and_runs_none_of_it(tmp_path):
    """The issue's attack end to end: a step planted in the local tier (its CRC32s made to match) is not
    resumed by ``fit(ckpt_path="last")``: the error names the header, and the code in it never ran. A normal
    Lightning checkpoint (hyper_parameters, loops, callbacks, optimizer) restoring with weights_only=True is
    test_tiers_trainer.py's resumes (the default, None, is True)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from helpers import TinyModel, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO

    (tmp_path / "local").mkdir()

    def fit(max_steps, ckpt_path=None):
        io = AsyncCheckpointIO("nvrx", local=LocalTier(tmp_path / "local", every_n_train_steps=2))
        ck = ModelCheckpoint(dirpath=tmp_path / "c", every_n_train_steps=100, save_last=True)
        t = trainer(tmp_path, [io], [ck], max_steps=max_steps)
        L.seed_everything(0)
        t.fit(TinyModel(width=8), loader(width=8, n=256, batch_size=4), ckpt_path=ckpt_path)
        return t

    fit(4)
    marker = tmp_path / "ran"
    head = _plant(tmp_path / "local" / "asyncckpt-local" / "default" / "holder-0", marker)
    with pytest.raises(packing.UnsafeShareError, match=rf"{head}: .*GLOBAL posix.system.*weights_only=False"):
        fit(8, ckpt_path="last")
    assert not marker.exists()


# 4, 5. settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("session", [".", "..", "...", ".hidden", "holder-0", "holder-12"])
def test_a_session_name_that_could_leave_or_mix_with_the_tiers_own_entries_is_refused(session):
    with pytest.raises(ValueError, match=rf"LocalTier\(session=\.\.\.\).*{session!r}"):
        LocalTier("/x", session=session)


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS", "SIGCHLD"])
def test_fault_and_child_signals_are_refused_as_emergency_signals(name):
    with pytest.raises(ValueError, match=rf"LocalTier\(emergency_signals=\.\.\.\): {name} "):
        LocalTier("/x", emergency_signals=(name,))
    with pytest.raises(ValueError, match=rf"{name} "):
        LocalTier("/x", emergency_signals=(getattr(signal, name),))


@pytest.mark.parametrize(("value", "match"), [
    (None, r"emergency_signals=None.*emergency_signals=\(\)"),
    ((15,), r"emergency_signals=\.\.\.\).*15.*a signal name"),
    ((b"SIGTERM",), r"emergency_signals=\.\.\.\).*b'SIGTERM'"),
])
def test_emergency_signals_of_the_wrong_type_get_a_clear_error(value, match):
    with pytest.raises((TypeError, ValueError), match=match):
        LocalTier("/x", emergency_signals=value)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"every_n_train_steps": True}, r"every_n_train_steps"),
    ({"every_n_train_steps": 2.0}, r"every_n_train_steps"),
    ({"replication_factor": "2"}, r"replication_factor"),
    ({"timeout_s": "10"}, r"timeout_s"),
    ({"timeout_s": True}, r"timeout_s"),
    ({"overlap_agreement": 1}, r"overlap_agreement"),
    ({"session": 3}, r"session"),
])
def test_other_settings_of_the_wrong_type_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        LocalTier("/x", **kwargs)


# 6. a full directory ---------------------------------------------------------------------------------------
def _fill(directory: Path, leave: int) -> None:
    """Fills the filesystem of ``directory`` but ``leave`` bytes."""
    free = shutil.disk_usage(directory).free
    with open(directory / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def test_the_space_check_counts_the_header(tmpfs_1m):
    """``2 x factor x (share + header)``: a share that fits only without its header is refused."""
    from lightning_asyncckpt.tiers import checks

    free = shutil.disk_usage(tmpfs_1m).free
    share = free // 2 - 4096  # fits twice with 4 KiB to spare each: not with a header of 64 KiB
    with pytest.raises(TierConfigError, match="need"):
        checks.space(tmpfs_1m, 0, [0], share_bytes=share, held_bytes=0, factor=1, gather=lambda x: [x],
                     head_bytes=64 << 10)


@pytest.mark.parametrize(("head_bytes", "leave", "fails"), [(300_000, 0, "head"), (100, 4096, "json")])
def test_a_full_directory_at_commit_names_the_file_and_leaves_nothing_partial(tmpfs_1m, head_bytes, leave, fails):
    """The header does not fit; or it does (one page left) and the manifest does not: either way the error
    names the file and its directory, and no .pt, .head or .tmp of the step is left."""
    store = LocalStore(tmpfs_1m, 0)
    data = torch.arange(4096, dtype=torch.uint8)
    mapped = store.reserve(2, 0, data.numel())
    mapped.tensor.copy_(data)
    _fill(tmpfs_1m, leave)
    head = b"h" * head_bytes
    held = Held(2, 0, data.numel(), packing.crc32(data), (1, 1, 1), "replicated", len(head), packing.crc32(head))
    with pytest.raises(OSError, match=rf"No space left.*step-0000000002\.owner-0\.{fails}.*holder-0"):
        store.commit(held, mapped, head)
    store.release(mapped)
    left = sorted(p.name for p in store.dir.iterdir())
    assert not [n for n in left if n.endswith((".pt", ".head", ".json", ".tmp"))], left
