"""A checkpoint as this rank's share of it, and back.

- ``replicated`` (single device, DDP, Fabric DDP): every rank holds the same tensors, so each rank's share
  is a disjoint part of them (:func:`lightning_asyncckpt.snapshot.tree.partition`, balanced by bytes), plus
  the whole non-tensor state (the skeleton). Restoring needs every owner's share on every rank.
- ``sharded`` (FSDP2, tensor parallel): each rank's share is its own ``DTensor`` local shards and its own
  plain tensors, with what rebuilds each ``DTensor`` on the same mesh (:class:`LocalShard`).

A share holds the live tensors (no copies): :func:`lightning_asyncckpt.tiers.packing.pack` copies them
into its flat buffer before the training loop changes them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from lightning_asyncckpt.snapshot import tree

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPLICATED, SHARDED = "replicated", "sharded"


@dataclasses.dataclass
class LocalShard:
    """A ``DTensor``'s local shard on this rank, and what rebuilds the ``DTensor`` on its mesh."""

    local: torch.Tensor
    placements: tuple
    mesh_dims: tuple | None
    mesh_ranks: tuple
    shape: tuple
    stride: tuple


def has_dtensors(checkpoint: object) -> bool:
    from torch.distributed.tensor import DTensor

    found = []
    tree.walk(checkpoint, (), lambda p, t: found.append(isinstance(t, DTensor)) or t)
    return any(found)


def make(checkpoint: dict[str, object], rank: int, world_size: int, mode: str) -> dict[str, object]:
    """(every rank, at a local save, on the training thread) This rank's share (its live tensors)."""
    return make_many(checkpoint, [rank], world_size, mode)[rank]


def make_many(checkpoint: dict[str, object], ranks: list[int], world_size: int, mode: str) -> dict[int, dict[str, object]]:
    """(every rank, at a local save, on the training thread) The shares of ``ranks`` (a replicated state:
    this rank holds its clique peers' parts too), the checkpoint split and partitioned once for all."""
    if mode == SHARDED:
        return {r: {"mode": SHARDED, "state": tree.walk(checkpoint, (), lambda p, t: _local(t))} for r in ranks}
    skeleton, tensors = tree.split(checkpoint)
    owners = {name: r for r, part in enumerate(tree.partition(tensors, world_size)) for name in part}
    return {r: {"mode": REPLICATED, "skeleton": skeleton, "owners": owners,
                "tensors": {name: t for name, t in tensors.items() if owners[name] == r}} for r in ranks}


def _local(t: torch.Tensor) -> torch.Tensor | LocalShard:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    return LocalShard(t.to_local(), tuple(t.placements), mesh.mesh_dim_names,
                      tuple(mesh.mesh.flatten().tolist()), tuple(t.shape), tuple(t.stride()))


def assemble(own: dict[str, object], every: list[dict[str, object]]) -> dict[str, object]:
    """The full replicated checkpoint from every owner's share: this rank's own skeleton (its non-tensor
    state) with every owner's tensors in place."""
    tensors: dict[str, torch.Tensor] = {}
    for share in every:
        tensors.update(share["tensors"])
    missing = sorted(set(_placeholder_names(own["skeleton"])) - set(tensors))
    if missing:
        raise RuntimeError(f"the local tier's shares lack {len(missing)} tensor(s), e.g. {missing[:3]}")
    return tree.join(own["skeleton"], tensors)


def _placeholder_names(skeleton: object) -> dict[str, torch.Tensor]:
    """Every placeholder of the skeleton by the name :func:`tree.split` gave its tensor."""
    namer, found = tree.FqnNamer(), {}

    def visit(path: tuple, t: torch.Tensor) -> torch.Tensor:
        found[namer(path)] = t
        return t

    tree.walk(skeleton, (), visit)
    return found


def meshes_of(module: torch.nn.Module) -> dict[tuple, DeviceMesh]:
    """The device meshes of ``module``'s ``DTensor`` parameters, by dimension names and ranks: what
    :func:`rebuild` puts each saved shard back on."""
    from torch.distributed.tensor import DTensor

    return {(p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.flatten().tolist())): p.device_mesh
            for p in module.parameters() if isinstance(p, DTensor)}


def rebuild(state: object, meshes: dict[tuple, DeviceMesh], device: torch.device) -> object:
    """A sharded share's state with each :class:`LocalShard` made a ``DTensor`` again, on the mesh of the
    same dimension names and ranks in ``meshes`` (the model's own), its local shard on ``device``."""
    from torch.distributed.tensor import DTensor

    def put(path: tuple, shard: LocalShard) -> torch.Tensor:
        mesh = meshes.get((shard.mesh_dims, shard.mesh_ranks))
        if mesh is None:
            raise RuntimeError(
                f"the local tier's share of {'.'.join(map(str, path))} was saved on the device mesh"
                f" {shard.mesh_dims} over ranks {list(shard.mesh_ranks)}, which this model does not have;"
                " resume from the persistent tier (it reshards)."
            )
        return DTensor.from_local(shard.local.to(device), mesh, shard.placements, run_check=False,
                                  shape=torch.Size(shard.shape), stride=shard.stride)

    return tree.walk(state, (), put, leaf=LocalShard)
