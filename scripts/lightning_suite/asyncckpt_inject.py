"""pytest plugin: run Lightning's own test suite with lightning_asyncckpt's AsyncCheckpointIO as a drop-in.

Load with ``-p asyncckpt_inject`` (this folder on PYTHONPATH). The mode comes from the environment variable
``ASYNCCKPT_SUITE_MODE``:

- ``plugin`` (default): every ``lightning.pytorch.Trainer(...)`` whose ``plugins`` hold no ``CheckpointIO`` and
  whose ``strategy`` is not a ``Strategy`` object that already has its own ``checkpoint_io`` gets
  ``lightning_asyncckpt.AsyncCheckpointIO()`` appended to ``plugins``; such a Trainer gets
  ``AsyncFinalizerCallback`` as any Trainer made with the plugin does (``integration/autoattach.py``).
- ``callback``: nothing is injected. The package no longer adds anything to a Trainer without the plugin, so
  this is stock Lightning too (kept for comparison with earlier runs).
- ``stock``: nothing is injected and an earlier install's ``callbacks_factory`` entry point, if the venv still
  has one, is hidden from Lightning, so Trainers are exactly stock Lightning.

Every ``lightning.fabric.Fabric(...)`` is handled the same way in ``plugin`` mode, unless its strategy is one
that refuses a ``CheckpointIO`` (FSDP, ``ModelParallelStrategy``, DeepSpeed, XLA; a user cannot add the plugin
there either).

Each Trainer construction is logged (test id, mode, injected or why not, and the checkpoint IO the strategy
ended up with) to ``$ASYNCCKPT_SUITE_LOG`` if set.
"""

from __future__ import annotations

import functools
import os

import pytest

MODE = os.environ.get("ASYNCCKPT_SUITE_MODE", "plugin")
if MODE not in ("plugin", "callback", "stock"):
    raise ValueError(f"ASYNCCKPT_SUITE_MODE={MODE!r}: use plugin, callback or stock")

_current_test = "<no test>"
_log: list[str] = []


def _hide_entry_point() -> None:
    """Hide lightning_asyncckpt's ``lightning.pytorch.callbacks_factory`` entry point from Lightning."""
    import lightning.fabric.utilities.registry as registry

    orig = registry.entry_points

    @functools.wraps(orig)
    def entry_points(*args, **kwargs):
        eps = orig(*args, **kwargs)
        if kwargs.get("group") == "lightning.pytorch.callbacks_factory":
            return [ep for ep in eps if not ep.value.startswith("lightning_asyncckpt")]
        return eps

    registry.entry_points = entry_points


def _inject(kwargs: dict, refusing: tuple) -> tuple:
    """In ``plugin`` mode, appends ``AsyncCheckpointIO()`` to a Trainer's or Fabric's ``plugins`` (in
    ``kwargs``) unless the user gave a ``CheckpointIO``, the strategy object has its own, or the strategy's
    name contains one of ``refusing``. Returns the plugin (or None) and why."""
    from lightning.fabric.plugins import CheckpointIO

    if MODE != "plugin":
        return None, f"mode={MODE}"
    plugins = kwargs.get("plugins")
    plugin_list = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    strategy = kwargs.get("strategy", "auto")
    name = (strategy if isinstance(strategy, str) else type(strategy).__name__).lower()
    if any(isinstance(p, CheckpointIO) for p in plugin_list):
        return None, "user CheckpointIO in plugins"
    if any(k in name for k in refusing):
        return None, f"strategy {name} refuses a CheckpointIO"
    if not isinstance(strategy, str) and getattr(strategy, "_checkpoint_io", None) is not None:
        return None, f"strategy {type(strategy).__name__} has its own checkpoint_io"
    from lightning_asyncckpt import AsyncCheckpointIO

    ours = AsyncCheckpointIO()
    kwargs["plugins"] = plugin_list + [ours]
    return ours, "injected"


def _wrap_trainer_init() -> None:
    from lightning.pytorch import Trainer

    orig_init = Trainer.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        ours, reason = _inject(kwargs, refusing=())
        try:
            orig_init(self, *args, **kwargs)
        finally:
            try:
                io = getattr(self.strategy, "_checkpoint_io", None)
                io_name = type(io).__name__ if io is not None else "None(default TorchCheckpointIO)"
                effective = "effective" if ours is not None and io is ours else ""
            except Exception as ex:  # Trainer.__init__ failed early
                io_name, effective = f"<{type(ex).__name__}>", ""
            _log.append(f"{_current_test}\t{reason}\t{io_name}\t{effective}")

    Trainer.__init__ = __init__


_REFUSING = ("fsdp", "deepspeed", "xla", "model_parallel", "modelparallel")


def _wrap_fabric_init() -> None:
    from lightning.fabric import Fabric

    orig_init = Fabric.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        ours, reason = _inject(kwargs, refusing=_REFUSING)
        try:
            orig_init(self, *args, **kwargs)
        finally:
            _log.append(f"{_current_test}\tfabric {reason}\t{'ours' if ours is not None else ''}")

    Fabric.__init__ = __init__


def pytest_configure(config: pytest.Config) -> None:
    if MODE == "stock":
        _hide_entry_point()
    _wrap_trainer_init()
    _wrap_fabric_init()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current_test
    _current_test = item.nodeid
    try:
        return (yield)
    finally:
        _current_test = "<between tests>"


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("ASYNCCKPT_SUITE_LOG")
    if path:
        with open(path, "w") as f:
            f.write("\n".join(_log) + ("\n" if _log else ""))
