"""The tables and figures of the documentation's performance page, generated from the results files in
``benchmarks/results/``: no number on that page is written by hand.

    python benchmarks/report_docs.py                 # rewrites docs/_generated/performance_tables.md
    python benchmarks/report_docs.py --check         # exit 1 if the committed file is out of date

``docs/performance.md`` includes the generated file. The runs it shows are named by the constants below; to
show a newer run, name its results file there (and its plots: ``python benchmarks/plots.py <file>.json``), run this
script and commit both. The GPU section quotes ``scripts/gpu_check.sh``'s log as it was measured.
Needs only the standard library (``tests/test_docs_performance.py`` runs it in ``make test``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "_generated" / "performance_tables.md"
# image paths as docs/performance.md (the page that includes the generated file) sees them
IMAGES = "../benchmarks/results"

# The runs the page shows, each with what it is (the numbers come from the file).
SAVE_CPU = "bench-20261201-024229.json"
SAVE_GPU_TIER = "bench-h200-20261204-175526.json"
TRAIN = "train-20261202-153224.json"
TIERS = [("tiers-20261207-110241.json", "a DDP state (every rank holds all of it)"),
         ("tiers-20261207-111838.json", "a sharded, FSDP2-like state (each rank holds a quarter)")]
TIERS_S3 = "tiers-20261205-190637.json"
GPU_LOG = "gpu_check-h200-20261204.log"
CLUSTER = "cluster-20261207-233601.json"  # bench_cluster.py: resume on the emulated cluster
TIERS_CLUSTER = ["tiers-20261207-234415.json", "tiers-20261207-234831.json"]  # bench_tiers.py --cluster, one per link setting

PEERS = {"torch_save": "stock Lightning (`TorchCheckpointIO`, `torch.save`)",
         "dcp_sync": "torch DCP `save` (synchronous)",
         "lightning_async": "Lightning's `AsyncCheckpointIO` (a thread)",
         "dcp_async_process": "torch DCP `async_save` (process executor, reused shared-memory staging)",
         "dcp_async": "torch DCP `async_save` (process writer, async staging)"}


def f(v: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if v is None else format(v, fmt) + unit


def who(variant: str) -> str:
    return PEERS.get(variant, f"**this library**: `{variant}`")


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows), ""]


def figures(stem: str, kinds: list[tuple[str, str]]) -> list[str]:
    """MyST figures of a results file's plots (benchmarks/plots.py); a missing PNG fails the generation."""
    out = []
    for kind, caption in kinds:
        png = RESULTS / f"{stem}-{kind}.png"
        if not png.exists():
            raise SystemExit(f"report_docs.py: {png.relative_to(ROOT)} is missing: run python benchmarks/plots.py "
                             f"benchmarks/results/{stem}.json first")
        out += [f"```{{figure}} {IMAGES}/{png.name}", f":alt: {caption}", "", f"{caption} (`{png.name}`)", "```", ""]
    return out


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def source(name: str, data: dict) -> str:
    args = data.get("args", {})
    cpus = data.get("cpus")
    return f"Results file: `benchmarks/results/{name}`" + (f" ({cpus} CPUs)" if cpus else "") + (
        f"; state on {args['device']}" if args.get("device") else "") + "."


# -------------------------------------------------------------------------------------------------
def save_section() -> list[str]:
    data = load(SAVE_CPU)
    rows = data["rows"]
    saves = max((r["checked"] for r in rows), default=0)
    lines = ["## Stall per checkpoint, every peer in the same run", "",
             f"`make bench` (`bench_save.py`), {rows[0]['size_gib']:g} GiB of state (weights and two Adam moments), "
             f"{saves} saves per variant: medians of the saves after the first. {source(SAVE_CPU, data)}", ""]
    lines += table(
        ["variant", "stall (s)", "first save's stall (s)", "× sync DCP", "× memcpy floor", "step slowdown during the write",
         "to commit (s)", "torn"],
        [[who(r["variant"]), f(r["stall_s"], ".3f"), f(r["first_stall_s"], ".3f"), f(r["stall_vs_dcp_sync"], ".3f", "×"),
          f(r["stall_vs_memcpy_floor"], ".2f", "×"), f(r["slowdown"], ".2f", "×"), f(r["e2e_s"], ".2f"),
          f"{r['torn']}/{r['checked']}"] for r in rows])
    lines += figures(SAVE_CPU[:-5], [("stall", "Stall per save, this library and its peers"),
                                     ("step", "Training step time while the write runs, against a step without a save"),
                                     ("commit", "Time from the save call to a durable commit")])
    return lines


