"""Injected faults: the policy the pipeline asks once per save, and the fault kinds that travel to the
real writer. Users reach them through :mod:`lightning_asyncckpt.testing`.

- ``policy``: how injected faults reach a save, without the pipeline knowing their kinds.
- ``injected``: the fault kinds, the ``LIGHTNING_ASYNCCKPT_FAULTS`` syntax, ``inject_faults`` blocks.
"""
