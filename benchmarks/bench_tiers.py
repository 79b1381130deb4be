"""The local tier against the persistent one, in one run: training overhead per save and recovery time.

    python benchmarks/bench_tiers.py                      # 0.25 GiB of state, 4 ranks on 2 simulated nodes
    python benchmarks/bench_tiers.py --size 0.5 --rounds 7 --recoveries 7
    python benchmarks/bench_tiers.py --render benchmarks/results/tiers-<time>.json

Four ranks (``torch.multiprocessing``, spawn; gloo on 127.0.0.1) simulate two nodes: ranks 0 and 1 are
node 0, ranks 2 and 3 node 1 (``TierRun(node_rank=rank // 2, local_world_size=2)``), so the local tier's
cliques are {0, 2} and {1, 3} and every share has its replica on the other node. Each node has its own
local directory (``/dev/shm/bench-tiers-<pid>/node<k>``); the persistent tier writes a ``torch.save`` file
under a temporary directory on the normal disk. Everything is removed at the end; every rank has a hard
deadline (``--timeout``), after which the parent kills it.

Every rank holds the same Lightning-like checkpoint (``state_dict``, ``optimizer_states`` with two
moments per layer, ``global_step``: ``--size`` GiB of float32 in ``3 x --layers`` tensors). A *training
step* is a matmul loop (calibrated at start to about ``--compute-ms`` with all ranks running), a
``--grad-mib`` all-reduce (a DDP gradient bucket's stand-in, which keeps the ranks in step, as DDP does),
then ``add_(1)`` on every state tensor (an optimizer step writes all of it).

**Overhead.** Variants, in an order rotated per round, in the same processes: ``baseline`` (no saves),
``local`` (``TierRun.save`` every ``--every`` steps, ``TierRun.boundary()`` after every step) and
``persistent`` (rank 0 ``AsyncCheckpointIO("nvrx").save_checkpoint`` every ``--every`` steps, the previous
file removed as ``ModelCheckpoint(save_top_k=1)`` does, ``finalize()`` on every rank after every step). A
variant's window is ``(--saves + 1) x --every`` steps, the saves after steps ``every, 2 every, ...``, so the
last save has ``--every`` steps to finish in the background; the window is timed on rank 0 from a barrier
to a barrier, then the tier is drained (untimed, reported). Per round:

- **overhead per save** = (window - the same round's baseline window) / saves;
- **stall**: the save call itself (local: the slowest rank's ``last_stall_s``; persistent: rank 0's call);
- **background**: the local writer thread's time per save (serialize, replicate, write; slowest rank), and
  the persistent save's time from the call to its commit (``SaveRecord.write_s``).

One untimed save of each tier, drained, comes first (worker start, staging buffers, the space check).

**Recovery.** After one more save of each tier, of the same step, is complete (and committed): node 1
*comes back empty*: rank 2 deletes everything in node 1's local directory, then every rank times
``TierRun.latest(None)`` + ``take`` (its own share from its copy or its peer's replica, CRC checks, the
full checkpoint assembled on every rank) against every rank's ``AsyncCheckpointIO.load_checkpoint`` of the
persistent file, once with the page cache dropped first (``sync; echo 3 > /proc/sys/vm/drop_caches``, or,
where that is refused, ``posix_fadvise(DONTNEED)`` on the file; the bytes still cached, read by
``fincore``, are reported) and once warm (read through first). A recovery's time is the slowest rank's,
from a common barrier. Every restored checkpoint is compared, tensor by tensor, with the live state.
Repeated ``--recoveries`` times, in a rotated order; figures are medians. Results:
``benchmarks/results/tiers-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

VARIANTS = ["baseline", "local", "persistent"]
RECOVERIES = ["local_replicas", "persistent_cold", "persistent_warm"]
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


class Trainer:
    """The simulated training loop of one rank, and its two tiers."""

    def __init__(self, rank: int, args: argparse.Namespace, node_dir: Path, ckpt_dir: Path) -> None:
        import torch
        import torch.distributed as dist

        from lightning_asyncckpt import AsyncCheckpointIO
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

    def _calibrate(self) -> int:
        """Matmuls per step for about --compute-ms, timed with every rank computing at once (contended)."""
        torch, dist = self.torch, self.dist
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):
                torch.mm(self.a, self.b)
            times.append((time.perf_counter() - t0) / 10)
        per = torch.tensor([statistics.median(times[1:])], dtype=torch.float64)
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
        return max(1, round(self.args.compute_ms / 1000 / float(per)))

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

    def drain(self, variant: str) -> float:
        t0 = time.perf_counter()
        if variant == "local":
            complete = self.tier.finish()
            assert complete == self.tier.saved_step, (complete, self.tier.saved_step)
        elif variant == "persistent":
            self.io.finalize(blocking=True)
        self.dist.barrier()
        return time.perf_counter() - t0

    # overhead ---------------------------------------------------------------------------------------
    def window(self, variant: str) -> dict[str, Any]:
        """(all ranks) One variant's timed window: (saves + 1) x every steps, saving after every ``every``."""
        every, saves = self.args.every, self.args.saves
        local_writes, history_before = [], len(self.io.history)
        stalls, step_times = [], []
        self.dist.barrier()
        t0 = time.perf_counter()
        for i in range(1, (saves + 1) * every + 1):
            s0 = time.perf_counter()
            self.train_step()
            if i % every == 0 and i <= saves * every:
                if variant == "local":
                    stalls.append(self.local_save())  # waits for the previous save's thread, then starts this one
                    if i > every:  # the previous save's thread time (this one's is far from done)
                        local_writes.append(self.tier.writer.last_write_s)
                elif variant == "persistent":
                    stalls.append(self.persistent_save())
            if variant == "local":
                self.tier.boundary()
            elif variant == "persistent":
                self.io.finalize()
            step_times.append(time.perf_counter() - s0)
        self.dist.barrier()
        elapsed = time.perf_counter() - t0
        drain_s = self.drain(variant)
        if variant == "local":
            local_writes.append(self.tier.writer.last_write_s)
        commits = [r.write_s for r in self.io.history[history_before:]] if variant == "persistent" else []
        rows = self.gather({"stalls": stalls, "writes": local_writes, "commits": commits})
        # the slowest rank's stall and background time per save (the ranks wait for each other every step)
        n = len(stalls)
        if variant == "local":
            stall = [max(r["stalls"][j] for r in rows) for j in range(n)]
            background = [max(r["writes"][j] for r in rows) for j in range(len(local_writes))]
        elif variant == "persistent":
            stall, background = rows[0]["stalls"], rows[0]["commits"]
        else:
            stall, background = [], []
        return {"variant": variant, "window_s": elapsed, "steps": len(step_times), "saves": n,
                "step_times": step_times, "stall_s": stall, "background_s": background, "drain_s": drain_s}

    def warmup(self) -> dict[str, Any]:
        """(all ranks) A few steps, then one untimed save of each tier, drained: first-time costs."""
        for _ in range(3):
            self.train_step()
        local_stall = self.local_save()
        local_drain = self.drain("local")
        pstall = self.persistent_save()
        pdrain = self.drain("persistent")
        rows = self.gather(local_stall)
        return {"local_first_stall_s": max(rows), "local_first_drain_s": local_drain,
                "persistent_first_stall_s": pstall if self.rank == 0 else None, "persistent_first_drain_s": pdrain}

    # recovery ---------------------------------------------------------------------------------------
    def prepare_recovery(self) -> int:
        """(all ranks) One more step and a save of it to both tiers, complete and committed."""
        self.train_step()
        self.local_save()
        self.persistent_save()
        self.drain("local")
        self.drain("persistent")
        assert self.tier.complete == self.step
        if self.rank == 0:
            assert self.persistent_path is not None and self.persistent_path.is_file()
        return self.step

    def recover(self, how: str, node1_dir: Path) -> dict[str, Any]:
        info: dict[str, Any] = {"how": how}
        path = self.gather(str(self.persistent_path) if self.persistent_path else None)[0]
        if how == "local_replicas":
            if self.rank == PER_NODE:  # node 1's lowest rank: the node is back with an empty local directory
                for child in node1_dir.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            self.dist.barrier()
            info["node1_files_before"] = sum(1 for _ in node1_dir.rglob("*"))
        elif self.rank == 0:
            info.update(drop_cache(Path(path)) if how == "persistent_cold" else warm_cache(Path(path)))
        self.dist.barrier()
        t0 = time.perf_counter()
        if how == "local_replicas":
            key = self.tier.latest(None)
            restored = self.tier.take(key)
            info["from"] = str(key)
        else:
            restored = self.io.load_checkpoint(path)
            info["from"] = path
        elapsed = time.perf_counter() - t0
        ok = restored is not None and same_state(restored, self.state)
        del restored
        rows = self.gather((elapsed, ok))
        info.update(seconds=max(r[0] for r in rows), per_rank_s=[r[0] for r in rows], exact=all(r[1] for r in rows))
        return info

    def close(self) -> None:
        self.tier.close()
        self.io.teardown()


