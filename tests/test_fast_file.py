"""The writer's fast file path (``O_DIRECT`` chunks, ISA-L CRC32s) and its plain fallback
(``LIGHTNING_ASYNCCKPT_FAST_WRITE=0``) write the same bytes, which are stock ``torch.save``'s."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from lightning_asyncckpt import engines
from lightning_asyncckpt.pipeline import dcp_plan
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.write import dcp_writer, fast_file, torch_file
from lightning_asyncckpt.write.jobs import DcpJob


def _state() -> dict:
    return {"w": torch.randn(300, 257), "b": torch.arange(70_000, dtype=torch.int64), "tied": None,
            "step": 7, "name": "x", "h": torch.ones(3, dtype=torch.bfloat16)}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_a_file_is_stocks_bytes_either_way(tmp_path, monkeypatch, fast):
    monkeypatch.setenv(fast_file.ENV_VAR, "1" if fast else "0")
    assert fast_file.enabled() is fast
    state = _state()
    stock = io.BytesIO()
    torch.save(state, stock)
    snap = staging.Stager(shared=False, copy_cpu=True).snapshot(state)
    path = tmp_path / "ours.ckpt"
    nbytes = torch_file.write_file(snap.skeleton, snap.tensors, path)
    assert path.read_bytes() == stock.getvalue() and nbytes == len(stock.getvalue())


def test_dcp_shards_are_the_same_bytes_either_way(tmp_path, monkeypatch):
    state = _state()
    snap = staging.Stager(shared=False, copy_cpu=True).snapshot(state)
    eng = engines.create(engines.EngineName("nvrx"), engines.WorkerMode("fork"), 0)
    written = {}
    for how in ("1", "0"):
        monkeypatch.setenv(fast_file.ENV_VAR, how)
        out = tmp_path / how
        plan = dcp_plan.plan_local_save(snap, out, eng.writer_cls, 2, eng.split_by_size)
        out.mkdir(exist_ok=True)
        dcp_writer.write_job(DcpJob(eng.writer_cls, plan.transforms, plan.buckets, str(tmp_path / f"{how}.result")))
        with open(tmp_path / f"{how}.result", "rb") as f:
            outcome = pickle.load(f)
        assert outcome["ok"], outcome
        written[how] = {p.name: p.read_bytes() for p in sorted(Path(out).iterdir())}
    assert len(written["1"]) == 2 and written["1"] == written["0"]
