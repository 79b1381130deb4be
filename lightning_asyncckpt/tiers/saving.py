"""The local tier's save: a checkpoint's shares copied into mapped node-local files, then handed to the writer.

:class:`TierSaver` copies this rank's share (and, for a replicated state, its clique peers' shares, which
it holds too) into files reserved in its holder directory (:mod:`~lightning_asyncckpt.tiers.store`); the
writer's thread (:mod:`~lightning_asyncckpt.tiers.writer`) then settles the replicas and commits. A save
that fails on any rank is raised on every rank at the next step boundary
(:mod:`~lightning_asyncckpt.tiers.boundary`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_asyncckpt.snapshot.lazy import BackgroundCopy
from lightning_asyncckpt.tiers import checks, packing, pinning, shares
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.hook import Checkpoint, CopyHook, LazyRule
from lightning_asyncckpt.tiers.mapped import MappedFile
from lightning_asyncckpt.tiers.store import LocalStore
from lightning_asyncckpt.tiers.tier_groups import TierGroups
from lightning_asyncckpt.tiers.writer import Copied, ShareWriter

# each share's layout and its tensors, by the rank that owns the share
Laid = dict[int, tuple[packing.Layout, dict[str, torch.Tensor]]]


class TierSaver:
    """(every rank, at the same step boundaries) One rank's local saves."""

    def __init__(self, config: LocalTier, groups: TierGroups, store: LocalStore, writer: ShareWriter,
                 raise_failed: Callable[[], None]) -> None:
        self.config, self.groups, self.store, self.writer = config, groups, store, writer
        self._raise_failed = raise_failed  # the step boundary's: a failed earlier save, raised before a new one
        self.saved_step = -1  # the step of the newest local save begun (-1: none)
        self.last_stall_s: float | None = None  # how long the newest save held the training loop
        self._space_checked = False
        self._prepared = False
        self._copy: BackgroundCopy | None = None  # a lazy save's copy, until wait_copy

    def save(self, step: int, checkpoint: Checkpoint, lazy: LazyRule = None, hook: CopyHook = None) -> None:
        """(every rank, at the same step boundaries) Copies this rank's share of ``checkpoint`` (a DTensor
        state: its local shards; a replicated one: its part, and its clique peers' parts, which it holds
        too) into mapped files of its holder directory, then a thread checks the replicas and commits. Waits
        for the previous local save's thread first (at most ``timeout_s``). A file that cannot be reserved
        (a full directory) fails this save on every rank at the next boundary, as a failed write.

        ``lazy`` (a lazy snapshot's rule, ``AsyncCheckpointIO.session.lazy_rule()``): the tensors it watches (the
        optimizers' parameters and state) are copied into the files by a background copy while the next
        step's forward and backward run; :meth:`wait_copy` waits for it before the optimizer step. One
        changed in place before its copy fails this save (nothing of it is committed), on every rank at the
        next boundary. ``hook``: the copy thread calls it first (tests: ``testing.HoldCopy``)."""
        start = time.perf_counter()
        if not self.writer.wait(self.config.timeout_s):
            raise TimeoutError(f"lightning-asyncckpt: the local save of step {self.saved_step} is still running"
                               f" after timeout_s={self.config.timeout_s}")
        self._raise_failed()
        mode, laid = self._layouts(checkpoint)
        rank = self.groups.rank
        head = laid[rank][0].header()  # this rank's; made once: also counted by the space check
        self._check_space(laid, len(head))
        self._pin_for(laid)
        copied, failure, deferred = [], None, []
        for owner, (lay, tensors) in laid.items():
            try:
                file = self.store.reserve(step, owner, lay.nbytes)
            except OSError as e:  # a full directory: this rank still takes part in the clique's exchange (its
                # peers would wait for it), from memory, and its thread reports the failure after
                failure = failure or f"local save of step {step}: {type(e).__name__}: {e}"
                file = MappedFile(None, lay.nbytes, torch.empty(lay.nbytes, dtype=torch.uint8))
            # the one copy, straight into node-local storage (of what a lazy rule leaves: the rest, later)
            deferred += packing.copy_into(lay, tensors, file.tensor, lazy)
            copied.append(Copied(owner, head if owner == rank else b"", file))
        self._copy = BackgroundCopy(deferred, hook=hook) if deferred else None  # their versions: read now
        self.writer.submit(step, mode, copied, failure, self._copy)
        self.saved_step = step
        self.last_stall_s = time.perf_counter() - start

    def wait_copy(self) -> None:
        """(every rank, right before the optimizer changes the state) Waits for a lazy save's background copy
        (at most ``timeout_s``); a problem with it is the writer thread's to report, at the next boundary."""
        if self._copy is not None:
            self._copy.wait(self.config.timeout_s)
            self._copy = None

    @property
    def wants_files(self) -> bool:
        """True until the first local save or :meth:`prepare`: the first save's files are not made yet."""
        return self.saved_step < 0 and not self._prepared

    def prepare(self, like: Checkpoint) -> None:
        """(every rank, at a step boundary before the first local save, once the optimizer has its state)
        Makes the first save's files in the background thread, sized for ``like`` (the checkpoint, or its
        model and optimizer states: a file a few bytes off is resized at the save, keeping its pages), so
        that the first save copies into ready files as every later one does. The save checks the space."""
        if not self.wants_files or self.writer.busy:  # busy: replicas sent after a restore; next boundary
            return
        _mode, laid = self._layouts(like)
        self._pin_for(laid)
        self.writer.make_ahead([lay.nbytes for lay, _ in laid.values()])
        self._prepared = True

    def _layouts(self, checkpoint: Checkpoint) -> tuple[str, Laid]:
        """The mode, and each share's layout and tensors by owner: this rank's, and with a replicated
        state and replication its clique peers' too (it holds their replicas)."""
        g = self.groups
        mode = shares.SHARDED if shares.has_dtensors(checkpoint) else shares.REPLICATED
        owners = g.clique if mode == shares.REPLICATED and g.clique_group is not None else [g.rank]
        made = shares.make_many(checkpoint, owners, g.world, mode)
        return mode, {o: packing.layout(share) for o, share in made.items()}

    def _pin_for(self, laid: Laid) -> None:
        """A GPU state: the pool's files are registered with CUDA, so that the save's copy runs at pinned speed."""
        device = pinning.cuda_device(laid[self.groups.rank][1])
        if device is not None:
            self.store.pool.pin_for(device)

    def _check_space(self, laid: Laid, head_bytes: int) -> None:
        """(every rank, together, at the first save) Refuses a directory too small for the shares, their
        headers (``head_bytes``: this rank's) and manifests (collective)."""
        if not self._space_checked:
            g = self.groups
            checks.space(Path(self.config.dir), g.rank, g.node_of, laid[g.rank][0].nbytes,
                         self.store.used_bytes(), g.factor, g.gather, head_bytes=head_bytes)
            self._space_checked = True
