#!/usr/bin/env python
"""Lower and compile the decode step of the full model for a real mesh, allocating no weights.

    python scripts/aot_flash.py --tp 2 --ep 4 [--engram-host-table] [--batch 64 --context 65536]
    python scripts/aot_flash.py --dp 8 [--tp T] [--moe-a2a-backend all_to_all]   # data-parallel attention

The mesh is made of fake host CPU devices (``--xla_force_host_platform_device_count``, set here
before JAX starts; ``--devices`` defaults to tp x ep, or dp x tp with ``--dp``: data-parallel attention,
`parallel.dp`: the batch's requests and their whole state split over the dp ranks, experts and Engram
rows over all devices, the MoE dispatched by ``--moe-a2a-backend``). Parameters are `jax.ShapeDtypeStruct`s with
the rules' shardings (`parallel.rules.param_shapes`), the cache is `eval_shape`d for ``--batch``
requests of ``--context`` tokens, and `decode.jitted_extend` (B rows x T tokens, the serving step) is
lowered and compiled. Printed (a table on stdout, everything in the JSON of ``--out``):

* parameter bytes: checkpoint total (`param_stats`), the placed tree's global total of checkpoint tensors
  (with Engram row padding) and of the load-time derived copies (``wo_a.bf16``), per device (max / min
  over devices, everything placed), and the host-table bytes with ``--engram-host-table``;
* cache bytes per device (replicated, see `parallel.rules`; split over the ranks with ``--dp``) for the batch
  and context, and how many requests of ``--context`` tokens fit next to the parameters (``fit_requests``);
* the MoE's collective bytes per device and step by backend, from shapes (`moe_dispatch.moe_collective_bytes`);
* with ``--attention-cost``: attention's own per-device FLOPs and bytes, isolated by compiling the attention
  sublayers alone (`attention_layers`: every layer's projections, compressor, indexer and sparse attention over
  the window ring and the selected compressed entries, on one normed input; no Engram, mHC, MoE or head) at the
  step's B x T and ``--context``, on this mesh and as today's ``--ep <devices>`` lays it out on the same
  devices (batch and cache replicated), and reading XLA's cost analysis of each (`attention_cost`; fake CPU
  devices only: the compile-only GPU executable has no cost analysis). The attention weights per device are
  printed beside them: read once per step whatever the rows, they are the part of the bytes no row split divides;
* ``--moe-a2a-backend ragged`` compiles only for a GPU target (``--gpu-target``): on fake CPU devices it is refused
  before tracing (XLA:CPU cannot run ``ragged_all_to_all``);
* the prefix cache's snapshot pool per device (``--radix-cache-snapshots`` rows, default 4 x batch and at
  least 64, as the server's default; placed by the cache's rules) and what one point costs, and the DSpark draft per device:
  its parameters (the ``mtp`` stages, part of the parameter totals) and its rings for the batch's slots;
  ``--memory-only`` stops there (no lowering or compiling: seconds instead of minutes);
* XLA's memory analysis of the compiled step (arguments, outputs, temporaries, generated code) and its
  cost analysis (FLOPs, bytes accessed — per device: the SPMD program is the per-device program);
* collective bytes per device per step, summed from the compiled HLO's all-reduce / all-gather /
  all-to-all / reduce-scatter / collective-permute results, by kind, and the largest groups by source
  (kind, result type, JAX op name: `collective_sources`);
* whether it fits an H200 (``--hbm-gib``, 141 GB by default, minus ``--reserve-gib``);
* kernel launches per step, counted from the compiled HLO (`kernel_launches`); with ``--kernel-table``
  (GPU target) every kernel in order with its grid and JAX source (`kernel_table`), and the counts by
  source function.

``--gpu-target scripts/gpu_specs/h200.txtpb`` compiles for compile-only CUDA devices instead of fake
CPU ones (`gpu_target_devices`: XLA's GPU compiler on a machine without a GPU; needs the CUDA PJRT
plugin of the installed jax, not a project dependency; run with ``JAX_PLATFORMS=cpu``); the memory
analysis and the kernel count are then the GPU executable's.

``--jaxpr-hash gpu`` compiles nothing: it traces the same step as on a GPU (no plugin needed) and reports the
sha256 of its jaxpr, equal with or without ``--gpu-target``; two commits with equal hashes compile the same
program, so the same launch counts (`scripts/step_jaxprs.py --gpu-cells` hashes the documented cells this way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FLAG = "--xla_force_host_platform_device_count"
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e8m0fnu": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2,
          "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _set_devices(n: int) -> None:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_FLAG}={n}"])


_COLLECTIVES = "ragged-all-to-all|all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute"


def collectives(hlo: str):
    """(kind, result type, result bytes, rest of the line) of every collective in an HLO text: an async
    start once, by its results (a type ``((operands), results)`` without the operands); XLA's ``/*index=N*/``
    tuple comments dropped first (their "=" would end the type). A ragged-all-to-all's result is its whole
    receive buffer (sized for the worst case), not the rows sent."""
    hlo = re.sub(r"/\*.*?\*/", "", hlo)
    for m in re.finditer(r"=\s*(\(?[^=]*?)\s+(" + _COLLECTIVES + r")(-start)?\(([^\n]*)", hlo):
        types = re.sub(r"^\(\(.*?\),\s*", "(", m.group(1)) if m.group(3) else m.group(1)
        n = sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", types) if dt in _BYTES)
        yield m.group(2), types, n, m.group(4)


def collective_bytes(hlo: str) -> dict:
    """{kind: bytes} of the collectives' results in an HLO text (tuples summed; async starts once: `collectives`)."""
    out: dict = {}
    for kind, _, n, _ in collectives(hlo):
        out[kind] = out.get(kind, 0) + n
    return out


