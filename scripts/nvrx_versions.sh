#!/usr/bin/env bash
# Runs tests/test_engine_versions.py against nvidia-resiliency-ext 0.5, 0.6 and 0.7 (needs network), then
# the representative subset of `make test-compat` (nvrx engine) with each release first on PYTHONPATH.
#
#     bash scripts/nvrx_versions.sh          # or: make test-nvrx-versions
#     NVRX_SUBSET=0 bash scripts/nvrx_versions.sh   # the engine-version tests only
#
# These releases ship only manylinux_2_39 wheels, which do not install on older glibc. Their async
# checkpoint code is plain Python, so the wheels are downloaded and unpacked under build/, and each
# release runs first on PYTHONPATH in a subprocess, next to the 0.4.1 that .venv has installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSIONS=${NVRX_VERSIONS:-0.5.0 0.6.0 0.7.0}
mkdir -p build/wheels
trees=()
for v in $VERSIONS; do
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_39_x86_64 -d build/wheels "nvidia-resiliency-ext==$v"
    tree="build/nvrx-$v"
    rm -rf "$tree" && mkdir -p "$tree"
    "$PY" -m zipfile -e build/wheels/nvidia_resiliency_ext-"$v"-*.whl "$tree"
    trees+=("$PWD/$tree")
done
status=0
LIGHTNING_ASYNCCKPT_NVRX_TREES=$(IFS=:; echo "${trees[*]}") "$PY" -m pytest -q tests/test_engine_versions.py "$@" || status=1
[ "${NVRX_SUBSET:-1}" = 0 ] && exit $status

# the subset of `make test-compat` (scripts/subset.sh), on the nvrx engine, each release imported first
# (the worker processes inherit PYTHONPATH); the version check reads the release's own metadata
ENGINE_K="nvrx-persistent"
source scripts/subset.sh
for tree in "${trees[@]}"; do
    echo "== nvidia-resiliency-ext from $tree"
    PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import nvidia_resiliency_ext, importlib.metadata as m; print('   ', m.version('nvidia-resiliency-ext'), nvidia_resiliency_ext.__file__)"
    for spec in "${SUBSET[@]}"; do
        file=${spec%% -k *}
        args=("$file")
        [[ "$spec" == *" -k "* ]] && args+=(-k "${spec#* -k }")
        PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider "${args[@]}" || status=1
    done
done
exit $status
