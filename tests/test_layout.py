"""The package's folder is its architecture: every module imports only from its own layer or the layers
below it, there are no import circles, and no module imports another module's ``_``-names.

Static (the source is parsed, nothing is imported), so a violation names the file and the import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_asyncckpt

ROOT = Path(lightning_asyncckpt.__file__).parent
PKG = "lightning_asyncckpt"
# lowest first; a module may import from its own layer and those before it
LAYERS = ["version", "errors", "units", "faults", "collectives", "snapshot", "storage", "format", "write", "engines", "pipeline", "tiers",
          "integration", "tools", "testing"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join((PKG, *parts))
        out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for each of the package's imports in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == PKG or module.startswith(PKG + "."):
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.append((sub, "", node.lineno) if sub in MODULES else (module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith(PKG + ".")]
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_belongs_to_a_layer():
    loose = [m for m in MODULES if m not in (PKG, f"{PKG}.__main__") and _layer(m) is None]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_goes_up_a_layer_or_into_private_names(name):
    here = _layer(name)
    for module, imported, line in _imports(name, MODULES[name]):
        there = _layer(module)
        where = f"{MODULES[name].relative_to(ROOT.parent)}:{line}"
        if here is not None and there is not None:
            assert there <= here, f"{where}: {name} ({LAYERS[here]}) imports {module} ({LAYERS[there]}), a layer above"
        assert not (imported.startswith("_") and not imported.startswith("__")), f"{where}: imports {module}.{imported}"
        assert not module.rpartition(".")[2].startswith("_") or module.endswith("__main__"), f"{where}: imports {module}"


def test_there_are_no_import_circles():
    graph = {m: {i for i, _, _ in _imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}
    graph.pop(PKG)  # the package's lazy public names point down into every layer by design
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
        if m in done or m not in graph:
            return
        for n in sorted(graph[m]):
            visit(n, stack + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_the_package_declares_no_lightning_callbacks_entry_point():
    """A ``callbacks_factory`` entry point adds its callbacks to every Trainer: the finalizer goes only to a
    Trainer made with the plugin (``integration/autoattach.py``). An earlier install's entry point, still in
    the environment until the package is installed again, adds nothing."""
    import tomllib

    from lightning_asyncckpt.integration.callback import external_callbacks

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]["entry-points"]
    assert not [group for group in project if group.endswith("callbacks_factory")], project
    assert external_callbacks() == []