def drop_cache(path: Path) -> dict[str, Any]:
    """Drops the page cache (the whole machine's; we are root), else the file's pages (fadvise)."""
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
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0])
    return None


def rank_main(rank: int, port: int, args: argparse.Namespace, base: Path, ckpt_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 ranks on the machine's cores; the tiers' background work competes for them
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=args.timeout))
        trainer = Trainer(rank, args, base / f"node{rank // PER_NODE}", ckpt_dir)
        result: dict[str, Any] = {"matmuls_per_step": trainer.matmuls, "state_bytes": trainer.state_bytes,
                                  "tensors": len(trainer.tensors)}
        result["first"] = trainer.warmup()
        windows = []
        for rnd in range(args.rounds):
            order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[: rnd % len(VARIANTS)]
            for variant in order:
                w = trainer.window(variant)
                w["round"] = rnd
                windows.append(w)
                if rank == 0:
                    print(f"round {rnd} {variant:>10}: {w['window_s']:.2f} s, drain {w['drain_s']:.2f} s",
                          file=sys.stderr, flush=True)
        result["windows"] = windows
        result["recovery_step"] = trainer.prepare_recovery()
        recoveries = []
        for rep in range(args.recoveries):
            order = RECOVERIES[rep % len(RECOVERIES):] + RECOVERIES[: rep % len(RECOVERIES)]
            for how in order:
                r = trainer.recover(how, base / "node1")
                r["rep"] = rep
                recoveries.append(r)
                if rank == 0:
                    print(f"recovery {rep} {how:>16}: {r['seconds']:.2f} s, exact {r['exact']}",
                          file=sys.stderr, flush=True)
        result["recoveries"] = recoveries
        trainer.close()
        dist.barrier()
        if rank == 0:
            out.write_text(json.dumps(result))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never leave the other ranks waiting in a collective longer than their timeout


