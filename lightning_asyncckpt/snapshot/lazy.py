"""The lazy snapshot: which tensors may be copied after ``save_checkpoint`` returns, the background copy,
and the proof that no copied tensor changed while it was copied.

Parameters and optimizer state change only in ``optimizer.step()``. A lazy save copies everything else at
save time (non-tensor state, small tensors, buffers such as BatchNorm's running statistics, which change
in the forward pass) and leaves the parameters and optimizer state of the *tracked* optimizers to a
background thread, which copies them into the same reused host buffers while the next step runs its
forward and backward (a CPU ``copy_`` releases the GIL). The pipeline waits for the thread right before
the state changes (the callback's ``on_before_optimizer_step``, the next save, finalize, load, teardown,
abort). A single-writer save's write is handed to the worker at save time, behind a gate the copy thread
opens once it is proven (:mod:`lightning_asyncckpt.write.gate`), so that it starts as soon as the copy ends; a
collective save's is handed over at the wait.

When the previous save's write still reads the only staging copy, a lazy save follows it into that copy
(:mod:`lightning_asyncckpt.snapshot.buffer_pool`) instead of taking a second one: its background copy first waits
for that write to end (:class:`AfterWrite`), so training waits for it only before the optimizer step. (A
hand-back of each tensor as soon as the write had read it was built and measured, and removed: the copy
it saved was 0.04 to 0.07 s against a write of about 1 s, which no run resolved.)

The rule (:class:`TrackedState`): a tensor of the checkpoint is copied lazily when it holds at least
:data:`LAZY_MIN_BYTES` and is exactly (same storage, offset, shape, stride, dtype) a parameter of a
tracked optimizer's ``param_groups`` or a tensor of its ``state``, or an inner tensor of such a state
when that is a wrapper subclass (torchao's low-bit states: the snapshot stages their inner tensors).
Anything else, and everything when no optimizer is tracked, is copied at save time.

The same rule serves every layout: a single writer's file, a collective save's share of a replicated
state (``AsyncDDPStrategy``), and a sharded save's local shards (``AsyncModelParallelStrategy``), whose
``DTensor`` parameters and optimizer state are matched by their local shard. A DCP save is planned at save
time (collectively, while every rank is in the save call); only the hand-over to the worker waits for the copy.

Proof (:class:`BackgroundCopy`): each lazily copied tensor's version counter is read at save time and
again right after its copy; any in-place change in between (a callback editing weights after a save,
EMA, an in-place op in forward) bumps it, and the save fails instead of being written torn. A change
made through ``.data`` bypasses version counters (torch does not count it): code that edits parameters
that way between a save and the next optimizer step needs ``snapshot="eager"``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from lightning_asyncckpt.snapshot import subclasses

if TYPE_CHECKING:
    from lightning_asyncckpt.snapshot.staging import Deferred

    class Gate(Protocol):  # lightning_asyncckpt.write.gate.Gate
        def decide(self, go: bool) -> object: ...

SNAPSHOT_MODES = ("eager", "lazy")

# Smaller tensors are copied at save time: the copy costs less than keeping track of it.
LAZY_MIN_BYTES = 64 << 10


def _key(t: torch.Tensor) -> tuple:
    """Identifies the memory a tensor views: a parameter and its ``state_dict`` entry (a ``detach``) agree;
    a ``DTensor`` (FSDP2, tensor parallel) by its local shard, which is what a sharded save copies."""
    if _is_dtensor(t):
        t = t.to_local()
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a wrapper subclass's data, depth first (``t`` itself if plain)."""
    if not subclasses.is_wrapper(t):
        return [t]
    return [x for n in subclasses.inner_names(t) for x in _inner(getattr(t, n))]


def _watch(v: torch.Tensor) -> dict[tuple, list[torch.Tensor]]:
    """The checkpoint tensors that optimizer tensor ``v`` proves (by their keys), each with the tensors whose
    version counters prove it unchanged. A wrapper subclass (torchao's low-bit state, possibly a ``DTensor``'s
    local shard) is staged through its inner tensors: each is proven by the wrapper's counter (the
    optimizer's in-place updates of the wrapper bump it, compiled ones included, where the inner tensors'
    counters stay) and by every inner tensor's own (an edit of ``v.codes`` bumps only that one)."""
    local = v.to_local() if _is_dtensor(v) else v
    outer = [v, local] if local is not v else [v]
    if not subclasses.is_wrapper(local):
        return {_key(v): outer}
    inner = _inner(local)
    proof = [*outer, *_wrappers(local), *inner]
    return {_key(x): proof for x in inner}


def _wrappers(t: torch.Tensor) -> list[torch.Tensor]:
    """Wrapper subclasses nested inside wrapper ``t`` (not ``t`` itself)."""
    out = []
    for n in subclasses.inner_names(t):
        x = getattr(t, n)
        if subclasses.is_wrapper(x):
            out += [x, *_wrappers(x)]
    return out


