#!/usr/bin/env bash
# One command for a local NVIDIA Dynamo deployment of dsv41_jax: our frontend with KV-aware routing and N
# aggregated workers, no etcd / NATS (file discovery, tcp request plane, zmq event plane), all on 127.0.0.1.
#
#   scripts/dynamo_local.sh [N] [engine flags...]     # e.g. scripts/dynamo_local.sh 2 --model nano
#
# Prefill/decode disaggregation: PREFILL=P starts P prefill workers, and the N workers decode
# (e.g. PREFILL=1 scripts/dynamo_local.sh 1 --model nano; the state moves through NIXL).
# Env: PORT (the frontend's HTTP port, default 8000), ROUTER_MODE (kv | round-robin | random, default kv),
# PYTHON (default python), LOG_DIR (one log per process; default a temporary directory). Ctrl-C stops every
# process. Needs scripts/install_dynamo.sh first. (= python -m dsv41_jax.dynamo.local --help)
set -euo pipefail
N=${1:-2}
shift || true
args=(--workers "$N" --prefill-workers "${PREFILL:-0}" --port "${PORT:-8000}" --router-mode "${ROUTER_MODE:-kv}")
[ -n "${LOG_DIR:-}" ] && args+=(--log-dir "$LOG_DIR")
exec "${PYTHON:-python}" -m dsv41_jax.dynamo.local "${args[@]}" -- "$@"
