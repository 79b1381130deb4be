"""Where a checkpoint goes and how it gets there safely: the storage side, below the formats. Imported by the
trainer and the writer alike; no Lightning imports.

- ``destination``: :class:`Destination`, a local path or an fsspec URL (the one place that tells them apart):
  temp paths, publish, discard, existence.
- ``paths``: which checkpoint paths a save accepts, checked at the call that names them.
- ``remote``: fsspec URLs (object stores): streamed writes, ranged reads, ``last_checkpoint``.
- ``commit``: the atomic publish of a checkpoint file or directory, and the leftovers of interrupted saves.
- ``regular_files``: opening a checkpoint's own files (no links, no FIFOs), and :class:`CorruptCheckpointError`.
- ``private_dirs``: directories of our own in shared places (the spool in ``/tmp``), 0700, never through a link.
- ``read_once``: a checkpoint that every rank loads together, read once across them (each rank its share of the
  bytes, the rest exchanged through :mod:`~lightning_asyncckpt.collectives.shares`).
"""
