#!/usr/bin/env python
"""SWA bounded replay (--enable-decoder-swa-bounded-replay): prefill speed-up and fidelity, measured in one run.

For each model variant (tiny random weights; "tiny" = 10 layers of which 3 come after the last store
layer S = 6; "tiny_l14" = the same with 4 more ratio-1 consumer layers after S, 7 of 14 late like
flash's 19 of 40; optionally a wider window) two engines are built with the same arguments, one with
the flag and one without (radix cache off in both: the mode refuses it), and:

* **speed**: prefill of a batch of B prompts of length P (chunks of T tokens, the engines' own jitted
  steps: `decode.jitted_extend` plain vs ``late_tail=W``), best of ``--repeats`` after a warm-up, for a
  few P; reported per case with the speed-up full / bounded;
* **fidelity**: ``--prompts`` seeded random prompts (lengths uniform in ``--min-len``..``--max-len``)
  generated greedily for ``--new-tokens`` tokens through both engines (`LLM.generate`, the real serving
  path: scheduler, runner, chunked prefill, decode): fraction of identical sequences, first-token
  agreement and mean first-divergence position (a sequence that never diverges counts ``--new-tokens``);
  with ``--control`` also for prompts no longer than the window (nothing approximated: the rounding floor).

A progress line per case on stderr; JSON to ``--output-json`` (default docs/results/bench_bounded_replay_cpu.json).
The weights are random, so the fidelity numbers say how far bounded replay moves a model's greedy path
off full prefill on this architecture, not how a trained checkpoint's text quality changes.

    PYTHONPATH=. python scripts/bench_bounded_replay.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from dsv41_jax.llm import LLM
from dsv41_jax.model import ModelConfig
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model.params import init_params
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams


def variant(name: str) -> ModelConfig:
    """tiny, or tiny_l<L>[_w<W>]: tiny with ratio-1 consumer layers appended after layer 9 up to L layers
    (all after the last store layer) and sliding window W."""
    cfg = ModelConfig.preset("tiny")
    if name == "tiny":
        return cfg
    parts = dict((p[0], int(p[1:])) for p in name.split("_")[1:])
    L = parts.get("l", cfg.num_hidden_layers)
    extra = L - cfg.num_hidden_layers
    ratios = cfg.compress_ratios[:cfg.num_hidden_layers] + (1,) * extra + cfg.compress_ratios[cfg.num_hidden_layers:]
    return cfg.replace(num_hidden_layers=L, compress_ratios=ratios, sliding_window=parts.get("w", cfg.sliding_window),
                       name=name)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def engine_pair(cfg, params, a):
    kw = dict(model="tiny", page_size=64, context_length=a.context, max_running_requests=a.batch,
              max_total_tokens=a.batch * a.context, chunked_prefill_size=a.chunk, batch_buckets=[a.batch],
              token_buckets=[a.chunk], disable_radix_cache=True, skip_server_warmup=True, random_seed=0)
    on = Engine(EngineArgs(**kw, enable_decoder_swa_bounded_replay=True), cfg=cfg, params=params)
    off = Engine(EngineArgs(**kw), cfg=cfg, params=params)
    return on, off


def time_prefill(eng, P: int, a, rng) -> dict:
    """Best-of-repeats wall time of prefilling B prompts of P tokens, plain vs bounded step (interleaved)."""
    cfg, ccfg = eng.cfg, eng.runner.ccfg
    W = cfg.sliding_window
    steps = {"full": dec.jitted_extend(cfg, ccfg), "bounded": dec.jitted_extend(cfg, ccfg, late_tail=W)}
    prompts = rng.integers(3, 300, size=(a.batch, P)).astype(np.int32)
    pad = int(np.asarray(eng.params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    state = kvc.reset_slots(kvc.init_cache(cfg, ccfg), np.arange(ccfg.max_slots + 1), pad)
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    for b in range(a.batch):
        alloc.ensure(b, P)
    batches = []
    for c0 in range(0, P, a.chunk):
        rows = [{"tokens": prompts[b, c0:c0 + a.chunk].tolist(), "start": c0, "slot": b, "page_table": alloc.pages(b)}
                for b in range(a.batch)]
        hb = dec.pack_rows(rows, a.chunk, a.batch, ccfg)
        batches.append(hb)
    tail_lo = np.full((a.batch,), max(0, P - W), np.int32)
    best = {}
    for rep in range(a.repeats + 1):  # the first round warms (page faults, executable load)
        for kind in ("full", "bounded"):
            st = jax.tree_util.tree_map(lambda x: x.copy(), state)
            jax.block_until_ready(st)
            t0 = time.perf_counter()
            for hb in batches:
                batch = dict(hb, tail_lo=tail_lo) if kind == "bounded" else hb
                logits, st = steps[kind](eng.params, st, batch)
            jax.block_until_ready((logits, st))
            dt = time.perf_counter() - t0
            if rep:
                best[kind] = min(best.get(kind, dt), dt)
    return {"prompt_len": P, "batch": a.batch, "chunk": a.chunk, "chunks": len(batches),
            "full_s": round(best["full"], 4), "bounded_s": round(best["bounded"], 4),
            "speedup": round(best["full"] / best["bounded"], 3)}


def fidelity(on, off, a, rng, min_len=None, max_len=None) -> dict:
    lens = rng.integers(min_len or a.min_len, (max_len or a.max_len) + 1, size=a.prompts)
    prompts = [rng.integers(3, 300, size=int(n)).tolist() for n in lens]
    sp = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    got = [list(o.outputs[0].token_ids) for o in LLM(engine=on).generate(prompts, sp, use_tqdm=False)]
    t_on = time.perf_counter() - t0
    t0 = time.perf_counter()
    want = [list(o.outputs[0].token_ids) for o in LLM(engine=off).generate(prompts, sp, use_tqdm=False)]
    t_off = time.perf_counter() - t0
    first_div = []
    for g, w in zip(got, want):
        d = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), a.new_tokens)
        first_div.append(d)
    diverged = [d for d in first_div if d < a.new_tokens]
    W = on.cfg.sliding_window
    return {"prompts": a.prompts, "new_tokens": a.new_tokens, "prompt_len_min": int(lens.min()),
            "prompt_len_max": int(lens.max()), "prompts_longer_than_window": int((lens > W).sum()),
            "identical_frac": round(sum(d == a.new_tokens for d in first_div) / a.prompts, 4),
            "first_token_agree_frac": round(sum(d > 0 for d in first_div) / a.prompts, 4),
            "first_divergence_mean": round(statistics.mean(first_div), 3),
            "first_divergence_mean_of_diverged": round(statistics.mean(diverged), 3) if diverged else None,
            "token_agree_frac": round(float(np.mean([x == y for g, w in zip(got, want) for x, y in zip(g, w)])), 4),
            "generate_wall_s": {"bounded": round(t_on, 2), "full": round(t_off, 2)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="tiny,tiny_l14", help="comma list: tiny, tiny_l<L>[_w<W>]")
    ap.add_argument("--lengths", default="64,256,512", help="prompt lengths of the speed cases")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", action="store_true",
                    help="also run the fidelity set with prompts no longer than the window (no approximation: "
                         "the rounding floor of the comparison)")
    ap.add_argument("--output-json", default=os.path.join("docs", "results", "bench_bounded_replay_cpu.json"))
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    report = {"what": "SWA bounded replay vs full prefill (scripts/bench_bounded_replay.py)",
              "hardware": f"{platform.machine()} CPU, {os.cpu_count()} cores, jax {jax.__version__} "
                          f"({jax.default_backend()})",
              "args": vars(a), "variants": []}
    for name in a.variants.split(","):
        cfg = variant(name)
        S = dec.last_store_layer(cfg)
        log(f"{name}: {cfg.num_hidden_layers} layers, late {S + 1}-{cfg.num_hidden_layers - 1}, "
            f"window {cfg.sliding_window}: building engines")
        params = init_params(cfg, jax.random.key(a.seed))
        on, off = engine_pair(cfg, params, a)
        rng = np.random.default_rng(a.seed)
        v = {"variant": name, "layers": cfg.num_hidden_layers, "last_store_layer": S,
             "late_layers": cfg.num_hidden_layers - 1 - S, "window": cfg.sliding_window, "act_dtype": cfg.act_dtype}
        t0 = time.perf_counter()
        v["fidelity"] = fidelity(on, off, a, rng)
        f = v["fidelity"]
        log(f"{name} fidelity ({time.perf_counter() - t0:.0f}s incl. compiles): identical {f['identical_frac']:.2f}, "
            f"first token {f['first_token_agree_frac']:.2f}, first divergence {f['first_divergence_mean']:.2f} "
            f"of {a.new_tokens}")
        if a.control:
            # prompts within the window: nothing is approximated, only the late layers' shapes differ ([B, W]
            # vs [B, T]), so what diverges here is the dtype's rounding, the floor under the numbers above
            v["control_within_window"] = c = fidelity(on, off, a, rng, 2, cfg.sliding_window)
            log(f"{name} control (prompts <= window): identical {c['identical_frac']:.2f}, first token "
                f"{c['first_token_agree_frac']:.2f}, first divergence {c['first_divergence_mean']:.2f}")
        v["speed"] = []
        for P in lengths:
            c = time_prefill(on, P, a, rng)
            v["speed"].append(c)
            log(f"{name} prefill B={a.batch} P={P}: full {c['full_s']:.3f}s, bounded {c['bounded_s']:.3f}s, "
                f"speed-up {c['speedup']:.2f}x")
        report["variants"].append(v)
        del on, off
        jax.clear_caches()
    os.makedirs(os.path.dirname(a.output_json) or ".", exist_ok=True)
    with open(a.output_json, "w") as fh:
        json.dump(report, fh, indent=1)
    log(f"wrote {a.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
