"""Every ```python block of README.md and docs/*.md runs, each in a fresh interpreter in a temporary directory
(CPU, hard timeout, process group killed after), so that an example that stops working fails `make test`.

The convention (docs/contributing.md, "Code examples"): an HTML comment on the line right before a block's
opening fence may say

- ``<!-- example: setup=docs/examples/NAME.py -->``: that file's code runs first, in the same script (it
  defines what the block takes as given, such as ``MyModel`` and ``model``);
- ``<!-- example: run=docs/examples/NAME.py -->``: the block needs what CI has not (several nodes, GPUs, an
  object store), and the named file, a stated reduced form of it, runs instead;
- ``<!-- example: fragment -->``: a piece of a larger loop shown in context, not run (keep these few).

Identical scripts run once (the README's quick starts are the getting-started page's), module docstrings aside."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from processes import launch

EXAMPLES_DIR = Path(ROOT) / "docs" / "examples"
# a block is 'fragment' only by choice, and such choices stay few: raise this only with a reason in the page
MAX_FRAGMENTS = 3
TIMEOUT_S = 200  # below pytest-timeout's 240 s, so that a hang reports its stacks

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^\n]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*example:\s*(?P<what>[^>]*?)\s*-->\s*$")


def doc_files() -> list[Path]:
    return [Path(ROOT) / "README.md"] + sorted((Path(ROOT) / "docs").glob("*.md"))


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, directive)`` for each fenced block whose info string is ``python``, in ``path``."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence)) and not lines[j].strip().strip(fence[0])),
                   None)
        if end is None:
            raise AssertionError(f"{path.name}:{i + 1}: a code fence that never closes")
        if info.split(" ")[0] == "python":
            prev = lines[i - 1] if i > 0 else ""
            d = _DIRECTIVE.match(prev)
            code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
            blocks.append((i + 1, code + "\n", d["what"] if d else None))
        i = end + 1
    return blocks


def _without_docstring(script: str) -> str:
    """``script`` less its module docstring: a reduced form's docstring says how it differs from the page, and
    one identical to a page's block otherwise runs once."""
    body = ast.parse(script).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        script = "\n".join(script.splitlines()[body[0].end_lineno:])
    return script.strip("\n") + "\n"


def scripts() -> tuple[dict[str, list[str]], list[str], set[Path]]:
    """The scripts to run (script text -> where it comes from), the fragments, and the files named."""
    runs: dict[str, list[str]] = {}
    fragments: list[str] = []
    named: set[Path] = set()
    for path in doc_files():
        for line, code, what in python_blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if what == "fragment":
                fragments.append(where)
                continue
            if what is None:
                script = code
            else:
                key, _, value = what.partition("=")
                target = Path(ROOT) / value
                if key not in ("setup", "run") or not value or target.parent != EXAMPLES_DIR:
                    raise AssertionError(f"{where}: unknown example directive {what!r} (see docs/contributing.md)")
                if not target.is_file():
                    raise AssertionError(f"{where}: names {value}, which does not exist")
                named.add(target)
                script = (target.read_text() + "\n" + code) if key == "setup" else target.read_text()
            runs.setdefault(_without_docstring(script), []).append(where)
    return runs, fragments, named


RUNS, FRAGMENTS, NAMED = scripts()


def test_examples_are_found_and_fragments_stay_few():
    assert len(RUNS) >= 5, f"only {len(RUNS)} runnable examples found in README.md and docs/*.md"
    assert len(FRAGMENTS) <= MAX_FRAGMENTS, f"too many blocks marked 'fragment': {FRAGMENTS}"
    unused = sorted(p.name for p in EXAMPLES_DIR.glob("*.py") if p not in NAMED)
    assert not unused, f"docs/examples/ files that no block names: {unused}"


@pytest.mark.parametrize("script", list(RUNS), ids=[", ".join(w) for w in RUNS.values()])
def test_example_runs(script, tmp_path):
    where = ", ".join(RUNS[script])
    (tmp_path / "example.py").write_text(script)
    work = tmp_path / "work"
    work.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "CUDA_VISIBLE_DEVICES": ""}
    with launch([sys.executable, str(tmp_path / "example.py")], tmp_path / "out", TIMEOUT_S, cwd=work, env=env) as job:
        code = job.wait()
    assert code == 0, f"the example at {where} failed (exit {code}):\n{job.log_text()[-4000:]}"
