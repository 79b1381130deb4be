"""The hint to put the local tier on a tmpfs with huge pages: read from the real mount table, for real
tmpfs mounts made here (skipped where mounting is refused), and logged once at setup by a real
:class:`~lightning_asyncckpt.tiers.tier_run.TierRun`."""

from __future__ import annotations

import logging

import pytest

from helpers import mounted_tmpfs
from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.tiers import huge_pages

NEVER = "always within_size advise [never] deny force"  # the kernel's own default for tmpfs


def test_the_mount_options_of_real_tmpfs_mounts_are_read(tmp_path):
    with mounted_tmpfs(tmp_path / "plain", "4m") as plain, \
            mounted_tmpfs(tmp_path / "huge", "4m", "huge=within_size") as huge:
        (huge / "a" / "b").mkdir(parents=True)
        assert huge_pages.tmpfs_huge(plain, shmem_enabled=NEVER) == "never"
        assert huge_pages.tmpfs_huge(huge / "a" / "b", shmem_enabled=NEVER) == "within_size"
        assert huge_pages.hint(plain, shmem_enabled=NEVER) is not None
        assert huge_pages.hint(huge / "a", shmem_enabled=NEVER) is None
    # the kernel's setting for every tmpfs wins over the mount's
    assert huge_pages.tmpfs_huge(tmp_path, mountinfo=_mountinfo(str(tmp_path), "tmpfs", "rw,huge=always"),
                                 shmem_enabled="always within_size advise never [deny] force") == "never"


def _mountinfo(point: str, fstype: str, options: str) -> str:
    return (f"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
            f"90 22 0:50 / {point} rw,relatime shared:2 - {fstype} {fstype} {options}\n")


def test_the_deepest_mount_holding_the_directory_decides():
    text = _mountinfo("/mnt/my\\040ckpt", "tmpfs", "rw,size=4096k,huge=within_size")  # a space, escaped
    assert huge_pages.tmpfs_huge("/mnt/my ckpt/run", mountinfo=text, shmem_enabled=NEVER) == "within_size"
    assert huge_pages.tmpfs_huge("/mnt/my ckptx", mountinfo=text, shmem_enabled=NEVER) is None  # ext4 at /
    assert huge_pages.tmpfs_huge("/mnt/ckpt", mountinfo=_mountinfo("/mnt/ckpt", "tmpfs", "rw"),
                                 shmem_enabled=NEVER) == "never"
    assert huge_pages.hint("/x", mountinfo=_mountinfo("/x", "tmpfs", "rw"),
                           shmem_enabled="always within_size advise never deny [force]") is None
    assert huge_pages.tmpfs_huge("/x", mountinfo="not a mount table") is None


def test_setup_logs_the_hint_once_for_a_tmpfs_without_huge_pages_only(tmp_path, caplog):
    from lightning_asyncckpt.tiers.setup import open_tier

    if "[deny]" in huge_pages.SHMEM_ENABLED.read_text() or "[force]" in huge_pages.SHMEM_ENABLED.read_text():
        pytest.skip("this kernel decides huge pages for every tmpfs, whatever the mount says")
    lines = {}
    with mounted_tmpfs(tmp_path / "plain", "8m") as plain, \
            mounted_tmpfs(tmp_path / "huge", "8m", "huge=within_size") as huge:
        for name, where in (("plain", plain), ("huge", huge)):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="lightning_asyncckpt"):
                run = open_tier(LocalTier(str(where), replication_factor=1, emergency_signals=()), node_rank=0,
                                local_world_size=1)
                run.close()
            lines[name] = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]
    assert len(lines["plain"]) == 1 and "huge=within_size" in lines["plain"][0], lines
    assert str(tmp_path / "plain") in lines["plain"][0]
    assert lines["huge"] == [], lines
