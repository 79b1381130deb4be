"""One rank's files in the node-local directory.

``<root>/holder-<rank>/step-<step>.owner-<owner>.pt`` is the share of rank ``owner`` at ``step`` as this
rank holds it (its own, or a replica), and ``....json`` beside it its manifest: size, CRC32 and the
topology it was saved under. The manifest is written (atomically) after the share, so a share without
one is unfinished and never used. Removal touches only this rank's own holder directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_NAME = re.compile(r"step-(\d{10})\.owner-(\d+)\.json")


@dataclass(frozen=True)
class Held:
    """One share this rank holds: plain data, gathered across ranks to plan a recovery."""

    step: int
    owner: int
    nbytes: int
    crc32: int
    topology: tuple  # (world_size, jump, factor)
    mode: str = "replicated"  # shares.REPLICATED or shares.SHARDED: which shares a restore needs


class LocalStore:
    """(one rank) Writes, lists, reads and removes the shares this rank holds."""

    def __init__(self, root: Path, rank: int) -> None:
        self.dir = Path(root) / f"holder-{rank}"

    def _paths(self, step: int, owner: int) -> tuple[Path, Path]:
        stem = f"step-{step:010d}.owner-{owner}"
        return self.dir / f"{stem}.pt", self.dir / f"{stem}.json"

    def write(self, step: int, owner: int, parts: list[torch.Tensor], crc: int, topology: tuple,
              mode: str = "replicated") -> None:
        """Writes one share (its ``uint8`` parts, one after the other), then its manifest; each appears at
        its name only when complete."""
        self.dir.mkdir(parents=True, exist_ok=True)
        blob, manifest = self._paths(step, owner)
        tmp = blob.with_name(blob.name + ".tmp")
        with open(tmp, "wb") as f:
            for p in parts:  # the write releases the GIL: training's Python goes on meanwhile
                f.write(memoryview(p.numpy()))
        os.replace(tmp, blob)
        held = Held(step, owner, sum(p.numel() for p in parts), crc, tuple(topology), mode)
        _write_atomic(manifest, json.dumps(asdict(held)).encode())

    def holdings(self, topology: tuple) -> list[Held]:
        """Every complete share here saved under ``topology`` (a manifest whose share has its size)."""
        found = []
        if not self.dir.is_dir():
            return found
        for path in sorted(self.dir.iterdir()):
            if not _NAME.fullmatch(path.name):
                continue
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                raw = json.loads(path.read_text())
                held = Held(int(raw["step"]), int(raw["owner"]), int(raw["nbytes"]), int(raw["crc32"]),
                            tuple(raw["topology"]), str(raw.get("mode", "replicated")))
                blob = self._paths(held.step, held.owner)[0]
                if held.topology == tuple(topology) and blob.stat().st_size == held.nbytes:
                    found.append(held)
        return found

    def read(self, held: Held) -> torch.Tensor:
        """The share's bytes, as a ``uint8`` tensor (read into its own buffer, which unpacking then views)."""
        path = self._paths(held.step, held.owner)[0]
        buf = bytearray(path.stat().st_size)
        with open(path, "rb") as f:
            f.readinto(buf)
        return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)

    def remove_older(self, step: int) -> int:
        """Removes this holder's shares (and unfinished files) of steps before ``step``; returns the count.
        A newer step's files are left alone: the writer thread may be writing them."""
        removed = 0
        if not self.dir.is_dir():
            return removed
        for path in self.dir.iterdir():
            m = re.fullmatch(r"step-(\d{10})\.owner-\d+\.(pt|json)(\.tmp)?", path.name)
            if m and int(m.group(1)) < step:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
        return removed

    def used_bytes(self) -> int:
        if not self.dir.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
