"""The lazy snapshot: which tensors may be copied after ``save_checkpoint`` returns, the background copy,
and the proof that no copied tensor changed while it was copied.

Parameters and optimizer state change only in ``optimizer.step()``. A lazy save copies everything else at
save time (non-tensor state, small tensors, buffers such as BatchNorm's running statistics, which change
in the forward pass) and leaves the parameters and optimizer state of the *tracked* optimizers to a
background thread, which copies them into the same reused host buffers while the next step runs its
forward and backward (a CPU ``copy_`` releases the GIL). The pipeline waits for the thread right before
the state changes (the callback's ``on_before_optimizer_step``, the next save, finalize, load, teardown,
abort) and only then hands the write to the worker.

The rule (:class:`TrackedState`): a tensor of the checkpoint is copied lazily when it holds at least
:data:`LAZY_MIN_BYTES` and is exactly (same storage, offset, shape, stride, dtype) a parameter of a
tracked optimizer's ``param_groups`` or a tensor of its ``state``. Anything else, and everything when no
optimizer is tracked, is copied at save time.

Proof (:class:`BackgroundCopy`): each lazily copied tensor's version counter is read at save time and
again right after its copy; any in-place change in between (a callback editing weights after a save,
EMA, an in-place op in forward) bumps it, and the save fails instead of being written torn. A change
made through ``.data`` bypasses version counters (torch does not count it): code that edits parameters
that way between a save and the next optimizer step needs ``snapshot="eager"``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

SNAPSHOT_MODES = ("eager", "lazy")

# Smaller tensors are copied at save time: the copy costs less than keeping track of it.
LAZY_MIN_BYTES = 64 << 10


def _key(t: torch.Tensor) -> tuple:
    """Identifies the memory a tensor views: a parameter and its ``state_dict`` entry (a ``detach``) agree."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class TrackedState:
    """The optimizers whose ``step`` is the only thing that changes their parameters and state (held
    weakly: the plugin does not keep a finished trainer's optimizers alive)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def track(self, optimizers: Iterable[Any]) -> None:
        # a LightningOptimizer wraps the torch optimizer, whose state is what the checkpoint holds
        self._refs = [weakref.ref(getattr(o, "_optimizer", o)) for o in optimizers]

    def rule(self) -> Callable[[torch.Tensor], bool] | None:
        """(at save time) Which checkpoint tensors may be copied lazily; ``None`` when none may."""
        keys = set()
        for ref in self._refs:
            opt = ref()
            if opt is None:
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    keys.add(_key(p))
                    for v in opt.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor) and v.device.type != "meta":
                            keys.add(_key(v))
        if not keys:
            return None
        return lambda t: t.numel() * t.element_size() >= LAZY_MIN_BYTES and type(t) is torch.Tensor and _key(t) in keys


class BackgroundCopy:
    """Copies ``(name, source, buffer)`` triples in a daemon thread, started at once.

    Made on the training thread at save time, which is when each source's version is read. CUDA sources
    are copied on a side stream ordered after the work queued before the save (an event recorded now).
    ``hook`` (tests: :class:`lightning_asyncckpt.testing.HoldCopy`) runs in the thread before it copies.
    """

    def __init__(self, items: list[tuple[str, torch.Tensor, torch.Tensor]], hook: Callable[[], None] | None = None):
        self.items = items
        self.nbytes = sum(t.numel() * t.element_size() for _, t, _ in items)
        self._versions = [t._version for _, t, _ in items]
        devices = {t.device for _, t, _ in items if t.device.type == "cuda"}
        # the kernels that produced the sources are queued on the training thread's current stream
        self._events = {d: torch.cuda.current_stream(d).record_event() for d in devices}
        self._hook = hook
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="asyncckpt-lazy-copy", daemon=True)
        self._thread.start()

    def _torn(self, i: int) -> bool:
        name, src, _ = self.items[i]
        if src._version == self._versions[i]:
            return False
        self._problem = (
            f"tensor {name!r} was changed in place after the save and before its lazy snapshot was copied"
            " (e.g. a callback or EMA editing weights right after a save, or an in-place op in forward);"
            ' nothing was written. Use AsyncCheckpointIO(snapshot="eager"), or change the state only after'
            " wait_for_snapshot()"
        )
        return True

    def _run(self) -> None:
        try:
            if self._hook is not None:
                self._hook()
            streams = {d: torch.cuda.Stream(device=d) for d in self._events}
            for d, side in streams.items():
                side.wait_event(self._events[d])
            on_device = []
            for i, (_, src, buf) in enumerate(self.items):
                if src.device.type == "cuda":
                    side = streams[src.device]
                    with torch.cuda.stream(side):
                        buf.copy_(src, non_blocking=True)
                    on_device.append(i)
                    continue
                buf.copy_(src)
                if self._torn(i):  # checked right after its copy: a later change cannot tear it
                    return
            for side in streams.values():
                side.synchronize()
            any(self._torn(i) for i in on_device)
        except BaseException as e:  # noqa: BLE001 - reported by wait(), on the training thread
            self._problem = f"the lazy snapshot copy failed: {type(e).__name__}: {e}"

    def wait(self, timeout_s: float) -> str | None:
        """(the training thread) Waits for the copy; returns why the snapshot is unusable, or ``None``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return f"the lazy snapshot copy did not finish within timeout_s={timeout_s:g}s"
        return self._problem

    def done(self) -> bool:
        return not self._thread.is_alive()
