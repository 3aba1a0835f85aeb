"""Compile the Pallas Triton kernels for a GPU target *without a GPU*, and report registers / spills.

Lowers a kernel call for platform "cuda" (Pallas' Triton lowering assumes sm_90 when no GPU is
present), takes the Triton IR it produced, and runs Triton's own compiler (the `triton` package,
installed with `jax-triton`) through TTGIR, LLVM, PTX and ptxas for the target; `cuobjdump` then gives
the registers per thread, stack (spill) bytes and shared memory. A kernel that fails here will not
compile on the GPU either; one that passes still has to be checked there for numerics and speed.

Usage: python scripts/triton_offline_check.py [--arch 90] [--shapes flash-decode,...] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def capture_ttir(fn, *args):
    """Triton IR text of every pallas_call in `fn(*args)` lowered for "cuda" (no GPU needed)."""
    import jax
    from jax._src.pallas.triton import lowering as tl
    from jax._src.pallas.triton import pallas_call_registration as reg

    mods = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def wrapped(*a, **k):
        r = orig(*a, **k)
        assert r.module.operation.verify()
        mods.append(r.module.operation.get_asm())
        return r

    reg.lowering.lower_jaxpr_to_triton_module = wrapped
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    del tl
    return mods


def compile_ttir(ttir: str, *, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """Compile Triton IR text to a cubin for sm_`arch`; returns regs, stack (spill) bytes, shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        k = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":") for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(k.metadata.shared)}


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
