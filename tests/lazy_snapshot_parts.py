"""What the lazy-snapshot tests (``test_lazy_snapshot*.py``) share: an ``AsyncCheckpointIO(snapshot="lazy")``
with a persistent worker, a small Adam loop without Lightning whose weights are above the lazy threshold, its
state as the loop would save it, and the bytes the plugin holds in staging buffers."""

from __future__ import annotations

import torch

from lightning_asyncckpt import AsyncCheckpointIO

WIDTH = 256  # 256 KiB per weight: above the lazy threshold


def lazy_io(**kw):
    return AsyncCheckpointIO("nvrx", worker="persistent", snapshot="lazy", **kw)


def torch_state(model, opt, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def fabric_loop_parts(width=WIDTH):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, width)

    def forward_backward():
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    return model, opt, forward_backward


def staged_bytes(io):
    return sum(b.numel() * b.element_size() for b in io.session.staging_buffers())
