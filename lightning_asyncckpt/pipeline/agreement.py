"""The persistent pipeline's agreement: :class:`~lightning_asyncckpt.collectives.agreement.Agreement`, over the
training's group (or a gloo exit group with a bound), from the package's one owner of collectives,
:mod:`lightning_asyncckpt.collectives`. The pipeline's modules run no collective of their own.

The names stay importable from here for the pipeline's modules.
"""

from __future__ import annotations

from lightning_asyncckpt.collectives import Agreed, Agreement, control_device, is_distributed

__all__ = ["Agreed", "Agreement", "control_device", "is_distributed"]
