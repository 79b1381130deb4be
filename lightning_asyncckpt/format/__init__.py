"""What a checkpoint is on storage, and where it may go. Imported by the trainer and the writer alike; no
Lightning imports.

- ``destination``: :class:`Destination`, a local path or an fsspec URL (the one place that tells them apart):
  temp paths, publish, discard, existence.
- ``paths``: which checkpoint paths a save accepts; ``remote``: fsspec URLs (object stores), ``last_checkpoint``.
- ``commit``: the atomic publish of a checkpoint directory, and the leftovers of interrupted saves.
- ``layout``: :class:`Layout`, which ranks write a save.
- ``dcp``: the DCP directory's file names, and reading one back; ``dcp_reader``: its items checked as they are
  read; ``metadata``: the one reader of ``.metadata`` (no code runs from it).
- ``read_once``: a ``torch.save`` file that every rank loads, read once across them (each rank its share).
- The integrity checks a load and ``verify`` share: ``integrity``, ``entries`` (``.metadata``'s entries),
  ``zip_records`` (a ``torch.save`` zip's records), ``regular_files`` (opening a checkpoint's own files).
"""
