"""Tensor subclasses are written as stock writes them: torchao's low-bit optimizer states (traceable wrapper
subclasses) keep their type, dtype and bytes in a ``torch.save`` file (byte for byte stock's), in a DCP
directory and in the local tier; the snapshot copies (or, lazily, proves) their inner tensors; only
TransformerEngine's tensors are dequantized, recognized by their module; and a file holding them loads
through the plugin with Lightning's callable ``map_location``, where stock's loader refuses it."""

from __future__ import annotations

import io
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.integration import map_location
from lightning_asyncckpt.pipeline.scheduler import torch_bytes
from lightning_asyncckpt.snapshot import lazy, staging, subclasses
from lightning_asyncckpt.tiers import packing, shares
from lightning_asyncckpt.write import file_layout, torch_file

optim = pytest.importorskip("torchao.optim", reason="torchao is a test extra")

OPTIMIZERS = ["AdamW8bit", "AdamW4bit", "AdamWFp8"]


@pytest.fixture(autouse=True)
def eager_steps(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, *args, **kwargs: fn)  # torchao compiles its step at each call


def _checkpoint(name: str, width: int = 256, steps: int = 1) -> tuple[dict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    opt = getattr(optim, name)(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, width)).pow(2).mean().backward()
        opt.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": steps}, opt


def _types(ck: dict) -> dict:
    return {(p, k): (type(v).__name__, v.dtype, tuple(v.shape))
            for p, s in ck["optimizer_states"][0]["state"].items() for k, v in s.items()}


def _write(ck: dict, path, defer=None) -> tuple[staging.Snapshot, staging.Stager]:
    """The plugin's file write, in this process: the layout, the snapshot, the skeleton's bytes, the writer."""
    staged, lay = file_layout.prepare(ck)
    stager = staging.Stager(shared=False, copy_cpu=True)
    snap = stager.snapshot(staged, defer=defer, objects=True)
    return snap, lambda: torch_file.write_file(torch.load(io.BytesIO(torch_bytes(snap.skeleton)), weights_only=False),
                                               snap.tensors, path, lay.aliases, lay.locations, lay.same_object, lay.kinds)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_torchao_states_are_written_as_stock_writes_them(name, tmp_path):
    ck, opt = _checkpoint(name)
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "stock.ckpt")
    snap, write = _write(ck, tmp_path / "ours.ckpt")
    # the snapshot is a copy: a step taken now does not reach the file
    before = {k: v.dequantize().clone() for k, v in ck["optimizer_states"][0]["state"][0].items() if k != "step"}
    next(iter(opt.param_groups[0]["params"])).grad.mul_(-3)
    opt.step()
    assert not torch.equal(ck["optimizer_states"][0]["state"][0]["exp_avg"].dequantize(), before["exp_avg"])
    write()
    stock = torch.load(tmp_path / "stock.ckpt", map_location="cpu", weights_only=True)
    ours = torch.load(tmp_path / "ours.ckpt", map_location="cpu", weights_only=True)
    assert _types(ours) == _types(stock)
    assert {t for t, _, _ in _types(ours).values()} >= {name.replace("AdamW", "OptimState")}
    for k, v in before.items():
        assert torch.equal(ours["optimizer_states"][0]["state"][0][k].dequantize(), v), k
    assert (tmp_path / "ours.ckpt").read_bytes() == (tmp_path / "stock.ckpt").read_bytes()


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])  # 4-bit codes of this width are under LAZY_MIN_BYTES
def test_a_lazy_snapshot_proves_a_wrappers_inner_tensors(name, tmp_path):
    ck, opt = _checkpoint(name)
    tracked = lazy.TrackedState()
    tracked.track([opt])
    rule = tracked.rule()
    state = opt.state[next(iter(opt.param_groups[0]["params"]))]
    # the inner codes are copied lazily, proven by the wrapper's version counter and their own
    assert [w is state["exp_avg"] for w in rule(state["exp_avg"].codes)].count(True) == 1
    snap, write = _write(ck, tmp_path / "a.ckpt", defer=rule)
    names = {d.name for d in snap.deferred if d.watch}
    assert "optimizer_states.0.state.0.exp_avg.codes" in names and "optimizer_states.0.state.0.exp_avg_sq.codes" in names
    assert snap.tensors["optimizer_states.0.state.0.exp_avg.codes"].dtype == state["exp_avg"].codes.dtype

    # an optimizer step before the background copy ends tears the snapshot: it fails, nothing is written
    copy = lazy.BackgroundCopy(snap.deferred, hook=lambda: opt.step())
    problem = copy.wait(60)
    assert problem is not None and "changed in place after the save" in problem, problem

    # untouched, the lazily copied file is stock's
    ck, opt = _checkpoint(name)
    tracked.track([opt])
    snap, write = _write(ck, tmp_path / "b.ckpt", defer=tracked.rule())
    assert snap.deferred and lazy.BackgroundCopy(snap.deferred).wait(60) is None
    write()
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "stock.ckpt")
    assert (tmp_path / "b.ckpt").read_bytes() == (tmp_path / "stock.ckpt").read_bytes()


