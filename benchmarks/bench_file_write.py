"""Background write of one checkpoint: stock's single ``torch.save`` file vs this library's DCP shards.

    python benchmarks/bench_file_write.py                    # ~1 GiB in 100 tensors, 3 runs each
    python benchmarks/bench_file_write.py --gib 0.25 --runs 1 --dir /path/on/local/disk

The state (float32, bf16 and int64 tensors plus a small non-tensor part) is staged once with the real
``Stager(shared=True, copy_cpu=True)``, as a save hands it to the worker. Each write runs in a forked
child, as the fork-per-save worker does, into a fresh temporary name on ``--dir``, fsync included;
the child measures its wall time and its CPU seconds (``getrusage``, user + system, all threads).
Variants, in rotating order:

- ``dcp``: ``dcp_writer.write_job`` with the engine's ``FileSystemWriterAsync``'s plan (each shard file
  through ``direct_io.DirectFile``; ``--threads`` shard files), then the coordinator's ``.metadata``
  (timed in the parent, added);
- ``file``: ``torch_file.write_file`` (``torch.save`` recorded into ``direct_io.DirectFile`` with CRC32 off,
  ``zip_crc.fill`` with ISA-L, O_DIRECT chunks from the staged copies written as each part is final);
- ``file_torch_crc``: the writer before ``zip_crc``: ``torch.save`` into a ``DirectFile`` with torch's own
  CRC32 computed while it serializes (same bytes);
- ``file_path``: ``torch.save`` to the path (torch's C++ file writer), then an fsync (to a visible
  name: that writer refuses a file name starting with ``.``, such as ``commit.tmp_for``'s);
Reports the median over ``--runs`` of each.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_asyncckpt.pipeline import dcp_plan
from lightning_asyncckpt.snapshot import staging
from lightning_asyncckpt.storage import commit
from lightning_asyncckpt.units import human_bytes
from lightning_asyncckpt.write import dcp_writer, direct_io, file_layout, torch_file
from lightning_asyncckpt.write.jobs import DcpJob

VARIANTS = ("dcp", "file", "file_torch_crc", "file_path")


def make_checkpoint(nbytes: int, count: int) -> dict:
    per = nbytes // count
    state = {}
    for i in range(count):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[i % 10 // 8 + (i % 10 == 9)]
        numel = per // torch.empty((), dtype=dtype).element_size()
        state[f"layer{i}.weight"] = torch.randint(0, 1000, (numel,)).to(dtype)
    return {"state_dict": state, "epoch": 3, "global_step": 100, "hyper_parameters": {"lr": 0.1, "dims": [1, 2]}}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(variant: str, snap: staging.Snapshot, target: str, report: str, engine: str, threads: int) -> None:
    cpu0, t0 = _cpu_s(), time.perf_counter()
    extra: dict = {}
    if variant == "dcp":
        from lightning_asyncckpt import engines

        eng = engines.create(engines.EngineName(engine), engines.WorkerMode("fork"), 0)
        state = dict(snap.tensors)
        state[staging.SKELETON_KEY] = snap.skeleton
        plan = dcp_plan.plan_save(state, Path(target), eng.writer_cls, threads, eng.split_by_size, False)
        os.makedirs(target, exist_ok=True)
        result_path = report + ".result"
        dcp_writer.write_job(DcpJob(eng.writer_cls, plan.transforms, plan.buckets, result_path))
        with open(result_path, "rb") as f:
            outcome = pickle.load(f)
        assert outcome["ok"], outcome
        extra = {"plan": plan, "results": outcome["results"]}
    elif variant == "file_path":
        checkpoint, _ = file_layout.rebuild(snap.skeleton, snap.tensors)
        torch.save(checkpoint, target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    elif variant == "file_torch_crc":
        checkpoint, used = file_layout.rebuild(snap.skeleton, snap.tensors)
        with direct_io.DirectFile(target, direct_io.storage_regions(used.values())) as f:
            torch.save(checkpoint, f, pickle_protocol=2)
    else:
        torch_file.write_file(snap.skeleton, snap.tensors, target)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    with open(report, "wb") as f:
        pickle.dump({"wall_s": wall, "cpu_s": cpu, **({"results": extra["results"]} if extra else {})}, f)


def _size(path: str) -> int:
    if os.path.isdir(path):
        return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return os.path.getsize(path)


def run_one(variant: str, snap: staging.Snapshot, outdir: Path, n: int, engine: str, threads: int) -> dict:
    target = str(commit.tmp_for(outdir / f"{variant}.ckpt", f"bench-{variant}-{n}"))
    if variant == "file_path":  # torch's C++ writer rejects a name starting with "." ("invalid file name")
        target = str(outdir / f"{variant}-{n}.tmp")
    report = str(outdir / f".report-{variant}-{n}")
    proc = mp.get_context("fork").Process(target=_child, args=(variant, snap, target, report, engine, threads))
    proc.start()
    proc.join()
    assert proc.exitcode == 0, f"{variant} writer exited {proc.exitcode}"
    with open(report, "rb") as f:
        out = pickle.load(f)
    os.unlink(report)
    if variant == "dcp":  # the coordinator's commit step: .metadata, as io.py does after the write
        from lightning_asyncckpt import engines

        eng = engines.create(engines.EngineName(engine), engines.WorkerMode("fork"), 0)
        state = dict(snap.tensors)
        state[staging.SKELETON_KEY] = snap.skeleton
        t0 = time.perf_counter()
        plan = dcp_plan.plan_save(state, Path(target), eng.writer_cls, threads, eng.split_by_size, False)
        plan.writer.finish(plan.metadata, [out.pop("results")])
        out["wall_s"] += time.perf_counter() - t0
    out["nbytes"] = _size(target)
    commit.remove_path(Path(target))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a directory on local disk (default: a new one under the cwd)")
    ap.add_argument("--engine", default="nvrx", choices=("nvrx", "mcore"))
    ap.add_argument("--threads", type=int, default=1, help="DCP shard files / writer threads (io.py's default 1)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")

    ckpt = make_checkpoint(int(args.gib * (1 << 30)), args.tensors)
    snap = staging.Stager(shared=True, copy_cpu=True).snapshot(ckpt)
    del ckpt
    outdir = Path(tempfile.mkdtemp(prefix="bench-file-", dir=args.dir or os.getcwd()))
    print(f"state {human_bytes(snap.nbytes)} in {len(snap.tensors)} tensors, writing to {outdir}, torch {torch.__version__}")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for n in range(args.runs):
            for v in variants[n % len(variants):] + variants[:n % len(variants)]:
                r = run_one(v, snap, outdir, n, args.engine, args.threads)
                runs[v].append(r)
                print(f"  run {n} {v:11s} {r['wall_s']:.2f}s wall {r['cpu_s']:.2f}s cpu {human_bytes(r['nbytes'])}", flush=True)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    print(f"\n| variant | wall s (median of {args.runs}) | GB/s | CPU s | CPU s / GB | bytes on disk |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        wall = statistics.median(r["wall_s"] for r in runs[v])
        cpu = statistics.median(r["cpu_s"] for r in runs[v])
        size = runs[v][0]["nbytes"]
        print(f"| {v} | {wall:.2f} | {size / wall / 1e9:.2f} | {cpu:.2f} | {cpu / (size / 1e9):.2f} | {size} |")


if __name__ == "__main__":
    sys.exit(main())
