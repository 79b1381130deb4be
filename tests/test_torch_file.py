"""The single-file format: a real Lightning checkpoint, staged by the real Stager, written by the worker
function in a separate process, compared with stock ``TorchCheckpointIO``'s file for the same dict."""

from __future__ import annotations

import argparse
import errno
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.data import AttributeDict
from torch.utils.data import DataLoader, TensorDataset

from helpers import assert_tree_equal
from lightning_asyncckpt import testing
from lightning_asyncckpt.engines.persistent_worker import resource_tracker_running, stop_resource_tracker
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.write import file_layout, torch_file
from lightning_asyncckpt.write.jobs import FileJob


class TiedModel(L.LightningModule):
    """Tied embedding / output weights, a bf16 and an int64 buffer, nested hyper-parameters."""

    def __init__(self, vocab: int = 32, width: int = 16, opts: Any = None, sizes: tuple = (1, 2), extra: Any = None):
        super().__init__()
        self.save_hyperparameters()
        self.emb = torch.nn.Embedding(vocab, width)
        self.hidden = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.linspace(0, 1, width).to(torch.bfloat16))
        self.register_buffer("seen", torch.arange(7, dtype=torch.int64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = self.hidden(self.emb(batch[0])) * self.scale.float()
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), batch[0].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _lightning_checkpoint(tmp_path: Path) -> dict:
    model = TiedModel(opts=argparse.Namespace(depth=2, act="gelu", drop=None), extra=[1, "a", None, (2.5, "b")])
    data = DataLoader(TensorDataset(torch.randint(0, 32, (8, 5))), batch_size=4)
    trainer = L.Trainer(
        default_root_dir=tmp_path, max_steps=2, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, data)
    return trainer._checkpoint_connector.dump_checkpoint()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Same types (dict subclasses, namedtuples, namespaces), keys in order, values; tensors equal in
    dtype, shape, device and value."""
    assert_tree_equal(a, b, where, strict=True)


def _sharing(ckpt: dict) -> list[set[str]]:
    """Groups of tensor fqns that share one storage (more than one member)."""
    _, tensors = staging.split(ckpt)
    groups: dict[int, set[str]] = {}
    for name, t in tensors.items():
        if t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), set()).add(name)
    return sorted((g for g in groups.values() if len(g) > 1), key=sorted)


def _run_job(ctx_name: str, args: tuple) -> dict | None:
    tracker_before = resource_tracker_running()
    proc = mp.get_context(ctx_name).Process(target=torch_file.write_file_job, args=(FileJob(*args),))
    proc.start()
    proc.join(120)
    if not tracker_before:  # spawning started multiprocessing's helper process: leave none behind
        stop_resource_tracker()
    assert not proc.is_alive()
    result_path = args[3]
    if not os.path.exists(result_path):
        return None
    with open(result_path, "rb") as f:
        return pickle.load(f)


def test_worker_file_equals_stock_file(tmp_path):
    ckpt = _lightning_checkpoint(tmp_path)
    assert isinstance(ckpt["hyper_parameters"]["opts"], argparse.Namespace)
    assert {t.dtype for t in staging.split(ckpt)[1].values()} >= {torch.bfloat16, torch.int64, torch.float32}
    assert ["state_dict.emb.weight", "state_dict.head.weight"] in [sorted(g) for g in _sharing(ckpt)]

    stock_path = tmp_path / "stock.ckpt"
    TorchCheckpointIO().save_checkpoint(ckpt, stock_path)

    lay = file_layout.layout(ckpt)
    assert lay.aliases == {"state_dict.head.weight": "state_dict.emb.weight"}
    assert lay.locations == {} and lay.same_object == set()
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot(ckpt)
    ours = tmp_path / "ours.ckpt"
    tmp = commit.tmp_for(ours, "tok-1")
    assert commit.is_leftover(tmp.name)
    result = tmp_path / "1.result"
    outcome = _run_job("spawn", (snap.skeleton, snap.tensors, str(tmp), str(result), None, lay.aliases, lay.locations,
                                 frozenset(lay.same_object)))
    assert outcome is not None and outcome["ok"], outcome
    assert outcome["pid"] != os.getpid()
    assert outcome["nbytes"] == tmp.stat().st_size and outcome["write_s"] > 0
    assert not ours.exists()
    torch_file.publish_file(tmp, ours)
    assert not tmp.exists()

    with torch.serialization.safe_globals([argparse.Namespace]):  # the hyper-parameters hold one
        stock = torch.load(stock_path, weights_only=True)
        got = torch.load(ours, weights_only=True)
    assert_same(got, stock)
    assert_same(torch.load(ours, weights_only=False), torch.load(stock_path, weights_only=False))
    # the tied weight is stored once and loads sharing one storage, as in stock's file
    assert _sharing(got) == _sharing(stock)
    # for CPU training, byte for byte the file stock writes (both torch.save into a file object)
    assert ours.read_bytes() == stock_path.read_bytes()

    # Lightning's loaders read it as stock's: hyper-parameters (namespaces) and weights come back
    with torch.serialization.safe_globals([argparse.Namespace]):
        model = TiedModel.load_from_checkpoint(ours, weights_only=True)
    assert isinstance(model.hparams, AttributeDict)
    assert model.hparams.opts == argparse.Namespace(depth=2, act="gelu", drop=None)
    assert model.hparams.extra == [1, "a", None, (2.5, "b")]
    assert model.head.weight is model.emb.weight
    for k, v in model.state_dict().items():
        assert torch.equal(v, stock["state_dict"][k]), k
    with torch.serialization.safe_globals([argparse.Namespace]):
        assert_same(TorchCheckpointIO().load_checkpoint(ours), TorchCheckpointIO().load_checkpoint(stock_path))


def test_one_tensor_object_held_twice_is_written_as_stock_writes_it(tmp_path):
    w = torch.randn(8, 4)
    ckpt = {"state_dict": {"a": w, "b": w, "c": w.detach(), "d": w[1:]}, "epoch": 1}
    stock = tmp_path / "stock.ckpt"
    TorchCheckpointIO().save_checkpoint(ckpt, stock)
    lay = file_layout.layout(ckpt)
    assert lay.aliases == {"state_dict.b": "state_dict.a", "state_dict.c": "state_dict.a"}
    assert lay.same_object == {"state_dict.b"}
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot(ckpt)
    ours = tmp_path / "ours.ckpt"
    torch_file.write_file(snap.skeleton, snap.tensors, ours, lay.aliases, same_object=lay.same_object)
    got = torch.load(ours, weights_only=True)
    assert_same(got, ckpt)
    sd = got["state_dict"]
    assert sd["a"] is sd["b"] and sd["c"] is not sd["a"] and sd["c"].data_ptr() == sd["a"].data_ptr()
    # "d", a partial view, is written as its own storage (stock stores it inside "a"'s)
    assert sd["d"].untyped_storage().nbytes() == 7 * 4 * 4
    assert ours.stat().st_size < stock.stat().st_size + 4096


def test_without_aliases_values_match_and_sharing_is_dropped(tmp_path):
    w = torch.randn(8, 4)
    ckpt = {"state_dict": {"a": w, "b": w}, "epoch": 1}
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot(ckpt)
    path = tmp_path / "x.ckpt"
    torch_file.write_file(snap.skeleton, snap.tensors, path)
    got = torch.load(path, weights_only=True)
    assert_same(got, ckpt)
    assert _sharing(got) == []  # written twice: the layout is what carries the tie


def test_slices_of_one_large_buffer_do_not_bloat_the_file(tmp_path):
    ckpt = {"state_dict": {f"w{i}": torch.randn(256, 64) for i in range(4)}, "step": torch.tensor(3)}
    stock = tmp_path / "stock.ckpt"
    torch.save(ckpt, stock)
    skeleton, tensors = staging.split(ckpt)
    # staged copies packed in one shared arena, as a stager with one buffer per save would hand them over
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    arena = staging._shared_empty(torch.Size([total]), torch.uint8)
    staged, off = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        staged[name] = arena[off:off + nbytes].view(t.dtype).view(t.shape)
        staged[name].copy_(t)
        off += nbytes
    staged["state_dict.w2"] = staged["state_dict.w2"].t().contiguous().t()  # a non-contiguous staged copy
    assert staged["state_dict.w0"].untyped_storage().nbytes() > staged["state_dict.w0"].numel() * 4
    ours = tmp_path / "ours.ckpt"
    torch_file.write_file(skeleton, staged, ours)
    assert_same(torch.load(ours, weights_only=True), ckpt)
    assert abs(ours.stat().st_size - stock.stat().st_size) < 4096
    # a naive torch.save of one slice writes the whole arena
    naive = tmp_path / "naive.ckpt"
    torch.save({"w0": staged["state_dict.w0"]}, naive)
    assert naive.stat().st_size > 3 * 256 * 64 * 4


def test_locations_tag_storages_with_the_original_device(tmp_path):
    ckpt = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16), "n": 1}
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot(ckpt)
    path = tmp_path / "x.ckpt"
    # as if "a" had been staged from cuda:1 (layout(checkpoint) records it on a GPU machine)
    torch_file.write_file(snap.skeleton, snap.tensors, path, locations={"a": "cuda:1"})
    seen = []
    got = torch.load(path, map_location=lambda storage, loc: seen.append(loc) or storage, weights_only=True)
    assert sorted(seen) == ["cpu", "cuda:1"]
    assert_same(got, ckpt)
    # the tag is per write: a later write without locations tags everything cpu
    torch_file.write_file(snap.skeleton, snap.tensors, path)
    seen.clear()
    torch.load(path, map_location=lambda storage, loc: seen.append(loc) or storage, weights_only=True)
    assert seen == ["cpu", "cpu"]


def test_job_reports_an_injected_failure_in_the_result_file_format(tmp_path):
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot({"w": torch.ones(4)})
    tmp = commit.tmp_for(tmp_path / "x.ckpt", "t")
    result = tmp_path / "r.result"
    outcome = _run_job("fork", (snap.skeleton, snap.tensors, str(tmp), str(result), testing.FailWrite(errno.ENOSPC)))
    assert outcome is not None
    assert outcome["ok"] is False and outcome["errno"] == errno.ENOSPC and outcome["error_type"] == "OSError"
    assert "write_s" in outcome and not tmp.exists()


def test_crash_mid_write_leaves_only_a_leftover(tmp_path):
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot({"w": torch.ones(4)})
    final = tmp_path / "x.ckpt"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the trainer that owned the save is gone too: its leftover is provably dead
    tmp = commit.tmp_for(final, commit.new_token(gone.pid))
    assert _run_job("fork", (snap.skeleton, snap.tensors, str(tmp), str(tmp_path / "r.result"), testing.CrashWrite())) is None
    assert tmp.exists() and not final.exists()  # the partial file is under the hidden name only
    assert commit.cleanup_leftovers(tmp_path) == [tmp]
    assert list(tmp_path.iterdir()) == []


def test_publish_replaces_atomically_and_readers_never_see_a_partial_file(tmp_path):
    final = tmp_path / "last.ckpt"
    old = {"state_dict": {"w": torch.zeros(512, 512)}, "global_step": 1}
    torch_file.write_file(*staging.split(old), final)
    stop = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(torch.load(final, weights_only=True)["global_step"])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for step in range(2, 8):
            new = {"state_dict": {"w": torch.full((512, 512), float(step))}, "global_step": step}
            tmp = commit.tmp_for(final, f"t{step}")
            torch_file.write_file(*staging.split(new), tmp)
            torch_file.publish_file(tmp, final)
            assert not tmp.exists()
    finally:
        stop.set()
        t.join()
    assert not errors, errors[:1]
    assert seen == sorted(seen)  # never an older one after a newer one
    assert torch.load(final, weights_only=True)["global_step"] == 7
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_publish_refuses_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        torch_file.publish_file(tmp_path / ".asyncckpt-incomplete-x", tmp_path / "x.ckpt")
