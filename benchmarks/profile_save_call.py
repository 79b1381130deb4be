"""Where the save call's time goes: ``cProfile`` over ``save_checkpoint`` alone, eager or lazy, CPU or CUDA.

    python benchmarks/profile_save_call.py                              # lazy, 0.5 GiB on the CPU
    python benchmarks/profile_save_call.py --device cuda --gib 2 --snapshot lazy   # scripts/gpu_check.sh

The same loop as ``bench_lazy.py`` (an MLP of ``Linear(width, width)`` with Adam: save, forward and backward,
``wait_for_snapshot()``, optimizer step, blocking finalize), with the profiler switched on only inside the
save calls after the first. Prints each call's wall time, then the functions with the most cumulative time
(``--top``). Profiling slows Python code, so the times are for finding the parts, not for reporting.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--snapshot", default="lazy", choices=["eager", "lazy"])
    p.add_argument("--engine", default="nvrx", choices=["nvrx", "mcore"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()

    import torch

    from lightning_asyncckpt import AsyncCheckpointIO

    layers = max(1, round(args.gib * 2**30 / (3 * args.width * args.width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)]).to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, device=args.device)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()

    step()
    opt.step()
    profiler, walls = cProfile.Profile(), []
    with tempfile.TemporaryDirectory(dir=".") as tmp, AsyncCheckpointIO(args.engine, snapshot=args.snapshot) as io:
        io.track_optimizers([opt])
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 0}
        io.warmup(like=state)
        for i in range(args.saves):
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": i}
            path = Path(tmp) / f"ckpt-{i}"
            if i:
                profiler.enable()
            t0 = time.perf_counter()
            io.save_checkpoint(state, path)
            walls.append(time.perf_counter() - t0)
            if i:
                profiler.disable()
            step()
            io.wait_for_snapshot()
            opt.step()
            io.finalize(blocking=True)
            path.unlink()
    print(f"{args.snapshot} save call, {layers} layers ({args.gib:g} GiB with Adam's moments) on {args.device}:"
          f" {', '.join(f'{w:.4f}' for w in walls)} s (median after the first {statistics.median(walls[1:]):.4f} s,"
          " profiled)")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
