"""Refusing a local tier that cannot protect anything, at setup and before anything is written.

Each check runs on every rank and the ranks agree on the outcome, so that all of them raise the same
:class:`~lightning_asyncckpt.tiers.cliques.TierConfigError` (none is left waiting in a collective).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning_asyncckpt.tiers import trusted_dirs
from lightning_asyncckpt.tiers.cliques import TierConfigError, same_node_peers
from lightning_asyncckpt.units import human_bytes

log = logging.getLogger(__name__)

Gather = Callable[[object], list[object]]  # (all ranks) every rank's value, in rank order


def agree(problem: str | None, gather: Gather) -> None:
    """(all ranks) Raises on every rank if any rank found a problem, naming each rank's."""
    problems = [(r, p) for r, p in enumerate(gather(problem)) if p]
    if problems:
        raise TierConfigError("\n".join(p if len(problems) == 1 else f"rank {r}: {p}" for r, p in problems))


def directory(dir: Path, rank: int, node: int) -> str | None:
    """(one rank) Why ``dir`` cannot hold this rank's local checkpoints, or None."""
    where = f"on node {node} (global rank {rank})"
    if not dir.exists():
        return (f"LocalTier(dir={str(dir)!r}): the directory does not exist {where}. Fix: create it on every"
                " node before the job starts (e.g. `mkdir -p` in the job script), or give a node-local"
                " directory that exists there, such as a folder under /dev/shm or a local NVMe mount.")
    if not dir.is_dir():
        return f"LocalTier(dir={str(dir)!r}): not a directory {where}. Fix: give a node-local directory."
    if not os.access(dir, os.W_OK | os.X_OK):
        return f"LocalTier(dir={str(dir)!r}): not writable {where}. Fix: give a directory this job can write."
    return None


def trusted(dir: Path, parts: list[str], rank: int, node: int) -> str | None:
    """(one rank, at setup, before anything is written) Why ``dir`` or the tier's own directories below it
    (``parts``, in turn: ``asyncckpt-local``, the session, this rank's holder) cannot be trusted, or None:
    :mod:`lightning_asyncckpt.tiers.trusted_dirs`."""
    problem = trusted_dirs.base_problem(dir) or trusted_dirs.tier_problem(dir, parts)
    return f"LocalTier(dir={str(dir)!r}) on node {node} (global rank {rank}): {problem}" if problem else None


def not_shared(root: Path, rank: int, node_of: list[int], gather: Gather) -> None:
    """(all ranks) Refuses a directory that ranks of two nodes both see: each rank leaves a probe file,
    then looks for the probes of other nodes' ranks. Needs more than one node to mean anything."""
    if len(set(node_of)) < 2:
        return
    trusted_dirs.make(root, root.parent.parent)
    probe = root / f".probe-rank{rank}"
    probe.unlink(missing_ok=True)  # a crashed run's: O_EXCL below never opens an existing file (or link)
    os.close(trusted_dirs.open_file(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    gather(None)  # every rank's probe exists before anyone looks
    seen = []
    for p in root.glob(".probe-rank*"):
        with contextlib.suppress(ValueError, OSError):
            other = int(p.name.removeprefix(".probe-rank"))
            if node_of[other] != node_of[rank]:
                seen.append(other)
    gather(None)  # everyone has looked before anyone removes its probe
    probe.unlink(missing_ok=True)
    problem = None
    if seen:
        other = min(seen)
        problem = (f"LocalTier(dir={str(root.parent.parent)!r}) is shared between nodes: global rank {rank} on node"
                   f" {node_of[rank]} sees the files of rank {other} on node {node_of[other]}. The local tier"
                   " must be storage each node has for itself, or a lost node takes its replicas along."
                   " Fix: a node-local directory (/dev/shm, a local NVMe mount); a shared filesystem is the"
                   " persistent tier's (ModelCheckpoint's dirpath).")
    agree(problem, gather)


def cliques_span_nodes(cliques: list[list[int]], node_of: list[int], jump: int) -> None:
    """(all ranks, same inputs) Refuses cliques with two ranks on one node when the job has several nodes;
    on one node, warns that the replicas survive a lost process but not a lost node."""
    pairs = same_node_peers(cliques, node_of)
    if not pairs:
        return
    per_node = node_of.count(node_of[0])
    if len(set(node_of)) > 1:
        a, b, node = pairs[0]
        raise TierConfigError(
            f"LocalTier(replication_jump={jump}) puts ranks {a} and {b}, which hold each other's shares, on the"
            f" same node {node}: losing that node loses both copies. Fix: replication_jump={per_node} (the ranks"
            " per node, the default).")
    log.warning("lightning-asyncckpt: the local tier's replicas are on this job's only node: they survive a"
                " lost process, not a lost node.")


def space(dir: Path, rank: int, node_of: list[int], share_bytes: int, held_bytes: int, factor: int,
          gather: Gather, head_bytes: int = 0) -> None:
    """(all ranks, at the first local save, before anything is written) Refuses a node whose directory
    cannot hold what its ranks will keep at the peak: the newest complete step and the one being written,
    ``factor`` copies of each share (its own and its replicas), each its tensors' file, its header
    (``head_bytes``) and its manifest: ``2 x factor x share`` per rank, each file in whole pages."""
    free = shutil.disk_usage(dir).free
    files = _pages(share_bytes) + _pages(head_bytes) + _pages(1)  # the .pt, .head and .json
    need = 2 * factor * files - held_bytes  # what this rank holds now is replaced, not added to
    rows = gather((node_of[rank], free, need, share_bytes))
    node, _, _, _ = rows[rank]
    mine = [(r, row) for r, row in enumerate(rows) if row[0] == node]
    total = sum(max(row[2], 0) for _, row in mine)
    problem = None
    if total > free and rank == min(r for r, _ in mine):
        shares_txt = ", ".join(f"rank {r}: {human_bytes(row[3])}" for r, row in mine)
        problem = (f"LocalTier(dir={str(dir)!r}) on node {node} has {human_bytes(free)} free, but its"
                   f" {len(mine)} rank(s) need {human_bytes(total)}: each keeps its newest complete step while it"
                   f" writes the next, {factor} cop{'y' if factor == 1 else 'ies'} of its share each (its own"
                   f" and {factor - 1} replica(s)), 2 x {factor} x share (its tensors, header and manifest, in whole"
                   f" pages); tensors: {shares_txt}. Fix: a larger"
                   " directory (a bigger /dev/shm: `docker run --shm-size=...`, a Kubernetes emptyDir with"
                   " medium: Memory and a sizeLimit, or tmpfs size=), a local NVMe mount, or a smaller"
                   " replication_factor. Nothing was written.")
    agree(problem, gather)


def _pages(n: int, page: int = 4096) -> int:
    """``n`` bytes as a file takes them (on tmpfs and most file systems: whole pages)."""
    return -(-n // page) * page
