#!/usr/bin/env bash
# Runs tests/test_engine_versions.py against nvidia-resiliency-ext 0.5, 0.6 and 0.7 (needs network).
#
#     bash scripts/nvrx_versions.sh          # or: make test-nvrx-versions
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
LIGHTNING_ASYNCCKPT_NVRX_TREES=$(IFS=:; echo "${trees[*]}") "$PY" -m pytest -q tests/test_engine_versions.py "$@"
