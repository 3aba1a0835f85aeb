#!/usr/bin/env bash
# One command for a local NVIDIA Dynamo deployment of dsv41_jax: a frontend with KV-aware routing and N aggregated
# workers, no etcd / NATS (file discovery, tcp request plane, zmq event plane), everything on 127.0.0.1.
#
#   scripts/dynamo_local.sh [N] [engine flags...]      # e.g. scripts/dynamo_local.sh 2 --model nano
#
# Env: PORT (frontend HTTP port, default 8000), ROUTER_MODE (kv | round-robin | random, default kv),
#      PYTHON (default python), DYN_FILE_KV (discovery directory, default a fresh temporary one),
#      LOG_DIR (default a temporary directory; each process logs to its own file there).
# Worker i serves its engine counters on 127.0.0.1:$((SYSTEM_PORT_BASE + i)) (POST /engine/control/stats),
# SYSTEM_PORT_BASE defaults to 28100 (Dynamo needs system ports below 32768).
# Ctrl-C (or SIGTERM) stops the frontend and every worker. Needs scripts/install_dynamo.sh first.
set -euo pipefail
N=${1:-2}
shift || true
PY=${PYTHON:-python}
PORT=${PORT:-8000}
ROUTER_MODE=${ROUTER_MODE:-kv}
SYSTEM_PORT_BASE=${SYSTEM_PORT_BASE:-28100}
LOG_DIR=${LOG_DIR:-$(mktemp -d -t dsv41-dynamo-XXXXXX)}
export DYN_FILE_KV=${DYN_FILE_KV:-$LOG_DIR/discovery}
export DYN_DISCOVERY_BACKEND=file DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1 \
       DYN_SYSTEM_HOST=127.0.0.1
pids=()
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM
for ((i = 0; i < N; i++)); do
  DYN_SYSTEM_PORT=$((SYSTEM_PORT_BASE + i)) "$PY" -m dsv41_jax.dynamo "$@" > "$LOG_DIR/worker$i.log" 2>&1 &
  pids+=($!)
done
"$PY" -m dsv41_jax.dynamo.frontend --http-host 127.0.0.1 --http-port "$PORT" --router-mode "$ROUTER_MODE" \
  > "$LOG_DIR/frontend.log" 2>&1 &
pids+=($!)
echo "frontend http://127.0.0.1:$PORT/v1 (router: $ROUTER_MODE), $N worker(s) loading; logs in $LOG_DIR"
until curl -sf "http://127.0.0.1:$PORT/v1/models" | grep -q '"id"'; do
  for p in "${pids[@]}"; do
    kill -0 "$p" 2>/dev/null || { echo "a process exited; see $LOG_DIR" >&2; exit 1; }
  done
  sleep 2
done
echo "ready: $(curl -s "http://127.0.0.1:$PORT/v1/models")"
wait -n "${pids[@]}"
echo "a process exited; see $LOG_DIR" >&2
exit 1
