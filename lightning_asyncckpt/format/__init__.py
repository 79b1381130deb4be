"""What a checkpoint is on storage: its formats and their integrity. Imported by the trainer and the writer
alike; no Lightning imports. Where it goes and how it is published safely is :mod:`lightning_asyncckpt.storage`.

- ``layout``: :class:`Layout`, which ranks write a save.
- ``dcp``: the DCP directory's file names, and reading one back; ``dcp_reader``: its items checked as they are
  read; ``metadata``: the one reader of ``.metadata`` (no code runs from it).
- The integrity checks a load and ``verify`` share: ``integrity``, ``entries`` (``.metadata``'s entries),
  ``zip_records`` (a ``torch.save`` zip's records).
"""
