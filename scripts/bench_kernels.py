#!/usr/bin/env python3
"""Pallas kernels vs their XLA paths at the flash config's shapes: time, achieved bandwidth, ratio.

    python scripts/bench_kernels.py [--quick] [--ops attention,indexer,engram,mhc,moe,linear] [--out bench.json]
    python scripts/bench_kernels.py --smoke     # interpret mode, tiny grid: checks the script runs (CPU)

For each kernel and case (decode and prefill shapes; batch 1–256, contexts 1K–1M for attention and the
indexer) both implementations run on the same inputs under `jit`; each is timed as the median of
`--reps` runs after warm-up (wall clock around `block_until_ready`, so launch overhead counts — it is
part of what a decode step pays). Achieved bandwidth = the call's minimal HBM bytes (`bytes_moved` of the
kernel module: each input read once, each output written once) / time, next to the device's copy
bandwidth measured in the same run (a large device-to-device copy; bytes read + written / time). The
outputs of the two paths are compared once per case (max abs difference), so a fast wrong kernel shows.
JSON out: the device, jax version, peak copy bandwidth, and one record per (op, part, case).
Needs a GPU for real numbers; on CPU only `--smoke` makes sense (interpret mode is a correctness tool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

OPS = ("attention", "indexer", "engram", "mhc", "moe", "linear")


def _time(fn, args, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn(*args) (block_until_ready), after `warmup` calls (compilation)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_bandwidth(reps: int, nbytes: int) -> float:
    """Device copy bandwidth, bytes/s (read + write), from a large jitted copy."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0 + 0.0)  # one fused elementwise pass: reads and writes every byte once
    t = _time(f, (x,), reps)
    return 2 * x.size * 4 / t


def _max_diff(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    d = 0.0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.kind in "iub":
            d = max(d, float(np.mean(x != y)))  # fraction of differing entries for integer outputs
        else:
            d = max(d, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))) if x.size else d
    return d


# ------------------------------------------------------------------------------------------- cases
# Each case builder returns {part: (kernel_fn, xla_fn, args)} plus a bytes function (part -> bytes).


def _mix_cases(op: str, quick: bool, smoke: bool, interpret: bool):
    """engram / mhc: `pallas.costs`' ``{op}_bench_inputs(tokens)`` gives each part's kernel, XLA function and args."""
    from dsv41_jax.pallas import costs

    bench_inputs, bytes_moved = {"engram": (costs.engram_bench_inputs, costs.engram_bytes_moved),
                                 "mhc": (costs.mhc_bench_inputs, costs.mhc_bytes_moved)}[op]
    toks = (4,) if smoke else ((1, 64, 4096) if quick else (1, 16, 64, 256, 1024, 4096))
    for t in toks:
        kw = {"table_rows": 1024} if (smoke and op == "engram") else {}
        parts = {p: (jax.jit(k), jax.jit(x), a) for p, (k, x, a) in
                 bench_inputs(t, seed=0, interpret=interpret, **kw).items()}
        yield {"tokens": t}, parts, (lambda part, t=t: bytes_moved(part, t))


def _seam_cases(op: str, quick: bool, smoke: bool, interpret: bool):
    """attention / indexer: `pallas.costs`' ``{op}_bench_inputs(batch, context, T)`` gives the seam's args;
    the XLA path is the seam with impl="xla"."""
    import functools

    from dsv41_jax.model import attention, indexer
    from dsv41_jax.pallas import costs, indexer_topk, sparse_attention

    mod = sparse_attention if op == "attention" else indexer_topk
    bench_inputs, bytes_moved = ((costs.attention_bench_inputs, costs.attention_bytes_moved) if op == "attention"
                                 else (costs.indexer_bench_inputs, costs.indexer_bytes_moved))
    seam = attention.sparse_attention if op == "attention" else indexer.topk
    if smoke:
        grid = [(1, 512, 1)]
    elif quick:
        grid = [(1, 4096, 1), (64, 4096, 1), (1, 65536, 1), (4, 4096, 64)]
    else:
        grid = [(b, c, 1) for b in (1, 16, 64, 256) for c in (1024, 8192, 65536)] + \
               [(1, 1 << 20, 1), (8, 1 << 20, 1), (1, 4096, 6), (16, 4096, 6), (4, 4096, 64)]
    # indexer: a ratio-2 dense key owner, the ratio-1 candidate source, a candidate-masked layer
    kinds = ("dense",) if op == "attention" or smoke else ("dense", "source", "masked")
    for b, c, t in grid:
        for kind in kinds:
            extra = {} if op == "attention" else {"kind": kind}
            args, kwargs = bench_inputs(b, c, t, seed=0, **extra)
            kern = jax.jit(lambda *a, kw=kwargs: mod.kernel(*a, interpret=interpret, **kw))
            xla = jax.jit(lambda *a, kw=kwargs: seam(*a, impl="xla", **kw))
            case = {"batch": b, "context": c, "T": t, **extra}
            parts = {"call": (kern, xla, args)}
            if op == "attention" and not smoke and (b, c, t) in TUNE_AT:
                # the kernel's alternative tilings (`TUNING_CANDIDATES`) on the same inputs
                for i, knobs in enumerate(mod.TUNING_CANDIDATES):
                    parts[f"tune{i}"] = (jax.jit(lambda *a, kw=kwargs, kn=knobs: mod.kernel(
                        *a, interpret=interpret, **kw, **kn)), xla, args)
            yield (case, parts,
                   functools.partial(lambda part, a, kw: bytes_moved(*a, **kw), a=args, kw=kwargs))


