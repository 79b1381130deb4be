"""Plan caching of collective saves: the pure digest and agreement logic, then 2-rank gloo jobs (each under a
hard timeout) whose structure changes between saves: every change must be planned anew, every unchanged
save reuses the plan, and every checkpoint reads back bit for bit (this package's reader and plain DCP)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from lightning_asyncckpt.pipeline.plan_cache import PlanCache, structure_digest
from processes import run_ranks

JOB = "plan_job"


def local_plan(state: dict, planner_data=None) -> SavePlan:
    items = [it for fqn, obj in state.items() for it in _create_write_items(fqn, obj)]
    return SavePlan(items, planner_data=planner_data)


def digest(state: dict, **kw) -> str:
    args = dict(world_size=2, rank=0, flatten=False, writer="W", metadata_extra=None) | kw
    plan_kw = {"planner_data": args.pop("planner_data")} if "planner_data" in args else {}
    return structure_digest(local_plan(state, **plan_kw), **args)


def test_digest_changes_with_every_part_of_the_structure():
    base = {"w": torch.zeros(4, 3), "b": torch.zeros(4), "extra": {"x": 1}}
    same = {"w": torch.ones(4, 3), "b": torch.full((4,), 7.0), "extra": {"x": 2}}  # other values, bytes included
    assert digest(base) == digest(same)
    variants = [
        {**base, "w": torch.zeros(4, 4)},  # a shape
        {**base, "w": torch.zeros(4, 3, dtype=torch.float64)},  # a dtype
        {**base, "w": torch.zeros(4, 3, requires_grad=True)},  # a tensor property
        {"w2": base["w"], "b": base["b"], "extra": base["extra"]},  # a name
        {**base, "new": torch.zeros(1)},  # a tensor appears
        {**base, "more": "x"},  # a byte item appears
    ]
    for variant in variants:
        assert digest(variant) != digest(base), variant.keys()
    for kw in ({"world_size": 4}, {"rank": 1}, {"flatten": True}, {"writer": "Other"},
               {"metadata_extra": {"w": ("model", "w")}}, {"planner_data": {"w": ("model", "w")}}):
        assert digest(base, **kw) != digest(base), kw


class Ranks:
    """``n`` threads standing for ranks: ``all_max`` is the element-wise maximum over all of them."""

    def __init__(self, n: int) -> None:
        self.n, self.values, self.barrier = n, {}, threading.Barrier(n)

    def run(self, fn) -> list:
        out: list = [None] * self.n

        def one(rank: int) -> None:
            def all_max(values):
                self.values[rank] = values
                self.barrier.wait()
                result = [max(col) for col in zip(*(self.values[r] for r in range(self.n)))]
                self.barrier.wait()
                return result

            out[rank] = fn(rank, all_max)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return out


def save(caches, digests, ranks) -> list[bool]:
    """One collective save's planning decision on every rank; a full plan is stored, as plan_save does.
    Returns whether each rank reused its plan."""

    def one(rank, all_max):
        decision = caches[rank].agree(digests[rank], all_max)
        if decision.hit is None:
            caches[rank].store(digests[rank], decision.round_id, f"plan {rank}", None)
        return decision.hit is not None

    return ranks.run(one)


def test_reuse_only_when_every_rank_has_the_same_rounds_plan():
    ranks = Ranks(3)
    caches = [PlanCache(enabled=True) for _ in range(3)]
    assert save(caches, ["a", "b", "c"], ranks) == [False] * 3  # nothing cached
    assert save(caches, ["a", "b", "c"], ranks) == [True] * 3
    assert save(caches, ["a", "B", "c"], ranks) == [False] * 3  # one rank's structure changed: all plan
    assert save(caches, ["a", "B", "c"], ranks) == [True] * 3
    # every rank finds its digest, but rank 1's entry is of an older round: plan again
    assert save(caches, ["a", "b", "c"], ranks) == [False] * 3
    caches[2] = PlanCache(enabled=True)  # a rank whose run started anew
    assert save(caches, ["a", "b", "c"], ranks) == [False] * 3
    assert save(caches, ["a", "b", "c"], ranks) == [True] * 3
    off = [PlanCache(enabled=False) for _ in range(3)]
    assert save(off, ["a", "b", "c"], ranks) == save(off, ["a", "b", "c"], ranks) == [False] * 3


def test_entries_are_bounded_and_metadata_is_copied_per_save():
    cache = PlanCache(enabled=True, max_entries=2)
    metadata = Metadata(state_dict_metadata={})
    for d in "xyz":
        cache.store(d, 1, "plan", metadata)
    assert cache.agree("x", lambda v: v).hit is None  # the oldest was dropped
    hit = cache.agree("z", lambda v: v).hit
    assert hit is not None and hit.central_plan == "plan"
    first = hit.metadata_for_save()
    first.storage_data = {"filled": "by this save's commit"}
    assert hit.metadata_for_save().storage_data is None and first is not hit.metadata_for_save()
    assert dataclasses.replace(first, storage_data=None) == metadata


def test_plan_cache_env_var_turns_it_off(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ASYNCCKPT_PLAN_CACHE", "0")
    assert not PlanCache().enabled
    monkeypatch.delenv("LIGHTNING_ASYNCCKPT_PLAN_CACHE")
    assert PlanCache().enabled


def _run(tmp_path, case, kinds):
    """The job's reports; every save of ``kinds`` read back exactly on both ranks, and planned or reused
    on both ranks as the job expects (``expected``: its sequence of structures)."""
    r0, r1 = run_ranks(JOB, tmp_path, case, "nvrx", "fork", timeout=240)
    for r in (r0, r1):
        for kind in kinds:
            assert r[kind]["problems"] == [], (r.rank, kind, r[kind]["problems"])
            assert r[kind]["decisions"] == r[kind]["expected"], (r.rank, kind)
    return r0, r1


def test_replicated_saves_replan_on_every_structure_change(tmp_path):
    """Repeated collective (``AsyncDDPStrategy``'s) saves: a tensor appearing, a shape, a dtype, a leaf without
    tensors on rank 0 only: each is planned anew on both ranks; unchanged ones reuse the plan; all read back
    exactly. With the change detection broken, a stale plan fails the save ("Could not find FQN") or writes a
    checkpoint that reads back wrong (a float64 tensor read back as float32)."""
    r0, _ = _run(tmp_path, "replicated", ["replicated"])
    assert r0["replicated"]["expected"].count("reused") == 3


@pytest.mark.slow  # make test-all
def test_cached_replicated_checkpoints_are_those_of_uncached_saves(tmp_path):
    """The same saves with and without the cache: the same files, byte for byte, and the same ``.metadata``
    content (but for the save's id and temporary path)."""
    r0, _ = _run(tmp_path, "replicated_vs_uncached", ["replicated", "replicated-uncached"])
    assert r0["cached_vs_uncached"] == []


@pytest.mark.slow  # make test-all
def test_sharded_saves_replan_when_optimizer_state_appears_or_shapes_change(tmp_path):
    """FSDP2 (``AsyncModelParallelStrategy``'s) saves: the model alone, then with Adam's state, then a model of
    other shapes under the same names: each change is planned anew; all read back exactly."""
    r0, _ = _run(tmp_path, "sharded", ["sharded"])
    assert r0["sharded"]["expected"].count("reused") == 3


@pytest.mark.slow  # make test-all
def test_a_rank_failing_to_plan_raises_on_every_rank_with_the_cache(tmp_path):
    """One rank's local planning fails on a save whose structure is cached: no rank waits in the cache's
    all-reduce; DCP's collective planning raises the error on both."""
    r0, r1 = run_ranks(JOB, tmp_path, "planning_error", "nvrx", "fork", timeout=120)
    for r in (r0, r1):
        assert r["raised"] is not None and r["raised"]["ranks"] == [1], r["raised"]
        assert "NotADirectoryError" in r["raised"]["message"]
        assert r["misses"] == 2  # the first save, and the failed one (planned in full)
