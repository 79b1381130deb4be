"""The name a resume from the local tier goes by: ``<root>/restore-step-<N>`` (``root``: the tier's
``<dir>/asyncckpt-local/<session>``).

Lightning keeps the checkpoint path it resumed from in ``trainer.ckpt_path`` and loads it through the
plugin's ``load_checkpoint``. A local step is no single file, but shares in node-local files on every node,
fetched by every rank together (:meth:`TierRun.latest`), so that is the name it keeps. Loaded again later
(``trainer.validate(ckpt_path=trainer.ckpt_path)``) it is not there: that gets an error that says what the
name is and what to load instead, not a bare "not found".
"""

from __future__ import annotations

import re
from pathlib import Path

from lightning_asyncckpt.storage import destination

_NAME = re.compile(r"restore-step-(\d+)")


def key_for(root: Path, step: int) -> str:
    """The name of a resume from the local tier's ``step``."""
    return str(Path(root) / f"restore-step-{step}")


def step_of(path: object) -> int | None:
    """The step a resume name stands for, or None for any other path (one that exists is a real file)."""
    p = destination.plain_path(path)
    if p is None:
        return None
    match = _NAME.fullmatch(p.name)
    if match is None or p.parent.parent.name != "asyncckpt-local" or p.exists():
        return None
    return int(match.group(1))


def not_held(path: object, step: int) -> FileNotFoundError:
    """(any rank) The error for loading a resume name the local tier no longer holds."""
    return FileNotFoundError(
        f"{path} names step {step} of the local tier, which fit resumed from (it was trainer.ckpt_path): it is"
        " not a checkpoint file but shares in node-local files, read once by every rank together at the"
        " resume, and not kept after it. To evaluate or load a checkpoint, pass a persistent one"
        " (ModelCheckpoint's, e.g. ckpt_path='last' or 'best'); to go on training, fit(ckpt_path='last')"
        " resumes from the newest local step again.")
