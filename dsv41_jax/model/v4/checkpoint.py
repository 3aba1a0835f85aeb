"""Reading a DeepSeek-V4 safetensors directory into `v4.params.declare_params`'s tree.

Tensor names: the release's (docs/design/v4.md, "Reading the checkpoint": ``embed.weight``, ``head.weight``,
``hc_head_fn``, ``layers.L.attn.kv_norm.weight``, ``layers.L.ffn.experts.E.w1.weight`` ...) and what
transformers' ``DeepseekV4ForCausalLM.save_pretrained`` writes — its reverse renames of the same tensors, with
a ``model.`` prefix that keeps three of them from being reversed (``model.embed_tokens.weight``,
``model.hc_head.hc_fn`` / ``hc_base`` / ``hc_scale``) and the attention's kv_norm written ``attn.norm``
(`canonical_name`). ``mtp.S.*`` tensors are the draft: the MTP layer (`v4.params.mtp_decl`) or, with a ``dspark_*``
config (Flash-0731 / Pro-0813), the DSpark stages (`v4.params.dspark_decl`); a directory without any
(transformers' ``save_pretrained``: it builds no draft) loads without the draft, with one log line.

Dtypes: a quantized declaration (fp8 + e8m0 block scales, MXFP4, int tables) needs that dtype in the file (e8m0
scales also as U8, int tables any integer width); a float declaration takes the file's float tensor as stored
(fp32 stays fp32: transformers saves fp32, and its numerics are what the v4check test compares). Shapes must
match the config. Every problem is a `checkpoint.CheckpointError` naming the tensor and file.

A directory ``python -m dsv41_jax.convert`` made of a V4 release directory (`dsv41_jax.convert_v4`) is read by
`load_orbax`: the same tree, bitwise.
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np

from dsv41_jax.model.checkpoint import (BF16, META_FILE, PARAMS_SUBDIR, CheckpointError, _fmt_problems, _hf_files,
                                        _placer, _requantize_stored, _ts_open, check_family, read_orbax_meta,
                                        read_safetensors_header, read_tensor)
from dsv41_jax.model.codec import E8M0
from dsv41_jax.model.params import P, children, flatten_names
from dsv41_jax.model.weights import Fp8, Mxfp4
from dsv41_jax.model.v4.params import declare_params

log = logging.getLogger(__name__)

_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.")
_STACKED = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(w[123]\.(?:weight|scale))$")  # ours -> E file tensors


def canonical_name(name: str) -> str:
    """A file's tensor name -> the release name our tree uses (module doc)."""
    n = name[len("model."):] if name.startswith("model.") else name
    n = _RENAMES.get(n, n)
    return _KV_NORM.sub(r"\1.kv_norm.", n)


def _entries(path: str) -> dict:
    """{release name: STEntry} over the directory's safetensors files."""
    out = {}
    for f in _hf_files(path)[0]:
        for name, e in read_safetensors_header(f)[0].items():
            c = canonical_name(name)
            if c in out:
                raise CheckpointError(f"{path}: tensor {c!r} appears twice ({out[c].name!r} and {name!r})")
            out[c] = e
    return out


def stored_dtype(e, name: str, decl: P, shape: tuple) -> np.dtype:
    """The dtype a file tensor `e` (release name `name`) is kept in for declaration `decl` of `shape` (module
    doc: a float as stored, f16 / f64 as fp32; an int table as the declared width; a quantized kind as
    declared, e8m0 scales also from U8); CheckpointError naming the tensor and file when it does not fit.
    Reads the header only (shared by `load_params` and the converter's planning)."""
    where = f"{name} in {e.file}"
    if tuple(e.shape) != tuple(shape):
        raise CheckpointError(f"{where}: shape {list(e.shape)}, expected {list(shape)}")
    want = np.dtype(decl.dtype)
    have = e.np_dtype
    if have is None:
        raise CheckpointError(f"{where}: unsupported dtype {e.dtype}")
    if _plain_float(want) and _plain_float(have):
        return have if have in (np.float32, BF16) else np.dtype(np.float32)  # XLA keeps fp32 as it is
    if want.kind == "i" and have.kind in "iu":
        return want
    if want == have or (want == np.dtype(E8M0) and have == np.uint8):
        return want
    raise CheckpointError(f"{where}: dtype {e.dtype}, expected {want.name} (does config.json's "
                          f"quantization_config / expert_dtype match the file?)")


