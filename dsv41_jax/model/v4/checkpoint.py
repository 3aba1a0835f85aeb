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
"""

from __future__ import annotations

import logging
import re

import jax
import numpy as np

from dsv41_jax.model.checkpoint import BF16, CheckpointError, _hf_files, read_safetensors_header, read_tensor
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


def _read(entries: dict, name: str, decl: P, shape: tuple) -> np.ndarray:
    e = entries.get(name)
    if e is None:
        raise CheckpointError(f"tensor {name!r} is missing (expected {np.dtype(decl.dtype).name} {list(shape)})")
    where = f"{name} in {e.file}"
    if tuple(e.shape) != tuple(shape):
        raise CheckpointError(f"{where}: shape {list(e.shape)}, expected {list(shape)}")
    want = np.dtype(decl.dtype)
    have = e.np_dtype
    if have is None:
        raise CheckpointError(f"{where}: unsupported dtype {e.dtype}")
    if _plain_float(want) and _plain_float(have):
        a = read_tensor(e)
        return a if have in (np.float32, BF16) else a.astype(np.float32)  # float kept as stored (f16 / f64 widened
    # / narrowed to fp32, which XLA keeps as it is)
    if want.kind == "i" and have.kind in "iu":
        return read_tensor(e).astype(want)
    if want == have or (want == np.dtype(E8M0) and have == np.uint8):
        return read_tensor(e, want)
    raise CheckpointError(f"{where}: dtype {e.dtype}, expected {want.name} (does config.json's "
                          f"quantization_config / expert_dtype match the file?)")


def _plain_float(dt) -> bool:
    """bf16 / f16 / f32 / f64 (not the fp8 / e8m0 codes, which are quantized kinds)."""
    return np.dtype(dt) in (BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def load_params(path: str, cfg) -> dict:
    """The V4 parameter tree of directory `path` for `cfg` (`v4.params.declare_params`), on the default device."""
    entries = _entries(path)
    used = set()

    def leaf(name: str, decl: P):
        m = _STACKED.match(name)
        if m:  # stacked routed experts: one file tensor per expert
            names = [f"{m.group(1)}.{e}.{m.group(2)}" for e in range(decl.shape[0])]
            used.update(names)
            return np.stack([_read(entries, n, decl, decl.shape[1:]) for n in names])
        used.add(name)
        return _read(entries, name, decl, decl.shape)

    decl = declare_params(cfg)
    if decl["mtp"] and not any(n.startswith("mtp.") for n in entries):
        log.info("%s: no mtp.* tensors: loaded without the %s draft (no speculation)", path, cfg.draft_kind)
        decl["mtp"] = []
    flat = {n: jax.device_put(leaf(n, d)) for n, d in flatten_names(decl).items()}
    extra = sorted(set(entries) - used)
    if extra:
        log.warning("%s: %d tensors this config does not use, e.g. %s", path, len(extra), extra[:5])
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
    import os

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
