"""Compile the Pallas Triton kernels for a GPU target *without a GPU*, and report registers / spills.

See dsv41_jax/pallas/offline.py: lowers each kernel call for "cuda", compiles the Triton IR with
Triton's compiler and ptxas for the target, prints registers, spill (stack) bytes and shared memory
per configuration as JSON lines.

Usage: python scripts/triton_offline_check.py [--arch 90] [--shapes flash-decode,...] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

SHAPES = {  # name: (batch, context, T)
    "flash-decode": (1, 4096, 1),
    "flash-verify": (4, 4096, 6),
    "flash-prefill": (1, 4096, 64),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--shapes", default="flash-decode")
    ap.add_argument("--modes", default="auto")
    ap.add_argument("--sweep", action="store_true", help="also every sparse_attention.TUNING_CANDIDATES")
    ap.add_argument("--knobs", default=None, help='JSON list of knob dicts to try, e.g. \'[{"block_h": 16}]\'')
    args = ap.parse_args(argv)
    import jax.numpy as jnp

    from dsv41_jax.pallas import sparse_attention as sa
    from dsv41_jax.pallas.offline import capture_ttir, compile_ttir

    knobs = json.loads(args.knobs) if args.knobs else [dict()]
    knobs += list(sa.TUNING_CANDIDATES) if args.sweep else []
    rep = []
    for shape in args.shapes.split(","):
        B, ctx, T = SHAPES[shape]
        for mode in args.modes.split(","):
            inputs, kw = sa.bench_inputs(B, ctx, T, mode=mode, dtype=jnp.bfloat16)
            for kn in knobs:
                eff = sa.effective_knobs(*inputs, **kw, **kn)
                fn = functools.partial(sa.kernel, interpret=False, **kw, **kn)
                (ttir,) = capture_ttir(fn, *inputs)
                res = compile_ttir(ttir, num_warps=eff["num_warps"], num_stages=eff["num_stages"], arch=args.arch)
                row = {"kernel": "sparse_attention", "shape": shape, "mode": mode, **eff, **res}
                print(json.dumps(row), flush=True)
                rep.append(row)
    return {"results": rep}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
