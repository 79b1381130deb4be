"""How long does training stop for a checkpoint? Every variant, measured in the same run.

    python benchmarks/bench_save.py                     # 0.5 and 2 GiB, every variant, 1 round
    python benchmarks/bench_save.py --sizes 0.5 --rounds 2 --saves 7
    python benchmarks/bench_save.py --big               # adds 8 GiB

Each variant runs in its own process (one per variant, size and round), in rotating order, so that
variants see the same machine state; figures are medians. One process:

1. builds a Lightning-style checkpoint of the given size (weights, two Adam moments, plain values);
2. measures, in the same process, the *memcpy floor* (copying the state into buffers that already
   exist, the least a snapshot can cost), an fsync'd *write probe* (the disk's throughput), and the
   time of a *training step* (which writes every tensor, as an optimizer step does);
3. saves ``--saves`` times; between saves it trains until the save is durably committed, timing each
   step. Per save it reports the *stall* (how long the save call held training), the step-time
   *slowdown* while the write ran in the background, the time to a durable commit, the background
   write throughput, the extra host memory (PSS of the process tree over the baseline: shared pages
   are counted once), and the *torn* tensors: every tensor is filled with the step number, so a
   checkpoint whose tensor holds anything but the step at which it was saved is torn.

Variants: Lightning's ``TorchCheckpointIO`` (synchronous ``torch.save``), a synchronous DCP save,
Lightning's ``AsyncCheckpointIO`` (a thread), torch DCP ``async_save`` with a process executor and a
reused shared-memory stager, this library (nvrx and mcore, persistent worker and fork per save), and its
local tier alone (``local_tier``: one rank, no replicas, the state copied into mapped ``/dev/shm`` files;
only its newest step is kept, so only the last save is read back).
The first save is reported separately; the steady state is the median of the saves after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plots import write_plots
from save_report import markdown, summarize
from save_variant import VARIANTS, run_variant

# bench_train_loop.py and probe_interference.py import memcpy_floor from here
from save_variant import memcpy_floor as memcpy_floor


def _gpu_name() -> str:
    import torch

    return f"CUDA ({torch.cuda.get_device_name(0)}); the floor is the pinned device-to-host copy"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0.5,2", help="state sizes in GiB, comma-separated")
    p.add_argument("--big", action="store_true", help="also 8 GiB")
    p.add_argument("--saves", type=int, default=7, help="saves per run (the first is reported separately)")
    p.add_argument("--rounds", type=int, default=1, help="runs per variant and size, interleaved")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the state lives; with cuda the floor is the pinned device-to-host copy and the"
                        " fork-per-save variants are left out (a forked child cannot use CUDA)")
    p.add_argument("--render", default=None, help="print the table of a saved bench-*.json instead of running")
    p.add_argument("--worker-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--verify", default="all", choices=["all", "last", "none"], help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.render:
        print(markdown(summarize(json.loads(Path(args.render).read_text())["runs"])))
        return
    if args.worker_run:
        result = run_variant(args.worker_run, float(args.sizes), args.saves, Path(args.dir), args.verify, args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return

    sizes = [float(s) for s in args.sizes.split(",")] + ([8.0] if args.big else [])
    variants = args.variants.split(",")
    if args.device == "cuda":
        variants = [v for v in variants if not v.endswith("_fork")]
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-save-"))
    runs: list[dict] = []
    for size in sizes:
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            for name in order:
                work = base / f"{name}-{size:g}-{rnd}"
                work.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, __file__, "--worker-run", name, "--sizes", str(size), "--saves", str(args.saves),
                       "--dir", str(work), "--verify", "last" if size > 2 else "all", "--device", args.device]
                t0 = time.monotonic()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                shutil.rmtree(work, ignore_errors=True)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    print(f"{name} at {size:g} GiB failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    continue
                runs.append(json.loads(lines[-1][len("RESULT "):]))
                print(f"{name:>18} {size:g} GiB round {rnd}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    rows = summarize(runs)
    table = markdown(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"bench-{stamp}.json").write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=1))
    (out / f"bench-{stamp}.md").write_text(
        f"# bench_save.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs"
        + (f", state on {_gpu_name()}" if args.device == "cuda" else "") + "\n\n"
        + table + "\n"
    )
    write_plots(out / f"bench-{stamp}.json")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
