#!/usr/bin/env bash
# Lightning's own tests_pytorch/checkpointing suite (Lightning tag 2.6.5 tests; installed lightning==2.6.6),
# run stock and with lightning_asyncckpt.AsyncCheckpointIO injected into every Trainer without a CheckpointIO.
# Usage: ./run.sh [stock] [callback] [plugin]   (default: stock plugin).  Extra pytest args via PYTEST_ARGS.
set -u
set -f  # TARGET may hold node ids with [...]
cd "$(dirname "$0")"
HERE=$PWD
PY=${PY:-$(cd "$HERE/../.." && pwd)/.venv/bin/python}
LIB=${LIB:-$(cd "$HERE/../.." && pwd)}
TARGET=${TARGET:-tests/tests_pytorch/checkpointing}
TIMEOUT=${TIMEOUT:-2400}
RES=${RES:-results}  # results folder (relative to this script)
MODES=("$@"); [ ${#MODES[@]} -eq 0 ] && MODES=(stock plugin)
mkdir -p "$RES"
{ echo "lightning_asyncckpt at $LIB: $(git -C "$LIB" log -1 --format='%h %ci %s' | cut -c1-100)"; git -C "$LIB" status --short -- lightning_asyncckpt | sed 's/^/  dirty: /'; } > "$RES/library_rev.txt"
# test-only dependencies missing from the venv (test_model_checkpoint.py imports both at module level);
# installed into ./deps (on PYTHONPATH of every mode), not into the venv
[ -d deps/cloudpickle ] || timeout 300 "$PY" -m pip install -q --no-deps --target deps cloudpickle
[ -d deps/jsonargparse ] || timeout 300 "$PY" -m pip install -q --no-deps --target deps jsonargparse
# tensorboard: with it, the Trainer's default logger is TensorBoardLogger and 4 more tests run (158 pass stock
# instead of 154); the strongest run is the one with it
[ -d deps/tensorboard ] || timeout 300 "$PY" -m pip install -q --no-deps --target deps tensorboard \
  tensorboard-data-server markdown absl-py grpcio
ARGS=()
for mode in "${MODES[@]}"; do
  case $mode in
    stock) pp="$HERE:$HERE/deps"; extra=(-p no:lightning_asyncckpt) ;;   # hide the package's pytest11 plugin too
    callback|plugin) pp="$LIB:$HERE:$HERE/deps"; extra=() ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  echo "=== $mode: $(date -Is)"
  start=$(date +%s)
  PYTHONPATH="$pp" ASYNCCKPT_SUITE_MODE=$mode ASYNCCKPT_SUITE_LOG="$HERE/$RES/trainers_$mode.log" \
    timeout "$TIMEOUT" "$PY" -m pytest -p no:cacheprovider -p asyncckpt_inject "${extra[@]}" --color=no -q -rA \
      --junitxml="$RES/$mode.xml" ${PYTEST_ARGS:-} $TARGET > "$RES/$mode.log" 2>&1
  rc=$?
  end=$(date +%s)
  echo "$mode: pytest rc=$rc, $((end - start)) s; $(tail -1 $RES/$mode.log)" | tee "$RES/${mode}_runtime.txt"
  ARGS+=("$mode=$RES/$mode.xml")
done
# keep the other modes' earlier results in the comparison
for m in stock callback plugin; do
  [[ " ${MODES[*]} " == *" $m "* ]] || { [ -f $RES/$m.xml ] && ARGS+=("$m=$RES/$m.xml"); }
done
RES="$RES" "$PY" summarize.py "${ARGS[@]}" | tee "$RES/summary.txt"
