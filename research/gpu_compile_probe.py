"""Compile times for an NVIDIA H200 (sm_90) on a machine without a GPU.

XLA's GPU compiler runs on the CPU against compile-only CUDA devices (`scripts/aot_flash.py`'s
`gpu_target_devices`, described by scripts/gpu_specs/h200.txtpb), so what a GPU would spend compiling
can be measured here. Two probes:

  sinkhorn: one mHC `hc_mixes` (tiny shapes) with Sinkhorn as the fori_loop and unrolled at several
            iteration counts — why `mhc.SINKHORN_LOOP_BACKENDS` holds "gpu";
  forward:  the whole forward of a preset (default tiny) under `jit`, lowering and compile seconds,
            and the custom calls / fusions of the compiled module.

Needs the CUDA PJRT plugin of the installed jax (`pip install jax-cuda12-plugin==<jax version>`, not a
project dependency). Run with JAX_PLATFORMS=cpu (set here). Usage:

  python research/gpu_compile_probe.py sinkhorn --iters 3,6,10,20
  python research/gpu_compile_probe.py forward --model tiny
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("probe", choices=("sinkhorn", "forward"), help="what to compile (see the module docstring)")
    ap.add_argument("--iters", default="3,6,10,20", help="sinkhorn: unrolled iteration counts to compile")
    ap.add_argument("--model", default="tiny", help="forward: the preset to compile")
    ap.add_argument("--target", default=os.path.join(os.path.dirname(__file__), "..", "scripts", "gpu_specs",
                                                      "h200.txtpb"), help="GpuTargetConfigProto text file")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from aot_flash import _traced_as, gpu_target_devices

    dev = gpu_target_devices(args.target, 1)[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    print(f"target: {dev.device_kind} (compile-only), jax {jax.__version__}", flush=True)

    def sds(shape, dt=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    def timed_compile(fn, *avals, **static):
        t = time.perf_counter()
        lowered = jax.jit(fn, static_argnames=tuple(static)).trace(*avals, **static).lower()
        t_lower = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        return t_lower, time.perf_counter() - t, compiled

    if args.probe == "sinkhorn":
        from dsv41_jax.model import mhc

        T, n, D = 8, 4, 64
        avals = (sds((T, n, D), jnp.bfloat16), sds(((2 + n) * n, n * D)), sds(((2 + n) * n,)), sds((3,)))
        for iters, unroll in [(20, False)] + [(int(i), True) for i in args.iters.split(",")]:
            def mixes(h, fn, base, scale, iters=iters, unroll=unroll):
                return mhc.hc_mixes(h, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=iters,
                                    unroll=unroll)
            _, t_compile, _ = timed_compile(mixes, *avals)
            print(f"hc_mixes sinkhorn={'unrolled' if unroll else 'loop':8s} iters={iters:3d}: "
                  f"compile {t_compile:6.1f} s", flush=True)
        return 0

    from dsv41_jax.model import ModelConfig, forward
    from dsv41_jax.model.params import param_shapes

    cfg = ModelConfig.preset(args.model)
    params = jax.tree.map(lambda x: sds(x.shape, x.dtype), param_shapes(cfg))
    with _traced_as("gpu"):  # dispatch and the mHC loop choice read the backend at trace time
        t_lower, t_compile, compiled = timed_compile(forward, params, sds((1, 8), jnp.int32), cfg=cfg)
    hlo = compiled.as_text()
    print(f"{args.model} forward [1, 8]: lowered {t_lower:.1f} s, compiled {t_compile:.1f} s; compiled module: "
          f"{len(re.findall(r'custom-call[(]', hlo))} custom calls, {len(re.findall(r' fusion[(]', hlo))} fusions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
