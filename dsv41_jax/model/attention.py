"""Latent attention: one 512-wide K=V latent per position, window + selected compressed slots (SPEC §3).

The sublayer is split so the full forward (`transformer.py`) and the cached decode path share every
piece of arithmetic:

* `project_q_kv` — q latent, RoPE'd queries and this layer's window K=V (RoPE + fp8 fake-quant);
* `attend` — one softmax over [window keys ∪ selected compressed slots] with the per-head sink;
* `output_proj` — inverse RoPE, grouped wo_a (bf16), wo_b (fp8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import linear, quant
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import HIGHEST
from dsv41_jax.model.rope import apply_rope, rope_freqs


def layer_freqs(cfg, plan):
    """RoPE frequencies of a layer: compress_rope_theta + YaRN if compress_ratio > 0, else rope_theta."""
    rd = cfg.qk_rope_head_dim
    if plan.yarn:
        rs = cfg.rope_scaling
        return rope_freqs(rd, cfg.compress_rope_theta,
                          yarn=(rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings))
    return rope_freqs(rd, cfg.rope_theta)


def project_q_kv(p, x, positions, freqs, cfg, dt):
    """x [B, T, D] normed input, positions int32 [B, T].

    Returns qr [B, T, q_lora] (normed q latent, also the indexer's input), q [B, T, H, hd] (RoPE'd,
    not quantized) and kv_rot [B, T, hd]: the RoPE'd K=V *before* its fp8 fake-quant (per 32, pow2
    scales); the quantized value is what the window ring stores and attention uses, in the same
    forward too — callers apply `window_kv` (or store its codes, which decode to the same values).
    """
    H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    qr = rmsnorm(linear.fp8(x, p["wq_a"], cfg, dt), p["q_norm"]["weight"], eps, dt)
    q = linear.fp8(qr, p["wq_b"], cfg, dt)
    q = q.reshape(q.shape[:-1] + (H, hd))
    q = apply_rope(q, positions[..., None], freqs, out_dtype=dt)
    kv = rmsnorm(linear.fp8(x, p["wkv"], cfg, dt), p["kv_norm"]["weight"], eps, dt)
    kv = apply_rope(kv, positions, freqs, out_dtype=dt)
    return qr, q, kv


def window_kv(kv_rot, dt):
    """The window K=V: fp8 e4m3 fake-quant over all head_dim dims, per 32, pow2 scales."""
    return quant.fake_quant_fp8(kv_rot, block=32, out_dtype=dt)


def attend(q, win_kv, win_mask, comp_kv, comp_mask, sink, dt):
    """Joint softmax over window keys and selected compressed slots, with the attention sink.

    q [B, T, H, hd]; win_kv [B, Nw, hd] with win_mask bool [B, T, Nw] (keys shared by the T queries of a
    row, e.g. the whole sequence or a ring); comp_kv [B, T, K, hd] gathered per query with comp_mask
    bool [B, T, K]; sink fp32 [H]. Returns [B, T, H, hd] in `dt`.

    Logits are fp32 (q·k)·hd^−0.5. The sink is unscaled, excluded from the max, and adds
    exp(sink − max) to the denominator only. As the reference kernel, the numerator uses probabilities
    rounded to bf16 (in the bf16 flow) and the denominator stays fp32. A row with no valid key gives 0.
    """
    hd = q.shape[-1]
    scale = hd ** -0.5
    qf = q.astype(jnp.float32)
    lw = jnp.einsum("bthd,bsd->bths", qf, win_kv.astype(jnp.float32), precision=HIGHEST) * scale
    lw = jnp.where(win_mask[:, :, None, :], lw, -jnp.inf)
    lc = jnp.einsum("bthd,btkd->bthk", qf, comp_kv.astype(jnp.float32), precision=HIGHEST) * scale
    lc = jnp.where(comp_mask[:, :, None, :], lc, -jnp.inf)
    m = jnp.maximum(jnp.max(lw, axis=-1, initial=-jnp.inf), jnp.max(lc, axis=-1, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    pw = jnp.exp(lw - m)
    pc = jnp.exp(lc - m)
    denom = jnp.sum(pw, axis=-1) + jnp.sum(pc, axis=-1) + jnp.exp(sink[None, None, :] - m[..., 0])
    num_dt = jnp.bfloat16 if dt == jnp.bfloat16 else jnp.float32
    pw = pw.astype(num_dt).astype(jnp.float32)
    pc = pc.astype(num_dt).astype(jnp.float32)
    num = jnp.einsum("bths,bsd->bthd", pw, win_kv.astype(jnp.float32), precision=HIGHEST)
    num = num + jnp.einsum("bthk,btkd->bthd", pc, comp_kv.astype(jnp.float32), precision=HIGHEST)
    return (num / denom[..., None]).astype(dt)


def output_proj(p, o, positions, freqs, cfg, dt):
    """o [B, T, H, hd] attention output -> [B, T, D].

    Inverse RoPE at the query position; heads viewed as o_groups groups of H/o_groups·hd; wo_a
    (fp8 in the file, dequantized to bf16 — exact) applied per group as a plain bf16 matmul; wo_b fp8.
    """
    B, T = o.shape[:2]
    G, R = cfg.o_groups, cfg.o_lora_rank
    o = apply_rope(o, positions[..., None], freqs, inverse=True, out_dtype=dt)
    o = o.reshape(B, T, G, cfg.o_group_in)
    y = linear.wo_a(o, p["wo_a"], cfg, dt).astype(dt).reshape(B, T, G * R)
    return linear.fp8(y, p["wo_b"], cfg, dt)