def test_a_local_tier_share_keeps_the_subclasses():
    ck, _ = _checkpoint("AdamW8bit", width=64)
    lay, tensors = packing.layout(shares.make(ck, 0, 1, shares.REPLICATED))
    assert all(type(t) is torch.Tensor for t in tensors.values())  # the inner tensors, as raw bytes
    flat = torch.empty(lay.nbytes, dtype=torch.uint8)
    packing.copy_into(lay, tensors, flat)
    assert lay.nbytes < sum(4 * t.numel() for t in ck["state_dict"].values()) * 2  # not float32 moments
    back = shares.assemble(packing.unpack(lay.header(), flat), [packing.unpack(lay.header(), flat)])
    assert _types(back) == _types(ck)
    want = ck["optimizer_states"][0]["state"][0]["exp_avg"]
    got = back["optimizer_states"][0]["state"][0]["exp_avg"]
    assert type(got) is type(want) and torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("engine, worker", [("nvrx", "persistent"), ("mcore", "fork")], ids=["nvrx", "mcore"])
def test_a_dcp_checkpoint_keeps_the_subclasses_at_about_stocks_size(tmp_path, engine, worker):
    ck, _ = _checkpoint("AdamW8bit", width=512)
    dcp.save(ck, checkpoint_id=tmp_path / "stock")  # stock DCP: each state one torch.save of the subclass
    stock_size = sum(f.stat().st_size for f in (tmp_path / "stock").iterdir())
    aio = AsyncCheckpointIO(engine, worker=worker, format="dcp", timeout_s=120)
    try:
        aio.save_checkpoint(ck, tmp_path / "ours")
        aio.finalize(blocking=True)
        back = aio.load_checkpoint(tmp_path / "ours", weights_only=True)
    finally:
        aio.teardown()
    assert _types(back) == _types(ck)
    want = ck["optimizer_states"][0]["state"][0]["exp_avg_sq"]
    assert torch.equal(back["optimizer_states"][0]["state"][0]["exp_avg_sq"].codes, want.codes)
    size = sum(f.stat().st_size for f in (tmp_path / "ours").rglob("*") if f.is_file())
    assert size <= 1.05 * stock_size, (size, stock_size)


class _TeLike(torch.Tensor):
    """A wrapper with a ``dequantize`` of its own, as TransformerEngine's tensors have; its module is TE's."""

    __module__ = "transformer_engine.pytorch.tensor.float8_tensor"

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data):
        self._data = data

    def dequantize(self, *, dtype=None):
        return self._data.to(torch.float32) * 2

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._data)
        raise NotImplementedError(func)

    __torch_function__ = torch._C._disabled_torch_function_impl


def test_only_transformer_engine_tensors_are_dequantized_with_a_warning_naming_them(caplog):
    ck, _ = _checkpoint("AdamW8bit", width=64)
    torchao_state = ck["optimizer_states"][0]["state"][0]["exp_avg"]
    assert "dequantize" in type(torchao_state).__dict__  # the old rule's test: it has one, and is kept whole
    assert not staging.is_quantized(torchao_state) and subclasses.is_wrapper(torchao_state)
    te = _TeLike(torch.arange(64, dtype=torch.uint8).view(8, 8))
    assert staging.is_quantized(te) and not subclasses.is_wrapper(te)
    with caplog.at_level(logging.WARNING, logger=subclasses.__name__):
        snap = staging.Stager(shared=False, copy_cpu=True).snapshot({"state_dict": {"fc.weight": te}})
        staging.Stager(shared=False, copy_cpu=True).snapshot({"state_dict": {"fc.weight": te}})
    got = snap.tensors["state_dict.fc.weight"]
    assert type(got) is torch.Tensor and torch.equal(got, te.dequantize())
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(said) == 1 and "'state_dict.fc.weight'" in said[0] and "256 bytes" in said[0] and "hold 64" in said[0]


def test_lightnings_callable_map_location_is_read_as_cpu_where_it_means_that():
    assert map_location.for_file(None) == "cpu"
    assert map_location.for_file(lambda storage, loc: storage) == "cpu"  # TorchCheckpointIO's default
    moving = lambda storage, loc: storage.cuda()  # noqa: E731
    assert map_location.for_file(moving) is moving
    assert map_location.for_file("cuda:1") == "cuda:1" and map_location.for_file({"cuda:0": "cpu"}) == {"cuda:0": "cpu"}


