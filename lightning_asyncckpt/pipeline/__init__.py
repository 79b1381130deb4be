"""The control plane on the training side: one run of saves from the save call to the commit.

``pipeline.SaveSession`` owns a run of saves and is its interface (submit, finalize, abort, close);
``AsyncCheckpointIO`` holds one. ``scheduler`` takes a save in, ``poller`` watches the
writes, ``finalizer`` agrees across the ranks, ``committer`` publishes and retains, ``drain`` lands
what is in flight on the way out. ``agreement`` owns every collective. No Lightning imports.
"""