# -------------------------------------------------------------------------------------------------
# The orchestrator
def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    windows = result["windows"]
    base = {w["round"]: w["window_s"] for w in windows if w["variant"] == "baseline"}
    base_steps = [s for w in windows if w["variant"] == "baseline" for s in w["step_times"]]
    base_step = _median(base_steps)
    rows = []
    for name in VARIANTS:
        mine = [w for w in windows if w["variant"] == name]
        per_save = [(w["window_s"] - base[w["round"]]) / w["saves"] for w in mine if w["saves"] and w["round"] in base]
        rows.append({
            "variant": name,
            "windows": len(mine),
            "window_s": _median([w["window_s"] for w in mine]),
            "step_s": _median([s for w in mine for s in w["step_times"]]),
            "overhead_per_save_s": _median(per_save),
            "overhead_per_save_all_s": per_save,
            "overhead_vs_step": (_median(per_save) / base_step) if per_save and base_step else None,
            "stall_s": _median([s for w in mine for s in w["stall_s"]]),
            "background_s": _median([s for w in mine for s in w["background_s"]]),
            "drain_s": _median([w["drain_s"] for w in mine]),
        })
    by = {r["variant"]: r for r in rows}
    rec_rows = []
    recs = result["recoveries"]
    for how in RECOVERIES:
        mine = [r for r in recs if r["how"] == how]
        rec_rows.append({
            "how": how,
            "reps": len(mine),
            "seconds": _median([r["seconds"] for r in mine]),
            "min_s": min(r["seconds"] for r in mine) if mine else None,
            "max_s": max(r["seconds"] for r in mine) if mine else None,
            "exact": f"{sum(r['exact'] for r in mine)}/{len(mine)}",
            "cache": mine[0].get("cache") if mine else None,
            "cached_bytes": _median([r.get("cached_bytes") for r in mine]),
            "file_bytes": mine[0].get("file_bytes") if mine else None,
        })
    rec = {r["how"]: r for r in rec_rows}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    ratios = {
        "overhead_local_vs_persistent": ratio(by["local"]["overhead_per_save_s"], by["persistent"]["overhead_per_save_s"]),
        "stall_local_vs_persistent": ratio(by["local"]["stall_s"], by["persistent"]["stall_s"]),
        "recovery_replicas_vs_persistent_cold": ratio(rec["local_replicas"]["seconds"], rec["persistent_cold"]["seconds"]),
        "recovery_replicas_vs_persistent_warm": ratio(rec["local_replicas"]["seconds"], rec["persistent_warm"]["seconds"]),
    }
    return {"base_step_s": base_step, "overhead": rows, "recovery": rec_rows, "ratios": ratios}


