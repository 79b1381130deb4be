"""How long does a save hold training with ``snapshot="eager"`` and with ``snapshot="lazy"``?

    python benchmarks/bench_lazy.py                       # 0.25 and 0.5 GiB of state, 7 saves per mode, 2 rounds
    python benchmarks/bench_lazy.py --sizes 1 --saves 5
    python benchmarks/bench_lazy.py --device cuda --sizes 2 --rounds 1   # scripts/gpu_check.sh runs this

Each mode runs in its own process, alternating (eager, lazy, eager, lazy, ...) so that both see the same
machine. One process builds an MLP of ``Linear(width, width)`` layers with Adam (state = weights + two
moments, plus small biases), warms up the worker and the staging buffers, then per save, as a Fabric loop
does (and as the Trainer's hooks do):

1. ``save_checkpoint`` (timed: the **save** block);
2. a real forward and backward of the model (timed: **fwd/bwd**, against the same without a save before it:
   the lazy copy runs in the background during it, on the same cores);
3. ``wait_for_snapshot()`` right before ``optimizer.step()`` (timed: the **wait** block; instant for eager);
4. ``optimizer.step()``, then a blocking finalize (untimed), so that the next save starts with no write in
   flight.

``--overlap`` saves after every step instead and finalizes without blocking, so that saves come faster
than the disk takes them: each save finds the previous write in flight. With ``max_pending=2`` (the
default) eager takes a second staging copy and waits in the save call once two writes are in flight;
lazy follows the write in flight into its one copy and waits before the optimizer step. **staged** is
the most host staging memory seen (``staging_buffers()``), against the state's size. **iteration**: one
save's whole iteration (save, forward and backward, wait, step, finalize): with ``--overlap``, the pace at
which saves can follow each other, which the disk sets for both modes once the writes have piled up.

Figures are medians over the saves after the first. **blocked** = save + wait: what training stops for.
**floor**: one blocking copy of the whole state into buffers that already exist (on CPU a memcpy; with
``--device cuda`` the device-to-host copy into pinned buffers), measured in the same process; the target
for lazy is a blocked time of 0.1 times that floor on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def floor_s(tensors: list, device: str, repeats: int = 3) -> float:
    """One blocking copy of ``tensors`` into host buffers made beforehand (pinned for CUDA): the least a
    snapshot taken inside the save call costs."""
    import torch

    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for t in tensors]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for b, t in zip(bufs, tensors):
            b.copy_(t, non_blocking=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def one(mode: str, size_gib: float, saves: int, batch: int, width: int, device: str = "cpu",
        overlap: bool = False) -> dict:
    import torch

    from lightning_asyncckpt import AsyncCheckpointIO

    layer_bytes = width * width * 4
    layers = max(1, round(size_gib * 1024 * MiB / (3 * layer_bytes)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)

    def forward_backward() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if device == "cuda":  # the training stream only: a device-wide sync would also wait for the lazy copy
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}

    forward_backward()
    opt.step()
    plain = [forward_backward() for _ in range(5)]  # fwd/bwd with no save before it
    opt.zero_grad()
    tensors = [t for t in [*model.parameters(), *(v for st in opt.state.values() for v in st.values())] if t.dim()]
    out = {"mode": mode, "size_gib": size_gib, "device": device, "floor_s": floor_s(tensors, device), "state_mib": sum(t.numel() * 4 for t in model.parameters()) * 3 / MiB,
           "layers": layers, "width": width, "fwd_bwd_plain_s": statistics.median(plain),
           "save_s": [], "wait_s": [], "fwd_bwd_s": [], "iteration_s": [], "lazy_mib": [], "staged_mib": 0.0,
           "overlap": overlap}
    with tempfile.TemporaryDirectory(dir=".") as tmp, AsyncCheckpointIO("nvrx", snapshot=mode) as io:
        io.track_optimizers([opt])
        io.warmup(like=state(0))
        started = time.perf_counter()
        for i in range(saves):
            path = Path(tmp) / f"ckpt-{i}"
            t0 = time.perf_counter()
            io.save_checkpoint(state(i), path)
            t1 = time.perf_counter()
            fb = forward_backward()
            t2 = time.perf_counter()
            io.wait_for_snapshot()
            t3 = time.perf_counter()
            opt.step()
            staged = sum(b.numel() * b.element_size() for b in io.session.staging_buffers()) / MiB
            out["staged_mib"] = max(out["staged_mib"], staged)
            io.finalize(blocking=not overlap)
            out["iteration_s"].append(time.perf_counter() - t0)  # with --overlap: the pace saves can keep
            if not overlap:
                path.unlink()
            out["save_s"].append(t1 - t0)
            out["fwd_bwd_s"].append(fb)
            out["wait_s"].append(t3 - t2)
        io.finalize(blocking=True)
        # the writer's own time over the loop's: 1.0 when each write starts as the one before it ends
        out["writer_busy"] = sum(r.worker_s for r in io.history) / (time.perf_counter() - started)
    out["lazy_mib"] = [r.lazy_nbytes / MiB for r in io.history]  # every save committed once the block is left
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--saves", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--one", nargs=2, metavar=("MODE", "SIZE"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--overlap", action="store_true", help="save after every step without waiting for the writes")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], float(args.one[1]), args.saves, args.batch, args.width, args.device,
                             args.overlap)))
        return
    runs = []
    for size in args.sizes:
        for r in range(args.rounds):
            for mode in (("eager", "lazy") if r % 2 == 0 else ("lazy", "eager")):
                cmd = [sys.executable, __file__, "--one", mode, str(size), "--saves", str(args.saves),
                       "--batch", str(args.batch), "--width", str(args.width), "--device", args.device,
                       *(["--overlap"] if args.overlap else [])]
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    print(f"device: {args.device}{', a save after every step, writes overlapping' if args.overlap else ''}")
    print("| state | mode | save (s) | wait (s) | blocked = save + wait (s) | floor (s) | blocked / floor | fwd/bwd (s) |"
          " fwd/bwd, no save (s) | copied lazily (MiB) | staged / state | iteration (s) | writer busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for mode in ("eager", "lazy"):
            rs = [r for r in runs if r["size_gib"] == size and r["mode"] == mode]
            med = {k: statistics.median(v for r in rs for v in r[k][1:]) for k in ("save_s", "wait_s", "fwd_bwd_s", "lazy_mib")}
            iteration = statistics.median(v for r in rs for v in r.get("iteration_s", [])[1:]) if "iteration_s" in rs[0] else None
            blocked = statistics.median(s + w for r in rs for s, w in zip(r["save_s"][1:], r["wait_s"][1:]))
            plain = statistics.median(r["fwd_bwd_plain_s"] for r in rs)
            floor = statistics.median(r["floor_s"] for r in rs)
            staged = max(r["staged_mib"] for r in rs) / rs[0]["state_mib"]
            busy = statistics.median(r["writer_busy"] for r in rs) if "writer_busy" in rs[0] else None
            print(f"| {rs[0]['state_mib']:.0f} MiB | {mode} | {med['save_s']:.4f} | {med['wait_s']:.4f} | {blocked:.4f} |"
                  f" {floor:.4f} | {blocked / floor:.3f}x | {med['fwd_bwd_s']:.3f} | {plain:.3f} | {med['lazy_mib']:.0f} |"
                  f" {staged:.2f}x | {'n/a' if iteration is None else f'{iteration:.3f}'} |"
                  f" {'n/a' if busy is None else f'{busy:.2f}'} |")


if __name__ == "__main__":
    main()
