#!/usr/bin/env python
"""Cost of one decode step per implementation.

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
  A Pallas kernel counts by its bytes-moved contract, not by its body's block-sized dots: the MoE
  kernel (``--impls "xla,moe=pallas" --no-compile``; `pallas.costs.moe_bytes_moved`: the selected
  experts' stored bytes once per non-empty group, plus activations) at the expected number of
  distinct experts the batch selects — the same expectation as the ideal's — with the bound for
  every group non-empty beside it (``bytes_x_ideal_all_groups``); another kernel by its declared
  ``pl.CostEstimate``.
* the ideal next to it: 2 x active parameters per token (routed experts at top-k / E of their size;
  embedding and Engram table rows are gathers, DSpark stages are not part of the target step), and the
  active weights' bytes at stored width (the distinct experts a batch of B can touch, in expectation).
* XLA's memory analysis of the compiled step (temporaries, arguments, outputs) and the compile time.
* a per-site breakdown (model file:function that issued each matmul), so a change in one op — e.g.
  context-bounded retrieval in attention / indexer — shows up where it belongs.

The step is whatever `decode.extend` is at the time; nothing here depends on its internals beyond
``extend(params, state, batch, cfg, ccfg)``, `init_cache(cfg, ccfg)` and `make_batch`.

Part (a), real timings on a small model (``--part a``, model default tiny): the jitted one-token decode
step (`decode.decode_step`, cache donated) per impl, batch (default 1/16/64), context (default
64..4096 tokens already in the cache) and ``max_context`` (default 1K and 64K: the page-table width the
step is compiled for). One compile per (impl, max_context, batch), reused across contexts; each case
times ``--iters`` steps after one warm-up and reports the median step time and B / step tokens per
second. The cache is *not* filled by a prefill: a decode step's work depends on how many tokens the
rows hold (positions, page tables: the retrieval loop's trip count, what attention reads), not on the
cached values, so each row is given ``context`` tokens' worth of pages and ``start = context − 1``
over a zeroed cache (a prefill of 64 x 4K tokens would cost far more than the measurement). Cases
whose context does not fit ``max_context`` are skipped. The JSON records the machine's load average
before and after (timings on a shared machine are only comparable within one run), and a PNG plots
step time against context, one line per (impl, batch, max_context). Per case also: the active weights'
bytes per step at stored width and the GB/s they give, as a fraction of a device copy's bandwidth
measured in the same run, and the kernel launches per step counted from the compiled HLO. A cut of a
big model (``--model flash --keep-layers 0,1,2,20``) gets random weights in the stored formats made on
the device (``--weights random``, `random_stored_params`):

    python scripts/bench_decode.py --part a --model flash --keep-layers 0,1,2,20 --impls auto \
        --batches 1,8,64 --contexts 4096,65536 --max-contexts 65536 --out gpu.json

    python scripts/bench_decode.py --model flash --impls reference,xla --batches 1,64 --out b.json
    python scripts/bench_decode.py --part a --impls reference,xla --out a.json   # PNG: a.png
    python scripts/bench_decode.py --part a --impls xla --numerics bfloat16,deterministic --out det.json

``--numerics`` (part a): the numerics modes to time, each case run once per mode in the same process
("bfloat16", "deterministic" = `ModelConfig.deterministic`, "float32", "exact"); with "bfloat16" and
"deterministic" both given, the summary (and the JSON's ``deterministic_cost``) gives the deterministic
step time over the bf16 one per (impl, batch, max_context, context).

A progress line per case goes to stderr; the JSON (``--out``) holds every number, and the summary
checks the batch-1 targets (matmul FLOPs <= 1.5x ideal, operand bytes <= 2.5x ideal,
temporaries <= 2 GB) for each impl.
"""

from __future__ import annotations

import argparse
import functools
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