# (batch, context, T) at which the attention kernel's tuning candidates are timed too
TUNE_AT = {(1, 65536, 1), (64, 4096, 1), (16, 8192, 1), (4, 4096, 64)}


def _moe_cases(quick: bool, smoke: bool, interpret: bool):
    """The grouped MXFP4 MoE kernel vs the xla grouped path (`moe.routed_slots`) on the same routed
    experts: flash's 384 x (5120, 2304), top-6 (smoke: 8 experts of 256 / 128); decode and prefill
    token counts. Bytes: the kernel's contract at the routing's distinct experts."""
    from dsv41_jax.model import ModelConfig, moe
    from dsv41_jax.pallas import costs
    from dsv41_jax.pallas import moe_mxfp4 as mk

    cfg = ModelConfig.preset("flash")
    bf = jnp.bfloat16
    dims = (8, 256, 128, 6) if smoke else None
    toks = (4,) if smoke else ((1, 8, 64, 512) if quick else (1, 8, 16, 64, 256, 1024, 4096))
    kern = jax.jit(lambda *a: mk.kernel(*a, cfg, bf, interpret=interpret))
    xla = jax.jit(lambda *a: moe.routed_slots(*a, cfg, bf))
    for t in toks:
        args = costs.moe_bench_inputs(t, seed=0, dims=dims)
        parts = {"call": (kern, xla, args)}
        if not smoke and t in MOE_TUNE_AT:
            # the kernel's alternative tilings (`moe_mxfp4.TUNING_CANDIDATES`) on the same inputs
            for i, knobs in enumerate(mk.TUNING_CANDIDATES[1:], 1):
                parts[f"tune{i}"] = (jax.jit(lambda *a, kn=knobs: mk.kernel(*a, cfg, bf, interpret=interpret, **kn)),
                                     xla, args)
        yield {"tokens": t}, parts, (lambda part, a=args: costs.moe_routed_bytes(*a))


# token counts at which the MoE kernel's tuning candidates are timed too (decode at B = 1 and 64)
MOE_TUNE_AT = {1, 64}


# flash's fp8 linears the decode step runs (name: rows N, K): q down / up, kv, the output projection
LINEAR_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192)}
# (weight, tokens) at which the linear kernel's tuning candidates are timed too
LINEAR_TUNE_AT = {("wq_a", 1), ("wq_b", 1)}


def _linear_cases(quick: bool, smoke: bool, interpret: bool):
    """The fused fp8 GEMM kernel (`pallas/quant_linear.py`: activation quant + GEMM in one launch) vs the
    linear seam's xla path (`linear.fp8`: the quant, then the K-blockwise GEMM at <= 8 rows, the
    exact-bf16 dequant GEMM above) on flash's linear shapes. Bytes: the kernel's contract."""
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.pallas import costs
    from dsv41_jax.pallas import quant_linear as ql

    cfg = ModelConfig.preset("flash").replace(impl="xla")
    bf = jnp.bfloat16
    shapes = {"tiny": (64, 256)} if smoke else LINEAR_SHAPES
    toks = (4,) if smoke else ((1, 64) if quick else (1, 8, 64, 512, 4096))
    kern = jax.jit(lambda x, p: ql.kernel(x, p, "fp8", bf, interpret=interpret))
    xla = jax.jit(lambda x, p: ql.ref_linear(x, p, "fp8", bf, cfg))
    for name, (n, k) in shapes.items():
        for t in toks:
            args = costs.linear_bench_inputs("fp8", t, n, k, seed=0)
            parts = {"call": (kern, xla, args)}
            if not smoke and (name, t) in LINEAR_TUNE_AT:
                for i, knobs in enumerate(ql.TUNING_CANDIDATES[1:], 1):
                    parts[f"tune{i}"] = (jax.jit(lambda x, p, kn=knobs: ql.kernel(x, p, "fp8", bf, interpret=interpret,
                                                                                  **kn)), xla, args)
            yield ({"weight": name, "tokens": t}, parts,
                   (lambda part, t=t, n=n, k=k: costs.linear_bytes_moved("fp8", M=t, N=n, K=k, x_itemsize=2, out_itemsize=2)))