# Instructions that launch no kernel of their own: data plumbing, control flow (counted through its
# computations), async done-halves.
_NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
              "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "copy-done",
              "all-reduce-done", "all-gather-done", "collective-permute-done", "async-done", "send-done",
              "recv-done", "get-dimension-size"}


def _computations(hlo: str) -> tuple:
    """{name: [instruction lines]} of an HLO module's text, and the entry computation's name."""
    comps, entry, cur = {}, None, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
        elif line.startswith("}"):
            cur = None
        elif cur is not None and "=" in line:
            comps[cur].append(line)
    return comps, entry


# The JAX source functions that say nothing about which model op a kernel belongs to (wrappers, the
# script itself, the jitted entry points): `kernel_table` skips them when naming a kernel's source.
_GENERIC_FRAMES = ("numerics.", "aot_flash.", "decode.jitted", "decode.extend", "tiling.")


def kernel_table(dump_dir: str, module: str = "jit_extend") -> list:
    """The compiled step's kernels in execution order, from an XLA GPU dump (``--xla_dump_to`` with
    ``--xla_dump_hlo_as_text``): one dict per kernel thunk — ``loop`` (how many while bodies it is
    inside), ``blocks`` (thread blocks of its grid; 0 for a copy), ``kernel`` (XLA's or the Pallas call's
    name) and ``source`` (the innermost JAX source frames of its HLO instruction, `file.function:line`,
    wrappers skipped). Static: a loop body's kernels are listed once. `module`: the step's HLO module name
    (`hlo_module_name` of its compiled text: ``jit__lambda`` since the step is `dp.rank_step`'s closure);
    of several dumped modules of that name the largest optimized HLO is the step's."""
    import glob

    found = glob.glob(os.path.join(dump_dir, f"module_*.{module}.*gpu_after_optimizations.txt"))
    if not found:
        raise FileNotFoundError(f"kernel_table: no {module} gpu_after_optimizations.txt in {dump_dir} (a GPU-target "
                                f"compile dumped there?)")
    hlo_path = max(found, key=os.path.getsize)
    thunk_path = hlo_path.split(f".{module}.", 1)[0] + f".{module}.thunk_sequence_after_thunk_passes.txt"
    if not os.path.exists(thunk_path):
        raise FileNotFoundError(f"kernel_table: no {os.path.basename(thunk_path)} in {dump_dir}")
    hlo = open(hlo_path).read()
    thunks = open(thunk_path).read()

    def section(name):
        return hlo.split("\n" + name + "\n", 1)[1].split("\n\n", 1)[0] if "\n" + name + "\n" in hlo else ""

    files = dict(re.findall(r'^(\d+) "([^"]*)"', section("FileNames"), re.M))
    funcs = dict(re.findall(r'^(\d+) "([^"]*)"', section("FunctionNames"), re.M))
    locs = {m[0]: m[1:] for m in re.findall(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)",
                                             section("FileLocations"), re.M)}
    frames = {m[0]: m[1:] for m in re.findall(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)",
                                               section("StackFrames"), re.M)}

    def chain(fid):
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            f, fn, ln = locs[loc]
            out.append(f"{os.path.basename(files[f])[:-3]}.{funcs[fn]}:{ln}")
            fid = parent
        specific = [c for c in out if not c.startswith(_GENERIC_FRAMES)]
        return specific or out[:1]  # a wrapper's frame when nothing more specific is recorded

    frame_of = {m.group(1).replace(".", "_"): m.group(2) for m in re.finditer(
        r"^\s*%([\w.\-]+) = [^\n]*? (?:fusion|custom-call|copy|sort|copy-start)\([^\n]*?stack_frame_id=(\d+)", hlo, re.M)}
    rows, whiles = [], []
    for line in thunks.splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() in ("condition:", "body:") or not line.strip():  # a while's parts, written unindented
            continue
        while whiles and indent <= whiles[-1]:
            whiles.pop()
        if re.match(r"\s*\d+: kWhile\b", line):
            whiles.append(indent)
            continue
        m = re.search(r"(k\w+)\s+\[[^\]]*\]\s+(\S+)(?: grid: \[(\d+), (\d+), (\d+)\])?", line)
        if not m:
            continue
        if m.group(1) not in ("kCustomKernel", "kKernel", "kCopy"):
            continue
        name = m.group(2)
        blocks = math.prod(int(m.group(i)) for i in (3, 4, 5)) if m.group(3) else 0
        rows.append({"loop": len(whiles), "blocks": blocks, "kernel": name,
                     "source": " < ".join(chain(frame_of.get(name, ""))[:3])})
    return rows


def hlo_module_name(hlo: str) -> str:
    """The module name of a compiled HLO text (its first line: ``HloModule <name>, ...``)."""
    m = re.match(r"HloModule ([^\s,]+)", hlo)
    if not m:
        raise ValueError(f"hlo_module_name: not an HLO module text: {hlo[:60]!r}")
    return m.group(1)


