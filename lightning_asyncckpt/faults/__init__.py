"""Injected faults: the policy the pipeline asks once per save, and the fault kinds that travel to the
real writer. Users reach them through :mod:`lightning_asyncckpt.testing`.
"""
