"""Parameter declarations: every tensor once, with shape, dtype, logical axes and initializer.

The parameter pytree mirrors the checkpoint's names (docs/design/spec.md §8): ``layers.L.attn.wq_a.weight`` lives at
``params["layers"][L]["attn"]["wq_a"].weight``. Two differences from the file, both lossless:
routed experts are stacked along a leading expert axis (``ffn.experts.E.w1.weight`` is
``params[...]["ffn"]["experts"]["w1"].weight[E]``), and ``params["derived"]`` holds tables derived
from the tokenizer (the Engram token map), which the checkpoint does not store. One addition, also not
in the checkpoint: ``attn.wo_a.bf16``, the load-time bf16 dequantization of ``wo_a`` (docs/design/spec.md §3; built
by `init_params` and `checkpoint.load_params` beside the fp8 pair, which the reference still reads).

Dtypes follow the checkpoint: fp8 e4m3 + e8m0 32×32 block scales for dense weights, packed MXFP4
(uint8, low nibble = even element) + e8m0 per-32 scales for routed experts, bf16 / fp32 as docs/design/spec.md §6.

Sharding is declared with logical axis names and mapped to a mesh with Flax Linen's logical-axis
rules (`flax.linen.logical_to_mesh_sharding`); the params themselves are plain pytrees so the forward
pass stays a pure function (no Module objects): dicts, except that a quantized weight is a typed node
(`weights.Fp8`, `weights.Mxfp4`: fields named as the checkpoint's ``weight`` / ``scale``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import quant, quant_np
from dsv41_jax.model.weights import Fp8, Mxfp4
from dsv41_jax.model.codec import E8M0, FP8
from dsv41_jax.model.config import ModelConfig

BF16 = jnp.bfloat16
F32 = jnp.float32
U8 = jnp.uint8

# Logical axis -> mesh axis. "tp" = tensor parallel, "ep" = expert parallel. Unlisted axes replicate.
DEFAULT_LOGICAL_RULES = (
    ("vocab", "tp"),
    ("heads", "tp"),         # q heads (wq_b output), o groups (wo_a output)
    ("o_in", "tp"),          # wo_b input (group-major)
    ("mlp", "tp"),           # shared expert intermediate
    ("experts", "ep"),
    ("experts_gate", "ep"),  # the router's rows (one per expert; replicated under DP attention: parallel/rules.py)
    ("engram_rows", "tp"),   # Engram tables are row-sharded across TP (docs/design/spec.md §5)
    ("embed", None),
    ("q_lora", None),
    ("kv", None),
    ("index", None),
    ("hc", None),
    ("expert_mlp", None),
    ("comp_slot", None),     # DeepSeek-V4: compressor ``ape`` rows
    ("hash_vocab", None),    # DeepSeek-V4: ``tid2eid`` rows (replicated: read locally by token id)
)


@dataclass(frozen=True)
class P:
    """One declared tensor.

    shape/dtype: exactly as stored. axes: one logical axis name (or None) per dim.
    init: initializer kind, see `_init_leaf`. std: scale for random kinds.
    in_checkpoint: False for tables derived at load time (not counted in checkpoint bytes).
    vision_only: read only for image tokens (docs/design/spec.md §8: ``ffn.gate.bias_vl``); the text model never
    reads it, so a text-only release checkpoint may lack it: loaded when present, zeros otherwise.
    """

    shape: tuple
    dtype: Any
    axes: tuple
    init: str = "normal"
    std: float = 0.02
    in_checkpoint: bool = True
    vision_only: bool = False

    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype)


def _cdiv(a, b):
    return -(-a // b)


def fp8_linear_decl(out_dim, in_dim, out_axis=None, in_axis=None):
    """fp8 e4m3 [out, in] weight with its e8m0 [ceil(out/32), ceil(in/32)] block scale."""
    std = 1.0 / math.sqrt(in_dim)
    return Fp8(weight=P((out_dim, in_dim), FP8, (out_axis, in_axis), "fp8", std),
               scale=P((_cdiv(out_dim, 32), _cdiv(in_dim, 32)), E8M0, (out_axis, in_axis), "fp8_scale"))


def fp8_linear_bf16_decl(out_dim, in_dim, out_axis=None, in_axis=None):
    """An fp8 linear that is dequantized to bf16 once at load (docs/design/spec.md §3: ``wo_a``): the file's fp8 weight
    and block scale, plus ``"bf16"`` [out, in], their exact product (not in the checkpoint; built by
    `init_params` and `checkpoint.load_params`). The reference path keeps reading the fp8 pair."""
    d = fp8_linear_decl(out_dim, in_dim, out_axis, in_axis)
    return dataclasses.replace(d, bf16=P((out_dim, in_dim), BF16, (out_axis, in_axis), "dequant_fp8",
                                         in_checkpoint=False))


def mxfp4_experts_decl(n_experts, out_dim, in_dim, out_axis=None, in_axis=None):
    """Stacked MXFP4 experts: uint8 [E, out, in/2] (2 e2m1 per byte) + e8m0 [E, out, in/32]."""
    std = 1.0 / math.sqrt(in_dim)
    return Mxfp4(weight=P((n_experts, out_dim, in_dim // 2), U8, ("experts", out_axis, in_axis), "mxfp4", std),
                 scale=P((n_experts, out_dim, in_dim // 32), E8M0, ("experts", out_axis, in_axis), "mxfp4_scale"))


def _norm(dim, axis=None):
    return {"weight": P((dim,), BF16, (axis,), "ones")}


def _bf16(out_dim, in_dim, out_axis=None, in_axis=None, std=None):
    return {"weight": P((out_dim, in_dim), BF16, (out_axis, in_axis), "normal",
                        std if std is not None else 1.0 / math.sqrt(in_dim))}


def layer_decl(cfg: ModelConfig, layer_id: int) -> dict:
    """Declarations for one target layer or DSpark stage."""
    plan = cfg.layer_plan(layer_id)
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    n, mix = cfg.hc_mult, cfg.hc_mix_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    d: dict = {"attn_norm": _norm(D), "ffn_norm": _norm(D)}
    for s in ("attn", "ffn"):
        d[f"hc_{s}_fn"] = P((mix, n * D), F32, ("hc", "embed"), "normal", 1.0 / math.sqrt(n * D))
        d[f"hc_{s}_base"] = P((mix,), F32, ("hc",), "hc_base", 0.5)
        d[f"hc_{s}_scale"] = P((3,), F32, (None,), "hc_scale", 0.5)
    attn = {
        "attn_sink": P((H,), F32, ("heads",), "normal", 0.5),
        "wq_a": fp8_linear_decl(cfg.q_lora_rank, D, "q_lora", "embed"),
        "q_norm": _norm(cfg.q_lora_rank),
        "wq_b": fp8_linear_decl(H * hd, cfg.q_lora_rank, "heads", "q_lora"),
        "wkv": fp8_linear_decl(hd, D, "kv", "embed"),
        "kv_norm": _norm(hd),
        "wo_a": fp8_linear_bf16_decl(G * R, cfg.o_group_in, "heads", None),
        "wo_b": fp8_linear_decl(D, G * R, "embed", "o_in"),
    }
    if plan.is_kv_source:
        comp = {"wkv": _bf16(hd, D, "kv", "embed"), "norm": _norm(hd)}
        if plan.compress_ratio > 1:
            comp["wgate"] = _bf16(hd, D, "kv", "embed")
        attn["compressor"] = comp
    if plan.is_index_source or plan.is_kv_source:
        idx: dict = {}
        if plan.is_index_source:
            idx["wq_b"] = fp8_linear_decl(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, "index", "q_lora")
            idx["weights_proj"] = _bf16(cfg.index_n_heads, D, "index", "embed")
        if layer_id in cfg.key_owner_ids:
            idx["wk"] = _bf16(cfg.index_head_dim, hd, "index", "kv")
            idx["k_norm"] = _norm(cfg.index_head_dim)
        if idx:
            attn["indexer"] = idx
    d["attn"] = attn
    E = cfg.dspark_n_routed_experts if plan.is_dspark else cfg.n_routed_experts
    I = cfg.moe_intermediate_size
    d["ffn"] = {
        "gate": {"weight": P((E, D), BF16, ("experts_gate", "embed"), "normal", 1.0 / math.sqrt(D)),
                 "bias": P((E,), F32, ("experts_gate",), "normal", 0.1),
                 "bias_vl": P((E,), F32, ("experts_gate",), "zeros", vision_only=True)},
        "experts": {"w1": mxfp4_experts_decl(E, I, D, "expert_mlp", "embed"),
                    "w3": mxfp4_experts_decl(E, I, D, "expert_mlp", "embed"),
                    "w2": mxfp4_experts_decl(E, D, I, "embed", "expert_mlp")},
        "shared_experts": {"w1": fp8_linear_decl(I, D, "mlp", "embed"),
                           "w3": fp8_linear_decl(I, D, "mlp", "embed"),
                           "w2": fp8_linear_decl(D, I, "embed", "mlp")},
    }
    if plan.is_engram:
        k = cfg.engram_layer_ids.index(layer_id)
        rows = cfg.engram_num_embeddings[k]
        de = cfg.engram_head_dim
        d["engram"] = {
            "embed": {"weight": P((rows, de), FP8, ("engram_rows", None), "fp8_rows", 1.0),
                      "scale": P((rows, de // 32), E8M0, ("engram_rows", None), "fp8_rows_scale")},
            "wkv": fp8_linear_decl(n * D + D, cfg.engram_in_dim, "embed", None),
            "q_weight": P((n, D), BF16, ("hc", "embed"), "normal_one", 0.3),
            "k_weight": P((n, D), BF16, ("hc", "embed"), "normal_one", 0.3),
        }
    return d


def fp8_gemm_paths(tree, path=()) -> list:
    """Paths (tuples of keys) of the fp8 GEMM weights (`weights.Fp8`) in a layer's declaration tree (`layer_decl`),
    but wo_a (the one with a bf16 copy, read by the o_proj kernel); the routed experts are `weights.Mxfp4`."""
    if isinstance(tree, Fp8):
        return [path] if tree.bf16 is None else []
    if not isinstance(tree, dict):
        return []
    return [q for k, v in tree.items() for q in fp8_gemm_paths(v, path + (k,))]


def declare_params(cfg: ModelConfig) -> dict:
    """The whole declaration tree (leaves are `P`); a DeepSeek-V4 config's is `v4.params.declare_params`."""
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4 import params as v4  # lazy: it builds on this module's declarations

        return v4.declare_params(cfg)
    V, D = cfg.vocab_size, cfg.hidden_size
    tree: dict = {
        "embed": {"weight": P((V, D), BF16, ("vocab", "embed"), "normal", 1.0)},
        "head": {"weight": P((V, D), BF16, ("vocab", "embed"), "normal", 1.0 / math.sqrt(D))},
        "norm": _norm(D),
        "layers": [layer_decl(cfg, i) for i in range(cfg.num_hidden_layers)],
        "mtp": [],
    }
    S = cfg.num_nextn_predict_layers
    for s in range(S):
        st = layer_decl(cfg, cfg.num_hidden_layers + s)
        if s == 0:
            st["main_proj"] = fp8_linear_decl(D, len(cfg.dspark_target_layer_ids) * D, "embed", None)
            st["main_norm"] = _norm(D)
        if s == S - 1:
            Rm = cfg.dspark_markov_rank
            st["norm"] = _norm(D)
            st["markov_head"] = {"embed": {"weight": P((V, Rm), BF16, ("vocab", None), "normal", 1.0)},
                                 "head": {"weight": P((V, Rm), BF16, ("vocab", None), "normal",
                                                      1.0 / math.sqrt(Rm))}}
            st["confidence_head"] = {"proj": _bf16(1, D + Rm)}
        tree["mtp"].append(st)
    if cfg.engram_layer_ids:
        tree["derived"] = {"engram_token_map": P((V,), jnp.int32, ("vocab",), "token_map", in_checkpoint=False)}
    return tree


