"""The sharded (FSDP2-like) state of ``bench_tiers.py --layout sharded``.

Every rank holds its own quarter of the state, as ``DTensor`` shards (``Shard(0)`` on a 1-D mesh of the
ranks), as ``fully_shard`` leaves a model and its Adam moments. The local tier then saves each rank's own
shards (its sharded mode; the replicas travel through NVRx's clique exchange). The persistent tier writes a
DCP directory from every rank (``AsyncCheckpointIO.save_checkpoint_sharded``, as ``AsyncModelParallelStrategy``
does) and is recovered with ``torch.distributed.checkpoint.load`` into the model's ``DTensor`` s, which is
how Lightning's ``ModelParallelStrategy`` loads one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def make_state(nbytes: int, layers: int, rank: int, world: int) -> dict[str, Any]:
    """A Lightning-like sharded checkpoint of ``nbytes`` in all (``nbytes / world`` on this rank)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    numel = max(1, nbytes // (3 * layers * 4 * world))  # this rank's shard of each tensor
    gen = torch.Generator().manual_seed(rank)  # each rank its own values: its own shard

    def rand() -> Any:
        return DTensor.from_local(torch.rand(numel, generator=gen), mesh, [Shard(0)], run_check=False)

    return {
        "state_dict": {f"layers.{i}.weight": rand() for i in range(layers)},
        "optimizer_0": {
            "state": {f"layers.{i}.weight": {"exp_avg": rand(), "exp_avg_sq": rand()} for i in range(layers)},
            "param_groups": [{"params": [f"layers.{i}.weight" for i in range(layers)], "lr": 1e-3}],
        },
        "epoch": 0,
        "global_step": 0,
    }


def split(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``save_checkpoint_sharded`` takes: the sharded part, and the rest (``meta.pt``)."""
    sharded = {k: v for k, v in state.items() if k in ("state_dict", "optimizer_0")}
    return sharded, {k: v for k, v in state.items() if k not in sharded}


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """The model's and optimizer's ``DTensor`` s that a recovery loads into (allocated and touched)."""
    import torch
    from torch.distributed.tensor import DTensor

    def walk(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return DTensor.from_local(torch.zeros_like(obj.to_local()), obj.device_mesh, obj.placements,
                                      run_check=False)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(split(state)[0])


def load_persistent(path: Path, into: dict[str, Any]) -> None:
    """(every rank) The DCP directory's shards of this rank, read into ``into`` (``zeros_like``) in place."""
    import torch.distributed.checkpoint as dcp

    dcp.load(into, checkpoint_id=str(path))
