"""Planning the conversion of a DeepSeek-V4 release directory (``python -m dsv41_jax.convert``, `convert`).

A V4 directory (config.json ``model_type`` ``deepseek_v4``, as `ModelConfig.from_pretrained` detects it) holds
the release names (docs/design/v4.md "Reading the checkpoint"; transformers' ``save_pretrained`` names are read
too, `v4.checkpoint.canonical_name`): fp8 e4m3 weights with e8m0 128x128 block scales, MXFP4 routed experts one
tensor per expert, ``ffn.gate.tid2eid`` hash tables, floats in bf16 / fp32. `make_plan` checks every tensor's
header against `v4.params.declare_params` exactly as the straight read (`v4.checkpoint.load_params`) would
(`v4.checkpoint.stored_dtype`), listing every problem before anything is written, and returns the same
`convert.Plan` the V4.1 planner returns, so the writer (streaming, progress bar, manifest, ``--resume``,
``--verify``, atomic publish) is shared. The arrays are the V4 parameter tree's leaves in the dtypes the straight
read gives (a float as stored, f16 / f64 as fp32, int tables as int32), so `v4.checkpoint.load_orbax` returns
bitwise the straight read's params. Storage ``bf16`` holds each fp8 pair (its 128x128 blocks) and MXFP4 expert
pair dequantized to one bf16 array, re-quantized exactly at load.
"""

from __future__ import annotations

import os

import numpy as np

from dsv41_jax import convert as cv
from dsv41_jax.model import checkpoint as ck
from dsv41_jax.model.params import flatten_names
from dsv41_jax.model.v4 import checkpoint as v4ck


def _param_path(name: str) -> tuple:
    """A dotted leaf name -> its param tree path (list indices as ints)."""
    return tuple(int(k) if k.isdigit() else k for k in name.split("."))


def _one_line(problems: list, hf_dir: str) -> str:
    """Every tensor problem as one line: how many, a hint when shapes disagree widely, the first three."""
    n_shape = sum(": shape " in p for p in problems)
    hint = (f" ({n_shape} have other shapes than config.json implies: is config.json this model's?)"
            if n_shape >= 3 else "")
    more = f"; ... and {len(problems) - 3} more" if len(problems) > 3 else ""
    return f"{hf_dir}: {len(problems)} tensor problem(s){hint}: " + "; ".join(problems[:3]) + more


def make_plan(hf_dir: str, cfg, storage: str, tp: int, ep: int, specs: dict) -> "cv.Plan":
    """Validate V4 release directory `hf_dir` against `cfg` (headers only) and plan its conversion.

    Raises CheckpointError listing every missing / mis-shaped / wrong-dtype tensor (with its file and what was
    expected), `convert.ConvertError` without tokenizer.json."""
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        raise cv.ConvertError(f"{hf_dir}: no tokenizer.json (the converted checkpoint needs it for the chat "
                              "template)")
    entries = v4ck.file_entries(hf_dir)
    decl = v4ck.release_decl(cfg, entries, hf_dir)
    pairs = v4ck.quant_pairs(cfg, decl) if storage == "bf16" else {}
    scales = {v[1] for v in pairs.values()}
    problems, arrays, items, found = [], {}, [], {}
    leaves = flatten_names(decl)
    kept: dict = {}  # leaf name -> stored dtype
    for name, d in leaves.items():
        files = v4ck.leaf_files(name, d)
        shape = tuple(d.shape[1:]) if files[0][1] is not None else tuple(d.shape)
        dts = set()
        for fn, _ in files:
            e = entries.get(fn)
            if e is None:
                problems.append(f"{fn}: missing from every shard; expected shape {list(shape)} dtype "
                                f"{np.dtype(d.dtype).name}")
                continue
            try:
                dts.add(v4ck.stored_dtype(e, fn, d, shape))
            except ck.CheckpointError as ex:
                problems.append(str(ex))
                continue
            found[fn] = e
        if len(dts) > 1:
            problems.append(f"{name}: its experts' tensors have different dtypes ({', '.join(sorted(map(str, dts)))})")
        elif dts:
            kept[name] = dts.pop()
    if problems:
        raise ck.CheckpointError(_one_line(problems, hf_dir))
    for name, d in leaves.items():
        if name in scales:
            continue  # written with its weight
        files = v4ck.leaf_files(name, d)
        stacked = files[0][1] is not None
        if name in pairs:
            kind, sname, shape, block = pairs[name]
            arrays[name] = cv.array_plan(name, _param_path(name), shape, ck.BF16, stacked, specs, tp, ep)
            sfiles = v4ck.leaf_files(sname, leaves[sname])
            for (fn, e), (sfn, _) in zip(files, sfiles):
                items.append(cv.Item(fn, name, e, kind, [found[fn], found[sfn]], block))
            continue
        dt = kept[name]
        arrays[name] = cv.array_plan(name, _param_path(name), tuple(d.shape), dt, stacked, specs, tp, ep)
        for fn, e in files:
            src = found[fn]
            same = src.np_dtype == dt or (dt == np.dtype(ck.E8M0) and src.np_dtype == ck.U8)
            items.append(cv.Item(fn, name, e, "copy" if same else "cast", [src]))
    used = {e.name for it in items for e in it.src}
    unknown = [e for e in entries.values() if e.name not in used]
    files = sorted({e.file for e in entries.values()})
    hf = ck.HFPlan(hf_dir, cfg, files, found, unknown, [], sum(e.nbytes for e in found.values()))
    return cv.Plan(hf_dir, cfg, hf, storage, tp, ep, arrays, items, sum(i.nbytes for i in items))
