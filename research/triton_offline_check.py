"""Compile the Pallas Triton kernels for a GPU target *without a GPU*, and report registers / spills.

See dsv41_jax/pallas/offline.py: lowers each kernel call for "cuda", compiles the Triton IR with
Triton's compiler and ptxas for the target, prints registers, spill (stack) bytes and shared memory
per kernel launch and configuration as JSON lines (and the whole list with --out).

Usage: python research/triton_offline_check.py [--ops attention,indexer,engram,mhc] [--arch 90]
           [--shapes flash-decode,flash-verify,flash-prefill] [--modes auto] [--sweep] [--knobs JSON]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

SHAPES = {  # name: (batch, context, T); Engram / mHC use batch·T tokens
    "flash-decode": (1, 4096, 1),
    "flash-verify": (4, 4096, 6),
    "flash-prefill": (1, 4096, 64),
}
OPS = ("attention", "indexer", "engram", "mhc")


def _launches(op, shape, mode, knobs):
    """(label dict, fn, args) per kernel call to lower, at `shape`."""
    import jax.numpy as jnp

    B, ctx, T = SHAPES[shape]
    if op == "attention":
        from dsv41_jax.pallas import costs
        from dsv41_jax.pallas import sparse_attention as sa

        inputs, kw = costs.attention_bench_inputs(B, ctx, T, mode=mode, dtype=jnp.bfloat16)
        for kn in knobs:
            eff = sa.effective_knobs(*inputs, **kw, **kn)
            yield {"mode": mode, **eff}, functools.partial(sa.kernel, interpret=False, **kw, **kn), inputs
    elif op == "indexer":
        from dsv41_jax.pallas import costs
        from dsv41_jax.pallas import indexer_topk as it

        for kind in ("dense", "source", "masked"):
            args, kw = costs.indexer_bench_inputs(B, ctx, T, mode=mode, kind=kind)
            yield {"mode": mode, "kind": kind}, functools.partial(it.kernel, interpret=False, **kw), args
    else:
        from dsv41_jax.pallas import costs

        bench_inputs = costs.engram_bench_inputs if op == "engram" else costs.mhc_bench_inputs
        extra = {"table_rows": 4096} if op == "engram" else {}
        for part, (kfn, _xla, args) in bench_inputs(B * T, seed=0, interpret=False, **extra).items():
            yield {"part": part, "tokens": B * T}, kfn, args


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90 = H100/H200)")
    ap.add_argument("--shapes", default="flash-decode", help=f"comma-separated subset of {', '.join(SHAPES)}")
    ap.add_argument("--modes", default="auto", help="kv_cache_dtype values for attention / indexer inputs")
    ap.add_argument("--sweep", action="store_true", help="attention: also every sparse_attention.TUNING_CANDIDATES")
    ap.add_argument("--knobs", default=None, help='attention: JSON list of knob dicts to try, e.g. \'[{"block_h": 16}]\'')
    ap.add_argument("--out", default=None, help="also write all rows as one JSON file")
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        ap.error(f"unknown op(s)/shape(s) {bad}")
    from dsv41_jax.pallas import sparse_attention as sa
    from dsv41_jax.pallas.offline import capture_kernels, compile_ttir

    knobs = json.loads(args.knobs) if args.knobs else [dict()]
    knobs += list(sa.TUNING_CANDIDATES) if args.sweep else []
    rep = []
    for op in ops:
        for shape in args.shapes.split(","):
            for mode in (args.modes.split(",") if op in ("attention", "indexer") else ["-"]):
                for label, fn, inputs in _launches(op, shape, mode, knobs):
                    for k in capture_kernels(fn, *inputs):
                        t0 = time.time()
                        res = compile_ttir(k["ttir"], num_warps=k["num_warps"], num_stages=k["num_stages"],
                                           arch=args.arch)
                        row = {"op": op, "kernel": k["name"], "shape": shape, **label, "num_warps": k["num_warps"],
                               "num_stages": k["num_stages"], **res, "compile_s": round(time.time() - t0, 1)}
                        print(json.dumps(row), flush=True)
                        rep.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"arch": args.arch, "results": rep}, f, indent=1)
    return {"results": rep}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
