"""``FabricTiers`` with FSDP2 (or, ``JOB_LAYOUT=tp``, 2-way tensor parallel) over 2 CPU ranks
(``AsyncFabricModelParallelStrategy``), under either
distribution (``lightning.fabric``, or ``lightning_fabric`` where ``pytorch_lightning`` is installed alone):
local saves every 2 steps to step 6 (``JOB_SNAPSHOT=lazy``: the optimizer's shards copied while the next step
runs, the loop waiting before each optimizer step), the model and optimizer then overwritten, and
``FabricTiers.resume`` loads each rank's shards of step 6 back, bit for bit.

Run by ``tests/test_tiers_fabric.py`` in ``.venv`` and ``.venv-pl``; imports nothing of the test helpers (they
import ``lightning``). Fabric's launcher runs this script again for rank 1. Each rank writes its
``reports.RankReport`` to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import importlib.util
import os

from reports import RankReport, run_reported


def main() -> None:
    snapshot, layout = os.environ.get("JOB_SNAPSHOT", "eager"), os.environ.get("JOB_LAYOUT", "fsdp2")
    run_reported(lambda args, report: run(args.out, report, snapshot, layout))


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


def _tensor_parallel(model, mesh):
    """2-way tensor parallel: the first layer column-wise, the second row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, mesh["tensor_parallel"], {"0": ColwiseParallel(), "1": RowwiseParallel()})


def _local(state) -> list:
    """Every tensor of this rank's model and optimizer state (a ``DTensor``: its local shard), copied."""
    from torch.distributed.tensor import DTensor

    model = [t.to_local().clone() if isinstance(t, DTensor) else t.clone() for t in state["model"].state_dict().values()]
    moments = [t.to_local().clone() if isinstance(t, DTensor) else t.clone()
               for s in state["optimizer"].state_dict()["state"].values() for t in s.values()]
    return model + moments


def run(out: str, report: RankReport, snapshot: str, layout: str) -> None:
    report["lightning_importable"] = importlib.util.find_spec("lightning") is not None
    import torch

    if report["lightning_importable"]:
        from lightning.fabric import Fabric
    else:
        from lightning_fabric import Fabric

    from lightning_asyncckpt import (
        AsyncCheckpointIO,
        AsyncFabricModelParallelStrategy,
        FabricTiers,
        LocalTier,
        testing,
    )

    io = AsyncCheckpointIO("nvrx", snapshot=snapshot, local=LocalTier(os.path.join(out, "local"), every_n_train_steps=2,
                                                   replication_factor=1, timeout_s=60, emergency_signals=()))
    tp = 2 if layout == "tp" else 1
    strategy = AsyncFabricModelParallelStrategy(_tensor_parallel if tp > 1 else _fsdp2, data_parallel_size=2 // tp,
                                                tensor_parallel_size=tp, checkpoint_io=io)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    # 256 wide: each rank's shard of a weight or moment is 128 KiB, over the least a lazy snapshot defers
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    io.track_optimizers([optimizer])
    hold = io.copy_hook = testing.HoldCopy(timeout_s=60)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    tiers = FabricTiers(fabric)
    g = torch.Generator().manual_seed(fabric.global_rank)
    with io:
        while state["step"] < 6:
            loss = model(torch.randn(4, 256, generator=g)).pow(2).mean()
            optimizer.zero_grad()
            fabric.backward(loss)
            io.wait_for_snapshot()
            optimizer.step()
            state["step"] += 1
            tiers.step_end(state["step"], state)
            if state["step"] == 2 and snapshot == "lazy":  # the save's copy of the shards was left to a thread
                hold.wait_started(timeout_s=30)
                report["deferred"] = True
                hold.release()
        report["complete"] = tiers.tier.finish()
        saved = _local(state)
        with torch.no_grad():  # what a resume must overwrite
            for p in model.parameters():
                p.zero_()
            for moments in optimizer.state.values():
                for t in moments.values():
                    t.zero_()
        state["step"] = 0
        report["resumed"] = tiers.resume(state)
        report["step"] = state["step"]
        report["tensors"] = len(saved)
        report["exact"] = all(torch.equal(a, b) for a, b in zip(_local(state), saved))
        tiers.close()


if __name__ == "__main__":
    main()