def markdown(summary: dict[str, Any], result: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    first = result["first"]
    lines = [
        f"State {result['state_bytes'] / GiB:.3g} GiB in {result['tensors']} tensors per rank, 4 ranks on 2 simulated"
        f" nodes; baseline step {f(summary['base_step_s'], '.3f')} s ({result['matmuls_per_step']} matmuls);"
        f" medians.",
        "",
        "| variant | windows | window (s) | step (s) | overhead per save (s) | × baseline step | stall (s) "
        "| background per save (s) | drain after window (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["overhead"]:
        lines.append(
            f"| {r['variant']} | {r['windows']} | {f(r['window_s'], '.2f')} | {f(r['step_s'], '.3f')} "
            f"| {f(r['overhead_per_save_s'], '.3f')} | {f(r['overhead_vs_step'], '.2f')} | {f(r['stall_s'], '.3f')} "
            f"| {f(r['background_s'], '.2f')} | {f(r['drain_s'], '.2f')} |")
    lines += [
        "",
        f"First (untimed) saves: local stall {f(first['local_first_stall_s'], '.3f')} s, drain"
        f" {f(first['local_first_drain_s'], '.2f')} s; persistent stall {f(first['persistent_first_stall_s'], '.3f')} s,"
        f" drain {f(first['persistent_first_drain_s'], '.2f')} s.",
        "",
        "| recovery | reps | time, slowest rank (s) | min (s) | max (s) | exact | page cache | file cached before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary["recovery"]:
        cached = (f"{r['cached_bytes'] / 1e6:.0f} of {r['file_bytes'] / 1e6:.0f} MB"
                  if r["cached_bytes"] is not None and r["file_bytes"] else "n/a")
        lines.append(
            f"| {r['how']} | {r['reps']} | {f(r['seconds'], '.3f')} | {f(r['min_s'], '.3f')} | {f(r['max_s'], '.3f')} "
            f"| {r['exact']} | {r['cache'] or 'n/a (RAM: /dev/shm)'} | {cached if r['how'] != 'local_replicas' else 'n/a'} |")
    ra = summary["ratios"]
    lines += [
        "",
        "| ratio | measured | target |",
        "|---|---|---|",
        f"| overhead per save, local / persistent | {f(ra['overhead_local_vs_persistent'], '.2f')}× | ≤ 0.5× |",
        f"| stall per save, local / persistent | {f(ra['stall_local_vs_persistent'], '.2f')}× | |",
        f"| recovery, replicas / persistent (cache dropped) | {f(ra['recovery_replicas_vs_persistent_cold'], '.2f')}× | ≤ 0.5× |",
        f"| recovery, replicas / persistent (warm cache) | {f(ra['recovery_replicas_vs_persistent_warm'], '.2f')}× | |",
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
    try:
        for node in range(WORLD // PER_NODE):
            (base / f"node{node}").mkdir(parents=True)
        (tmp / "ckpt").mkdir()
        out = tmp / "result.json"
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=rank_main, args=(r, port, args, base, tmp / "ckpt", out), daemon=False)
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank failed: the others fail within a grace
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
            raise SystemExit(f"bench_tiers: ranks exited with {codes} (deadline --timeout {args.timeout:g} s); see above")
        return json.loads(out.read_text())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=0.25, help="state per rank in GiB (every rank holds all of it)")
    p.add_argument("--layers", type=int, default=16, help="layers; 3 tensors each (weight, two moments)")
    p.add_argument("--every", type=int, default=8, help="steps between saves")
    p.add_argument("--saves", type=int, default=3, help="saves per timed window")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every variant, order rotated")
    p.add_argument("--recoveries", type=int, default=5, help="repetitions of every recovery, order rotated")
    p.add_argument("--compute-ms", type=float, default=60.0, help="matmul time per step, calibrated at start")
    p.add_argument("--grad-mib", type=float, default=4.0, help="the all-reduce per step, in MiB")
    p.add_argument("--timeout", type=float, default=420.0, help="hard deadline of the whole run, in seconds")
    p.add_argument("--dir", default=None, help="where the persistent tier writes (default: the system's temp dir)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--render", default=None, help="print the tables of a saved tiers-*.json instead of running")
    args = p.parse_args()

    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(markdown(summarize(saved["result"]), saved["result"]))
        return
    t0 = time.monotonic()
    result = run(args)
    summary = summarize(result)
    table = markdown(summary, result)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    load = os.getloadavg()
    (out / f"tiers-{stamp}.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, "result": result, "cpus": os.cpu_count(), "loadavg": load,
         "wall_s": time.monotonic() - t0}, indent=1))
    (out / f"tiers-{stamp}.md").write_text(
        f"# bench_tiers.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs,"
        f" load average {load[0]:.1f} at the end, {time.monotonic() - t0:.0f} s\n\n" + table + "\n")


if __name__ == "__main__":
    main()
