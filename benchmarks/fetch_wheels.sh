#!/usr/bin/env bash
# Wheels the H200 image lacks (pure Python, plus pydantic-core for CPython 3.12 x86_64), at the
# versions installed here, into .whl/ for benchmarks/h200.sh. Needs pip and the package index.
#
#   bash benchmarks/fetch_wheels.sh      # then carry .whl to the GPU machine with the tree
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(pydantic pydantic-core annotated-types typing-inspection structlog starlette uvicorn)
pins=()
for p in "${pkgs[@]}"; do
    v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] || { echo "$p is not installed here: pip install -e . first" >&2; exit 1; }
    pins+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl
