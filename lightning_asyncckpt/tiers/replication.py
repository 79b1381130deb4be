"""Replication within a clique, NVRx's: a share travels as :class:`ShareStateDict`, an implementation of
NVRx's ``TensorAwareStateDict`` protocol (two ``uint8`` tensors, the packed share's header and flat
buffer, :mod:`lightning_asyncckpt.tiers.packing`, and plain metadata: step, owner, the two CRC32s), and
:func:`replicate` is NVRx's ``CliqueReplicationStrategy.replicate`` (every clique member ends with every
member's share: an all-gather of the hollow dicts, then one broadcast per member), on the CPU over the
clique's own gloo group. Used for sharded (FSDP2) states, whose shares differ from rank to rank; a
replicated state's replicas are copied locally (:mod:`lightning_asyncckpt.tiers.local_replicas`).

What arrives lands where the caller says (:class:`LandingGroup`): a replica's flat buffer straight in its
reserved mapped file. NVRx receives into fresh memory, which the writer then copied into that file: one
more copy of every replica, and a share's size of memory allocated, faulted in and freed at every save.

With :mod:`~lightning_asyncckpt.tiers.cliques` (its clique layout), the only module of the tier that
imports nvidia-resiliency-ext, and only when a local save replicates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict
from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

from lightning_asyncckpt import collectives
from lightning_asyncckpt.collectives import ProcessGroup

Land = Callable[[int, int, torch.Size, torch.dtype], torch.Tensor]
"""``land(owner, index, shape, dtype)``: the tensor that the ``index``-th tensor of ``owner``'s (global
rank) share is received into."""


class ShareStateDict(TensorAwareStateDict):
    """One rank's packed share at one step, as NVRx's replication moves it."""

    def __init__(self, step: int, owner: int, crc32: tuple[int, int], parts: list[torch.Tensor]) -> None:
        self.step, self.owner, self.crc32 = step, owner, crc32
        self._shapes = [tuple(p.shape) for p in parts]
        self._parts: list[torch.Tensor] | None = list(parts)

    def pop_tensors(self) -> list[torch.Tensor]:
        assert self._parts is not None, "pop_tensors on a hollow share"
        parts, self._parts = self._parts, None
        return parts

    @property
    def tensors(self) -> Iterable[torch.Tensor]:
        assert self._parts is not None, "tensors of a hollow share"
        return list(self._parts)

    @property
    def is_hollow(self) -> bool:
        return self._parts is None

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        self._parts = list(tensor_data)

    def init_tensors(self) -> None:
        self._parts = [torch.empty(s, dtype=torch.uint8) for s in self._shapes]

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Nothing to do: a packed share is on the CPU already."""

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Nothing to do: a packed share is on the CPU already."""


def head_tensor(head: bytes) -> torch.Tensor:
    """A header's bytes as a ``uint8`` tensor (what the exchange sends)."""
    return torch.frombuffer(bytearray(head), dtype=torch.uint8) if head else torch.empty(0, dtype=torch.uint8)


class LandingGroup(GroupWrapper):
    """NVRx's wrapper of the clique's group, receiving into tensors that ``land`` gives.

    ``all_gather_batch`` is the loop of NVRx's own (0.4.1 to 0.7.0 alike): the members' tensor shapes
    gathered, then each member broadcasts its tensors in turn. Only the receiving buffer differs: NVRx's
    is ``torch.empty`` of the placeholder's shape. ``land`` must not raise (a member that left the loop
    would leave its peers in a broadcast): where it cannot give a file, it gives memory and the caller
    reports the failure after the exchange.

    Its collectives, and those NVRx's strategy runs through it, go through
    :mod:`lightning_asyncckpt.collectives`, as NVRx's own wrapper runs them."""

    def __init__(self, group: ProcessGroup, land: Land) -> None:
        super().__init__(group)
        self.land = land

    def all_gather_object(self, my_obj: object) -> list:
        """(every member of the clique, same order) Every member's ``my_obj``, in group-rank order."""
        return collectives.all_gather_object(my_obj, self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """(every member of the clique, same order) Member ``src``'s (global rank) ``tensor`` into every member's."""
        collectives.broadcast(tensor, src, self.group)

    def all_gather_batch(self, my_tensors: list[torch.Tensor],
                         target_device: object = None) -> list[list[torch.Tensor]]:
        shapes = self.all_gather_object([(t.shape, t.dtype) for t in my_tensors])
        me = self.my_group_rank
        result = []
        for member, member_shapes in enumerate(shapes):
            owner = self.get_global_rank(member)
            received = []
            for i, (shape, dtype) in enumerate(member_shapes):
                tensor = my_tensors[i] if member == me else self.land(owner, i, shape, dtype)
                self.broadcast(tensor, src=owner)
                received.append(tensor)
            result.append(received)
        return result


def replicate(share: ShareStateDict, group: ProcessGroup, land: Land) -> list[ShareStateDict]:
    """(every member of the clique ``group``, together, in the writer thread) Every member's share, its
    peers' received into the tensors ``land`` gives (see :class:`LandingGroup`)."""
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    strategy = CliqueReplicationStrategy(LandingGroup(group, land), target_device="cpu")
    shares, _ids = strategy.replicate(share, (share.step, share.owner))
    return list(shares)
