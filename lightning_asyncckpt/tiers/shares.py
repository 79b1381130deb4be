"""A checkpoint as this rank's share of it, and back.

- ``replicated`` (single device, DDP, Fabric DDP): every rank holds the same tensors, so each rank's share
  is a disjoint part of them (:func:`lightning_asyncckpt.snapshot.tree.partition`, balanced by bytes), plus
  the whole non-tensor state (the skeleton). Restoring gathers the parts back from their owners.
- ``sharded`` (FSDP2, tensor parallel): each rank's share is its own ``DTensor`` local shards and its own
  plain tensors, with what rebuilds each ``DTensor`` on the same mesh (:class:`LocalShard`).

A share holds the live tensors (no copies): :func:`lightning_asyncckpt.tiers.packing.pack` copies them
into its flat buffer before the training loop changes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from lightning_asyncckpt.snapshot import tree

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


def has_dtensors(checkpoint: Any) -> bool:
    from torch.distributed.tensor import DTensor

    found = []
    tree.walk(checkpoint, (), lambda p, t: found.append(isinstance(t, DTensor)) or t)
    return any(found)


def make(checkpoint: dict[str, Any], rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """(every rank, at a local save, on the training thread) This rank's share (its live tensors)."""
    if mode == SHARDED:
        return {"mode": SHARDED, "state": tree.walk(checkpoint, (), lambda p, t: _local(t))}
    skeleton, tensors = tree.split(checkpoint)
    owners = {name: r for r, part in enumerate(tree.partition(tensors, world_size)) for name in part}
    mine = {name: t for name, t in tensors.items() if owners[name] == rank}
    return {"mode": REPLICATED, "skeleton": skeleton, "owners": owners, "tensors": mine}


def _local(t: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    return LocalShard(t.to_local(), tuple(t.placements), mesh.mesh_dim_names,
                      tuple(mesh.mesh.flatten().tolist()), tuple(t.shape), tuple(t.stride()))


def assemble(share: dict[str, Any], group: dist.ProcessGroup | None) -> dict[str, Any]:
    """(all ranks of ``group``, together) The full replicated checkpoint from every rank's share: each
    owner broadcasts its tensors, packed into one buffer, in rank order. Every rank keeps its own skeleton."""
    skeleton, owners, mine = share["skeleton"], share["owners"], share["tensors"]
    names = _placeholder_names(skeleton)  # the skeleton's meta tensors carry each shape and dtype
    tensors: dict[str, torch.Tensor] = dict(mine)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    me = dist.get_rank(group) if world > 1 else 0
    for owner in range(world if world > 1 else 0):
        part = sorted(n for n in names if owners.get(n) == owner)
        if not part:
            continue
        sizes = [names[n].numel() * names[n].element_size() for n in part]
        if me == owner:
            buf = torch.cat([mine[n].contiguous().reshape(-1).view(torch.uint8) for n in part])
        else:
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(buf, src=dist.get_global_rank(group, owner) if group is not None else owner, group=group)
        if me != owner:
            offset = 0
            for n, size in zip(part, sizes):
                meta = names[n]
                # cloned before the view: a part's offset need not be aligned for its dtype
                tensors[n] = buf[offset:offset + size].clone().view(meta.dtype).reshape(meta.shape)
                offset += size
    return tree.join(skeleton, tensors)


def _placeholder_names(skeleton: Any) -> dict[str, torch.Tensor]:
    """Every placeholder of the skeleton by the name :func:`tree.split` gave its tensor."""
    namer, found = tree.FqnNamer(), {}

    def visit(path: tuple, t: torch.Tensor) -> torch.Tensor:
        found[namer(path)] = t
        return t

    tree.walk(skeleton, (), visit)
    return found


def rebuild(state: Any, meshes: dict[tuple, Any], device: torch.device) -> Any:
    """A sharded share's state with each :class:`LocalShard` made a ``DTensor`` again, on the mesh of the
    same dimension names and ranks in ``meshes`` (the model's own), its local shard on ``device``."""
    from torch.distributed.tensor import DTensor

    def put(path: tuple, shard: LocalShard) -> Any:
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
