"""``bench_tiers.py``'s state and timing helpers: the replicated state, its tensors in order, the check that a
restored state is the live one, timers around the library's functions, and the rotated repetitions."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import defaultdict
from typing import Any


def make_state(nbytes: int, layers: int) -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // (3 * layers * 4))
    gen = torch.Generator().manual_seed(0)  # the same values on every rank: a replicated (DDP) state

    def rand() -> Any:
        return torch.rand(numel, generator=gen)

    return {
        "state_dict": {f"layers.{i}.weight": rand() for i in range(layers)},
        "optimizer_states": [{
            "state": {i: {"exp_avg": rand(), "exp_avg_sq": rand()} for i in range(layers)},
            "param_groups": [{"params": list(range(layers)), "lr": 1e-3, "betas": (0.9, 0.999)}],
        }],
        "epoch": 0,
        "global_step": 0,
    }


def state_tensors(obj: Any) -> list:
    """The state's tensors in a fixed order; a ``DTensor``'s local shard (the local tier restores one as a
    ``LocalShard``, whose ``local`` it is)."""
    import torch

    if hasattr(obj, "to_local"):  # a DTensor
        return [obj.to_local()]
    if type(obj).__name__ == "LocalShard":
        return [obj.local]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in state_tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in state_tensors(v)]
    return []


def same_state(restored: Any, live: dict[str, Any]) -> bool:
    import torch

    a, b = state_tensors(restored), state_tensors(live)
    return (isinstance(restored, dict) and restored.get("global_step") == live["global_step"]
            and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)))


class Timers:
    """Seconds spent in wrapped functions, summed per name (any thread)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr, None)
        if inner is None:  # not in this version of the library: that part reads 0
            return

        @functools.wraps(inner)
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                with self._lock:
                    self.total[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def mark(self) -> dict[str, float]:
        with self._lock:
            return dict(self.total)

    def since(self, mark: dict[str, float], names: list[str]) -> dict[str, float]:
        now = self.mark()
        return {n: now.get(n, 0.0) - mark.get(n, 0.0) for n in names}


def rotations(kinds: list[str], reps: int, run_one: Any, talk: bool, line: Any) -> list[dict[str, Any]]:
    """``reps`` rounds of ``run_one(kind)`` for every kind, each round's order rotated by one (so that no kind
    always follows the same one); each row gets its round as ``rep``, and with ``talk`` a progress line."""
    rows = []
    for rep in range(reps):
        for kind in kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]:
            row = run_one(kind)
            row["rep"] = rep
            rows.append(row)
            if talk:
                print(line(rep, kind, row), file=sys.stderr, flush=True)
    return rows
