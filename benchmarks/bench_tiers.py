"""The local tier against the persistent one, in one run: training overhead per save and recovery time.

    python benchmarks/bench_tiers.py                      # 0.25 GiB of state, 4 ranks on 2 simulated nodes
    python benchmarks/bench_tiers.py --size 0.5 --reps 12 --recoveries 7
    python benchmarks/bench_tiers.py --render benchmarks/results/tiers-<time>.json

Four ranks (``torch.multiprocessing``, spawn; gloo on 127.0.0.1) simulate two nodes: ranks 0 and 1 are
node 0, ranks 2 and 3 node 1 (``TierRun(node_rank=rank // 2, local_world_size=2)``), so the local tier's
cliques are {0, 2} and {1, 3} and every share has its replica on the other node. Each node has its own
local directory (``/dev/shm/bench-tiers-<pid>/node<k>``); the persistent tier (``AsyncCheckpointIO("nvrx")``
on rank 0) writes a ``torch.save`` file under a temporary directory on the normal disk (``--dir``).
Everything is removed at the end; the run has a hard deadline (``--timeout``), after which the parent
kills every rank.

Every rank holds the same Lightning-like checkpoint (``state_dict``, ``optimizer_states`` with two
moments per layer, ``global_step``: ``--size`` GiB of float32 in ``3 x --layers`` tensors). A *training
step* is a matmul loop (``--compute-ms``, calibrated at start with every rank computing), a ``--grad-mib``
all-reduce (a DDP gradient bucket's stand-in, which keeps the ranks in step as DDP does), then
``add_(1)`` on every state tensor (an optimizer step writes all of it).

**Overhead.** A *period* is one save and the ``--every`` training steps after it, timed on rank 0 from a
barrier to a barrier, in three variants interleaved in the same processes, their order rotated per
repetition (``--reps``):

- ``baseline``: ``--every`` steps, no save;
- ``local``: ``TierRun.save`` on every rank, the steps with ``TierRun.boundary()`` after each, then
  ``TierRun.finish()`` (the wait for the save's thread, if it is still running, counts);
- ``persistent``: rank 0 ``save_checkpoint`` (the previous file removed as ``ModelCheckpoint(save_top_k=1)``
  does), the steps with ``finalize()`` on every rank after each, then ``finalize(blocking=True)``.

**Overhead per save** = the period - the same repetition's baseline period (median over repetitions; also
the median period minus the median baseline period). **Stall**: the save call (local: the slowest rank's
``last_stall_s``; persistent: rank 0's call). **Background**: the local writer thread's time (CRC32s, the
clique's exchange, commits; the slowest rank), and the persistent save's from the call to its commit
(``SaveRecord.write_s``). **Drain**: the wait at the period's end (near 0: the save finished within
``--every`` steps). **CPU**: user + system seconds of every rank's process (its threads: the local
writer) and its children (the persistent worker) over the period, summed over the ranks; the extra CPU
per save is the period's minus the same repetition's baseline's. Parts of the save call, its thread and
the recovery are timed by wrapping the tier's functions (``packing.copy_into``, ``ShareWriter.wait``,
``local_replicas.settle``, ``replication.replicate``, ``LocalStore.commit``, ``exchange.transfer``,
``store.map_share``, ``shares.assemble``, and the load below) in this process; nothing else changes. One untimed save of each
tier, drained, comes first (the worker start, the staging buffers, the files, the space check).

**Recovery.** After one more save of each tier, of the same step, is complete (and committed), node 1
*comes back empty*: rank 2 deletes everything in node 1's local directory, then every rank times
``TierRun.latest(None)`` + ``take`` (node 1 refilled from node 0, CRC checks, the full checkpoint
assembled on every rank) against every rank's ``AsyncCheckpointIO.load_checkpoint`` of the persistent
file, once with the page cache dropped first (``sync; echo 3 > /proc/sys/vm/drop_caches``, or, where that
is refused, ``posix_fadvise(DONTNEED)`` on the file; the bytes still cached, read by ``fincore``, are
reported), once warm (read through first), and (unless ``--no-s3``) once from the same file on an
S3-protocol server (moto's server mode in its own process on 127.0.0.1, as the tests start it; every rank
reads ``s3://`` through s3fs). Either way the timed recovery ends once the restored checkpoint is loaded
into the rank's model: every tensor copied into a tensor of its own, allocated and touched before the
timing (what ``load_state_dict`` does), since the local tier hands out views of its files and the
persistent load tensors in memory of their own. A recovery's time is the slowest rank's, from a common
barrier. Every restored checkpoint is compared, tensor by tensor, with the live state.
Repeated ``--recoveries`` times, in a rotated order; figures are medians. Results:
``benchmarks/results/tiers-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the loopback S3 server
from s3server import S3Server  # noqa: E402

VARIANTS = ["baseline", "local", "persistent"]
RECOVERIES = ["local_replicas", "persistent_cold", "persistent_warm", "persistent_s3"]
S3_PATH = "s3://bench-tiers/last.ckpt"
SAVE_PARTS = ["wait_previous", "copy_share"]  # of the local save call
THREAD_PARTS = ["replicate", "write"]  # of the local save's thread: replicas settled, shares committed
RECOVERY_PARTS = ["transfer", "read", "assemble", "load"]  # the rest: listing, CRC32, agreeing, unpickling
GiB = 1 << 30
WORLD, PER_NODE = 4, 2


# -------------------------------------------------------------------------------------------------
# One rank
def make_state(nbytes: int, layers: int) -> dict[str, Any]:
    import torch

    numel = max(1, nbytes // (3 * layers * 4))
    gen = torch.Generator().manual_seed(0)  # the same values on every rank: a replicated (DDP) state

    def rand() -> Any:
        return torch.rand(numel, generator=gen)

    return {
        "state_dict": {f"layers.{i}.weight": rand() for i in range(layers)},
        "optimizer_states": [{
            "state": {i: {"exp_avg": rand(), "exp_avg_sq": rand()} for i in range(layers)},
            "param_groups": [{"params": list(range(layers)), "lr": 1e-3, "betas": (0.9, 0.999)}],
        }],
        "epoch": 0,
        "global_step": 0,
    }


def state_tensors(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in state_tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in state_tensors(v)]
    return []


def same_state(restored: Any, live: dict[str, Any]) -> bool:
    import torch

    a, b = state_tensors(restored), state_tensors(live)
    return (isinstance(restored, dict) and restored.get("global_step") == live["global_step"]
            and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)))


class Timers:
    """Seconds spent in wrapped functions, summed per name (any thread)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr, None)
        if inner is None:  # not in this version of the library: that part reads 0
            return

        @functools.wraps(inner)
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                with self._lock:
                    self.total[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def mark(self) -> dict[str, float]:
        with self._lock:
            return dict(self.total)

    def since(self, mark: dict[str, float], names: list[str]) -> dict[str, float]:
        now = self.mark()
        return {n: now.get(n, 0.0) - mark.get(n, 0.0) for n in names}


class Trainer:
    """The simulated training loop of one rank, and its two tiers."""

    def __init__(self, rank: int, args: argparse.Namespace, node_dir: Path, ckpt_dir: Path) -> None:
        import torch
        import torch.distributed as dist

        from lightning_asyncckpt import AsyncCheckpointIO
        from lightning_asyncckpt.tiers import restore as tier_restore
        from lightning_asyncckpt.tiers import run as tier_run
        from lightning_asyncckpt.tiers import store as tier_store
        from lightning_asyncckpt.tiers import writer as tier_writer
        from lightning_asyncckpt.tiers.store import LocalStore

        try:  # where replication has its own module, the writer imports it at each save
            from lightning_asyncckpt.tiers import replication as tier_replication
        except ImportError:
            tier_replication = None
        from lightning_asyncckpt.tiers.config import LocalTier
        from lightning_asyncckpt.tiers.run import TierRun

        self.torch, self.dist, self.rank, self.args, self.ckpt_dir = torch, dist, rank, args, ckpt_dir
        self.state = make_state(int(args.size * GiB), args.layers)
        self.tensors = state_tensors(self.state)
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.grad = torch.ones(max(1, int(args.grad_mib * (1 << 20)) // 4))
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.matmuls = self._calibrate()
        self.step = 0
        config = LocalTier(node_dir, every_n_train_steps=args.every, replication_factor=2, emergency_signals=(),
                           timeout_s=args.timeout)
        self.tier = TierRun(config, node_rank=rank // PER_NODE, local_world_size=PER_NODE)
        self.io = AsyncCheckpointIO("nvrx")
        if rank == 0:
            self.io.warmup(like=self.state)  # starts the worker and allocates its staging buffers
        self.persistent_path: Path | None = None
        self.timers = t = Timers()
        t.wrap(tier_run.packing, "copy_into", "copy_share")  # the save call's one copy, into mapped files
        t.wrap(self.tier.writer, "wait", "wait_previous")
        t.wrap(tier_writer.local_replicas, "settle", "replicate")  # replicated state: CRC32s gathered, repairs
        t.wrap(tier_replication, "replicate", "replicate")  # sharded state: NVRx's clique exchange
        t.wrap(self.tier.store, "commit", "write")  # header, manifest, renames
        t.wrap(tier_restore.exchange, "transfer", "transfer")  # recovery: shares sent between ranks
        t.wrap(LocalStore, "read", "read")  # recovery: shares read from node-local files (before mapping)
        t.wrap(tier_store, "map_share", "read")  # recovery: another holder's shares on this node, mapped
        t.wrap(tier_restore.shares, "assemble", "assemble")

    def _calibrate(self) -> int:
        """Matmuls per step for about --compute-ms, timed with every rank computing at once (contended)."""
        torch, dist = self.torch, self.dist
        times = []
        for _ in range(4):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(100):
                torch.mm(self.a, self.b)
            times.append((time.perf_counter() - t0) / 100)
        per = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        return max(1, round(self.args.compute_ms / 1000 / float(per)))

    @staticmethod
    def cpu_s() -> float:
        """CPU seconds (user + system) of this rank's process (its threads) and its children (the worker)."""
        import psutil

        me, total = psutil.Process(), 0.0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
        return total

    def gather(self, obj: Any) -> list:
        out: list = [None] * WORLD
        self.dist.all_gather_object(out, obj)
        return out

    def train_step(self) -> None:
        for _ in range(self.matmuls):
            self.torch.mm(self.a, self.b)
        self.dist.all_reduce(self.grad)
        self.grad.fill_(1.0)
        for t in self.tensors:
            t.add_(1.0)
        self.step += 1
        self.state["global_step"] = self.step

    # the tiers' saves -----------------------------------------------------------------------------
    def local_save(self) -> float:
        self.tier.save(self.step, self.state)
        return self.tier.last_stall_s

    def persistent_save(self) -> float | None:
        if self.rank != 0:
            return None
        path = self.ckpt_dir / f"step-{self.step}.ckpt"
        t0 = time.perf_counter()
        self.io.save_checkpoint(self.state, path)
        stall = time.perf_counter() - t0
        if self.persistent_path is not None:
            self.io.remove_checkpoint(self.persistent_path)  # once the new one commits (save_top_k=1)
        self.persistent_path = path
        return stall

    def drain(self, variant: str) -> None:
        if variant == "local":
            complete = self.tier.finish()
            assert complete == self.tier.saved_step, (complete, self.tier.saved_step)
        elif variant == "persistent":
            self.io.finalize(blocking=True)

    # overhead ---------------------------------------------------------------------------------------
    def period(self, variant: str) -> dict[str, Any]:
        """(all ranks) One timed period: a save (none for the baseline), ``--every`` steps, the drain."""
        history = len(self.io.history)
        self.dist.barrier()
        mark, cpu0 = self.timers.mark(), self.cpu_s()
        t0 = time.perf_counter()
        stall = None
        if variant == "local":
            stall = self.local_save()
        elif variant == "persistent":
            stall = self.persistent_save()
        save_parts = self.timers.since(mark, SAVE_PARTS)
        for _ in range(self.args.every):
            self.train_step()
            if variant == "local":
                self.tier.boundary()
            elif variant == "persistent":
                self.io.finalize()
        t1 = time.perf_counter()
        self.drain(variant)
        self.dist.barrier()
        elapsed, drain = time.perf_counter() - t0, time.perf_counter() - t1
        cpu = self.cpu_s() - cpu0
        thread_parts = self.timers.since(mark, THREAD_PARTS)
        background = None
        if variant == "local":
            background = self.tier.writer.last_write_s
        elif variant == "persistent" and self.rank == 0:
            background = self.io.history[-1].write_s if len(self.io.history) > history else None
        rows = self.gather({"stall": stall, "save_parts": save_parts, "background": background,
                            "thread_parts": thread_parts, "cpu": cpu})
        out: dict[str, Any] = {"variant": variant, "period_s": elapsed, "drain_s": drain, "steps": self.args.every,
                               "cpu_s": sum(r["cpu"] for r in rows), "cpu_per_rank_s": [r["cpu"] for r in rows]}
        if variant == "local":  # the slowest rank's, with its parts (the ranks wait for each other every step)
            slow = max(rows, key=lambda r: r["stall"])
            out.update(stall_s=slow["stall"], save_parts=slow["save_parts"])
            slow = max(rows, key=lambda r: r["background"])
            out.update(background_s=slow["background"], thread_parts=slow["thread_parts"])
        elif variant == "persistent":
            out.update(stall_s=rows[0]["stall"], background_s=rows[0]["background"])
        return out

    def warmup(self) -> dict[str, Any]:
        """(all ranks) A few steps, then one untimed save of each tier, drained: first-time costs."""
        self.train_step()
        self.tier.prepare(self.state)  # as the Trainer and Fabric integrations do, at a boundary before the first save
        self.train_step()
        out = {}
        for variant in ("local", "persistent"):
            self.dist.barrier()
            t0 = time.perf_counter()
            stall = self.local_save() if variant == "local" else self.persistent_save()
            self.drain(variant)
            self.dist.barrier()
            rows = self.gather(stall)
            out[f"{variant}_first_stall_s"] = max(rows) if variant == "local" else rows[0]
            out[f"{variant}_first_to_done_s"] = time.perf_counter() - t0
        return out

    # recovery ---------------------------------------------------------------------------------------
    def prepare_recovery(self) -> int:
        """(all ranks) One more step and a save of it to both tiers, complete and committed; the model's
        tensors that a recovery loads into, allocated and touched."""
        import torch

        self.model = [torch.zeros_like(t) for t in state_tensors(self.state)]
        self.train_step()
        self.local_save()
        self.persistent_save()
        self.drain("local")
        self.drain("persistent")
        assert self.tier.complete == self.step
        if self.rank == 0:
            assert self.persistent_path is not None and self.persistent_path.is_file()
            if self.args.s3:  # the same file on the S3-protocol server: a persistent tier on an object store
                import fsspec

                fsspec.filesystem("s3").put(str(self.persistent_path), S3_PATH.removeprefix("s3://"))
        self.dist.barrier()
        return self.step

    def recover(self, how: str, node1_dir: Path) -> dict[str, Any]:
        info: dict[str, Any] = {"how": how}
        path = self.gather(str(self.persistent_path) if self.persistent_path else None)[0]
        if how == "local_replicas":
            if self.rank == PER_NODE:  # node 1's lowest rank: the node is back with an empty local directory
                for child in node1_dir.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            self.dist.barrier()
            info["node1_entries_before"] = sum(1 for _ in node1_dir.rglob("*"))
        elif how == "persistent_s3":
            path = S3_PATH
            info["cache"] = "n/a (moto keeps it in memory)"
        elif self.rank == 0:
            info.update(drop_cache(Path(path)) if how == "persistent_cold" else warm_cache(Path(path)))
        self.dist.barrier()
        mark = self.timers.mark()
        t0 = time.perf_counter()
        if how == "local_replicas":
            key = self.tier.latest(None)
            restored = self.tier.take(key)
            info["from"] = str(key)
        else:
            restored = self.io.load_checkpoint(path)
            info["from"] = path
        t1 = time.perf_counter()
        for dst, src in zip(self.model, state_tensors(restored) if restored is not None else []):
            dst.copy_(src)  # into the model, as load_state_dict does
        elapsed = time.perf_counter() - t0
        parts = self.timers.since(mark, RECOVERY_PARTS)
        parts["load"] = elapsed - (t1 - t0)
        ok = (restored is not None and same_state(restored, self.state)
              and all(self.torch.equal(a, b) for a, b in zip(self.model, state_tensors(self.state))))
        del restored
        rows = self.gather((elapsed, ok, parts))
        slow = max(rows, key=lambda r: r[0])
        info.update(seconds=slow[0], per_rank_s=[r[0] for r in rows], exact=all(r[1] for r in rows))
        if how == "local_replicas":
            info["parts"] = slow[2]
        return info

    def close(self) -> None:
        self.tier.close()
        self.io.teardown()


def drop_cache(path: Path) -> dict[str, Any]:
    """Drops the page cache (the whole machine's; needs root), else the file's own pages (fadvise)."""
    os.sync()
    method = "drop_caches"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        method = f"posix_fadvise DONTNEED (drop_caches refused: {e.strerror})"
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"cache": method, "cached_bytes": cached_bytes(path), "file_bytes": path.stat().st_size}


def warm_cache(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    return {"cache": "warm (read through first)", "cached_bytes": cached_bytes(path), "file_bytes": path.stat().st_size}


def cached_bytes(path: Path) -> int | None:
    """The file's bytes in the page cache (util-linux ``fincore``), or None without it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError, IndexError):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    return None


def recoveries_of(args: Any) -> list[str]:
    s3 = args.get("s3", False) if isinstance(args, dict) else args.s3
    return [k for k in RECOVERIES if s3 or k != "persistent_s3"]


def rank_main(rank: int, port: int, args: argparse.Namespace, base: Path, ckpt_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks on the machine's cores; the tiers' background work competes for them
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=args.timeout))
        trainer = Trainer(rank, args, base / f"node{rank // PER_NODE}", ckpt_dir)
        result: dict[str, Any] = {"matmuls_per_step": trainer.matmuls, "state_bytes": trainer.state_bytes,
                                  "tensors": len(trainer.tensors), "loadavg_start": os.getloadavg()}
        result["first"] = trainer.warmup()
        periods = []
        for rep in range(args.reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]
            for variant in order:
                p = trainer.period(variant)
                p["rep"] = rep
                periods.append(p)
                if rank == 0:
                    print(f"rep {rep} {variant:>10}: {p['period_s']:.2f} s, drain {p['drain_s']:.2f} s",
                          file=sys.stderr, flush=True)
        result["periods"] = periods
        result["recovery_step"] = trainer.prepare_recovery()
        recoveries = []
        kinds = recoveries_of(args)
        for rep in range(args.recoveries):
            order = kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]
            for how in order:
                r = trainer.recover(how, base / "node1")
                r["rep"] = rep
                recoveries.append(r)
                if rank == 0:
                    print(f"recovery {rep} {how:>16}: {r['seconds']:.2f} s, exact {r['exact']}",
                          file=sys.stderr, flush=True)
        result["recoveries"] = recoveries
        result["loadavg_end"] = os.getloadavg()
        trainer.close()
        dist.barrier()
        if rank == 0:
            out.write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # the other ranks fail their next collective (the group's timeout) or are killed


# -------------------------------------------------------------------------------------------------
# The orchestrator
def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    periods = result["periods"]
    base = {p["rep"]: p["period_s"] for p in periods if p["variant"] == "baseline"}
    base_cpu = {p["rep"]: p["cpu_s"] for p in periods if p["variant"] == "baseline"}
    base_median = _median(list(base.values()))
    rows = []
    for name in VARIANTS:
        mine = [p for p in periods if p["variant"] == name]
        paired = [p["period_s"] - base[p["rep"]] for p in mine if p["rep"] in base]
        median = _median([p["period_s"] for p in mine])
        row = {
            "variant": name,
            "periods": len(mine),
            "period_s": median,
            "overhead_s": _median(paired) if name != "baseline" else None,
            "overhead_all_s": paired,
            "overhead_of_medians_s": (median - base_median) if name != "baseline" and median is not None else None,
            "cpu_s": _median([p["cpu_s"] for p in mine]),
            "extra_cpu_s": _median([p["cpu_s"] - base_cpu[p["rep"]] for p in mine if p["rep"] in base_cpu])
            if name != "baseline" else None,
            "stall_s": _median([p.get("stall_s") for p in mine]),
            "background_s": _median([p.get("background_s") for p in mine]),
            "drain_s": _median([p["drain_s"] for p in mine]),
        }
        if name == "local":
            row["save_parts"] = {k: _median([p["save_parts"].get(k, 0.0) for p in mine]) for k in SAVE_PARTS}
            row["thread_parts"] = {k: _median([p["thread_parts"].get(k, 0.0) for p in mine]) for k in THREAD_PARTS}
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    rec_rows = []
    for how in [h for h in RECOVERIES if any(r["how"] == h for r in result["recoveries"])]:
        mine = [r for r in result["recoveries"] if r["how"] == how]
        row = {
            "how": how,
            "reps": len(mine),
            "seconds": _median([r["seconds"] for r in mine]),
            "min_s": min(r["seconds"] for r in mine) if mine else None,
            "max_s": max(r["seconds"] for r in mine) if mine else None,
            "exact": f"{sum(r['exact'] for r in mine)}/{len(mine)}",
            "cache": mine[0].get("cache") if mine else None,
            "cached_bytes": _median([r.get("cached_bytes") for r in mine]),
            "file_bytes": mine[0].get("file_bytes") if mine else None,
        }
        if how == "local_replicas":
            row["parts"] = {k: _median([r["parts"].get(k, 0.0) for r in mine]) for k in RECOVERY_PARTS}
        rec_rows.append(row)
    rec = {r["how"]: r for r in rec_rows}
    ratios = {
        "overhead_local_vs_persistent": _ratio(by["local"]["overhead_s"], by["persistent"]["overhead_s"]),
        "overhead_of_medians_local_vs_persistent": _ratio(by["local"]["overhead_of_medians_s"],
                                                          by["persistent"]["overhead_of_medians_s"]),
        "stall_local_vs_persistent": _ratio(by["local"]["stall_s"], by["persistent"]["stall_s"]),
        "extra_cpu_local_vs_persistent": _ratio(by["local"]["extra_cpu_s"], by["persistent"]["extra_cpu_s"]),
        "recovery_replicas_vs_persistent_cold": _ratio(rec["local_replicas"]["seconds"], rec["persistent_cold"]["seconds"]),
        "recovery_replicas_vs_persistent_warm": _ratio(rec["local_replicas"]["seconds"], rec["persistent_warm"]["seconds"]),
        "recovery_replicas_vs_persistent_s3": _ratio(rec["local_replicas"]["seconds"],
                                                     rec.get("persistent_s3", {}).get("seconds")),
    }
    return {"baseline_period_s": base_median, "overhead": rows, "recovery": rec_rows, "ratios": ratios}


def markdown(summary: dict[str, Any], result: dict[str, Any], args: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    first, every = result["first"], args["every"]
    base_step = summary["baseline_period_s"] / every if summary["baseline_period_s"] else None
    lines = [
        f"State {result['state_bytes'] / GiB:.3g} GiB in {result['tensors']} tensors on every rank; 4 ranks on 2 simulated"
        f" nodes; a save every {every} steps; baseline step {f(base_step, '.3f')} s ({result['matmuls_per_step']}"
        f" matmuls, a {args['grad_mib']:g} MiB all-reduce, add_ on the state); load average"
        f" {result['loadavg_start'][0]:.1f} at the start, {result['loadavg_end'][0]:.1f} at the end. Medians.",
        "",
        f"| variant | periods | period: save + {every} steps + drain (s) | overhead per save (s) | of the medians (s) "
        "| stall (s) | background (s) | drain (s) | CPU, all processes (s) | extra CPU per save (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["overhead"]:
        lines.append(
            f"| {r['variant']} | {r['periods']} | {f(r['period_s'], '.2f')} | {f(r['overhead_s'], '.3f')} "
            f"| {f(r['overhead_of_medians_s'], '.3f')} | {f(r['stall_s'], '.3f')} | {f(r['background_s'], '.2f')} "
            f"| {f(r['drain_s'], '.2f')} | {f(r['cpu_s'], '.2f')} | {f(r['extra_cpu_s'], '.2f')} |")
    local = next(r for r in summary["overhead"] if r["variant"] == "local")
    sp, tp = local["save_parts"], local["thread_parts"]
    lines += [
        "",
        f"Local save call (slowest rank): waiting for the previous save's thread {f(sp['wait_previous'], '.3f')} s,"
        f" copying the shares into their mapped files {f(sp['copy_share'], '.3f')} s. Its thread: replicas settled"
        f" (CRC32s gathered, repairs) {f(tp['replicate'], '.2f')} s, commits {f(tp['write'], '.2f')} s, the rest"
        f" {f(local['background_s'] - tp['replicate'] - tp['write'] if local['background_s'] is not None else None, '.2f')} s.",
        f"First (untimed) saves: local stall {f(first['local_first_stall_s'], '.3f')} s, done after"
        f" {f(first['local_first_to_done_s'], '.2f')} s; persistent stall {f(first['persistent_first_stall_s'], '.3f')} s,"
        f" committed after {f(first['persistent_first_to_done_s'], '.2f')} s.",
        "",
        "| recovery | reps | slowest rank (s) | min (s) | max (s) | exact | page cache | file cached before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["recovery"]:
        cached = (f"{r['cached_bytes'] / 1e6:.0f} of {r['file_bytes'] / 1e6:.0f} MB"
                  if r["cached_bytes"] is not None and r["file_bytes"] else "n/a")
        lines.append(
            f"| {r['how']} | {r['reps']} | {f(r['seconds'], '.3f')} | {f(r['min_s'], '.3f')} | {f(r['max_s'], '.3f')} "
            f"| {r['exact']} | {r['cache'] or 'n/a (/dev/shm is RAM)'} | {cached} |")
    rp = next(r for r in summary["recovery"] if r["how"] == "local_replicas")["parts"]
    rest = next(r for r in summary["recovery"] if r["how"] == "local_replicas")["seconds"]
    rest = rest - sum(v for v in rp.values() if v is not None) if rest is not None else None
    ra = summary["ratios"]
    lines += [
        "",
        f"Local recovery (slowest rank): shares sent between ranks {f(rp['transfer'], '.2f')} s, read (or mapped) from"
        f" node-local files {f(rp['read'], '.2f')} s, the full checkpoint assembled {f(rp['assemble'], '.2f')} s,"
        f" loaded into the model {f(rp.get('load'), '.2f')} s, the rest (listing, CRC32 checks, agreeing, unpickling)"
        f" {f(rest, '.2f')} s.",
        "",
        "| ratio | measured | target |",
        "|---|---|---|",
        f"| overhead per save, local / persistent | {f(ra['overhead_local_vs_persistent'], '.2f')}× | ≤ 0.5× |",
        f"| the same, of the medians | {f(ra['overhead_of_medians_local_vs_persistent'], '.2f')}× | |",
        f"| stall per save, local / persistent | {f(ra['stall_local_vs_persistent'], '.2f')}× | |",
        f"| extra CPU per save (all processes), local / persistent | {f(ra['extra_cpu_local_vs_persistent'], '.2f')}× | |",
        f"| recovery, replicas / persistent (page cache dropped) | {f(ra['recovery_replicas_vs_persistent_cold'], '.2f')}× | ≤ 0.5× |",
        f"| recovery, replicas / persistent (warm) | {f(ra['recovery_replicas_vs_persistent_warm'], '.2f')}× | |",
        f"| recovery, replicas / persistent on the S3-protocol server | {f(ra.get('recovery_replicas_vs_persistent_s3'), '.2f')}× | |",
    ]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    base = Path(f"/dev/shm/bench-tiers-{os.getpid()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    procs: list = []
    stack = contextlib.ExitStack()  # the S3-protocol server, stopped at the end whatever happens
    try:
        for node in range(WORLD // PER_NODE):
            (base / f"node{node}").mkdir(parents=True)
        (tmp / "ckpt").mkdir()
        out = tmp / "result.json"
        if args.s3:  # moto in its own process on loopback; the ranks (spawned) inherit the endpoint
            server = stack.enter_context(S3Server(tmp))
            os.environ.update(server.env, AWS_ENDPOINT_URL=server.direct_endpoint)
            import fsspec

            fsspec.filesystem("s3").mkdir(S3_PATH.removeprefix("s3://").split("/")[0])
        ctx = mp.get_context("spawn")
        port = _free_port()
        os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")  # torch.cuda's pynvml notice, per rank
        procs = [ctx.Process(target=rank_main, args=(r, port, args, base, tmp / "ckpt", out)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: the others, within a grace
                grace = min(deadline, time.monotonic() + 15)
                while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes) or not out.is_file():
            raise SystemExit(f"bench_tiers: the ranks exited with {codes} (deadline --timeout {args.timeout:g} s)")
        return json.loads(out.read_text())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stack.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.25, help="state in GiB (every rank holds all of it)")
    p.add_argument("--layers", type=int, default=16, help="layers; 3 tensors each (weight, two moments)")
    p.add_argument("--every", type=int, default=8, help="training steps after each save (a period)")
    p.add_argument("--reps", type=int, default=10, help="periods of every variant, in a rotated order")
    p.add_argument("--recoveries", type=int, default=7, help="repetitions of every recovery, in a rotated order")
    p.add_argument("--compute-ms", type=float, default=60.0, help="matmul time per step, calibrated at start")
    p.add_argument("--grad-mib", type=float, default=4.0, help="the all-reduce per step, in MiB")
    p.add_argument("--timeout", type=float, default=420.0, help="hard deadline of the whole run, in seconds")
    p.add_argument("--dir", default=None, help="where the persistent tier writes (default: the system's temp dir)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--no-s3", dest="s3", action="store_false",
                   help="skip the recovery from the same file on an S3-protocol server (moto, loopback)")
    p.add_argument("--render", default=None, help="print the tables of a saved tiers-*.json instead of running")
    args = p.parse_args()

    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(markdown(summarize(saved["result"]), saved["result"], saved["args"]))
        return
    t0 = time.monotonic()
    result = run(args)
    summary = summarize(result)
    table = markdown(summary, result, vars(args))
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    wall = time.monotonic() - t0
    (out / f"tiers-{stamp}.json").write_text(json.dumps(
        {"args": vars(args), "cpus": os.cpu_count(), "wall_s": wall, "summary": summary, "result": result}, indent=1))
    (out / f"tiers-{stamp}.md").write_text(
        f"# bench_tiers.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs,"
        f" {wall:.0f} s\n\n" + table + "\n")


if __name__ == "__main__":
    main()
