"""The CUDA path: CUDA tensors staged through pinned shared memory, a worker without a CUDA context, and a
real TransformerEngine FP8 model, and the local tier's share files pinned for a GPU state. Skipped without CUDA (and without TE); ``scripts/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from lightning_asyncckpt import AsyncCheckpointIO
from lightning_asyncckpt.format import dcp as dcp_format
from lightning_asyncckpt.snapshot import staging
from processes import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gpu_pids() -> set[int]:
    """PIDs holding a CUDA context on any GPU, from nvidia-smi (empty when it cannot tell)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.split() if x.strip().isdigit()}


@pytest.mark.parametrize("worker", ["persistent", "fork"])
@pytest.mark.parametrize("engine", ["nvrx", "mcore"])
def test_cuda_tensors_are_staged_through_pinned_memory(engine, worker, tmp_path, hold):
    torch.cuda.set_device(0)
    state = {
        "global_step": 3,
        "state_dict": {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda").bfloat16()},
    }
    expected = {k: v.cpu() for k, v in state["state_dict"].items()}
    io = AsyncCheckpointIO(engine, worker=worker, timeout_s=120)
    try:
        io.warmup(like=state)
        io.write_hook = hold  # the write waits until the state has changed
        io.save_checkpoint(state, tmp_path / "c")
        for v in state["state_dict"].values():  # the next step changes every tensor on the GPU
            v.add_(1)
        buffers = io.session.staging_buffers()
        assert buffers and all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
        if worker == "persistent":
            pid = io.session.worker_pids()[0]
            assert pid not in _gpu_pids(), "the writer process created a CUDA context"
        hold.release()
        io.finalize(blocking=True)
        loaded = io.load_checkpoint(tmp_path / "c", weights_only=True)
    finally:
        io.teardown()
    for k, want in expected.items():
        assert torch.equal(loaded["state_dict"][k], want), k


def test_transformer_engine_fp8_weights_are_saved_dequantized_and_load_into_te(tmp_path):
    te = pytest.importorskip("transformer_engine.pytorch")
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=True):
        layer = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    with te.fp8_autocast(enabled=True):
        layer(x).sum().backward()
    sd = layer.state_dict()
    assert staging.is_quantized(layer.weight), type(layer.weight)
    want = layer.weight.dequantize().cpu()
    assert want.dtype is torch.bfloat16
    io = AsyncCheckpointIO("nvrx", worker="persistent", timeout_s=120)
    try:
        io.save_checkpoint({"state_dict": sd, "global_step": 1}, tmp_path / "te")
        io.finalize(blocking=True)
        loaded = io.load_checkpoint(tmp_path / "te", weights_only=False)
    finally:
        io.teardown()
    w = loaded["state_dict"]["weight"]
    assert type(w) is torch.Tensor and w.dtype is torch.bfloat16 and torch.equal(w, want)
    meta = dcp_format.read_metadata(tmp_path / "te")
    assert any(m.properties.dtype is torch.bfloat16 for k, m in meta.state_dict_metadata.items() if k.endswith("weight"))
    # a TE module accepts the high-precision weights (and re-quantizes them under fp8_model_init)
    fresh = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    fresh.load_state_dict({k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in loaded["state_dict"].items()})
    assert torch.equal(fresh.weight.detach().cpu(), want)


def test_bench_cuda_smoke(tmp_path):
    """The CUDA benchmark runs end to end (one small size): what gpu_check.sh measures at 2 to 8 GiB."""
    cmd = [sys.executable, "benchmarks/bench_save.py", "--device", "cuda", "--sizes", "0.05", "--saves", "3",
           "--variants", "dcp_sync,nvrx_persistent", "--out", tmp_path]
    with launch(cmd, tmp_path / "log", 600, cwd=ROOT) as job:
        code = job.wait()
    assert code == 0, job.log_text()[-3000:]
    assert "nvrx_persistent" in job.log_text()


def test_a_gpu_states_share_files_are_registered_with_cuda_and_unregistered_when_let_go(tmp_path):
    """The local tier's pool pins the files it makes for a CUDA state (the copy from the GPU then runs at
    pinned speed), keeps a spare pinned for reuse, and unregisters every file before it lets go of it."""
    from lightning_asyncckpt.tiers.mapped import FilePool

    shm = Path("/dev/shm")
    directory = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else tmp_path))
    pool = FilePool(directory, keep_free=1)
    try:
        pool.pin_for(torch.device("cuda", 0))
        assert pool.prepare([1 << 20], uses=1) == 1  # made ahead (the writer thread's job), pinned there
        first = pool.take(directory / "a.pt.tmp", 1 << 20)
        assert first.pinned and first.tensor.is_pinned()
        first.tensor.copy_(torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda"))
        assert bool((first.tensor == 7).all())
        pool.give_back(first.path)  # kept as the spare: still pinned
        again = pool.take(directory / "b.pt.tmp", 1 << 20)
        assert again is first and again.pinned
        other = pool.take(directory / "c.pt.tmp", 2 << 20)  # no spare of its size: made in the save call,
        assert not other.pinned  # where it is never registered (that costs as much as the copy it speeds up)
        pool.give_back(other.path)  # kept as the spare
        pool.prepare([])  # the writer thread's job after a save: registers it
        assert other.pinned and other.tensor.is_pinned()
        gone = pool.take(directory / "d.pt.tmp", 1 << 20)  # the 2 MiB spare resized: a new mapping
        assert not other.pinned and not gone.pinned
        pool.close()
        assert not first.pinned and not first.tensor.is_pinned() and not gone.pinned
    finally:
        pool.close()
        shutil.rmtree(directory, ignore_errors=True)
