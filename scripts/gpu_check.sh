#!/usr/bin/env bash
# The GPU check of the Pallas kernels: run the kernel tests natively, then the kernel benchmark.
# Installs nothing and reaches no network; needs only jax (with CUDA), numpy, ml_dtypes and pytest.
# Writes its logs and the benchmark JSON under $OUT when that is set (else ./gpu_check_out/).
#
#   bash scripts/gpu_check.sh            # tests + full benchmark
#   QUICK=1 bash scripts/gpu_check.sh    # tests + a reduced benchmark grid (for a short lease)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
{
  echo "# gpu_check $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'backend', jax.default_backend(), jax.devices())"
} | tee "$OUT/env.txt"
if [ "$("$PY" -c 'import jax; print(jax.default_backend())')" != "gpu" ]; then
  echo "gpu_check: no GPU backend here; the kernel tests would run in interpret mode (use pytest for that)" >&2
  exit 2
fi
# The kernel tests, natively (the pallas_impl fixture picks "pallas" on a GPU). -p no:cacheprovider: the
# tree may be read-only; conftest forces host CPU devices only, which leaves the GPU the default backend.
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_pallas_attention.py tests/test_pallas_indexer.py tests/test_pallas_mix.py 2>&1 | tee "$OUT/tests.log"
rc_tests=${PIPESTATUS[0]}
echo "kernel tests: rc=$rc_tests" | tee -a "$OUT/env.txt"
timeout "${BENCH_TIMEOUT:-300}" "$PY" scripts/bench_kernels.py ${QUICK:+--quick} --out "$OUT/bench_kernels.json" 2>&1 \
  | tee "$OUT/bench.log"
rc_bench=${PIPESTATUS[0]}
echo "benchmark: rc=$rc_bench" | tee -a "$OUT/env.txt"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
