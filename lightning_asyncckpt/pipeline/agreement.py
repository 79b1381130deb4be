"""The persistent pipeline's agreement: :class:`~lightning_asyncckpt.collectives.agreement.Agreement`, over the
training's group (or a gloo exit group with a bound), from the package's one owner of collectives,
:mod:`lightning_asyncckpt.collectives`. The pipeline's modules run no collective of their own.

The pipeline's modules import it from here.
"""

from __future__ import annotations

from lightning_asyncckpt.collectives import Agreement

__all__ = ["Agreement"]
