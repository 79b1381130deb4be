"""Corrupted variants of real checkpoints (``tests/test_corruption.py``), and the runner that tries each one.

:func:`make_originals` writes a real single-file ``.ckpt`` and a real DCP directory with ``AsyncCheckpointIO`` from
a tiny ``Trainer`` run. :func:`make_variants` damages copies of them: truncations, bit flips in tensor records, in
the pickle and in the zip central directory, missing and truncated shards and skeletons, malicious pickles (a
``__reduce__`` that creates a marker file), crafted ``.metadata`` paths (absolute, ``..``, a symlink out, a FIFO),
FIFOs and links in place of the checkpoint. Each variant says what a load may give: ``"equal"`` (a harmless
change: the original, exactly), else ``"refuse"``.

``corrupt_runner.py`` tries each variant.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path


@dataclasses.dataclass
class Variant:
    name: str
    path: str
    original: str  # "file" or "dir": which original it was made from
    # "equal": loads as the original; "refuse": every load and verify must fail; "any": a harmless change or
    # a refusal (loads and verify agree); "unsafe": sound bytes whose pickle runs code: refused by the
    # weights_only load, and verify fails it or says it needs weights_only=False
    expect: str = "refuse"


class Payload:
    """Unpickled, creates the marker file (what a malicious checkpoint's code would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (self.marker, "w")


# -- the originals ---------------------------------------------------------------------------------------------
def make_originals(root: Path) -> dict[str, str]:
    """A single-file checkpoint and a DCP directory, each the last checkpoint of a tiny ``Trainer`` run with
    ``AsyncCheckpointIO`` (a fork worker)."""
    import lightning as L

    from helpers import TinyModel, loader, trainer
    from lightning_asyncckpt import AsyncCheckpointIO

    out = {}
    for kind, fmt in (("file", "auto"), ("dir", "dcp")):
        L.seed_everything(0)
        dirpath = root / f"run-{kind}"
        ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=dirpath, filename="last", save_top_k=1)
        t = trainer(root / f"tr-{kind}", [AsyncCheckpointIO(worker="fork", format=fmt)], [ckpt], max_steps=3)
        t.fit(TinyModel(width=32), loader(width=32))
        out[kind] = str(dirpath / "last.ckpt")
    return out


