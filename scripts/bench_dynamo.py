#!/usr/bin/env python
"""Multi-turn chat through our Dynamo frontend: one worker vs two with KV-aware routing vs two with random routing.

One run, three settings, each measured with scripts/bench_multiturn.py (TTFT of cached turns vs a cold control,
and the hit rate from the ``cached_tokens`` the workers report), each with its own conversations (seed + k):

1. ``1 worker``: the frontend (``--router-mode kv``) and worker0;
2. ``2 workers, kv``: worker1 joins (the KV router sends each turn where its prefix is);
3. ``2 workers, random``: the frontend restarted with ``--router-mode random`` (a turn lands on either worker).

Writes one JSON report (the three summaries and each worker's counters) and prints a table::

    python scripts/bench_dynamo.py --output-json docs/results/bench_dynamo_cpu.json -- --model nano

Needs Dynamo (scripts/install_dynamo.sh). The arguments after -- are the workers' engine flags.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_multiturn  # noqa: E402

from dsv41_jax.dynamo.local import LocalDeployment  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="nano", help="the served model name")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("engine_flags", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    flags = a.engine_flags[1:] if a.engine_flags[:1] == ["--"] else a.engine_flags
    dep = LocalDeployment(log_dir=a.log_dir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the deployment on SIGTERM too (finally below)
    results = {}
    try:
        dep.start_worker("worker0", flags)
        fe_port = _port()
        dep.start_frontend(fe_port, "kv")
        dep.wait_ready(a.model)
        settings = [("1 worker", None), ("2 workers, kv", "worker1"), ("2 workers, random", "random")]
        for k, (label, change) in enumerate(settings):
            if change == "worker1":
                dep.start_worker("worker1", flags)
                dep.wait_ready(a.model)
            elif change == "random":
                dep.stop("frontend")
                dep.start_frontend(fe_port, "random")
                dep.wait_ready(a.model)
            before = {w: dep.stats(w) for w in dep.worker_ports}
            out = os.path.join(dep.log_dir, f"multiturn_{k}.json")
            bench_multiturn.main(["--base-url", dep.frontend_url, "--model", a.model, "--conversations",
                                  str(a.conversations), "--turns", str(a.turns), "--system-words", str(a.system_words),
                                  "--max-tokens", str(a.max_tokens), "--seed", str(a.seed + k), "--label", label,
                                  "--output-json", out])
            with open(out) as f:
                summary = json.load(f)["summary"]
            after = {w: dep.stats(w) for w in dep.worker_ports}
            summary["worker_requests"] = {w: after[w]["requests"] - before.get(w, {}).get("requests", 0) for w in after}
            summary["worker_cached_prompt_tokens"] = {
                w: after[w]["cached_prompt_tokens"] - before.get(w, {}).get("cached_prompt_tokens", 0) for w in after}
            results[label] = summary
    finally:
        dep.stop_all()
    print(f"{'setting':20s} {'hit rate':>9s} {'TTFT cached':>12s} {'TTFT cold':>10s} {'TTFT 1st':>9s}  requests/worker")
    for label, s in results.items():
        print(f"{label:20s} {s['hit_rate_cached_turns']:9.3f} {s['ttft_cached_median_s'] * 1e3:10.1f}ms "
              f"{s['ttft_cold_median_s'] * 1e3:8.1f}ms {s['ttft_first_turn_median_s'] * 1e3:7.1f}ms  "
              f"{s['worker_requests']}")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
