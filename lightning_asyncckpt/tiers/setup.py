"""Making one run's local tier on every rank (:func:`open_tier`): its groups, the setup checks, the lock.

In this order, on every rank together (each step is collective, or agreed with :func:`checks.agree`, so
that every rank refuses alike):

1. the tier's process groups and clique layout (:mod:`~lightning_asyncckpt.tiers.tier_groups`);
2. the directory exists on every node, and the tier's own directories, where they exist, are this user's
   alone (:mod:`~lightning_asyncckpt.tiers.trusted_dirs`): before anything is written;
3. the cliques span nodes, and no two nodes share the directory;
4. the session's lock (:mod:`~lightning_asyncckpt.tiers.job_lock`), before any file of ours;
5. then the parts: the store, the writer, the step boundary, the saver, the restorer, the signals.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning_asyncckpt.collectives import StepAgreement
from lightning_asyncckpt.tiers import checks, huge_pages, job_lock
from lightning_asyncckpt.tiers.boundary import StepBoundary
from lightning_asyncckpt.tiers.config import LocalTier
from lightning_asyncckpt.tiers.preemption import PreemptionFlag
from lightning_asyncckpt.tiers.resuming import TierRestorer
from lightning_asyncckpt.tiers.saving import TierSaver
from lightning_asyncckpt.tiers.store import LocalStore, holder_dir
from lightning_asyncckpt.tiers.tier_groups import TierGroups, make_groups
from lightning_asyncckpt.tiers.tier_run import TierRun
from lightning_asyncckpt.tiers.writer import ShareWriter

log = logging.getLogger(__name__)


def open_tier(config: LocalTier, node_rank: int, local_world_size: int) -> TierRun:
    """(every rank, together, at setup, once the training's process group exists) The run's local tier,
    checked and locked (see the module docstring). Raises :class:`~lightning_asyncckpt.tiers.cliques.TierConfigError`
    or an ``OSError`` naming the directory on every rank alike where a check refuses.

    Args:
        config: the user's :class:`~lightning_asyncckpt.LocalTier`.
        node_rank: this process's node (``trainer.node_rank``, ``fabric.node_rank``).
        local_world_size: ranks per node: the default distance between the members of a clique.

    Returns:
        The tier, holding the session's lock until :meth:`TierRun.close`.
    """
    groups = make_groups(config, node_rank, local_world_size)
    rank, gather = groups.rank, groups.gather
    checks.agree(checks.directory(Path(config.dir), rank, node_rank), gather)
    # before anything is written: the tier's own directories, where they exist, are this user's alone
    own = [config.root.parent.name, config.root.name, holder_dir(config.root, rank).name]
    checks.agree(checks.trusted(Path(config.dir), own, rank, node_rank), gather)
    _log_setup(config, groups)
    checks.cliques_span_nodes(groups.cliques, groups.node_of, groups.jump)
    checks.not_shared(config.root, rank, groups.node_of, gather)
    leader = rank == groups.node_of.index(node_rank)  # the node's lowest rank locks for its ranks
    lock = job_lock.exclusive(config.root, leader, f"LocalTier(dir={str(config.dir)!r},"
                              f" session={config.session!r})", gather)  # before any file of ours
    try:
        return _assemble(config, groups, lock)
    except BaseException:
        lock.release()
        raise


def _assemble(config: LocalTier, groups: TierGroups, lock: job_lock.JobLock) -> TierRun:
    """(every rank) The tier's parts, wired to each other; nothing collective."""
    store = LocalStore(config.root, groups.rank, keep_free=len(groups.clique) if groups.factor > 1 else 1,
                       base=Path(config.dir))
    writer = ShareWriter(store, groups.rank, groups.clique_group, groups.topology, config.timeout_s)
    flag = PreemptionFlag(config.emergency_signals)  # armed by TierRun.arm(), once the loop runs
    agreement = StepAgreement(groups.group if groups.world > 1 else None, config.overlap_agreement)
    steps = StepBoundary(groups, agreement, flag, writer, store, config.root)
    saver = TierSaver(config, groups, store, writer, steps.raise_failed)
    restorer = TierRestorer(config, groups, store, writer, steps.restored)
    return TierRun(config, groups, store, writer, lock, flag, steps, saver, restorer)


def _log_setup(config: LocalTier, groups: TierGroups) -> None:
    if groups.rank != 0:
        return
    if config.replication_factor is None and groups.factor == 1:
        log.info("lightning-asyncckpt: the local tier keeps no replicas: this job runs on one node, so each rank"
                 " keeps its own share there (replication_factor=None is 1 on one node, 2 on several)")
    if line := huge_pages.hint(Path(config.dir)):
        log.info(line)  # a recovery is twice as fast on a tmpfs with huge pages (huge_pages' docstring)
