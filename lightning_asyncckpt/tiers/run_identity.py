"""Which run a local step belongs to: a local step is restored only by the run that wrote it.

A session directory (``LocalTier.root``) is shared by every run started with the same ``dir`` and
``session``, one after the other (:mod:`~lightning_asyncckpt.tiers.job_lock` refuses two at once). A run is
named by a **run id** (a random UUID, made by rank 0 when a run starts afresh and agreed on by every rank)
and its **persistent destination**: where its persistent checkpoints go (for the Trainer the dirpaths of its
``ModelCheckpoint`` callbacks, or ``default_root_dir`` without one; for Fabric the ``persistent`` path given
to ``FabricTiers.resume``). Every local step's manifest names its run id (:class:`~lightning_asyncckpt.tiers.
store.Held`), and every rank keeps a run record, ``<root>/holder-<rank>/run.record`` (0600, JSON), with the run id,
the destination and a generation (one more than the newest record any rank had when the run started).

When a run starts (:func:`begin`, every rank together, before its first local save or restore):

- **a fresh start** (no checkpoint to resume from: the Trainer's ``fit`` without ``ckpt_path``, a Fabric loop
  whose first local save comes before any ``resume``) makes a new run id: no local step written before it
  started is ever restored;
- **a resume** (``ckpt_path="last"``, a path, SLURM's ``hpc`` checkpoint; ``FabricTiers.resume``) adopts the
  run of the newest record any rank holds when that record's destination is this run's: a requeue of the
  same run resumes from its local steps (whatever its hosts and pids now), and so does a job whose node was
  replaced (that node's ranks have no record, their peers do; they take theirs). Any other record (another
  destination: another experiment in the same session) makes a new run id, so its steps are never used.

Each rank then writes its record and removes, from its own holder directory only, the shares of any other
run: they can never be restored by this run or a later one (the record now names this run), and they would
hold space that the tier's space check counts as this run's. They are the tier's own files in its own
session, which the running job holds exclusively; a step written before run ids existed names none and is
removed likewise (migration: the first resume after the upgrade uses the persistent tier).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_asyncckpt.tiers import store, trusted_dirs

log = logging.getLogger(__name__)

RECORD = "run.record"  # in each holder directory (JSON; not "*.json", the manifests' pattern)


@dataclass(frozen=True)
class RunRecord:
    """The run that a holder directory's shares belong to."""

    run: str  # the run id (a UUID's hex)
    destination: str  # where its persistent checkpoints go ("": none given)
    generation: int  # one more than the newest record any rank had when the run started


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose: this run's record, and the newest one found when that was another run's."""

    record: RunRecord
    adopted: bool  # the run resumes the run it found
    replaced: RunRecord | None  # the newest record of another run (its steps are not restored), if any


def destination_of(paths: str | os.PathLike | Iterable[str | os.PathLike | None] | None) -> str:
    """A persistent destination as recorded: each local path made absolute (URLs as given), sorted, one a line."""
    if paths is None:
        return ""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = {str(p) if "://" in str(p) else os.path.abspath(os.fspath(p)) for p in items if p is not None and str(p)}
    return "\n".join(sorted(out))


def read_record(holder: Path) -> RunRecord | None:
    """The run record of a holder directory, or None (none, or one that cannot be read or parsed)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        fd = os.open(Path(holder) / RECORD, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            raw = json.loads(f.read(65536))
        return RunRecord(str(raw["run"]), str(raw["destination"]), int(raw["generation"]))
    return None


def write_record(holder: Path, record: RunRecord) -> None:
    """Writes the run record of a holder directory (made 0700 if missing), atomically, 0600, never through a
    symlink."""
    holder = Path(holder)
    trusted_dirs.make(holder, holder.parent.parent.parent)  # 0700 whatever the umask, never through a link
    tmp = holder / (RECORD + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a crashed write's; unlink removes a link itself, never its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(json.dumps(asdict(record)).encode())
    os.replace(tmp, holder / RECORD)


def decide(records: list[RunRecord | None], destination: str, resuming: bool, fresh_id: str) -> Decision:
    """(pure; every rank, on the same gathered ``records``) This run's record: the newest record's run where
    ``resuming`` and its destination is ``destination``; else a new run ``fresh_id``."""
    known = [r for r in records if r is not None]
    newest = max(known, key=lambda r: (r.generation, r.run), default=None)
    if resuming and newest is not None and newest.destination == destination:
        return Decision(newest, True, None)
    generation = newest.generation + 1 if newest is not None else 1
    return Decision(RunRecord(fresh_id, destination, generation), False, newest)


def sweep(holder: Path, run: str) -> int:
    """(one rank, before any save or restore of run ``run``) Removes the shares of other runs from this
    rank's own holder directory, each manifest first (a share without one is never listed). Returns how many."""
    holder = Path(holder)
    if not holder.is_dir():
        return 0
    removed = 0
    for path in sorted(holder.iterdir()):
        held = store.read_manifest(path)
        if held is None or held.run == run:
            continue
        pt, head, manifest = store.share_files(holder, held)
        for p in (manifest, head, pt):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()  # our own names in our own directory; a link is removed, never followed
        removed += 1
    return removed


def begin(holder: Path, rank: int, gather: Callable[[object], list[object]], destination: str,
          resuming: bool) -> tuple[RunRecord, str | None]:
    """(every rank, together, once per run before its first local save or restore) Agrees on this run's
    record (module docstring), writes it to this rank's holder directory and removes other runs' shares
    there. Returns the record and, where this rank could not write or remove, why (for ``checks.agree``)."""
    rows = gather((read_record(holder), uuid.uuid4().hex if rank == 0 else None))
    decision = decide([r for r, _ in rows], destination, resuming, rows[0][1])
    record = decision.record
    try:
        if read_record(holder) != record:
            write_record(holder, record)
        removed = sweep(holder, record.run)
    except OSError as e:
        return record, f"the local tier cannot record its run in {holder} on global rank {rank}: {e}"
    if rank == 0:
        _explain(decision, resuming, removed)
    return record, None


def _explain(decision: Decision, resuming: bool, removed: int) -> None:
    """(rank 0) One log line where the run found another run's record: its local steps are not restored."""
    other = decision.replaced
    if decision.adopted or other is None:
        return
    if not resuming:
        why = "this run starts afresh (no checkpoint to resume from)"
    else:
        why = (f"they were written for the persistent destination {other.destination or '(none)'!r}, and this run's"
               f" is {decision.record.destination or '(none)'!r}")
    log.warning("lightning-asyncckpt: local tier: the local steps of the run before (%s) are not resumed from: %s;"
                " rank 0 removed %d of its shares (each rank removes its own)", other.run[:8], why, removed)
