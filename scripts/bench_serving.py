#!/usr/bin/env python
"""Load generator for any OpenAI-compatible endpoint (ours, SGLang, vLLM, …).

Sends streaming requests at a fixed concurrency (or a sweep of them) and reports, per level:
TTFT, TPOT and ITL (mean / median / p99, in ms), end-to-end latency, request throughput and
input / output / total token throughput. Writes a JSON report and a PNG plot.

Examples::

    python -m dsv41_jax.serve --port 30000 &
    python scripts/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 32 \\
        --concurrency 1,2,4,8 --random-input-len 64 --random-output-len 32 \\
        --output-json bench.json --output-png bench.png

    # chat endpoint, prompts from a file (jsonl with "prompt" or "messages", or plain text lines)
    python scripts/bench_serving.py --endpoint chat --dataset file --dataset-path prompts.jsonl

Definitions (as SGLang's / vLLM's serving benchmarks):

* TTFT: request sent -> first streamed chunk carrying generated text;
* ITL: time between consecutive text-carrying chunks (a chunk may carry several tokens);
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request (requests with > 1 output token);
* output tokens come from the stream's ``usage`` (``stream_options.include_usage``) when the
  server reports it, else the number of text chunks;
* throughputs are totals over the level's wall time (first send to last completion);
* accept length (speculative decoding, e.g. ours with ``--speculative-algorithm DSPARK``): tokens
  committed per verify row-step over the level, from the server's Prometheus counters scraped before
  and after it (``dsv41:spec_verify_steps_total`` / ``dsv41:spec_accepted_tokens_total``, or SGLang's
  ``sglang:spec_accept_length`` gauge); absent when the server exports neither.

Random prompts: with ``--tokenizer`` (``tiny`` or a model directory / tokenizer.json) each prompt
is decoded from ``--random-input-len`` random token ids (exact lengths for /v1/completions, which
then receives token ids); without it, random words of that count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from dsv41_jax.serving.engine_args import HelpFormatter

import httpx

WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be or had not "
         "but one have first new they after their who two its also time may into other only year world city "
         "state river music game team school war during between under known where while people part family "
         "water house light market number small great early north south model system data value token cache "
         "graph matrix vector layer attention expert router memory window page batch query key decode").split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    status: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = field(default_factory=list)
    text_len: int = 0


# ------------------------------------------------------------------------------------ prompts


def _load_tokenizer(spec: Optional[str]):
    if not spec:
        return None
    try:
        from dsv41_jax.serving.tokenizer import load_tokenizer
        return load_tokenizer(spec)
    except Exception:  # not installed / not our tokenizer: plain HF tokenizers
        from tokenizers import Tokenizer
        path = spec if spec.endswith(".json") else os.path.join(spec, "tokenizer.json")
        return Tokenizer.from_file(path)


def random_prompts(n: int, input_len: int, range_ratio: float, seed: int, tokenizer=None) -> list:
    """``n`` prompts; lengths uniform in [input_len * range_ratio, input_len]."""
    rng = random.Random(seed)
    out = []
    lo = max(1, int(input_len * range_ratio))
    for _ in range(n):
        k = rng.randint(lo, max(lo, input_len))
        if tokenizer is not None:
            special = set(getattr(tokenizer, "special_token_ids", ()) or ())
            vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else tokenizer.get_vocab_size()
            ids = []
            while len(ids) < k:
                t = rng.randrange(vocab)
                if t not in special and t > 2:
                    ids.append(t)
            out.append({"ids": ids})
        else:
            out.append({"text": " ".join(rng.choice(WORDS) for _ in range(k))})
    return out


def file_prompts(path: str, n: int, seed: int) -> list:
    items = []
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            for line in f:
                line = line.strip()
                if not line:
                    continue
                d = json.loads(line)
                if "messages" in d:
                    items.append({"messages": d["messages"]})
                elif "prompt" in d:
                    items.append({"text": d["prompt"]})
                elif "text" in d:
                    items.append({"text": d["text"]})
                elif "conversations" in d:  # ShareGPT
                    conv = d["conversations"]
                    if conv:
                        items.append({"text": conv[0].get("value", "")})
        elif path.endswith(".json"):
            data = json.load(f)
            for d in data:
                if isinstance(d, str):
                    items.append({"text": d})
                elif isinstance(d, dict) and "conversations" in d and d["conversations"]:
                    items.append({"text": d["conversations"][0].get("value", "")})
                elif isinstance(d, dict) and "prompt" in d:
                    items.append({"text": d["prompt"]})
        else:
            items = [{"text": line.rstrip("\n")} for line in f if line.strip()]
    if not items:
        raise SystemExit(f"{path}: no prompts found")
    rng = random.Random(seed)
    return [items[i % len(items)] if n <= len(items) else rng.choice(items) for i in range(n)]


# -------------------------------------------------------------------------------------- client


def _payload(item: dict, args, tokenizer) -> tuple[str, dict]:
    common: dict[str, Any] = {"model": args.model, "max_tokens": args.output_len, "stream": True,
                              "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        common["ignore_eos"] = True
    if args.top_p is not None:
        common["top_p"] = args.top_p
    if args.extra_body:
        common.update(json.loads(args.extra_body))
    if args.endpoint == "chat":
        if "messages" in item:
            msgs = item["messages"]
        else:
            text = item.get("text")
            if text is None:
                text = tokenizer.decode(item["ids"]) if tokenizer is not None else ""
            msgs = [{"role": "user", "content": text}]
        return "/v1/chat/completions", dict(common, messages=msgs)
    if "ids" in item and not args.text_prompts:
        prompt: Any = item["ids"]
    elif "ids" in item:
        prompt = tokenizer.decode(item["ids"])
    elif "messages" in item:
        prompt = "\n".join(str(m.get("content", "")) for m in item["messages"])
    else:
        prompt = item["text"]
    return "/v1/completions", dict(common, prompt=prompt)


def _chunk_text(d: dict) -> str:
    out = []
    for c in d.get("choices") or []:
        if "text" in c and c["text"]:
            out.append(c["text"])
        delta = c.get("delta") or {}
        for k in ("content", "reasoning_content"):
            if delta.get(k):
                out.append(delta[k])
        if delta.get("tool_calls"):
            out.append(json.dumps(delta["tool_calls"]))
    return "".join(out)


async def send_one(client: httpx.AsyncClient, url: str, payload: dict, headers: dict, timeout: float) -> RequestResult:
    r = RequestResult()
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers, timeout=timeout) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {body[:300]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    r.error = json.dumps(d["error"])[:300]
                    return r
                now = time.perf_counter()
                text = _chunk_text(d)
                if text:
                    chunks += 1
                    r.text_len += len(text)
                    if last is None:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
                u = d.get("usage")
                if u:
                    r.prompt_tokens = int(u.get("prompt_tokens") or 0)
                    r.output_tokens = int(u.get("completion_tokens") or 0)
        r.latency = time.perf_counter() - start
        if not r.output_tokens:
            r.output_tokens = chunks
        if last is None:
            r.ttft = r.latency
        r.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
        r.latency = time.perf_counter() - start
    return r


def _stats(xs: list, scale: float = 1000.0) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None, "std": None}
    s = sorted(xs)
    k = (len(s) - 1) * 0.99
    f, c = math.floor(k), math.ceil(k)
    p99 = s[f] if f == c else s[f] + (s[c] - s[f]) * (k - f)
    return {"mean": statistics.fmean(s) * scale, "median": statistics.median(s) * scale, "p99": p99 * scale,
            "std": (statistics.pstdev(s) * scale) if len(s) > 1 else 0.0}


def summarize(results: list, wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    wall = max(wall, 1e-9)
    return {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / wall,
        "input_throughput": in_tok / wall,
        "output_throughput": out_tok / wall,
        "total_token_throughput": (in_tok + out_tok) / wall,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
    }


async def run_level(base_url: str, items: list, args, tokenizer, concurrency: int) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    results: list = []
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=args.timeout) as client:
        async def task(item):
            async with sem:
                path, payload = _payload(item, args, tokenizer)
                results.append(await send_one(client, path, payload, headers, args.timeout))

        start = time.perf_counter()
        await asyncio.gather(*(task(it) for it in items))
        wall = time.perf_counter() - start
    return summarize(results, wall, concurrency)


_SPEC_SERIES = ("dsv41:spec_verify_steps_total", "dsv41:spec_accepted_tokens_total", "dsv41:spec_draft_tokens_total",
                "sglang:spec_accept_length")


def scrape_spec(base_url: str, api_key: Optional[str], timeout: float) -> dict:
    """The speculative-decoding series of the server's /metrics ({} when unreachable or absent)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout)
        if r.status_code != 200:
            return {}
    except httpx.HTTPError:
        return {}
    out = {}
    for line in r.text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in _SPEC_SERIES:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                pass
    return out