def _is_decl(x):
    return isinstance(x, P)


def param_shapes(cfg: ModelConfig) -> dict:
    """Abstract parameter tree (`jax.ShapeDtypeStruct` leaves), allocating nothing."""
    return jax.tree_util.tree_map(lambda p: p.abstract(), declare_params(cfg), is_leaf=_is_decl)


def logical_axes(cfg: ModelConfig) -> dict:
    """Tree of logical-axis tuples, same structure as the params."""
    return jax.tree_util.tree_map(lambda p: p.axes, declare_params(cfg), is_leaf=_is_decl)


def mesh_shardings(cfg: ModelConfig, mesh, rules=DEFAULT_LOGICAL_RULES) -> dict:
    """`NamedSharding` per parameter from the logical axes and `rules` (Flax logical-axis rules).

    A dim whose size does not divide by its mesh axis size is replicated instead (logged by the caller).
    """
    import flax.linen as nn
    from jax.sharding import NamedSharding, PartitionSpec

    def one(p: P):
        spec = nn.logical_to_mesh_axes(p.axes, rules)
        fixed = []
        for dim, ax in zip(p.shape, spec):
            if ax is not None and (ax not in mesh.shape or dim % mesh.shape[ax]):
                ax = None
            fixed.append(ax)
        return NamedSharding(mesh, PartitionSpec(*fixed))

    return jax.tree_util.tree_map(one, declare_params(cfg), is_leaf=_is_decl)