def kernel_sources(rows: list) -> dict:
    """{the innermost source function of a kernel (`file.function`, or its name if none): kernels} of
    `kernel_table` rows, most first."""
    counts: dict = {}
    for r in rows:
        key = r["source"].split(" < ")[0].rsplit(":", 1)[0] if r["source"] else re.sub(r"([_.]+\d+)+$", "", r["kernel"])
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def kernel_launches(hlo: str) -> dict:
    """Kernels one execution of a compiled HLO module launches, counted statically from its text: every
    instruction that is not plumbing (`_NO_LAUNCH`: fusions, custom calls — Triton / cuBLAS / Pallas —,
    copies, collectives, sorts, ...) counts once; a ``while`` counts its body and condition per trip
    (XLA's ``known_trip_count``; a loop without one counts once and is reported), a ``conditional`` its
    costliest branch, a ``call`` its callee. Returns {"launches", "whiles_without_trip_count",
    "by_opcode"} (launches by opcode, through loops)."""
    comps, entry = _computations(hlo)
    unknown = [0]

    def opcode(line):
        # (a long tuple type carries /*index=N*/ comments, whose "=" the pattern would stop at: a while over a
        # carry of six or more arrays was skipped, its body never counted)
        m = re.search(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(", re.sub(r"/\*.*?\*/", "", line))
        return m.group(1) if m else None

    def count(name, depth=0):
        by: dict = {}
        for line in comps.get(name, []):
            op = opcode(line)
            if op is None:
                continue
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if n is None:
                    unknown[0] += 1
                trips = int(n.group(1)) if n else 1
                for key, k in (("body", trips), ("condition", trips + 1)):
                    callee = re.search(rf"{key}=%?([\w.\-]+)", line)
                    for o, c in (count(callee.group(1), depth + 1).items() if callee else ()):
                        by[o] = by.get(o, 0) + k * c
            elif op == "conditional":
                names = re.findall(r"%([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", line) or
                                                     re.search(r"(true_computation=\S+ false_computation=\S+)",
                                                               line.replace(",", ""))).group(1))
                best = max((count(b, depth + 1) for b in names), key=lambda d: sum(d.values()), default={})
                for o, c in best.items():
                    by[o] = by.get(o, 0) + c
            elif op == "call":
                callee = re.search(r"to_apply=%?([\w.\-]+)", line)
                for o, c in (count(callee.group(1), depth + 1).items() if callee else ()):
                    by[o] = by.get(o, 0) + c
            elif op not in _NO_LAUNCH:
                by[op] = by.get(op, 0) + 1
        return by

    by = count(entry) if entry else {}
    return {"launches": sum(by.values()), "whiles_without_trip_count": unknown[0],
            "by_opcode": dict(sorted(by.items(), key=lambda kv: -kv[1]))}


def collective_sources(hlo: str, top: int = 12) -> list:
    """The collectives of an HLO text grouped by (kind, result type, JAX op name from the metadata), the
    largest first: [{"kind", "type", "op_name", "count", "bytes"}] (bytes per step, all instances) — where
    each collective comes from (a `tiling` conditional, a `shard_map` psum, a reshape that reshards, ...)."""
    groups: dict = {}
    for kind, types, n, rest in collectives(hlo):
        name = re.search(r'op_name="([^"]*)"', rest)
        key = (kind, re.sub(r"\{[^}]*\}", "", types).strip(), name.group(1) if name else "")
        g = groups.setdefault(key, {"kind": key[0], "type": key[1], "op_name": key[2], "count": 0, "bytes": 0})
        g["count"] += 1
        g["bytes"] += n
    return sorted(groups.values(), key=lambda g: -g["bytes"])[:top]


def _cost(compiled) -> dict:
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    return {k: float(v) for k, v in (c or {}).items() if k in ("flops", "bytes accessed", "transcendentals")}


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
            "generated_code_size_in_bytes")
    return {k: int(getattr(m, k)) for k in keys if m is not None and hasattr(m, k)}


def keep_layers(cfg, keep):
    """`cfg` cut to the target layers `keep` (ascending ids, renumbered 0..; DSpark dropped): the same
    layer kinds at the same sizes, for a quick look at what a layer costs (compiles in ~1/10 the time)."""
    keep = sorted(set(keep))
    if not keep or keep[0] < 0 or keep[-1] >= cfg.num_hidden_layers:
        raise ValueError(f"--keep-layers: ids must be in 0..{cfg.num_hidden_layers - 1}")
    new = {old: i for i, old in enumerate(keep)}
    eng = [(new[i], rows) for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if i in new]
    cand = cfg.candidate_source_layer_id
    return cfg.replace(
        num_hidden_layers=len(keep), compress_ratios=tuple(cfg.compress_ratios[i] for i in keep),
        kv_source_layer_ids=tuple(new[i] for i in cfg.kv_source_layer_ids if i in new),
        index_source_layer_ids=tuple(new[i] for i in cfg.index_source_layer_ids if i in new),
        candidate_source_layer_id=new.get(cand) if cand is not None else None,
        engram_layer_ids=tuple(i for i, _ in eng), engram_num_embeddings=tuple(r for _, r in eng),
        num_nextn_predict_layers=0, dspark_target_layer_ids=())


