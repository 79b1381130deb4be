"""The one owner of cross-rank collectives: every collective the package runs itself goes through here.

Each operation says in its docstring which ranks call it ("all ranks of <group>, same order") and what bounds
its wait. The persistent pipeline agrees over the training's group (or a gloo exit group with a bound); the
local tier over gloo groups of its own, made with ``LocalTier.timeout_s`` as their bound, so that a rank
that is gone fails a wait instead of hanging it. Without a process group every operation is local.

- ``groups``: whether a process group exists, this rank and the world size, the device of control tensors,
  and the gloo groups with a bound (the tier's group, its cliques', the exit group).
- ``agreement``: maxima and minima of a few integers in one all-reduce (:func:`max_min`: the one place that
  negates into a maximum), and :class:`Agreement`, the persistent pipeline's.
- ``rounds``: :class:`StepAgreement`, the local tier's round at every step boundary (optionally overlapped).
- ``objects``: small Python objects gathered from every rank (:func:`gather_objects`, in one collective).
- ``transfer``: tensors point to point, and broadcast from one member.
- ``shares``: a file read once across the ranks: agreeing on it, then every rank's share gathered in
  fixed-size chunks (a read-once resume).
- ``planning``: DCP's plan gather and scatter (imported on its own: it loads ``torch.distributed.checkpoint``).

Other modules may name ``torch.distributed``'s types, and call DCP's and NVRx's own APIs (which run their own
collectives: ``dcp.save``, NVRx's replication strategy, whose group calls are routed here); they run no
collective of ``torch.distributed`` themselves.
"""

from lightning_asyncckpt.collectives.agreement import Agreed, Agreement, AllMax, max_min
from lightning_asyncckpt.collectives.groups import (
    ProcessGroup,
    bounded_group,
    bounded_groups,
    control_device,
    group_alive,
    group_ranks,
    is_distributed,
    rank,
    world_size,
)
from lightning_asyncckpt.collectives.objects import SLOT, all_gather_object, gather_objects, slot_for
from lightning_asyncckpt.collectives.rounds import StepAgreement
from lightning_asyncckpt.collectives.transfer import Work, broadcast, irecv, isend, recv, send

__all__ = [
    "SLOT",
    "Agreed",
    "Agreement",
    "AllMax",
    "ProcessGroup",
    "StepAgreement",
    "Work",
    "all_gather_object",
    "bounded_group",
    "bounded_groups",
    "broadcast",
    "control_device",
    "gather_objects",
    "group_alive",
    "group_ranks",
    "irecv",
    "is_distributed",
    "isend",
    "max_min",
    "rank",
    "recv",
    "send",
    "slot_for",
    "world_size",
]
