"""``benchmarks/plots.py`` draws every kind of results file the ``make bench*`` targets write, beside it, and
refuses a file that is none of them. Needs matplotlib (the ``bench`` extra, which ``make bench`` installs);
skipped without it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT as _ROOT

pytest.importorskip("matplotlib", reason="the bench extra is not installed: pip install -e '.[bench]'")

ROOT = Path(_ROOT)
RESULTS = ROOT / "benchmarks" / "results"
PLOTS = ROOT / "benchmarks" / "plots.py"
CASES = {
    "bench-20261201-024229.json": ["stall", "commit", "step"],
    "train-20261202-153224.json": ["stall", "commit", "step"],
    "tiers-20261207-111838.json": ["overhead", "recovery"],
}


def test_every_kind_of_results_file_gets_its_plots_beside_it(tmp_path):
    for name in CASES:
        shutil.copy(RESULTS / name, tmp_path / name)
    proc = subprocess.run([sys.executable, str(PLOTS), *(str(tmp_path / n) for n in CASES)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name, kinds in CASES.items():
        for kind in kinds:
            png = tmp_path / f"{name[:-5]}-{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
            assert f"wrote {png}" in proc.stdout


def test_a_file_that_is_no_results_file_is_refused_naming_it(tmp_path):
    other = tmp_path / "notes.json"
    other.write_text("{}")
    proc = subprocess.run([sys.executable, str(PLOTS), str(other)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"{other}: not a results file of bench_save.py, bench_train_loop.py or bench_tiers.py" in proc.stderr
