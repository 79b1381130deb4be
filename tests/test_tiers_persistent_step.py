"""The step of a persistent checkpoint, which the local tier's recovery compares with its own: read from the
``torch.save`` archive's pickle alone, without importing or running anything of it and without its tensors,
from a local file or from an object on a real S3-protocol server (moto on loopback)."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_asyncckpt.tiers.persistent_step import global_step


class _RunsCode:
    """Unpickled normally (``torch.load(weights_only=False)``), it removes the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.remove, (self.path,))


def _checkpoint(marker, **steps):
    state_dict = torch.nn.Linear(256, 256).state_dict()  # an OrderedDict with its _metadata, as Lightning saves it
    return {**steps, "epoch": 0, "state_dict": state_dict, "hyper_parameters": {"x": _RunsCode(marker)},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1}]}]}


def test_the_step_of_a_file_is_read_without_running_anything_it_names(tmp_path):
    marker = tmp_path / "marker"
    marker.touch()
    path = tmp_path / "last.ckpt"
    torch.save(_checkpoint(str(marker), global_step=12), path)
    assert global_step(path) == 12
    assert marker.exists()  # the pickle's os.remove was never called
    torch.load(path, weights_only=False)  # as a plain load does: the check above can fail
    assert not marker.exists()


def test_a_fabric_state_gives_its_step_and_a_file_without_either_gives_none(tmp_path, caplog):
    torch.save({"step": 5, "model": {"w": torch.ones(2)}}, tmp_path / "fabric.ckpt")
    assert global_step(tmp_path / "fabric.ckpt") == 5
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "none.ckpt")
    (tmp_path / "junk.ckpt").write_bytes(b"not an archive")
    assert global_step(tmp_path / "none.ckpt") is None and global_step(tmp_path / "junk.ckpt") is None
    assert caplog.text.count("cannot read the global step") == 2
    assert global_step(tmp_path / "missing.ckpt") is None and global_step(None) is None


def test_the_step_of_an_object_on_s3_is_read_from_its_pickle_alone(tmp_path, s3):
    marker = tmp_path / "marker"
    marker.touch()
    path = tmp_path / "last.ckpt"
    big = _checkpoint(str(marker), global_step=30)
    big["state_dict"]["big"] = torch.zeros(16 << 20, dtype=torch.uint8)  # 16 MiB the read must not fetch
    torch.save(big, path)
    s3.fs.put(str(path), "ckpt/run1/last.ckpt")
    before = s3.get_bytes()
    assert global_step("s3://ckpt/run1/last.ckpt") == 30
    assert s3.get_bytes() - before < 2 << 20, s3.get_bytes() - before  # 1.05 MB when written
    assert marker.exists()
    # a directory with this package's record, as its DCP saves write it
    s3.fs.pipe("ckpt/run1/dcp/.asyncckpt.json", b'{"global_step": 31}')
    s3.fs.pipe("ckpt/run1/dcp/.metadata", b"x")
    assert global_step("s3://ckpt/run1/dcp") == 31
    assert global_step("s3://ckpt/run1/missing.ckpt") is None


@pytest.mark.parametrize("key", ["global_step", "step"])
def test_a_dcp_directory_gives_the_step_of_its_meta_pt(tmp_path, key):
    (tmp_path / "d").mkdir()
    torch.save({key: 9, "epoch": 1}, tmp_path / "d" / "meta.pt")
    assert global_step(tmp_path / "d") == 9
