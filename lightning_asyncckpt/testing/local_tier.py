"""What happens to a node's local tier (:class:`~lightning_asyncckpt.LocalTier`), for a CI that proves its job
resumes from the right tier, without knowing the tier's file layout::

    from lightning_asyncckpt.testing import local_tier

    trainer.fit(model, ckpt_path="last")          # run 1: local saves every 2 steps, persistent every 8
    local_tier.corrupt_share(node0_dir, owner=2)  # a bit flip in node 0's copy of rank 2's newest share
    local_tier.lose_node(node1_dir)               # node 1 replaced: its local directory is empty
    trainer.fit(model, ckpt_path="last")          # run 2: rank 2's share is only in the bad copy: persistent

Each function acts on one node's ``LocalTier(dir=...)`` (its own files only: ``<dir>/asyncckpt-local/<session>/``)
and is called between two runs of the job, on the node (or in the test) that owns the directory. The
restore that next uses a corrupted or missing copy finds it out (CRC32, manifest) and takes the next tier,
with the reason in its log line; a copy no restore uses is not read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lightning_asyncckpt.tiers import store

__all__ = ["HeldShare", "corrupt_share", "drop_share", "held", "lose_node"]


@dataclass(frozen=True)
class HeldShare:
    """One complete copy of a rank's share on this node: ``owner``'s share of ``step``, kept by ``holder``
    (the owner itself, or a clique peer that keeps a replica), in ``files`` (its tensor bytes, header and
    manifest; ``path`` is the first)."""

    step: int
    owner: int
    holder: int
    files: tuple[Path, Path, Path]

    @property
    def path(self) -> Path:
        return self.files[0]


def held(dir: str | os.PathLike, session: str = "default") -> list[HeldShare]:
    """Every complete share this node's local directory holds for ``session``, newest step first (``[]``
    where the tier has saved nothing here yet)."""
    from lightning_asyncckpt.tools import local_command as listing

    try:
        [found] = listing.sessions(Path(dir), only=session)
    except listing.NoLocalTier:
        return []
    rows = [HeldShare(s.manifest.step, s.manifest.owner, s.holder,
                      store.share_files(store.holder_dir(found.path, s.holder), s.manifest))
            for s in found.shares]
    return sorted(rows, key=lambda r: (-r.step, r.owner, r.holder))


def lose_node(dir: str | os.PathLike, session: str = "default") -> int:
    """Empties ``session``'s files on this node, as a node replaced (or rebooted, ``/dev/shm`` wiped) leaves
    it; nothing outside ``<dir>/asyncckpt-local/<session>/`` is touched. Returns how many files it removed.
    Refused (``RuntimeError`` naming the processes) while a process still maps or holds open one of them:
    a lost node runs no job."""
    from lightning_asyncckpt.tools import local_command as listing

    root = Path(dir) / listing.TIER_DIR / session
    if not root.is_dir():
        return 0
    if users := listing.users(root):
        raise RuntimeError(f"lose_node({str(dir)!r}): {root} is in use by {', '.join(users)}; stop the job first"
                           " (a lost node runs none)")
    return listing.remove(listing.Session(session, root)).files  # the tier's names only, no link followed


def corrupt_share(dir: str | os.PathLike, owner: int, step: int | None = None, holder: int | None = None,
                  session: str = "default") -> Path:
    """Flips one byte in the middle of ``owner``'s share of ``step`` (default: the newest this node holds) in
    the copy ``holder`` keeps (default: the only one on this node), as a memory or disk error would; its
    manifest still holds the old CRC32. Returns the file changed."""
    share = _one(dir, owner, step, holder, session, "corrupt_share")
    path = share.path if share.path.stat().st_size else share.files[1]  # an empty share: its header
    with open(path, "r+b") as f:
        middle = os.fstat(f.fileno()).st_size // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def drop_share(dir: str | os.PathLike, owner: int, step: int | None = None, holder: int | None = None,
               session: str = "default") -> list[Path]:
    """Removes one copy of ``owner``'s share of ``step`` (default: the newest this node holds), the one
    ``holder`` keeps (default: the only one on this node): its tensor bytes, header and manifest. Returns
    the files removed."""
    share = _one(dir, owner, step, holder, session, "drop_share")
    files = list(share.files)
    for path in files:
        path.unlink()
    return files


def _one(dir: str | os.PathLike, owner: int, step: int | None, holder: int | None, session: str,
         call: str) -> HeldShare:
    rows = held(dir, session)
    if not rows:
        raise ValueError(f"{call}: {dir} holds no local-tier share of session {session!r} (LocalTier(dir=...,"
                         " session=...) of the job, after a local save)")
    mine = [r for r in rows if r.owner == owner and (holder is None or r.holder == holder)]
    steps = sorted({r.step for r in mine}, reverse=True)
    if step is not None:
        mine = [r for r in mine if r.step == step]
    elif steps:
        mine = [r for r in mine if r.step == steps[0]]
    if len(mine) == 1:
        return mine[0]
    here = "; ".join(f"step {r.step} owner {r.owner} holder {r.holder}" for r in rows)
    if not mine:
        raise ValueError(f"{call}(owner={owner}, step={step}, holder={holder}): {dir} holds no such share; it holds:"
                         f" {here}")
    raise ValueError(f"{call}(owner={owner}, step={step}): several holders on this node keep that share"
                     f" ({', '.join(str(r.holder) for r in mine)}); pass holder=")