def children(node) -> list:
    """[(key, child)] of a tree node: a dict's items, a list's (index, item), a typed node's (`weights.Fp8`,
    `weights.Mxfp4`) fields that are set, named as in the checkpoint; [] for a leaf."""
    if isinstance(node, dict):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    if isinstance(node, (Fp8, Mxfp4)):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node) if getattr(node, f.name) is not None]
    return []


def child(node, k):
    """`node`'s child `k` (a dict key, a list index, a typed node's field name)."""
    return getattr(node, k) if isinstance(node, (Fp8, Mxfp4)) else node[k]


def is_node(x) -> bool:
    """Whether `x` is an inner node of a parameter tree (dict, list, typed node), not a leaf."""
    return isinstance(x, (dict, list, tuple, Fp8, Mxfp4))


def key_name(k) -> str:
    """A `jax.tree_util` key path entry as the checkpoint names it (dict key, list index, typed node field)."""
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def flatten_names(tree: dict, prefix: str = "") -> dict:
    """{dotted checkpoint-style name: leaf} for a declaration or parameter tree (experts stacked)."""
    if not is_node(tree):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in children(tree):
        out.update(flatten_names(v, f"{prefix}{k}."))
    return out


def param_stats(cfg: ModelConfig) -> dict:
    """Parameter count and bytes per dtype, from the declared shapes (checkpoint tensors only).

    Counts are of stored elements (a packed MXFP4 byte is one element holding two parameters;
    `params` counts logical parameters: two per packed byte, scales excluded).
    """
    names = flatten_names(declare_params(cfg))
    by_dtype: dict = {}
    tensors = 0
    params = 0
    total = 0
    for name, p in names.items():
        if not p.in_checkpoint:
            continue
        nel = int(np.prod(p.shape))
        nbytes = nel * jnp.dtype(p.dtype).itemsize
        key = jnp.dtype(p.dtype).name
        by_dtype[key] = by_dtype.get(key, 0) + nbytes
        total += nbytes
        if p.init in ("fp8_scale", "mxfp4_scale", "fp8_rows_scale"):
            pass
        elif p.init == "mxfp4":
            params += 2 * nel
        else:
            params += nel
        # Checkpoint tensor count: stacked experts are E tensors each in the file.
        tensors += p.shape[0] if p.init in ("mxfp4", "mxfp4_scale") else 1
    return {"bytes": total, "bytes_by_dtype": by_dtype, "params": params, "tensors": tensors}