def train_section() -> list[str]:
    data = load(TRAIN)
    rows = data["rows"]
    gib = rows[0]["state_bytes"] / 2**30
    lines = ["## In a Lightning Trainer loop", "",
             f"`make bench-train` (`bench_train_loop.py`): a `Trainer` on CPU with {gib:.2f} GiB of state, saving through "
             f"stock `ModelCheckpoint` every N steps; {data['args']['saves']} saves per phase, {data['args']['rounds']} "
             f"rounds, medians. **Blocked** is what the training thread waits for per save; **overhead** is what a save "
             f"costs the loop (a save period's time minus N baseline steps). {source(TRAIN, data)}", ""]
    lines += table(
        ["N", "variant", "blocked (s)", "overhead per save (s)", "× DCP async_save's overhead", "to commit (s)",
         "the disk's floor (s)"],
        [[str(r["every"]), who(r["variant"]), f(r["blocked_s"], ".4f"), f(r["overhead_s"], ".3f"),
          f(r.get("overhead_vs_dcp"), ".2f", "×"), f(r["commit_s"], ".2f"), f(r.get("probe_floor_s"), ".2f")]
         for r in rows])
    lines += figures(TRAIN[:-5], [("stall", "Blocked and overhead per save in the Trainer loop"),
                                  ("step", "Training step time around a save"),
                                  ("commit", "Time to commit against the disk's floor")])
    return lines


def tiers_section() -> list[str]:
    lines = ["## The local tier: overhead per save and time to resume", "",
             "`make bench-tiers` (`bench_tiers.py`): 4 ranks on 2 simulated nodes (each node pinned to its own core), "
             "a save every 8 steps. The local tier saves into node-local memory and replicates to a peer node; the "
             "persistent tier writes to the shared file system. After a save, node 1 is emptied and both nodes "
             "resume: from the peers' replicas, or by reloading the persistent checkpoint (page cache dropped: "
             "*cold*; read through first: *warm*). Medians, slowest rank.", ""]
    for name, what in TIERS:
        data = load(name)
        s, a = data["summary"], data["args"]
        over = [o for o in s["overhead"] if o["variant"] != "baseline"]
        lines += [f"### {a['size']:g} GiB, {what}", "", source(name, data), ""]
        lines += table(["variant", "overhead per save (s)", "stall per save (s)", "extra CPU per save (s)"],
                       [[o["variant"], f(o["overhead_s"], ".3f"), f(o["stall_s"], ".3f"), f(o["extra_cpu_s"], ".2f")]
                        for o in over])
        lines += table(["resume from", "seconds (median)", "min", "max", "exact"],
                       [[r["how"].replace("_", " "), f(r["seconds"], ".3f"), f(r["min_s"], ".3f"), f(r["max_s"], ".3f"),
                         r["exact"]] for r in s["recovery"]])
        ratios = s["ratios"]
        lines += [f"Overhead per save, local / persistent: {f(ratios['overhead_local_vs_persistent'], '.2f', '×')}; "
                  f"resume, replicas / persistent (cold): {f(ratios['recovery_replicas_vs_persistent_cold'], '.2f', '×')}.",
                  ""]
        lines += figures(name[:-5], [("overhead", "Overhead and stall per save, local tier against persistent"),
                                     ("recovery", "Time to resume after a lost node")])
    return lines


