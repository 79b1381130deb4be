"""The exit drain: on the way out of an exception, or at interpreter exit without ``teardown``, the saves
in flight still land where they can, within ``drain_timeout_s``, and nothing waits forever.

- Saves this rank commits alone (single-writer, up to the first collective one): polled here, with no
  collectives.
- Collective saves: the blocking finalize over the exit group, a gloo group made before the first such
  save whose collectives fail, rather than wait forever, when a rank never comes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import time
import weakref
from collections.abc import Callable

from lightning_asyncckpt.collectives.agreement import Agreement
from lightning_asyncckpt.errors import CheckpointWriteError
from lightning_asyncckpt.pipeline.finalizer import finalize
from lightning_asyncckpt.pipeline.poller import settle_local
from lightning_asyncckpt.pipeline.run_state import Run
from lightning_asyncckpt.pipeline.settings import Settings

log = logging.getLogger(__name__)

# How long a rank waits for the others to arrive for committing collective saves on the way out (a rank
# that never comes, e.g. one blocked in a training collective, costs this much before the others give up).
EXIT_MEET_S = 60.0


class ExitGroup:
    """The gloo group the ranks commit collective saves over on the way out."""

    def __init__(self) -> None:
        self._agreement: Agreement | None = None

    def make(self, agreement: Agreement, drain_timeout_s: float) -> None:
        """(all ranks, together) Made before the first collective save: at the callback's ``setup`` for the
        Trainer, inside that save for Fabric. A group of a destroyed process group is made anew."""
        if self.usable() or not agreement.active or drain_timeout_s <= 0:
            return
        self._agreement = agreement.exit_side(min(drain_timeout_s, EXIT_MEET_S))

    def usable(self) -> bool:
        """The group exists and its process group was not destroyed (e.g. by the script's end)."""
        try:
            return self._agreement is not None and self._agreement.active
        except Exception:  # noqa: BLE001 - a destroyed group
            return False

    @property
    def agreement(self) -> Agreement | None:
        return self._agreement


def drain(run: Run, settings: Settings, rank: int, exit_group: ExitGroup, timeout_s: float) -> None:
    """(never raises) Waits up to ``timeout_s`` for the saves in flight, commits those that finish (with
    the removals that waited for them) and logs those that fail. Failures are then dropped: the caller
    is already handling an exception."""
    if run.engine is None or not len(run.pending):
        return
    together = timeout_s > 0 and any(p.collective for p in run.pending) and exit_group.usable()
    if not together:
        with contextlib.suppress(Exception):
            settle_local(run, settings, rank, blocking=False)  # commits what already finished
        if not run.pending.solo_waiting() or timeout_s <= 0:
            run.failures.clear()
            return
    count = len(run.pending) if together else len(run.pending.solo_waiting())
    log.warning(
        "lightning-asyncckpt: waiting up to %gs for %d checkpoint write(s) in flight%s before stopping",
        timeout_s, count, " (with every rank)" if together else "",
    )
    committed = len(run.history)
    deadline = time.monotonic() + timeout_s
    try:
        if together:
            assert exit_group.agreement is not None
            finalize(run, exit_group.agreement, settings, blocking=True, force=True, deadline=deadline)
        else:
            while run.pending.solo_waiting() and time.monotonic() < deadline:
                settle_local(run, settings, rank, blocking=False)
                if run.pending.solo_waiting():
                    time.sleep(settings.poll_interval_s)
    except CheckpointWriteError as e:
        log.error("lightning-asyncckpt: %s", e)
    except KeyboardInterrupt:
        log.warning("lightning-asyncckpt: interrupted while waiting for checkpoint writes; dropping them")
    except Exception as e:  # noqa: BLE001 - on the way out: report, never mask the original error
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if together:  # e.g. a rank that never came
            log.warning("lightning-asyncckpt: not every rank could commit the saves in flight (%s); dropping them", reason)
        else:
            log.error("lightning-asyncckpt: error while waiting for checkpoint writes: %s", reason)
    run.failures.clear()
    log.warning(
        "lightning-asyncckpt: %d of %d checkpoint write(s) in flight committed before stopping",
        len(run.history) - committed, count,
    )


class AtExit:
    """Drains at interpreter exit when ``teardown`` never came (a Fabric script that ends, or dies of an
    uncaught exception). Runs before ``multiprocessing`` stops daemon processes such as the workers (its
    exit handler, also run by multiprocessing children such as ddp_spawn ranks, runs finalizers of
    priority >= 0 first)."""

    def __init__(self) -> None:
        self._hook: multiprocessing.util.Finalize | None = None

    def arm(self, owner: object, abort: Callable[[object], None]) -> None:
        if self._hook is None:
            self._hook = multiprocessing.util.Finalize(None, _call_if_alive, args=(weakref.ref(owner), abort), exitpriority=100)

    def disarm(self) -> None:
        if self._hook is not None:
            self._hook.cancel()
            self._hook = None


def _call_if_alive(ref: weakref.ref, abort: Callable[[object], None]) -> None:
    owner = ref()
    if owner is not None:
        abort(owner)
