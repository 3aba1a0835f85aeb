#!/usr/bin/env python
"""Decode-step time vs. max_context: is retrieval bounded by the live context?

For each case: a jitted one-token decode step (`decode.jitted_extend`, cache donated) of the tiny
model (random weights) at a given live context, with a page table that allows `max_context` tokens and pools of the same size in every case.
With impl "reference" the indexer scores every slot the page table can address (max_context / ratio);
with "xla" it scores only the blocks of slots the rows hold (`indexer._topk_xla`). The claim checked:
at a 64-token context, xla's step with max_context 64K is within 1.3x of the same step with 1K.

The cache is zero-initialised rather than prefilled: step time depends on the context length (the
loop's trip count and the gathers), not on the stored values, and prefilling would compile one more
shape per case. Each case prints a progress line; the JSON report goes to --out (and stdout).

    python scripts/bench_retrieval.py --out /tmp/bench_retrieval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--impls", default="reference,xla", help="comma-separated impls of the attention+indexer ops")
    ap.add_argument("--max-contexts", default="1024,65536", help="comma-separated max_context values (tokens)")
    ap.add_argument("--contexts", default="64", help="comma-separated live contexts (tokens already cached)")
    ap.add_argument("--batch", type=int, default=1, help="rows per step (all at the same context)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--num-pages", type=int, default=0,
                    help="pages per pool, the same in every case (default: what the largest context needs + 1); "
                         "a real server's pool does not grow with max_context")
    ap.add_argument("--act-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--iters", type=int, default=30, help="timed steps per case (after 3 warm-up steps)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--compile-preset", default=None, metavar="PRESET",
                    help="instead of timing steps: trace, lower and compile one decode step of PRESET ('flash' or "
                         "'tiny') from abstract shapes (`param_shapes`, no weights) and report the seconds of each")
    ap.add_argument("--no-compile", action="store_true", help="with --compile-preset: stop after lowering")
    return ap.parse_args(argv)


def compile_case(preset, impl, B, T, page_size, max_context, do_compile=True):
    """Seconds to trace+lower and to compile `extend` (B x T, all_logits=False) from abstract shapes."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import ModelConfig
    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode as dec
    from dsv41_jax.model.params import param_shapes

    cfg = ModelConfig.preset(preset)
    if impl:
        cfg = cfg.replace(impl=impl)
    mps = -(-max_context // page_size)
    ccfg = kvc.CacheConfig(page_size=page_size, num_pages=B * mps + 1, max_slots=B, max_pages_per_seq=mps)
    params = param_shapes(cfg)
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    i32 = jnp.int32
    batch = {"tokens": jax.ShapeDtypeStruct((B, T), i32), "start": jax.ShapeDtypeStruct((B,), i32),
             "n_new": jax.ShapeDtypeStruct((B,), i32), "slot": jax.ShapeDtypeStruct((B,), i32),
             "page_table": jax.ShapeDtypeStruct((B, mps), i32)}
    fn = jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, ccfg), donate_argnums=(1,))
    t0 = time.perf_counter()
    lowered = fn.lower(params, state, batch)
    t_lower = time.perf_counter() - t0
    n_lines = lowered.as_text().count("\n")
    out = {"preset": preset, "impl": cfg.impl, "B": B, "T": T, "max_context": max_context,
           "trace_lower_s": round(t_lower, 2), "stablehlo_lines": n_lines}
    if do_compile:
        t0 = time.perf_counter()
        lowered.compile()
        out["compile_s"] = round(time.perf_counter() - t0, 2)
    return out


def run_case(params, cfg, impl, max_context, context, B, page_size, num_pages, iters):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode as dec

    mps = -(-max_context // page_size)
    ccfg = kvc.CacheConfig(page_size=page_size, num_pages=num_pages, max_slots=B, max_pages_per_seq=mps)
    c = cfg.replace(impl=f"xla,attention={impl},indexer={impl}")
    st = kvc.init_cache(c, ccfg)
    need = -(-(context + 1) // page_size)
    pt = np.zeros((B, mps), np.int32)
    for b in range(B):
        pt[b, :need] = 1 + b * need + np.arange(need)
    batch = {"tokens": jnp.full((B, 1), 7, jnp.int32), "start": jnp.full((B,), context, jnp.int32),
             "n_new": jnp.ones((B,), jnp.int32), "slot": jnp.arange(B, dtype=jnp.int32),
             "page_table": jnp.asarray(pt)}
    step = dec.jitted_extend(c, ccfg)
    t0 = time.perf_counter()
    lg, st = step(params, st, batch)
    jax.block_until_ready(lg)
    first = time.perf_counter() - t0
    for _ in range(2):
        lg, st = step(params, st, batch)
    jax.block_until_ready(lg)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        lg, st = step(params, st, batch)
        jax.block_until_ready(lg)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"impl": impl, "max_context": max_context, "context": context, "batch": B, "num_pages": num_pages,
            "first_call_s": round(first, 3), "median_ms": round(1e3 * statistics.median(times), 3),
            "p10_ms": round(1e3 * times[len(times) // 10], 3), "p90_ms": round(1e3 * times[(9 * len(times)) // 10], 3),
            "iters": iters}


def main(argv=None):
    args = parse_args(argv)
    import jax

    if args.compile_preset:
        impls = [None] if args.impls == "-" else args.impls.split(",")
        res = []
        for impl in impls:
            r = compile_case(args.compile_preset, impl, args.batch, 1, args.page_size,
                             int(args.max_contexts.split(",")[0]), not args.no_compile)
            print(f"[bench_retrieval] compile {r}", file=sys.stderr, flush=True)
            res.append(r)
        report = {"bench": "compile", "backend": jax.default_backend(), "jax": jax.__version__, "cases": res}
        text = json.dumps(report, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        print(text)
        return report

    from dsv41_jax.model import ModelConfig, init_params

    cfg = ModelConfig.preset("tiny").replace(act_dtype=args.act_dtype)
    params = init_params(cfg, jax.random.key(0))
    cases = []
    impls = args.impls.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    num_pages = args.num_pages or args.batch * -(-(max(contexts) + 1) // args.page_size) + 1
    for ctx in contexts:
        for mc in (int(x) for x in args.max_contexts.split(",")):
            for impl in impls:
                r = run_case(params, cfg, impl, mc, ctx, args.batch, args.page_size, num_pages, args.iters)
                cases.append(r)
                print(f"[bench_retrieval] impl={impl:9s} max_context={mc:7d} context={ctx:6d} B={args.batch} "
                      f"median {r['median_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, p90 {r['p90_ms']:.2f}; "
                      f"first call {r['first_call_s']:.1f} s)", file=sys.stderr, flush=True)
    ratios = {}
    mcs = sorted({c["max_context"] for c in cases})
    for impl in impls:
        for ctx in sorted({c["context"] for c in cases}):
            row = {c["max_context"]: c["median_ms"] for c in cases if c["impl"] == impl and c["context"] == ctx}
            if len(mcs) >= 2 and mcs[0] in row and mcs[-1] in row:
                ratios[f"{impl}/context={ctx}/max_context {mcs[-1]} vs {mcs[0]}"] = round(row[mcs[-1]] / row[mcs[0]], 3)
    report = {"bench": "retrieval", "model": "tiny (random weights)", "backend": jax.default_backend(),
              "device": str(jax.devices()[0]), "jax": jax.__version__, "act_dtype": args.act_dtype,
              "page_size": args.page_size, "cases": cases, "step_time_ratio": ratios}
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
