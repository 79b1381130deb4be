"""The performance page's tables come from the results files: ``benchmarks/report_docs.py`` regenerates them
into a temporary directory, and the committed ``docs/_generated/performance_tables.md`` must be the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "_generated" / "performance_tables.md"


def test_the_performance_tables_are_the_ones_the_results_files_give(tmp_path):
    fresh = tmp_path / "performance_tables.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report_docs.py"), "--out", str(fresh)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert fresh.read_text() == COMMITTED.read_text(), (
        "docs/_generated/performance_tables.md is out of date: run python benchmarks/report_docs.py and commit it")


def test_the_performance_page_includes_the_tables():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert "```{include} _generated/performance_tables.md" in page
