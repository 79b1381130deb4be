"""Whole scripts in fresh interpreters, as users run them (hard timeouts, process groups killed)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest

from helpers import ROOT
from processes import launch


def _run(cmd, cwd, timeout=180):
    with launch(cmd, cwd, timeout, cwd=cwd) as job:
        code = job.wait()
    return code, job.log_text()


@pytest.mark.parametrize("engine", ["nvrx", pytest.param("mcore", marks=pytest.mark.slow)])
def test_script_without_main_guard(tmp_path, engine):
    """Many training scripts have no `if __name__ == "__main__"`; the spawned worker must not re-run them."""
    script = tmp_path / "train_no_guard.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        with open("runs.txt", "a") as f:
            f.write(str(os.getpid()) + "\\n")
        from lightning.pytorch.callbacks import ModelCheckpoint
        from helpers import TinyModel, loader, trainer
        from lightning_asyncckpt import AsyncCheckpointIO, AsyncFinalizerCallback
        io = AsyncCheckpointIO({engine!r}, worker="persistent")
        ck = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=4, save_top_k=-1)
        trainer(".", [io], [AsyncFinalizerCallback(), ck], max_steps=8).fit(TinyModel(), loader())
        print("saved", sorted(os.listdir("ckpts")))
    """))
    code, out = _run([sys.executable, str(script)], cwd=tmp_path)
    assert code == 0, out[-3000:]
    assert len((tmp_path / "runs.txt").read_text().split()) == 1, "the script's top level ran more than once"
    assert "saved ['epoch=0-step=4.ckpt', 'epoch=0-step=8.ckpt']" in out


def test_demo_runs(tmp_path):
    code, out = _run(
        [sys.executable, os.path.join(ROOT, "examples", "train.py"), "--max-steps", "40", "--every", "10",
         "--width", "128", "--out", str(tmp_path / "demo")],
        cwd=tmp_path,
    )
    assert code == 0, out[-3000:]
    assert "median stall" in out
    assert sorted(os.listdir(tmp_path / "demo" / "checkpoints")) == [
        "epoch=0-step=30.ckpt", "epoch=0-step=40.ckpt", "last.ckpt",
    ]


def test_two_tiers_example_runs(tmp_path):
    """Preempted at step 13 (SIGTERM), the example resumes from local step 13, not persistent step 10, then lists
    and removes its local files."""
    local = tmp_path / "local"
    local.mkdir()
    code, out = _run(
        [sys.executable, os.path.join(ROOT, "examples", "train_two_tiers.py"), "--local-dir", str(local),
         "--local-every", "5", "--every", "10", "--preempt-at", "13", "--width", "32", "--out", str(tmp_path / "tt")],
        cwd=tmp_path,
    )
    assert code == 0, out[-3000:]
    assert "preempted: training stopped at step 13; persistent checkpoints: ['epoch=0-step=10.ckpt', 'last.ckpt']" in out
    assert "resumed from restore-step-13, now at step 18" in out
    assert "verified 1 share(s): OK" in out and "removed " in out
    assert os.listdir(local) == []  # the example's own directory under --local-dir is gone too


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_fabric_example_runs(tmp_path):
    code, out = _run(
        [sys.executable, os.path.join(ROOT, "examples", "train_fabric.py"), "--steps", "20", "--every", "10",
         "--out", str(tmp_path / "fabric")],
        cwd=tmp_path,
    )
    assert code == 0, out[-3000:]
    assert "restored step 20; checkpoints: ['step-10', 'step-20']" in out


@pytest.mark.slow  # make test-all: kept out of make test for its 15-minute budget
def test_sharded_example_runs(tmp_path):
    code, out = _run(
        [sys.executable, os.path.join(ROOT, "examples", "train_sharded.py"), "--steps", "40",
         "--out", str(tmp_path / "sharded")],
        cwd=tmp_path,
    )
    assert code == 0, out[-3000:]
    assert "4 sharded saves" in out  # top-2 and last at steps 20 and 40
    assert "last.ckpt: ['.asyncckpt.json', '.metadata', '__0_0.distcp', '__1_0.distcp', 'meta.pt']" in out
    assert "resumed from step 40, now at step 60" in out


@pytest.mark.slow  # make test-all: eight variant processes, a few minutes
@pytest.mark.timeout(960)
def test_bench_train_loop_quick(tmp_path):
    """The Trainer-loop benchmark's smoke run: every variant runs, saves, commits, and lands in the table."""
    spec = importlib.util.spec_from_file_location("train_loop_parts", os.path.join(ROOT, "benchmarks", "train_loop_parts.py"))
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    VARIANTS = parts.VARIANTS
    results = tmp_path / "results"
    code, out = _run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_train_loop.py"), "--quick", "--width", "128",
         "--every", "2", "--saves", "2", "--baseline", "2", "--dir", str(tmp_path / "ckpts"), "--out", str(results)],
        cwd=tmp_path, timeout=900,
    )
    assert code == 0, out[-3000:]
    md, js = sorted(results.glob("train-*.md")), sorted(results.glob("train-*.json"))
    assert len(md) == 1 and len(js) == 1, sorted(os.listdir(results))
    for name in VARIANTS:
        assert f"| 2 | {name} |" in md[0].read_text()
    report = json.loads(js[0].read_text())
    assert sorted(r["variant"] for r in report["runs"]) == sorted(VARIANTS)
    for run in report["runs"]:
        (phase,) = run["phases"]
        assert [s is not None and s["commit_s"] is not None for s in phase["saves"]] == [True, True], run["variant"]
    assert not list((tmp_path / "ckpts").glob("*/*")), "checkpoints left behind"


def test_bench_tiers_renders_a_saved_run(tmp_path):
    """``bench_tiers.py --render`` reprints a saved run's tables (the orchestrator, the report and the rank
    module import together)."""
    saved = os.path.join(ROOT, "benchmarks", "results", "tiers-20261204-154254.json")
    code, out = _run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tiers.py"), "--render", saved],
                     cwd=tmp_path, timeout=120)
    assert code == 0, out[-3000:]
    assert "| overhead per save, local / persistent | 0.67× | ≤ 0.5× |" in out, out[-3000:]
    assert "CRC32 checks 0.09 s" in out, out[-3000:]


@pytest.mark.slow  # make test-all: four spawned ranks, about a minute
@pytest.mark.timeout(600)
def test_bench_tiers_tiny_run(tmp_path):
    """The tier benchmark end to end on a tiny state: every variant and recovery runs, every restored
    checkpoint is exact, and nothing is left in /dev/shm."""
    results = tmp_path / "results"
    code, out = _run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tiers.py"), "--size", "0.02",
                      "--reps", "1", "--recoveries", "1", "--no-s3", "--timeout", "400", "--dir", str(tmp_path),
                      "--out", str(results)], cwd=tmp_path, timeout=500)
    assert code == 0, out[-3000:]
    (js,) = results.glob("tiers-*.json")
    summary = json.loads(js.read_text())["summary"]
    assert {r["how"]: r["exact"] for r in summary["recovery"]} == {
        "local_replicas": "1/1", "persistent_cold": "1/1", "persistent_warm": "1/1"}, summary["recovery"]
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("bench-tiers-")]
