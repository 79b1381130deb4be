"""The corruption suite: corrupted variants of real checkpoints (``corrupt_variants.py``: a single file and a DCP
directory from a tiny ``Trainer`` run, truncated, bit-flipped, missing parts, malicious pickles, crafted
``.metadata`` paths, FIFOs and links), each loaded through the plugin and given to ``verify`` and ``inspect``,
in subprocesses with a hard timeout (and an alarm per variant). What must hold: no load gives other tensors than
the original's without an error, nothing hangs, no exception escapes the command line, every error names the
file, ``verify`` fails exactly what does not load, and no code from a checkpoint runs.

``make test`` runs the fixed set (under a minute); ``make fuzz`` (marker ``fuzz``) adds hypothesis-generated
damage and a real ``Trainer.fit(ckpt_path=...)`` on a subset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corrupt_variants import MARKER_ENV, Variant, make_originals, make_variants

from helpers import ROOT, TESTS

_PER_VARIANT_S = 15


def _run(op: str, originals: Path, variants: Path, count: int) -> list[dict]:
    """Runs the runner's ``op`` on every variant in one process, with a hard timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "corrupt_variants.py"), op, str(originals),
                           str(variants), str(_PER_VARIANT_S)], capture_output=True, text=True, env=env,
                          timeout=60 + count * _PER_VARIANT_S, cwd=os.path.dirname(variants))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module", name="suite")
def suite_fixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrupt")
    originals = make_originals(root / "orig")
    marker = str(root / "MARKER-code-ran")
    variants = make_variants(originals, root / "variants", marker)
    (root / "originals.json").write_text(json.dumps(originals))
    (root / "variants.json").write_text(json.dumps([dataclasses.asdict(v) for v in variants]))
    results = {op: {r["name"]: r for r in _run(op, root / "originals.json", root / "variants.json", len(variants))}
               for op in ("load", "verify", "inspect")}
    return variants, results, marker


def _names_file(v: Variant, message: str) -> bool:
    return v.path in message or os.path.realpath(v.path) in message


def test_at_least_50_variants_of_files_and_directories(suite):
    variants, _, _ = suite
    assert len(variants) >= 50
    assert {v.original for v in variants} == {"file", "dir"}


def test_no_corrupt_checkpoint_loads_silently(suite):
    variants, results, _ = suite
    bad = []
    for v in variants:
        r = results["load"][v.name]
        if r["outcome"] in ("wrong", "hang"):
            bad.append(f"{v.name}: {r['outcome']}")
        elif v.expect == "equal" and r["outcome"] != "equal":
            bad.append(f"{v.name}: should load as the original: {r['message']}")
        elif v.expect in ("refuse", "unsafe") and r["outcome"] != "refused":
            bad.append(f"{v.name}: loaded (equal to the original) but should be refused")
        elif r["outcome"] == "refused" and not _names_file(v, r["message"]):
            bad.append(f"{v.name}: the error does not name the file: {r['message']}")
    assert not bad, "\n".join(bad)


def test_verify_fails_exactly_what_does_not_load(suite):
    variants, results, _ = suite
    bad = []
    for v in variants:
        r, load = results["verify"][v.name], results["load"][v.name]
        if r["code"] == "hang" or r["traceback"]:
            bad.append(f"{v.name}: verify {'hung' if r['code'] == 'hang' else 'raised: ' + r['traceback'][-300:]}")
        elif v.expect == "unsafe" and r["code"] == 0:
            if "weights_only=False" not in r["out"]:
                bad.append(f"{v.name}: verify says OK without saying it needs weights_only=False: {r['out']}")
        elif (r["code"] == 0) != (load["outcome"] == "equal"):
            bad.append(f"{v.name}: verify exit {r['code']}, load {load['outcome']}: {r['err'][-300:]}")
        elif r["code"] != 0 and not _names_file(v, r["err"]):
            bad.append(f"{v.name}: verify's error does not name the file: {r['err'][-300:]}")
    assert not bad, "\n".join(bad)


def test_inspect_never_hangs_nor_raises(suite):
    variants, results, _ = suite
    bad = []
    for v in variants:
        r = results["inspect"][v.name]
        if r["code"] == "hang" or r["traceback"]:
            bad.append(f"{v.name}: inspect {'hung' if r['code'] == 'hang' else 'raised: ' + r['traceback'][-300:]}")
        elif r["code"] != 0 and (not _names_file(v, r["err"]) or "Traceback" in r["err"]):
            bad.append(f"{v.name}: inspect's error is not one clean line naming the file: {r['err'][-300:]}")
    assert not bad, "\n".join(bad)


def test_no_code_from_a_checkpoint_ran(suite):
    _, _, marker = suite
    assert not os.path.exists(marker)
    assert MARKER_ENV  # the marker's path is baked into the malicious pickles
