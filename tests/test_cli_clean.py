"""``lightning-asyncckpt clean``: the leftovers of interrupted saves in a directory are listed, then removed
with ``--yes``; committed checkpoints and other files are left alone."""

from __future__ import annotations

import os

from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy

from helpers import run_cli as run
from lightning_asyncckpt.format import commit


def test_clean_lists_then_removes_only_leftovers(ckpts, tmp_path, capsys):
    real = _copy(ckpts.single, tmp_path / "last.ckpt")
    leftover = commit.tmp_for(tmp_path / "epoch=1.ckpt", "4242-3")
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1000)
    aside = tmp_path / f"{commit.INCOMPLETE_PREFIX}4242-1-replaced"
    aside.write_bytes(b"y" * 10)
    (tmp_path / "notes.txt").write_text("keep")

    code, out, err = run(capsys, "clean", tmp_path)
    assert code == 0 and err == ""
    assert f"would remove {leftover} (1.0 kB," in out and f"would remove {aside} (10 B," in out
    assert "2 leftover(s)" in out and "--yes" in out
    assert leftover.exists() and aside.exists()

    code, out, err = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and err == ""
    assert f"removed {leftover}" in out and "removed 2 leftover(s), 1.0 kB" in out
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "notes.txt"]
    assert run(capsys, "verify", real)[0] == 0

    code, out, _ = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and out.strip() == f"no leftovers of interrupted saves in {tmp_path}"