def _read(entries: dict, name: str, decl: P, shape: tuple) -> np.ndarray:
    e = entries.get(name)
    if e is None:
        raise CheckpointError(f"tensor {name!r} is missing (expected {np.dtype(decl.dtype).name} {list(shape)})")
    dt = stored_dtype(e, name, decl, shape)
    if dt == e.np_dtype or (dt == np.dtype(E8M0) and e.np_dtype == np.uint8):
        return read_tensor(e, dt)  # as stored (U8 scales: the same bits as e8m0)
    return read_tensor(e).astype(dt)


def _plain_float(dt) -> bool:
    """bf16 / f16 / f32 / f64 (not the fp8 / e8m0 codes, which are quantized kinds)."""
    return np.dtype(dt) in (BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def file_entries(path: str) -> dict:
    """{release name: STEntry} over directory `path`'s safetensors files (transformers' names canonicalized)."""
    return _entries(path)


def release_decl(cfg, names, path: str) -> dict:
    """`declare_params(cfg)`, without the MTP layers when none of `names` (the tensors or stored arrays present)
    is an ``mtp.*`` one (transformers' ``save_pretrained`` writes none): the checkpoint then loads without the
    draft, with one log line."""
    decl = declare_params(cfg)
    if decl["mtp"] and not any(n.startswith("mtp.") for n in names):
        log.info("%s: no mtp.* tensors: loaded without the MTP draft layer (no MTP speculation)", path)
        decl["mtp"] = []
    return decl


def leaf_files(name: str, decl: P) -> list:
    """[(release tensor name, expert index or None)] a declared leaf is stored in: one tensor per routed expert
    for a stacked expert leaf, else the leaf's own name."""
    m = _STACKED.match(name)
    if not m:
        return [(name, None)]
    return [(f"{m.group(1)}.{e}.{m.group(2)}", e) for e in range(decl.shape[0])]


def quant_pairs(cfg, decl) -> dict:
    """{weight name: (kind, scale name, dequantized shape, block)} of `decl`'s quantized pairs: fp8 weights with
    ``weight_block_size`` block scales ("fp8", block = the block side) and MXFP4 routed experts ("mxfp4",
    [E, out, in], block 32) — what a converted checkpoint of storage ``bf16`` holds dequantized."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, Fp8):
            out[f"{prefix}weight"] = ("fp8", f"{prefix}scale", tuple(node.weight.shape), int(cfg.weight_block_size[0]))
        elif isinstance(node, Mxfp4):
            sh = tuple(node.weight.shape)
            out[f"{prefix}weight"] = ("mxfp4", f"{prefix}scale", sh[:-1] + (2 * sh[-1],), 32)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")

    walk(decl, "")
    return out


def load_params(path: str, cfg, par=None) -> dict:
    """The V4 parameter tree of directory `path` for `cfg` (`v4.params.declare_params`), on the default device, or
    with a mesh plan `par` each leaf read on the host and placed straight onto its sharding (`checkpoint._placer`:
    every device receives only its block)."""
    entries = _entries(path)
    used = set()

    def leaf(name: str, decl: P):
        files = leaf_files(name, decl)
        used.update(n for n, _ in files)
        if files[0][1] is not None:  # stacked routed experts: one file tensor per expert
            return np.stack([_read(entries, n, decl, decl.shape[1:]) for n, _ in files])
        return _read(entries, name, decl, decl.shape)

    decl = release_decl(cfg, entries, path)
    place = _placer(cfg, par)
    flat = {n: place(n, leaf(n, d)) for n, d in flatten_names(decl).items()}
    extra = sorted(set(entries) - used)
    if extra:
        log.warning("%s: %d tensors this config does not use, e.g. %s", path, len(extra), extra[:5])
    return _unflatten(decl, flat, "")


def load_orbax(path: str, cfg, par=None) -> dict:
    """The V4 parameter tree of a directory ``python -m dsv41_jax.convert`` wrote from a V4 release directory
    (`checkpoint.checkpoint_kind` "orbax"): the same leaves, dtypes and bits as `load_params` of the source;
    storage ``bf16`` pairs re-quantized with their block (exact: e4m3·2^k and e2m1·2^k are bf16 values).
    Every missing / mis-shaped array is listed in one CheckpointError before anything is read."""
    meta = read_orbax_meta(path)
    check_family(meta, cfg, path)
    recorded = meta.get("arrays", {})
    pdir = os.path.join(path, PARAMS_SUBDIR)
    decl = release_decl(cfg, recorded, path)
    leaves = flatten_names(decl)
    pairs = quant_pairs(cfg, decl) if meta["storage"] == "bf16" else {}
    scales = {v[1] for v in pairs.values()}
    problems = []
    for name, d in leaves.items():
        if name in scales:
            continue
        shape = pairs[name][2] if name in pairs else tuple(d.shape)
        ok = ({"bfloat16"} if name in pairs else {"bfloat16", "float32"} if _plain_float(d.dtype)
              else {np.dtype(d.dtype).name})
        rec = recorded.get(name)
        want = f"expected shape {list(shape)} dtype {' or '.join(sorted(ok))}"
        if rec is None or not os.path.isdir(os.path.join(pdir, name)):
            problems.append(f"{name}: missing from {pdir}; {want}")
        elif tuple(rec["shape"]) != shape or rec["dtype"] not in ok:
            problems.append(f"{name} in {pdir}: found shape {rec['shape']} dtype {rec['dtype']}; {want}")
    if problems:
        raise CheckpointError(_fmt_problems(problems, path, "converted with another config?" if len(problems) > 2
                                            else ""))
    extra = sorted(set(recorded) - set(leaves))
    if extra:
        log.warning("%s: %d arrays this config does not use were ignored: %s", path, len(extra), ", ".join(extra[:20]))
    flat, place = {}, _placer(cfg, par)
    for name, d in leaves.items():
        if name in scales:
            continue
        arr = _ts_open(os.path.join(pdir, name))
        rec = recorded[name]
        if np.dtype(arr.dtype.numpy_dtype).name != rec["dtype"] or list(arr.shape) != rec["shape"]:
            raise CheckpointError(f"{name} in {pdir}: the stored array is {arr.dtype.name} {list(arr.shape)}; "
                                  f"{META_FILE} records {rec['dtype']} {rec['shape']}")
        if name in pairs:
            kind, sname, _, block = pairs[name]
            q, sc = _requantize_stored(arr, kind, None, block)
            flat[name], flat[sname] = place(name, np.asarray(q)), place(sname, np.asarray(sc))
        else:
            flat[name] = place(name, np.asarray(arr.read().result()))
    return _unflatten(decl, flat, "")


def _unflatten(node, flat: dict, prefix: str):
    if isinstance(node, (Fp8, Mxfp4)):
        return type(node)(**{k: _unflatten(v, flat, f"{prefix}{k}.") for k, v in children(node)})
    if isinstance(node, dict):
        return {k: _unflatten(v, flat, f"{prefix}{k}.") for k, v in node.items()}
    if isinstance(node, list):
        return [_unflatten(v, flat, f"{prefix}{i}.") for i, v in enumerate(node)]
    return flat[prefix[:-1]]


def file_tensors(params: dict, cfg, scale_format: str = "e8m0") -> dict:
    """{release name: numpy array} of a V4 parameter tree: routed experts one tensor per expert, e8m0 scales as
    F8_E8M0 ("e8m0", as the release) or their bits as U8 ("u8")."""
    if scale_format not in ("e8m0", "u8"):
        raise ValueError(f"scale_format must be 'e8m0' or 'u8', got {scale_format!r}")
    out = {}
    for name, a in flatten_names(params).items():
        a = np.asarray(a)
        if a.dtype == np.dtype(E8M0) and scale_format == "u8":
            a = a.view(np.uint8)
        m = _STACKED.match(name)
        if m:
            for e in range(a.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}"] = np.ascontiguousarray(a[e])
        else:
            out[name] = np.ascontiguousarray(a)
    return out


def save_checkpoint(params: dict, cfg, out_dir: str, *, shards: int = 1, tokenizer_dir=None,
                    scale_format: str = "e8m0") -> dict:
    """Write `params` as a V4 release-layout directory: config.json (`config_v4.to_v4_dict`), `shards`
    safetensors files with their index, the tokenizer files. Returns the index dict."""
    from safetensors.numpy import save_file

    from dsv41_jax.model.checkpoint import write_index_and_config

    tensors = file_tensors(params, cfg, scale_format)
    names = list(tensors)
    shards = max(1, min(int(shards), len(names)))
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for k in range(shards):
        fn = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k * len(names) // shards:(k + 1) * len(names) // shards]}
        save_file(part, os.path.join(out_dir, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in part})
    return write_index_and_config(out_dir, weight_map, sum(a.nbytes for a in tensors.values()), cfg, tokenizer_dir)
