"""A pytest plugin (registered through the ``pytest11`` entry point): the ``asyncckpt_faults`` fixture."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from lightning_asyncckpt.testing import ENV_VAR, Fault


@pytest.fixture
def asyncckpt_faults() -> Iterator[Callable[..., None]]:
    """Injects faults into every ``AsyncCheckpointIO`` save of the test (and of processes it starts);
    they are removed after the test::

        def test_resume_after_full_disk(asyncckpt_faults):
            asyncckpt_faults(Fault("enospc", saves=[2]))
            ...
    """
    before = os.environ.get(ENV_VAR)

    def add(*faults: Fault) -> None:
        current = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = ";".join([f.spec() for f in faults] + ([current] if current else []))

    yield add
    if before is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = before
