"""Plan caching of collective saves, for tests/test_plan_cache.py: 2 ranks (spawned here), gloo on CPU.

Every rank saves a sequence of states through ``AsyncCheckpointIO.save_checkpoint_distributed`` (replicated,
``--case replicated``) or ``save_checkpoint_sharded`` (FSDP2 ``DTensor`` shards, ``--case sharded``), twice:
into ``cached/`` with the plan cache (the default) and into ``uncached/`` with it turned off
(``LIGHTNING_ASYNCCKPT_PLAN_CACHE=0``). Between saves the structure sometimes stays and sometimes changes (a
key appears, a shape or dtype changes, optimizer state appears after the first step). Each save is read back
(this package's reader, and plain DCP's ``dcp_to_torch_save``) and compared bit for bit with a copy taken
at save time. Each rank writes ``<out>/rank<r>.json``: the plan decisions it logged and any mismatch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import assert_tree_equal, clone_tree
from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.pipeline import dcp_plan, plan_cache
from lightning_asyncckpt.storage import commit
from processes import run_gloo_cases

WORLD = 2


class Decisions(logging.Handler):
    """The plan cache's decisions, from its log: ``"reused"`` or ``"planned"`` per collective save."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append("reused" if "reused" in record.getMessage() else "planned")


def replicated_states():
    """(name, state) per save: the same on every rank, as DDP's is."""
    g = torch.Generator().manual_seed(0)
    w = {"layer.weight": torch.randn(8, 4, generator=g), "layer.bias": torch.randn(8, generator=g)}
    base = {"model": w, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}, "step": 0}
    # string keys: plain DCP reads integer keys back as list indices
    moments = {"0": {"exp_avg": torch.randn(8, 4, generator=g)}, "1": {"exp_avg": torch.randn(8, generator=g)}}

    def bump(state, step):
        out = clone_tree(state)
        out["step"] = step
        out["model"] = {k: v + step for k, v in out["model"].items()}
        return out

    s1 = base
    s2 = bump(base, 2)
    s3 = bump(base, 3) | {"optimizer": {"state": moments, "param_groups": base["optimizer"]["param_groups"]}}
    s4 = bump(s3, 4)
    s5 = bump(s4, 5) | {"buffer": torch.arange(6.0)}  # a tensor appears
    s6 = bump(s5, 6) | {"buffer": torch.arange(9.0)}  # its shape changes
    s7 = bump(s6, 7) | {"buffer": torch.arange(9.0, dtype=torch.float64)}  # its dtype changes
    s8 = bump(s7, 8) | {"notes": {"tag": "eight"}}  # a leaf without tensors (rank 0's plan only)
    s9 = bump(s8, 9) | {"notes": {"tag": "nine"}}
    return [s1, s2, s3, s4, s5, s6, s7, s8, s9]


EXPECTED_REPLICATED = ["planned", "reused", "planned", "reused", "planned", "planned", "planned", "planned", "reused"]


def read_plain(path, out, rank):
    """The checkpoint read with plain DCP (``dcp_to_torch_save``), keys sorted (DCP does not keep their order)."""
    target = os.path.join(out, f"plain-{rank}.pt")
    dcp_to_torch_save(path, target)
    got = torch.load(target, weights_only=False)
    os.unlink(target)
    return _sorted(got)


def _sorted(tree):
    if isinstance(tree, dict):
        return {k: _sorted(tree[k]) for k in sorted(tree, key=str)}
    return tree


def _sharded_part(got):
    """The model and optimizer state of a sharded checkpoint read back (not ``meta.pt``'s values)."""
    out = {"model": got["model"]}
    if "optimizer" in got:
        out["optimizer"] = got["optimizer"]["state"]
    return _sorted(out)


def same_checkpoints(a, b):
    """Differences between two directories of the same save, cached and not: the same files, byte for byte,
    except the provenance file (its time) and ``.metadata``, whose content must match but for the
    ``storage_meta`` (the save's id and temporary path)."""
    diffs = []
    if sorted(os.listdir(a)) != sorted(os.listdir(b)):
        return [f"{a}: files {sorted(os.listdir(a))} != {sorted(os.listdir(b))}"]
    for name in sorted(os.listdir(a)):
        if name == commit.INFO_FILE:
            continue
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            da, db = fa.read(), fb.read()
        if name == commit.METADATA_FILE:
            ma, mb = (dataclasses.replace(pickle.loads(d), storage_meta=None) for d in (da, db))
            if ma != mb:
                diffs.append(f"{a}/{name}: metadata differs")
        elif da != db:
            diffs.append(f"{a}/{name}: bytes differ")
    return diffs


