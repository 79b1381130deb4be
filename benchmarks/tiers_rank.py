"""One rank of ``bench_tiers.py`` (a spawned process): the training loop's stand-in, the variants'
periods, and the recoveries, timed in the rank (see ``bench_tiers.py`` for what each figure means)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import tiers_sharded
from page_cache import drop_cache, host_reported_kib, warm_cache
from tiers_parts import Timers, make_state, rotations, same_state, state_tensors

VARIANTS = ["baseline", "local", "local_lazy", "local_overlap", "persistent", "persistent_s3"]  # see bench_tiers.py
RECOVERIES = ["local_replicas", "persistent_cold", "persistent_warm", "persistent_s3"]
S3_PATH = "s3://bench-tiers/last.ckpt"
S3_SAVES = "s3://bench-tiers/saves"  # the persistent_s3 variant's checkpoints
SAVE_PARTS = ["wait_previous", "copy_share"]  # of the local save call
THREAD_PARTS = ["replicate", "write"]  # of the local save's thread: replicas settled, shares committed
RECOVERY_PARTS = ["transfer", "read", "assemble", "load", "crc32", "agree", "unpack", "list"]
GiB = 1 << 30
WORLD, PER_NODE = 4, 2


class Trainer:
    """The simulated training loop of one rank, and its two tiers."""

    def __init__(self, rank: int, args: argparse.Namespace, node_dir: Path, ckpt_dir: Path) -> None:
        import torch
        import torch.distributed as dist

        from lightning_asyncckpt import AsyncCheckpointIO
        from lightning_asyncckpt.tiers import restore as tier_restore
        from lightning_asyncckpt.tiers import saving as tier_saving
        from lightning_asyncckpt.tiers import store as tier_store
        from lightning_asyncckpt.tiers import writer as tier_writer
        from lightning_asyncckpt.tiers.store import LocalStore

        try:  # where replication has its own module, the writer imports it at each save
            from lightning_asyncckpt.tiers import replication as tier_replication
        except ImportError:
            tier_replication = None
        from lightning_asyncckpt.tiers.config import LocalTier
        from lightning_asyncckpt.tiers.setup import open_tier

        self.torch, self.dist, self.rank, self.args, self.ckpt_dir = torch, dist, rank, args, ckpt_dir
        self.sharded = getattr(args, "layout", "replicated") == "sharded"
        if self.sharded:
            self.state = tiers_sharded.make_state(int(args.size * GiB), args.layers, rank, WORLD)
        else:
            self.state = make_state(int(args.size * GiB), args.layers)
        self.tensors = state_tensors(self.state)
        self._state_ptrs = {t.data_ptr() for t in self.tensors}
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.grad = torch.ones(max(1, int(args.grad_mib * (1 << 20)) // 4))
        self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.matmuls = self._calibrate()
        self.step = 0
        config = LocalTier(node_dir, every_n_train_steps=args.every, replication_factor=2, emergency_signals=(),
                           timeout_s=args.timeout)
        self.tier = open_tier(config, node_rank=rank // PER_NODE, local_world_size=PER_NODE)
        self.io = AsyncCheckpointIO("nvrx")
        if rank == 0 and not self.sharded:
            self.io.warmup(like=self.state)  # starts the worker and allocates its staging buffers
        self.persistent_path: Path | None = None
        self.persistent_s3_path: str | None = None
        self.s3_pid = int(os.environ.get("BENCH_S3_PID", "0"))  # moto's process: its CPU is reported apart
        self.timers = t = Timers()
        t.wrap(tier_saving.packing, "copy_into", "copy_share")  # the save call's one copy, into mapped files
        t.wrap(self.tier.writer, "wait", "wait_previous")
        t.wrap(tier_writer.local_replicas, "settle", "replicate")  # replicated state: CRC32s gathered, repairs
        t.wrap(tier_replication, "replicate", "replicate")  # sharded state: NVRx's clique exchange
        t.wrap(self.tier.store, "commit", "write")  # header, manifest, renames
        t.wrap(tier_restore.exchange.Posted, "wait", "transfer")  # recovery: the wait for shares sent between ranks
        t.wrap(LocalStore, "read", "read")  # recovery: shares read from node-local files (before mapping)
        t.wrap(tier_store, "map_share", "read")  # recovery: another holder's shares on this node, mapped
        t.wrap(tier_restore.shares, "assemble", "assemble")
        t.wrap(tier_restore.packing, "crc32", "crc32")  # recovery: every check (the writer's are not in its window)
        t.wrap(self.tier, "gather", "agree")  # the holdings gathered, and every agreement of the restore
        t.wrap(tier_restore.packing, "unpack", "unpack")  # headers unpickled, tensors viewed
        t.wrap(LocalStore, "holdings", "list")  # manifests listed and read

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
        self.tier.wait_copy()  # the optimizer step's wait for a lazy local save's copy (none: returns at once)
        for t in self.tensors:
            t.add_(1.0)
        self.step += 1
        self.state["global_step"] = self.step

    # the tiers' saves -----------------------------------------------------------------------------
    def local_save(self, lazy: bool = False) -> float:
        # lazy: every state tensor (the optimizer's, here) copied in the background until before the add_
        self.tier.save(self.step, self.state, lazy=self._watch if lazy else None)
        return self.tier.last_stall_s

    def _watch(self, t: Any) -> list | None:
        return [t] if t.data_ptr() in self._state_ptrs else None

    def persistent_save(self, s3: bool = False) -> float | None:
        """(every rank) A persistent save of the current step: a DCP directory from every rank (sharded), or
        rank 0's ``torch.save`` file on the disk, or with ``s3`` in the bucket of the S3-protocol server."""
        if s3:
            return self._persistent_s3_save()
        path = self.ckpt_dir / f"step-{self.step}.ckpt"
        if self.sharded:  # every rank writes its shards into one DCP directory
            t0 = time.perf_counter()
            sharded, meta = tiers_sharded.split(self.state)
            self.io.save_checkpoint_sharded(sharded, path, meta)
            stall = time.perf_counter() - t0
        elif self.rank != 0:
            return None
        else:
            t0 = time.perf_counter()
            self.io.save_checkpoint(self.state, path)
            stall = time.perf_counter() - t0
        if self.rank == 0 and self.persistent_path is not None:
            self.io.remove_checkpoint(self.persistent_path)  # once the new one commits (save_top_k=1)
        self.persistent_path = path
        return stall

    def _persistent_s3_save(self) -> float | None:
        if self.rank != 0:
            return None
        path = f"{S3_SAVES}/step-{self.step}.ckpt"
        t0 = time.perf_counter()
        self.io.save_checkpoint(self.state, path)
        stall = time.perf_counter() - t0
        if self.persistent_s3_path is not None:
            self.io.remove_checkpoint(self.persistent_s3_path)
        self.persistent_s3_path = path
        return stall

    def server_cpu_s(self) -> float:
        """CPU seconds of the S3-protocol server (rank 0 reads it; 0 without one)."""
        import psutil

        if self.rank != 0 or not self.s3_pid:
            return 0.0
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(self.s3_pid).cpu_times()
            return t.user + t.system
        return 0.0

    def drain(self, variant: str) -> None:
        if variant.startswith("local"):
            complete = self.tier.finish()
            assert complete == self.tier.saved_step, (complete, self.tier.saved_step)
        elif variant.startswith("persistent"):
            self.io.finalize(blocking=True)

    # overhead ---------------------------------------------------------------------------------------
    def period(self, variant: str) -> dict[str, Any]:
        """(all ranks) One timed period: a save (none for the baseline), ``--every`` steps, the drain."""
        history = len(self.io.history)
        self.dist.barrier()
        mark, cpu0, server0 = self.timers.mark(), self.cpu_s(), self.server_cpu_s()
        t0 = time.perf_counter()
        stall = None
        if variant.startswith("local"):
            self.tier._steps.agreement.overlapped = variant == "local_overlap"  # benchmark only: LocalTier(overlap_agreement=True) in place
            stall = self.local_save(lazy=variant == "local_lazy")
        elif variant.startswith("persistent"):
            stall = self.persistent_save(s3=variant == "persistent_s3")
        save_parts = self.timers.since(mark, SAVE_PARTS)
        for _ in range(self.args.every):
            self.train_step()
            if variant.startswith("local"):
                self.tier.boundary()
            elif variant.startswith("persistent"):
                self.io.finalize()
        t1 = time.perf_counter()
        self.drain(variant)
        self.dist.barrier()
        elapsed, drain = time.perf_counter() - t0, time.perf_counter() - t1
        cpu, server_cpu = self.cpu_s() - cpu0, self.server_cpu_s() - server0
        thread_parts = self.timers.since(mark, THREAD_PARTS)
        background = None
        if variant.startswith("local"):
            background = self.tier.writer.last_write_s
        elif variant.startswith("persistent") and self.rank == 0:
            background = self.io.history[-1].write_s if len(self.io.history) > history else None
        rows = self.gather({"stall": stall, "save_parts": save_parts, "background": background,
                            "thread_parts": thread_parts, "cpu": cpu})
        out: dict[str, Any] = {"variant": variant, "period_s": elapsed, "drain_s": drain, "steps": self.args.every,
                               "cpu_s": sum(r["cpu"] for r in rows), "cpu_per_rank_s": [r["cpu"] for r in rows],
                               "server_cpu_s": server_cpu if self.rank == 0 else None}
        if variant.startswith("local"):  # the slowest rank's, with its parts (the ranks wait for each other every step)
            slow = max(rows, key=lambda r: r["stall"])
            out.update(stall_s=slow["stall"], save_parts=slow["save_parts"])
            slow = max(rows, key=lambda r: r["background"])
            out.update(background_s=slow["background"], thread_parts=slow["thread_parts"])
        elif variant.startswith("persistent"):  # sharded: every rank's save call, the slowest
            stall = max(r["stall"] for r in rows) if self.sharded else rows[0]["stall"]
            out.update(stall_s=stall, background_s=rows[0]["background"])
        return out

    def warmup(self) -> dict[str, Any]:
        """(all ranks) A few steps, then one untimed save of each tier, drained: first-time costs."""
        self.train_step()
        self.tier.prepare(self.state)  # as the Trainer and Fabric integrations do, at a boundary before the first save
        self.train_step()
        out = {}
        for variant in [v for v in variants_of(self.args) if v in ("local", "persistent", "persistent_s3")]:
            self.dist.barrier()
            t0 = time.perf_counter()
            stall = self.local_save() if variant == "local" else self.persistent_save(s3=variant == "persistent_s3")
            self.drain(variant)
            self.dist.barrier()
            rows = self.gather(stall)
            out[f"{variant}_first_stall_s"] = max(rows) if variant == "local" or self.sharded else rows[0]
            out[f"{variant}_first_to_done_s"] = time.perf_counter() - t0
        return out

    # recovery ---------------------------------------------------------------------------------------
    def prepare_recovery(self) -> int:
        """(all ranks) One more step and a save of it to both tiers, complete and committed; the model's
        tensors that a recovery loads into, allocated and touched."""
        import torch

        if self.sharded:  # DTensors that DCP loads into; the local tier's shards are copied into their locals
            self.model_state = tiers_sharded.zeros_like(self.state)
            self.model = state_tensors(self.model_state)
        else:
            self.model = [torch.zeros_like(t) for t in state_tensors(self.state)]
        self.train_step()
        self.local_save()
        self.persistent_save()
        self.drain("local")
        self.drain("persistent")
        assert self.tier.complete == self.step
        if self.rank == 0:
            assert self.persistent_path is not None and self.persistent_path.exists()
            if self.args.s3:  # the same file on the S3-protocol server: a persistent tier on an object store
                import fsspec

                fsspec.filesystem("s3").put(str(self.persistent_path), S3_PATH.removeprefix("s3://"))
        self.dist.barrier()
        return self.step

    def recover(self, how: str, node1_dir: Path) -> dict[str, Any]:
        info: dict[str, Any] = {"how": how}
        reported = [host_reported_kib()]  # before node 1's files are freed, at the timed part, after it
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
        for t in self.model:  # so that each recovery proves it loaded the state
            t.zero_()
        self.dist.barrier()
        mark = self.timers.mark()
        reported.append(host_reported_kib())
        t0 = time.perf_counter()
        in_place = False
        if how == "local_replicas":
            key = self.tier.latest(None)
            restored = self.tier.take(key)
            info["from"] = str(key)
        elif self.sharded:  # DCP reads into the model's tensors: its load is the whole recovery
            tiers_sharded.load_persistent(Path(path), self.model_state)
            restored, in_place = {**self.model_state, "global_step": self.step}, True  # meta.pt: not read
            info["from"] = path
        else:
            restored = self.io.load_checkpoint(path)
            info["from"] = path
        t1 = time.perf_counter()
        if restored is not None and not in_place:
            for dst, src in zip(self.model, state_tensors(restored)):
                dst.copy_(src)  # into the model, as load_state_dict does
        elapsed = time.perf_counter() - t0
        reported.append(host_reported_kib())
        if None not in reported:  # MiB handed to the VM's host before the timed part (node 1 emptied), in it
            info["host_reported_mib"] = [(b - a) / 1024 for a, b in zip(reported, reported[1:])]
        parts = self.timers.since(mark, RECOVERY_PARTS)
        parts["load"] = elapsed - (t1 - t0)
        ok = (restored is not None and same_state(restored, self.state)
              and all(self.torch.equal(a, b) for a, b in zip(self.model, state_tensors(self.state))))
        del restored
        if how == "local_replicas":  # untimed: the first boundary sends what the restore left for later (FSDP2)
            self.tier.finish()
        rows = self.gather((elapsed, ok, parts))
        slow = max(rows, key=lambda r: r[0])
        info.update(seconds=slow[0], per_rank_s=[r[0] for r in rows], exact=all(r[1] for r in rows))
        if how == "local_replicas":
            info["parts"] = slow[2]
            info["parts_per_rank"] = [r[2] for r in rows]
        return info

    def close(self) -> None:
        self.tier.close()
        self.io.teardown()


