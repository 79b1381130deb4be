"""A 2-rank Fabric DDP (gloo, CPU) loop for tests/test_fabric.py. Each rank writes <out>/rank<r>.json."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import psutil
import torch

from helpers import assert_tree_equal, clone_tree, run_fabric_case
from lightning_asyncckpt import AsyncCheckpointIO, CheckpointWriteError, testing
from lightning_asyncckpt.storage import commit
from processes import job_args, other_children


def _setup(fabric, width=64):
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return fabric.setup(model, opt)


def _step(fabric, model, opt, i, width=64):
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(100 * fabric.global_rank + i))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    fabric.backward(loss)
    opt.step()


def case_exact(args, fabric, io, report):
    path = os.path.join(args.out, "ckpt", "step-5")
    with io:
        model, opt = _setup(fabric)
        expected = None
        for i in range(12):
            _step(fabric, model, opt, i)
            if i == 5:
                io.write_hook = testing.DelayWrite(0.5)
                state = {"model": model, "optimizer": opt, "step": i, "extra": {"lr": [1e-2], 7: "seven"}}
                fabric.save(path, state)
                report["complete_right_after_save"] = commit.is_complete(Path(path))
                expected = clone_tree({
                    "model": model.module.state_dict(), "optimizer": opt.optimizer.state_dict()["state"],
                })
            io.finalize()  # every rank, every step: commits the save once it is written
        report["committed_before_exit"] = commit.is_complete(Path(path))
    report["children_after_exit"] = _children(fabric)

    model2, opt2 = _setup(fabric)
    state2 = {"model": model2, "optimizer": opt2, "step": -1, "extra": {}}
    remainder = fabric.load(path, state2)
    assert_tree_equal(clone_tree(model2.module.state_dict()), expected["model"], "model")
    assert_tree_equal(clone_tree(opt2.optimizer.state_dict()["state"]), expected["optimizer"], "optimizer")
    assert state2["step"] == 5 and state2["extra"] == {"lr": [1e-2], 7: "seven"}, state2
    report["remainder"] = sorted(map(str, remainder))
    report["loaded_exact"] = True
    io.teardown()  # the load started nothing; a second teardown is harmless


def case_load_right_after_save(args, fabric, io, report):
    """As Lightning's own ``test_ddp_save_load``: rank 0 saves (its write held up), then every rank loads at
    once, with no finalize in between; rank 1 waits for rank 0's file to land instead of finding nothing."""
    path = os.path.join(args.out, "ckpt", "now.ckpt")
    model, opt = _setup(fabric)
    _step(fabric, model, opt, 0)
    expected = clone_tree(model.module.state_dict())
    io.write_hook = testing.DelayWrite(1.0)
    fabric.save(path, {"model": model, "step": 3})
    model2, opt2 = _setup(fabric)
    state = {"model": model2, "step": -1}
    fabric.load(path, state)
    assert_tree_equal(clone_tree(model2.module.state_dict()), expected, "model")
    report["loaded_exact"] = state["step"] == 3
    io.teardown()


def _failing_loop(args, fabric, io, report, setup, failing_ranks):
    """Saves at steps 3 and 6; the second save's write fails on ``failing_ranks``."""
    try:
        with io:
            model, opt = setup(fabric)
            for i in range(40):
                _step(fabric, model, opt, i)
                if i == 3:
                    fabric.save(os.path.join(args.out, "ckpt", "good"), {"model": model})
                if i == 6:
                    if fabric.global_rank in failing_ranks:
                        io.write_hook = testing.FailWrite()
                    fabric.save(os.path.join(args.out, "ckpt", "bad"), {"model": model})
                io.finalize()
        report["raised"] = None
    except CheckpointWriteError as e:
        report["raised"] = {"path": e.path, "ranks": list(e.ranks), "errno": e.errno, "message": str(e)}
        report["raised_at_step"] = i
    fabric.barrier()
    report["files"] = sorted(os.listdir(os.path.join(args.out, "ckpt")))
    report["children_after_exit"] = _children(fabric)


def case_fail(args, fabric, io, report):
    """DDP: rank 0 writes; its failure is raised on both ranks."""
    _failing_loop(args, fabric, io, report, _setup, failing_ranks=(0,))


def _setup_sharded(fabric, width=64):
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width)))
    opt = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    return model, opt


