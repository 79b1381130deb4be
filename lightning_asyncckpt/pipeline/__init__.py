"""The control plane on the training side: one run of saves from the save call to the commit.

``pipeline.SavePipeline`` is its interface; ``scheduler`` takes a save in, ``poller`` watches the
writes, ``finalizer`` agrees across the ranks, ``committer`` publishes and retains, ``drain`` lands
what is in flight on the way out. Its collectives go through
:mod:`lightning_asyncckpt.collectives` (``agreement``: the training group's). No Lightning imports.
"""
