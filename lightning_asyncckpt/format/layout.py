"""``Layout``: which ranks write a save, and so who commits it."""

from __future__ import annotations

import enum


class Layout(str, enum.Enum):
    """How a save is laid out over the ranks.

    - ``SINGLE_WRITER``: one rank (global rank 0 under DDP) writes the whole checkpoint dict and commits
      it alone, without collectives (Lightning calls the plugin on that rank only).
    - ``DISTRIBUTED``: the state is replicated; every rank writes a disjoint share of it
      (``AsyncDDPStrategy``). The ranks commit it together.
    - ``SHARDED``: every rank writes its own shards in Lightning's ``ModelParallelStrategy`` layout
      (FSDP2, tensor parallel). The ranks commit it together.
    """

    SINGLE_WRITER = "single-writer"
    DISTRIBUTED = "distributed"
    SHARDED = "sharded"

    def all_ranks_write(self, distributed: bool) -> bool:
        """Whether every rank writes a part (and the ranks commit together): only when a process group
        with more than one rank is up, since alone a rank is its own coordinator."""
        return distributed and self is not Layout.SINGLE_WRITER
