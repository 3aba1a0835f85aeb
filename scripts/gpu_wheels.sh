#!/usr/bin/env bash
# Download, as wheels for CPython 3.12 on x86-64 Linux, the server's dependencies that a GPU image with JAX
# may lack (fastapi, uvicorn, llguidance, jsonschema and what they need), pinned to the versions installed
# in the Python running this script, so `scripts/gpu_check.sh` can install them offline on a GPU machine:
#
#   scripts/gpu_wheels.sh .whl          # here, with network
#   WHEELS=.whl bash scripts/gpu_check.sh   # there: pip install --no-index --target, nothing fetched
set -euo pipefail
DIR=${1:?usage: scripts/gpu_wheels.sh DIR}
PY=${PYTHON:-python3}
PKGS=(fastapi starlette pydantic pydantic_core annotated-types typing-inspection typing_extensions opentelemetry-api
      uvicorn llguidance jsonschema jsonschema-specifications referencing rpds-py)
PINNED=()
for p in "${PKGS[@]}"; do
  v=$("$PY" -c "import sys; from importlib.metadata import version; print(version(sys.argv[1]))" "$p") \
    || { echo "gpu_wheels: $p is not installed in $PY: install the package ('pip install -e .') first" >&2; exit 1; }
  PINNED+=("$p==$v")
done
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" "${PINNED[@]}"
echo "gpu_wheels: ${#PINNED[@]} wheels in $DIR ($(du -sh "$DIR" | cut -f1))"
