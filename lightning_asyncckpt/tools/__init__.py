"""Reading checkpoints back for people: ``inspect``, ``verify``, ``convert`` and ``clean`` as library
code, and the command line that only parses and prints.

- ``cli``: the ``lightning-asyncckpt`` command; ``usage``: what its commands share (exit statuses, errors).
- ``describe``: what a checkpoint holds (``inspect``); ``verify``: every item checked; ``items``: single
  items of a DCP directory read without DCP's planner.
- ``cleanup``: the commands that remove files (``clean``, ``local``); ``local_command``: a node's local-tier files (the ``local`` command).
"""
