#!/usr/bin/env python
"""Multi-turn chat against an OpenAI-compatible server: TTFT of cached turns vs cold, and hit rate.

Each of ``--conversations`` conversations shares one long system prompt (``--system-words`` random
words) and runs ``--turns`` turns: turn t sends the whole history (system, user 1, assistant 1, …,
user t) as a streaming chat request, one request at a time (TTFT is then the server's own prefill +
first step, not queueing). After every turn ≥ 2 the same messages are sent again with a fresh
random word in front of the system prompt — same length, no reusable prefix — as the *cold*
control, in the same run and server state. Reported:

* TTFT (request sent → first streamed chunk with text) per turn, cached vs cold, median over
  conversations; their ratio;
* ``usage.prompt_tokens_details.cached_tokens`` per request (the server's own count) and the hit
  rate = cached / prompt tokens over the cached turns, plus the server's ``dsv41:cache_hit_rate``
  gauge when ``/metrics`` is on;
* the first turns' cached tokens: conversations after the first share only the system prompt with
  what came before (the second resumes from the first's last prefill chunk end inside it and makes a
  branch point at its last page boundary; the later ones resume from that);
* generated tokens per second over the whole run.

Run it against a server with the cache on (the default) and, for the "off" numbers, one started with
``--disable-radix-cache`` (``--label off``): the cold control then equals the cached turns. Writes a
JSON report and a PNG plot (TTFT per turn)::

    python -m dsv41_jax.serve --model tiny --port 30000 &
    python scripts/bench_multiturn.py --base-url http://127.0.0.1:30000 --output-json mt.json --output-png mt.png

Several servers in one run: repeat ``--base-url`` (and ``--label``, one per server); the same workload
(same seed) runs against each in turn and the report compares their hit rates. E.g. data-parallel
attention's routing, the cache-aware default against round robin::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m dsv41_jax.serve --model tiny --port 30001 \
        --enable-dp-attention --dp-size 4 &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m dsv41_jax.serve --model tiny --port 30002 \
        --enable-dp-attention --dp-size 4 --load-balance-method round_robin &
    python scripts/bench_multiturn.py --base-url http://127.0.0.1:30001 --label cache_aware \
        --base-url http://127.0.0.1:30002 --label round_robin --output-json mt_dp.json

The JSON keeps the first server's ``summary`` and ``records`` at the top, the others under ``compare``,
and ``hit_rates`` {label: hit rate of the cached turns} for all.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import httpx


def _words(rng: random.Random, n: int) -> str:
    vocab = ["alpha", "river", "stone", "cloud", "market", "signal", "garden", "engine", "paper", "window",
             "orange", "silver", "forest", "bridge", "planet", "music", "number", "yellow", "castle", "ocean"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def chat_once(client: httpx.Client, model: str, messages: list, max_tokens: int) -> dict:
    """One streaming chat request: TTFT, text, usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            for c in d.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") or (c.get("delta") or {}).get("reasoning_content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    e2e = time.perf_counter() - t0
    usage = usage or {}
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def scrape_hit_rate(client: httpx.Client):
    try:
        r = client.get("/metrics")
        for line in r.text.splitlines():
            if line.startswith("dsv41:cache_hit_rate "):
                return float(line.split()[-1])
    except httpx.HTTPError:
        pass
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", action="append", default=None,
                    help="server URL (default http://127.0.0.1:30000); repeat to run the workload against several")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=300, help="words of the shared system prompt")
    ap.add_argument("--user-words", type=int, default=20, help="words of each user message")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", action="append", default=None,
                    help="a name for the server setting in the report (default 'on'); one per --base-url")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--output-png", default=None)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    if a.conversations < 1 or a.turns < 2:
        ap.error("need --conversations >= 1 and --turns >= 2 (turn 1 is always cold)")
    urls = a.base_url or ["http://127.0.0.1:30000"]
    labels = a.label or (["on"] if len(urls) == 1 else [f"server{i}" for i in range(len(urls))])
    if len(labels) != len(urls):
        ap.error(f"give one --label per --base-url ({len(urls)} URLs, {len(labels)} labels)")
    runs = [_run(a, url, label) for url, label in zip(urls, labels)]
    summary, records = runs[0]
    hit_rates = {s["label"]: s["hit_rate_cached_turns"] for s, _ in runs}
    if len(runs) > 1:
        print(json.dumps({"hit_rates": hit_rates}, indent=1))
    if a.output_json:
        out = {"args": vars(a), "summary": summary, "records": records, "hit_rates": hit_rates}
        if len(runs) > 1:
            out["compare"] = [{"summary": s, "records": r} for s, r in runs[1:]]
        with open(a.output_json, "w") as f:
            json.dump(out, f, indent=1)
    if a.output_png:
        _plot(summary, a.output_png)
    return 0