def shared_section() -> list[str]:
    data = load(TIERS_S3)
    s, a, result = data["summary"], data["args"], data["result"]
    local_dir = a.get("local_dir") or "/dev/shm"
    sources = {r["how"]: r.get("from", "") for r in result["recoveries"]}
    file_bytes = next((r["file_bytes"] for r in s["recovery"] if r.get("file_bytes")), None)

    def shared_read(how: str) -> str:
        return "0 (node-local memory and the peers' replicas)" if sources.get(how, "").startswith(local_dir) \
            else f"the whole checkpoint ({mib(file_bytes)} file)"

    lines = ["## Reads from shared storage", "",
             "A resume from the local tier reads nothing from shared storage: each node's ranks read their node's "
             "memory, and a node back empty receives its shares from its peers. A resume from the persistent tier "
             "reads the whole checkpoint from it, on every node at once. Measured with the persistent checkpoint "
             f"on an S3-protocol server (moto on loopback), {a['size']:g} GiB DDP state. {source(TIERS_S3, data)}", ""]
    lines += table(["resume from", "read from shared storage", "seconds (median)", "exact"],
                   [[r["how"].replace("_", " "), shared_read(r["how"]), f(r["seconds"], ".3f"), r["exact"]]
                    for r in s["recovery"]])
    over = {o["variant"]: o for o in s["overhead"]}
    if "persistent_s3" in over:
        lines += [f"Overhead per save on that store: local {f(over['local']['overhead_s'], '.3f')} s, persistent "
                  f"{f(over['persistent_s3']['overhead_s'], '.3f')} s ("
                  f"{f(s['ratios']['overhead_local_vs_persistent_s3'], '.2f', '×')}); resume, replicas / persistent: "
                  f"{f(s['ratios']['recovery_replicas_vs_persistent_s3'], '.2f', '×')}.", ""]
    return lines


def cluster_section() -> list[str]:
    data = load(CLUSTER)
    a = data["args"]
    lines = ["## On an emulated cluster: resume time and bytes read from shared storage", "",
             f"`make bench-cluster` (`bench_cluster.py`): {a['nodes']} nodes x {a['ranks_per_node']} ranks, each node in "
             "its own network namespace behind a `tc` rate limit (its NIC), the shared storage an S3-protocol server "
             "in its own namespace behind its own limit, shared by all nodes and mounted on each with s3fs. Every "
             "rank resumes through `DDPStrategy.load_checkpoint`, as Lightning's resume does, with stock's "
             "`TorchCheckpointIO` and with `AsyncCheckpointIO` (read once: each rank reads about 1/W and receives "
             "the rest over the process group). The page cache is dropped before each resume; the bytes are counted "
             "at the storage's link (protocol headers included). Medians, slowest rank. " + source(CLUSTER, data), ""]
    lines += table(["NIC : storage (Mbit/s)", "stock (s)", "ours (s)", "ours / stock", "read, stock (x file)",
                    "read, ours (x file)", "exact (stock, ours)"],
                   [[f"{s['nic_mbit']:g} : {s['storage_mbit']:g}", f(s["median"]["stock"]["seconds"], ".2f"),
                     f(s["median"]["ours"]["seconds"], ".2f"), f(s["time_ours_over_stock"], ".2f", "×"),
                     f(s["bytes_stock_over_file"], ".2f", "×"), f(s["bytes_ours_over_file"], ".3f", "×"),
                     f"{s['median']['stock']['exact']}, {s['median']['ours']['exact']}"] for s in data["summaries"]])
    lines += ["Projected to larger clusters with the link rates above: stock reads `k x S` from the storage "
              "(`k` measured per node, times N nodes), `T_stock = k x S / B_s + c_stock`; ours reads `S` once and gloo's ring "
              "all-gather moves `(W - 1) / W x S` into each node, `T_ours = S / B_s + (W - 1) / W x S / B_n + c`, with "
              "`c` (the load from memory with its checks, the exchange's messages) and `c_stock` (stock's load) measured "
              "at 2 nodes and kept constant.",
              ""]
    rows = []
    for s in data["summaries"]:
        b_s, b_n, size = s["storage_mbit"] * 1e6 / 8, s["nic_mbit"] * 1e6 / 8, s["file_bytes"]
        per_node = s["bytes_stock_over_file"] / a["nodes"]
        for n in (64, 1024):
            stock = per_node * n * size / b_s + max(s["rest_stock_s"], 0.0)
            world = n * a["ranks_per_node"]
            ours = size / b_s + (world - 1) / world * size / b_n + max(s["rest_c_s"], 0.0)
            rows.append([f"{s['nic_mbit']:g} : {s['storage_mbit']:g}",
                         f"{f(s['rest_stock_s'], '.2f')}, {f(s['rest_c_s'], '.2f')}", str(n), f(stock, ".1f"),
                         f(ours, ".1f"),
                         f(ours / stock, ".3f", "×")])
    lines += table(["NIC : storage (Mbit/s)", "c_stock, c (s)", "nodes", "stock (s)", "ours (s)", "ours / stock"], rows)
    lines += figures(CLUSTER[:-5], [("resume", "Resume time and bytes read from shared storage, ours against stock's")])
    for name in TIERS_CLUSTER:
        t = load(name)
        ta, ts = t["args"], t["summary"]
        r = ts["ratios"]
        lines += [f"### The two tiers at NIC {ta['nic_mbit']:g} : storage {ta['storage_mbit']:g} Mbit/s", "",
                  f"`bench_tiers.py --cluster`: {ta['size']:g} GiB DDP state, a save every {ta['every']} steps; the "
                  "persistent tier writes to and reloads from the shared storage. " + source(name, t), ""]
        lines += table(["measure", "measured", "target"],
                       [["overhead per save, local / persistent", f(r["overhead_local_vs_persistent"], ".2f", "×"), "≤ 0.5×"],
                        ["resume, replicas / persistent (page cache dropped)",
                         f(r["recovery_replicas_vs_persistent_cold"], ".2f", "×"), "≤ 0.5×"]])
        lines += figures(name[:-5], [("overhead", "Overhead and stall per save on the emulated cluster"),
                                     ("recovery", "Time to resume after a lost node on the emulated cluster")])
    return lines


