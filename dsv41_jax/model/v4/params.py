"""V4's parameter declaration (release tensor names, docs/design/v4.md "Reading the checkpoint") and init.

The tree mirrors the release names as V4.1's does (`params.declare_params`): ``layers.L.attn.wq_a.weight`` at
``params["layers"][L]["attn"]["wq_a"]["weight"]``, routed experts stacked on a leading axis, the model-level
``hc_head_fn`` / ``hc_head_base`` / ``hc_head_scale`` at the top. Per layer kind (`config_v4.attention_kinds`):
CSA layers own ``attn.compressor`` (2·head_dim wide, ``ape`` [r, 2·hd]) and ``attn.indexer`` (``wq_b``,
``weights_proj`` and its own 2·dI-wide ``compressor``); HCA layers own ``attn.compressor`` (hd wide); sliding
layers neither. Hash-routed layers have ``ffn.gate.tid2eid`` [vocab, k] int32 instead of ``ffn.gate.bias``.

Dense weights (`dense_decl`): fp8 e4m3 with e8m0 ``weight_block_size`` block scales when the config has a
block size (the release), else plain bf16; the file's own float dtype is kept on load (`v4.checkpoint`).
Routed experts: MXFP4 (``expert_dtype`` "fp4", V4.1's `params.mxfp4_experts_decl`) or plain.

Logical axes (each tensor's mesh split): V4.1's names and its one table (`parallel.rules.RULES`; docs/design/v4.md
"Mesh"); `partition_specs` gives every tensor's `PartitionSpec` on a tp x ep mesh by checkpoint name.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import quant_np
from dsv41_jax.model.codec import E8M0, FP8
from dsv41_jax.model.config_v4 import attention_kinds, draft_kinds
from dsv41_jax.model.params import P, mxfp4_experts_decl
from dsv41_jax.model.weights import Fp8, Mxfp4

BF16, F32 = jnp.bfloat16, jnp.float32


def dense_decl(cfg, out_dim, in_dim, out_axis=None, in_axis=None):
    """A dense [out, in] weight: fp8 + block scale (``weight_block_size``), or plain bf16."""
    std = 1.0 / math.sqrt(in_dim)
    bs = cfg.weight_block_size
    if not bs:
        return {"weight": P((out_dim, in_dim), BF16, (out_axis, in_axis), "normal", std)}
    return Fp8(weight=P((out_dim, in_dim), FP8, (out_axis, in_axis), "fp8_v4", std),
               scale=P((-(-out_dim // bs[0]), -(-in_dim // bs[1])), E8M0, (out_axis, in_axis), "fp8_scale"))


def _norm(dim):
    return {"weight": P((dim,), BF16, (None,), "ones")}


def _plain(out_dim, in_dim, out_axis=None, in_axis=None):
    return {"weight": P((out_dim, in_dim), BF16, (out_axis, in_axis), "normal", 1.0 / math.sqrt(in_dim))}


def compressor_decl(cfg, ratio: int, width: int, d: int):
    """A compressor of `width` series (2: CSA's overlapping windows, 1: HCA) of `d` channels."""
    D = cfg.hidden_size
    return {"wkv": _plain(width * d, D, "kv", "embed"), "wgate": _plain(width * d, D, "kv", "embed"),
            "ape": P((ratio, width * d), F32, ("comp_slot", "kv"), "normal", 0.5), "norm": _norm(d)}


def layer_decl(cfg, i: int, kind=None) -> dict:
    """Declarations of layer `i` (a target layer; a draft layer passes its `kind`, `config_v4.draft_kinds`)."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    n, mix = cfg.hc_mult, cfg.hc_mix_dim
    G, R = cfg.o_groups, cfg.o_lora_rank
    kind = kind or attention_kinds(cfg)[i]
    d: dict = {"attn_norm": _norm(D), "ffn_norm": _norm(D)}
    for s in ("attn", "ffn"):
        d[f"hc_{s}_fn"] = P((mix, n * D), F32, ("hc", "embed"), "normal", 1.0 / math.sqrt(n * D))
        d[f"hc_{s}_base"] = P((mix,), F32, ("hc",), "normal", 0.5)
        d[f"hc_{s}_scale"] = P((3,), F32, (None,), "normal_one", 0.5)
    attn = {"attn_sink": P((H,), F32, ("heads",), "normal", 0.5),
            "wq_a": dense_decl(cfg, cfg.q_lora_rank, D, "q_lora", "embed"), "q_norm": _norm(cfg.q_lora_rank),
            "wq_b": dense_decl(cfg, H * hd, cfg.q_lora_rank, "heads", "q_lora"),
            "wkv": dense_decl(cfg, hd, D, "kv", "embed"), "kv_norm": _norm(hd),
            "wo_a": dense_decl(cfg, G * R, cfg.o_group_in, "heads", None),
            "wo_b": dense_decl(cfg, D, G * R, "embed", "o_in")}
    if kind == "csa":
        r, nI, dI = cfg.csa_compress_ratio, cfg.index_n_heads, cfg.index_head_dim
        attn["compressor"] = compressor_decl(cfg, r, 2, hd)
        attn["indexer"] = {"wq_b": dense_decl(cfg, nI * dI, cfg.q_lora_rank, "index", "q_lora"),
                           "weights_proj": _plain(nI, D, "index", "embed"),
                           "compressor": compressor_decl(cfg, r, 2, dI)}
    elif kind == "hca":
        attn["compressor"] = compressor_decl(cfg, cfg.hca_compress_ratio, 1, hd)
    d["attn"] = attn
    E, I, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    gate = {"weight": P((E, D), BF16, ("experts_gate", "embed"), "normal", 1.0 / math.sqrt(D))}
    if i in cfg.hash_layer_ids:
        gate["tid2eid"] = P((cfg.vocab_size, k), jnp.int32, ("hash_vocab", None), "tid2eid")
    else:
        gate["bias"] = P((E,), F32, ("experts_gate",), "normal", 0.1)
    if cfg.expert_dtype == "fp4":
        experts = {"w1": mxfp4_experts_decl(E, I, D, "expert_mlp", "embed"),
                   "w3": mxfp4_experts_decl(E, I, D, "expert_mlp", "embed"),
                   "w2": mxfp4_experts_decl(E, D, I, "embed", "expert_mlp")}
    elif cfg.expert_dtype == "bf16":
        experts = {w: {"weight": P((E, o, c), BF16, ("experts", None, None), "normal", 1.0 / math.sqrt(c))}
                   for w, o, c in (("w1", I, D), ("w3", I, D), ("w2", D, I))}
    else:
        raise NotImplementedError(f"DeepSeek-V4 routed experts of expert_dtype {cfg.expert_dtype!r}: 'fp4' (MXFP4) "
                                  "and 'bf16' (plain) are implemented")
    d["ffn"] = {"gate": gate, "experts": experts,
                "shared_experts": {"w1": dense_decl(cfg, I, D, "mlp", "embed"),
                                   "w3": dense_decl(cfg, I, D, "mlp", "embed"),
                                   "w2": dense_decl(cfg, D, I, "embed", "mlp")}}
    return d


def head_decl(cfg) -> dict:
    """An output head's own tensors: ``norm`` and the ``hc_head`` collapse (the vocab projection is shared)."""
    D, n = cfg.hidden_size, cfg.hc_mult
    return {"norm": _norm(D),
            "hc_head_fn": P((n, n * D), F32, ("hc", "embed"), "normal", 1.0 / math.sqrt(n * D)),
            "hc_head_base": P((n,), F32, ("hc",), "normal", 0.5),
            "hc_head_scale": P((1,), F32, (None,), "normal_one", 0.5)}


def mtp_decl(cfg, s: int) -> dict:
    """MTP layer `s` (``mtp.s.*``, docs/design/v4.md "MTP"): a full V4 layer (layer id L + s, its attention kind
    from ``compress_ratios[L + s]``, learned routing) plus ``enorm`` / ``hnorm``, ``e_proj`` / ``h_proj`` [D, D]
    and its own head tensors (`head_decl`); embedding and vocab projection are the target's."""
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    d = layer_decl(cfg, L + s, draft_kinds(cfg)[s])
    d.update(enorm=_norm(D), hnorm=_norm(D), e_proj=dense_decl(cfg, D, D, None, "embed"),
             h_proj=dense_decl(cfg, D, D, None, "embed"), **head_decl(cfg))
    return d


def dspark_decl(cfg, s: int) -> dict:
    """DSpark stage `s` of Flash-0731 / Pro-0813 (``mtp.s.*``, docs/design/v4.md "the DSpark head"): a full V4 layer
    (layer id L + s, sliding, learned routing over the target's experts); stage 0 also ``main_proj`` [D, n_t·D]
    (fp8 as the other dense weights) and ``main_norm``; the last stage ``norm``, its own ``hc_head_*``,
    ``markov_head.markov_w1`` / ``markov_w2`` [vocab, dspark_markov_rank] bf16 and ``confidence_head.proj``
    [1, D + rank] bf16 — the release's names and dtypes (its model-00046..48 shard headers)."""
    D, L, V, R = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.dspark_markov_rank
    d = layer_decl(cfg, L + s, draft_kinds(cfg)[s])
    if s == 0:
        d.update(main_proj=dense_decl(cfg, D, len(cfg.dspark_target_layer_ids) * D, None, "embed"),
                 main_norm=_norm(D))
    if s == cfg.num_nextn_predict_layers - 1:
        d.update(**head_decl(cfg),
                 markov_head={"markov_w1": {"weight": P((V, R), BF16, ("vocab", None), "normal", 1.0)},
                              "markov_w2": {"weight": P((V, R), BF16, ("vocab", None), "normal",
                                                        1.0 / math.sqrt(R))}},
                 confidence_head={"proj": _plain(1, D + R)})
    return d


def declare_params(cfg) -> dict:
    """The whole V4 declaration tree (leaves `params.P`); ``mtp`` holds the draft's layers: the MTP layers of a
    ``draft_kind`` "mtp" config (`mtp_decl`), the DSpark stages of a "dspark" one (`dspark_decl`)."""
    V, D = cfg.vocab_size, cfg.hidden_size
    draft = mtp_decl if cfg.draft_kind == "mtp" else dspark_decl
    return {"embed": {"weight": P((V, D), BF16, ("vocab", "embed"), "normal", 1.0)},
            "head": {"weight": P((V, D), BF16, ("vocab", "embed"), "normal", 1.0 / math.sqrt(D))},
            **head_decl(cfg),
            "layers": [layer_decl(cfg, i) for i in range(cfg.num_hidden_layers)],
            "mtp": [draft(cfg, s) for s in range(cfg.num_nextn_predict_layers)]}


def partition_specs(cfg, tp: int = 1, ep: int = 1) -> dict:
    """{checkpoint-style name (`params.flatten_names`): `jax.sharding.PartitionSpec`} of every V4 tensor on a
    tp x ep mesh (what the converter's ``--tp`` / ``--ep`` layout records). The split is `params.mesh_shardings`'
    (the logical-axis table, which names V4's extra axes as `parallel.rules.RULES` does): q heads, o groups, the
    shared expert's intermediate and the vocabulary over tp, the routed experts and the gate's rows over ep,
    everything else (compressors with ``ape``, indexers, ``tid2eid``, ``hc_head``, norms, mHC) replicated; a dim
    that does not divide by its mesh axis is replicated."""
    from jax.sharding import AbstractMesh

    from dsv41_jax.model.params import flatten_names, mesh_shardings

    if cfg.model_family != "deepseek_v4":
        raise ValueError(f"v4.params.partition_specs: a DeepSeek-V4 config, got model_family {cfg.model_family!r}")
    mesh = AbstractMesh((tp, ep), ("tp", "ep"))
    return {n: s.spec for n, s in flatten_names(mesh_shardings(cfg, mesh)).items()}


def _rng(key, name: str) -> np.random.Generator:
    kd = np.asarray(jax.random.key_data(key)).ravel().tolist()
    return np.random.default_rng([zlib.crc32(name.encode())] + [int(x) & 0xFFFFFFFF for x in kd])


def _init(name: str, node, key, cfg):
    """Random values for one declaration node (a quantized pair is made together, host-side)."""
    if isinstance(node, list):
        return [_init(f"{name}.{i}", v, key, cfg) for i, v in enumerate(node)]
    if isinstance(node, (Fp8, Mxfp4)):  # a quantized pair, typed as V4.1's (`weights`)
        w = node.weight
        g = _rng(key, name)
        if isinstance(node, Fp8):
            q, s = quant_np.quantize_fp8_block_np(g.standard_normal(w.shape, np.float32) * w.std,
                                                  block=int(cfg.weight_block_size[0]))
        else:
            E, o, half = w.shape
            q, s = quant_np.quantize_mxfp4_np(g.standard_normal((E, o, 2 * half), np.float32) * w.std)
        return type(node)(weight=jax.device_put(q), scale=jax.device_put(s))
    if isinstance(node, dict):
        return {k: _init(f"{name}.{k}" if name else k, v, key, cfg) for k, v in node.items()}
    g = _rng(key, name)
    if node.init == "ones":
        z = np.ones(node.shape, np.float32)
    elif node.init == "tid2eid":  # k distinct experts per token
        V, k = node.shape
        z = np.stack([g.permutation(cfg.n_routed_experts)[:k] for _ in range(V)]).astype(np.int32)
    else:
        z = g.standard_normal(node.shape, np.float32) * np.float32(node.std)
        if node.init == "normal_one":
            z = z + np.float32(1.0)
    return jax.device_put(z.astype(node.dtype))


def init_params(cfg, key) -> dict:
    """Random parameters in the declared dtypes (quantized from scaled normals where the config quantizes)."""
    if cfg.weight_block_size and cfg.weight_block_size[0] != cfg.weight_block_size[1]:
        raise NotImplementedError(f"fp8 weight blocks {tuple(cfg.weight_block_size)}: only square blocks")
    return _init("", declare_params(cfg), key, cfg)
