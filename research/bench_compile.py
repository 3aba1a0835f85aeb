"""Compile cost of the tiny model's programs on this backend: what the test suite and a cold server pay.

For each case (program x variant) a fresh subprocess traces, lowers and compiles one program with the
persistent compilation cache off, and reports the CPU seconds of tracing + lowering and of XLA's
compile (`time.process_time`, all threads: less sensitive to a shared machine than wall time), the
wall time, the size of the optimized HLO (lines, fusions), and the median time of one run of the
compiled program (after a warm-up; `--steps` runs). Programs: the tiny `forward` (12
tokens) and the paged `extend` step (B=2, T=5), impl "xla". Variants: how the "xla" mHC path runs
Sinkhorn — `loop` (the fori_loop; the CPU default, `mhc.SINKHORN_LOOP_BACKENDS`) or `unrolled` (the
default on GPU/TPU).

  python research/bench_compile.py --output-json docs/results/bench_compile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

PROGRAMS = ("forward", "extend")
VARIANTS = ("loop", "unrolled")


def _one(program: str, variant: str, dtype: str, steps: int) -> dict:
    """Runs in the subprocess: compile one program, return its measurements."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.model import ModelConfig, init_params, mhc
    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode as dec
    from dsv41_jax.model.transformer import forward

    if variant == "unrolled":
        mhc.SINKHORN_LOOP_BACKENDS = ()
    else:
        mhc.SINKHORN_LOOP_BACKENDS = (jax.default_backend(),)
    mhc.sinkhorn_unrolled_on.cache_clear()
    cfg = ModelConfig.preset("tiny").replace(act_dtype=dtype, impl="xla")
    params = init_params(cfg, jax.random.key(0))
    if program == "forward":
        fn = jax.jit(forward, static_argnames=("cfg",))
        args, kw = (params, jnp.asarray(np.arange(12)[None] % 300 + 3, jnp.int32)), {"cfg": cfg}
    else:
        ccfg = kvc.CacheConfig(page_size=8, num_pages=16, max_slots=2, max_pages_per_seq=5, retrieval_block=4)
        st = kvc.init_cache(cfg, ccfg)
        rows = [{"tokens": [5, 6, 7, 8, 9], "start": 0, "slot": 0, "page_table": [0]},
                {"tokens": [10, 11], "start": 0, "slot": 1, "page_table": [1]}]
        fn = jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, ccfg))
        args, kw = (params, st, dec.make_batch(rows, 5, 2, ccfg)), {}
    c0, w0 = time.process_time(), time.perf_counter()
    lowered = fn.lower(*args, **kw)
    c1 = time.process_time()
    compiled = lowered.compile()
    c2, w2 = time.process_time(), time.perf_counter()
    text = compiled.as_text()
    times = []
    for _ in range(steps + 1):  # the first call warms up; the static cfg is baked into `compiled`
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t)
    return {"program": program, "variant": variant, "dtype": dtype, "trace_lower_cpu_s": round(c1 - c0, 2),
            "compile_cpu_s": round(c2 - c1, 2), "wall_s": round(w2 - w0, 2),
            "optimized_hlo_lines": text.count("\n"), "fusions": len(re.findall(r"= \S+ fusion\(", text)),
            "run_ms_median": round(1e3 * sorted(times[1:])[len(times[1:]) // 2], 3), "runs": steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma list of {PROGRAMS}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    ap.add_argument("--dtype", default="float32", help="act_dtype of the tiny config (default float32, as the "
                    "equivalence tests)")
    ap.add_argument("--steps", type=int, default=20, help="timed runs of each compiled program after one warm-up "
                    "(median reported as run_ms_median; default 20)")
    ap.add_argument("--output-json", default=None, help="write the report here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        program, variant = a.child.split(":")
        print(json.dumps(_one(program, variant, a.dtype, a.steps)))
        return {}
    programs = [p for p in a.programs.split(",") if p]
    variants = [v for v in a.variants.split(",") if v]
    for p in programs:
        if p not in PROGRAMS:
            ap.error(f"--programs: unknown {p!r} (known: {', '.join(PROGRAMS)})")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r} (known: {', '.join(VARIANTS)})")
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    cases = []
    for i, (p, v) in enumerate((p, v) for p in programs for v in variants):
        print(f"[{i + 1}/{len(programs) * len(variants)}] {p} / sinkhorn {v} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--child", f"{p}:{v}", "--dtype", a.dtype,
                              "--steps", str(a.steps)], env=env,
                             capture_output=True, text=True)
        if out.returncode:
            sys.stderr.write(out.stderr)
            raise SystemExit(f"case {p}/{v} failed (exit {out.returncode})")
        case = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"    compile {case['compile_cpu_s']} CPU-s, {case['optimized_hlo_lines']} HLO lines, "
              f"run {case['run_ms_median']} ms", file=sys.stderr)
        cases.append(case)
    import jax

    rep = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend()},
           "cases": cases}
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump(rep, f, indent=1)
    print(json.dumps(rep, indent=1))
    return rep


if __name__ == "__main__":
    main()