def gpu_section() -> list[str]:
    """``scripts/gpu_check.sh``'s log as measured: its header, the tests' summary, each benchmark's table and
    verdict lines, and the peer that failed (with its error)."""
    log = (RESULTS / GPU_LOG).read_text().splitlines()
    lines = ["## On a GPU: one NVIDIA H200", "",
             f"`make gpu-check` (`scripts/gpu_check.sh`), quoted from its log `benchmarks/results/{GPU_LOG}`: "
             "one run of each; the floor is the pinned device-to-host copy of the same tensors.", "",
             "```text", *log[:2], "```", ""]
    section = None
    for i, ln in enumerate(log):
        if ln.startswith("== "):
            section = ln[3:]
            lines += ([""] if lines[-1] else []) + [f"**{section}**", ""]
        elif re.match(r"\d+ passed", ln):
            lines += [f"Result: {ln}", ""]
        elif section and re.match(r"\S+ at .* failed:", ln):
            error = next((x for x in log[i:] if "Error:" in x and x.startswith("[rank0]: ")), "")
            lines += [f"{ln[:-1]} (`{error[len('[rank0]: '):]}`): no row.", ""]
        elif section and ln.startswith("|"):
            lines.append(ln)
            if i + 1 < len(log) and not log[i + 1].startswith("|"):
                lines.append("")
        elif section and re.search(r"(stall|blocked) .* floor", ln) and not ln.startswith(" "):
            lines += [f"- {ln}"] + ([""] if i + 1 < len(log) and not re.search(r"(stall|blocked) .* floor", log[i + 1])
                                     else [])
    data = load(SAVE_GPU_TIER)
    lines += ["**The local tier's save on the same GPU**", "", source(SAVE_GPU_TIER, data), ""]
    lines += table(["variant", "stall (s)", "× the pinned floor", "to commit (s)"],
                   [[who(r["variant"]), f(r["stall_s"], ".4f"), f(r["stall_vs_memcpy_floor"], ".2f", "×"),
                     f(r["e2e_s"], ".2f")] for r in data["rows"]])
    lines += figures(SAVE_GPU_TIER[:-5], [("stall", "Stall per save with the state on an H200")])
    return lines


def render() -> str:
    head = ["<!-- Generated by benchmarks/report_docs.py from benchmarks/results/: do not edit; run", "     "
            "python benchmarks/report_docs.py (tests/test_docs_performance.py fails when this file is stale). -->", ""]
    body = save_section() + train_section() + tiers_section() + shared_section() + cluster_section() + gpu_section()
    return "\n".join(head + body).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help="where to write (default: docs/_generated/performance_tables.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from what would be written")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            sys.exit(f"{args.out} is out of date: run python benchmarks/report_docs.py and commit it")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
