"""What a job (a process a test starts, see ``processes.launch``) reports back to its test: one typed
:class:`RankReport` per rank, written by :func:`reported` (the only writer: temp file, then ``os.replace``,
so that a test polling for a report while it kills a node never reads half of one) and read with
:func:`read_report`. Both sides import this module: the job scripts under ``jobs/`` and the tests.

Standard library only: the jobs that run in the ``pytorch_lightning``-alone environment (``.venv-pl``)
import it too, and nothing of the test helpers (those import ``lightning``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class RankReport:
    """What one rank of a job saw.

    Attributes:
        rank: the rank's global rank (``LOCAL_RANK`` for one-node jobs).
        world_size: the size of the rank's process group at its end (``None``: no group was made).
        crash: the traceback of what the job's body raised (``None``: it ran to its end).
        seen: the case's own observations, by name; ``report["files"]`` reads and writes them.
    """

    rank: int
    world_size: int | None = None
    crash: str | None = None
    seen: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.seen[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.seen[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.seen

    def get(self, name: str, default: Any = None) -> Any:
        return self.seen.get(name, default)

    def setdefault(self, name: str, default: Any) -> Any:
        return self.seen.setdefault(name, default)

    def write(self, path: str | os.PathLike) -> None:
        """Writes the report to ``path`` whole: a temp file beside it, then a rename; a write that fails
        leaves ``path`` as it was and no temp file (values JSON cannot hold are written as their ``str``)."""
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(self), f, indent=1, default=str)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def report_path(out: str | os.PathLike, rank: int, prefix: str = "rank") -> Path:
    """Where rank ``rank`` of a job writes its report: ``<out>/<prefix><rank>.json``."""
    return Path(out) / f"{prefix}{rank}.json"


def read_report(path: str | os.PathLike) -> RankReport:
    """The report a job wrote to ``path``."""
    return RankReport(**json.loads(Path(path).read_text()))


def reported(rank: int, path: str | os.PathLike, body: Callable[[RankReport], None],
             world_size: Callable[[], int | None] = lambda: None, report: RankReport | None = None) -> RankReport:
    """(each rank of a job) Runs ``body(report)``, then writes the report to ``path`` (:meth:`RankReport.write`)
    with ``world_size()`` and the traceback as ``crash`` if ``body`` raised: the test fails with it.

    Args:
        rank: this rank's number, as the test reads it back.
        path: the report's file (:func:`report_path`).
        body: the job's case; it records what it saw into the report.
        world_size: called after ``body``: the size of the rank's process group then, if any.
        report: a report to start from (values set before ``body``), else an empty one.

    Returns:
        The report written."""
    report = report or RankReport(rank=rank)
    try:
        body(report)
    except BaseException as e:  # noqa: BLE001 - the report carries it to the test
        report.crash = "".join(traceback.format_exception(e))
    report.world_size = world_size()
    report.write(path)
    return report


def run_reported(run: Callable[[argparse.Namespace, RankReport], None], cases: list[str] | None = None) -> None:
    """The ``main`` of a job that imports nothing of the test helpers (the ``.venv-pl`` ones): parses ``--out``
    (and ``--case``, one of ``cases``, where given), then :func:`reported` writes ``run(args, report)``'s
    report to ``<out>/rank<LOCAL_RANK>.json``."""
    ap = argparse.ArgumentParser()
    if cases:
        ap.add_argument("--case", choices=cases, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    reported(rank, report_path(args.out, rank), lambda report: run(args, report))