# -- damage ----------------------------------------------------------------------------------------------------
def _flip(path: Path, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _records(path: Path, base: int = 0, length: int | None = None) -> dict[str, tuple[int, int, int]]:
    """{record name: (absolute data offset, size, central entry offset)} of the zip archive at ``base``."""
    data = path.read_bytes()[base: None if length is None else base + length]
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        central = data.rfind(b"PK\x05\x06")
        cd_start = struct.unpack_from("<I", data, central + 16)[0]
        at = cd_start
        entries = {}
        while data[at:at + 4] == b"PK\x01\x02":
            n, m, k = struct.unpack_from("<HHH", data, at + 28)
            entries[data[at + 46: at + 46 + n].decode()] = at
            at += 46 + n + m + k
        for info in zf.infolist():
            h = info.header_offset
            n, m = struct.unpack_from("<HH", data, h + 26)
            out[info.filename.split("/", 1)[-1]] = (base + h + 30 + n + m, info.file_size, base + entries[info.filename])
    return out


def _copy(src: Path, dst: Path) -> Path:
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copyfile(src, dst)
    return dst


def _rewrite_metadata(path: Path, change) -> None:
    """Rewrites ``.metadata`` with ``change(relative_path) -> new`` applied to the first shard's entries."""
    from lightning_asyncckpt.format.metadata import read_metadata

    md = read_metadata(path)
    first = sorted({s.relative_path for s in md.storage_data.values()})[0]
    for k, s in list(md.storage_data.items()):
        if s.relative_path == first:
            md.storage_data[k] = dataclasses.replace(s, relative_path=change(first))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _rewrite_tensor(path: Path, size: list[int] | None = None, chunk: tuple[list[int], list[int]] | None = None) -> None:
    """Rewrites ``.metadata`` (with DCP's own types) so that its largest tensor declares ``size``, and its first
    chunk ``chunk`` (offsets, sizes), the chunk's storage entry moved to the new offsets."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    from lightning_asyncckpt.format.metadata import read_metadata

    md = read_metadata(path)
    fqn = _items(path)[0][0]
    entry = md.state_dict_metadata[fqn]
    if size is not None:
        entry.size = torch.Size(size)
    if chunk is not None:
        old = entry.chunks[0]
        entry.chunks[0] = ChunkStorageMetadata(offsets=torch.Size(chunk[0]), sizes=torch.Size(chunk[1]))
        stored = md.storage_data.pop(MetadataIndex(fqn, old.offsets))
        md.storage_data[MetadataIndex(fqn, torch.Size(chunk[0]), 0)] = stored
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _rewrite_storage(path: Path, change) -> None:
    """Rewrites ``.metadata`` with the storage entries ``change(metadata, largest, second largest)`` returns (the
    keys of the two largest items, which lie in the same shard)."""
    from lightning_asyncckpt.format.metadata import read_metadata

    md = read_metadata(path)
    largest = sorted(md.storage_data, key=lambda k: -md.storage_data[k].length)
    first = largest[0]
    second = next(k for k in largest[1:] if md.storage_data[k].relative_path == md.storage_data[first].relative_path)
    md.storage_data.update(change(md, first, second))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def huge_tensor(path: Path) -> Path:
    """``.metadata`` declares the largest tensor as 2**40 elements in one chunk (4 TiB of float32), its stored
    item unchanged: a load must refuse it before allocating anything."""
    _rewrite_tensor(path, [2**40], ([0], [2**40]))
    return path


def _items(path: Path) -> list[tuple[str, Path, int, int]]:
    """(fqn, shard, offset, length) of each item of a DCP directory, largest first."""
    from lightning_asyncckpt.format.metadata import read_metadata

    md = read_metadata(path)
    items = [(i.fqn, path / s.relative_path, s.offset, s.length) for i, s in md.storage_data.items()]
    return sorted(items, key=lambda e: -e[3])


def _metadata_entry(path: Path, fqn: str):
    from lightning_asyncckpt.format.metadata import read_metadata

    return read_metadata(path).state_dict_metadata[fqn]


def _tensor_records(path: Path, base: int = 0, length: int | None = None) -> list[tuple[str, int, int, int]]:
    return sorted(((n, *r) for n, r in _records(path, base, length).items() if n.startswith("data/")),
                  key=lambda r: -r[2])


def _file_variants(src: Path, out: Path, marker: str) -> list[Variant]:
    import torch

    vs: list[Variant] = []

    def new(name: str, expect: str = "refuse") -> Path:
        p = out / f"file-{name}.ckpt"
        vs.append(Variant(f"file-{name}", str(p), "file", expect))
        return p

    size = src.stat().st_size
    recs = _records(src)
    tensors = _tensor_records(src)
    for label, n in (("empty", 0), ("100b", 100), ("half", size // 2), ("minus1", size - 1), ("minus22", size - 22)):
        p = _copy(src, new(f"truncated-{label}"))
        os.truncate(p, n)
    for i, (_name, at, n, _) in enumerate(tensors[:6]):  # a bit in the middle of each of the largest tensors
        _flip(_copy(src, new(f"flip-tensor{i}")), at + n // 2)
    name, at, n, _ = tensors[0]
    _flip(_copy(src, new("flip-tensor-first-byte")), at, 0x01)
    _flip(_copy(src, new("flip-tensor-last-byte")), at + n - 1, 0x80)
    p = _copy(src, new("weight-1234.5"))
    with open(p, "r+b") as f:  # a weight set to 1234.5, as an editor of the bytes would
        f.seek(at + 4 * 3)
        f.write(struct.pack("<f", 1234.5))
    pkl_at, pkl_n, pkl_cd = recs["data.pkl"]
    _flip(_copy(src, new("flip-pickle")), pkl_at + pkl_n // 2, 0x01)
    _flip(_copy(src, new("flip-central-crc")), tensors[1][3] + 16)  # the CRC32 field of a central entry
    _flip(_copy(src, new("flip-central-name")), tensors[1][3] + 46 + 3)
    _flip(_copy(src, new("flip-central-size")), tensors[1][3] + 24, 0x01)  # its uncompressed size
    _flip(_copy(src, new("flip-local-header", "any")), tensors[0][1] - 30 - 10)  # the local header's name
    data = src.read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    _flip(_copy(src, new("flip-eocd-offset", "any")), eocd + 16, 0x04)
    new("garbage").write_bytes(os.urandom(4096))
    p = new("appended-garbage", "any")
    p.write_bytes(data + os.urandom(1000))
    # malicious pickles, with valid CRC32s: a __reduce__ that creates the marker
    evil = torch.load(src, weights_only=True)
    evil["hyper_parameters"] = {"payload": Payload(marker)}
    torch.save(evil, new("malicious-reduce", "unsafe"))
    with open(new("malicious-legacy"), "wb") as f:  # a legacy (non-zip) torch.save: a bare pickle
        pickle.dump(Payload(marker), f)
    # links and special files in place of the checkpoint
    os.symlink(src, new("symlink-to-original", "equal"))
    os.link(src, new("hardlink-to-original", "equal"))
    os.symlink("/etc/hostname", new("symlink-to-etc"))
    os.mkfifo(new("fifo"))
    fifo = out / "a-fifo"
    os.mkfifo(fifo)
    os.symlink(fifo, new("symlink-to-fifo"))
    os.symlink("/dev/zero", new("symlink-to-dev-zero"))
    return vs


def _dir_variants(src: Path, out: Path, marker: str) -> list[Variant]:
    import torch

    from lightning_asyncckpt.format.metadata import read_metadata
    from lightning_asyncckpt.storage import commit

    vs: list[Variant] = []

    def new(name: str, expect: str = "refuse") -> Path:
        p = out / f"dir-{name}.ckpt"
        vs.append(Variant(f"dir-{name}", str(p), "dir", expect))
        return _copy(src, p)

    items = _items(src)
    shards = sorted({str(s) for _, s, _, _ in items})
    skeleton = commit.SKELETON_FILE
    (new("metadata-missing") / ".metadata").unlink()
    p = new("metadata-truncated")
    os.truncate(p / ".metadata", (p / ".metadata").stat().st_size // 2)
    p = new("metadata-flipped")
    _flip(p / ".metadata", (p / ".metadata").stat().st_size // 2, 0xFF)
    for i, shard in enumerate(shards):
        rel = Path(shard).name
        (new(f"shard{i}-missing") / rel).unlink()
        os.truncate(new(f"shard{i}-empty") / rel, 0)
        os.truncate(new(f"shard{i}-half") / rel, Path(shard).stat().st_size // 2)
        os.truncate(new(f"shard{i}-minus1") / rel, Path(shard).stat().st_size - 1)
    for i, (_fqn, shard, offset, length) in enumerate(items[:5]):  # bits in the largest items' tensor data
        name, at, n, cd = _tensor_records(shard, offset, length)[0]
        _flip(new(f"flip-item{i}") / shard.name, at + n // 2)
    fqn, shard, offset, length = items[0]
    name, at, n, cd = _tensor_records(shard, offset, length)[0]
    _flip(new("flip-item-central-crc") / shard.name, cd + 16)
    _flip(new("flip-item-local-header", "any") / shard.name, offset + 20, 0x01)  # the first record's sizes
    p = new("item-weight-1234.5")
    with open(p / shard.name, "r+b") as f:
        f.seek(at + 8)
        f.write(struct.pack("<f", 1234.5))
    (new("skeleton-missing") / skeleton).unlink()
    p = new("skeleton-truncated")
    os.truncate(p / skeleton, (p / skeleton).stat().st_size // 2)
    p = new("skeleton-flip-pickle")
    pkl_at, pkl_n, _ = _records(p / skeleton)["data.pkl"]
    _flip(p / skeleton, pkl_at + pkl_n // 2, 0x01)
    torch.save({"payload": Payload(marker)}, new("skeleton-malicious", "unsafe") / skeleton)
    with open(new("metadata-malicious") / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    # crafted .metadata: where the first shard's items are read from
    _rewrite_metadata(new("path-absolute"), lambda rel: "/etc/hostname")
    _rewrite_metadata(new("path-dotdot"), lambda rel: f"../{Path(src).parent.name}/{Path(src).name}/{rel}")
    _rewrite_metadata(new("path-dotdot-etc"), lambda rel: "../" * 30 + "etc/hostname")
    p = new("path-symlink-out")
    os.symlink("/etc/hostname", p / "out.distcp")
    _rewrite_metadata(p, lambda rel: "out.distcp")
    p = new("path-fifo")
    os.mkfifo(p / "fifo.distcp")
    _rewrite_metadata(p, lambda rel: "fifo.distcp")
    p = new("path-dev-zero")
    _rewrite_metadata(p, lambda rel: "/dev/zero")
    p = new("path-directory")
    _rewrite_metadata(p, lambda rel: ".")
    p = new("shard-fifo")
    (p / Path(shards[0]).name).unlink()
    os.mkfifo(p / Path(shards[0]).name)
    p = new("shard-symlink-out")  # the shard's own bytes, but outside the checkpoint: refused all the same
    (p / Path(shards[0]).name).unlink()
    os.symlink(shards[0], p / Path(shards[0]).name)
    p = new("skeleton-fifo")
    (p / skeleton).unlink()
    os.mkfifo(p / skeleton)
    p = new("skeleton-symlink-etc")
    (p / skeleton).unlink()
    os.symlink("/etc/hostname", p / skeleton)
    p = new("info-fifo", "any")  # who wrote it: read by inspect, and by the load for the layout
    (p / commit.INFO_FILE).unlink()
    os.mkfifo(p / commit.INFO_FILE)
    # crafted .metadata: tensor sizes that do not match the stored bytes (each would allocate before reading)
    huge_tensor(new("metadata-huge-tensor"))
    size = list(_metadata_entry(src, items[0][0]).size)
    _rewrite_tensor(new("metadata-size-doubled"), [2 * size[0], *size[1:]])  # its one chunk fills half of it
    _rewrite_tensor(new("metadata-chunk-larger-than-stored"), [64 * size[0], *size[1:]],
                    ([0] * len(size), [64 * size[0], *size[1:]]))  # tiles its size, needs 64x the stored bytes
    _rewrite_tensor(new("metadata-chunk-outside"), None, ([size[0], *[0] * (len(size) - 1)], size))
    p = new("metadata-entry-without-size")  # a damaged pickle can rename a field of an entry
    md = read_metadata(p)
    del md.state_dict_metadata[items[0][0]].size
    with open(p / ".metadata", "wb") as f:
        pickle.dump(md, f)
    # one stored item read for two entries: a byte range shared, or a shard read again through a hard link
    _rewrite_storage(new("metadata-items-overlap"), lambda md, first, second: {second: dataclasses.replace(
        md.storage_data[second], offset=md.storage_data[first].offset, length=md.storage_data[first].length)})
    p = new("shard-hardlink")
    os.link(p / Path(shards[0]).name, p / "again.distcp")
    _rewrite_storage(p, lambda md, first, second: {k: dataclasses.replace(v, relative_path="again.distcp")
                                                   for k, v in md.storage_data.items() if k.fqn == second.fqn})
    link = out / "dir-symlink-to-original.ckpt"
    os.symlink(src, link)
    vs.append(Variant("dir-symlink-to-original", str(link), "dir", "equal"))
    return vs


def make_variants(originals: dict[str, str], out: Path, marker: str) -> list[Variant]:
    out.mkdir(parents=True, exist_ok=True)
    return (_file_variants(Path(originals["file"]), out, marker)
            + _dir_variants(Path(originals["dir"]), out, marker))
