"""What does a checkpoint cost a real Lightning training loop? Every variant, saving every N steps.

    python benchmarks/bench_train_loop.py                    # 1 GiB of state, N in 4 8 16 (make bench-train)
    python benchmarks/bench_train_loop.py --every 4 8 --saves 5 --rounds 2
    python benchmarks/bench_train_loop.py --quick            # 64 MiB of state, a smoke run
    python benchmarks/bench_train_loop.py --format dcp --layers 16   # ours write DCP directories; 2 GiB of state
    python benchmarks/bench_train_loop.py --render benchmarks/results/train-<time>.json

A Trainer on CPU trains ``--layers`` Linear(``--width``, ``--width``) layers without bias with SGD and
momentum: 8 x 4096 x 4096 fp32 are 512 MiB of weights plus 512 MiB of momentum, a 1 GiB checkpoint. The
batch size is chosen (in a calibration process) so that forward + backward takes ``--fb-ratio`` times the
memcpy floor; every variant's process measures and reports that ratio again.

Each variant runs in its own process, in an order rotated per round. One process measures the **memcpy
floor** (copying the state into buffers that already exist), then runs one ``Trainer.fit`` with a phase
per N: baseline steps without saving, then ``--saves`` saves N steps apart through stock
``ModelCheckpoint(every_n_train_steps=N, save_top_k=1)``, then an untimed drain (every save durable,
checkpoints deleted). One warm-up save and its drain, before the phases, pay first-time costs (DCP's
writer process start, staging buffers). A step is timed from one batch start to the next (forward, backward, optimizer step
and every batch-end hook, the save call included). A *save period* is the N steps from the step after a
save to the next save's step (its call included); each phase's first save, with no earlier write in
flight, only ends the baseline. Per phase:

- **overhead per save** = time of a save period - N x the median baseline step, medianed over periods. The
  baseline steps are those of every baseline block of the process pooled: before each phase and after the
  last (runs before 2026-12-02 15:00 used their phase's own block, so one disturbed block skewed a phase);
- **blocked**: what the training thread waits for per save: the save call (``trainer.save_checkpoint``)
  plus the waits before the optimizer step (a lazy snapshot's copy, DCP's staging);
- **to commit**: from the save call to the moment the save is durable (ours: committed by the finalize
  after a batch; DCP: its upload future done; ``torch.save``: the call's end);
- **to commit vs probe floor**: to commit over the state's size divided by an fsync'd ``O_DIRECT`` probe's
  bandwidth (``profile_write.probe``: the same bytes, 8 MiB blocks, the same directory), measured by every
  variant's process right after its training, on a quiet machine; the floor is the median over all of them;
- **writer GB per CPU-second**: the phase's checkpoint bytes over the CPU time (user + system) of every
  process below the trainer (workers, forked writers, DCP's writer process) from the phase's first save
  to its drain, read through psutil (``/proc/<pid>/stat``).

Variants: stock ``TorchCheckpointIO`` (synchronous ``torch.save``), torch DCP ``async_save`` (process
writer, ``DefaultStager`` with async staging into reused shared memory, waited on before the optimizer
step; each save first waits for the previous upload, as torchtitan does), and this library for both
engines: persistent worker with ``snapshot="eager"`` and ``"lazy"``, and fork per save. ``--format dcp``
makes ours write a DCP directory per checkpoint (``AsyncCheckpointIO(format="dcp")``), as the peer does;
by default ours write stock's one ``torch.save`` file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_loop_parts as parts  # noqa: E402
from bench_save import memcpy_floor  # noqa: E402
from plots import write_plots  # noqa: E402
from profile_write import probe  # noqa: E402
from train_loop_parts import VARIANTS  # noqa: E402

GiB = 1 << 30


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# -------------------------------------------------------------------------------------------------
# In a child process
def calibrate(width: int, layers: int, target: float) -> dict:
    """The memcpy floor, and a batch size whose forward + backward takes ``target`` times it."""
    import torch

    model = parts.Net(width, layers)
    floor = memcpy_floor(parts.state_like(model))
    batch, fb = 8, 0.0
    for _ in range(4):
        fb = parts.fwd_bwd_seconds(model, torch.randn(batch, width))
        if fb >= target * floor:
            break
        batch = min(4096, int(math.ceil(batch * 1.15 * target * floor / fb / 8)) * 8)
    return {"floor_s": floor, "batch": batch, "fwd_bwd_s": fb}


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    model = parts.Net(args.width, args.layers)
    like = parts.state_like(model)
    state_bytes = sum(t.numel() * t.element_size() for t in like)
    floor = memcpy_floor(like)
    del like
    phases = parts.plan(args.every, args.warmup, args.baseline, args.saves)
    after = parts.tail(phases, args.baseline)
    steps = after[1] + 1  # the tail's last step is timed to the next one's start
    clock = parts.Clock()
    saver = parts.Saver(name, clock, fmt=args.format)
    dirs = {ph["every"]: str(workdir / f"every{ph['every']}") for ph in phases} | {0: str(workdir / "warm")}
    ckpts = [parts.PhaseCheckpoint((ph["base"][1], ph["saves"][-1]), dirpath=dirs[ph["every"]], every_n_train_steps=ph["every"],
                             save_top_k=1, save_last=False) for ph in phases]
    ckpts.append(parts.PhaseCheckpoint((parts.WARM_SAVE, parts.WARM_SAVE), dirpath=dirs[0], every_n_train_steps=1, save_top_k=1))
    timer = parts.LoopTimer(phases, saver, clock, dirs)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(workdir),
        plugins=saver.plugins, callbacks=[timer, *saver.callbacks, *ckpts],
    )
    trainer.fit(model, parts.loader(args.batch, args.width, steps))
    probe_floor = state_bytes / probe(workdir, state_bytes, direct=True)  # every save is durable: the disk is quiet
    by_batch = {rec["batch"]: rec for rec in clock.saves.values()}
    out = []
    pool = [timer.interval(b) for r in [*(ph["base"] for ph in phases), after] for b in range(*r)]
    pooled = statistics.median(pool)
    for ph in phases:
        n, (b0, b1) = ph["every"], ph["base"]
        base = [timer.interval(b) for b in range(b0, b1)]
        base_med = statistics.median(base)
        # the N steps ending with each save after the first (whose period had no earlier write in flight)
        periods = [sum(timer.interval(b) for b in range(s - n + 1, s + 1)) for s in ph["saves"][1:]]
        saves = [by_batch.get(s) for s in ph["saves"]]
        cpu = timer.cpu.get(n, [])
        writer_cpu = cpu[1] - cpu[0] if len(cpu) == 2 else None
        out.append({
            "every": n, "base_step_s": pooled, "phase_base_step_s": base_med, "base_steps": len(pool),
            "fwd_bwd_s": statistics.median(timer.fwd_bwd[b] for b in range(b0, b1)),
            "periods_s": periods, "overheads_s": [p - n * pooled for p in periods],
            "saves": saves, "writer_cpu_s": writer_cpu, "written_bytes": state_bytes * len(ph["saves"]),
            # every step from the phase's baseline to its last save, for benchmarks/plots.py's step-time plot
            "first_step": b0, "steps_s": [timer.interval(b) for b in range(b0, ph["saves"][-1] + 1)],
        })
    return {"variant": name, "format": args.format, "state_bytes": state_bytes, "memcpy_floor_s": floor, "probe_floor_s": probe_floor,
            "batch": args.batch,
            "torch_threads": torch.get_num_threads(), "phases": out, "history": saver.history()}


# -------------------------------------------------------------------------------------------------
# The orchestrator
def summarize(runs: list[dict]) -> list[dict]:
    """Per N and variant: medians over every measured period and save of every round (each phase's first
    save, which had no earlier write in flight and pays first-time costs, left out)."""
    rows: list[dict] = []
    disk_floor = _median([r.get("probe_floor_s") for r in runs])  # runs before 2026-12-02 have none
    for n in sorted({ph["every"] for r in runs for ph in r["phases"]}):
        for name in VARIANTS:
            mine = [(r, ph) for r in runs if r["variant"] == name for ph in r["phases"] if ph["every"] == n]
            if not mine:
                continue
            saves = [s for _, ph in mine for s in ph["saves"][1:] if s is not None]
            floor = _median([r["memcpy_floor_s"] for r, _ in mine])
            probe_floor = disk_floor  # the disk's, over every variant's process: one probe each is noisy
            commit = _median([s["commit_s"] for s in saves])
            blocked = _median([s["call_s"] + s["wait_s"] for s in saves if s["call_s"] is not None])
            cpu = [ph["writer_cpu_s"] for _, ph in mine if ph["writer_cpu_s"]]
            fb = _median([ph["fwd_bwd_s"] for _, ph in mine])
            rows.append({
                "every": n, "variant": name,
                "overhead_s": _median([o for _, ph in mine for o in ph["overheads_s"]]),
                "blocked_s": blocked,
                "call_s": _median([s["call_s"] for s in saves]),
                "wait_s": _median([s["wait_s"] for s in saves]),
                "commit_s": commit,
                "probe_floor_s": probe_floor,
                "commit_vs_probe": commit / probe_floor if commit is not None and probe_floor else None,
                "floor_s": floor,
                "blocked_vs_floor": blocked / floor if blocked is not None and floor else None,
                "writer_gb_per_cpu_s": (sum(ph["written_bytes"] for _, ph in mine if ph["writer_cpu_s"]) / 1e9 / sum(cpu)
                                        if cpu and name != "torch_save" else None),
                "base_step_s": _median([ph["base_step_s"] for _, ph in mine]),
                "fwd_bwd_vs_floor": fb / floor if fb and floor else None,
                "base_steps": sum(ph["base_steps"] for _, ph in mine),
                "saved_steps": sum(n * len(ph["overheads_s"]) for _, ph in mine),
                "state_bytes": mine[0][0]["state_bytes"],
            })
    for row in rows:
        peer = next((r for r in rows if r["every"] == row["every"] and r["variant"] == "dcp_async"), None)
        ov, peer_ov, floor = row["overhead_s"], peer and peer["overhead_s"], row["floor_s"]
        row["overhead_vs_dcp"] = ov / peer_ov if ov is not None and peer_ov else None
        row["overhead_vs_floor"] = ov / floor if ov is not None and floor else None
    return rows


def _f(v: Any, fmt: str, suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{suffix}"


def markdown(rows: list[dict]) -> str:
    head = ("| N | variant | overhead per save (s) | vs DCP async_save | vs memcpy floor | blocked (s) | blocked vs floor"
            " | to commit (s) | to commit vs probe floor | writer GB per CPU-s | step (s) | fwd+bwd vs floor | steps measured (baseline + saving) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['every']} | {r['variant']} | {_f(r['overhead_s'], '.3f')} | {_f(r['overhead_vs_dcp'], '.2f', '×')}"
            f" | {_f(r['overhead_vs_floor'], '.1f', '×')} | {_f(r['blocked_s'], '.3f')} | {_f(r['blocked_vs_floor'], '.2f', '×')}"
            f" | {_f(r['commit_s'], '.2f')} | {_f(r.get('commit_vs_probe'), '.2f', '×')} | {_f(r['writer_gb_per_cpu_s'], '.2f')} | {_f(r['base_step_s'], '.3f')}"
            f" | {_f(r['fwd_bwd_vs_floor'], '.1f', '×')} | {r['base_steps']} + {r['saved_steps']} |"
        )
    return "\n".join(lines)


def _child(cmd: list[str], what: str) -> dict | None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--every", type=int, nargs="+", default=None, help="save every N steps, one phase per N (4 8 16)")
    p.add_argument("--saves", type=int, default=None, help="saves per phase; the first one is left out (3)")
    p.add_argument("--baseline", type=int, default=6, help="steps without saving before each phase's saves (at least)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps at the start of fit left out, with a warm-up save and its drain (at least 3)")
    p.add_argument("--rounds", type=int, default=1, help="processes per variant, in rotated order")
    p.add_argument("--width", type=int, default=None, help="Linear layer width (4096)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=0, help="batch size; 0: calibrated for --fb-ratio")
    p.add_argument("--fb-ratio", type=float, default=2.5, help="forward + backward over the memcpy floor to aim for")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--format", default="auto", choices=["auto", "dcp"],
                   help="this library's AsyncCheckpointIO(format=): auto writes stock's torch.save file, dcp a DCP directory")
    p.add_argument("--quick", action="store_true", help="smoke run: width 1024 (64 MiB of state), N in 2 4")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory on disk)")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--render", default=None, help="print the table of a saved train-*.json instead of running")
    p.add_argument("--worker-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.every = args.every or ([2, 4] if quick else [4, 8, 16])
    args.saves = args.saves or 3
    args.width = args.width or (1024 if quick else 4096)
    if args.warmup < 3:
        p.error("--warmup must be at least 3: a warm-up save and its drain happen in it")
    if args.saves < 2:
        p.error("--saves must be at least 2: the first save of each phase is left out")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {','.join(VARIANTS)}")
    return args


def child_args(args: argparse.Namespace) -> list[str]:
    return ["--every", *map(str, args.every), "--saves", str(args.saves), "--baseline", str(args.baseline),
            "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers),
            "--batch", str(args.batch), "--fb-ratio", str(args.fb_ratio), "--format", args.format]


def main() -> None:
    args = parse_args()
    if args.render:
        print(markdown(summarize(json.loads(Path(args.render).read_text())["runs"])))
        return
    if args.calibrate:
        print("RESULT " + json.dumps(calibrate(args.width, args.layers, args.fb_ratio)), flush=True)
        return
    if args.worker_run:
        print("RESULT " + json.dumps(run_variant(args.worker_run, args, Path(args.dir))), flush=True)
        return

    t_start = time.monotonic()
    calib = None
    if args.batch == 0:
        calib = _child([sys.executable, __file__, "--calibrate", *child_args(args)], "calibration")
        if calib is None:
            sys.exit(1)
        args.batch = calib["batch"]
        print(f"calibrated: memcpy floor {calib['floor_s']:.3f} s, batch {args.batch}: forward + backward "
              f"{calib['fwd_bwd_s']:.3f} s ({calib['fwd_bwd_s'] / calib['floor_s']:.1f}× the floor)", file=sys.stderr)
    variants = args.variants.split(",")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-train-", dir="/var/tmp"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: list[dict] = []
    for rnd in range(args.rounds):
        order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
        for name in order:
            work = base / f"{name}-{rnd}"
            work.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            result = _child([sys.executable, __file__, "--worker-run", name, "--dir", str(work), *child_args(args)],
                            f"{name} round {rnd}")
            shutil.rmtree(work, ignore_errors=True)
            if result is not None:
                runs.append(result)
                fb = ", ".join(f"N={ph['every']}: {ph['fwd_bwd_s'] / result['memcpy_floor_s']:.1f}×" for ph in result["phases"])
                print(f"{name:>24} round {rnd}: {time.monotonic() - t0:.0f} s (forward + backward vs floor: {fb})",
                      file=sys.stderr)
                # after every variant, so that a run cut short keeps what it measured
                write_results(out, stamp, args, calib, runs, len(variants) * args.rounds, time.monotonic() - t_start)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    print(markdown(summarize(runs)))
    print(f"wrote {out / f'train-{stamp}.md'}", file=sys.stderr)
    if runs:
        write_plots(out / f"train-{stamp}.json")
    if len(runs) < len(variants) * args.rounds:
        sys.exit(1)


def write_results(out: Path, stamp: str, args: argparse.Namespace, calib: dict | None, runs: list[dict], planned: int,
                  elapsed: float) -> None:
    """``train-<stamp>.json`` (everything measured) and ``.md`` (the table), rewritten as runs complete."""
    state = runs[0]["state_bytes"] / GiB if runs else 0
    partial = f"; partial: {len(runs)} of {planned} variant runs" if len(runs) < planned else ""
    (out / f"train-{stamp}.json").write_text(json.dumps({"args": vars(args), "calibration": calib,
                                                         "rows": summarize(runs), "runs": runs}, indent=1))
    (out / f"train-{stamp}.md").write_text(
        f"# bench_train_loop.py, {time.strftime('%Y-%m-%d %H:%M')}\n\n`{' '.join(sys.argv)}` on {os.cpu_count()} CPUs;"
        f" {state:.2f} GiB of state, batch {args.batch}, {elapsed:.0f} s{partial}\n\n" + markdown(summarize(runs)) + "\n"
    )

if __name__ == "__main__":
    main()
