"""One variant of ``bench_save.py`` in its own process (``--worker-run``): the checkpoint it saves, what its
saves are measured against (the memcpy floor, the write probe, a training step), the ``Variant`` wrapper
that saves, waits for and reads back each variant's checkpoints, and ``run_variant``, which times the
saves (see ``bench_save.py`` for what each figure means)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = [
    "torch_save",
    "dcp_sync",
    "lightning_async",
    "dcp_async_process",
    "nvrx_persistent",
    "nvrx_fork",
    "mcore_persistent",
    "mcore_fork",
    "nvrx_persistent_dcp",  # format="dcp": 0.1's single-writer DCP directory, beside the default file
    "mcore_persistent_dcp",
    "local_tier",  # the local tier alone (one rank, no replicas): the shares copied into mapped /dev/shm files
]
GiB = 1 << 30


def make_state(nbytes: int, layers: int = 24, device: str = "cpu") -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // (3 * layers * 4))

    def zeros() -> Any:
        return torch.zeros(numel, device=device)

    return {
        "state_dict": {f"layers.{i}.weight": zeros() for i in range(layers)},
        "optimizer_states": [{
            "state": {i: {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros()}
                      for i in range(layers)},
            "param_groups": [{"params": list(range(layers)), "lr": 1e-3, "betas": (0.9, 0.999)}],
        }],
        "epoch": 0,
        "global_step": 0,
        "hyper_parameters": {"layers": layers},
    }


def big_tensors(obj: Any) -> list:
    import torch

    out: list = []
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 1:
            out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            out.extend(big_tensors(v))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(big_tensors(v))
    return out


def train_step(tensors: list, value: float) -> None:
    for t in tensors:
        t.fill_(value)
    if tensors[0].device.type == "cuda":
        import torch

        torch.cuda.synchronize()  # a step ends when its kernels have run


def tree_pss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def memcpy_floor(tensors: list) -> float:
    """The least a snapshot can cost: copying the state into host buffers that already exist. For CUDA
    tensors that is the device-to-host copy into pinned buffers (asynchronous, then one synchronize)."""
    import torch

    cuda = tensors[0].device.type == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    times = []
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del dst
    return statistics.median(times[1:])


def write_probe(directory: Path, nbytes: int) -> float:
    """Bytes per second of an fsync'd sequential write of ``nbytes`` (at most 1 GiB) here."""
    nbytes = min(nbytes, GiB)
    block = b"\1" * (8 << 20)
    path = directory / "probe.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            f.write(block)
            written += len(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return written / elapsed


class Variant:
    """save() schedules or performs a save; done() says whether it is durably committed."""

    def __init__(self, name: str):
        self.name = name
        self.io: Any = None
        self._done: Any = None
        self.step = 0
        self.local_dir: Path | None = None

    def warmup(self, state: dict) -> None:
        if self.name.split("_")[0] in ("nvrx", "mcore"):
            from lightning_asyncckpt import AsyncCheckpointIO

            engine, worker, *fmt = self.name.split("_")
            self.io = AsyncCheckpointIO(engine, worker=worker, max_pending=1, format=fmt[0] if fmt else "auto")
            self.io.warmup(like=state)  # starts the worker and allocates the staging buffers
        elif self.name == "local_tier":
            from lightning_asyncckpt import LocalTier
            from lightning_asyncckpt.tiers.setup import open_tier

            shm = Path("/dev/shm")
            self.local_dir = Path(tempfile.mkdtemp(prefix="bench-local-", dir=shm if shm.is_dir() else None))
            self.io = open_tier(LocalTier(self.local_dir, every_n_train_steps=1, replication_factor=1,
                                          emergency_signals=()), node_rank=0, local_world_size=1)
            self.io.prepare(state)  # the first save's files, made ahead as the integrations do
            self.io.writer.wait(600)  # as the other variants' warmup, done before the first save
        elif self.name == "lightning_async":
            from lightning.fabric.plugins import TorchCheckpointIO
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            self.io = AsyncCheckpointIO(TorchCheckpointIO())
        elif self.name == "torch_save":
            from lightning.fabric.plugins import TorchCheckpointIO

            self.io = TorchCheckpointIO()
        elif self.name == "dcp_async_process":
            import socket

            import torch.distributed as dist
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # its process executor needs a process group (its worker joins one of its own)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=0, world_size=1)

            cuda = big_tensors(state)[0].device.type == "cuda"
            self.io = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                   use_async_staging=False, use_non_blocking_copy=False))

    def save(self, state: dict, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        if self.name == "torch_save":
            self.io.save_checkpoint(state, path)
        elif self.name == "dcp_sync":
            dcp.save(state, checkpoint_id=str(path), no_dist=True)
        elif self.name == "lightning_async":
            self.io.save_checkpoint(state, path)
            self._done = self.io._executor.submit(lambda: None)  # runs after the save on its one thread
        elif self.name == "local_tier":
            self.step += 1
            self.io.save(self.step, state)
        elif self.name == "dcp_async_process":
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            resp = dcp.async_save(state, checkpoint_id=str(path), async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.io, no_dist=True)
            self._done = getattr(resp, "upload_completion", resp)
        else:
            self.io.save_checkpoint(state, path)

    def done(self, path: Path) -> bool:
        if self.name in ("torch_save", "dcp_sync"):
            return True
        if self.name == "local_tier":
            if self.io.writer.busy:
                return False
            return self.io.boundary().complete == self.step  # raises a failed local save
        if self.name in ("lightning_async", "dcp_async_process"):
            if self._done.done():
                self._done.result()
                return True
            return False
        self.io.finalize()
        return self.io.session.num_pending == 0

    def load(self, path: Path) -> Any:
        """The checkpoint saved at ``path`` (the local tier: its newest step, restored as on a resume)."""
        import torch

        if self.name == "local_tier":
            return self.io.take(self.io.latest(None))
        if path.is_file():  # stock's format (torch_save, lightning_async, and ours by default)
            return torch.load(path, mmap=True, weights_only=True)
        from lightning_asyncckpt.format import dcp as dcp_format

        return dcp_format.load(path, weights_only=False)

    def close(self) -> None:
        if self.name == "local_tier":
            self.io.close()
            shutil.rmtree(self.local_dir, ignore_errors=True)
        elif self.name == "lightning_async" or self.name.split("_")[0] in ("nvrx", "mcore"):
            self.io.teardown()
        elif self.name == "dcp_async_process":
            import torch.distributed as dist

            self.io.close()
            dist.destroy_process_group()


def torn_tensors(loaded: Any, expected: float) -> int:
    return sum(1 for t in big_tensors(loaded) if not bool((t == expected).all()))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def run_variant(name: str, size_gib: float, saves: int, workdir: Path, verify: str,
                device: str = "cpu") -> dict[str, Any]:
    import lightning.pytorch  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    torch.set_num_threads(1)  # the other core is the background writer's
    nbytes = int(size_gib * GiB)
    # The baseline is a training process before any checkpointing: torch, Lightning and DCP are imported
    # (every variant needs them; Lightning alone is about 90 MB), the state does not exist yet.
    pss0 = tree_pss()
    state = make_state(nbytes, device=device)
    tensors = big_tensors(state)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    floor = memcpy_floor(tensors)
    probe = write_probe(workdir, state_bytes)
    base_steps = []
    for k in range(5):
        t0 = time.perf_counter()
        train_step(tensors, float(-k))
        base_steps.append(time.perf_counter() - t0)
    base_step = statistics.median(base_steps)
    variant = Variant(name)
    variant.warmup(state)
    pss_base = tree_pss()
    records: list[dict] = []
    to_check: list = []
    value = 0.0
    for i in range(saves):
        value += 1.0
        train_step(tensors, value)
        state["global_step"] = int(value)
        path = workdir / f"ckpt-{i}"
        t0 = time.perf_counter()
        variant.save(state, path)
        stall = time.perf_counter() - t0
        pss_peak = tree_pss()
        during = []
        while not variant.done(path):
            t1 = time.perf_counter()
            train_step(tensors, value + 0.5)  # changes every tensor while the write runs
            during.append(time.perf_counter() - t1)
            if len(during) % 4 == 1:
                pss_peak = max(pss_peak, tree_pss())
        e2e = time.perf_counter() - t0
        if (verify == "all" and name != "local_tier") or (verify != "none" and i == saves - 1):  # it keeps one step
            to_check.append((i, path, value))  # read back after all saves: reading allocates memory
        else:
            _remove(path)
        records.append({
            "stall_s": stall,
            "e2e_s": e2e,
            "slowdown": (statistics.mean(during) / base_step) if during else None,
            "steps_during_write": len(during),
            "write_gbps": state_bytes / max(e2e - stall, 1e-9) / 1e9 if during else state_bytes / stall / 1e9,
            "extra_mem_bytes": pss_peak - pss_base,
            "extra_mem_incl_worker_bytes": pss_peak - pss0 - state_bytes,
            "torn": None,
        })
    for i, path, value in to_check:  # before close: the local tier restores its newest step through its run
        records[i]["torn"] = torn_tensors(variant.load(path), value)
        _remove(path)
    variant.close()
    return {
        "variant": name, "size_gib": size_gib, "device": device, "state_bytes": state_bytes, "memcpy_floor_s": floor,
        "probe_gbps": probe / 1e9, "base_step_s": base_step, "saves": records,
    }
