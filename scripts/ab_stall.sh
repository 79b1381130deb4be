#!/usr/bin/env bash
# make bench's stall, A/B: the library at BASE against this checkout, in alternating runs (issue 53's check that a
# refactor leaves the stall no worse). Each run is one bench_save.py process per variant, with PYTHONPATH on one
# tree; the medians of each side's steady-state stalls are printed, per variant.
#   scripts/ab_stall.sh [BASE=79b8cc9] [RUNS=5] [SIZES=0.25] [VARIANTS=nvrx_persistent,mcore_persistent]
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-79b8cc9}; RUNS=${RUNS:-5}; SIZES=${SIZES:-0.25}; VARIANTS=${VARIANTS:-nvrx_persistent,mcore_persistent}
PY=${PY:-.venv/bin/python}
work=$(mktemp -d /tmp/ab-stall-XXXXXX)
trap 'git worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/base" "$BASE"
for i in $(seq "$RUNS"); do
  for side in base head; do
    tree=$PWD; [ "$side" = base ] && tree=$work/base
    # each side's own bench drives it (the library's API changed between them); the stall is measured the same way
    PYTHONPATH=$tree "$PY" "$tree/benchmarks/bench_save.py" --sizes "$SIZES" --saves 5 --rounds 1 --variants "$VARIANTS" \
      --out "$work/$side-$i" > "$work/$side-$i.log" 2>&1
    echo "run $i $side: done ($(uptime | sed 's/.*load average: //'))"
  done
done
"$PY" - "$work" "$RUNS" <<'PY'
import glob, json, statistics, sys
work, runs = sys.argv[1], int(sys.argv[2])
stalls = {}
for side in ("base", "head"):
    for f in glob.glob(f"{work}/{side}-*/bench-*.json"):
        for r in json.load(open(f))["runs"]:
            stalls.setdefault((r["variant"], side), []).extend(s["stall_s"] for s in r["saves"][1:])
for v in sorted({v for v, _ in stalls}):
    b, h = statistics.median(stalls[(v, "base")]), statistics.median(stalls[(v, "head")])
    print(f"{v}: base {b * 1e3:.1f} ms, head {h * 1e3:.1f} ms (head/base {h / b:.2f}x; "
          f"{len(stalls[(v, 'base')])} and {len(stalls[(v, 'head')])} saves)")
PY
