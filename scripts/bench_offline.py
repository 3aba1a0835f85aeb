#!/usr/bin/env python
"""Offline throughput of the engine at several batch sizes.

    python scripts/bench_offline.py --model tiny --batch-sizes 1,2,4,8,16,32,64 \\
        --input-len 32 --output-len 32 --out bench.json --plot bench.png [engine flags]

One engine is built with ``--max-running-requests`` = the largest batch size (every bucket is
compiled in its warm-up, which is timed); then, per batch size b, b random prompts of
``--input-len`` tokens are generated greedily to exactly ``--output-len`` tokens (ignore_eos)
through the scheduler, ``--repeats`` times (the best run is kept). Reported per batch size:

* prefill tok/s: prompt tokens / time until every request had its first token;
* decode tok/s: tokens generated after the first / the remaining time;
* total tok/s: (prompt + generated tokens) / wall time; output tok/s: generated tokens / wall time;
* mean step time of the decode-only iterations (with the overlap schedule this is the device time
  of a step plus whatever host work is not hidden);
* and, once: the warm-up (compile) time and the number of compilations, plus how many happened
  during the measured runs (0 when the buckets cover everything);
* with ``--speculative-algorithm DSPARK``: the DSpark accept length (tokens committed per row-step,
  1 + accepted drafts) and accept rate of each batch size's run.

The JSON holds every number; the PNG plots decode / prefill tok/s and step time against b. The
summary line reports decode throughput at 16 over that at 1 when both were measured.

``--compare-deterministic``: after the runs above (with the engine flags as given, deterministic mode
off), a second engine with ``--enable-deterministic-inference`` runs the same batch sizes with the same
prompts in the same process, and the JSON's ``deterministic`` block holds its results and, per batch
size, its cost: decode tok/s and decode step time relative to the first engine's.

    python scripts/bench_offline.py --model tiny --batch-sizes 1,16,64 --compare-deterministic --out det.json
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


def _ints(s: str) -> list:
    return [int(x) for x in s.replace(",", " ").split()]


def pool_tokens(batch: int, input_len: int, output_len: int, page_size: int) -> int:
    """KV pool (``--max-total-tokens``) that admits `batch` requests at once, so the largest batch runs
    as one cohort (decode steps = output_len - 1). A pool of exactly ``batch`` x the pages of one request
    admitted one request fewer after the previous batch size's run (a page stayed held) and ran the last
    one as a second cohort, doubling the measured steps. So: each request's pages, one page of slack per
    request, and the headroom the scheduler may keep free while admitting (a share, at most all, of what
    the running requests may still generate)."""
    per_request = -(-(input_len + output_len) // page_size)
    headroom = -(-(batch * output_len) // page_size)
    return (batch * (per_request + 1) + headroom) * page_size


def bench_one(llm, b: int, input_len: int, output_len: int, seed: int) -> dict:
    import numpy as np

    from dsv41_jax.serving.sampling import SamplingParams

    eng = llm.engine
    rng = np.random.default_rng(seed + b)
    V = min(eng.vocab_size, eng.tokenizer.vocab_size)
    prompts = [rng.integers(3, V, size=input_len).tolist() for _ in range(b)]
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rids = [f"bench-{b}-{i}-{time.monotonic_ns()}" for i in range(b)]
    t0 = time.perf_counter()
    for r, p in zip(rids, prompts):
        eng.add_request(r, p, sp, output_kind="final")
    seqs = [s for r in rids for s in eng.output.groups[r].seqs]
    m0 = eng.metrics.snapshot()
    n_first = None
    decode_steps = []
    outs = []
    while eng.has_unfinished():
        ts = time.perf_counter()
        outs += eng.step()
        te = time.perf_counter()
        info = eng.last_step
        if info.get("decode_rows") and not info.get("prefill_tokens"):
            decode_steps.append(te - ts)
        if n_first is None and all(s.first_token_time is not None for s in seqs):
            n_first = te
    t1 = time.perf_counter()
    steps = eng.metrics["spec_verify_steps"] - m0["spec_verify_steps"]
    acc = eng.metrics["spec_accepted_tokens"] - m0["spec_accepted_tokens"]
    drafts = eng.metrics["spec_draft_tokens"] - m0["spec_draft_tokens"]
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == b * output_len, (gen, b * output_len)
    t_first = (n_first or t1) - t0
    wall = t1 - t0
    dec_time = max(wall - t_first, 1e-9)
    return {
        "batch_size": b, "wall_s": wall, "time_to_all_first_tokens_s": t_first,
        "prefill_tok_s": b * input_len / t_first if t_first > 0 else None,
        "decode_tok_s": b * (output_len - 1) / dec_time if output_len > 1 else None,
        "output_tok_s": gen / wall, "total_tok_s": (gen + b * input_len) / wall,
        "mean_decode_step_ms": 1000 * float(np.mean(decode_steps)) if decode_steps else None,
        "decode_steps": len(decode_steps),
        "spec_accept_length": (1.0 + acc / steps) if steps else None,
        "spec_accept_rate": (acc / drafts) if drafts else None,
    }


def plot(results: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [r["batch_size"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for key, label in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                       ("output_tok_s", "output tok/s (end to end)")):
        ys = [r[key] for r in results]
        if any(y is not None for y in ys):
            ax.plot(bs, [y or float("nan") for y in ys], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax = axes[1]
    ax.plot(bs, [r["mean_decode_step_ms"] or float("nan") for r in results], marker="o", color="C3")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step (ms)")
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _measure(args, ns):
    """Build one engine (`LLM`) from `args` and run every batch size: (llm, build_s, compilations, results)."""
    from dsv41_jax.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(**vars(args))
    build_s = time.perf_counter() - t0
    n_comp = llm.engine.num_compilations()
    results = []
    for b in ns.batch_sizes:
        best = None
        for rep in range(max(1, ns.repeats)):
            r = bench_one(llm, b, ns.input_len, ns.output_len, args.random_seed + 1000 * rep)
            if best is None or r["wall_s"] < best["wall_s"]:
                best = r
        results.append(best)
        logging.info("batch %3d: decode %.1f tok/s, prefill %.1f tok/s, output %.1f tok/s, decode step %.2f ms%s",
                     b, best["decode_tok_s"] or 0, best["prefill_tok_s"] or 0, best["output_tok_s"],
                     best["mean_decode_step_ms"] or 0,
                     "" if best["spec_accept_length"] is None else
                     f", accept length {best['spec_accept_length']:.2f} (rate {best['spec_accept_rate']:.2f})")
    return llm, build_s, n_comp, results


def main(argv=None) -> dict:
    from dsv41_jax.serving.engine_args import EngineArgs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64],
                    help="batch sizes to measure (default 1,2,4,8,16,32,64)")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    ap.add_argument("--output-len", type=int, default=32, help="generated tokens per request (default 32)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per batch size; the fastest is kept (default 1)")
    ap.add_argument("--out", default="bench_offline.json", help="JSON output path")
    ap.add_argument("--plot", default=None, help="PNG plot path (default: the JSON path with .png)")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    ap.add_argument("--compare-deterministic", action="store_true",
                    help="also run the batch sizes with --enable-deterministic-inference and report its cost")
    EngineArgs.add_cli_args(ap)
    ap.set_defaults(max_running_requests=None, chunked_prefill_size=None, context_length=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bmax = max(ns.batch_sizes)
    if ns.max_running_requests is None:
        ns.max_running_requests = bmax
    if ns.chunked_prefill_size is None:
        ns.chunked_prefill_size = min(512, max(16, 1 << (ns.input_len - 1).bit_length()))
    if ns.context_length is None:
        ns.context_length = ns.input_len + ns.output_len
    if ns.max_total_tokens is None and ns.mem_fraction_static is None:
        ns.max_total_tokens = pool_tokens(bmax, ns.input_len, ns.output_len, ns.page_size)
    args = EngineArgs.from_cli_args(ns)
    if bmax > args.max_running_requests:
        ap.error(f"--batch-sizes up to {bmax} need --max-running-requests >= {bmax}")

    import jax

    if args.enable_deterministic_inference and ns.compare_deterministic:
        ap.error("--compare-deterministic compares against the engine flags as given: drop "
                 "--enable-deterministic-inference")
    llm, build_s, n_comp, results = _measure(args, ns)
    eng = llm.engine
    by_b = {r["batch_size"]: r for r in results}
    scaling = None
    if 1 in by_b and 16 in by_b and by_b[1]["decode_tok_s"]:
        scaling = by_b[16]["decode_tok_s"] / by_b[1]["decode_tok_s"]
    dev = jax.devices()[0]
    report = {
        "model": args.model, "device": f"{dev.platform}:{dev.device_kind}", "host": platform.node(),
        "cpu_count": os.cpu_count(), "input_len": ns.input_len, "output_len": ns.output_len,
        "engine_args": vars(args),
        "batch_buckets": eng.batch_buckets, "token_buckets": eng.token_buckets,
        "build_s": build_s, "compile_time_s": eng.warmup_time, "warmup_shapes": eng.warmup_shapes,
        "num_compilations": n_comp, "compilations_during_runs": eng.num_compilations() - n_comp,
        "decode_scaling_16_over_1": scaling, "results": results,
    }
    if ns.compare_deterministic:
        del llm, eng
        dargs = args.replace(enable_deterministic_inference=True)
        dllm, dbuild_s, _, dres = _measure(dargs, ns)
        cost = {}
        for r, d in zip(results, dres):
            c = cost[r["batch_size"]] = {
                "decode_tok_s_ratio": (d["decode_tok_s"] / r["decode_tok_s"]) if r["decode_tok_s"] else None,
                "decode_step_ms_ratio": (d["mean_decode_step_ms"] / r["mean_decode_step_ms"])
                if r["mean_decode_step_ms"] else None}
            logging.info("batch %3d: deterministic decode %.1f tok/s vs %.1f (x%.2f), step %.2f ms vs %.2f ms",
                         r["batch_size"], d["decode_tok_s"] or 0, r["decode_tok_s"] or 0,
                         c["decode_tok_s_ratio"] or 0, d["mean_decode_step_ms"] or 0, r["mean_decode_step_ms"] or 0)
        report["deterministic"] = {"build_s": dbuild_s, "compile_time_s": dllm.engine.warmup_time,
                                   "results": dres, "cost": cost}
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=2)
    png = ns.plot or os.path.splitext(ns.out)[0] + ".png"
    plot(results, png, f"{args.model} ({report['device']}, dtype {args.dtype}), in {ns.input_len} / out "
                       f"{ns.output_len}")
    msg = f"wrote {ns.out} and {png}; compile {report['compile_time_s']:.1f}s ({n_comp} compilations, " \
          f"{report['compilations_during_runs']} during runs)"
    if scaling is not None:
        msg += f"; decode throughput at 16 / at 1 = {scaling:.2f}x"
    print(msg)
    return report


if __name__ == "__main__":
    main()
