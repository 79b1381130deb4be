"""The finalizer in every Trainer, also where the package's entry point is not installed.

Installing the package registers ``AsyncFinalizerCallback`` with every ``Trainer`` through Lightning's
``callbacks_factory`` entry point. Code run from a source checkout (``PYTHONPATH``), or vendored into a job,
has no entry point: without the callback nothing finalizes at step ends, and nothing drives the local tier,
which then saved nothing, silently (found on a GPU machine where the checkout was on ``PYTHONPATH``). So
every ``AsyncCheckpointIO`` makes sure, once per process, that a Trainer made after it gets the callback as
the entry point would give it: inert unless that Trainer uses the plugin and has no finalizer of its own.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

from lightning_asyncckpt.integration import patches
from lightning_asyncckpt.integration.lightning_api import trainer_module

# The package's callbacks_factory entry point, as pyproject.toml declares it: loaded here as Lightning loads it
ENTRY_POINT = "lightning_asyncckpt.integration.callback:external_callbacks"


def install() -> None:
    """(any process, idempotent; ``AsyncCheckpointIO.__init__``) Wraps ``_CallbackConnector.on_trainer_init``
    to give a Trainer the entry point's callbacks where it has none of their kind after it ran."""
    connector = trainer_module("trainer.connectors.callback_connector")._CallbackConnector

    def make(original: Any) -> Any:
        def on_trainer_init(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            group = f"{trainer_module().__name__}.callbacks_factory"
            made = EntryPoint("lightning_asyncckpt", ENTRY_POINT, group).load()()
            if not any(isinstance(cb, type(m)) for cb in self.trainer.callbacks for m in made):
                self.trainer.callbacks.extend(made)
            return out

        return on_trainer_init

    patches.wrap_class(connector, "on_trainer_init", make)
