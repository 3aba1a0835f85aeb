"""Hashes of the jaxprs of the model's jitted steps, for checking that a restructuring changed no program.

Traces (does not compile or run) `decode.extend` (one token and a ragged chunk), `decode.extend_uncommitted`
with restore data + `commit` (a DSpark verify step), `decode.extend_bounded`, `transformer.forward` and
`dspark.propose`, for the configs of `scripts/reading_measure.py` and tests/configs.py and tiny, in the fp32 /
bf16 / exact flows, with the "xla", "reference", every-op-on-its-kernel ("pallas_interpret") and the reading
measure's mixed implementation specs, and prints one line per step: its sha256 (of the jaxpr's text) and name.

    python scripts/step_jaxprs.py [--out FILE] [--quick] [--gpu-cells]

Run it before and after a change and diff the outputs: equal hashes = the same programs, bit for bit.

These steps are traced on the CPU backend, so "auto" is "xla" there and the GPU-only trace-time choices (the
GPU_AUTO kernels, no CPU weight tiling, mHC's loop form) are not among them, nor are flash's shapes. ``--gpu-cells``
adds the eight launch-count cells of docs/benchmarks.md ("Launches per decode step": flash cut to layers 0,2,3,20
and 0,2,3,4,5,20, B = 1 and 64, context 4K, "auto" and "auto,linear=pallas"), each the exact step
`scripts/aot_flash.py` compiles, traced as on a GPU (`aot_flash.py --jaxpr-hash gpu`, one process a cell: no
CUDA plugin needed). Equal hashes there: the same programs, so the same compiled launch counts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

IMPLS = ("xla", "reference", "pallas_interpret",
         "xla,attention=pallas_interpret,mhc=pallas_interpret,moe=pallas_interpret,linear=pallas_interpret")


def _configs(quick: bool):
    import configs as tc
    import reading_measure

    from dsv41_jax.model import ModelConfig

    out = {"tiny_runs": reading_measure._config(), "micro": tc.micro(), "mini": tc.mini()}
    if not quick:
        out.update({"tiny": ModelConfig.preset("tiny"), "e64": tc.e64()})
    return out


def _steps(cfg, name):
    """(label, fn, args) of each traced step of `cfg` (abstract arguments)."""
    import jax

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode as dec
    from dsv41_jax.model import dspark, layer_scan
    from dsv41_jax.model import transformer
    from dsv41_jax.model.params import param_shapes

    ccfg = kvc.CacheConfig(page_size=8, num_pages=12, max_slots=2, max_pages_per_seq=4)
    params = layer_scan.prepare(param_shapes(cfg), cfg)
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    i32 = "int32"

    def batch(B, T, bounded=False):
        b = {"tokens": jax.ShapeDtypeStruct((B, T), i32), "start": jax.ShapeDtypeStruct((B,), i32),
             "n_new": jax.ShapeDtypeStruct((B,), i32), "slot": jax.ShapeDtypeStruct((B,), i32),
             "page_table": jax.ShapeDtypeStruct((B, ccfg.max_pages_per_seq), i32)}
        if bounded:
            b["tail_lo"] = jax.ShapeDtypeStruct((B,), i32)
        return b

    def verify(p, s, b):
        logits, st, pend, _ = dec.extend_uncommitted(p, s, b, cfg, ccfg, all_logits=True, restore=True)
        return logits, dec.commit(st, pend, b, b["n_new"] - 1, cfg)

    out = [("extend B1 T1", lambda p, s, b: dec.extend(p, s, b, cfg, ccfg), (params, state, batch(1, 1))),
           ("extend B2 T3 all", lambda p, s, b: dec.extend(p, s, b, cfg, ccfg, all_logits=True),
            (params, state, batch(2, 3))),
           ("verify B1 T3", verify, (params, state, batch(1, 3))),
           ("forward B1 T4", lambda p, t: transformer.forward(p, t, cfg, return_aux=True),
            (params, jax.ShapeDtypeStruct((1, 4), i32)))]
    if cfg.sliding_window >= 2:
        out.append(("bounded B1 T3", lambda p, s, b: dec.extend_bounded(p, s, b, cfg, ccfg, late_tail=2),
                    (params, state, batch(1, 3, True))))
    if cfg.num_nextn_predict_layers and name == "micro":
        rstate = jax.eval_shape(lambda: dspark.with_rings(kvc.init_cache(cfg, ccfg), cfg, ccfg))
        rings = rstate["dspark"]
        a = jax.ShapeDtypeStruct((1,), i32)
        out.append(("dspark propose B1", lambda p, r, an, st, sl: dspark.propose(p, r, an, st, sl, cfg, ccfg),
                    (params, rings, a, a, a)))
    return out


GPU_CELLS = [(keep, batch, impl) for keep in ("0,2,3,20", "0,2,3,4,5,20") for batch in (1, 64)
             for impl in ("auto", "auto,linear=pallas")]


def _gpu_cell_lines() -> list:
    """One line per `GPU_CELLS` cell: its step's jaxpr hash traced as on a GPU (a fresh process each)."""
    import json
    import subprocess
    import tempfile

    lines = []
    for keep, batch, impl in GPU_CELLS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "aot_flash.py"), "--keep-layers", keep,
                            "--batch", str(batch), "--context", "4096", "--impl", impl, "--jaxpr-hash", "gpu",
                            "--out", f.name], check=True, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, JAX_PLATFORMS="cpu"))
            h = json.load(open(f.name))["jaxpr_sha256"]
        lines.append(f"{h}  flash-cut {keep} B{batch} context4096 {impl} traced-as-gpu :: aot_flash step")
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the lines to this file")
    ap.add_argument("--quick", action="store_true", help="three configs (tiny_runs, micro, mini), not five")
    ap.add_argument("--gpu-cells", action="store_true",
                    help="also the launch-count cells traced as on a GPU (module doc; about a minute each)")
    args = ap.parse_args(argv)
    import jax

    lines = _gpu_cell_lines() if args.gpu_cells else []
    for cname, base in _configs(args.quick).items():
        for dtype in ("float32", "bfloat16", "exact"):
            for impl in IMPLS:
                if dtype == "exact" and impl != "xla":
                    continue  # the kernels refuse the fp64 modes
                cfg = base.replace(act_dtype=dtype, impl=impl)
                for label, fn, fargs in _steps(cfg, cname):
                    try:
                        text = str(jax.make_jaxpr(fn)(*fargs))
                        h = hashlib.sha256(text.encode()).hexdigest()[:16]
                    except Exception as e:  # a refused combination: its message is what must not change
                        h = "error " + type(e).__name__ + ": " + str(e).splitlines()[0][:120]
                    line = f"{h}  {cname} {dtype} {impl} :: {label}"
                    print(line, flush=True)
                    lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
