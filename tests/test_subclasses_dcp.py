"""``format="dcp"`` and every-rank (replicated) DCP saves hold torchao's low-bit optimizer states as stock's DCP
save of the same state does: one item per tensor (the subclass saved whole), not its inner tensors as items."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.format.metadata import read_metadata
from lightning_asyncckpt.pipeline import dcp_plan
from lightning_asyncckpt.snapshot import staging

optim = pytest.importorskip("torchao.optim", reason="torchao is a test extra")


@pytest.fixture(autouse=True)
def eager_steps(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: fn)  # torchao compiles its step at each call


def _checkpoint(width: int = 256, steps: int = 1) -> dict:
    torch.manual_seed(steps)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    opt = optim.AdamW8bit(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, width)).pow(2).mean().backward()
        opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": steps}


def _states(ck: dict) -> dict:
    return {(str(p), k): v for p, s in ck["optimizer_states"][0]["state"].items() for k, v in s.items()}


def _assert_same_states(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, w in want.items():
        g = got[key]
        assert (type(g), g.dtype, g.shape) == (type(w), w.dtype, w.shape), key
        if hasattr(w, "codes"):
            assert torch.equal(g.codes, w.codes) and torch.equal(g.scale, w.scale) and torch.equal(g.qmap, w.qmap), key
        else:
            assert torch.equal(g, w), key


def test_format_dcp_holds_each_torchao_state_as_one_item_as_stock_dcp_save_does(tmp_path):
    ck = _checkpoint()
    dcp.save(ck, checkpoint_id=tmp_path / "stock", no_dist=True)
    aio = AsyncCheckpointIO("nvrx", worker="fork", format="dcp", timeout_s=120)
    try:
        aio.save_checkpoint(ck, tmp_path / "ours")
        aio.finalize(blocking=True)
        back = aio.load_checkpoint(tmp_path / "ours", weights_only=True)
    finally:
        aio.teardown()
    stock_items = set(read_metadata(tmp_path / "stock").state_dict_metadata)
    ours_items = set(read_metadata(tmp_path / "ours").state_dict_metadata)
    assert ours_items == stock_items, (sorted(ours_items - stock_items), sorted(stock_items - ours_items))
    _assert_same_states(_states(back), _states(ck))  # through the plugin: the subclasses, as saved
    target = _checkpoint(steps=2)  # plain DCP reads ours into another run's state, as it reads stock's
    dcp.load(target, checkpoint_id=tmp_path / "ours", no_dist=True)
    _assert_same_states(_states(target), _states(ck))
    stock_back = dcp_format.load(tmp_path / "stock", weights_only=True)  # and we read stock's without dequantizing
    _assert_same_states(_states(stock_back), _states(ck))


def test_every_ranks_share_holds_each_torchao_state_whole_on_one_rank():
    """An every-rank save (``AsyncDDPStrategy``) splits the tensors between the ranks: a state's inner tensors stay
    together, so that the rank that writes it writes the one item stock's DCP save writes."""
    ck = _checkpoint(width=64)
    snaps = [staging.Stager(shared=False, copy_cpu=True).snapshot(ck, rank=r, world_size=2) for r in range(2)]
    items = [dcp_plan.replicated_items(s.skeleton, s.tensors, everything=r == 0) for r, s in enumerate(snaps)]
    states = {k for _, k in _states(ck)}
    for key in ("optimizer_states.0.state.0.exp_avg", "optimizer_states.0.state.0.exp_avg_sq"):
        holders = [r for r, (got, _) in enumerate(items) if key in got]
        assert len(holders) == 1, (key, holders)
        whole, want = items[holders[0]][0][key], ck["optimizer_states"][0]["state"][0][key.rsplit(".", 1)[1]]
        assert type(whole) is type(want) and torch.equal(whole.codes, want.codes), key
    for got, paths in items:
        assert not any(k.endswith((".codes", ".scale", ".qmap")) for k in list(got) + list(paths))
    assert states == {"exp_avg", "exp_avg_sq", "step"}
