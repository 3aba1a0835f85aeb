#!/usr/bin/env bash
# The GPU check: one script for a GPU run of at most 8 minutes on one H200. Reaches no network (needs jax with
# CUDA, numpy, ml_dtypes, pytest and this tree; the server step also fastapi, uvicorn, llguidance, jsonschema:
# where they are missing, carry them as wheels, `scripts/gpu_wheels.sh DIR` downloads them, and set
# WHEELS=DIR). Results (logs, JSON, a summary) go under $OUT when that is set (else ./gpu_check_out/).
# Steps, each under its own timeout (seconds, overridable) so one slow step cannot eat the others' time:
#
#   1. the Pallas kernel tests natively (attention, indexer, Engram / mHC, the MoE kernel, the fused
#      fp8 / MXFP4 linear, the window codes, o_proj; slow ones too), 4 pytest workers        T_KERNELS=150
#   2. the model-level equivalence tests natively: forward and decode with every kernel vs
#      "xla", DSpark vs plain decoding, prefix-cache hit vs cold, 4 workers                  T_MODEL=120
#   3. from the start, beside 1-2: the server on nano (`python -m dsv41_jax.serve`, kernels chosen by
#      `auto`) answering the quick-start demo (thinking, a tool call, json_schema, /metrics); its log
#      gives the start-up (compile) time                                                    T_SERVER=200
#   4. after 1-3: the fused linear kernel vs the xla fp8 GEMM at flash's wq_a / wq_b / wkv / wo_b, 1
#      and 64 rows, its tuning candidates at 1 row; then the MoE kernel vs the xla grouped path at
#      flash's expert shapes, 1-512 tokens (time, GB/s, diff), its candidates at 1 and 64   T_MOE=170
#   5. from the start, in the background: the decode step of a flash-dimension cut (layers 0,2,3,20:
#      window, ratio-2 source, ratio-2 reader, ratio-1 source + candidates: 30 GiB; layer 1's Engram table
#      alone is 101 GiB, a row gather per step) with random weights in the stored formats, at B = 1, 64, 8
#      and contexts 4K and 64K, with impl "auto" and then "auto,linear=pallas": ms per step, weight bytes per step, GB/s against a device copy measured in
#      the same run, kernel launches per step, compile time per batch. XLA's GPU compile of the cut takes
#      minutes of CPU, so it overlaps steps 1-4; the timings (and the copy) wait for steps 1-4 to end
#      (bench_decode --barrier), so they run on a GPU nobody else uses                        T_DECODE=480
#   The processes share the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION: decode 0.45, server 0.1, each
#   test worker 0.09, the MoE benchmark 0.4). At most 480 s in all. Results of the runs on an H200:
#   docs/results/gpu_check_h200_flash_cut/ (docs/benchmarks.md, "The model on an H200").
#
#   bash scripts/gpu_check.sh            # on a GPU (ALL_KERNELS=1: also every kernel's micro-benchmark)
#   DRY_RUN=1 bash scripts/gpu_check.sh  # on CPU: every step's command at tiny sizes (tests collected, not
#                                        # run; benchmarks in interpret mode; the server on nano), to check
#                                        # the script itself
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
DRY="${DRY_RUN:-}"
if [ -n "${WHEELS:-}" ]; then  # the server's dependencies, carried as wheels (scripts/gpu_wheels.sh)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels in $WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi
{
  echo "# gpu_check $(date -u +%FT%TZ)${DRY:+ (dry run)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'backend', jax.default_backend(), jax.devices())"
} | tee "$OUT/env.txt"
if [ -z "$DRY" ] && [ "$("$PY" -c 'import jax; print(jax.default_backend())')" != "gpu" ]; then
  echo "gpu_check: no GPU backend here (DRY_RUN=1 checks the script on CPU; the tests run in interpret mode under pytest)" >&2
  exit 2
