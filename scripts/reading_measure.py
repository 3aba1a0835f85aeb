"""How much code a reader follows through one decode step, counted by tracing.

Traces (does not run) one jitted plain decode step, `decode.extend` at B = 1, T = 1, of a tiny-sized config
that has every kind of layer — a layer-scan run of window-only layers, a KV + index source with Engram, a run
of compressed consumers (tests/test_layer_scan.py's `tiny_runs_cfg`) — in the fp32 flow with every op on its
kernel ("pallas_interpret": the fused layout the H200 runs, traced on a CPU), with `sys.setprofile` on. It
counts:

* functions: the distinct functions (defs, nested defs, lambdas) of ``dsv41_jax/model/`` entered while
  tracing the step (each once, however many layers run it), excluding `config.py` (the config's
  derived properties) — with their source lines (first to last line of the def) and their branch nodes
  (`ast` If / IfExp / For / While / Try / match, and each extra operand of an ``and`` / ``or``; a nested def's
  or lambda's branches count with that function, not its parent);
* files: the model files those functions live in;
* Pallas entry points: the distinct functions of ``dsv41_jax/pallas/`` called directly from model code.

The kernel registry is filled before the trace (`dispatch.registry()`, as a server's start-up does when it
resolves its implementations): registering each kernel (`dispatch.register`, run once per process when
``dsv41_jax.pallas`` is imported) is not part of a step, though an earlier version of this script counted
it (`dispatch.register`: one function, 14 lines, 5 branches on the path); ``--cold`` counts it as
before, for comparison with those numbers.

Reported for the whole of ``model/`` and for the step's *path*: the files that sequence a step and choose
each operation's form (`STEP_FILES`: decode, transformer, layer_scan, plan, attention, moe, linear, mhc,
dispatch), as against the arithmetic they call (codecs, quantization, RoPE, norms, tiling, the indexer,
Engram, the compressor, the cache's stores).

    python scripts/reading_measure.py [--impl SPEC] [--cold] [--json] [--verbose]

Deterministic: the same tree gives the same numbers (tracing is pure Python; nothing is timed).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = "xla,attention=pallas_interpret,mhc=pallas_interpret,moe=pallas_interpret,linear=pallas_interpret"
STEP_FILES = ("decode", "transformer", "layer_scan", "plan", "attention", "moe", "linear", "mhc", "dispatch")
BRANCHES = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try) + ((ast.Match,) if hasattr(ast, "Match") else ())


def _config():
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.model.config import _engram_rows

    t = ModelConfig.preset("tiny")
    return t.replace(num_hidden_layers=5, compress_ratios=(0, 0, 2, 2, 2, 0), kv_source_layer_ids=(2,),
                     index_source_layer_ids=(2,), candidate_source_layer_id=None, engram_layer_ids=(2,),
                     engram_num_embeddings=tuple(_engram_rows((2,), 4, 2, 50)), num_nextn_predict_layers=1,
                     dspark_target_layer_ids=(2, 3, 4), name="tiny_runs", act_dtype="float32")


def _trace_step(impl: str, cold: bool = False):
    """Trace `decode.extend` (one token, one row) under a profiler; returns {(file, firstline, name): (code,
    caller file)} of every Python call seen. cold: the kernel registry is filled during the trace (module doc)."""
    import jax

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import dispatch
    from dsv41_jax.model import decode as dec
    from dsv41_jax.model import layer_scan
    from dsv41_jax.model.params import param_shapes

    cfg = _config().replace(impl=impl)
    ccfg = kvc.CacheConfig(page_size=8, num_pages=12, max_slots=2, max_pages_per_seq=4)
    params = layer_scan.prepare(param_shapes(cfg), cfg)
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    batch = {"tokens": jax.ShapeDtypeStruct((1, 1), "int32"), "start": jax.ShapeDtypeStruct((1,), "int32"),
             "n_new": jax.ShapeDtypeStruct((1,), "int32"), "slot": jax.ShapeDtypeStruct((1,), "int32"),
             "page_table": jax.ShapeDtypeStruct((1, ccfg.max_pages_per_seq), "int32")}
    seen: dict = {}

    def prof(frame, event, _arg):
        if event != "call":
            return
        co = frame.f_code
        key = (co.co_filename, co.co_firstlineno, co.co_name)
        if key not in seen:
            back = frame.f_back
            seen[key] = (co, back.f_code.co_filename if back is not None else "")

    step = jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, ccfg))
    if not cold:
        dispatch.registry()
    sys.setprofile(prof)
    try:
        step.trace(params, state, batch)
    finally:
        sys.setprofile(None)
    return seen


def _func_nodes(path: str) -> dict:
    """{(firstline, name): ast node} of every def / lambda in a file (firstline as the code object has it)."""
    tree = ast.parse(open(path).read())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            out[(first, node.name)] = node
            out[(node.lineno, node.name)] = node
        elif isinstance(node, ast.Lambda):
            out.setdefault((node.lineno, "<lambda>"), node)
    return out


def _branches(node) -> int:
    """Branch nodes of one function, not descending into nested defs / lambdas (counted on their own)."""
    n = 0
    stack = list(ast.iter_child_nodes(node))
    while stack:
        x = stack.pop()
        if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(x, BRANCHES):
            n += 1
        elif isinstance(x, ast.BoolOp):
            n += len(x.values) - 1
        elif isinstance(x, ast.comprehension):
            n += len(x.ifs)
        stack.extend(ast.iter_child_nodes(x))
    return n


def measure(impl: str = KERNELS, cold: bool = False) -> dict:
    sys.path.insert(0, ROOT)
    model_dir = os.path.join(ROOT, "dsv41_jax", "model") + os.sep
    pallas_dir = os.path.join(ROOT, "dsv41_jax", "pallas") + os.sep
    seen = _trace_step(impl, cold)
    funcs, entries, nodes = [], set(), {}
    for (path, first, name), (_co, caller) in seen.items():
        if path.startswith(pallas_dir) and caller.startswith(model_dir):
            entries.add(f"{os.path.relpath(path, ROOT)}:{name}")
        if not path.startswith(model_dir) or path.endswith(os.sep + "config.py"):
            continue
        if path not in nodes:
            nodes[path] = _func_nodes(path)
        node = nodes[path].get((first, name))
        if node is None:  # a comprehension / genexpr scope: part of its function
            continue
        lines = node.end_lineno - node.lineno + 1
        funcs.append({"file": os.path.relpath(path, ROOT), "name": name, "line": node.lineno, "lines": lines,
                      "branches": _branches(node)})
    funcs.sort(key=lambda f: (f["file"], f["line"]))
    files = sorted({f["file"] for f in funcs})
    path = [f for f in funcs if os.path.basename(f["file"])[:-3] in STEP_FILES]
    return {"impl": impl, "cold": cold, "functions": len(funcs), "lines": sum(f["lines"] for f in funcs),
            "branches": sum(f["branches"] for f in funcs), "files": len(files),
            "path": {"functions": len(path), "branches": sum(f["branches"] for f in path),
                     "lines": sum(f["lines"] for f in path), "files": len({f["file"] for f in path})},
            "pallas_entry_points": len(entries), "entry_points": sorted(entries),
            "per_file": {p: {"functions": sum(f["file"] == p for f in funcs),
                             "lines": sum(f["lines"] for f in funcs if f["file"] == p),
                             "branches": sum(f["branches"] for f in funcs if f["file"] == p)} for p in files},
            "detail": funcs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default=KERNELS, help="ModelConfig.impl of the traced step (default: every op on "
                                                    "its kernel, interpreted)")
    ap.add_argument("--cold", action="store_true", help="fill the kernel registry during the trace (this script's "
                                                        "earlier count)")
    ap.add_argument("--json", action="store_true", help="print the whole result, per function, as JSON")
    ap.add_argument("--verbose", action="store_true", help="also list each function counted, with its branches and "
                                                           "lines (path files marked *)")
    args = ap.parse_args(argv)
    m = measure(args.impl, args.cold)
    if args.json:
        print(json.dumps(m, indent=1))
        return 0
    print(f"impl {m['impl']}" + (" (cold: the kernel registry filled during the trace)" if m["cold"] else ""))
    print(f"{m['functions']} functions, {m['branches']} branches, {m['lines']} lines in {m['files']} model files; "
          f"{m['pallas_entry_points']} Pallas entry points")
    q = m["path"]
    print(f"the step's path ({', '.join(STEP_FILES)}): {q['functions']} functions, {q['branches']} branches, "
          f"{q['lines']} lines in {q['files']} files")
    for p, c in m["per_file"].items():
        print(f"  {p}: {c['functions']} functions, {c['branches']} branches, {c['lines']} lines")
        if args.verbose:
            star = "*" if os.path.basename(p)[:-3] in STEP_FILES else " "
            for f in m["detail"]:
                if f["file"] == p:
                    print(f"    {star} {f['name']:<32} line {f['line']:>4}: {f['branches']:>3} branches, "
                          f"{f['lines']:>4} lines")
    for e in m["entry_points"]:
        print(f"  entry {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