# ---------------------------------------------------------------------------------------- init


def _rng(key, name: str) -> np.random.Generator:
    """A numpy generator per (key, tensor name): init is host-side so it compiles nothing."""
    kd = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return np.random.default_rng([zlib.crc32(name.encode())] + [int(x) & 0xFFFFFFFF for x in kd])


def _init_group(name: str, node, key, cfg: ModelConfig, token_map):
    """Initialize a quantized (weight, scale) pair together (a `weights.Fp8` / `weights.Mxfp4`, or the Engram
    table's {"weight", "scale"} rows); None if `node` is not such a pair."""
    w = node.weight if isinstance(node, (Fp8, Mxfp4)) else node.get("weight") if isinstance(node, dict) else None
    if not isinstance(w, P) or w.init not in ("fp8", "mxfp4", "fp8_rows"):
        return None
    g = _rng(key, name)
    if w.init == "fp8":
        q, s = quant_np.quantize_fp8_block_np(g.standard_normal(w.shape, np.float32) * w.std)
    elif w.init == "fp8_rows":
        q, s = quant_np.quantize_fp8_rows_np(g.standard_normal(w.shape, np.float32) * w.std)
    else:
        E, out_dim, half = w.shape
        q, s = quant_np.quantize_mxfp4_np(g.standard_normal((E, out_dim, 2 * half), np.float32) * w.std)
    q, s = jax.device_put(q), jax.device_put(s)
    if isinstance(node, Mxfp4):
        return Mxfp4(weight=q, scale=s)
    if isinstance(node, Fp8):  # with wo_a's load-time dequantized copy (`fp8_linear_bf16_decl`)
        return Fp8(weight=q, scale=s, bf16=None if node.bf16 is None else
                   quant.dequantize_fp8_block(q, s, out_dtype=BF16))
    return {"weight": q, "scale": s}