def placed_bytes(cfg, params) -> tuple:
    """(all placed device bytes, of which load-time derived leaves) of a placed / abstract params tree,
    global (every shard once). Derived = the leaves not in the checkpoint (`params.P.in_checkpoint`:
    ``wo_a.bf16``, ``derived.*``), so placed − derived is the checkpoint's tensors as placed."""
    import jax.numpy as jnp

    from dsv41_jax.model.params import declare_params, flatten_names

    def nbytes(x):
        return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize if hasattr(x, "dtype") else 0  # HostTable: 0

    decl = flatten_names(declare_params(cfg))
    flat = flatten_names(params)
    placed = sum(nbytes(x) for x in flat.values())
    derived = sum(nbytes(x) for n, x in flat.items() if n in decl and not decl[n].in_checkpoint)
    return placed, derived


def gpu_target_devices(spec_path: str, n: int) -> list:
    """n compile-only CUDA devices described by a GpuTargetConfigProto text file (e.g.
    scripts/gpu_specs/h200.txtpb), on a machine without a GPU: XLA's GPU compiler then builds the
    same executable as on that GPU (no autotuning: default GEMM configs). Needs the CUDA PJRT plugin
    of the installed jax (``pip install jax-cuda12-plugin==<jax version>``, not a project
    dependency); run with JAX_PLATFORMS=cpu so that no GPU client is started."""
    from jax.experimental import topologies

    with open(spec_path) as f:
        spec = f.read()
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x1x{n}")
    except Exception as e:  # no plugin, or a plugin without compile-only topologies
        raise ValueError(f"--gpu-target: no compile-only CUDA topology ({type(e).__name__}: {e}); it needs the "
                         f"CUDA PJRT plugin of this jax (pip install jax-cuda12-plugin==<jax version>)") from e
    return list(topo.devices)