def _count_eqns(jaxpr) -> int:
    """Equations in `jaxpr` and its sub-jaxprs, each body once (the size of what XLA compiles)."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(x, "jaxpr", x)
                if hasattr(sub, "eqns"):
                    n += _count_eqns(sub)
    return n


def expected_distinct(E: int, k: int, n_tok: float) -> float:
    """Expected distinct experts that n_tok tokens select, top-k of E each, routing uniform."""
    return E * (1.0 - (1.0 - k / E) ** n_tok)


def _kernel_cost(eqn, routing) -> dict | None:
    """A Pallas kernel counted by its bytes-moved contract instead of its body's block-sized dots:
    the MoE kernel (`pallas.costs.moe_call_geometry` / `moe_bytes_moved`) at the expected number of
    non-empty groups, ``routing = (E, k)`` (the ideal's expectation), with the all-groups bound (its
    declared `pl.CostEstimate`) beside it; another kernel with a cost estimate by that estimate.
    None: no contract (its body is counted as before)."""
    from dsv41_jax.pallas import costs

    ce = eqn.params.get("cost_estimate")
    geo = costs.moe_call_geometry(str(eqn.params.get("name", "")), [v.aval for v in eqn.invars],
                                  eqn.params["out_avals"])
    if geo is not None:
        part = geo.pop("part")
        E, k = routing
        active = min(geo["G"], expected_distinct(E, k, geo["A"] / k))
        return {"flops": ce.flops, "bytes": costs.moe_bytes_moved(part, **geo, n_active=active),
                "bytes_upper": costs.moe_bytes_moved(part, **geo)}
    if ce is not None and ce.bytes_accessed:
        return {"flops": ce.flops, "bytes": ce.bytes_accessed, "bytes_upper": ce.bytes_accessed}
    return None


def count_matmuls(jaxpr, mult: int = 1, acc: dict = None, outer: str = None, routing: tuple = (1, 1)) -> dict:
    """Matmul FLOPs / operand bytes of `jaxpr` (a `jax.core.Jaxpr`), through loops (module doc).
    `outer`: the site of the enclosing `cond`, if any (see `_site`); `routing`: (experts, top-k) of
    the MoE, for a kernel's contract (`_kernel_cost`)."""
    if acc is None:
        acc = {"flops": 0, "bytes": 0, "n_matmuls": 0, "while_loops_counted_once": 0, "by_site": {},
               "kernel_calls": 0, "kernel_bytes_upper_extra": 0}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        kc = _kernel_cost(eqn, routing) if name == "pallas_call" else None
        if kc is not None:
            acc["flops"] += kc["flops"] * mult
            acc["bytes"] += kc["bytes"] * mult
            acc["kernel_calls"] += mult
            acc["kernel_bytes_upper_extra"] += (kc["bytes_upper"] - kc["bytes"]) * mult
            s = acc["by_site"].setdefault(f"pallas:{eqn.params['name']}", {"flops": 0, "bytes": 0})
            s["flops"] += kc["flops"] * mult
            s["bytes"] += kc["bytes"] * mult
        elif name in ("dot_general", "ragged_dot_general"):
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
            count_matmuls(eqn.params["jaxpr"].jaxpr, mult * int(eqn.params["length"]), acc, outer, routing)
        elif name == "while":
            acc["while_loops_counted_once"] += mult
            count_matmuls(eqn.params["body_jaxpr"].jaxpr, mult, acc, outer, routing)
        elif name == "cond":
            best = None
            for br in eqn.params["branches"]:
                sub = count_matmuls(br.jaxpr, mult, outer=_site(eqn, outer), routing=routing)
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
                count_matmuls(sub, mult, acc, outer, routing)
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
    distinct = expected_distinct(E, k, B)
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
    from dsv41_jax.model import decode, layer_scan
    from dsv41_jax.model.params import param_shapes

    pages = max(1, max_context // page_size)
    ccfg = kvc.CacheConfig(page_size=page_size, num_pages=B * pages, max_slots=B, max_pages_per_seq=pages)
    # the layout a server runs: runs of plan-identical layers stacked at load (`layer_scan.prepare`)
    params = layer_scan.prepare(param_shapes(cfg), cfg)
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
    t0, c0 = time.perf_counter(), time.process_time()
    closed = jax.make_jaxpr(step)(*avals)
    t_trace, c_trace = time.perf_counter() - t0, time.process_time() - c0
    mm = count_matmuls(closed.jaxpr, routing=(c.n_routed_experts, c.num_experts_per_tok))
    ideal = ideal_costs(c, B)
    from dsv41_jax.model import layer_scan

    res = {"impl": impl, "batch": B, "T": 1, "max_context": ccfg.max_context, "trace_s": t_trace,
           "trace_cpu_s": c_trace, "layer_scan": c.layer_scan, "layer_bodies": len(layer_scan.layer_runs(c)),
           "jaxpr_eqns": _count_eqns(closed.jaxpr),
           "matmul_flops_per_token": mm["flops"] / B, "matmul_bytes_per_token": mm["bytes"] / B,
           "matmul_flops_step": mm["flops"], "matmul_bytes_step": mm["bytes"], "n_matmuls": mm["n_matmuls"],
           "while_loops_counted_once": mm["while_loops_counted_once"],
           "kernel_calls": mm["kernel_calls"],
           "bytes_x_ideal_all_groups": (mm["bytes"] + mm["kernel_bytes_upper_extra"]) / ideal["weight_bytes_per_step"],
           "ideal": ideal,
           "flops_x_ideal": mm["flops"] / B / ideal["flops_per_token"],
           "bytes_x_ideal": mm["bytes"] / ideal["weight_bytes_per_step"],
           "by_site": dict(sorted(mm["by_site"].items(), key=lambda kv: -kv[1]["bytes"]))}
    if not args.no_compile:
        # wall and CPU (process) seconds, lowering (trace + StableHLO) and XLA's compile apart: on a shared
        # machine the CPU seconds are the comparable number
        t0, c0 = time.perf_counter(), time.process_time()
        lowered = jax.jit(step).lower(*avals)
        t1, c1 = time.perf_counter(), time.process_time()
        compiled = lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        res.update(compile_s=t2 - t0, lower_s=t1 - t0, xla_compile_s=t2 - t1, compile_cpu_s=c2 - c0,
                   lower_cpu_s=c1 - c0, xla_compile_cpu_s=c2 - c1)
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
    if r.get("kernel_calls"):
        s += f"  [{r['kernel_calls']} kernel calls; every MoE group non-empty: {r['bytes_x_ideal_all_groups']:.2f}x]"
    if "memory" in r:
        s += f"  temp {r['memory'].get('temp_size_in_bytes', 0) / g:.2f} GB"
    if "compile_s" in r:
        s += f"  compile {r['compile_s']:.1f}s (lower {r['lower_s']:.1f}s, CPU {r['compile_cpu_s']:.1f}s)"
    return s


def check_targets(results: list) -> dict:
    """Batch-1 targets (see the module doc), per impl: {impl: {target: (value, limit, ok)}}."""
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


# ----------------------------------------------------------------------------- part (a): real timings

def prepare_case(cfg, impl: str, B: int, max_context: int, contexts: list, page_size: int,
                 weights: str = "init") -> dict | None:
    """Everything one (impl, B, max_context) case needs before it is timed: parameters, a zeroed cache,
    one batch per context that fits, and the step compiled ahead of time (`jitted_extend(...).lower(...)
    .compile()`, state donated) with its kernel launches per step (`aot_flash.kernel_launches` on its HLO)
    and its compile seconds. None when no context fits ``max_context``."""
    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode
    from dsv41_jax.model.numerics import mode_name
    import numpy as np

    c = cfg.replace(impl=impl)
    pages = max(1, max_context // page_size)
    live = [L for L in contexts if L <= max_context]
    if not live:
        return None
    need = max(-(-L // page_size) for L in live)  # pages a row holds at the largest context
    ccfg = kvc.CacheConfig(page_size=page_size, num_pages=B * need + 1, max_slots=B, max_pages_per_seq=pages)
    params = _part_a_params(c, weights)
    state = kvc.init_cache(c, ccfg)
    if "engram_hist" in state:
        pad = int(np.asarray(params["derived"]["engram_token_map"])[c.engram_pad_token_id])
        state = kvc.reset_slots(state, np.arange(ccfg.max_slots + 1), pad)
    batches = {}
    for L in live:
        n = -(-L // page_size)
        # Row b holds pages 1 + b·need .. (page 0 stays unused, as the allocator's null page).
        rows = [{"tokens": [3 + b % 100], "start": L - 1, "slot": b,
                 "page_table": list(range(1 + b * need, 1 + b * need + n))} for b in range(B)]
        batches[L] = decode.make_batch(rows, 1, B, ccfg)
    t0 = time.perf_counter()
    step = decode.jitted_extend(c, ccfg, False, None).lower(params, state, batches[live[0]]).compile()
    compile_s = time.perf_counter() - t0
    return {"impl": impl, "numerics": mode_name(c), "B": B, "ccfg": ccfg, "params": params, "state": state,
            "batches": batches, "step": step, "compile_s": compile_s,
            "launches": _aot().kernel_launches(step.as_text()),
            "weight_bytes": ideal_costs(c, B)["weight_bytes_per_step"]}


def real_cases(cfg, impl: str, B: int, max_context: int, contexts: list, page_size: int, iters: int,
               weights: str = "init", copy_bps: float | None = None, prepared: dict | None = None):
    """Yield one timing dict per context for the decode step of `cfg` with impl, batch B, max_context
    (`prepare_case`'s, or `prepared` when the step was compiled earlier).

    Each context: one warm-up step, then ``iters`` timed steps (median and min reported).
    Bytes per step: the active weights at stored width (`ideal_costs`: the experts B tokens select in
    expectation), so GB/s = those bytes / step time — against `copy_bps`, a device copy measured in the
    same run, when given. (KV-cache reads are not in it: a lower bound on what the step moves.)"""
    import jax
    import numpy as np

    t0 = time.perf_counter()
    p = prepared or prepare_case(cfg, impl, B, max_context, contexts, page_size, weights)
    if p is None:
        return
    params, state, step, launches = p["params"], p.pop("state"), p["step"], p["launches"]
    weight_bytes = p["weight_bytes"]
    first = True
    for L, batch in p["batches"].items():
        logits, state = step(params, state, batch)  # warm-up
        jax.block_until_ready(logits)
        times = []
        for _ in range(iters):
            t1 = time.perf_counter()
            logits, state = step(params, state, batch)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t1)
        ms = 1e3 * float(np.median(times))
        r = {"impl": impl, "numerics": p["numerics"], "batch": B, "context": L, "max_context": p["ccfg"].max_context,
             "step_ms": ms, "step_ms_min": 1e3 * min(times), "tokens_per_s": B / (ms / 1e3), "iters": iters,
             "weight_bytes_per_step": weight_bytes, "weight_GBps": weight_bytes / (ms / 1e3) / 1e9,
             "kernel_launches": launches["launches"], "launches_by_opcode": launches["by_opcode"],
             "whiles_without_trip_count": launches["whiles_without_trip_count"]}
        if copy_bps:
            r["frac_copy_bandwidth"] = weight_bytes / (ms / 1e3) / copy_bps
        if first:
            r["compile_s"] = p["compile_s"]
            if prepared is None:
                r["compile_and_first_step_s"] = time.perf_counter() - t0 - sum(times)
        first = False
        yield r
    del state


def _aot():
    """scripts/aot_flash.py as a module (its HLO counters and `keep_layers`)."""
    import importlib.util

    if "aot_flash" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "aot_flash", os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_flash.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["aot_flash"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["aot_flash"]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device copy bandwidth in bytes/s (read + write), a jitted elementwise pass over `nbytes`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0 + 0.0)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(ts))


_PARAMS = {}


def random_stored_params(cfg, seed: int = 0) -> dict:
    """Random parameters in the checkpoint's stored formats, made on the device leaf by leaf (no host
    copy, no quantization: a flash-sized cut would need the float weights on the host otherwise).
    MXFP4 weights: random bytes (every byte is two valid e2m1 codes); fp8 e4m3: random bits below 2 in
    magnitude (no NaN code); E8M0 scales: 2^-9 .. 2^-4; bf16 / fp32 tensors: N(0, std²) (+1 where the
    initializer says so); ones / zeros as declared; the Engram token map: random ids in range; the
    load-time bf16 copy of ``wo_a`` dequantized from its pair. The values are meaningless; the step's
    work (and so its time) does not depend on them — except routing, which random gates spread
    roughly uniformly over the experts."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import quant
    from dsv41_jax.model.params import P, declare_params
    from dsv41_jax.model.weights import Fp8, Mxfp4

    key = jax.random.key(seed, impl="rbg")
    counter = [0]

    def nxt():
        counter[0] += 1
        return jax.random.fold_in(key, counter[0])

    @functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
    def make(k, shape, dtype, init, std):
        if init == "mxfp4":
            return jax.random.bits(k, shape, jnp.uint8)
        if init in ("fp8", "fp8_rows"):
            b = jax.random.bits(k, shape, jnp.uint8) & 0xBF  # exponent field <= 7: |v| < 2, no NaN code
            return jax.lax.bitcast_convert_type(b, quant.FP8)
        if init.endswith("scale") and jnp.dtype(dtype) == jnp.dtype(quant.E8M0):
            return jax.lax.bitcast_convert_type(jax.random.randint(k, shape, 118, 124).astype(jnp.uint8), quant.E8M0)
        if init == "token_map":
            return jax.random.randint(k, shape, 0, cfg.engram_compressed_vocab_size, jnp.int32)
        if init in ("ones", "zeros"):
            return jnp.full(shape, 1 if init == "ones" else 0, dtype)
        z = jax.random.normal(k, shape, jnp.float32) * std
        return (z + 1.0 if init in ("normal_one", "hc_scale") else z).astype(dtype)

    def walk(node):
        if isinstance(node, P):
            return make(nxt(), tuple(node.shape), jnp.dtype(node.dtype).name, node.init, float(node.std or 0.0))
        if isinstance(node, Fp8):
            w, s = walk(node.weight), walk(node.scale)
            # `fp8_linear_bf16_decl`: the exact dequantized copy of the pair
            return Fp8(w, s, None if node.bf16 is None else quant.dequantize_fp8_block(w, s, out_dtype=jnp.bfloat16))
        if isinstance(node, Mxfp4):
            return Mxfp4(walk(node.weight), walk(node.scale))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(declare_params(cfg))


def _part_a_params(cfg, weights: str = "init"):
    """The model's random parameters, built once per config (impl does not change them): `init_params`
    ("init": quantized from host normals, small models) or `random_stored_params` ("random")."""
    import jax

    from dsv41_jax.model.params import init_params

    key = (cfg.replace(impl="auto", deterministic=False), weights)
    if key not in _PARAMS:
        _PARAMS.clear()  # one model at a time (a flash cut fills much of a device)
        _PARAMS[key] = random_stored_params(cfg) if weights == "random" else init_params(cfg, jax.random.key(0))
    return _PARAMS[key]


def plot_part_a(cases: list, path: str) -> None:
    """Step time vs context, one line per (impl, batch, max_context); log-log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series = {}
    for r in cases:
        series.setdefault((r["impl"], r["batch"], r["max_context"]), []).append((r["context"], r["step_ms"]))
    shapes = sorted({(B, mc) for (_, B, mc) in series})  # one colour per (batch, max_context), style per impl
    colours = plt.get_cmap("tab10")
    for (impl, B, mc), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if impl == "xla" else "s",
                color=colours(shapes.index((B, mc)) % 10), linestyle="-" if impl == "xla" else "--",
                label=f"{impl} B={B} max_ctx={mc // 1024}K")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens in the cache)")
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title("tiny decode step per implementation (CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_part_a(args) -> dict:
    """Part (a): real step timings (module doc). Returns the JSON document; with ``--out`` it is also
    written after every case, so a run cut short (a GPU lease, a timeout) keeps what it measured."""
    import jax

    from dsv41_jax.model import ModelConfig

    cfg = _config(args)
    modes = [m for m in args.numerics.split(",") if m] if args.numerics else [None]
    load0 = os.getloadavg()
    gpu = jax.default_backend() == "gpu"
    cases = []
    doc = {"part": "a", "model": args.model, "keep_layers": args.keep_layers, "weights": args.weights,
           "act_dtype": cfg.act_dtype, "jax": jax.__version__, "backend": jax.default_backend(),
           "device": jax.devices()[0].device_kind, "host": platform.node(), "cpu_count": os.cpu_count(),
           "loadavg_before": load0, "page_size": args.page_size, "cases": cases}
    grid = [(impl, mc, B, mode) for impl in [s for s in args.impls.split(";" if ";" in args.impls else ",") if s]
            for mc in _ints(args.max_contexts) for B in _ints(args.batches)
            for mode in modes]  # the modes of one (impl, B) back to back: comparable machine load

    def time_cases(key, prepared=None):
        impl, mc, B, mode = key
        if "copy_bandwidth_GBps" not in doc:  # measured just before the first timing, in the same conditions
            doc["copy_bandwidth_GBps"] = copy_bandwidth(1 << 31 if gpu else 1 << 26) / 1e9
            log(f"[a] device copy bandwidth {doc['copy_bandwidth_GBps']:.1f} GB/s ({jax.devices()[0].device_kind})")
        cm = cfg if mode is None else _with_numerics(cfg, mode)
        for r in real_cases(cm, impl, B, mc, _ints(args.contexts), args.page_size, args.iters, args.weights,
                            doc["copy_bandwidth_GBps"] * 1e9, prepared):
            cases.append(r)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(doc, loadavg_after=os.getloadavg()), f, indent=1)
            log(f"[a] impl={impl:<9} {r['numerics']:<22} B={B:<3} max_context={mc:<6} "
                f"context={r['context']:<5} step {r['step_ms']:8.2f} ms  {r['tokens_per_s']:9.1f} tok/s  "
                f"weights {r['weight_GBps']:7.1f} GB/s ({100 * r['frac_copy_bandwidth']:.0f}% of copy)  "
                f"{r['kernel_launches']} launches" + (f"  (compile {r['compile_s']:.1f}s)" if "compile_s" in r else ""))

    if not args.barrier:
        for key in grid:
            time_cases(key)
    else:
        # Compile cases one by one (CPU work: it can overlap other jobs using the device); time them only
        # once the barrier file exists, so the timings and the copy bandwidth run on a device nobody else
        # uses. Cases compiled while the barrier is there are timed at once: a run cut short keeps them.
        t_start, waiting = time.perf_counter(), []

        def barrier_up():
            return os.path.exists(args.barrier)

        for key in grid:
            impl, mc, B, mode = key
            cm = cfg if mode is None else _with_numerics(cfg, mode)
            p = prepare_case(cm, impl, B, mc, _ints(args.contexts), args.page_size, args.weights)
            if p is None:
                continue
            log(f"[a] compiled impl={impl} B={B} max_context={mc}: {p['compile_s']:.1f}s, "
                f"{p['launches']['launches']} launches per step")
            waiting.append((key, p))
            if barrier_up():
                while waiting:
                    time_cases(*waiting.pop(0))
        if waiting:
            log(f"[a] waiting for {args.barrier} (at most {args.barrier_timeout:.0f} s)")
        t_wait = time.perf_counter()
        while waiting and not barrier_up() and time.perf_counter() - t_wait < args.barrier_timeout:
            time.sleep(0.5)
        doc["barrier"] = {"file": args.barrier, "found": barrier_up(),
                          "found_after_s": time.perf_counter() - t_start}
        if not barrier_up():
            log(f"[a] barrier NOT found after {args.barrier_timeout:.0f} s: timing anyway (recorded in the JSON)")
        while waiting:
            time_cases(*waiting.pop(0))
    doc = dict(doc, loadavg_after=os.getloadavg())
    cost = deterministic_cost(cases)
    if cost:
        doc["deterministic_cost"] = cost
        for c in cost:
            log(f"[a] deterministic / bf16: impl={c['impl']:<9} B={c['batch']:<3} max_context={c['max_context']:<6} "
                f"context={c['context']:<5} step x{c['step_ratio']:.2f}")
    return doc


NUMERICS = ("bfloat16", "deterministic", "float32", "exact")


def _with_numerics(cfg, mode: str):
    """`cfg` in one of `NUMERICS` ("deterministic": the bf16 flow with ``deterministic=True``)."""
    if mode not in NUMERICS:
        raise SystemExit(f"--numerics: {mode!r} is not one of {', '.join(NUMERICS)}")
    if mode == "deterministic":
        return cfg.replace(act_dtype="bfloat16", deterministic=True)
    return cfg.replace(act_dtype=mode, deterministic=False)


def deterministic_cost(cases: list) -> list:
    """Per (impl, batch, max_context, context) timed in both the bf16 and the deterministic bf16 mode:
    the deterministic step time over the bf16 one."""
    by = {(r["impl"], r["batch"], r["max_context"], r["context"], r["numerics"]): r for r in cases}
    out = []
    for (impl, B, mc, L, mode), r in by.items():
        d = by.get((impl, B, mc, L, "bfloat16+deterministic"))
        if mode == "bfloat16" and d is not None:
            out.append({"impl": impl, "batch": B, "max_context": mc, "context": L, "bf16_ms": r["step_ms"],
                        "deterministic_ms": d["step_ms"], "step_ratio": d["step_ms"] / r["step_ms"]})
    return out


def _config(args):
    """The preset, with --act-dtype, --no-layer-scan and --keep-layers (`aot_flash.keep_layers`) applied."""
    from dsv41_jax.model import ModelConfig

    cfg = ModelConfig.preset(args.model)
    if args.act_dtype:
        cfg = cfg.replace(act_dtype=args.act_dtype)
    if args.no_layer_scan:
        cfg = cfg.replace(layer_scan=False)
    if args.keep_layers:
        cfg = _aot().keep_layers(cfg, _ints(args.keep_layers))
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--part", choices=("a", "b"), default="b",
                    help="b: abstract flash costs (default); a: real tiny step timings")
    ap.add_argument("--model", default=None, help="config preset (default: flash for b, tiny for a)")
    ap.add_argument("--impls", default="reference,xla", help="comma-separated ModelConfig.impl specs")
    ap.add_argument("--batches", default=None, help="decode batch sizes (rows x 1 token); default 1,64 for b, "
                                                    "1,16,64 for a")
    ap.add_argument("--max-context", type=int, default=65536, help="(b) cache max context (tokens)")
    ap.add_argument("--max-contexts", default="1024,65536", help="(a) max contexts compiled for")
    ap.add_argument("--contexts", default="64,256,1024,4096", help="(a) tokens already in the cache")
    ap.add_argument("--iters", type=int, default=5, help="(a) timed steps per case (median reported)")
    ap.add_argument("--plot", default=None, help="(a) PNG path (default: the JSON path with .png)")
    ap.add_argument("--page-size", type=int, default=None, help="default 256 for b, 64 for a")
    ap.add_argument("--act-dtype", default=None, help="override ModelConfig.act_dtype")
    ap.add_argument("--numerics", default=None,
                    help="(a) comma-separated numerics modes to time per case: " + ", ".join(NUMERICS)
                         + " (default: the config's); bfloat16,deterministic reports the mode's cost")
    ap.add_argument("--no-layer-scan", action="store_true",
                    help="(b) ModelConfig.layer_scan=False: the unrolled layer loop (default: scan runs of layers)")
    ap.add_argument("--no-compile", action="store_true", help="jaxpr counts only (no XLA compile/memory)")
    ap.add_argument("--keep-layers", default=None,
                    help="a cut of the model: these target layer ids only (scripts/aot_flash.py keep_layers; "
                         "flash 0,1,2,20 = window, window + Engram, ratio-2 source, ratio-1 source)")
    ap.add_argument("--weights", choices=("init", "random"), default=None,
                    help="(a) init_params (host-quantized; default for tiny) or random_stored_params (random "
                         "bits in the stored formats, made on the device; default for other models)")
    ap.add_argument("--barrier", default=None, metavar="FILE",
                    help="(a) compile each case, but time cases (and the copy bandwidth) only once FILE exists: "
                         "compiles overlap other jobs on the device, timings do not (scripts/gpu_check.sh)")
    ap.add_argument("--barrier-timeout", type=float, default=600.0,
                    help="(a) seconds to wait for --barrier's FILE after the last compile, then time anyway")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    a = args.part == "a"
    args.model = args.model or ("tiny" if a else "flash")
    args.batches = args.batches or ("1,16,64" if a else "1,64")
    args.page_size = args.page_size or (64 if a else 256)
    args.weights = args.weights or ("init" if args.model == "tiny" else "random")
    if a:
        doc = run_part_a(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
            log(f"wrote {args.out}")
        plot = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
        if plot and doc["cases"]:
            plot_part_a(doc["cases"], plot)
            log(f"wrote {plot}")
        return 0

    import jax

    cfg = _config(args)
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
    doc = {"part": "b", "model": args.model, "act_dtype": cfg.act_dtype, "layer_scan": cfg.layer_scan,
           "max_context": args.max_context,
           "jax": jax.__version__, "backend": jax.default_backend(), "host": platform.node(),
           "targets": TARGETS, "target_check": targets, "cases": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1, default=float)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
