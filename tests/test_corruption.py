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

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corrupt_variants import Variant, make_originals, make_variants

from helpers import ROOT, TESTS

_PER_VARIANT_S = 15


def _run(op: str, originals: Path, variants: Path, count: int) -> list[dict]:
    """Runs the runner's ``op`` on every variant in one process, with a hard timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "corrupt_runner.py"), op, str(originals),
                           str(variants), str(_PER_VARIANT_S)], capture_output=True, text=True, env=env,
                          timeout=60 + count * _PER_VARIANT_S, cwd=os.path.dirname(variants))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module", name="originals")
def originals_fixture(tmp_path_factory):
    """A real single-file checkpoint and a real DCP directory, each from a tiny ``Trainer`` run."""
    root = tmp_path_factory.mktemp("corrupt")
    return root, make_originals(root / "orig")


@pytest.fixture(scope="module", name="suite")
def suite_fixture(originals):
    root, originals = originals
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
    assert not os.path.exists(marker)  # the marker's path is baked into the malicious pickles


# -- make fuzz ---------------------------------------------------------------------------------------------------
@pytest.mark.fuzz
@pytest.mark.timeout(3600)
def test_every_variant_in_its_own_command_line_process(suite):
    """The real command line, one process per variant and command: exit status, no traceback, the file named."""
    from concurrent.futures import ThreadPoolExecutor

    variants, results, _ = suite
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}

    def run(job: tuple[str, Variant]) -> str | None:
        command, v = job
        try:
            proc = subprocess.run([sys.executable, "-m", "lightning_asyncckpt", command, v.path], capture_output=True,
                                  text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            return f"{v.name}: {command} hung"
        if "Traceback" in proc.stderr:
            return f"{v.name}: {command} printed a traceback: {proc.stderr[-400:]}"
        if proc.returncode not in (0, 1, 2):
            return f"{v.name}: {command} exit {proc.returncode}: {proc.stderr[-400:]}"
        if proc.returncode and not _names_file(v, proc.stderr):
            return f"{v.name}: {command}'s error does not name the file: {proc.stderr[-400:]}"
        if command == "verify" and (proc.returncode == 0) != (results["verify"][v.name]["code"] == 0):
            return f"{v.name}: verify exit {proc.returncode} in its own process, {results['verify'][v.name]['code']} batched"
        return None

    with ThreadPoolExecutor(2) as pool:
        bad = [b for b in pool.map(run, [(c, v) for v in variants for c in ("verify", "inspect")]) if b]
    assert not bad, "\n".join(bad)


_FIT_SUBSET = ("file-flip-tensor0", "file-weight-1234.5", "file-flip-central-crc", "file-truncated-half", "file-fifo",
               "file-malicious-reduce", "file-symlink-to-original", "dir-flip-item0", "dir-item-weight-1234.5",
               "dir-skeleton-missing", "dir-skeleton-truncated", "dir-path-absolute", "dir-path-fifo",
               "dir-shard-fifo", "dir-shard0-missing", "dir-symlink-to-original")


@pytest.mark.fuzz
@pytest.mark.timeout(1800)
def test_trainer_fit_resumes_exactly_or_refuses(suite, originals):
    """A real ``Trainer.fit(ckpt_path=...)`` with the plugin on a subset: the restored weights and optimizer
    state are the original's, or the fit raises naming the file; nothing hangs."""
    variants, _, _ = suite
    root, _ = originals
    subset = [v for v in variants if v.name in _FIT_SUBSET]
    assert len(subset) == len(_FIT_SUBSET)
    (root / "fit.json").write_text(json.dumps([dataclasses.asdict(v) for v in subset]))
    bad = []
    for r, v in zip(_run("fit", root / "originals.json", root / "fit.json", len(subset)), subset):
        if r["outcome"] in ("wrong", "hang") or (v.expect == "equal") != (r["outcome"] == "equal"):
            bad.append(f"{v.name}: {r['outcome']} {r['message'][-300:]}")
        elif r["outcome"] == "refused" and not _names_file(v, r["message"]):
            bad.append(f"{v.name}: the error does not name the file: {r['message'][-300:]}")
    assert not bad, "\n".join(bad)


