"""shard_file: a DCP shard written with torch.save's CRC32 off holds, byte for byte, what torch writes with it on;
a region that looks like an archive but is not one fails the write instead of leaving a CRC32 of zero."""

import io

import pytest
import torch

from lightning_asyncckpt.write import direct_io, shard_file


def _items():
    big = torch.randn(300, 256)
    return big, [torch.arange(5), b"raw bytes item", big, torch.zeros(0), {"step": 3}]


def _write(f, items):
    """As DCP's ``_write_item`` does: ``tell()`` before and after each item."""
    for item in items:
        f.tell()
        if isinstance(item, bytes):
            f.write(item)
        else:
            torch.save(item, f)
        f.tell()


def test_archives_get_the_crc32_torch_would_have_written(tmp_path):
    big, items = _items()
    expected = io.BytesIO()
    _write(expected, items)  # torch's own CRC32
    path = tmp_path / "shard.distcp"
    with shard_file.crc32_off_for([]):
        assert not torch.serialization.get_crc32_options()
        with shard_file.ShardFile(str(path), direct_io.storage_regions([big])) as f:
            _write(f, items)
    assert torch.serialization.get_crc32_options()  # restored
    assert path.read_bytes() == expected.getvalue()


def test_a_region_that_is_not_an_archive_fails_the_write(tmp_path):
    path = tmp_path / "shard.distcp"
    with pytest.raises(ValueError, match=r"shard\.distcp: bytes 0 to 12 are not one torch.save archive"):
        with shard_file.ShardFile(str(path), []) as f:
            f.tell()
            f.write(b"PK\x03\x04 garbage")
            f.tell()


def test_a_storage_extension_keeps_torchs_crc32():
    class Transforms:
        extensions = ["zstd"]

    with shard_file.crc32_off_for([Transforms()]):
        assert torch.serialization.get_crc32_options()


def test_two_archives_without_a_boundary_between_them_fail_the_write(tmp_path):
    """A region must be one archive: two with no ``tell()`` between them would leave the first one's CRC32
    at zero, so the write fails instead."""
    path = tmp_path / "shard.distcp"
    with pytest.raises(ValueError, match=r"not one torch.save archive \(\d+ bytes before the archive's first record"):
        with shard_file.crc32_off_for([]), shard_file.ShardFile(str(path), []) as f:
            f.tell()
            torch.save(torch.arange(5), f)
            torch.save(torch.arange(7), f)
            f.tell()