def _run(a, base_url: str, label: str) -> tuple:
    """The workload (seeded by --seed: the same for every server) against one server: (summary, records)."""
    rng = random.Random(a.seed)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    system = _words(rng, a.system_words)
    convs = [[{"role": "system", "content": system}] for _ in range(a.conversations)]
    records = []
    t_start = time.perf_counter()
    gen_tokens = 0
    with httpx.Client(base_url=base_url, headers=headers, timeout=a.timeout) as client:
        for t in range(1, a.turns + 1):
            for i, msgs in enumerate(convs):
                msgs.append({"role": "user", "content": _words(rng, a.user_words)})
                res = chat_once(client, a.model, msgs, a.max_tokens)
                records.append({"conversation": i, "turn": t, "kind": "cached" if t > 1 else "first", **res})
                gen_tokens += res["completion_tokens"] or 0
                msgs.append({"role": "assistant", "content": res["text"]})
                if t > 1:  # cold control: same length, no reusable prefix
                    cold_msgs = [dict(m) for m in msgs[:-1]]
                    cold_msgs[0]["content"] = f"{rng.randrange(10**9)} " + cold_msgs[0]["content"]
                    res_c = chat_once(client, a.model, cold_msgs, a.max_tokens)
                    records.append({"conversation": i, "turn": t, "kind": "cold", **res_c})
                    gen_tokens += res_c["completion_tokens"] or 0
                print(f"[{label}] turn {t} conv {i}: ttft {res['ttft_s'] * 1e3:.1f} ms, cached {res['cached_tokens']}"
                      f"/{res['prompt_tokens']}" + (f"; cold control {res_c['ttft_s'] * 1e3:.1f} ms" if t > 1 else ""),
                      file=sys.stderr)
        server_hit_rate = scrape_hit_rate(client)
    wall = time.perf_counter() - t_start

    def med(kind, turn=None):
        xs = [r["ttft_s"] for r in records if r["kind"] == kind and (turn is None or r["turn"] == turn)]
        return statistics.median(xs) if xs else None

    firsts = [r for r in records if r["kind"] == "first"]
    cached = [r for r in records if r["kind"] == "cached"]
    ptoks = sum(r["prompt_tokens"] or 0 for r in cached)
    ctoks = sum(r["cached_tokens"] or 0 for r in cached)
    per_turn = [{"turn": t, "ttft_cached_s": med("cached", t) if t > 1 else med("first", 1),
                 "ttft_cold_s": med("cold", t) if t > 1 else med("first", 1)} for t in range(1, a.turns + 1)]
    summary = {"label": label, "conversations": a.conversations, "turns": a.turns,
               "ttft_first_turn_median_s": med("first"), "ttft_cached_median_s": med("cached"),
               "ttft_cold_median_s": med("cold"),
               "ttft_cold_over_cached": (med("cold") / med("cached")) if med("cached") else None,
               "hit_rate_cached_turns": (ctoks / ptoks) if ptoks else None,
               "first_turn_cached_tokens": [r["cached_tokens"] for r in firsts],
               "first_turn_prompt_tokens": [r["prompt_tokens"] for r in firsts],
               "first_turn_ttft_s": [r["ttft_s"] for r in firsts], "server_cache_hit_rate": server_hit_rate,
               "gen_tokens_per_s": gen_tokens / wall, "wall_s": wall, "per_turn": per_turn}
    print(json.dumps({k: v for k, v in summary.items() if k != "per_turn"}, indent=1))
    return summary, records


def _plot(summary: dict, path: str) -> None:
    """TTFT per turn, cached vs cold (the first server's run)."""
    per_turn = summary["per_turn"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    turns = [p["turn"] for p in per_turn]
    ax.plot(turns, [p["ttft_cold_s"] * 1e3 for p in per_turn], "o-", label="cold (no reusable prefix)")
    ax.plot(turns, [p["ttft_cached_s"] * 1e3 for p in per_turn], "s-", label=f"cached (cache {summary['label']})")
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (ms)")
    hr = summary["hit_rate_cached_turns"]
    ax.set_title(f"multi-turn TTFT, hit rate {hr:.2f}" if hr is not None else "multi-turn TTFT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
