"""The persistent worker's whole CPU time per save, everything it does for a save included.

    python benchmarks/worker_cpu.py --engines nvrx mcore --mib 256 --saves 6

``profile_write.py`` counts the worker's CPU from a save's return to its commit; work the engine's loop
does after it reports (Megatron-Core's full ``gc.collect()`` after every save) falls outside that window,
yet it takes the training's cores all the same. Here one process per engine makes a warm-up save, then
``--saves`` saves of ``--mib`` MiB, each finalized and removed, and reads the user + system time of its
child processes (the worker) before the first and after the last, once the worker has gone idle again
(it waits for its next request, so the reading is taken after a second with nothing to do).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(engine: str, mib: int, saves: int) -> float:
    import psutil
    import torch

    from lightning_asyncckpt import AsyncCheckpointIO

    count = 16
    state = {"state_dict": {f"w{i}": torch.randn(mib * (1 << 20) // count // 4) for i in range(count)}, "step": 0}
    folder = Path(tempfile.mkdtemp(prefix="worker-cpu-", dir="/var/tmp"))
    with AsyncCheckpointIO(engine, worker="persistent") as io:
        io.warmup()
        io.save_checkpoint(state, folder / "warm.ckpt")
        io.finalize(blocking=True)
        io.remove_checkpoint(folder / "warm.ckpt")
        workers = psutil.Process().children(recursive=True)
        before = sum(sum(p.cpu_times()[:2]) for p in workers)
        for i in range(saves):
            io.save_checkpoint(state, folder / f"s{i}.ckpt")
            io.finalize(blocking=True)
            io.remove_checkpoint(folder / f"s{i}.ckpt")
        time.sleep(1.0)  # the loop's work after its report (a collection) ends; then it waits, idle
        after = sum(sum(p.cpu_times()[:2]) for p in workers)
    folder.rmdir()
    return (after - before) / saves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["nvrx", "mcore"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2, help="processes per engine, alternating")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.mib, args.saves)), flush=True)
        return
    for rnd in range(args.rounds):
        for engine in args.engines:
            out = subprocess.run([sys.executable, __file__, "--one", engine, "--mib", str(args.mib), "--saves", str(args.saves)],
                                 capture_output=True, text=True, timeout=600)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                print(f"{engine} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                sys.exit(1)
            cpu = json.loads(lines[-1][len("RESULT "):])
            print(f"round {rnd} {engine}: worker CPU per {args.mib} MiB save {cpu:.3f} s ({args.mib / 1024 / cpu:.2f} GiB per CPU-s)")


if __name__ == "__main__":
    main()