def save_all(args, report, kind, states, save, decisions_expected):
    """Saves ``states`` one by one with ``save(io, state, path)`` (each committed before the next; it returns
    what the checkpoint must hold), reads each back and compares."""
    decisions = Decisions()
    logger = logging.getLogger(plan_cache.__name__)
    logger.addHandler(decisions)
    logger.setLevel(logging.DEBUG)
    rank = dist.get_rank()
    problems = []
    with AsyncCheckpointIO(args.engine, worker=args.worker) as io:
        for i, state in enumerate(states):
            path = os.path.join(args.out, kind, f"s{i + 1}")
            expected = save(io, state, path)  # a copy taken at save time
            io.finalize(blocking=True)
            dist.barrier()
            got = io.load_checkpoint(path)
            try:
                if kind.startswith("replicated"):
                    assert_tree_equal(got, expected, f"s{i + 1}")
                    assert_tree_equal(read_plain(path, args.out, rank), _sorted(expected), f"s{i + 1} (plain DCP)")
                else:
                    assert_tree_equal(_sharded_part(got), expected, f"s{i + 1}")
                    assert_tree_equal(_sharded_part(read_plain(path, args.out, rank)), expected, f"s{i + 1} (plain DCP)")
            except (AssertionError, KeyError) as e:
                problems.append(f"{type(e).__name__}: {e}")
            dist.barrier()
    logger.removeHandler(decisions)
    report[kind] = {"decisions": decisions.seen, "expected": decisions_expected, "problems": problems}


def _replicated(args, report, uncached_too):
    states = replicated_states()

    def save(io, state, path):
        io.save_checkpoint_distributed(state, path)
        return clone_tree(state)

    save_all(args, report, "replicated", states, save, EXPECTED_REPLICATED)
    if not uncached_too:
        return
    os.environ[plan_cache.ENV_VAR] = "0"
    save_all(args, report, "replicated-uncached", states, save, ["planned"] * len(states))
    if dist.get_rank() == 0:
        report["cached_vs_uncached"] = [
            d for i in range(len(states)) for d in same_checkpoints(
                os.path.join(args.out, "replicated", f"s{i + 1}"), os.path.join(args.out, "replicated-uncached", f"s{i + 1}"))
        ]


def case_replicated(args, report):
    _replicated(args, report, uncached_too=False)


def case_replicated_vs_uncached(args, report):
    _replicated(args, report, uncached_too=True)


def sharded_setup():
    """Two FSDP2 models (``DTensor`` shards over both ranks) of the same parameter names and different
    widths, each with Adam; returns ``save_state(kind)`` and ``full(kind)`` for the kinds of save in
    ``SHARDED``: (model, with its optimizer state)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (WORLD,))
    models, opts = [], []
    for width in (8, 12):
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models.append(model)
        opts.append(torch.optim.Adam(model.parameters(), lr=0.1))

    def train_step(m):
        x = torch.randn(4, models[m][0].in_features, generator=torch.Generator().manual_seed(dist.get_rank()))
        models[m](x).pow(2).mean().backward()
        opts[m].step()
        opts[m].zero_grad()

    def save_state(kind):
        m, with_optimizer = kind
        train_step(m)
        state = {"model": get_model_state_dict(models[m])}
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(models[m], opts[m])
        return state

    def full(kind):
        m, with_optimizer = kind
        options = StateDictOptions(full_state_dict=True)
        out = {"model": dict(get_model_state_dict(models[m], options=options))}
        if with_optimizer:
            out["optimizer"] = get_optimizer_state_dict(models[m], opts[m], options=options)["state"]
        return _sorted(clone_tree(out))

    return save_state, full


# (model, with optimizer state): the model alone, then with Adam's state, then a model of other shapes
SHARDED = [(0, False), (0, False), (0, True), (0, True), (1, True), (1, True)]
EXPECTED_SHARDED = ["planned", "reused", "planned", "reused", "planned", "reused"]


def case_sharded(args, report):
    save_state, full = sharded_setup()

    def save(io, kind, path):
        io.save_checkpoint_sharded(save_state(kind), path, {"kind": list(kind)})
        return full(kind)

    save_all(args, report, "sharded", SHARDED, save, EXPECTED_SHARDED)


def case_planning_error(args, report):
    """A rank whose local planning fails (its directory cannot be made) with the cache on: every rank
    raises (DCP's CheckpointException naming rank 1), none waits forever."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs
    from torch.distributed.checkpoint.api import CheckpointException


    rank, cache = dist.get_rank(), plan_cache.PlanCache(enabled=True)
    blocker = os.path.join(args.out, "a-file")
    open(blocker, "w").close()
    state = {"w": torch.ones(4)}
    good = os.path.join(args.out, "good")

    def plan(tmp):
        return dcp_plan.plan_save(state, tmp, fs.FileSystemWriterAsync, 1, fs._split_by_size_and_type,
                                    distributed=True, cache=cache)

    plan(Path(good))  # cached now on both ranks
    dist.barrier()
    try:
        plan(Path(blocker) / "tmp" if rank == 1 else Path(good))
        report["raised"] = None
    except CheckpointException as e:  # DCP's, a BaseException: every rank's errors, by rank
        report["raised"] = {"type": type(e).__name__, "ranks": sorted(e.failures), "message": str(e)}
    report["misses"] = cache.misses


if __name__ == "__main__":
    run_gloo_cases("jobs.plan_job", WORLD)
