"""One rank's files in the node-local directory.

``<root>/holder-<rank>/step-<step>.owner-<owner>`` with three suffixes is the share of rank ``owner`` at
``step`` as this rank holds it (its own, or a replica): ``.pt`` its tensors' bytes (one flat buffer,
:mod:`lightning_asyncckpt.tiers.packing`), ``.head`` its structure, ``.json`` its manifest (sizes, CRC32 of
each, the topology it was saved under, the run that wrote it). The manifest is written (atomically) last, so a share without one
is unfinished and never used. Removal touches only this rank's own holder directory.

Every directory here is made 0700 and every file 0600, and none is opened through a link
(:mod:`lightning_asyncckpt.tiers.trusted_dirs`): another local user can neither read a share nor plant one.
A commit that fails (a full directory) leaves no partial file: what it wrote is removed, and its error names
the file and the directory.

The ``.pt`` files are mapped and reused (:mod:`lightning_asyncckpt.tiers.mapped`): a save copies into a
reserved file, then commits it under its name.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightning_asyncckpt.tiers import packing, trusted_dirs
from lightning_asyncckpt.tiers.mapped import FilePool, MappedFile

_NAME = re.compile(r"step-(\d{10})\.owner-(\d+)\.json")
_ANY = re.compile(r"step-(\d{10})\.owner-\d+\.(pt|head|json)(\.tmp)?")


@dataclass(frozen=True)
class Held:
    """One share this rank holds: plain data, gathered across ranks to plan a recovery."""

    step: int
    owner: int
    nbytes: int  # of the .pt file (the tensors)
    crc32: int  # of the .pt file
    topology: tuple  # (world_size, jump, factor)
    mode: str = "replicated"  # shares.REPLICATED or shares.SHARDED: which shares a restore needs
    head_nbytes: int = 0
    head_crc32: int = 0
    run: str = ""  # the run that wrote it (tiers.run_identity); "": written before runs were named, never restored


class LocalStore:
    """(one rank) Reserves, commits, lists, reads and removes the shares this rank holds."""

    def __init__(self, root: Path, rank: int, keep_free: int = 0, base: Path | None = None) -> None:
        """``base``: the directory the user gave (``LocalTier.dir``), below which every directory is the
        tier's own (made here, 0700, never through a link); where None, the nearest of ``root`` and its
        parents that exists."""
        self.dir = holder_dir(root, rank)
        self.base = Path(base) if base is not None else _nearest_existing(Path(root))
        trusted_dirs.make(self.dir, self.base)  # the pool makes its files ahead here, before the first save
        self.pool = FilePool(self.dir, keep_free)

    def _file(self, step: int, owner: int, suffix: str) -> Path:
        return self.dir / f"{_share_name(step, owner)}{suffix}"

    def reserve(self, step: int, owner: int, nbytes: int) -> MappedFile:
        """(any thread) A mapped file for a share's tensors, not yet listed; raises ``OSError`` (ENOSPC)
        before anything is written."""
        trusted_dirs.make(self.dir, self.base)  # again: it may have been removed since (the CLI's --remove)
        return self.pool.take(self._file(step, owner, ".pt.tmp"), nbytes)

    def release(self, mapped: MappedFile) -> None:
        """(any thread) A reserved file that will not be committed: back to the pool, a spare for the next save."""
        if mapped.path is not None:
            self.pool.give_back(mapped.path)

    def commit(self, held: Held, mapped: MappedFile, head: bytes) -> None:
        """(any thread) Gives a reserved file its name and writes the header, then the manifest. Where that
        fails (ENOSPC), what it wrote is removed and the file is reserved again, unnamed (the caller releases
        it); the error names the file and the directory."""
        head_file, pt = self._file(held.step, held.owner, ".head"), self._file(held.step, held.owner, ".pt")
        _write_atomic(head_file, head)  # may fail (ENOSPC): .pt not named yet
        try:
            self.pool.rename(mapped.path, pt)
        except OSError:
            head_file.unlink(missing_ok=True)
            raise
        try:
            _write_atomic(self._file(held.step, held.owner, ".json"), json.dumps(asdict(held)).encode())
        except OSError:
            head_file.unlink(missing_ok=True)
            self.pool.rename(pt, self._file(held.step, held.owner, ".pt.tmp"))  # unnamed again: never listed
            raise

    def write(self, held: Held, flat: torch.Tensor, head: bytes) -> None:
        """Reserve, copy ``flat`` in and commit: one share written whole."""
        mapped = self.reserve(held.step, held.owner, held.nbytes)
        if held.nbytes:
            mapped.tensor.copy_(flat)
        self.commit(held, mapped, head)

    def holdings(self, topology: tuple) -> list[Held]:
        """Every complete share here saved under ``topology`` (a manifest whose files have their sizes)."""
        found = []
        if not self.dir.is_dir():
            return found
        for path in sorted(self.dir.iterdir()):
            held = read_manifest(path)
            if held is not None and held.topology == tuple(topology) and files_whole(self.dir, held):
                found.append(held)
        return found

    def saved_under_others(self, topology: tuple) -> dict[tuple, int]:
        """``{topology: newest step}`` of the complete shares here saved under another topology (another
        world size, ``replication_jump`` or ``replication_factor``): what a resized job cannot use."""
        newest: dict[tuple, int] = {}
        if self.dir.is_dir():
            for path in self.dir.iterdir():
                held = read_manifest(path)
                if held is not None and held.topology != tuple(topology) and files_whole(self.dir, held):
                    newest[held.topology] = max(newest.get(held.topology, -1), held.step)
        return newest

    def map(self, held: Held) -> tuple[bytes, torch.Tensor]:
        """The share's header and a private (copy-on-write) mapping of its tensors' bytes: no copy. For
        checksums and sends, and for a restored checkpoint once its step is :meth:`retire`-d."""
        return map_share(self.dir, held)

    def retire(self, step: int) -> None:
        """(recovery, every rank) The files of ``step`` in this holder directory back a restored checkpoint's
        tensors (private mappings, on this rank and its node's other ranks): never reused by a later save,
        only removed, so that nothing a save writes can show through a page that was not copied yet."""
        if self.dir.is_dir():
            for path in self.dir.glob(f"step-{step:010d}.owner-*.pt"):
                self.pool.forget(path)

    def remove_older(self, step: int) -> int:
        """Removes this holder's shares (and unfinished files) of steps before ``step``, the manifest first;
        their tensor files become the pool's spares. Returns the count of shares removed. A newer step's
        files are left alone: the writer thread may be writing them."""
        if not self.dir.is_dir():
            return 0
        old = [p for p in self.dir.iterdir() if (m := _ANY.fullmatch(p.name)) and int(m.group(1)) < step]
        order = {"json": 0, "head": 1, "pt": 2}  # once the manifest is gone, the share is no longer listed
        old.sort(key=lambda p: order[_ANY.fullmatch(p.name).group(2)])
        removed = 0
        for path in old:
            if path.name.endswith(".pt") or path.name.endswith(".pt.tmp"):
                self.pool.give_back(path)
            else:
                path.unlink(missing_ok=True)
            removed += path.name.endswith(".json")
        return removed

    def used_bytes(self) -> int:
        if not self.dir.is_dir():
            return 0
        total = 0
        for p in self.dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                st = p.lstat()
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        return total

    def close(self) -> None:
        self.pool.close()


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    """``data`` as ``path`` (0600), through ``<path>.tmp``: never through a link, and nothing left behind where
    it fails; an ``OSError`` names the file and its directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # a crashed save's: O_EXCL never opens an existing file (or a link)
        with os.fdopen(trusted_dirs.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(e.errno, f"{e.strerror or e}: writing {path.name} ({len(data)} bytes) in {path.parent}") from e


def _share_name(step: int, owner: int) -> str:
    return f"step-{step:010d}.owner-{owner}"


def read_manifest(path: Path) -> Held | None:
    """The share a manifest (``step-<step>.owner-<owner>.json``) describes; ``None`` for any other file, or
    one that cannot be read or parsed."""
    if not _NAME.fullmatch(Path(path).name):
        return None
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        raw = json.loads(trusted_dirs.read_file(Path(path)))
        return Held(int(raw["step"]), int(raw["owner"]), int(raw["nbytes"]), int(raw["crc32"]),
                    tuple(raw["topology"]), str(raw["mode"]), int(raw["head_nbytes"]), int(raw["head_crc32"]),
                    str(raw.get("run", "")))
    return None


def share_files(directory: Path, held: Held) -> tuple[Path, Path, Path]:
    """The share's ``.pt``, ``.head`` and ``.json`` files in ``directory`` (a holder directory)."""
    name = _share_name(held.step, held.owner)
    return tuple(Path(directory) / f"{name}{suffix}" for suffix in (".pt", ".head", ".json"))


def files_whole(directory: Path, held: Held) -> bool:
    """Whether the share's tensor and header files in ``directory`` have the sizes its manifest says."""
    pt, head, _ = share_files(directory, held)
    try:
        pts, heads = pt.lstat(), head.lstat()  # a link is no share
        return (stat.S_ISREG(pts.st_mode) and stat.S_ISREG(heads.st_mode) and pts.st_size == held.nbytes
                and heads.st_size == held.head_nbytes)
    except OSError:
        return False


def crc_mismatch(held: Held, head: bytes, flat: torch.Tensor, where: str) -> str | None:
    """``None`` if the share's bytes (``head``, ``flat``) have the CRC32s of its manifest, else the problem,
    naming the share and ``where`` its bytes came from."""
    actual, head_actual = packing.crc32(flat), packing.crc32(head)
    if actual == held.crc32 and head_actual == held.head_crc32:
        return None
    return (f"rank {held.owner}'s share in {where} has CRC32 {actual:08x}/{head_actual:08x},"
            f" its manifest {held.crc32:08x}/{held.head_crc32:08x}")


def holder_dir(root: Path, rank: int) -> Path:
    """The holder directory of ``rank`` under the tier's ``root``."""
    return Path(root) / f"holder-{rank}"


def map_share(directory: Path, held: Held) -> tuple[bytes, torch.Tensor]:
    """A share's header and a private (copy-on-write) mapping of its tensors' bytes in ``directory`` (any
    holder's; nothing of it is changed or removed)."""
    pt, head_file, _ = share_files(directory, held)
    head = trusted_dirs.read_file(head_file)
    if not held.nbytes:
        return head, torch.empty(0, dtype=torch.uint8)
    with os.fdopen(trusted_dirs.open_file(pt, os.O_RDONLY), "rb") as f:
        mapping = mmap.mmap(f.fileno(), held.nbytes, access=mmap.ACCESS_COPY)
    return head, torch.frombuffer(mapping, dtype=torch.uint8)
