"""PNG plots of a benchmark's results file, written beside it: the pictures of ``make bench``,
``make bench-train`` and ``make bench-tiers``, and of any results file already in ``benchmarks/results/``.

    python benchmarks/plots.py benchmarks/results/bench-<time>.json [more.json ...]

What each results file gets (``<stem>`` is the file's name without ``.json``):

- ``bench-*.json`` (``bench_save.py``): ``<stem>-stall.png``, the stall per save of every variant, this
  library's beside its peers (stock ``torch.save``, synchronous DCP, Lightning's thread, DCP ``async_save``);
  ``<stem>-step.png``, the training step before a save against the step while its write runs;
  ``<stem>-commit.png``, the time from the save call to the durable commit.
- ``train-*.json`` (``bench_train_loop.py``): ``<stem>-stall.png``, what the training thread is blocked for
  per save and what a save costs the loop (overhead per save), per save interval N; ``<stem>-step.png``,
  the step time around a save (every step, where the file has them; older files have the mean step of each
  save period against the baseline step); ``<stem>-commit.png``, the time to commit against the disk's floor.
- ``tiers-*.json`` (``bench_tiers.py``): ``<stem>-overhead.png``, the overhead and stall per save of the
  local tier's variants against the persistent tier; ``<stem>-recovery.png``, the time to resume after a
  lost node, from the peers' replicas against a reload of the persistent checkpoint.
- ``cluster-*.json`` (``bench_cluster.py``): ``<stem>-resume.png``, resume time and bytes read from shared
  storage, ours against stock's, per link setting of the emulated cluster.

Every figure is a median, as in the tables. matplotlib is a benchmark dependency only (the ``bench`` extra),
never the library's. The figures are drawn with the Agg backend: no display needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
except ImportError as e:  # the benchmarks still write their tables; write_plots says what to install
    plt = None
    _MISSING = e

OURS = "#1f6fb4"  # this library
PEER = "#9a9a9a"  # everything else, measured in the same run
PEERS = {"torch_save", "dcp_sync", "lightning_async", "dcp_async_process", "dcp_async", "torch_checkpointing"}
LABELS = {
    "torch_save": "stock torch.save",
    "dcp_sync": "DCP save (sync)",
    "lightning_async": "Lightning AsyncCheckpointIO",
    "dcp_async_process": "DCP async_save",
    "dcp_async": "DCP async_save",
    "torch_checkpointing": "torch_checkpointing",
}


def label(variant: str) -> str:
    return LABELS.get(variant, variant)


def colour(variant: str) -> str:
    return PEER if variant in PEERS or variant.startswith("torch_checkpointing") else OURS


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _bars(ax, names: list[str], values: list[float | None], fmt: str = "{:.3f}", colours: list[str] | None = None) -> None:
    """One horizontal bar per variant, its value written at its end (``n/a`` where none was measured)."""
    ys = range(len(names))
    ax.barh(ys, [v or 0 for v in values], color=colours or [colour(n) for n in names])
    ax.set_yticks(list(ys), [label(n) for n in names])
    ax.invert_yaxis()
    for y, v in zip(ys, values):
        ax.text(v or 0, y, " " + (fmt.format(v) if v is not None else "n/a"), va="center", fontsize=8)
    ax.margins(x=0.25)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _where(data: dict) -> str:
    args = data.get("args", {})
    device = args.get("device") or "cpu"
    return f"state on {device}" + (f", {data['cpus']} CPUs" if data.get("cpus") else "")


# -------------------------------------------------------------------------------------------------
def bench_plots(data: dict, stem: Path) -> list[Path]:
    """``bench_save.py``: stall per save, step time around a save, time to commit; one panel per size."""
    rows = data["rows"]
    sizes = sorted({r["size_gib"] for r in rows})
    base_step = {(r["variant"], r["size_gib"]): r.get("base_step_s") for r in data.get("runs", [])}
    out = []
    for what, key, title, xlabel, log in [
        ("stall", "stall_s", "Training stalled per save (median of the saves after the first)", "seconds (log scale)", True),
        ("commit", "e2e_s", "From the save call to a durable commit (median)", "seconds", False),
    ]:
        fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 0.45 * max(len(rows) // len(sizes), 3) + 1.6),
                                 squeeze=False)
        for ax, size in zip(axes[0], sizes):
            at = [r for r in rows if r["size_gib"] == size]
            _bars(ax, [r["variant"] for r in at], [r[key] for r in at])
            if log:
                ax.set_xscale("log")
            ax.set_title(f"{size:g} GiB, {_where(data)}", fontsize=10)
            ax.set_xlabel(xlabel)
        fig.suptitle(f"{title}\nblue: this library; grey: peers, measured in the same run", fontsize=10)
        out.append(_save(fig, stem.with_name(f"{stem.name}-{what}.png")))
    # step time: the step before a save against the step while its write runs (slowdown x base step)
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 0.45 * max(len(rows) // len(sizes), 3) + 1.6),
                             squeeze=False)
    for ax, size in zip(axes[0], sizes):
        at = [r for r in rows if r["size_gib"] == size and r.get("slowdown") is not None]
        names = [r["variant"] for r in at]
        before = [base_step.get((n, size)) for n in names]
        during = [b * r["slowdown"] if b is not None else None for b, r in zip(before, at)]
        ys = range(len(names))
        ax.barh([y - 0.2 for y in ys], [b or 0 for b in before], height=0.4, color="#d0d0d0", label="step, no save")
        ax.barh([y + 0.2 for y in ys], [d or 0 for d in during], height=0.4, color=[colour(n) for n in names],
                label="step while the write runs")
        for y, d, r in zip(ys, during, at):
            ax.text(d or 0, y + 0.2, f" {r['slowdown']:.2f}×", va="center", fontsize=8)
        ax.set_yticks(list(ys), [label(n) for n in names])
        ax.invert_yaxis()
        ax.margins(x=0.25)
        ax.set_xlabel("seconds per training step (median)")
        ax.set_title(f"{size:g} GiB, {_where(data)}\n(synchronous saves have no background write: not shown)", fontsize=9)
        ax.legend(handles=[Patch(color="#d0d0d0", label="step, no save"),
                           Patch(color=OURS, label="step while the write runs (this library)"),
                           Patch(color=PEER, label="the same, a peer")], fontsize=8, loc="lower right")
    fig.suptitle("Training step time around a save", fontsize=10)
    out.append(_save(fig, stem.with_name(f"{stem.name}-step.png")))
    return out


# -------------------------------------------------------------------------------------------------
def train_plots(data: dict, stem: Path) -> list[Path]:
    """``bench_train_loop.py``: blocked and overhead per save, step time around a save, time to commit."""
    rows = data["rows"]
    every = sorted({r["every"] for r in rows})
    state = rows[0]["state_bytes"] / 2**30 if rows else 0
    out = []
    fig, axes = plt.subplots(len(every), 2, figsize=(12, (0.5 * max(len(rows) // len(every), 3) + 1) * len(every)),
                             squeeze=False)
    for (ax_b, ax_o), n in zip(axes, every):
        at = [r for r in rows if r["every"] == n]
        _bars(ax_b, [r["variant"] for r in at], [r["blocked_s"] for r in at])
        ax_b.set_title(f"blocked per save, a save every {n} steps", fontsize=10)
        ax_b.set_xlabel("seconds (median)")
        _bars(ax_o, [r["variant"] for r in at], [r["overhead_s"] for r in at])
        ax_o.set_title(f"overhead per save (the loop's lost time), every {n} steps", fontsize=10)
        ax_o.set_xlabel("seconds (median)")
    fig.suptitle(f"A Lightning Trainer loop, {state:.2f} GiB of state\nblue: this library; grey: peers, measured in the same run",
                 fontsize=10)
    out.append(_save(fig, stem.with_name(f"{stem.name}-stall.png")))

    fig, axes = plt.subplots(1, len(every), figsize=(6.5 * len(every), 0.5 * max(len(rows) // len(every), 3) + 1.6),
                             squeeze=False)
    for ax, n in zip(axes[0], every):
        at = [r for r in rows if r["every"] == n]
        _bars(ax, [r["variant"] for r in at], [r["commit_s"] for r in at], "{:.2f}")
        floor = _median([r.get("probe_floor_s") for r in at])
        if floor:
            ax.axvline(floor, color="black", linestyle="--", linewidth=1)
            ax.text(floor, -0.6, " the disk's floor", fontsize=8)
        ax.set_title(f"from the save call to a durable commit, every {n} steps", fontsize=10)
        ax.set_xlabel("seconds (median)")
    out.append(_save(fig, stem.with_name(f"{stem.name}-commit.png")))
    out.append(_train_steps(data, stem))
    return out


def _train_steps(data: dict, stem: Path) -> Path:
    """Every step of the first round's phase of the smallest N, where the file has them (``steps_s``, since
    2026-12-07); else, per variant and N, the mean step of each save period against the baseline step."""
    runs = data.get("runs", [])
    timed = [(r, ph) for r in runs for ph in r["phases"][:1] if ph.get("steps_s")]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    if timed:
        seen: list[str] = []
        ours_styles = iter([(c, "-") for c in (OURS, "#5fa2dd", "#0b3d6b", "#3c8dbc", "#7fb8e6")] * 4)
        peer_styles = iter([(c, ls) for c in ("#555555", "#999999") for ls in ("--", ":", "-.")] * 4)
        for r, ph in timed:
            if r["variant"] in seen:
                continue
            seen.append(r["variant"])
            first = ph["first_step"]
            xs = range(first, first + len(ph["steps_s"]))
            col, ls = next(ours_styles if colour(r["variant"]) == OURS else peer_styles)
            ax.plot(list(xs), ph["steps_s"], label=label(r["variant"]), linewidth=1.2, color=col, linestyle=ls)
        for s in (timed[0][1]["saves"] or []):
            if s:
                ax.axvline(s["batch"], color="black", alpha=0.25, linewidth=0.8)
        ax.set_xlabel(f"training step (a save every {timed[0][1]['every']} steps: the vertical lines)")
        ax.set_ylabel("seconds")
        ax.set_title("Every training step around the saves (the first round); blue, solid: this library;"
                     " grey, dashed: peers", fontsize=10)
        ax.legend(fontsize=8)
    else:
        names = sorted({r["variant"] for r in runs}, key=lambda v: (colour(v) == OURS, v))
        labels, base, during, colours = [], [], [], []
        for n in sorted({ph["every"] for r in runs for ph in r["phases"]}):
            for v in names:
                phs = [ph for r in runs if r["variant"] == v for ph in r["phases"] if ph["every"] == n]
                if not phs:
                    continue
                labels.append(f"{label(v)}, N={n}")
                colours.append(colour(v))
                base.append(_median([ph["base_step_s"] for ph in phs]))
                during.append(_median([p / n for ph in phs for p in ph["periods_s"]]))
        ys = range(len(labels))
        ax.barh([y - 0.2 for y in ys], base, height=0.4, color="#d0d0d0", label="step, no save in flight")
        ax.barh([y + 0.2 for y in ys], during, height=0.4, color=colours)
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (median)")
        ax.set_title("Training step time around a save (this file has no per-step times)", fontsize=10)
        ax.legend(handles=[Patch(color="#d0d0d0", label="step, no save in flight"),
                           Patch(color=OURS, label="mean step of a save period, its save included (this library)"),
                           Patch(color=PEER, label="the same, a peer")], fontsize=8,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over one
        fig.set_size_inches(14, 0.35 * len(labels) + 1.6)
    return _save(fig, stem.with_name(f"{stem.name}-step.png"))


# -------------------------------------------------------------------------------------------------
def tiers_plots(data: dict, stem: Path) -> list[Path]:
    """``bench_tiers.py``: overhead and stall per save; recovery after a lost node."""
    summary, args = data["summary"], data.get("args", {})
    where = f"{args.get('layout') or 'replicated'}, {args.get('size')} GiB, 4 ranks on 2 simulated nodes, {data.get('cpus')} CPUs"
    over = [o for o in summary["overhead"] if o["variant"] != "baseline"]
    names = [o["variant"] for o in over]
    tiers = [OURS if n.startswith("local") else PEER for n in names]
    fig, (ax_o, ax_s) = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 1.8))
    _bars(ax_o, names, [o["overhead_s"] for o in over], colours=tiers)
    ax_o.set_title("overhead per save (the period's extra time)", fontsize=10)
    ax_o.set_xlabel("seconds (median)")
    _bars(ax_s, names, [o["stall_s"] for o in over], colours=tiers)
    ax_s.set_title("stall per save (the save call)", fontsize=10)
    ax_s.set_xlabel("seconds (median)")
    fig.suptitle(f"The local tier against the persistent one ({where})\nblue: the local tier; grey: the persistent"
                 " tier (this library's too)", fontsize=10)
    out = [_save(fig, stem.with_name(f"{stem.name}-overhead.png"))]

    rec = summary["recovery"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rec) + 1.8))
    ys = range(len(rec))
    secs = [r["seconds"] for r in rec]
    lo = [r["seconds"] - r["min_s"] for r in rec]
    hi = [r["max_s"] - r["seconds"] for r in rec]
    ax.barh(list(ys), secs, xerr=[lo, hi], color=[OURS if r["how"].startswith("local") else PEER for r in rec],
            error_kw={"elinewidth": 0.8, "capsize": 3})
    ax.set_yticks(list(ys), [r["how"].replace("_", " ") for r in rec])
    ax.invert_yaxis()
    for y, r in zip(ys, rec):
        ax.text(r["max_s"], y, f" {r['seconds']:.2f} s ({r['exact']} exact)", va="center", fontsize=8)
    ax.margins(x=0.3)
    ax.set_xlabel("seconds to resume, slowest rank (median; whiskers: min and max)")
    ax.set_title(f"Recovery after a lost node ({where})\nblue: from the peers' replicas (the local tier);"
                 " grey: reloading the persistent checkpoint", fontsize=10)
    out.append(_save(fig, stem.with_name(f"{stem.name}-recovery.png")))
    return out


def cluster_plots(data: dict, stem: Path) -> list[Path]:
    """``bench_cluster.py``: resume time and bytes read from shared storage, ours against stock's, per link
    setting of the emulated cluster."""
    sums = data["summaries"]
    settings = [f"NIC {s['nic_mbit']:g} : storage {s['storage_mbit']:g} Mbit/s" for s in sums]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.8 + 0.9 * len(sums)))
    for ax, key, scale, unit in ((left, "seconds", 1.0, "s"), (right, "storage_sent", 1 / sums[0]["file_bytes"], "x")):
        ys = range(len(sums))
        for dy, variant, col in ((-0.2, "stock", PEER), (0.2, "ours", OURS)):
            vals = [s["median"][variant][key] * scale for s in sums]
            ax.barh([y + dy for y in ys], vals, height=0.4, color=col)
            for y, v in zip(ys, vals):
                ax.text(v, y + dy, f" {v:.2f} {unit}", va="center", fontsize=8)
        ax.set_yticks(list(ys), settings, fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.25)
    left.set_xlabel("seconds to resume (median, slowest rank)")
    right.set_xlabel("read from shared storage, x the checkpoint")
    fig.legend(handles=[Patch(color=PEER, label="stock Lightning (every rank reads the file)"),
                        Patch(color=OURS, label="this library (each byte read once, the rest exchanged)")],
               fontsize=8, loc="lower center", ncol=2)  # below both panels, over no bar
    a = data["args"]
    fig.suptitle(f"Resume on an emulated cluster: {a['nodes']} nodes x {a['ranks_per_node']} ranks, "
                 f"{sums[0]['file_bytes'] / 2**30:.2g} GiB checkpoint", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(stem.with_name(f"{stem.name}-resume.png"), dpi=110)
    plt.close(fig)
    return [stem.with_name(f"{stem.name}-resume.png")]


KINDS = {"bench": bench_plots, "train": train_plots, "tiers": tiers_plots, "cluster": cluster_plots}


def kind_of(path: Path) -> str:
    """``bench``, ``train`` or ``tiers``, by the results file's name (``bench-h200-...`` is a ``bench``)."""
    kind = path.name.split("-", 1)[0]
    if kind not in KINDS:
        raise ValueError(f"{path}: not a results file of bench_save.py, bench_train_loop.py, bench_tiers.py or bench_cluster.py "
                         f"(its name starts with {kind!r}, expected one of {', '.join(KINDS)})")
    return kind


def plot_file(path: Path) -> list[Path]:
    """Writes the plots of one results file beside it and returns their paths."""
    kind = kind_of(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e
    return KINDS[kind](data, path.with_suffix(""))


def write_plots(path: Path) -> None:
    """What the benchmarks call after writing their results file: its plots, or one line on stderr saying
    why there are none (matplotlib missing: ``pip install -e '.[bench]'``, as ``make bench`` does)."""
    if plt is None:
        print(f"no plots: {_MISSING}; install them with pip install -e '.[bench]' (make bench does)", file=sys.stderr)
        return
    for png in plot_file(path):
        print(f"wrote {png}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="bench-*.json, train-*.json or tiers-*.json")
    args = p.parse_args(argv)
    if plt is None:
        sys.exit(f"plots.py: {_MISSING}; pip install -e '.[bench]'")
    for path in args.results:
        try:
            for png in plot_file(path):
                print(f"wrote {png}")
        except (ValueError, OSError, KeyError) as e:
            sys.exit(f"plots.py: {e}")


if __name__ == "__main__":
    main()