def accept_length(before: dict, after: dict) -> dict:
    """Accept length / rate over a level from two scrapes (None when the server has no such series)."""
    k_steps, k_acc, k_draft = _SPEC_SERIES[:3]
    if k_steps in after:
        steps = after[k_steps] - before.get(k_steps, 0.0)
        acc = after.get(k_acc, 0.0) - before.get(k_acc, 0.0)
        drafts = after.get(k_draft, 0.0) - before.get(k_draft, 0.0)
        return {"spec_accept_length": (1.0 + acc / steps) if steps else None,
                "spec_accept_rate": (acc / drafts) if drafts else None, "spec_verify_steps": steps}
    if _SPEC_SERIES[3] in after:  # SGLang: a gauge of the recent accept length
        return {"spec_accept_length": after[_SPEC_SERIES[3]], "spec_accept_rate": None, "spec_verify_steps": None}
    return {"spec_accept_length": None, "spec_accept_rate": None, "spec_verify_steps": None}


def discover_model(base_url: str, api_key: Optional[str], timeout: float) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise SystemExit("the endpoint lists no models; pass --model")
    return data[0]["id"]


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["levels"]
    cs = [lv["concurrency"] for lv in levels]

    def col(key, stat="median"):
        return [lv[key][stat] if lv[key][stat] is not None else float("nan") for lv in levels]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(cs, [lv["output_throughput"] for lv in levels], "o-", label="output tok/s")
    ax.plot(cs, [lv["total_token_throughput"] for lv in levels], "s--", label="total tok/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("tokens / s")
    ax.set_title("throughput")
    ax.legend()
    ax = axes[1]
    for key, label in (("ttft_ms", "TTFT"), ("e2e_latency_ms", "E2E")):
        ax.plot(cs, col(key), "o-", label=f"{label} median")
        ax.plot(cs, col(key, "p99"), "x:", label=f"{label} p99")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("ms")
    ax.set_title("request latency")
    ax.legend()
    ax = axes[2]
    for key, label in (("tpot_ms", "TPOT"), ("itl_ms", "ITL")):
        ax.plot(cs, col(key), "o-", label=f"{label} median")
        ax.plot(cs, col(key, "p99"), "x:", label=f"{label} p99")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("ms")
    ax.set_title("per-token latency")
    ax.legend()
    for ax in axes:
        if len(cs) > 1 and max(cs) / max(1, min(cs)) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{report['model']} @ {report['base_url']} ({report['endpoint']}, "
                 f"in {report['input_len']} / out {report['output_len']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark an OpenAI-compatible serving endpoint.",
                                formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server URL (without /v1)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key")
    p.add_argument("--dataset", choices=("random", "file"), default="random", help="prompt source")
    p.add_argument("--dataset-path", default=None, help="jsonl ('prompt' / 'messages' / 'text'), ShareGPT json, or text lines")
    p.add_argument("--tokenizer", default=None, help="tokenizer for exact random prompt lengths: 'tiny' or a model dir")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--random-input-len", type=int, default=128, help="random prompt length (tokens or words)")
    p.add_argument("--random-output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="prompt lengths in [ratio*len, len]")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels (the sweep)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=None, help="top_p")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (fixed output lengths; SGLang/vLLM extra)")
    p.add_argument("--text-prompts", action="store_true", help="send random token prompts as text, not token ids")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before the sweep (not measured)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--output-json", default=None, help="write the report here")
    p.add_argument("--output-png", default=None, help="write the plot here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    except ValueError:
        print(f"--concurrency: expected integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    if not levels or any(c < 1 for c in levels):
        print("--concurrency: levels must be >= 1", file=sys.stderr)
        return 2
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if args.model is None:
        args.model = discover_model(base, args.api_key, args.timeout)
    args.output_len = args.random_output_len
    tokenizer = _load_tokenizer(args.tokenizer)
    if args.dataset == "file":
        if not args.dataset_path:
            print("--dataset file needs --dataset-path", file=sys.stderr)
            return 2
        items = file_prompts(args.dataset_path, args.num_prompts, args.seed)
    else:
        items = random_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed, tokenizer)
    if args.warmup:
        asyncio.run(run_level(base, items[: args.warmup], args, tokenizer, 1))
    report = {"base_url": base, "endpoint": args.endpoint, "model": args.model, "dataset": args.dataset,
              "num_prompts": args.num_prompts, "input_len": args.random_input_len, "output_len": args.output_len,
              "levels": []}
    for c in levels:
        before = scrape_spec(base, args.api_key, args.timeout)
        s = asyncio.run(run_level(base, items, args, tokenizer, c))
        s.update(accept_length(before, scrape_spec(base, args.api_key, args.timeout)))
        report["levels"].append(s)
        print(f"concurrency {c:4d}: {s['completed']}/{s['completed'] + s['failed']} ok, "
              f"req/s {s['request_throughput']:.2f}, out tok/s {s['output_throughput']:.1f}, "
              f"TTFT med {_fmt(s['ttft_ms']['median'])} p99 {_fmt(s['ttft_ms']['p99'])} ms, "
              f"TPOT med {_fmt(s['tpot_ms']['median'])} ms, ITL med {_fmt(s['itl_ms']['median'])} "
              f"p99 {_fmt(s['itl_ms']['p99'])} ms"
              + ("" if s["spec_accept_length"] is None else f", accept length {s['spec_accept_length']:.2f}"),
              flush=True)
        if s["failed"]:
            print(f"  errors: {s['errors']}", flush=True)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if args.output_png:
        plot(report, args.output_png)
    failed = sum(lv["failed"] for lv in report["levels"])
    return 1 if failed and not any(lv["completed"] for lv in report["levels"]) else 0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    sys.exit(main())
