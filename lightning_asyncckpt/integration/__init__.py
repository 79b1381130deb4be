"""The faces Lightning and Fabric call; the only subpackage that imports Lightning.

- ``io``: :class:`AsyncCheckpointIO`, Lightning's ``CheckpointIO``; it holds a
  :class:`~lightning_asyncckpt.pipeline.pipeline.SaveSession` (``io.session``).
- ``contract``: the one interface through which the parts below reach the session
  (:class:`SessionInterface`), and what a strategy can do (:class:`StrategyCapabilities`).
- ``callback``: :class:`AsyncFinalizerCallback`, which finalizes at the right hooks on every rank.
- ``strategies``: :class:`AsyncDDPStrategy` and :class:`AsyncModelParallelStrategy`; ``fabric``: Fabric's sharded
  strategy.
- ``autoattach``: the finalizer and the resume wrappers for each Trainer made with the plugin, nothing for any
  other; ``patches``: every change made to Lightning's own objects, made and undone in one place.
- ``tier_trainer``, ``tier_step_end``, ``tier_resume``: the local tier in the Trainer (setup, the step end after
  every other callback, ``ckpt_path="last"``); ``tier_fabric``, ``tier_fabric_load``: in a Fabric loop;
  ``replaced_handlers``: the signal handlers the tier replaced.
- ``resume``: ``ckpt_path="last"`` on object stores; ``loading``: reading a checkpoint back;
  ``map_location``: the ``map_location`` of a ``torch.save`` file with tensor subclasses.
- ``logger_relay``: a logger hears of a checkpoint once it is committed; ``logsetup``: the package's log lines.
- ``lightning_api``: which Lightning this process uses, and every Lightning class the package builds on;
  ``versions``: the supported versions, checked when ``AsyncCheckpointIO`` is made.
"""
