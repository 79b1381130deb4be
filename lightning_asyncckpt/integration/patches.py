"""Every change this package makes to Lightning's own objects, made and undone in one place.

Lightning gives a plugin no hook for these, so the package wraps these methods, only for trainers that use
``AsyncCheckpointIO``; a Trainer without the plugin runs Lightning's own code, with no frame of this package:

- a strategy's ``save_checkpoint`` (instance, the callback, from ``setup`` to ``teardown``): counts
  weights-only saves, finishes a SLURM requeue save before it returns;
- each ``ModelCheckpoint``'s ``file_exists`` (instance, the callback, from ``setup`` to ``teardown``): a save
  still being written counts as existing, so that a later save does not take its name;
- each logger's ``after_save_checkpoint`` (instance, the logger relay): deferred until the save commits;
- the trainer's own checkpoint connector's ``_parse_ckpt_path`` and ``resume_start`` (instance, ``tier_resume``,
  for the trainer's life, made as the trainer is): ``ckpt_path="last"`` with a local tier and on object
  stores; while ``"last"`` is resolved, its ``ModelCheckpoint``'s ``_find_last_checkpoints`` (instance,
  ``resume``);
- ``_CallbackConnector.on_trainer_init`` (the class, ``autoattach``), only while an ``AsyncCheckpointIO`` or one of
  the package's strategies exists: the finalizer, and the connector's wrappers above, for a Trainer made
  with the plugin.

Instance wrappers are given back by :meth:`InstancePatches.undo`; the class wrapper by
:func:`undo_class_patches`. Each wrapper carries a mark, so nothing is wrapped twice. A method that this
Lightning does not have is left alone, with one warning naming the Lightning version, rather than patched
blindly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

MARK = "_asyncckpt"  # set on every wrapper this package installs
F = TypeVar("F", bound=Callable[..., object])  # the method wrapped, and its wrapper
_class_patches: list[tuple[type, str, Callable[..., object], object]] = []  # (class, name, our wrapper, its own attribute before)
_warned: set[str] = set()


def is_ours(fn: object) -> bool:
    """Whether ``fn`` is a wrapper this package installed."""
    return bool(getattr(fn, MARK, False))


def _missing(owner: object, name: str) -> None:
    what = f"{type(owner).__name__ if not isinstance(owner, type) else owner.__name__}.{name}"
    if what not in _warned:
        _warned.add(what)
        from lightning_asyncckpt.integration.versions import installed_version

        log.warning("lightning-asyncckpt: Lightning %s has no %s; the package leaves it as it is",
                    installed_version("lightning"), what)


def _set(owner: object, name: str, value: object) -> None:
    """``owner.name = value``: the one place the package sets an attribute of Lightning's objects and classes
    (or marks a wrapper of its own). It must: wrapping a method of a class or object we do not own is what a
    patch is. Every such change is made by :func:`_wrap` or :func:`hook_method` for a trainer that uses the
    plugin, and undone by :func:`_give_back` or :class:`InstancePatches` after it."""
    setattr(owner, name, value)


def _wrap(owner: object, name: str, make: Callable[[F], F]) -> tuple[F, object] | None:
    """Sets ``owner.name`` to ``make(current)``, marked; returns ``(wrapper, owner's own attribute before)``,
    or None where ``owner`` has no such method or it is ours already."""
    current = getattr(owner, name, None)
    if current is None:
        _missing(owner, name)
        return None
    if is_ours(current):
        return None
    before = vars(owner).get(name) if hasattr(owner, "__dict__") else None
    wrapper = make(current)
    _set(wrapper, MARK, True)
    _set(owner, name, wrapper)
    return wrapper, before


def _give_back(owner: object, name: str, wrapper: Callable[..., object], before: object) -> None:
    """Gives ``owner`` its own ``name`` back, unless someone replaced our wrapper since."""
    if vars(owner).get(name) is wrapper:
        if before is None:
            delattr(owner, name)
        else:
            _set(owner, name, before)


class MethodHook:
    """One object's method, wrapped: calls ``around(original, *args, **kwargs)`` with the class's method bound
    to the object. Unlike a closure it pickles (``strategy="ddp_spawn"`` pickles the trainer, and with it the
    trainer's own objects that carry these), as long as ``around`` is a module-level function."""

    def __init__(self, obj: object, name: str, around: Callable[..., object]) -> None:
        self._obj = obj
        self._name = name
        self._around = around

    def __call__(self, *args: object, **kwargs: object) -> object:
        original = getattr(type(self._obj), self._name).__get__(self._obj)
        return self._around(original, *args, **kwargs)


def hook_method(obj: object, name: str, around: Callable[..., object]) -> bool:
    """(any process) Wraps ``obj.name`` in a :class:`MethodHook`, for ``obj``'s life: ``obj`` alone is changed,
    not its class. False, and ``obj`` left as it is, where its class has no such method or ``obj`` has an
    attribute of that name of its own already (ours, or someone's that would have shadowed the class's)."""
    if getattr(type(obj), name, None) is None:
        _missing(obj, name)
        return False
    if name in vars(obj):
        return False
    hook = MethodHook(obj, name, around)
    _set(hook, MARK, True)
    _set(obj, name, hook)
    return True


class InstancePatches:
    """(one callback or relay, on every rank) The instance attributes it put on Lightning objects."""

    def __init__(self) -> None:
        self._made: list[tuple[object, str, Callable[..., object], object]] = []  # (object, name, our wrapper, its own attribute before)

    def wrap(self, obj: object, name: str, make: Callable[[F], F]) -> F | None:
        """Sets ``obj.name`` to ``make(current)``; returns the wrapper, or None where ``obj`` has no such method
        or it is ours already."""
        made = _wrap(obj, name, make)
        if made is None:
            return None
        self._made.append((obj, name, *made))
        return made[0]

    def undo(self) -> None:
        """Gives each object its own attribute back, unless someone replaced our wrapper since."""
        for made in reversed(self._made):
            _give_back(*made)
        self._made = []


def wrap_class(cls: type, name: str, make: Callable[[F], F]) -> bool:
    """(any process, idempotent) Replaces ``cls.name`` with ``make(current)``, process-wide, until
    :func:`undo_class_patches`; False where ``cls`` has no such method or it is ours already."""
    made = _wrap(cls, name, make)
    if made is not None:
        _class_patches.append((cls, name, *made))
    return made is not None


def class_patched() -> bool:
    """Whether any class wrapper of this package is installed."""
    return bool(_class_patches)


def undo_class_patches() -> None:
    """(any process) Gives every class this package patched its own method back."""
    while _class_patches:
        _give_back(*_class_patches.pop())
