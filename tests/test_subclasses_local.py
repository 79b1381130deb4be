"""torchao's low-bit optimizer states in the local tier, as stock's DCP save holds them: a local step keeps
each state's subclass and its own bytes (no float32 copy of it), a resume from it gives the optimizer the
same subclasses back, and training goes on with the losses of a resume from stock's checkpoint of the same
state. One process, the tier's own files (no worker: the local tier writes on the training thread)."""

from __future__ import annotations

import io
import os

import pytest
import torch

from lightning_asyncckpt import LocalTier
from lightning_asyncckpt.snapshot import subclasses

optim = pytest.importorskip("torchao.optim", reason="torchao is a test extra")

WIDTH = 128  # torchao quantizes the states of tensors of 4096 elements and more: the two weights here


@pytest.fixture(autouse=True)
def eager_steps(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: fn)  # torchao compiles its step at each call


def _model_and_optimizer(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    return model, getattr(optim, name)(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, WIDTH, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _own_bytes(t: torch.Tensor) -> int:
    """A state's bytes as stock's DCP save holds them: a wrapper's inner tensors, else the tensor's."""
    if subclasses.is_wrapper(t):
        return sum(_own_bytes(getattr(t, n)) for n in subclasses.inner_names(t))
    return t.numel() * t.element_size()


def _types(opt_state: dict) -> dict:
    return {(p, k): (type(v).__name__, v.dtype, tuple(v.shape)) for p, s in opt_state["state"].items()
            for k, v in s.items() if isinstance(v, torch.Tensor)}


def _tier(dir):
    from lightning_asyncckpt.tiers.setup import open_tier

    return open_tier(LocalTier(dir, emergency_signals=()), node_rank=0, local_world_size=1)


def _resumed(name: str, ck: dict) -> tuple[dict, list[float]]:
    """A fresh model and optimizer loaded from ``ck``: the optimizer state's types, and 3 more steps' losses."""
    model, opt = _model_and_optimizer(name)
    model.load_state_dict(ck["state_dict"])
    opt.load_state_dict(ck["optimizer_states"][0])
    types = _types(opt.state_dict())
    return types, _train(model, opt, 3, seed=1)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_a_local_resume_keeps_torchao_states_their_bytes_and_a_stock_resumes_losses(name, tmp_path):
    model, opt = _model_and_optimizer(name)
    _train(model, opt, 2, seed=0)
    ck = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 2}
    before = _types(ck["optimizer_states"][0])
    assert {t for t, _, _ in before.values()} >= {name.replace("AdamW", "OptimState")}
    buf = io.BytesIO()
    torch.save(ck, buf)  # stock's checkpoint of the same state
    stock = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)

    run = _tier(tmp_path)
    try:
        run.save(2, ck)
        assert run.finish() == 2
    finally:
        run.close()
    tier_bytes = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.suffix in (".pt", ".head"))
    own = sum(_own_bytes(t) for t in (*ck["state_dict"].values(),
                                      *(v for s in ck["optimizer_states"][0]["state"].values() for v in s.values()))
              if isinstance(t, torch.Tensor))
    assert own <= tier_bytes <= 1.05 * own, (tier_bytes, own)  # no dequantized float32 copy of a state

    run = _tier(tmp_path)
    try:
        local = run.take(run.latest(None))
        assert local is not None and local["global_step"] == 2
        local_types, local_losses = _resumed(name, local)
    finally:
        run.close()
    stock_types, stock_losses = _resumed(name, stock)
    assert local_types == stock_types == before
    assert local_losses == stock_losses
    assert not [m for m in open(f"/proc/{os.getpid()}/maps").read().splitlines() if str(tmp_path) in m]