def test_a_sharded_snapshot_keeps_the_wrapper_around_copies_of_its_inner_tensors():
    ck, opt = _checkpoint("AdamW8bit", width=64)
    snap = staging.Stager(shared=False, copy_cpu=True).snapshot_tree({"optimizer": ck["optimizer_states"][0]})
    want = ck["optimizer_states"][0]["state"][0]["exp_avg"]
    got = snap.skeleton["optimizer"]["state"][0]["exp_avg"]
    assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
    assert "optimizer.state.0.exp_avg.codes" in snap.tensors
    assert got.codes.data_ptr() != want.codes.data_ptr() and torch.equal(got.codes, want.codes)  # a copy


class Tagged(torch.Tensor):
    """A plain ``as_subclass`` subclass (no wrapper, not TransformerEngine's): ``torch.save`` keeps its type."""


def test_another_subclass_is_written_whole_as_torch_save_writes_it(tmp_path):
    ck = {"state_dict": {"w": torch.randn(16, 16).as_subclass(Tagged), "b": torch.randn(16)}}
    TorchCheckpointIO().save_checkpoint(ck, tmp_path / "stock.ckpt")
    _, write = _write(ck, tmp_path / "ours.ckpt")
    write()
    back = torch.load(tmp_path / "ours.ckpt", weights_only=False)
    assert type(back["state_dict"]["w"]) is Tagged and torch.equal(back["state_dict"]["w"], ck["state_dict"]["w"])
    assert (tmp_path / "ours.ckpt").read_bytes() == (tmp_path / "stock.ckpt").read_bytes()


def test_a_sharded_save_writes_the_subclasses_as_stock_dcp_does(tmp_path):
    ck, _ = _checkpoint("AdamW8bit", width=256)
    state = {"model": ck["state_dict"], "optimizer": ck["optimizer_states"][0]}
    dcp.save(state, checkpoint_id=tmp_path / "stock")
    aio = AsyncCheckpointIO("mcore", worker="fork", timeout_s=120)
    try:
        aio.save_checkpoint_sharded(state, tmp_path / "ours", {"global_step": 1})
        aio.finalize(blocking=True)
    finally:
        aio.teardown()
    other, _ = _checkpoint("AdamW8bit", width=256, steps=2)
    target = {"model": other["state_dict"], "optimizer": other["optimizer_states"][0]}
    dcp.load(target, checkpoint_id=tmp_path / "ours")  # plain DCP, as Lightning's ModelParallelStrategy loads
    for k in ("exp_avg", "exp_avg_sq"):
        want, got = state["optimizer"]["state"][0][k], target["optimizer"]["state"][0][k]
        assert type(got) is type(want) and torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)

    def shards(d):
        return sum(f.stat().st_size for f in d.glob("*.distcp"))

    assert abs(shards(tmp_path / "ours") - shards(tmp_path / "stock")) <= 0.05 * shards(tmp_path / "stock")


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_stock_dcps_save_of_the_subclasses_passes_the_integrity_check_of_a_load(name, tmp_path):
    """torchao's states hold a float32 tensor's elements in one byte or half a byte each: the check that refuses a
    ``.metadata`` declaring more elements than its items store (``format/entries.py``) must let them through."""
    from lightning_asyncckpt.format import integrity
    from lightning_asyncckpt.format.metadata import read_metadata

    ck, _ = _checkpoint(name, width=256)
    dcp.save({"model": ck["state_dict"], "optimizer": ck["optimizer_states"][0]}, checkpoint_id=tmp_path / "stock")
    integrity.check_directory(tmp_path / "stock", read_metadata(tmp_path / "stock", allow_pickle=True))


def test_every_ranks_share_of_a_replicated_save_joins_back_into_the_subclasses():
    """``AsyncDDPStrategy``'s every-rank saves (and ``format="dcp"``): each rank stages a disjoint share of the
    tensors, a wrapper's inner tensors on one rank, written as one DCP item per wrapper (as stock's DCP save
    writes it); on load the reader gives the skeleton beside them the inner tensors, which rebuild the wrappers."""
    from lightning_asyncckpt.pipeline import dcp_plan

    ck, _ = _checkpoint("AdamW8bit", width=64)
    snaps = [staging.Stager(shared=False, copy_cpu=True).snapshot(ck, rank=r, world_size=2) for r in range(2)]
    assert set(snaps[0].tensors).isdisjoint(snaps[1].tensors)
    items, paths = dcp_plan.replicated_items(snaps[0].skeleton, snaps[0].tensors, everything=True)
    every = {**snaps[0].tensors, **snaps[1].tensors}
    inner = (".codes", ".scale", ".qmap")
    named = {n.rsplit(".", 1)[0] if n.endswith(inner) else n for n in every}  # the items: a wrapper's, whole
    assert named <= set(paths) and paths["optimizer_states.0.state.0.exp_avg"][-1] == "exp_avg"
    back = staging.join(snaps[1].skeleton, every)
    assert _types(back) == _types(ck)
    want, got = ck["optimizer_states"][0]["state"][0]["exp_avg"], back["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(got.codes, want.codes) and torch.equal(got.qmap, want.qmap)
