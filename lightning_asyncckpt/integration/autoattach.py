"""The finalizer, and the resume wrappers, for each Trainer made with the plugin; nothing for any other.

A Trainer that uses ``AsyncCheckpointIO`` needs ``AsyncFinalizerCallback`` (without it nothing finalizes at
step ends, and nothing drives the local tier, which then saves nothing, silently) and the wrappers of its
checkpoint connector that resolve ``ckpt_path="last"`` (:mod:`~lightning_asyncckpt.integration.tier_resume`).
Lightning's ``callbacks_factory`` entry point cannot give them: its factory is not told which Trainer it is
for, so it would add the callback to every Trainer, also those without the plugin. Instead:

- an ``AsyncCheckpointIO``, or one of the package's strategies, calls :func:`install` as it is made (always
  before the Trainer that takes it): ``_CallbackConnector.on_trainer_init`` is wrapped, process-wide, while
  any of them exists, and given back by the last one's garbage collection;
- for a Trainer made then whose strategy saves through ``AsyncCheckpointIO``, the wrapper adds the finalizer
  as the entry point would have (ordered by Lightning, before the checkpoint callbacks; none where the user
  gave one) and attaches the connector's wrappers, to that trainer alone, for its life;
- any other Trainer gets nothing: its ``fit`` runs Lightning's own code, with no frame of this package.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_asyncckpt.integration import lightning_api, patches

if TYPE_CHECKING:
    from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector

# what a Trainer made with the plugin is given: loaded when the first such Trainer is made
ATTACH = "lightning_asyncckpt.integration.callback"

_owners: list[weakref.ref[object]] = []  # the plugins and strategies alive that a Trainer may yet take


def install(owner: object) -> None:
    """(any process, as ``owner`` is made: ``AsyncCheckpointIO.__init__``, the package's strategies) Wraps
    ``on_trainer_init`` of the Lightning whose Trainer may take ``owner`` (both distributions where both are
    imported), until ``owner`` and every other owner are gone.

    Args:
        owner: the plugin or strategy being made; held weakly.
    """
    _owners[:] = [r for r in _owners if r() is not None]
    _owners.append(weakref.ref(owner, _forget))
    for connector in _callback_connectors():
        patches.wrap_class(connector, "on_trainer_init", _wrapper)


def _forget(_gone: weakref.ref[object]) -> None:
    """(whichever thread collects an owner) Gives ``on_trainer_init`` back once no owner is alive."""
    if not any(r() is not None for r in _owners):
        _owners.clear()
        patches.undo_class_patches()


def _callback_connectors() -> list[type]:
    """Lightning's ``_CallbackConnector``: the one the package builds on, and the other distribution's where
    that is imported already (its Trainer accepts the plugin too; see ``lightning_api``)."""
    sub = "trainer.connectors.callback_connector"
    found = [lightning_api.trainer_module(sub)._CallbackConnector]
    if lightning_api.OTHER is not None:
        other = sys.modules.get(f"{lightning_api.DISTRIBUTIONS[lightning_api.OTHER][1]}.{sub}")
        if other is not None:
            found.append(other._CallbackConnector)
    return found


def _wrapper(original: Callable[..., None]) -> Callable[..., None]:
    def on_trainer_init(self: _CallbackConnector, *args: object, **kwargs: object) -> None:
        out = original(self, *args, **kwargs)
        attach(self)
        return out

    return on_trainer_init


def _uses_an_owner(strategy: object) -> bool:
    """Whether ``strategy`` is one of the package's strategies, or its checkpoint IO (unwrapped as
    ``find_async_io`` does) an ``AsyncCheckpointIO``: each is an owner. Asks no property, so that a strategy
    without the plugin makes no default checkpoint IO here."""
    alive = [o for o in (r() for r in _owners) if o is not None]
    io = vars(strategy).get("_checkpoint_io") if hasattr(strategy, "__dict__") else None
    for _ in range(8):
        if any(strategy is o or io is o for o in alive):
            return True
        io = vars(io).get("_checkpoint_io") if hasattr(io, "__dict__") else None
    return False


def attach(connector: _CallbackConnector) -> None:
    """(every rank, at the end of ``_CallbackConnector.on_trainer_init``) For a Trainer whose strategy saves
    through ``AsyncCheckpointIO``: the finalizer where it has none, and its connector's resume wrappers.

    Args:
        connector: the Trainer's ``_CallbackConnector``, whose ``trainer`` has its callbacks now.
    """
    trainer = connector.trainer
    if not _uses_an_owner(trainer.strategy):
        return
    # by name, as Lightning loads an entry point: the callback and the plugin import this module
    plugged = importlib.import_module(ATTACH)
    if plugged.needs_a_finalizer(trainer):
        # where the entry point's callbacks went: Lightning then puts its checkpoint callbacks last
        callbacks = [*trainer.callbacks, plugged.automatic_finalizer()]
        reorder = getattr(connector, "_reorder_callbacks", None)
        trainer.callbacks[:] = reorder(callbacks) if reorder is not None else callbacks
    plugged.attach_resume(trainer)