def variants_of(args: Any) -> list[str]:
    """The overhead variants of this run: ``persistent_s3`` only with the S3-protocol server (replicated)."""
    s3 = args.get("s3", False) if isinstance(args, dict) else args.s3
    return [v for v in VARIANTS if s3 or v != "persistent_s3"]


def recoveries_of(args: Any) -> list[str]:
    s3 = args.get("s3", False) if isinstance(args, dict) else args.s3
    return [k for k in RECOVERIES if s3 or k != "persistent_s3"]


def rank_main(rank: int, port: int, args: argparse.Namespace, base: Path, ckpt_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks on the machine's cores; the tiers' background work competes for them
    if getattr(args, "pin_nodes", False):  # each simulated node on cores of its own; its writers inherit them
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // (WORLD // PER_NODE))
        node = rank // PER_NODE
        os.sched_setaffinity(0, set(cores[node * per:(node + 1) * per] or cores[-per:]))
    try:
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")  # node 0's address on an emulated cluster
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=args.timeout))
        trainer = Trainer(rank, args, base / f"node{rank // PER_NODE}", ckpt_dir)
        result: dict[str, Any] = {"matmuls_per_step": trainer.matmuls, "state_bytes": trainer.state_bytes,
                                  "tensors": len(trainer.tensors), "loadavg_start": os.getloadavg()}
        result["first"] = trainer.warmup()
        result["periods"] = rotations(
            variants_of(args), args.reps, trainer.period, rank == 0,
            lambda rep, v, p: f"rep {rep} {v:>10}: {p['period_s']:.2f} s, drain {p['drain_s']:.2f} s")
        result["recovery_step"] = trainer.prepare_recovery()
        result["recoveries"] = rotations(
            recoveries_of(args), args.recoveries, lambda how: trainer.recover(how, base / "node1"), rank == 0,
            lambda rep, how, r: f"recovery {rep} {how:>16}: {r['seconds']:.2f} s, exact {r['exact']}")
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


