"""``lightning-asyncckpt inspect`` on real checkpoints written by ``AsyncCheckpointIO`` (single-writer and
sharded), a stock DCP one and incomplete ones: status, step and epoch, who wrote it, the tensors and the largest
of them, as text and as JSON."""

from __future__ import annotations

import json

from cli_checkpoints import ckpts_fixture  # noqa: F401 - the fixture ckpts
from cli_checkpoints import copy_dir as _copy

from helpers import run_cli as run
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.storage import commit


def test_inspect_json_reports_the_checkpoint(ckpts, capsys):
    code, out, err = run(capsys, "inspect", ckpts.single, "--json")
    assert code == 0, err
    info = json.loads(out)
    _, tensors = staging.split(ckpts.ckpt)
    sizes = sorted(((t.numel() * t.element_size(), name, list(t.shape), str(t.dtype)[6:])
                    for name, t in tensors.items()), key=lambda s: (-s[0], s[1]))
    assert info["status"] == "committed" and info["reason"] is None and info["layout"] == "single-writer"
    assert (info["global_step"], info["epoch"]) == (120, 3)
    # who wrote it, from the .asyncckpt.json the library writes beside .metadata
    assert (info["engine"], info["worker"], info["world_size"], info["writer_ranks"]) == ("nvrx", "fork", 1, 1)
    assert info["engine_version"] and info["written_by"].startswith("lightning-asyncckpt ")
    assert info["num_tensors"] == len(tensors) == 6
    assert info["tensor_bytes"] == sum(s[0] for s in sizes)
    assert info["largest_tensors"] == [{"name": n, "shape": s, "dtype": d, "bytes": b} for b, n, s, d in sizes[:5]]
    assert info["largest_tensors"][0] == {"name": "state_dict.layer.weight", "shape": [64, 32], "dtype": "float32",
                                          "bytes": 8192}
    assert info["non_tensor_keys"] == list(ckpts.ckpt)
    assert info["files"] == 5 and info["file_bytes"] == sum(p.stat().st_size for p in ckpts.single.iterdir())


def test_inspect_text(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.single)
    assert code == 0
    fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith("  ") and ":" in line)
    assert fields["status"].strip() == "committed"
    assert fields["global step"].strip() == "120" and fields["epoch"].strip() == "3"
    assert fields["tensors"].strip().startswith("6 (")
    assert "state_dict.layer.weight" in out and "[64, 32]" in out and "bfloat16" in out
    assert fields["engine"].strip().startswith("nvrx ") and "fork worker" in fields["engine"]
    assert fields["world size"].strip().startswith("1")


def test_inspect_sharded_reads_step_from_meta(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.sharded, "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "sharded"
    assert (info["global_step"], info["epoch"]) == (7, 1)
    assert info["non_tensor_keys"] == list(ckpts.meta)
    assert info["num_tensors"] == 2 and info["tensor_bytes"] == 2 * 8 * 4 * 4


def test_inspect_stock_dcp_checkpoint(ckpts, capsys):
    code, out, _ = run(capsys, "inspect", ckpts.nocrc, "--json")
    info = json.loads(out)
    assert code == 0 and info["layout"] == "dcp" and info["status"] == "committed"
    assert (info["global_step"], info["epoch"]) == (120, 3)
    assert info["non_tensor_keys"] == ["global_step", "epoch"] and info["num_tensors"] == 4
    assert info["engine"] == "unknown" and info["world_size"] == "unknown"  # not written by this library


def test_inspect_incomplete(ckpts, tmp_path, capsys):
    no_meta = _copy(ckpts.single, tmp_path / "a.ckpt")
    (no_meta / ".metadata").unlink()
    code, out, _ = run(capsys, "inspect", no_meta, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and "no .metadata" in info["reason"]
    assert info["num_tensors"] is None and info["writer_ranks"] == 1 and info["files"] == 4  # 2 shard files, .asyncckpt.json, skeleton

    leftover = _copy(ckpts.single, tmp_path / f"{commit.INCOMPLETE_PREFIX}123-1")  # complete, never renamed
    code, out, _ = run(capsys, "inspect", leftover, "--json")
    info = json.loads(out)
    assert code == 0 and info["status"] == "incomplete" and "interrupted save" in info["reason"]
    assert info["global_step"] == 120

    code, out, _ = run(capsys, "inspect", no_meta)
    assert code == 0 and "incomplete" in out
