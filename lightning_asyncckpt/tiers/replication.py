"""Replication within a clique, NVRx's: a share travels as :class:`ShareStateDict`, an implementation of
NVRx's ``TensorAwareStateDict`` protocol (two ``uint8`` tensors, the packed share's header and flat
buffer, :mod:`lightning_asyncckpt.tiers.packing`, and plain metadata: step, owner, the two CRC32s), and
:func:`replicate` is NVRx's ``CliqueReplicationStrategy.replicate`` (every clique member ends with every
member's share: an all-gather of the hollow dicts, then one broadcast per member), on the CPU over the
clique's own gloo group. Used for sharded (FSDP2) states, whose shares differ from rank to rank; a
replicated state's replicas are copied locally (:mod:`lightning_asyncckpt.tiers.local_replicas`).

The only module of the tier that imports nvidia-resiliency-ext, and only when a local save replicates.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict


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


def replicate(share: ShareStateDict, group: dist.ProcessGroup) -> list[ShareStateDict]:
    """(every member of the clique ``group``, together, in the writer thread) Every member's share."""
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    shares, _ids = CliqueReplicationStrategy(group, target_device="cpu").replicate(share, (share.step, share.owner))
    return list(shares)