class _traced_as:
    """Trace as a process whose default backend is `backend` (None: unchanged). The model reads
    `jax.default_backend()` at trace time — dispatch "auto" (the Pallas kernels on a GPU), the CPU-only
    weight tiling, mHC's Sinkhorn loop — so a compile for a GPU target must see "gpu" there."""

    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        import jax

        self.orig = jax.default_backend
        if self.backend:
            jax.default_backend = lambda: self.backend

    def __exit__(self, *exc):
        import jax

        jax.default_backend = self.orig


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model.config import ModelConfig
    from dsv41_jax.model.params import param_stats
    from dsv41_jax.parallel import plan as mesh_plan
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.host_table import HostTable
    from dsv41_jax.parallel.mesh import make_mesh

    preset = args.config in ("tiny", "flash")
    cfg = ModelConfig.preset(args.config) if preset else ModelConfig.from_pretrained(args.config)
    if args.dtype:
        cfg = cfg.replace(act_dtype=args.dtype)
    if args.impl:
        cfg = cfg.replace(impl=args.impl)
    if args.keep_layers:
        cfg = keep_layers(cfg, [int(i) for i in args.keep_layers.split(",")])
    n_dev = _mesh_devices(args)
    devices = gpu_target_devices(args.gpu_target, n_dev) if args.gpu_target else jax.devices("cpu")
    mesh = make_mesh(args.tp, args.ep, args.dp, cfg=cfg, devices=devices)
    par = mesh_plan.MeshPlan.of(mesh, args.moe_a2a_backend)
    if par.moe_a2a_backend == "ragged" and not args.gpu_target and not args.memory_only:
        # refused before tracing (the model would refuse it there too, `moe_dispatch`), never replaced
        raise ValueError("--moe-a2a-backend ragged: XLA:CPU cannot run ragged_all_to_all; compile it for GPUs "
                         "with --gpu-target scripts/gpu_specs/h200.txtpb (or use --memory-only / all_to_all)")
    params = rules.param_shapes(cfg, mesh)
    host_bytes = 0
    if args.engram_host_table:
        layers = []
        for i, lp in enumerate(params["layers"]):
            if "engram" in lp:
                e = lp["engram"]["embed"]
                rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]  # host: unpadded
                t = HostTable.abstract((rows,) + e["weight"].shape[1:], (rows,) + e["scale"].shape[1:])
                host_bytes += t.nbytes
                lp = dict(lp, engram=dict(lp["engram"], embed=t))
            layers.append(lp)
        params = dict(params, layers=layers)
    from dsv41_jax.model import layer_scan

    params = layer_scan.prepare(params, cfg)  # as the engine holds them (runs stacked at load)
    ps = args.page_size
    per_seq = -(-args.context // ps)
    # every rank its requests' pages plus its null page (`cache.rank_pages`)
    ccfg = kvc.CacheConfig(page_size=ps, num_pages=args.batch * per_seq + args.dp, max_slots=args.batch,
                           max_pages_per_seq=per_seq, dp=args.dp)
    ccfg.validate(cfg)
    cache_sh = rules.cache_shardings(cfg, ccfg, mesh)
    cache = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                   jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg)), cache_sh)
    bsh = rules.batch_shardings(mesh)
    B, T = args.batch, args.tokens
    shapes = {"tokens": (B, T), "start": (B,), "n_new": (B,), "slot": (B,), "page_table": (B, per_seq)}
    batch = {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=bsh[k]) for k, v in shapes.items()}

    stats = param_stats(cfg)
    per_dev = rules.param_bytes_per_device(params)
    cache_dev = rules.param_bytes_per_device(cache)
    extra = _snapshot_and_draft(cfg, ccfg, mesh, params, args)
    placed, derived = placed_bytes(cfg, params)
    rep = {
        "config": cfg.name, "keep_layers": args.keep_layers, "act_dtype": cfg.act_dtype, "tp": args.tp, "ep": args.ep,
        "dp": args.dp, "moe_a2a_backend": par.moe_a2a_backend,
        "devices": n_dev, "engram_host_table": bool(args.engram_host_table), "batch": args.batch,
        "tokens": args.tokens, "context": args.context, "page_size": ps,
        "param_bytes_checkpoint": stats["bytes"],
        "param_bytes_placed_global": placed - derived + host_bytes,  # checkpoint tensors as placed (+ row padding)
        "param_bytes_derived": derived,  # load-time copies (wo_a.bf16, the Engram token map), global
        "param_bytes_per_device_max": max(per_dev.values()), "param_bytes_per_device_min": min(per_dev.values()),
        "engram_host_bytes": host_bytes,
        "cache_bytes_per_device": max(cache_dev.values()),
        **extra,
        "moe_collective_bytes": moe_bytes(cfg, args, n_dev, par.moe_a2a_backend),
    }
    budget = (args.hbm_gib - args.reserve_gib) * 2**30
    rep["fit_requests"] = fit_requests(rep, budget, args)
    if args.attention_cost:
        rep["attention_cost"] = attention_cost(cfg, args, devices)
    if args.memory_only:
        need = (rep["param_bytes_per_device_max"] + rep["cache_bytes_per_device"]
                + rep["snapshot_pool_bytes_per_device"] + rep["dspark_rings_bytes_per_device"])
        rep["device_bytes_needed"] = need
        rep["fits"] = {"hbm_bytes": int(args.hbm_gib * 2**30), "budget_bytes": int(budget), "fits": need <= budget,
                       "without": "XLA temporaries (compile to see them)"}
        return rep
    t0 = time.perf_counter()
    step = mesh_plan.jitted_extend(cfg, ccfg, False, par, args.engram_host_table)
    if args.jaxpr_hash:
        import hashlib

        with _traced_as("gpu" if args.gpu_target or args.jaxpr_hash == "gpu" else None):
            text = str(jax.make_jaxpr(step)(params, cache, batch))
        # CPU devices name their default memory kind in a sharding, compile-only CUDA ones do not: the same program
        text = text.replace(", memory_kind=device)", ")")
        rep["jaxpr_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return rep
    with _traced_as("gpu" if args.gpu_target else None):
        lowered = step.lower(params, cache, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = _memory(compiled)
    hlo = compiled.as_text()
    rep.update({
        "memory_analysis": mem, "cost_analysis": _cost(compiled),
        "collective_bytes": collective_bytes(hlo),
        "collective_sources": collective_sources(hlo),
        "target": "cuda " + devices[0].device_kind if args.gpu_target else "cpu", "impl": cfg.impl,
        "kernel_launches": kernel_launches(hlo), "hlo_module": hlo_module_name(hlo),
        "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
    })
    need = (rep["param_bytes_per_device_max"] + rep["cache_bytes_per_device"] + mem.get("temp_size_in_bytes", 0)
            + rep["snapshot_pool_bytes_per_device"] + rep["dspark_rings_bytes_per_device"])
    rep["device_bytes_needed"] = need
    rep["fits"] = {"hbm_bytes": int(args.hbm_gib * 2**30), "budget_bytes": int(budget), "fits": need <= budget}
    return rep


def attention_layers(params, state, batch, cfg, ccfg, par):
    """The attention sublayers alone of every layer of `cfg`, on one step's batch: for each layer
    `decode.attention_cached` (q / kv projections and codes, the compressor and its store writes, the
    indexer, the sparse attention over window ring + selected compressed entries, the output projection)
    on the same normed input ``batch["x"]`` [B, T, D] (what the attention sees after mHC's pre-mix, which
    is not attention work). No Engram, mHC, MoE or head. Returns (each layer's y [B, T, D], the cache with
    the layers' writes, the window codes and partial groups left for `commit`): every output leads with
    the batch rows or a cache block (`parallel.dp.rank_step`'s contract), and nothing is dead code."""
    from dsv41_jax.model import decode as dec
    from dsv41_jax.model import tiling
    from dsv41_jax.model.plan import StepPlan

    with tiling.on_mesh(par):
        dt, tokens, positions, valid, st, pend, _ = dec._step_setup(state, batch, cfg, False)
        step = StepPlan.of(cfg, par, tokens.shape, ccfg.kv_cache_dtype, keep_all=True)
        ctx = {"topk": {}, "cand": None}
        x = par.replicated(batch["x"]) if par is not None else batch["x"]  # as `transformer.enter` hands it
        ys = []
        for i in range(cfg.num_hidden_layers):
            y, (st, ctx, _, pend) = dec.attention_cached(step, params["layers"][i]["attn"], x,
                                                       cfg.layer_plan(i), st, ctx, batch, positions, valid, cfg,
                                                       ccfg, dt, pend)
            ys.append(y)
    return tuple(ys), st, tuple(w for w in pend.window if w is not None), pend.partial


def attention_cost(cfg, args, devices) -> dict:
    """XLA's cost analysis (per device: the SPMD program is one device's) of `attention_layers` compiled
    for the step's B x T at ``--context``, twice on the same devices: as this run lays it out (``--dp``:
    one program per rank, `parallel.dp.rank_step`, each rank its B/D rows and its cache block) and as
    today's ``--ep <devices>`` does (batch and cache replicated, every device every row). Parameters are
    the attention sublayers' only, placed by the rules of each mesh. Returns {"layers", "dp": cost,
    "ep": cost, "ratio": {key: dp / ep}}; each cost also carries ``weight_bytes``, the attention weights
    per device (the part of "bytes accessed" no row split reduces). Fake CPU devices only: XLA:CPU's
    analysis counts its own lowering (fp8 weights dequantized in row tiles), which inflates the
    row-independent bytes; the compile-only GPU executable has no cost analysis (refused)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model.numerics import act_dtype
    from dsv41_jax.parallel import dp as dp_mod
    from dsv41_jax.parallel import plan as mesh_plan
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh

    n = _mesh_devices(args)
    devices = list(devices)[:n]
    B, T, per_seq = args.batch, args.tokens, -(-args.context // args.page_size)
    out = {"layers": cfg.num_hidden_layers}
    for name, (tp, ep, D) in {"dp": (args.tp, 1, args.dp), "ep": (1, n, 1)}.items():
        mesh = make_mesh(tp, ep, D, cfg=cfg, devices=devices)
        par = mesh_plan.MeshPlan.of(mesh, args.moe_a2a_backend if D > 1 else None)
        ccfg = kvc.CacheConfig(page_size=args.page_size, num_pages=B * per_seq + D, max_slots=B,
                               max_pages_per_seq=per_seq, dp=D)
        params = rules.param_shapes(cfg, mesh)
        params = {"layers": [{"attn": lp["attn"]} for lp in params["layers"]]}
        cache = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                       jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg)),
                                       rules.cache_shardings(cfg, ccfg, mesh))
        bsh = rules.batch_shardings(mesh)
        shapes = {"tokens": (B, T), "start": (B,), "n_new": (B,), "slot": (B,), "page_table": (B, per_seq)}
        batch = {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=bsh[k]) for k, v in shapes.items()}
        rows = bsh["tokens"].spec[0]
        batch["x"] = jax.ShapeDtypeStruct((B, T, cfg.hidden_size), act_dtype(cfg),
                                          sharding=NamedSharding(mesh, PartitionSpec(rows, None, None)))

        def fn(params, state, batch, ccfg, par):
            return attention_layers(params, state, batch, cfg, ccfg, par)

        step = dp_mod.rank_step(fn, par, ccfg, jax.tree_util.tree_map(lambda a: a.sharding, params))
        try:
            with _traced_as("gpu" if args.gpu_target else None):
                compiled = jax.jit(step).lower(params, cache, batch).compile()
        except jax.errors.JaxRuntimeError as e:  # e.g. dp x tp on fake CPU devices: XLA:CPU's HLO verifier
            # refuses the weight row tiles' conditionals inside a rank ("Inconsistent conditional sharding")
            raise ValueError(f"--attention-cost: XLA could not compile the attention layers on the {name} mesh: "
                             f"{str(e).splitlines()[0][:200]}") from e
        cost = _cost(compiled)
        if not cost:
            raise ValueError("--attention-cost: XLA gave no cost analysis for this target (the compile-only GPU "
                             "executable has none); run it on fake CPU devices")
        # the attention weights each device holds: read once per step whatever the rows, so DP cannot divide them
        cost["weight_bytes"] = max(rules.param_bytes_per_device(params).values())
        out[name] = cost
    out["ratio"] = {k: out["dp"][k] / out["ep"][k] for k in out["dp"] if out["ep"].get(k)}
    return out


def _mesh_devices(args) -> int:
    """Devices of the mesh asked for: dp x tp under data-parallel attention, else tp x ep."""
    return args.dp * args.tp if args.dp > 1 else args.tp * args.ep


def moe_bytes(cfg, args, n_dev: int, backend: str) -> dict:
    """{backend: the routed experts' collective bytes per device and step} for today's psum ("none": the
    whole batch replicated, experts over ep) and the backend in use, from shapes
    (`moe_dispatch.moe_collective_bytes`; tokens per device = the step's B·T split over all devices)."""
    from dsv41_jax.parallel import moe_dispatch

    tokens = args.batch * args.tokens
    out = {}
    for b in dict.fromkeys(("none", backend)):
        per = tokens // n_dev if b != "none" else -(-tokens // n_dev)
        out[b] = moe_dispatch.moe_collective_bytes(cfg, max(per, 1), n_dev, b)["total"]
    return out


def fit_requests(rep: dict, budget: float, args) -> int:
    """Requests of ``--context`` tokens whose KV / state (cache, DSpark rings and snapshot pool scaled per
    request) fit the device budget next to the parameters, over the whole mesh: per device the state of
    B/dp requests is what `cache_bytes_per_device` etc. measured for the batch."""
    per_req = (rep["cache_bytes_per_device"] + rep["dspark_rings_bytes_per_device"]
               + rep["snapshot_pool_bytes_per_device"]) / (args.batch / args.dp)
    left = budget - rep["param_bytes_per_device_max"]
    return max(0, int(left // per_req)) * args.dp if per_req else 0


def _snapshot_and_draft(cfg, ccfg, mesh, params, args) -> dict:
    """Per device: the prefix cache's snapshot pool (its rows: the cache's per-slot rows, placed by the
    cache's rules as the engine places them) and one point; the DSpark draft's parameters and rings."""
    import jax

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.parallel import rules

    slot_keys = ("window", "partial", "engram_hist", "dspark")
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    draft = bool(cfg.num_nextn_predict_layers) and args.dspark
    if draft:
        from dsv41_jax.model import dspark

        state = jax.eval_shape(lambda: dspark.with_rings(kvc.init_cache(cfg, ccfg), cfg, ccfg))
    rows = {k: state[k] for k in slot_keys if k in state}
    from dsv41_jax.serving.prefix_cache import default_snapshot_rows

    n = args.radix_cache_snapshots if args.radix_cache_snapshots is not None else default_snapshot_rows(args.batch)
    n = -(-n // args.dp) * args.dp  # whole rank blocks (`cache.rank_*`: every rank the same share)

    def sharded(tree, lead):
        shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((lead,) + a.shape[1:], a.dtype), tree)
        sh = rules.state_shardings(shapes, mesh)
        return jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, sh)

    def per_device(tree) -> int:
        d = rules.param_bytes_per_device(tree)
        return max(d.values()) if d else 0

    pool = per_device(sharded(rows, n))
    rings = per_device(sharded({"dspark": state["dspark"]}, kvc.slot_rows(ccfg))) if draft else 0
    return {"snapshot_rows": n, "snapshot_point_bytes_per_device": pool // n,
            "snapshot_pool_bytes_per_device": pool, "dspark": draft,
            "dspark_param_bytes_per_device": per_device(params.get("mtp") or []) if draft else 0,
            "dspark_rings_bytes_per_device": rings}


def _table(rep: dict) -> str:
    g = 2**30
    mesh = (f"dp={rep['dp']} x tp={rep['tp']}" if rep["dp"] > 1 else f"tp={rep['tp']} x ep={rep['ep']}")
    rows = [("mesh", f"{mesh} ({rep['devices']} devices), MoE {rep['moe_a2a_backend']}"
             + (", Engram host table" if rep["engram_host_table"] else "")),
            ("step", f"B={rep['batch']} x T={rep['tokens']}, context {rep['context']}, {rep['act_dtype']}"),
            ("params: checkpoint", f"{rep['param_bytes_checkpoint'] / g:10.2f} GiB"),
            ("params: placed (global)", f"{rep['param_bytes_placed_global'] / g:10.2f} GiB"),
            ("params: per device max", f"{rep['param_bytes_per_device_max'] / g:10.2f} GiB"),
            ("Engram on host", f"{rep['engram_host_bytes'] / g:10.2f} GiB"),
            ("cache per device", f"{rep['cache_bytes_per_device'] / g:10.2f} GiB"),
            (f"requests of {rep['context']} tokens that fit", f"{rep['fit_requests']}"),
            (f"snapshot pool per device ({rep['snapshot_rows']} rows)",
             f"{rep['snapshot_pool_bytes_per_device'] / g:10.2f} GiB ({rep['snapshot_point_bytes_per_device'] / 2**20:.2f} "
             "MiB a point)")]
    if rep["dspark"]:
        rows += [("DSpark draft params per device", f"{rep['dspark_param_bytes_per_device'] / g:10.2f} GiB (in params)"),
                 ("DSpark rings per device", f"{rep['dspark_rings_bytes_per_device'] / g:10.2f} GiB")]
    for k, v in rep.get("memory_analysis", {}).items():
        rows.append((f"XLA {k.replace('_size_in_bytes', '')}", f"{v / g:10.3f} GiB"))
    for k, v in rep.get("cost_analysis", {}).items():
        rows.append((f"cost: {k}", f"{v:.4g}"))
    att = rep.get("attention_cost")
    if att:
        for k in ("flops", "bytes accessed"):
            if k in att["ratio"]:
                rows.append((f"attention {k} per device ({att['layers']} layers)",
                             f"{att['dp'][k]:.4g} vs {att['ep'][k]:.4g} with ep={rep['devices']}: "
                             f"{att['ratio'][k]:.3f}x (1/{1 / att['ratio'][k]:.1f})"))
        rows.append(("attention weights per device", f"{att['dp']['weight_bytes'] / 2**20:.1f} vs "
                                                     f"{att['ep']['weight_bytes'] / 2**20:.1f} MiB (read whatever the rows)"))
    for k, v in rep["moe_collective_bytes"].items():
        rows.append((f"MoE collectives ({k}, shapes)", f"{v / 2**20:10.3f} MiB/step"))
    for k, v in sorted(rep.get("collective_bytes", {}).items()):
        rows.append((f"collective {k}", f"{v / 2**20:10.3f} MiB/step"))
    for src in rep.get("collective_sources", [])[:6]:
        rows.append((f"  {src['kind']} x{src['count']}",
                     f"{src['bytes'] / 2**20:10.3f} MiB  {src['type']}  {src['op_name'][-60:]}"))
    f = rep["fits"]
    rows.append(("fits H200", f"{'yes' if f['fits'] else 'NO'}: needs {rep['device_bytes_needed'] / g:.1f} of "
                              f"{f['budget_bytes'] / g:.1f} GiB"))
    if "lower_s" in rep:
        kl = rep["kernel_launches"]
        ops = ", ".join(f"{k} {v}" for k, v in list(kl["by_opcode"].items())[:6])
        once = kl["whiles_without_trip_count"]
        rows.append(("kernel launches / step", f"{kl['launches']} ({ops})"
                     + (f"; {once} loop(s) counted once" if once else "")))
        rows.append(("target / impl", f"{rep['target']} / {rep['impl']}"))
        rows.append(("lower / compile", f"{rep['lower_s']} s / {rep['compile_s']} s"))
    else:
        rows.append(("(--memory-only)", "not lowered or compiled: no XLA temporaries in 'fits'"))
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel attention ranks (dp x tp devices)")
    ap.add_argument("--moe-a2a-backend", default=None, choices=("none", "all_to_all", "ragged"),
                    help="MoE token dispatch (default: none, all_to_all with --dp)")
    ap.add_argument("--engram-host-table", action="store_true")
    ap.add_argument("--config", default="flash", help="preset (flash, tiny) or a model directory")
    ap.add_argument("--keep-layers", default=None,
                    help="comma list of target layer ids to keep (renumbered; DSpark dropped), e.g. 0,1,2,20 for "
                         "flash: window, window + Engram, ratio-2 source, ratio-1 source")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "exact"), help="act_dtype override")
    ap.add_argument("--impl", default=None, help='ModelConfig.impl spec (default the config\'s: "auto")')
    ap.add_argument("--gpu-target", default=None, metavar="TXTPB",
                    help="compile for compile-only CUDA devices described by this GpuTargetConfigProto "
                         "(scripts/gpu_specs/h200.txtpb) instead of fake CPU devices; needs the CUDA PJRT plugin")
    ap.add_argument("--batch", type=int, default=64, help="decode rows (and cache slots)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per row of the step")
    ap.add_argument("--context", type=int, default=65536, help="context tokens per request (cache size)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--hbm-gib", type=float, default=141 * 1e9 / 2**30, help="device memory (H200: 141 GB)")
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="kept free (runtime, NCCL, fragmentation)")
    ap.add_argument("--devices", type=int, default=None, help="fake CPU devices (default tp x ep, or dp x tp)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--radix-cache-snapshots", type=int, default=None,
                    help="prefix-cache snapshot rows (default 4 x --batch and at least 64, the server's default)")
    ap.add_argument("--dspark", action=argparse.BooleanOptionalAction, default=True,
                    help="count the DSpark draft's rings (and list its parameters); default on")
    ap.add_argument("--attention-cost", action="store_true",
                    help="also compile the attention sublayers alone (every layer's projections, compressor, "
                         "indexer and sparse attention at this B, T and context) on this mesh and on ep over "
                         "the same devices, and print XLA's per-device FLOPs and bytes of each")
    ap.add_argument("--memory-only", action="store_true",
                    help="the per-device memory table only: no lowering or compiling")
    ap.add_argument("--jaxpr-hash", default=None, choices=("cpu", "gpu"),
                    help="no compile: trace the step as on this backend (gpu: \"auto\" resolved as on a GPU, the GPU "
                         "weight layout; no plugin needed) and report the sha256 of its jaxpr (`jaxpr_sha256`). "
                         "Equal hashes at two commits: the same program, so the same compiled launches. One backend "
                         "per process (the step plan and dispatch choices are cached per config, not per backend)")
    ap.add_argument("--kernel-table", default=None, metavar="TSV",
                    help="with --gpu-target: write the compiled step's kernels in order (loop depth, thread "
                         "blocks, kernel, JAX source) to TSV and print the counts by source function (XLA "
                         "dumps to a temporary directory for this)")
    from dsv41_jax.parallel.distributed import add_distributed_args

    add_distributed_args(ap)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    dump = None
    if args.kernel_table:
        if not args.gpu_target or args.memory_only or args.jaxpr_hash:
            ap.error("--kernel-table needs --gpu-target (the kernel thunks are the GPU compiler's) and a compile")
        if "jax" in sys.modules:
            ap.error("--kernel-table: the XLA dump flags must be set before JAX starts (run the script itself)")
        import tempfile

        dump = tempfile.mkdtemp(prefix="aot_flash_dump_")
        os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split() +
                                           [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"])
    if "jax" not in sys.modules:  # the device count must be set before JAX starts
        _set_devices(args.devices or _mesh_devices(args))
    from dsv41_jax.parallel.distributed import initialize_from
    from dsv41_jax.parallel.mesh import MeshError

    try:
        initialize_from(args)
        rep = run(args)
    except (MeshError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dump is not None:
        import shutil

        rows = kernel_table(dump, rep["hlo_module"])
        shutil.rmtree(dump, ignore_errors=True)
        with open(args.kernel_table, "w") as f:
            f.write("loop\tblocks\tkernel\tsource\n")
            f.writelines(f"{r['loop']}\t{r['blocks']}\t{r['kernel']}\t{r['source']}\n" for r in rows)
        rep["kernel_sources"] = kernel_sources(rows)
        print(f"kernels in order: {args.kernel_table} ({len(rows)} kernel thunks, each loop body once); by source:")
        for k, v in list(rep["kernel_sources"].items())[:20]:
            print(f"  {v:4d}  {k}")
    if "jaxpr_sha256" in rep:
        print(f"{rep['jaxpr_sha256']}  {rep['config']} {rep['keep_layers']} B={rep['batch']} T={rep['tokens']} "
              f"context {rep['context']} {args.impl or 'auto'} traced as {args.jaxpr_hash}")
    else:
        print(_table(rep))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
