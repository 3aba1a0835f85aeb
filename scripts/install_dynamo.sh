#!/usr/bin/env bash
# Install NVIDIA Dynamo 1.6.1 for `python -m dsv41_jax.dynamo` / `python -m dsv41_jax.dynamo.frontend` into the
# current Python environment (run it with the venv active, from the repository root or anywhere).
#
#   1. this package with its [dynamo] extra: ai-dynamo-runtime 1.6.1 (the Rust runtime, frontend, router) and the
#      Python dependencies of ai-dynamo's modules;
#   2. ai-dynamo 1.6.1 with --no-deps: its `aisimulate` dependency is a placeholder that downloads the real wheel
#      from a host outside the package index (it serves only Dynamo's planner, which we do not use); pip extras
#      cannot say --no-deps, hence this script;
#   3. NIXL 1.5.1 (nixl + nixl-cu12, with UCX bundled) with --no-deps, for prefill/decode disaggregation (the request's
#      state moves between workers by NIXL READs of host memory): nixl pulls both CUDA variants and nixl-cu12
#      declares torch, neither of which the transfer of host memory needs (its only other dependency, numpy, is ours).
#
# No torch, CUDA or etcd / NATS: the frontend and workers run with --discovery-backend file, the tcp request
# plane and the zmq event plane. Measured on a 2-core CPU machine, fresh venv: ~80 s, ~680 MB.
set -euo pipefail
PY=${PYTHON:-python}
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
"$PY" -m pip install -q -e "$ROOT[dynamo]"
"$PY" -m pip install -q --no-deps ai-dynamo==1.6.1
"$PY" -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
"$PY" -c "import dynamo.frontend, dynamo.common.backend, dynamo.llm, nixl._api; from importlib.metadata import version; print('NVIDIA Dynamo', version('ai-dynamo'), '+ NIXL', version('nixl'), 'installed')"