def _parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def _full(model, opt):
    """(all ranks) The gathered model and optimizer state, keys sorted."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    state = {"model": dict(get_model_state_dict(model, options=opts)),
             "opt": dict(get_optimizer_state_dict(model, opt, options=opts)["state"])}

    def srt(t):
        return {k: srt(t[k]) for k in sorted(t, key=str)} if isinstance(t, dict) else clone_tree(t)

    return srt(state)


def case_sharded(args, fabric, io, report):
    """FSDP2 through AsyncFabricModelParallelStrategy: save returns early, finalize commits, load is exact."""
    path = os.path.join(args.out, "ckpt", "step-5")
    records = []
    with io:
        model, opt = _setup_sharded(fabric)
        for i in range(12):
            _step(fabric, model, opt, i)
            if i == 5:
                io.write_hook = testing.DelayWrite(0.3)
                fabric.save(path, {"model": model, "optimizer": opt, "step": i, "note": "five"})
                report["complete_right_after_save"] = commit.is_complete(Path(path))
                io.write_hook = None
                expected = _full(model, opt)
            records += io.finalize()  # what a Fabric loop logs: fabric.log_dict(record.metrics())
        fresh, fresh_opt = _setup_sharded(fabric)
        state = {"model": fresh, "optimizer": fresh_opt, "step": None}
        remainder = fabric.load(path, state)  # commits the pending save first
        records += io.finalize()
        report["files"] = sorted(os.listdir(path))
        report["sizes"] = {f: os.path.getsize(os.path.join(path, f)) for f in report["files"]}
        report["records"] = [[os.path.basename(r.path), r.step, r.nbytes, r.local_nbytes, sorted(r.metrics())]
                             for r in records]
        assert_tree_equal(_full(fresh, fresh_opt), expected, "loaded")
        report["loaded_exact"] = state["step"] == 5
        report["remainder"] = sorted(remainder)
    report["children_after_exit"] = _children(fabric)


def case_sharded_exit(args, fabric, io, report):
    """FSDP2: the script ends right after a sharded save, with no finalize or teardown (Fabric never
    tears down). The ranks commit it together at interpreter exit; the test reads it afterwards."""
    model, opt = _setup_sharded(fabric)
    for i in range(6):
        _step(fabric, model, opt, i)
    io.write_hook = testing.DelayWrite(1.5)
    path = os.path.join(args.out, "ckpt", "step-5")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 5})
    expected = _full(model, opt)
    if fabric.global_rank == 0:
        torch.save(expected["model"], os.path.join(args.out, "expected_model.pt"))
    report["complete_right_after_save"] = commit.is_complete(Path(path))


def case_sharded_abandoned(args, fabric, io, report):
    """FSDP2: rank 0 dies with a sharded save in flight while rank 1 is elsewhere (it never comes to
    commit). Rank 0 must give up after the exit group's timeout and drop the save, not hang."""
    io.session.configure(drain_timeout_s=3.0)  # also the exit group's timeout: made at the first collective save
    model, opt = _setup_sharded(fabric)
    _step(fabric, model, opt, 0)
    path = os.path.join(args.out, "ckpt", "step-0")
    gave_up = os.path.join(args.out, "rank0-gave-up")
    if fabric.global_rank == 1:
        fabric.save(path, {"model": model, "optimizer": opt})
        # busy elsewhere until rank 0 has given up (then it gives up in turn at exit)
        deadline = time.monotonic() + 120
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.01)
        report["left"] = os.path.exists(gave_up)
        return
    io.write_hook = testing.DelayWrite(1.0)
    try:
        with io:
            fabric.save(path, {"model": model, "optimizer": opt})
            pids = io.session.worker_pids()
            raise ValueError("boom on rank 0")
    except ValueError as e:
        report["raised"] = str(e)
    open(gave_up, "w").close()  # the `with io:` block is left: rank 0 stopped waiting for rank 1
    report["files"] = sorted(os.listdir(os.path.join(args.out, "ckpt")))
    # rank 1 (a child of rank 0 here) still runs, with its own worker: look at rank 0's own writer only
    report["had_worker"] = bool(pids)
    report["workers_left"] = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for peer in getattr(fabric.strategy.launcher, "procs", []):  # let rank 1 finish and report
        peer.wait(timeout=120)


def case_sharded_fail(args, fabric, io, report):
    """A write failing on rank 1 only is raised on both ranks by the next finalize."""
    _failing_loop(args, fabric, io, report, _setup_sharded, failing_ranks=(1,))


def _children(fabric):
    """Child processes other than the ranks (one that is already exiting gets a moment to go)."""
    return [line for _, line in other_children(lambda pid, line: pid in _peers(fabric))]


def _peers(fabric):
    launcher = getattr(fabric.strategy, "launcher", None)
    return {p.pid for p in getattr(launcher, "procs", [])}


def main():
    args = job_args()
    io = AsyncCheckpointIO(args.engine, worker=args.worker)
    if args.case.startswith("sharded"):
        from lightning_asyncckpt import AsyncFabricModelParallelStrategy

        strategy = AsyncFabricModelParallelStrategy(_parallelize, data_parallel_size=2, tensor_parallel_size=1)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[io])
    else:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[io])
    fabric.launch()
    run_fabric_case(args, fabric, io, globals())


if __name__ == "__main__":
    main()
