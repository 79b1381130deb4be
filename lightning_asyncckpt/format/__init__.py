"""What a checkpoint is on storage, and where it may go: paths, the ``Destination`` (``destination``: a
local path or an fsspec URL, the one place that tells them apart), object stores, atomic publish and
leftovers, DCP metadata and loading, the layouts, and the integrity checks a load and ``verify`` share
(``integrity``, ``zip_records``, ``regular_files``, ``entries``). Imported by the trainer and the writer alike; no
Lightning imports.
"""
