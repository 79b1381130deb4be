"""The control plane on the training side: one run of saves from the save call to the commit.

``pipeline.SaveSession`` owns a run of saves and is its interface (submit, finalize, abort, close);
``AsyncCheckpointIO`` holds one; ``lifecycle.RunLifecycle`` is its current run and what ends it (the exit
group, the drain), ``session_parts`` the values it is handed. ``scheduler`` takes a save in, ``poller`` watches the
writes, ``finalizer`` agrees across the ranks, ``committer`` publishes and retains, ``drain`` lands
what is in flight on the way out. Its collectives go through
:mod:`lightning_asyncckpt.collectives` (``agreement``: the training group's). No Lightning imports.

``run.Run`` is a run's state, made of small parts that each own theirs and change it only through their
methods: ``workers`` (the engine, the scratch directory), ``temp_names`` (the save order, the token, the
hidden paths), ``pending``, ``failures``, ``retention`` (removals), ``remote_ops`` (the object-store
thread and its publishes), ``records.Ledger`` (the committed records). ``save.Save`` is one save: its
request, then what each step makes of it.
"""
