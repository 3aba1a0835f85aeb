"""Lower and compile one MoE layer's token dispatch (`dsv41_jax.parallel.moe_dispatch`) for D devices,
abstractly (no weights allocated), and report its collectives.

    JAX_PLATFORMS=cpu python scripts/aot_moe_dispatch.py --gpu-target scripts/gpu_specs/h200.txtpb \\
        --devices 8 --backend ragged [--config flash] [--tokens-per-device 8] [--json OUT]

The mesh is ``("dp",)`` over D devices: tokens and experts both split over all of them (data-parallel
attention's layout). With ``--gpu-target`` the devices are compile-only CUDA devices (XLA's GPU
compiler on a machine without a GPU: `aot_flash.gpu_target_devices`, needs JAX's CUDA PJRT plugin) —
the proof that the ``ragged`` backend, which XLA:CPU cannot run, compiles for an H200 node; without it,
D fake CPU devices (``all_to_all`` only). Prints (and writes with ``--json``) the target, the compile
time, the collective ops of the compiled HLO with their result bytes, and `moe_collective_bytes`'s
prediction for the layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aot_flash  # noqa: E402  (scripts/: the compile-only devices, the device-count flag, dtype sizes)

def hlo_collectives(hlo: str) -> tuple:
    """({op: count}, {op: result bytes}) of the collectives in an HLO text (`aot_flash.collectives`: an
    async start once, by its results)."""
    count: dict = {}
    nbytes: dict = {}
    for op, _, n, _ in aot_flash.collectives(hlo):
        count[op] = count.get(op, 0) + 1
        nbytes[op] = nbytes.get(op, 0) + n
    return count, nbytes


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dsv41_jax.model.config import ModelConfig
    from dsv41_jax.model.numerics import act_dtype
    from dsv41_jax.model.params import P as PDecl
    from dsv41_jax.model.params import mxfp4_experts_decl
    from dsv41_jax.parallel import moe_dispatch as md

    cfg = ModelConfig.preset(args.config)
    if args.dtype:
        cfg = cfg.replace(act_dtype=args.dtype)
    n = args.devices
    devices = (aot_flash.gpu_target_devices(args.gpu_target, n) if args.gpu_target else jax.devices("cpu")[:n])
    if len(devices) < n:
        raise ValueError(f"--devices {n}: only {len(devices)} devices")
    mesh = Mesh(np.asarray(devices[:n], dtype=object), ("dp",))
    D, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    split = NamedSharding(mesh, P("dp"))

    def abstract(decl):  # a `weights.Mxfp4` of declarations -> of sharded abstract arrays
        return jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=split), decl,
                                      is_leaf=lambda x: isinstance(x, PDecl))

    ex = {"w1": abstract(mxfp4_experts_decl(E, I, D)), "w3": abstract(mxfp4_experts_decl(E, I, D)),
          "w2": abstract(mxfp4_experts_decl(E, D, I))}
    N = n * args.tokens_per_device
    dt = act_dtype(cfg)
    xf = jax.ShapeDtypeStruct((N, D), dt, sharding=split)
    idx = jax.ShapeDtypeStruct((N, k), jnp.int32, sharding=split)
    w = jax.ShapeDtypeStruct((N, k), jnp.float32, sharding=split)

    def layer(ex, xf, idx, w):
        return md.routed_experts_dispatch(ex, xf, idx, w, cfg, dt, mesh, backend=args.backend, token_axes="dp",
                                          expert_axes="dp")

    t0 = time.perf_counter()
    with aot_flash._traced_as("gpu" if args.gpu_target else None):
        compiled = jax.jit(layer).lower(ex, xf, idx, w).compile()
    secs = time.perf_counter() - t0
    count, nbytes = hlo_collectives(compiled.as_text())
    pred = md.moe_collective_bytes(cfg, args.tokens_per_device, n, args.backend)
    return {"target": "cuda " + devices[0].device_kind if args.gpu_target else "cpu", "devices": n,
            "config": args.config, "backend": args.backend, "tokens_per_device": args.tokens_per_device,
            "experts_per_device": E // n, "compile_s": round(secs, 2), "hlo_ops": count, "hlo_result_bytes": nbytes,
            "predicted_bytes_per_layer": pred["per_layer"]}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=("tiny", "flash"), help="model preset (shapes only)")
    ap.add_argument("--devices", type=int, default=8, help="devices of the ('dp',) mesh (default 8)")
    ap.add_argument("--backend", default="ragged", choices=("all_to_all", "ragged"))
    ap.add_argument("--tokens-per-device", type=int, default=8)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "exact"), help="activation mode")
    ap.add_argument("--gpu-target", default=None, metavar="TXTPB",
                    help="compile for compile-only CUDA devices of this target (scripts/gpu_specs/h200.txtpb)")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the report as JSON")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.devices < 1 or args.tokens_per_device < 1:
        print("error: --devices and --tokens-per-device must be >= 1", file=sys.stderr)
        return 2
    if "jax" not in sys.modules and not args.gpu_target:
        aot_flash._set_devices(args.devices)
    try:
        rep = run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
