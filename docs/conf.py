"""Sphinx configuration of the documentation site (`make docs`; pages in MyST Markdown).

The package is imported from this checkout, and its runtime (torch, Lightning, the engines) from the
environment `make docs` names in ASYNCCKPT_RUNTIME_SITE (the project's .venv): the docs tools stay pinned in
their own .venv-docs (requirements/docs.txt) and the API reference documents the code as it imports.
"""

from __future__ import annotations

import os
import site
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.environ.get("ASYNCCKPT_RUNTIME_SITE"):
    site.addsitedir(os.environ["ASYNCCKPT_RUNTIME_SITE"])  # after .venv-docs' own: the docs pins win

project = "lightning-asyncckpt"
author = "the lightning-asyncckpt authors"
copyright = "2026, the lightning-asyncckpt authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples", "_generated"]

# MyST: `#` anchors for headings down to ###, so that [text](page.md#a-heading) is checked like any reference
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# Every reference must resolve: a broken internal link or API reference fails `make docs` (-W). Types that
# belong to other projects (torch, Lightning, the standard library) are not in this site, and without network
# in CI there is no intersphinx inventory to resolve them against: those alone are let through.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|lightning|pytorch_lightning|lightning_fabric|nvidia_resiliency_ext|megatron|fsspec"
               r"|typing|typing_extensions|collections|os|pathlib|signal|enum|dataclasses|types|abc|logging"
               r"|threading|multiprocessing|concurrent|datetime|pytest|_pytest)(\..*)?"),
    (r"py:class", r"(optional|callable|Any|Path|Tensor|Module|Optimizer|Callable|Iterator|Mapping|Sequence"
                  r"|Trainer|LightningModule|Fabric|CheckpointIO|FaultPolicy|MAP_LOCATION|RankFailure)"),
    # the package's internal modules: not in the API reference (Architecture describes them); a docstring of a
    # public name may still point at them for contributors
    (r"py:.*", r"lightning_asyncckpt\.(pipeline|snapshot|integration|tiers|faults|storage|format|write|engines"
               r"|collectives|tools)\..*"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "lightning-asyncckpt"
html_static_path: list[str] = []


def _check_python_examples(app, doctree, docname):  # noqa: ANN001 - Sphinx's event signature
    """A python example that does not parse fails the build (warnings are errors): make test runs each one,
    and this catches a broken one already at ``make docs``."""
    import ast

    from docutils import nodes
    from sphinx.util import logging

    for block in doctree.findall(nodes.literal_block):
        if block.get("language") in ("python", "py", "python3"):
            try:
                ast.parse(block.astext())
            except SyntaxError as e:
                logging.getLogger(__name__).warning(f"a python example does not parse: {e}", location=block)


def setup(app):  # noqa: ANN001 - Sphinx's
    app.connect("doctree-resolved", _check_python_examples)
