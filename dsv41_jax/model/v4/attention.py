"""The attention sublayer of V4's sliding / CSA / HCA layers over a whole sequence (docs/design/v4.md).

The shared latent-MQA core with V4's variants:

* `project_q`: V4.1's q path (wq_a → weighted RMSNorm → wq_b) plus the ``q_head_norm`` variant — an
  unweighted RMSNorm of each head after wq_b, before RoPE (`v4.numerics.head_rms`); `project_kv`:
  kv_norm(wkv·x), RoPE'd, its non-RoPE channels fp8 in the release numerics (`v4.numerics.kv_entries`).
* compressed entries: every CSA / HCA layer compresses for itself (`v4.compressor.compress`; no KV sources);
  HCA attends every causal entry (w < (t+1) // r); CSA attends the top-k entries of its own Lightning indexer
  (`index_select`: its own compressor's keys, the shared `indexer.index_scores` / `indexer.select_topk`).
* `attention.attend` (one softmax over window keys and entries with the per-head sink), then the inverse
  RoPE, the grouped wo_a and wo_b (`output_proj`).

RoPE: sliding layers ``rope_theta``; CSA / HCA layers ``compress_rope_theta`` with YaRN unless
``rope_scaling.type`` is "default" (`layer_freqs`).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import indexer
from dsv41_jax.model.attention import attend, sink_of
from dsv41_jax.model.numerics import einsum_exact, HIGHEST, is_exact
from dsv41_jax.model.rope import rope_freqs
from dsv41_jax.model.v4.compressor import compress
from dsv41_jax.model.v4.linear import dense, weight
from dsv41_jax.model.v4.numerics import head_rms, index_rotated, kv_entries
from dsv41_jax.model.v4.torch_order import exact_level, norm_fn, rope_fn


def layer_freqs(cfg, kind: str):
    """RoPE frequencies [rd/2] of a layer of `kind` ("sliding" | "csa" | "hca"); the power correctly rounded, as
    torch's, with ``release_order`` "torch_cpu" (`rope.rope_freqs`' ``exact_pow``)."""
    rd = cfg.qk_rope_head_dim
    exact_pow = cfg.release_order == "torch_cpu"
    if kind == "sliding":
        return rope_freqs(rd, cfg.rope_theta, exact_pow=exact_pow)
    rs = cfg.rope_scaling
    yarn = ((rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings)
            if rs.type == "yarn" else None)
    return rope_freqs(rd, cfg.compress_rope_theta, yarn=yarn, exact_pow=exact_pow)


def head_norm(q, cfg, dt):
    """The ``q_head_norm`` variant: q [.., H, hd] · rsqrt(mean(q²) + eps) per head (`v4.numerics.head_rms`: the
    shared `norm.rmsnorm` with weight 1 in fp32, the release's bf16 tensor arithmetic in the bf16 flow)."""
    if not cfg.q_head_norm:
        return q
    return head_rms(q, cfg, dt)


def project_q(p, x, positions, freqs, cfg, dt):
    """x [B, T, D] -> (qr [B, T, q_lora] the normed q latent (the indexer's input), q [B, T, H, hd] RoPE'd)."""
    eps = cfg.rms_norm_eps
    qr = norm_fn(cfg)(dense(x, p["wq_a"], cfg, dt), p["q_norm"]["weight"], eps, dt, is_exact(cfg))
    q = dense(qr, p["wq_b"], cfg, dt)
    q = head_norm(q.reshape(q.shape[:-1] + (cfg.num_attention_heads, cfg.head_dim)), cfg, dt)
    return qr, rope_fn(cfg)(q, positions[..., None], freqs, out_dtype=dt)


def project_kv(p, x, positions, freqs, cfg, dt):
    """The window K=V [B, T, hd]: kv_norm(wkv·x), RoPE'd, as stored (`v4.numerics.kv_entries`)."""
    kv = norm_fn(cfg)(dense(x, p["wkv"], cfg, dt), p["kv_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return kv_entries(rope_fn(cfg)(kv, positions, freqs, out_dtype=dt), cfg, dt)


def index_select(p, qr, x, positions, freqs, keys, ratio: int, cfg, dt):
    """CSA's Lightning indexer: the top-`index_topk` entries of each query over the layer's own index keys.

    p: the layer's ``indexer`` params (``wq_b`` [nI·dI, q_lora], ``weights_proj`` [nI, D]); qr [B, T, q_lora];
    x [B, T, D]; keys [B, S, dI] (its compressor's entries: `index_keys`, or the cached pool's). score(t, w) =
    Σ_h w_h · ReLU(q_h · k_w) with w = weights_proj·x · (dI·nI)^−½ (the projection rounded to `dt`, then the
    scaled product, as the release); entries w ≥ (t+1) // ratio are −inf. The queries are RoPE'd, then
    rotated and FP4 in the release numerics (`v4.numerics.index_rotated`, as the keys).
    Returns int32 [B, T, min(k, S)], ascending, −1 for picks at −inf (`indexer.select_topk`)."""
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    q = dense(qr, p["wq_b"], cfg, dt)
    q = rope_fn(cfg)(q.reshape(q.shape[:-1] + (nI, dI)), positions[..., None], freqs, out_dtype=dt)
    q = index_rotated(q, cfg, dt)
    w = dense(x, p["weights_proj"], cfg, dt).astype(jnp.float32) * jnp.float32((dI ** -0.5) * (nI ** -0.5))
    scores = indexer.index_scores(q, w.astype(dt), keys, (positions + 1) // ratio, dt, exact_level(cfg))
    return indexer.select_topk(scores, cfg.index_topk)


def compressed_view(entries, positions, ratio: int, sel=None):
    """What a query attends of the layer's compressed entries [B, S, hd]: (comp [B, T, K, hd], mask [B, T, K]) —
    CSA: the picks `sel` [B, T, K] (−1 = none); HCA (`sel` None): every entry w < (t+1) // ratio."""
    B, S, hd = entries.shape
    if sel is not None:
        comp = jnp.take_along_axis(entries[:, None], jnp.maximum(sel, 0)[..., None], axis=2)
        return comp, sel >= 0
    T = positions.shape[1]
    comp = jnp.broadcast_to(entries[:, None], (B, T, S, hd))
    return comp, jnp.arange(S)[None, None, :] < ((positions + 1) // ratio)[..., None]


def output_proj(p, o, positions, freqs, cfg, dt):
    """o [B, T, H, hd] -> [B, T, D]: inverse RoPE at the query position, wo_a per group (o_groups groups of
    H/o_groups heads -> o_lora_rank each), wo_b."""
    B, T = o.shape[:2]
    G, R = cfg.o_groups, cfg.o_lora_rank
    o = rope_fn(cfg)(o, positions[..., None], freqs, inverse=True, out_dtype=dt).reshape(B, T, G, -1)
    wa = weight(p["wo_a"], cfg).reshape(G, R, -1)
    if is_exact(cfg):
        y = einsum_exact("btgi,gri->btgr", o, wa)
    else:
        y = jnp.einsum("btgi,gri->btgr", o.astype(jnp.float32), wa.astype(jnp.float32), precision=HIGHEST)
    return dense(y.astype(dt).reshape(B, T, G * R), p["wo_b"], cfg, dt)


def attention_full(p, x, positions, kind: str, ratio: int, cfg, dt):
    """The attention sublayer of one layer over a sequence starting at position 0.

    p: the layer's ``attn`` params; x [B, T, D] its normed input; kind "sliding" | "csa" | "hca" with its
    compress `ratio`. Returns (y [B, T, D] in `dt`, rec): rec {"topk": int32 [B, T, k']} at CSA layers (the
    indexer's picks), else {}."""
    B, T, _ = x.shape
    W = cfg.sliding_window
    freqs = layer_freqs(cfg, kind)
    qr, q = project_q(p, x, positions, freqs, cfg, dt)
    kv = project_kv(p, x, positions, freqs, cfg, dt)
    t = jnp.arange(T)
    win_mask = jnp.broadcast_to((t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W), (B, T, T))
    S = T // ratio if ratio else 0
    rec: dict = {}
    if kind == "sliding" or S == 0:
        comp = jnp.zeros((B, T, 0, cfg.head_dim), dt)
        comp_mask = jnp.zeros((B, T, 0), bool)
        if kind == "csa":
            rec["topk"] = jnp.zeros((B, T, 0), jnp.int32)
    else:
        entries = compress(p["compressor"], x, ratio, kind == "csa", freqs, cfg, dt)  # [B, S, hd]
        sel = None
        if kind == "csa":
            keys = compress(p["indexer"]["compressor"], x, ratio, True, freqs, cfg, dt, index=True)  # [B, S, dI]
            rec["topk"] = sel = index_select(p["indexer"], qr, x, positions, freqs, keys, ratio, cfg, dt)
        comp, comp_mask = compressed_view(entries, positions, ratio, sel)
    o = attend(q, kv, win_mask, comp, comp_mask, sink_of(p), dt, exact=exact_level(cfg))
    return output_proj(p, o, positions, freqs, cfg, dt), rec