def _init_leaf(name: str, p: P, key, cfg: ModelConfig, token_map):
    if p.init in ("normal", "normal_one", "hc_base", "hc_scale"):
        z = _rng(key, name).standard_normal(p.shape, np.float32) * np.float32(p.std)
        if p.init in ("normal_one", "hc_scale"):
            z = z + np.float32(1.0)
        # Built on the host and moved with device_put (ml_dtypes rounds to nearest even, as XLA's
        # convert does): device-side casts and fills, and `jnp.asarray` of a host array (a staged
        # identity in JAX 0.10), compile one tiny program per shape — ~60 for tiny, minutes on a GPU.
        return jax.device_put(z.astype(p.dtype))
    if p.init == "ones":
        return jax.device_put(np.ones(p.shape, p.dtype))
    if p.init == "zeros":
        return jax.device_put(np.zeros(p.shape, p.dtype))
    if p.init == "token_map":
        if token_map is None:
            raise ValueError("init_params: this config has Engram layers and needs the tokenizer's Engram token "
                             "map (pass tokenizer=... or engram_token_map=...)")
        tm = np.asarray(token_map, np.int32)
        if tm.shape != p.shape:
            raise ValueError(f"engram token map has shape {tm.shape}, expected {p.shape} (vocab_size)")
        return jax.device_put(tm)
    raise ValueError(f"{name}: unknown initializer {p.init!r}")


def engram_token_map_for(cfg: ModelConfig, tokenizer=None) -> np.ndarray:
    """The Engram token map [vocab_size] int32, checked against engram_compressed_vocab_size.

    `tokenizer`: an HF `tokenizers.Tokenizer`, a path to a tokenizer.json, or None for the one the
    package ships for the preset (nano's for ``cfg.name == "nano"``, else tiny's). Whichever it is, it
    must fit the config: its compressed-id count must be the config's engram_compressed_vocab_size and
    its size at most vocab_size (a ConfigError names the mismatch), so a config that needs another
    tokenizer is told so instead of guessed at.
    Ids >= len(tokenizer) map to the pad's compressed id (docs/design/spec.md §5, uncertain point).
    """
    from dsv41_jax.model import engram_tables
    from dsv41_jax.model.config import ConfigError, preset_tokenizer_dir
    import os

    shipped = tokenizer is None
    if shipped:
        tokenizer = os.path.join(preset_tokenizer_dir(cfg), "tokenizer.json")
    if isinstance(tokenizer, str):
        m, count = engram_tables.load_engram_token_map(tokenizer)
    else:
        m, count = engram_tables.build_engram_token_map(tokenizer)
    hint = (f" (no tokenizer was given, so the bundled {os.path.basename(preset_tokenizer_dir(cfg))} one was "
            "used: pass the model's own)") if shipped else ""
    if count != cfg.engram_compressed_vocab_size:
        raise ConfigError(f"engram_compressed_vocab_size: config says {cfg.engram_compressed_vocab_size} but the "
                          f"tokenizer's normalization gives {count} compressed ids{hint}")
    m = np.asarray(m, np.int32)
    if m.shape[0] > cfg.vocab_size:
        raise ConfigError(f"vocab_size: tokenizer has {m.shape[0]} tokens, more than vocab_size={cfg.vocab_size}"
                          f"{hint}")
    pad = m[cfg.engram_pad_token_id]
    full = np.full((cfg.vocab_size,), pad, np.int32)
    full[: m.shape[0]] = m
    return full


def init_params(cfg: ModelConfig, key, *, tokenizer=None, engram_token_map=None) -> dict:
    """Random parameters in the checkpoint's dtypes (quantized from scaled normals), for tests/tiny."""
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4 import params as v4

        return v4.init_params(cfg, key)
    decl = declare_params(cfg)
    token_map = engram_token_map
    if cfg.engram_layer_ids and token_map is None:
        token_map = engram_token_map_for(cfg, tokenizer)

    def walk(node, name):
        grp = _init_group(name, node, key, cfg, token_map)
        if grp is not None:
            return grp
        if isinstance(node, dict):
            return {k: walk(v, f"{name}.{k}" if name else k) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{name}.{i}") for i, v in enumerate(node)]
        return _init_leaf(name, node, key, cfg, token_map)

    return walk(decl, "")
