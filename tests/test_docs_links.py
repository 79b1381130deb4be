"""README.md is read on GitHub, outside the Sphinx build that checks the docs' links (`make docs`): each of its
relative links must name a file of this repository."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT

_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def test_readme_links_name_files_that_exist():
    text = (Path(ROOT) / "README.md").read_text()
    targets = [m["target"] for m in _LINK.finditer(text)]
    relative = [t for t in targets if not re.match(r"[a-z]+://", t) and not t.startswith("#")]
    assert len(relative) >= 10, f"the README should link into the docs; it has {relative}"
    missing = [t for t in relative if not (Path(ROOT) / t.split("#")[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
