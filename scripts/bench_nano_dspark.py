#!/usr/bin/env python
"""DSpark on a trained nano checkpoint through the serving engine: accept length, same greedy output,
decode speed-up.

    python scripts/bench_nano_dspark.py --model runs/nano_dspark/export --n 24 --json bench.json

The same held-out prompts (the synthetic corpus at --seed, rendered with the V4.1 chat encoder as
`LLM.chat` renders them, tool prompts with their tools) are generated greedily (temperature 0, up to
--max-tokens, stopping at EOS) by two engines built from the same checkpoint: plain decoding and
``speculative_algorithm="DSPARK"`` (γ = --gamma, default the checkpoint's dspark_block_size). Per
batch size (--batch-sizes: the prompts are submitted in groups of that many, so at 1 each request
decodes alone) it reports:

* the accept length (tokens committed per row-step, 1 + accepted drafts, SGLang's "accept len", as
  scripts/bench_offline.py reads it from the engine's counters) and accept rate, overall, for the
  text and the tool-calling prompts, and the histogram of accepted drafts per step;
* how many outputs are token for token the plain engine's (and where the first one differs);
* decode tok/s, per request: tokens after each request's first / the time from its first token to
  its end (summed over requests; at batch b > 1 the b requests share each step, so this is the
  speed one request sees), overall and for the text / tool-calling prompts; output tok/s: all
  generated tokens / wall time (the throughput, prefills included); the speed-ups DSpark / plain.

Both engines are built (and compiled: the warm-up is timed) before anything is measured. Writes
every number as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("bench_nano_dspark")


def _ints(s: str) -> list:
    return [int(x) for x in s.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a release-format nano checkpoint directory with trained "
                    "DSpark stages (scripts/train_nano_dspark.py --export DIR)")
    ap.add_argument("--n", type=int, default=24, help="held-out prompts per thinking mode (default 24)")
    ap.add_argument("--seed", type=int, default=1000, help="held-out data seed (default 1000)")
    ap.add_argument("--kinds", default=None, help="comma-separated task kinds (default all)")
    ap.add_argument("--modes", default="off,on", help="thinking modes: off, on or off,on (default)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generation limit per prompt (default 64)")
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 4], help="batch sizes to measure (default 1,4)")
    ap.add_argument("--gamma", type=int, default=None,
                    help="DSpark proposals per step (default the checkpoint's block)")
    ap.add_argument("--dtype", default="auto", help="engine activation dtype: auto (bf16), float32 or exact "
                    "(default auto)")
    ap.add_argument("--json", default=None, help="write the report here")
    return ap


def _prompts(tok, kinds, n: int, seed: int, modes) -> list:
    from dsv41_jax.training import data

    out = []
    for mode in modes:
        for i in range(n):
            ex = data.make_example(seed, i, kinds=kinds, thinking=mode == "on")
            out.append({"kind": ex.kind, "thinking": mode, "ids": tok.encode(ex.prompt)})
    return out


def _run(llm, prompts: list, b: int, max_tokens: int) -> dict:
    """Generate every prompt in groups of `b`; per-prompt outputs and metrics, wall time, DSpark counters."""
    from dsv41_jax.serving.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    eng = llm.engine
    m0 = eng.metrics.snapshot()
    hist0 = list(getattr(eng.output, "spec_hist", []) or [])
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), b):
        outs += llm.generate([p["ids"] for p in prompts[i: i + b]], sp)
    wall = time.perf_counter() - t0
    steps = eng.metrics["spec_verify_steps"] - m0["spec_verify_steps"]
    acc = eng.metrics["spec_accepted_tokens"] - m0["spec_accepted_tokens"]
    drafts = eng.metrics["spec_draft_tokens"] - m0["spec_draft_tokens"]
    hist = list(getattr(eng.output, "spec_hist", []) or [])
    rows = []
    for p, o in zip(prompts, outs):
        m = o.metrics
        rows.append({"kind": p["kind"], "thinking": p["thinking"], "tokens": list(o.outputs[0].token_ids),
                     "finish_reason": o.outputs[0].finish_reason, "ttft_s": m.get("ttft_s"), "e2e_s": m.get("e2e_s"),
                     "spec_verify_steps": m.get("spec_verify_steps"),
                     "spec_accepted_tokens": m.get("spec_accepted_tokens")})
    gen = sum(len(r["tokens"]) for r in rows)
    dec_tok = sum(max(0, len(r["tokens"]) - 1) for r in rows)
    dec_s = sum(max(0.0, (r["e2e_s"] or 0) - (r["ttft_s"] or 0)) for r in rows)
    return {"batch_size": b, "wall_s": wall, "generated_tokens": gen, "output_tok_s": gen / wall,
            "decode_tokens": dec_tok, "decode_s": dec_s, "decode_tok_s": dec_tok / dec_s if dec_s > 0 else None,
            "spec_verify_steps": steps, "spec_accept_length": (1.0 + acc / steps) if steps else None,
            "spec_accept_rate": (acc / drafts) if drafts else None,
            "spec_accept_hist": [h - (hist0[j] if j < len(hist0) else 0) for j, h in enumerate(hist)] if hist else None,
            "rows": rows}


def _group(plain_rows, ds_rows, pred) -> dict:
    """Accept length and decode speeds of the requests `pred` selects (e.g. the tool-calling ones)."""
    sel = [i for i, r in enumerate(ds_rows) if pred(r)]

    def dec(rows):
        tok = sum(max(0, len(rows[i]["tokens"]) - 1) for i in sel)
        s = sum(max(0.0, (rows[i]["e2e_s"] or 0) - (rows[i]["ttft_s"] or 0)) for i in sel)
        return tok / s if s > 0 else None

    steps = sum(ds_rows[i]["spec_verify_steps"] or 0 for i in sel)
    acc = sum(ds_rows[i]["spec_accepted_tokens"] or 0 for i in sel)
    p, d = dec(plain_rows), dec(ds_rows)
    return {"requests": len(sel), "mean_tokens": sum(len(ds_rows[i]["tokens"]) for i in sel) / max(1, len(sel)),
            "verify_steps": steps, "accept_length": (1.0 + acc / steps) if steps else None,
            "decode_tok_s_plain": p, "decode_tok_s_dspark": d, "decode_speedup": (d / p) if p and d else None}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    errors = []
    if not modes or any(m not in ("off", "on") for m in modes):
        errors.append(f"--modes must be off, on or off,on, got {args.modes!r}")
    if args.n < 1 or args.max_tokens < 1 or not args.batch_sizes or min(args.batch_sizes) < 1:
        errors.append("--n, --max-tokens and every --batch-sizes value must be >= 1")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        errors.append(f"--model {args.model}: not a checkpoint directory (no config.json)")
    from dsv41_jax.training.data import KINDS

    kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else KINDS
    if any(k not in KINDS for k in kinds):
        errors.append(f"--kinds: unknown {[k for k in kinds if k not in KINDS]}; known: {', '.join(KINDS)}")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import jax

    from dsv41_jax import LLM
    from dsv41_jax.model.config import ModelConfig
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training import data

    cfg = ModelConfig.from_pretrained(args.model)
    gamma = args.gamma or cfg.dspark_block_size
    tok = load_tokenizer(args.model)
    prompts = _prompts(tok, kinds, args.n, args.seed, modes)
    longest = max(len(p["ids"]) for p in prompts)
    ctx = longest + args.max_tokens + gamma + 2
    common = dict(model=args.model, max_running_requests=max(args.batch_sizes), context_length=ctx, dtype=args.dtype)
    engines = {}
    for name, extra in (("plain", {}), ("dspark", {"speculative_algorithm": "DSPARK",
                                                   "speculative_dspark_block_size": gamma})):
        t0 = time.perf_counter()
        llm = LLM(**common, **extra)
        engines[name] = (llm, time.perf_counter() - t0)
        log.info("%s engine built in %.1f s", name, engines[name][1])
    report = {"model": os.path.abspath(args.model), "device": f"{jax.devices()[0].platform}", "host": platform.node(),
              "cpu_count": os.cpu_count(), "seed": args.seed, "kinds": list(kinds), "modes": modes, "n": args.n,
              "max_tokens": args.max_tokens, "gamma": gamma, "dtype": args.dtype, "context_length": ctx,
              "build_s": {k: v[1] for k, v in engines.items()}, "results": []}
    for path in ("nano_run.json", "dspark_run.json"):
        f = os.path.join(args.model, path)
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                report[path.split(".")[0]] = json.load(fh)
    for b in args.batch_sizes:
        runs = {name: _run(llm, prompts, b, args.max_tokens) for name, (llm, _) in engines.items()}
        plain, ds = runs["plain"], runs["dspark"]
        same, first_diff = 0, []
        for a, c in zip(plain["rows"], ds["rows"]):
            if a["tokens"] == c["tokens"]:
                same += 1
            else:
                first_diff.append(next((i for i, (x, y) in enumerate(zip(a["tokens"], c["tokens"])) if x != y),
                                       min(len(a["tokens"]), len(c["tokens"]))))
        res = {"batch_size": b, "identical_outputs": same, "outputs": len(prompts),
               "first_divergence": first_diff,
               "accept_length": ds["spec_accept_length"], "accept_rate": ds["spec_accept_rate"],
               "accept_hist": ds["spec_accept_hist"],
               "text": _group(plain["rows"], ds["rows"], lambda r: r["kind"] not in data.TOOL_KINDS),
               "tool": _group(plain["rows"], ds["rows"], lambda r: r["kind"] in data.TOOL_KINDS),
               "decode_speedup": (ds["decode_tok_s"] / plain["decode_tok_s"])
               if ds["decode_tok_s"] and plain["decode_tok_s"] else None,
               "output_speedup": ds["output_tok_s"] / plain["output_tok_s"],
               "plain": {k: v for k, v in plain.items() if k != "rows"},
               "dspark": {k: v for k, v in ds.items() if k != "rows"},
               "requests": [{"kind": a["kind"], "thinking": a["thinking"], "tokens": len(c["tokens"]),
                             "identical": a["tokens"] == c["tokens"],
                             "decode_s_plain": (a["e2e_s"] or 0) - (a["ttft_s"] or 0),
                             "decode_s_dspark": (c["e2e_s"] or 0) - (c["ttft_s"] or 0),
                             "spec_verify_steps": c["spec_verify_steps"],
                             "spec_accepted_tokens": c["spec_accepted_tokens"]}
                            for a, c in zip(plain["rows"], ds["rows"])]}
        report["results"].append(res)
        print(f"batch {b}: accept length {res['accept_length'] or 0:.2f} (rate {res['accept_rate'] or 0:.2f}; "
              f"text {res['text']['accept_length'] or 0:.2f}, tool {res['tool']['accept_length'] or 0:.2f}), "
              f"identical outputs {same}/{len(prompts)}, "
              f"decode {plain['decode_tok_s'] or 0:.1f} -> {ds['decode_tok_s'] or 0:.1f} tok/s "
              f"(x{res['decode_speedup'] or 0:.2f}), output {plain['output_tok_s']:.1f} -> {ds['output_tok_s']:.1f} "
              f"tok/s (x{res['output_speedup']:.2f}); decode speed-up text x{res['text']['decode_speedup'] or 0:.2f}, "
              f"tool x{res['tool']['decode_speedup'] or 0:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
