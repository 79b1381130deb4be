"""The path of one single-device save through the package, module by module (issue 53's "reads top-down").

    python scripts/trace_save.py

It saves a small state dict with ``AsyncCheckpointIO`` (the default engine, one process), with a profile hook
on the main thread that records the first call of each function of this package (what a reader reads once;
loops and recursion over the state's tensors add nothing). Consecutive functions of one module are one stop. It prints the stops of ``save_checkpoint``, and counts:

- ``returns``: stops in a module the path had already left (A -> B -> A counts once);
- ``climbs``: stops in a higher layer than the stop before (a call back up the layer table of
  ``docs/architecture.md``);
- ``call-backs``: first calls into a module that is already on the call stack below the caller (B, called by
  A, calls back into A): the path leaves a module and re-enters it from underneath, which a top-down reader
  cannot follow. A caller that calls its parts one after another (A -> B, back in A, A -> C) reads
  top-down; it counts as returns, not as call-backs.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

# top to bottom, as tests/test_layout.py orders the folders
LAYERS = ["testing", "tools", "integration", "tiers", "pipeline", "engines", "write", "format", "storage",
          "snapshot", "collectives", "faults"]


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def trace(call) -> tuple[list[str], list[str]]:
    """The stops of ``call`` and its call-backs (each as "caller -> module re-entered")."""
    stops: list[str] = []
    callbacks: list[str] = []
    read: set[object] = set()
    stack: list[str] = []  # the package's modules of the frames now running, outermost first

    def hook(frame, event, _arg):
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("lightning_asyncckpt"):
            return
        if event == "return":
            if stack:
                stack.pop()
            return
        if event != "call":
            return
        first = frame.f_code not in read
        if first and stack and stack[-1] != name and name in stack[:-1]:
            callbacks.append(f"{stack[-1]} -> {name}")
        stack.append(name)
        if not first:
            return
        read.add(frame.f_code)
        if not stops or stops[-1] != name:
            stops.append(name)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stops, callbacks


def main() -> None:
    from lightning_asyncckpt import AsyncCheckpointIO

    state = {"state_dict": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "global_step": 1, "epoch": 0}
    with tempfile.TemporaryDirectory() as tmp:
        io = AsyncCheckpointIO()
        io.save_checkpoint(state, Path(tmp) / "warm.ckpt")  # the first save starts the worker: trace the next
        io.teardown()
        io = AsyncCheckpointIO()
        io.save_checkpoint(state, Path(tmp) / "warm.ckpt")
        stops, callbacks = trace(lambda: io.save_checkpoint(state, Path(tmp) / "x.ckpt"))
        io.teardown()
    seen: set[str] = set()
    returns = climbs = 0
    for i, m in enumerate(stops):
        back = m in seen
        up = i > 0 and _layer(m) < _layer(stops[i - 1])
        returns += back
        climbs += up
        seen.add(m)
        print(f"{i + 1:3d}  {m}{'   (again)' if back else ''}{'   (up)' if up else ''}")
    for callback in callbacks:
        print(f"call-back: {callback}")
    print(f"{len(stops)} stops in {len(seen)} modules; {returns} returns to a module already left; {climbs} climbs; "
          f"{len(callbacks)} call-backs")


if __name__ == "__main__":
    main()
