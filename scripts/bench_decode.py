#!/usr/bin/env python
"""Cost of one decode step per implementation (issue 10).

Part (b), abstract (``--part b``, the default): the full model (``--model flash``) is never
allocated. Parameters are `jax.ShapeDtypeStruct`s from `param_shapes`, the cache comes from
`jax.eval_shape(init_cache)`, and the step `dsv41_jax.model.decode.extend` (B rows x T=1 token) is
traced and compiled, per (impl, batch):

* matmul FLOPs and matmul operand bytes, counted from the jaxpr **through loops** (XLA's HLO cost
  analysis counts a while body once: here a ``scan`` body is multiplied by its length, nested calls
  are followed, and for ``cond`` the costliest branch counts). Every ``dot_general`` and
  ``ragged_dot_general`` counts 2·(output elements)·(contracted size) FLOPs (for a ragged dot each
  output row against its own group only) and the bytes of both operands at the dtype they enter
  the matmul. ``while`` loops with data-dependent trip counts are counted once and reported.
* the ideal next to it: 2 x active parameters per token (routed experts at top-k / E of their size;
  embedding and Engram table rows are gathers, DSpark stages are not part of the target step), and the
  active weights' bytes at stored width (the distinct experts a batch of B can touch, in expectation).
* XLA's memory analysis of the compiled step (temporaries, arguments, outputs) and the compile time.
* a per-site breakdown (model file:function that issued each matmul), so a change in one op — e.g.
  context-bounded retrieval in attention / indexer — shows up where it belongs.

The step is whatever `decode.extend` is at the time; nothing here depends on its internals beyond
``extend(params, state, batch, cfg, ccfg)``, `init_cache(cfg, ccfg)` and `make_batch`.

Part (a), real timings on a small model (``--part a``): tiny-model step time per impl at batch
1/16/64 and contexts 64..4K, max_context 1K vs 64K, with a PNG plot. Not implemented yet: the
intended structure is `run_part_a(args)` filling ``{"cases": [{impl, batch, context, max_context,
step_ms}]}`` through the same JSON writer, with `real_step(...)` timing a jitted `decode_step` after
a prefill of ``context`` tokens; ``--part a`` says so and exits with status 2.

    python scripts/bench_decode.py --model flash --impls reference,xla --batches 1,64 --out b.json

A progress line per case goes to stderr; the JSON (``--out``) holds every number, and the summary
checks the batch-1 targets of issue 10 (matmul FLOPs <= 1.5x ideal, operand bytes <= 2.5x ideal,
temporaries <= 2 GB) for each impl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGETS = {"flops_x_ideal": 1.5, "bytes_x_ideal": 2.5, "temp_bytes": 2 * 2**30}


def _ints(s: str) -> list:
    return [int(x) for x in s.replace(",", " ").split()]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ jaxpr cost counting

_HELPERS = ("linear.py", "numerics.py", "quant.py", "tiling.py")


def _site(eqn, outer: str = None) -> str:
    """'file.py:function' of the model frame that issued `eqn`: the innermost dsv41_jax/model frame
    that is not a matmul helper (linear / numerics / quant / tiling). Inside a `cond` branch the
    recorded traceback stops at the branch function, so a helper-only answer defers to `outer`, the
    site of the enclosing `cond` (`tiling.scoped` puts each weight tile in one)."""
    from jax._src import source_info_util

    best = None
    try:
        for fr in source_info_util.user_frames(eqn.source_info.traceback):
            if "dsv41_jax" in fr.file_name and "/model/" in fr.file_name:
                best = f"{os.path.basename(fr.file_name)}:{fr.function_name}"
                if not fr.file_name.endswith(_HELPERS):
                    return best  # the op that asked for the matmul, not the matmul helper
    except Exception:  # source info is best effort
        pass
    return outer or best or "?"


def _nbytes(aval) -> int:
    import numpy as np

    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _sub_jaxprs(eqn):
    """(jaxpr, multiplier) pairs of the sub-computations of `eqn`, excluding scan/cond/while."""
    from jax.extend import core as jcore

    out = []
    for v in eqn.params.values():
        vals = v if isinstance(v, (tuple, list)) else (v,)
        for x in vals:
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def count_matmuls(jaxpr, mult: int = 1, acc: dict = None, outer: str = None) -> dict:
    """Matmul FLOPs / operand bytes of `jaxpr` (a `jax.core.Jaxpr`), through loops (module doc).
    `outer`: the site of the enclosing `cond`, if any (see `_site`)."""
    if acc is None:
        acc = {"flops": 0, "bytes": 0, "n_matmuls": 0, "while_loops_counted_once": 0, "by_site": {}}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
            out = eqn.outvars[0].aval
            dn = eqn.params["dimension_numbers"] if name == "dot_general" else \
                eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            (lc, _), _ = dn
            k = math.prod(lhs.shape[d] for d in lc)
            flops = 2 * int(math.prod(out.shape)) * int(k) * mult
            nbytes = (_nbytes(lhs) + _nbytes(rhs)) * mult
            acc["flops"] += flops
            acc["bytes"] += nbytes
            acc["n_matmuls"] += mult
            s = acc["by_site"].setdefault(_site(eqn, outer), {"flops": 0, "bytes": 0})
            s["flops"] += flops
            s["bytes"] += nbytes
        elif name == "scan":
            count_matmuls(eqn.params["jaxpr"].jaxpr, mult * int(eqn.params["length"]), acc, outer)
        elif name == "while":
            acc["while_loops_counted_once"] += mult
            count_matmuls(eqn.params["body_jaxpr"].jaxpr, mult, acc, outer)
        elif name == "cond":
            best = None
            for br in eqn.params["branches"]:
                sub = count_matmuls(br.jaxpr, mult, outer=_site(eqn, outer))
                if best is None or sub["flops"] > best["flops"]:
                    best = sub
            if best is not None:
                acc["flops"] += best["flops"]
                acc["bytes"] += best["bytes"]
                acc["n_matmuls"] += best["n_matmuls"]
                for k2, v in best["by_site"].items():
                    s = acc["by_site"].setdefault(k2, {"flops": 0, "bytes": 0})
                    s["flops"] += v["flops"]
                    s["bytes"] += v["bytes"]
        else:
            for sub in _sub_jaxprs(eqn):
                count_matmuls(sub, mult, acc, outer)
    return acc


# ------------------------------------------------------------------------------------------- ideal

def ideal_costs(cfg, B: int) -> dict:
    """Per decode step of B tokens: 2 x active params per token, and active weight bytes at stored width.

    Active: every target-layer tensor and the head (all of them take part in every token), the routed
    experts at top-k / E of their size per token; not the embedding or Engram tables (row gathers),
    not the DSpark stages, not derived tables. Bytes: dense weights once per step; routed experts for
    the expected number of distinct experts B tokens select, E·(1 − (1 − k/E)^B).
    """
    import numpy as np

    from dsv41_jax.model.params import declare_params, flatten_names

    names = flatten_names(declare_params(cfg))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = E * (1.0 - (1.0 - k / E) ** B)
    params_tok = 0.0
    bytes_step = 0.0
    routed_bytes_tok1 = 0.0
    for name, p in names.items():
        if not p.in_checkpoint or name.startswith("mtp.") or name.startswith("embed.") \
                or ".engram.embed." in name:
            continue
        nel = int(np.prod(p.shape))
        nb = nel * np.dtype(p.dtype).itemsize
        is_scale = p.init in ("fp8_scale", "mxfp4_scale", "fp8_rows_scale")
        n_params = 0 if is_scale else (2 * nel if p.init == "mxfp4" else nel)
        if ".ffn.experts." in name:
            params_tok += n_params * k / E
            bytes_step += nb * distinct / E
            routed_bytes_tok1 += nb * k / E
        else:
            params_tok += n_params
            bytes_step += nb
    return {"flops_per_token": 2 * params_tok, "active_params_per_token": params_tok,
            "weight_bytes_per_step": bytes_step, "weight_bytes_per_token": bytes_step / B,
            "routed_expert_bytes_batch1": routed_bytes_tok1, "expected_distinct_experts": distinct}


# -------------------------------------------------------------------------------------- one case

def abstract_case(cfg, B: int, max_context: int, page_size: int):
    """(step, abstract args) for decode.extend at B rows x T=1 with a CacheConfig for max_context."""
    import jax

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode
    from dsv41_jax.model.params import param_shapes

    pages = max(1, max_context // page_size)
    ccfg = kvc.CacheConfig(page_size=page_size, num_pages=B * pages, max_slots=B, max_pages_per_seq=pages)
    params = param_shapes(cfg)
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    rows = [{"tokens": [3], "start": 0, "slot": b, "page_table": [0]} for b in range(B)]
    batch = decode.make_batch(rows, 1, B, ccfg)
    batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)

    def step(params, state, batch):
        return decode.extend(params, state, batch, cfg, ccfg)

    return step, (params, state, batch), ccfg


def run_case(cfg, impl: str, B: int, args) -> dict:
    import jax

    c = cfg.replace(impl=impl)
    step, avals, ccfg = abstract_case(c, B, args.max_context, args.page_size)
    t0 = time.perf_counter()
    closed = jax.make_jaxpr(step)(*avals)
    t_trace = time.perf_counter() - t0
    mm = count_matmuls(closed.jaxpr)
    ideal = ideal_costs(c, B)
    res = {"impl": impl, "batch": B, "T": 1, "max_context": ccfg.max_context, "trace_s": t_trace,
           "matmul_flops_per_token": mm["flops"] / B, "matmul_bytes_per_token": mm["bytes"] / B,
           "matmul_flops_step": mm["flops"], "matmul_bytes_step": mm["bytes"], "n_matmuls": mm["n_matmuls"],
           "while_loops_counted_once": mm["while_loops_counted_once"],
           "ideal": ideal,
           "flops_x_ideal": mm["flops"] / B / ideal["flops_per_token"],
           "bytes_x_ideal": mm["bytes"] / ideal["weight_bytes_per_step"],
           "by_site": dict(sorted(mm["by_site"].items(), key=lambda kv: -kv[1]["bytes"]))}
    if not args.no_compile:
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(*avals).compile()
        res["compile_s"] = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        if ma is not None:
            res["memory"] = {k: int(getattr(ma, k)) for k in
                             ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
                              "alias_size_in_bytes", "generated_code_size_in_bytes") if hasattr(ma, k)}
    return res


def fmt_case(r: dict) -> str:
    g = 2**30
    s = (f"[b] impl={r['impl']:<9} B={r['batch']:<3} matmul GFLOP/tok {r['matmul_flops_per_token'] / 1e9:8.2f} "
         f"({r['flops_x_ideal']:.2f}x ideal)  operand GB/step {r['matmul_bytes_step'] / g:8.2f} "
         f"({r['bytes_x_ideal']:.2f}x ideal {r['ideal']['weight_bytes_per_step'] / g:.2f})")
    if "memory" in r:
        s += f"  temp {r['memory'].get('temp_size_in_bytes', 0) / g:.2f} GB"
    if "compile_s" in r:
        s += f"  compile {r['compile_s']:.1f}s"
    return s


def check_targets(results: list) -> dict:
    """Batch-1 targets of issue 10, per impl: {impl: {target: (value, limit, ok)}}."""
    out = {}
    for r in results:
        if r["batch"] != 1:
            continue
        t = {"flops_x_ideal": (r["flops_x_ideal"], TARGETS["flops_x_ideal"]),
             "bytes_x_ideal": (r["bytes_x_ideal"], TARGETS["bytes_x_ideal"])}
        if "memory" in r:
            t["temp_bytes"] = (r["memory"].get("temp_size_in_bytes", 0), TARGETS["temp_bytes"])
        out[r["impl"]] = {k: {"value": v, "limit": lim, "ok": bool(v <= lim)} for k, (v, lim) in t.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--part", choices=("a", "b"), default="b", help="b: abstract flash costs (default)")
    ap.add_argument("--model", default="flash", help="config preset (default flash)")
    ap.add_argument("--impls", default="reference,xla", help="comma-separated ModelConfig.impl specs")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes (rows x 1 token)")
    ap.add_argument("--max-context", type=int, default=65536, help="cache max context (tokens)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--act-dtype", default=None, help="override ModelConfig.act_dtype")
    ap.add_argument("--no-compile", action="store_true", help="jaxpr counts only (no XLA compile/memory)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if args.part == "a":
        log("part (a) (real tiny timings) is not implemented yet; see the module docstring for its structure")
        return 2

    import jax

    from dsv41_jax.model import ModelConfig

    cfg = ModelConfig.preset(args.model)
    if args.act_dtype:
        cfg = cfg.replace(act_dtype=args.act_dtype)
    results = []
    for impl in [s for s in args.impls.split(";" if ";" in args.impls else ",") if s]:
        for B in _ints(args.batches):
            t0 = time.perf_counter()
            r = run_case(cfg, impl, B, args)
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            log(fmt_case(r))
    targets = check_targets(results)
    for impl, t in targets.items():
        log(f"[b] batch-1 targets impl={impl}: " + ", ".join(
            f"{k} {v['value']:.3g} <= {v['limit']:.3g} {'OK' if v['ok'] else 'MISSED'}" for k, v in t.items()))
    doc = {"part": "b", "model": args.model, "act_dtype": cfg.act_dtype, "max_context": args.max_context,
           "jax": jax.__version__, "backend": jax.default_backend(), "host": platform.node(),
           "targets": TARGETS, "target_check": targets, "cases": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
