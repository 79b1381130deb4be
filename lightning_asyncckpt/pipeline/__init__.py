"""The control plane on the training side: one run of saves from the save call to the commit.

No Lightning imports. Its collectives go through :mod:`lightning_asyncckpt.collectives` (the training group's
``Agreement``, or a gloo exit group with a bound); its engine calls through
:class:`~lightning_asyncckpt.engines.protocol.EngineProtocol`.

- ``pipeline``: :class:`SaveSession`, which ``AsyncCheckpointIO`` holds (``io.session``): a run of saves and its
  verbs (submit, finalize, abort, close; the rest named by ``integration.contract.SessionInterface``);
  ``lifecycle``: ``RunLifecycle``, its current run and what ends it (the exit group, the drain);
  ``session_parts``: the values the session is handed.
- ``settings``: :class:`Settings`, what ``AsyncCheckpointIO``'s arguments decide, validated once, frozen.
- ``run_state``: :class:`Run`, one run's state, made of small parts that each own theirs and change it only
  through their methods: ``workers`` (the engine, the scratch directory), ``temp_names`` (the save order, the
  token, the hidden paths), ``pending`` (the queue), ``failures``, ``retention`` (top-k removals),
  ``remote_ops`` (the object-store thread and its publishes), ``records`` (:class:`SaveRecord`, the ``Ledger``
  of committed records).
- ``save``: :class:`Save`, one save with an explicit state and checked transitions.
- ``scheduler``: a save taken in: snapshot, plan, hand-over; ``write_jobs`` (the worker's job),
  ``dcp_plan`` (DCP's planning) and ``plan_cache`` (a plan reused), ``serialize`` (the non-tensor state,
  pickled at save time), ``settle_copy`` (a lazy snapshot's copy settled before the optimizer step).
- ``poller``: this rank's writes polled; ``finalizer``: the ranks agree, collective saves commit together,
  failures are raised on every rank; ``committer``: a written save published and recorded.
- ``drain``: what is in flight landed on the way out (an exception, interpreter exit), within a bound.
- ``scratch``: the run's results directory in ``/dev/shm``, and the sweep of dead runs' ones.
"""
