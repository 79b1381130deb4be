#!/usr/bin/env bash
# The one prepared check for a CUDA machine (steps 1 to 4 took about 4 minutes on an H200 with 16 cores on
# 2026-12-04; hard limit 16). Run from the repo root:
#
#     bash scripts/gpu_check.sh            # or: make gpu-check; results in ${OUT:-gpu_check_out}/
#
# Wheels for a machine without network (Python 3.12 here as an example), fetched where pip works:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#         -d .whl nvidia-resiliency-ext megatron-core
#
# 1. the GPU tests: CUDA tensors staged through pinned shared memory (both engines, both workers), a
#    writer without a CUDA context, NCCL and gloo agreement at world size 1, TransformerEngine FP8
#    weights saved dequantized (skipped where TE is not installed), a CUDA model resumed from the local
#    tier bit for bit;
# 2. the CUDA benchmark at 2 and 8 GiB on the GPU, and the stall against the pinned device-to-host
#    copy floor measured in the same run (target: 1.3x or less), the local tier alone beside it;
# 3. the lazy snapshot on the GPU (benchmarks/bench_lazy.py --device cuda, 2 GiB): what training blocks on
#    (save call + wait before the optimizer step) against the pinned D2H floor (target: 0.1x or less),
#    eager beside it;
# 4. saves faster than the disk (bench_lazy.py --overlap, 1 GiB): a lazy save's device-to-host copy follows the
#    write in flight once it ends, one staging copy against eager's two; blocked, pace and
#    how busy the writer stays;
# 5. the lazy snapshot with a forward and backward longer than the copy (--batch 4096, 2 GiB: about 70 ms
#    of fp32 matmuls against a 40 ms copy on an H200), where the copy can hide entirely;
# 6. where the lazy save call's own time goes on the GPU (benchmarks/profile_save_call.py, cProfile);
# 7. the device-to-host copy into the local tier's mapped /dev/shm files, pageable and registered with
#    CUDA, against pinned memory (benchmarks/probe_d2h_mapped.py, 2 GiB).
#
# Python: $PYTHON (default python3) must have a CUDA torch. Missing packages can be installed from
# wheels in .whl/ (no network needed): they go to /tmp/site. The package itself is used from the
# checkout (PYTHONPATH), so nothing is installed into the system.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/gpu_check.log"
: >"$LOG"
say() { echo "$@" | tee -a "$LOG"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { say "installing the carried wheels failed"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.metadata as md, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("lightning", "nvidia-resiliency-ext", "megatron-core", "transformer-engine", "pytest", "pytest-timeout"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF

status=0
say "== GPU tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --timeout=200 \
    tests/test_gpu.py tests/test_control_plane.py tests/test_tiers_trainer.py -k "not bench_cuda_smoke" -rs 2>&1 \
    | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "== CUDA benchmark (2 and 8 GiB on the GPU)"
BENCH_DIR=$(mktemp -d -p /dev/shm gpu-bench-XXXX 2>/dev/null || mktemp -d)
timeout 270 "$PY" benchmarks/bench_save.py --device cuda --sizes "${GPU_BENCH_SIZES:-2,8}" --saves 4 \
    --variants dcp_sync,dcp_async_process,nvrx_persistent,mcore_persistent,local_tier --dir "$BENCH_DIR" --out "$OUT" \
    2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
rm -rf "$BENCH_DIR"

"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, pathlib, sys
runs = sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json"))
if not runs:
    print("no benchmark result"); sys.exit(0)
for row in json.loads(runs[-1].read_text())["rows"]:
    if row["variant"].endswith("_persistent"):
        x = row["stall_vs_memcpy_floor"]
        verdict = "met" if x is not None and x <= 1.3 else "NOT met"
        print(f"{row['size_gib']:g} GiB {row['variant']}: stall {row['stall_s']:.4f} s = {x:.2f}x the pinned D2H floor"
              f" ({verdict}; target 1.3x)")
EOF
say "== lazy snapshot on the GPU (2 GiB): blocked = save + wait before the step, against the pinned D2H floor"
timeout 180 "$PY" benchmarks/bench_lazy.py --device cuda --sizes "${GPU_LAZY_SIZES:-2}" --saves 5 --rounds 1 \
    --out "$OUT/lazy.json" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" - "$OUT/lazy.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, pathlib, statistics, sys
path = pathlib.Path(sys.argv[1])
runs = json.loads(path.read_text()) if path.exists() else []
for r in (r for r in runs if r["mode"] == "lazy"):
    blocked = statistics.median(s + w for s, w in zip(r["save_s"][1:], r["wait_s"][1:]))
    x = blocked / r["floor_s"]
    print(f"{r['size_gib']:g} GiB lazy: blocked {blocked:.4f} s = {x:.3f}x the pinned D2H floor"
          f" ({'met' if x <= 0.1 else 'NOT met'}; target 0.1x)")
EOF

say "== lazy saves faster than the disk on the GPU (1 GiB, a save every step): the copy follows the write in flight"
timeout 90 "$PY" benchmarks/bench_lazy.py --device cuda --overlap --sizes "${GPU_OVERLAP_SIZES:-1}" --saves 8 --rounds 1 \
    --batch 4 --out "$OUT/lazy-overlap.json" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "== lazy snapshot with a forward and backward longer than the copy (2 GiB, --batch 4096)"
timeout 120 "$PY" benchmarks/bench_lazy.py --device cuda --sizes 2 --saves 5 --rounds 1 --batch "${GPU_LAZY_BATCH:-4096}" \
    --out "$OUT/lazy-compute.json" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "== where the lazy save call's time goes on the GPU (cProfile, 2 GiB)"
timeout 90 "$PY" benchmarks/profile_save_call.py --device cuda --gib 2 --saves 4 --top 30 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "== the device-to-host copy into the local tier's mapped files (2 GiB): pageable, registered, pinned"
timeout 90 "$PY" benchmarks/probe_d2h_mapped.py --gib 2 --reps 6 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

say "gpu_check: exit $status"
exit $status
