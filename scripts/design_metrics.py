"""The design rules of issue 53, measured on the package's source (no import, no torch).

    python scripts/design_metrics.py            # a table
    python scripts/design_metrics.py --json     # the same, for tests/test_design_rules.py

Each rule counts what a reviewer would count by hand:

- ``io_public``: public methods and properties that ``AsyncCheckpointIO`` defines itself or takes from a base
  class of this package (Lightning's ``CheckpointIO`` excluded).
- ``mutable_attrs``: per class, the distinct ``self.x`` it assigns outside ``__init__``'s frozen fields, plus the
  fields of a non-frozen dataclass. Properties' setters count as the attribute they set.
- ``dist_imports``: modules that import ``torch.distributed`` outside ``if TYPE_CHECKING:``.
- ``str_isinstance``: ``isinstance(x, str)`` calls, where the package decides remote against local by type.
- ``foreign_setattr``: assignments to an attribute of an object other than ``self``/``cls``
  (``other.x = ...``, ``setattr(other, ...)``), except on an object the same function (or module body) has
  just constructed itself: a local name whose every binding there is a call of a class (``X(...)``,
  ``mod.X(...)``, ``cls(...)``, ``object.__new__(...)``), as in ``out = Report(); out.n += 1; return out``:
  that is the owner's own construction, not a change to someone else's object.
- ``private_flags``: reads of ``_asyncckpt_*`` names.
- ``any``: annotations that mention ``Any`` (``dict[str, Any]`` included), and ``any_colon``: the ``: Any`` the
  issue counted (206 at the start of the redesign).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_asyncckpt"


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        out.append((rel, ast.parse(path.read_text(), filename=rel)))
    return out


def _is_dataclass(node: ast.ClassDef) -> tuple[bool, bool]:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            frozen = isinstance(dec, ast.Call) and any(
                k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value for k in dec.keywords
            )
            return True, frozen
    return False, False


def _self_assigned(node: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for fn in ast.walk(node):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for sub in ast.walk(fn):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = list(sub.targets)
            elif isinstance(sub, ast.AugAssign | ast.AnnAssign):
                targets = [sub.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self" and isinstance(leaf.ctx, ast.Store)):
                        names.add(leaf.attr)
    return names


def mutable_attrs(mods: list[tuple[str, ast.Module]]) -> dict[str, int]:
    out = {}
    for rel, mod in mods:
        for node in ast.walk(mod):
            if not isinstance(node, ast.ClassDef):
                continue
            is_dc, frozen = _is_dataclass(node)
            names = set() if frozen else _self_assigned(node)
            if is_dc and not frozen:
                names |= {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and "ClassVar" not in ast.unparse(s.annotation)}
            if names:
                out[f"{rel}:{node.name}"] = len(names)
    return out


def _type_checking_lines(mod: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(mod):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def dist_imports(mods: list[tuple[str, ast.Module]]) -> list[str]:
    out = []
    for rel, mod in mods:
        hidden = _type_checking_lines(mod)
        for node in ast.walk(mod):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if node.__dict__.get("lineno") in hidden:
                continue
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") and
                   not n.startswith("torch.distributed.checkpoint") or n == "torch.distributed" for n in names):
                out.append(rel)
                break
    return sorted(set(out))


def _calls(mods, pred) -> list[str]:
    out = []
    for rel, mod in mods:
        for node in ast.walk(mod):
            if isinstance(node, ast.Call) and pred(node):
                out.append(f"{rel}:{node.lineno}")
    return out


def str_isinstance(mods) -> list[str]:
    def pred(node: ast.Call) -> bool:
        if getattr(node.func, "id", None) != "isinstance" or len(node.args) != 2:
            return False
        return "str" in {getattr(e, "id", None) for e in ast.walk(node.args[1])}
    return _calls(mods, pred)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope (a module or function body), not those of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _constructs(value: ast.expr) -> bool:
    """``value`` makes a new object: a call of a class (by the naming convention), of ``cls``, or ``__new__``."""
    if not isinstance(value, ast.Call):
        return False
    f = value.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name[:1].isupper() or name in ("cls", "__new__")


def _constructed_here(scope: ast.AST) -> set[str]:
    """The local names of ``scope`` whose every binding there is ``name = <construction>``."""
    nodes = list(_scope_nodes(scope))
    simple = {id(n.targets[0]): n for n in nodes
              if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
    made, other = set(), set()
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            assign = simple.get(id(node))  # else bound by a loop, a with, a tuple target, a walrus...
            (made if assign is not None and _constructs(assign.value) else other).add(node.id)
        elif isinstance(node, ast.Global | ast.Nonlocal):
            other.update(node.names)
        elif isinstance(node, ast.arg):  # a parameter: the caller's object
            other.add(node.arg)
    return made - other


def foreign_setattr(mods) -> list[str]:
    out = []
    for rel, mod in mods:
        for scope in (mod, *(n for n in ast.walk(mod) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))):
            own = {"self", "cls"} | _constructed_here(scope)
            for node in _scope_nodes(scope):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = list(node.targets)
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                      and not (node.args and getattr(node.args[0], "id", None) in own)):
                    out.append(f"{rel}:{node.lineno}")
                for t in targets:
                    for leaf in ast.walk(t):
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.ctx, ast.Store)
                                and not (isinstance(leaf.value, ast.Name) and leaf.value.id in own)):
                            out.append(f"{rel}:{node.lineno}")
    return sorted(out, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def private_flags(mods) -> list[str]:
    out = []
    for rel, mod in mods:
        for node in ast.walk(mod):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_asyncckpt_"):
                out.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_asyncckpt_"):
                out.append(f"{rel}:{node.lineno}")
    return out


def any_annotations(mods) -> int:
    count = 0
    for _, mod in mods:
        for node in ast.walk(mod):
            anns: list[ast.expr | None] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                anns = [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs] + [node.returns]
                anns += [a.vararg.annotation if a.vararg else None, a.kwarg.annotation if a.kwarg else None]
            elif isinstance(node, ast.AnnAssign):
                anns = [node.annotation]
            count += sum(1 for x in anns if x is not None and "Any" in {
                getattr(e, "id", None) or getattr(e, "attr", None) for e in ast.walk(x)})
    return count


def io_public(mods) -> list[str]:
    classes = {node.name: (rel, node) for rel, mod in mods for node in ast.walk(mod) if isinstance(node, ast.ClassDef)}
    seen: list[str] = []

    def visit(name: str) -> None:
        if name not in classes:
            return  # Lightning's CheckpointIO, object, Protocols from elsewhere
        _, node = classes[name]
        for s in node.body:
            if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and not s.name.startswith("_"):
                if s.name not in seen:
                    seen.append(s.name)
        for base in node.bases:
            visit(getattr(base, "id", None) or getattr(base, "attr", ""))

    visit("AsyncCheckpointIO")
    return seen


def measure() -> dict:
    mods = _modules()
    attrs = mutable_attrs(mods)
    return {
        "io_public": io_public(mods),
        "mutable_attrs_over_12": {k: v for k, v in sorted(attrs.items(), key=lambda kv: -kv[1]) if v > 12},
        "max_mutable_attrs": max(attrs.values()),
        "dist_imports": dist_imports(mods),
        "str_isinstance": str_isinstance(mods),
        "foreign_setattr": foreign_setattr(mods),
        "private_flags": private_flags(mods),
        "any": any_annotations(mods),
        "any_colon": sum(len(re.findall(r": Any\b", (PACKAGE.parent / r).read_text())) for r, _ in mods),
        "largest_files": sorted(((len((PACKAGE.parent / r).read_text().splitlines()), r) for r, _ in mods), reverse=True)[:5],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    m = measure()
    if args.json:
        print(json.dumps(m, indent=1))
        return
    print(f"AsyncCheckpointIO public methods/properties: {len(m['io_public'])}  {m['io_public']}")
    print(f"classes over 12 mutable attributes: {len(m['mutable_attrs_over_12'])} (max {m['max_mutable_attrs']})")
    for k, v in m["mutable_attrs_over_12"].items():
        print(f"    {v:3d}  {k}")
    print(f"modules importing torch.distributed: {len(m['dist_imports'])}")
    for k in m["dist_imports"]:
        print(f"    {k}")
    by_file = Counter(s.split(':')[0] for s in m["str_isinstance"])
    print(f"isinstance(..., str): {len(m['str_isinstance'])} in {dict(by_file)}")
    by_file = Counter(s.split(':')[0] for s in m["foreign_setattr"])
    print(f"assignments to another object's attributes: {len(m['foreign_setattr'])} in {dict(by_file)}")
    print(f"_asyncckpt_ flags: {len(m['private_flags'])} {m['private_flags']}")
    print(f"Any annotations: {m['any']} (': Any': {m['any_colon']})")
    print(f"largest files: {m['largest_files']}")


if __name__ == "__main__":
    main()