fi
status=0
step() {  # step NAME TIMEOUT CMD...: run CMD under a timeout, log to $OUT/NAME.log, record rc and seconds
  local name=$1 limit=$2
  shift 2
  [ -z "$DRY" ] || limit=900  # a dry run checks wiring on a CPU, whose speed says nothing
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 3 "$OUT/$name.log"
  [ "$rc" = 0 ] || status=1
}
BARRIER="$(mktemp -u /tmp/gpu_check_barrier.XXXXXX)"
if [ -n "$DRY" ]; then
  DECODE=(--model tiny --keep-layers 0 --batches 1 --contexts 64 --max-contexts 1024 --iters 1 --weights random)
  IMPLS="auto;auto,linear=pallas_interpret"  # on the CPU the kernel runs in interpret mode
else
  IMPLS="auto;auto,linear=pallas"  # the fused linear kernel (auto keeps xla for it until this run times it)
  # B=1 first (the bandwidth goal), then 64 (the MoE's case), then 8; one compile per batch, the JSON is
  # written after every case, so a step cut short by its timeout keeps what it measured
  DECODE=(--model flash --keep-layers 0,2,3,20 --batches 1,64,8 --contexts 4096,65536 --max-contexts 65536 --iters 10)
fi
(
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
  step decode_flash_cut "${T_DECODE:-480}" "$PY" scripts/bench_decode.py --part a --impls "$IMPLS" \
    "${DECODE[@]}" \
    --barrier "$BARRIER" --barrier-timeout 600 --out "$OUT/bench_decode.json"
  exit $status
) &
decode_pid=$!
# the server on nano and the quick-start demo against it (beside the tests: its start is mostly CPU compile);
# the server's log follows the demo's output
SERVE='"$0" -m dsv41_jax.serve --port 30017 > /tmp/gpu_check_server.log 2>&1 & pid=$!
trap "kill $pid 2>/dev/null" EXIT TERM  # the timeout signals this shell only: take the server with it
"$0" scripts/quickstart_demo.py --base-url http://127.0.0.1:30017 --wait "$1"; rc=$?
kill $pid 2>/dev/null; wait $pid 2>/dev/null; echo "--- the server log"; cat /tmp/gpu_check_server.log; exit $rc'
(
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.1
  step server_nano "${T_SERVER:-200}" bash -c "$SERVE" "$PY" "$(( ${T_SERVER:-200} - 20 ))"
  exit $status
) &
server_pid=$!
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.09  # per pytest worker
# pytest: -p no:cacheprovider (the tree may be read-only); conftest forces host CPU devices only, which leaves
# the GPU the default backend, and the pallas_impl fixture picks the native kernels there. -o addopts="":
# the slow tests too (the MoE kernel at flash's widths, experts past 2 GiB).
if [ -n "$DRY" ]; then PAR=(--collect-only); else PAR=(-n 4 --dist loadgroup); fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" --durations=8 -rfE "${PAR[@]}")
step kernel_tests "${T_KERNELS:-150}" "${PYTEST[@]}" tests/test_pallas_attention.py tests/test_pallas_indexer.py \
  tests/test_pallas_mix.py tests/test_pallas_moe.py tests/test_pallas_linear.py tests/test_pallas_window_codes.py \
  tests/test_pallas_o_proj.py
step model_tests "${T_MODEL:-120}" "${PYTEST[@]}" tests/test_fastpath_attention.py tests/test_dspark.py \
  tests/test_prefix_cache.py -k "pallas_equals_xla or greedy_speculation_equals_plain or cached_prefix_equals_cold_exact"
wait "$server_pid" || status=1
if [ -n "$DRY" ]; then GRID=--smoke; else GRID=--quick; fi
XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 step moe_kernel "${T_MOE:-170}" "$PY" scripts/bench_kernels.py --ops linear,moe \
  "$GRID" --reps 5 --out "$OUT/bench_moe.json"
if [ -n "${ALL_KERNELS:-}" ]; then  # optional: every kernel's micro-benchmark (scripts/bench_kernels.py --quick)
  step bench_kernels "${T_ALL:-300}" "$PY" scripts/bench_kernels.py "$GRID" --out "$OUT/bench_kernels.json"
fi
touch "$BARRIER"  # the GPU is the decode benchmark's alone from here
wait "$decode_pid" || status=1
rm -f "$BARRIER"
echo "gpu_check: done, status $status (results in $OUT)" | tee -a "$OUT/summary.txt"
exit $status
