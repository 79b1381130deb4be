"""Fabric with the local tier on simulated nodes (tests/test_tiers_nodes.py): 2 nodes x 1 rank, DDP
(``--strategy ddp``) or FSDP2 (``--strategy fsdp2``: ``AsyncFabricModelParallelStrategy``, each rank's
shards), local saves every 2 steps through ``FabricTiers``, a persistent ``fabric.save`` at step 8 (FSDP2: a
sharded directory written by both ranks).

Cases: ``train`` (until step 10 is complete locally; the states of steps 8 and 10 go aside; then waits to be
killed), ``resume`` (``FabricTiers.resume`` with the persistent step-8 file; reports the step and whether
the state equals the saved one exactly) and ``keys`` (``strict``, and the resumed step's name loaded again).
"""

from __future__ import annotations

import copy
import os
import time

import lightning as L
import torch
from nodes import node_job_args, run_and_report

from helpers import assert_tree_equal
from lightning_asyncckpt import AsyncCheckpointIO, FabricTiers, LocalTier


def _state_of(state):
    """This rank's model and optimizer state, copied (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    def local(obj):
        if isinstance(obj, dict):
            return {k: local(v) for k, v in obj.items()}
        return obj.to_local().clone() if isinstance(obj, DTensor) else copy.deepcopy(obj)

    return local({"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()["state"],
                  "step": state["step"]})


def _parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def _fabric(args, io):
    if args.strategy == "fsdp2":
        from lightning_asyncckpt import AsyncFabricModelParallelStrategy

        world = args.nodes * args.devices
        strategy = AsyncFabricModelParallelStrategy(_parallelize, data_parallel_size=world, tensor_parallel_size=1,
                                                    checkpoint_io=io)
        return L.Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy)
    return L.Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy="ddp", plugins=[io])


def _case_keys(fabric, tiers, state, report, persistent):
    """``FabricTiers.resume`` with keys as ``fabric.load`` takes them: a requested key the local step lacks
    raises under ``strict``, is left as it is without; the step's name loaded again says what it is."""
    try:
        tiers.resume({**state, "extra": 1}, persistent=persistent)
    except KeyError as e:
        report["strict_error"] = str(e)
    wanted = {**state, "extra": 1}
    report["resumed"] = tiers.resume(wanted, persistent=persistent, strict=False)
    report["start_step"], report["extra"] = wanted["step"], wanted["extra"]
    try:
        fabric.load("/dev/shm/local/asyncckpt-local/default/restore-step-10", state)
    except FileNotFoundError as e:
        report["again_error"] = str(e)


def main():
    args = node_job_args(strategy="ddp")
    run_and_report(args.out, args.devices, lambda report: run(args, report))


def run(args, report):
    io = AsyncCheckpointIO(args.engine, local=LocalTier("/dev/shm/local", every_n_train_steps=2, timeout_s=60))
    fabric = _fabric(args, io)
    fabric.launch()
    L.seed_everything(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if args.strategy == "fsdp2":  # the optimizer over the sharded parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    else:
        model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers = FabricTiers(fabric)
    persistent = os.path.join(args.out, "c", "step-8.ckpt")  # FSDP2: a directory of that name
    with io:
        if args.case == "resume":
            report["resumed"] = tiers.resume(state, persistent=persistent)
            report["start_step"] = state["step"]
            saved = torch.load(os.path.join(args.out, f"state-rank{fabric.global_rank}-step{state['step']}.pt"),
                               weights_only=False)
            assert_tree_equal(_state_of(state), saved, "state at resume")
            report["resume_exact"] = True
            return
        if args.case == "keys":
            _case_keys(fabric, tiers, state, report, persistent)
            return
        assert not tiers.resume(state, persistent=persistent)  # at every start: it names the run (none saved yet)
        copies = {}
        g = torch.Generator().manual_seed(fabric.global_rank)
        while state["step"] < 10:
            x = torch.randn(8, 32, generator=g)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            if state["step"] in (8, 10):
                copies[state["step"]] = _state_of(state)
            if state["step"] == 8:
                fabric.save(persistent, state)
            tiers.step_end(state["step"], state)
            io.finalize()
        assert tiers.tier.finish() == 10
        io.finalize(blocking=True)
        for step, c in copies.items():
            torch.save(c, os.path.join(args.out, f"state-rank{fabric.global_rank}-step{step}.pt"))
        open(os.path.join(args.out, f"held-rank{fabric.global_rank}"), "w").close()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # the test kills this process
            time.sleep(0.1)


if __name__ == "__main__":
    main()
