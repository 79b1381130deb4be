"""The run's one thread for object-store calls (uploads of a DCP directory's ``.metadata``, remote
removals), and the remote directories being published through it.

The training thread does no remote I/O: it asks this thread, in order (a publish before the removals that
wait for it), and the coordinator polls the publishes while it polls its writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from lightning_asyncckpt.storage import destination, remote

if TYPE_CHECKING:
    from lightning_asyncckpt.pipeline.save import Save


class Publish(NamedTuple):
    """A remote DCP directory whose ``.metadata`` is being uploaded (the coordinator)."""

    save: Save
    upload: Future
    results: list  # every rank's write results, for the record
    since: float  # monotonic, when the upload was asked for


class Settled(NamedTuple):
    """A publish that ended: ``error`` is None when its ``.metadata`` landed."""

    publish: Publish
    error: BaseException | None


class RemoteOps:
    """This run's object-store calls, in one background thread made at the first one."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._publishing: list[Publish] = []

    def background(self, fn: Callable[..., object], *args: object) -> Future:
        """Runs ``fn(*args)`` in the run's one thread for object-store calls, in the order asked for;
        :meth:`close` waits for all of them.

        Returns:
            The call's future.
        """
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncckpt-remote")
        return self._thread.submit(fn, *args)

    def remove(self, path: Path | str, what: str) -> None:
        """(this rank, retention) Removes a checkpoint: a local one now; a remote one in the background
        thread, so that object-store calls stay off the training thread."""
        where = destination.of(path)
        if where.is_remote:
            self.background(where.discard, what)
        else:
            where.discard(what)

    def publish(self, save: Save, results: list) -> None:
        """(the coordinator) Uploads ``save``'s ``.metadata`` in the background; :meth:`settled` says when
        it ended."""
        upload = self.background(save.destination.publish, save.tmp, save.writes_file)
        self._publishing.append(Publish(save, upload, results, time.monotonic()))

    def saves(self) -> list[Save]:
        """The saves being published, oldest first."""
        return [p.save for p in self._publishing]

    def settled(self, blocking: bool, timeout_s: float, url: str | None = None) -> Iterator[Settled]:
        """(the coordinator, while polling) Yields the publishes that ended, oldest first, each taken off the
        queue (``blocking``: waits for each; ``url``: waits only for those up to the last one to that URL).
        One still running ``timeout_s`` after it began ends with a :class:`TimeoutError`."""
        last = max((i for i, p in enumerate(self._publishing) if p.save.path == url), default=-1) if url else None
        while self._publishing and (last is None or last >= 0):
            publish = self._publishing[0]
            left = publish.since + timeout_s - time.monotonic()
            if not publish.upload.done() and left > 0 and not (blocking or last is not None):
                return
            self._publishing.pop(0)
            last = None if last is None else last - 1
            try:
                publish.upload.result(timeout=max(left, 0))
            except Exception as e:  # noqa: BLE001 - raised on every rank by the next finalize (a timeout too)
                if isinstance(e, (TimeoutError, FutureTimeout)):  # the same class from Python 3.11 on
                    e = TimeoutError(f"the upload of {remote.METADATA} did not finish within timeout_s={timeout_s:g}s")
                yield Settled(publish, e)
                continue
            yield Settled(publish, None)

    def close(self) -> list[Save]:
        """(this rank, as the run closes) Waits for every call asked for; returns the saves that were being
        published (published or not, they are not recorded)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)  # the publishes and removals asked for are done when the run closes
            self._thread = None
        publishing, self._publishing = self._publishing, []
        return [p.save for p in publishing]
