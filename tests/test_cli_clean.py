"""``lightning-asyncckpt clean``: the leftovers of interrupted saves in a directory are listed, then removed
with ``--yes``; committed checkpoints and other files are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy

from helpers import run_cli as run
from lightning_asyncckpt.storage import commit


def test_clean_lists_then_removes_only_leftovers(ckpts, tmp_path, capsys):
    real = _copy(ckpts.single, tmp_path / "last.ckpt")
    leftover = commit.tmp_for(tmp_path / "epoch=1.ckpt", f"{_dead_token()}-3")
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1024)
    aside = tmp_path / f"{commit.INCOMPLETE_PREFIX}{_dead_token()}-1-replaced"
    aside.write_bytes(b"y" * 10)
    (tmp_path / "notes.txt").write_text("keep")

    code, out, err = run(capsys, "clean", tmp_path)
    assert code == 0 and err == ""
    assert f"would remove {leftover} (1.0 KiB," in out and f"would remove {aside} (10 B," in out
    assert "2 leftover(s)" in out and "--yes" in out
    assert leftover.exists() and aside.exists()

    code, out, err = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and err == ""
    assert f"removed {leftover}" in out and "removed 2 leftover(s), 1.0 KiB" in out
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "notes.txt"]
    assert run(capsys, "verify", real)[0] == 0

    code, out, _ = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and out.strip() == f"no leftovers of interrupted saves in {tmp_path}"


def _crash_between_renames(kind: str, path) -> None:
    """The real publish code, in a process of its own that dies between the two renames of a replace (as a
    kill there leaves it): where the filesystem cannot exchange (NFS, Lustre), or a file replaces a DCP
    directory."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from lightning_asyncckpt.storage import commit\n"
        "from lightning_asyncckpt.write import torch_file\n"
        "kind, path = sys.argv[1], Path(sys.argv[2])\n"
        "commit._exchange = lambda a, b: False  # no atomic exchange here (NFS, Lustre)\n"
        "real = os.rename\n"
        "def rename(src, dst):\n"
        "    if Path(src).name.startswith(commit.INCOMPLETE_PREFIX):\n"
        "        os._exit(9)  # killed after the old checkpoint went aside, before the new one went in\n"
        "    real(src, dst)\n"
        "os.rename = rename\n"
        "tmp = commit.tmp_for(path, commit.new_token() + '-1')\n"
        "if kind == 'file':\n"
        "    tmp.write_bytes(b'new file')\n"
        "    torch_file.publish_file(tmp, path)\n"
        "else:\n"
        "    tmp.mkdir()\n"
        "    (tmp / commit.METADATA_FILE).write_text('md')\n"
        "    (tmp / 'data').write_text('new')\n"
        "    commit.publish(tmp, path)\n"
        "raise SystemExit('the publish was not interrupted')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, kind, str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 9, proc.stderr


def _dead_token() -> str:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return commit.new_token(gone.pid)  # reaped: no process has it now


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_clean_puts_back_what_a_crash_between_the_renames_left_aside(capsys, tmp_path, kind):
    last = tmp_path / "last.ckpt"
    last.mkdir()  # the old checkpoint: a DCP directory
    (last / commit.METADATA_FILE).write_text("md")
    (last / "data").write_text("old")
    _crash_between_renames(kind, last)
    assert not os.path.lexists(last)
    assert sorted(p.name[:20] for p in tmp_path.iterdir()) == [".asyncckpt-incomplet", ".asyncckpt-replaced-"]

    code, out, err = run(capsys, "clean", tmp_path)
    assert code == 0 and err == "", err
    assert f"would put back {last}" in out, out
    assert not os.path.lexists(last)  # only listed
    code, out, err = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and err == "", err
    assert f"put back {last}" in out and "removed 1 leftover(s)" in out, out
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert (last / "data").read_text() == "old"


def test_clean_keeps_the_save_in_flight_of_a_live_process(capsys, tmp_path):
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as other:
        try:
            live = commit.tmp_for(tmp_path / "a.ckpt", f"{commit.new_token(other.pid)}-1")
            live.write_bytes(b"being written")
            dead = commit.tmp_for(tmp_path / "b.ckpt", f"{_dead_token()}-1")
            dead.write_bytes(b"abandoned")
            code, out, err = run(capsys, "clean", tmp_path, "--yes")
            assert code == 0 and err == "", err
            assert f"kept {live}: its process (pid {other.pid}) is alive" in out, out
            assert f"removed {dead}" in out and "removed 1 leftover(s)" in out, out
            assert live.read_bytes() == b"being written" and not dead.exists()
        finally:
            other.stdin.close()


def test_clean_keeps_other_hosts_leftovers_unless_asked(capsys, tmp_path):
    elsewhere = commit.tmp_for(tmp_path / "y.ckpt", "0badc0de.1.abcdef-1")
    elsewhere.mkdir()
    code, out, err = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and err == "" and elsewhere.is_dir(), (out, err)
    assert f"kept {elsewhere}: written on another host" in out and "--any-host" in out, out
    code, out, err = run(capsys, "clean", tmp_path, "--yes", "--any-host")
    assert code == 0 and not elsewhere.exists(), (out, err)


def test_clean_removes_a_planted_link_never_its_target(capsys, tmp_path):
    target = tmp_path / "precious"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "f").write_bytes(b"z" * 5000)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    link = commit.tmp_for(ckpts / "x.ckpt", f"{_dead_token()}-1")
    link.symlink_to(target)
    aside = ckpts / f"{commit.REPLACED_PREFIX}{_dead_token()}-1-{b'../precious2'.hex()}"
    aside.mkdir()  # a name that would put it back outside the directory
    code, out, err = run(capsys, "clean", ckpts, "--yes")
    assert code == 0 and err == "", err
    assert f"removed {link}" in out and "4.9 KiB" not in out, out
    assert (target / "sub" / "f").read_bytes() == b"z" * 5000
    assert os.listdir(ckpts) == [] and not (tmp_path / "precious2").exists()