def cases(op: str, quick: bool, smoke: bool, interpret: bool):
    if op in ("attention", "indexer"):
        return _seam_cases(op, quick, smoke, interpret)
    if op == "moe":
        return _moe_cases(quick, smoke, interpret)
    if op == "linear":
        return _linear_cases(quick, smoke, interpret)
    return _mix_cases(op, quick, smoke, interpret)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    ap.add_argument("--quick", action="store_true", help="a reduced grid of cases (for a short GPU lease)")
    ap.add_argument("--smoke", action="store_true",
                    help="interpret mode, one tiny case per kernel: checks that the script runs (CPU)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per case (median reported)")
    ap.add_argument("--out", default="bench_kernels.json", help="JSON output path")
    a = ap.parse_args(argv)
    ops = [o.strip() for o in a.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        ap.error(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    backend = jax.default_backend()
    interpret = a.smoke or backend != "gpu"
    if backend != "gpu" and not a.smoke:
        ap.error("no GPU: the Pallas kernels run natively only on a GPU; use --smoke to check the script on CPU")
    reps = 1 if a.smoke else a.reps
    dev = jax.devices()[0]
    peak = None if a.smoke else copy_bandwidth(reps, 1 << 31)
    out = {"device": dev.device_kind, "backend": backend, "jax": jax.__version__, "interpret": interpret,
           "copy_bandwidth_GBps": None if peak is None else peak / 1e9, "records": []}
    print(f"device {dev.device_kind} | jax {jax.__version__} | interpret {interpret} | copy bandwidth "
          f"{'-' if peak is None else f'{peak / 1e9:.0f} GB/s'}", flush=True)
    print(f"{'op':10s} {'part':7s} {'case':34s} {'kernel ms':>10s} {'xla ms':>10s} {'xla/kern':>8s} "
          f"{'GB/s':>8s} {'%peak':>6s} {'maxdiff':>9s}", flush=True)
    failed = 0
    for op in ops:
        for case, parts, nbytes in cases(op, a.quick, a.smoke, interpret):
            for part, (kfn, xfn, args) in parts.items():
                try:
                    tk = _time(kfn, args, reps, warmup=1 if a.smoke else 2)
                    tx = _time(xfn, args, reps, warmup=1 if a.smoke else 2)
                    diff = _max_diff(kfn(*args), xfn(*args))
                except Exception as e:  # one failing case is recorded; the others still run
                    if a.smoke:
                        raise
                    failed += 1
                    out["records"].append(dict(op=op, part=part, **case, error=f"{type(e).__name__}: {e}"[:2000]))
                    print(f"{op:10s} {part:7s} {case} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    _write(a.out, out)
                    continue
                bw = nbytes(part) / tk
                rec = dict(op=op, part=part, **case, kernel_s=tk, xla_s=tx, speedup=tx / tk,
                           bytes=int(nbytes(part)), kernel_GBps=bw / 1e9,
                           frac_peak=None if peak is None else bw / peak, max_diff=diff)
                out["records"].append(rec)
                cs = " ".join(f"{k}={v}" for k, v in case.items())
                print(f"{op:10s} {part:7s} {cs:34s} {tk * 1e3:10.3f} {tx * 1e3:10.3f} {tx / tk:8.2f} "
                      f"{bw / 1e9:8.1f} {'-' if peak is None else f'{100 * bw / peak:5.1f}':>6s} {diff:9.2e}",
                      flush=True)
                _write(a.out, out)  # after every record: a run cut short by its lease still leaves its JSON
    _write(a.out, out)
    print(f"wrote {a.out}" + (f"; {failed} case(s) failed" if failed else ""), flush=True)
    return 1 if failed else 0


def _write(path: str, out: dict) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
