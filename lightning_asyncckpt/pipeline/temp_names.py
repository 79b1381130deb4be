"""The names of a run's hidden directories, and the leftovers of dead runs it removes before writing.

Every save is written into a hidden temporary path first and published by a rename (``storage.commit``).
The name carries the run's token, so that the sweep of leftovers at the start of a run never removes
what this run is writing; a collective save's directory has the same name on every rank (rank 0's token,
agreed at the first one, and a count every rank keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.pipeline.save import Save
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.storage.destination import Destination


class TempNames:
    """This rank's save counter (``order``), the run's token, and the directories already swept."""

    def __init__(self) -> None:
        self._token = commit.new_token()
        self._token_agreed = False  # collective saves write into rank 0's token's directories
        self._collective_count = 0
        self._order = 0  # saves scheduled on this rank
        self._swept: set[Path | str] = set()

    @property
    def order(self) -> int:
        """How many saves were scheduled on this rank: the order of the newest."""
        return self._order

    def sweep(self, rank: int, dirpath: Destination | None) -> None:
        """(writing ranks, as a save starts) Once per directory: for rank 0 the leftovers of dead saves in
        ``dirpath`` removed (the directory made if missing); a remote ``dirpath`` is checked instead (a
        missing bucket is an error here, at save time), and this node's spool swept of dead runs' parts."""
        if dirpath is None or dirpath.location in self._swept:
            return
        spool = dirpath.open_directory(rank, self._token)
        if spool is not None and spool not in self._swept:  # parts of dead runs' directory saves on this node
            commit.cleanup_leftovers(spool, keep_prefix=commit.tmp_for(spool / "x", self._token).name)
            self._swept.add(spool)
        self._swept.add(dirpath.location)

    def next_save(self, agreement: Agreement, save: Save, on_first_collective: Callable[[], None]) -> tuple[int, Path | str]:
        """(the saving ranks; every rank, same order, for a collective save) Counts the save and names the
        hidden path it is written into: per save for one writer; for a collective save the same on every
        rank. A remote file is written at its URL (invisible until complete: an object store has no
        rename); a remote directory into a local spool directory first, which its worker uploads.

        Returns:
            The save's order on this rank, and its hidden path.
        """
        self._order += 1
        if not save.collective:
            return self._order, save.destination.temp_path(f"{self._token}-{self._order}", save.writes_file)
        if not self._token_agreed:
            self._token = agreement.all_gather(self._token)[0]
            self._token_agreed = True
            on_first_collective()  # every rank is here (Fabric; the Trainer made its exit group at setup)
        self._collective_count += 1
        name = f"{self._token}-c{self._collective_count}"
        return self._order, save.destination.temp_path(name, save.writes_file, rank=agreement.rank)