class TrackedState:
    """The optimizers whose ``step`` is the only thing that changes their parameters and state (held
    weakly: the plugin does not keep a finished trainer's optimizers alive)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []

    def track(self, optimizers: Iterable[object]) -> None:
        # a LightningOptimizer wraps the torch optimizer, whose state is what the checkpoint holds
        self._refs = [weakref.ref(getattr(o, "_optimizer", o)) for o in optimizers]

    def rule(self) -> Callable[[torch.Tensor], list[torch.Tensor] | None] | None:
        """(at save time) Which checkpoint tensors may be copied lazily; ``None`` when none may. For such a
        tensor the rule returns the tensors whose version counters prove it unchanged: the optimizer's own
        parameter or state tensor, and for a ``DTensor`` also a view of its local shard. In-place ops on a
        ``DTensor`` bump the wrapper's counter and edits of ``to_local()`` the shard's, never both, and a
        state dict's ``detach`` of a ``DTensor`` shares neither: so the copy watches the optimizer's tensors."""
        watched: dict[tuple, list[torch.Tensor]] = {}
        for ref in self._refs:
            opt = ref()
            if opt is None:
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    tensors = [p, *(v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))]
                    for v in tensors:
                        if v.device.type != "meta":
                            watched.update(_watch(v))
        if not watched:
            return None

        def watch(t: torch.Tensor) -> list[torch.Tensor] | None:
            if t.numel() * t.element_size() < LAZY_MIN_BYTES or type(t) is not torch.Tensor:
                return None
            return watched.get(_key(t))

        return watch


class BackgroundCopy:
    """Copies :class:`~lightning_asyncckpt.snapshot.staging.Deferred` items (name, source, buffer, watched tensors)
    in a daemon thread, started at once.

    Made on the training thread at save time, which is when the watched tensors' versions are read. CUDA sources
    are copied on a side stream ordered after the work queued before the save (an event recorded now).
    ``hook`` (tests: :class:`lightning_asyncckpt.testing.HoldCopy`) runs first in the thread. ``after``
    (:class:`AfterWrite`: the buffers are still read by the write before this save) is waited for next,
    before anything is copied. ``gate``
    (:class:`lightning_asyncckpt.write.gate.Gate`, for a write handed to the worker already) is decided by the
    thread as it ends: ``go`` once every tensor is copied and proven unchanged, ``skip`` on any problem.
    """

    def __init__(self, items: list[Deferred], hook: Callable[[], None] | None = None, after: AfterWrite | None = None,
                 gate: Gate | None = None):
        self.items = items
        # what is copied after the save call returned (items without a watch were copied privately at save time)
        self.nbytes = sum(d.source.numel() * d.source.element_size() for d in items if d.watch)
        self._versions = [[w._version for w in d.watch] for d in items]
        devices = {d.source.device for d in items if d.source.device.type == "cuda"}
        # the kernels that produced the sources are queued on the training thread's current stream
        self._events = {d: torch.cuda.current_stream(d).record_event() for d in devices}
        self._hook, self._after, self._gate = hook, after, gate
        self._cancelled = threading.Event()
        self._problem: str | None = None
        self.problem_type = "TornSnapshot"  # the error type of ``wait``'s problem
        self._thread = threading.Thread(target=self._run, name="asyncckpt-lazy-copy", daemon=True)
        self._thread.start()

    def _torn(self, i: int) -> bool:
        name, watch = self.items[i].name, self.items[i].watch
        if [w._version for w in watch] == self._versions[i]:
            return False
        self._problem = (
            f"tensor {name!r} was changed in place after the save and before its lazy snapshot was copied"
            " (e.g. a callback or EMA editing weights right after a save, or an in-place op in forward);"
            ' nothing was written. Use AsyncCheckpointIO(snapshot="eager"), or change the state only after'
            " wait_for_snapshot()"
        )
        return True

    def _run(self) -> None:
        self._copy()
        if self._gate is not None:
            try:  # the worker waits for this decision before it reads the buffers
                self._gate.decide(self._problem is None)
            except OSError as e:
                self._problem = self._problem or f"the lazy snapshot's gate could not be decided: {e}"

    def _copy(self) -> None:
        try:
            if self._hook is not None:
                self._hook()
            if self._after is not None:  # the write before it still reads the buffers: not torn if it never ends
                problem = self._after.wait(self._cancelled)
                if problem is not None:
                    self._problem, self.problem_type = problem, "TimeoutError"
                    return
            streams = {d: torch.cuda.Stream(device=d) for d in self._events}
            for d, side in streams.items():
                side.wait_event(self._events[d])
            on_device = []
            for i, (_, src, buf, _) in enumerate(self.items):
                if src.device.type == "cuda":
                    with torch.cuda.stream(streams[src.device]):
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
            self.problem_type = "TimeoutError"  # not torn: unfinished (the thread can only set the same type)
            return f"the lazy snapshot copy did not finish within timeout_s={timeout_s:g}s"
        return self._problem

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """(the training thread, on the way out) A copy still waiting for the write before it gives up (its
        save is dropped); one already copying finishes."""
        self._cancelled.set()


FOLLOW_POLL_S = 0.005  # how often a copy waiting for the write before it looks for that write's report


@dataclass(frozen=True)
class AfterWrite:
    """What a :class:`BackgroundCopy` whose buffers the write before it still reads
    (:mod:`lightning_asyncckpt.snapshot.buffer_pool`) waits for: that write's lease released (``ready``, set on
    the training thread) or its worker's report at ``report`` (the worker reports only once it no longer
    reads the buffers), so that the copy starts as soon as the write ends, during the next forward and
    backward. Bounded by ``timeout_s``."""

    ready: threading.Event
    report: Path
    timeout_s: float

    def wait(self, cancelled: threading.Event) -> str | None:
        """(the copy thread) ``None`` once the buffers are free; else why the copy cannot run."""
        deadline = time.monotonic() + self.timeout_s
        while not self.ready.wait(FOLLOW_POLL_S):
            if self.report.exists():
                return None
            if cancelled.is_set():
                return "the save was dropped while its lazy snapshot waited for the write before it"
            if time.monotonic() > deadline:
                return f"the write before this save did not end within timeout_s={self.timeout_s:g}s"
        return None
