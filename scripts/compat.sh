#!/usr/bin/env bash
# `make test-compat`: the corners of the supported versions (docs/compatibility.md), each in its own
# cached virtual environment, against a representative subset of the suite (needs network the first time).
#
#     bash scripts/compat.sh                  # every corner
#     COMPAT_CORNERS=oldest bash scripts/compat.sh
#
# A corner is one line of CORNERS: Python, torch, Lightning, megatron-core, nvidia-resiliency-ext. Its venv
# is built once under $COMPAT_VENVS (default: ../.compat-venvs, beside the repository; torch other than the
# CPU pin of `make test` comes from the registry as a multi-GB CUDA build, which runs on CPU) and reused;
# this checkout is installed into it (editable, no dependencies) at every run. Python X.Y is looked up as
# pythonX.Y on PATH, then under pyenv. Budget: about 30 minutes on 2 CPU cores with the venvs cached.
# Exit status: 0 when every corner passed; the summary lists each corner's result and time.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENVS=${COMPAT_VENVS:-$REPO/../.compat-venvs}
mkdir -p "$VENVS"
VENVS=$(cd "$VENVS" && pwd)

# `below` is under the floors (torch 2.6, Lightning 2.5), and `below24` is the stack that issue 17 measured
# failing at every load (torch 2.4.1, Lightning 2.4.0): there AsyncCheckpointIO must refuse at once
#      name   python torch  lightning    megatron-core nvidia-resiliency-ext
CORNERS="
oldest 3.10   2.7.0  2.6.0        0.13.1        0.4.1
newest 3.12   2.14.1 2.6.6        0.16.1        0.4.1
below  3.10   2.6.0  2.5.0.post0  0.13.1        0.4.1
below24 3.11  2.4.1  2.4.0        0.13.1        0.4.1
"
WANT=${COMPAT_CORNERS:-oldest newest below below24}

# the subset (scripts/subset.sh), on both engines (nvrx persistent, mcore fork)
ENGINE_K="(nvrx-persistent or mcore-fork)"
source scripts/subset.sh
TESTS=("${SUBSET[@]}")

find_python() {
    local v=$1 p
    for p in "$(command -v "python$v")" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v"*/bin/python"$v"; do
        # a pyenv shim is on PATH for every version but runs only the selected ones
        [ -x "$p" ] && "$p" -c "" 2>/dev/null && { echo "$p"; return; }
    done
    return 1
}

build() {  # venv python torch lightning mcore nvrx
    local venv=$1 py
    [ -f "$venv/.compat-ready" ] && return 0
    py=$(find_python "$2") || { echo "no Python $2 here (PATH or pyenv)"; return 1; }
    rm -rf "$venv" && "$py" -m venv "$venv" || return 1
    # pins.txt pins lightning and megatron-core for `make test`: the corner's own versions replace those
    grep -v -E "^(lightning|megatron-core)==" requirements/pins.txt > "$venv.pins"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$3" "lightning==$4" \
        "megatron-core==$5" "nvidia-resiliency-ext==$6" -c "$venv.pins" "setuptools>=64" wheel \
        pytest pytest-timeout psutil 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" -c "import torch, lightning, megatron.core, nvidia_resiliency_ext" || return 1
    touch "$venv/.compat-ready"
}

# megatron-core 0.13 with torch 2.7 starts torch inductor's compile-worker processes when it is imported; they
# outlive fit and fail the suite's "no process left behind" checks. They are torch's, not this library's:
# one compile thread starts none.
export TORCHINDUCTOR_COMPILE_THREADS=1

summary=()
status=0
start_all=$SECONDS
while read -r name py torch lightning mcore nvrx; do
    [ -z "$name" ] && continue
    [[ " $WANT " == *" $name "* ]] || continue
    start=$SECONDS
    venv="$VENVS/py$py-torch$torch-lightning$lightning-mcore$mcore-nvrx$nvrx"
    label="$name: Python $py, torch $torch, lightning $lightning, megatron-core $mcore, nvidia-resiliency-ext $nvrx"
    echo "== $label"
    if ! build "$venv" "$py" "$torch" "$lightning" "$mcore" "$nvrx"; then
        summary+=("FAILED (venv did not build)  $label"); status=1; continue
    fi
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null; then
        summary+=("FAILED (this checkout did not install)  $label"); status=1; continue
    fi
    "$venv/bin/python" -c "import torch, lightning, sys; print('   ', sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__)"
    ok=1
    tests=("${TESTS[@]}")
    [[ "$name" == below* ]] && tests=("tests/test_versions.py -k refused_at_construction")
    for spec in "${tests[@]}"; do
        file=${spec%% -k *}
        args=("$file")
        [[ "$spec" == *" -k "* ]] && args+=(-k "${spec#* -k }")
        "$venv/bin/python" -m pytest -q -p no:cacheprovider "${args[@]}" || ok=0
    done
    took=$((SECONDS - start))
    if [ $ok = 1 ]; then summary+=("passed in ${took}s  $label"); else summary+=("FAILED in ${took}s  $label"); status=1; fi
done <<< "$CORNERS"
echo
echo "== test-compat summary ($((SECONDS - start_all))s)"
printf '%s\n' "${summary[@]}"
exit $status