def _damage_strategy():
    from hypothesis import strategies as st

    return st.tuples(
        st.sampled_from(["file", "dir-shard", "dir-skeleton", "dir-metadata"]),
        st.sampled_from(["flip", "truncate", "overwrite"]),
        st.floats(0.0, 1.0, exclude_max=True),  # where, as a fraction of the file
        st.integers(0, 7),  # which bit
        st.binary(min_size=1, max_size=64),  # what is written
    )


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
def test_hypothesis_damage_never_loads_silently(originals, tmp_path_factory):
    """Hypothesis draws a file of a real checkpoint, a place in it and a damage (a bit flipped, the file cut
    there, bytes overwritten); the plugin's load either refuses naming the file or gives exactly the original,
    and ``verify`` agrees with it. In this process, each step under an alarm."""
    import shutil
    import signal

    import corrupt_runner as cr
    import corrupt_variants as cv
    from hypothesis import HealthCheck, given, settings

    from lightning_asyncckpt.tools import cli

    root, paths = originals
    reference = {kind: cr._load(p) for kind, p in paths.items()}
    work = tmp_path_factory.mktemp("hyp")
    counter = iter(range(10**6))

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_damage_strategy())
    def check(damage):
        where, how, at, bit, data = damage
        kind = "file" if where == "file" else "dir"
        target = work / f"v{next(counter)}.ckpt"
        cv._copy(Path(paths[kind]), target)
        if kind == "file":
            victim = target
        else:
            names = {"dir-skeleton": ".asyncckpt-skeleton.pt", "dir-metadata": ".metadata"}
            victim = target / names[where] if where in names else sorted(target.glob("*.distcp"))[0]
        size = victim.stat().st_size
        pos = int(at * size)
        if how == "truncate":
            os.truncate(victim, pos)
        elif how == "flip":
            cv._flip(victim, pos, 1 << bit)
        else:
            with open(victim, "r+b") as f:
                f.seek(pos)
                f.write(data[: size - pos])
        signal.signal(signal.SIGALRM, cr._alarm)
        signal.alarm(60)
        try:
            try:
                loaded, message = cr._load(str(target)), ""
            except cr._Hang:
                raise
            except BaseException as e:  # noqa: BLE001
                loaded, message = None, f"{type(e).__name__}: {e}"
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli.main(["verify", str(target)])
        finally:
            signal.alarm(0)
        if loaded is not None:
            assert cr.same(loaded, reference[kind]), f"{damage}: a silent wrong load"
            assert code == 0, f"{damage}: loads as the original, verify says {err.getvalue()}"
        else:
            assert str(target) in message, f"{damage}: the error does not name the checkpoint: {message}"
            assert code != 0, f"{damage}: verify says OK, the load says {message}"
            assert str(target) in err.getvalue()
        shutil.rmtree(target) if target.is_dir() else target.unlink()

    check()


def test_verify_on_load_false_skips_the_crc32_but_never_the_path_checks(originals, tmp_path):
    import corrupt_runner as cr
    import corrupt_variants as cv
    import torch

    from lightning_asyncckpt import AsyncCheckpointIO
    from lightning_asyncckpt.format.integrity import CorruptCheckpointError

    _, paths = originals
    path = cv._copy(Path(paths["file"]), tmp_path / "flipped.ckpt")
    name, at, n, _ = cv._tensor_records(path)[0]
    cv._flip(path, at + n // 2)
    with pytest.raises(CorruptCheckpointError, match=rf"{path}: corrupt: record '{name}' does not match its CRC32"):
        AsyncCheckpointIO(worker="fork").load_checkpoint(path)
    loaded = AsyncCheckpointIO(worker="fork", verify_on_load=False).load_checkpoint(path)  # stock's behaviour
    original = torch.load(paths["file"], weights_only=True)
    assert not cr.same(loaded, original)
    os.mkfifo(tmp_path / "fifo.ckpt")
    with pytest.raises(CorruptCheckpointError, match=r"fifo\.ckpt: not a regular file \(a FIFO\)"):
        AsyncCheckpointIO(worker="fork", verify_on_load=False).load_checkpoint(tmp_path / "fifo.ckpt")
    with pytest.raises(TypeError, match=r"verify_on_load=\.\.\.\) takes True or False; got 'no'"):
        AsyncCheckpointIO(verify_on_load="no")


_LOAD_AND_MEASURE = """
import json, resource, sys
from lightning_asyncckpt import AsyncCheckpointIO
out = {}
for verify in (True, False):
    try:
        AsyncCheckpointIO(worker="fork", verify_on_load=verify).load_checkpoint(sys.argv[1])
        out[str(verify)] = "loaded"
    except BaseException as e:
        out[str(verify)] = f"{type(e).__name__}: {e}"
out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(out))
"""


def test_a_metadata_declaring_a_huge_tensor_is_refused_before_anything_is_allocated(originals, tmp_path):
    """A ``.metadata`` whose largest tensor declares 2**40 elements (its stored item unchanged) is refused naming
    the file and the item, with or without the CRC32 pass, and the loading process stays small (its address
    space capped at 4 GB, so that a load that allocates first cannot hurt the machine)."""
    import resource

    import corrupt_variants as cv

    _, paths = originals
    path = cv.huge_tensor(cv._copy(Path(paths["dir"]), tmp_path / "huge.ckpt"))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4_000_000_000, 4_000_000_000))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(path)], capture_output=True, text=True,
                          env=env, timeout=300, preexec_fn=cap)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    for verify in ("True", "False"):
        assert result[verify].startswith(f"CorruptCheckpointError: {path}/.metadata: item "), result[verify]
        assert str(2**40) in result[verify] and "before anything is allocated" in result[verify], result[verify]
    assert result["maxrss_kib"] < 2 * 1024 * 1024, f"peak RSS {result['maxrss_kib']} KiB"

