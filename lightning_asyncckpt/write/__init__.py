"""What runs inside the writer process. Nothing here imports Lightning, so that a worker starts quickly.

- ``worker``: the process's entry points, its CPU priority, its report of a write's outcome.
- ``jobs``: the typed job the trainer hands the writer for one save.
- ``torch_file``: the ``torch.save`` file job; ``file_layout``: the file made stock's file for the staged copies.
- ``dcp_writer``: the job that writes this rank's part of a DCP directory; ``shard_file``: a shard with its CRC32s.
- ``fast_file``: the fast or plain file writes behind one interface: ``direct_io`` (aligned ``O_DIRECT``
  writes) and ``zip_crc`` (each zip record's CRC32).
- ``gate``: the gate of a write handed over before its lazy copy; ``parent_watch``: a writer ends itself once
  its trainer is gone.
"""
