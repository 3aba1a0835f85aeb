"""Every CSA / HCA layer's own compressor (docs/design/v4.md, "Compressor").

A variant of V4.1's ratio-r pooling (`compressor.pool_groups`: per-channel softmax over a window's slots in
fp32, then the weighted RMSNorm): the learned position bias ``ape`` [r, w·d] is added to the gate scores, and
CSA's windows overlap — its projections are 2·d wide, each token giving a series Ca (``[..., :d]``) and Cb
(``[..., d:]``); entry w pools Ca of window w−1 (slots 0..r−1) and Cb of window w (slots r..2r−1), the Ca half
of entry 0 absent (score −inf, kv 0). Entries are then RoPE'd at position w·r (`compressor.compressed_rot`);
V4 simulates no fp4 quantization of them here. The same routine makes CSA's attention entries (width
``head_dim``) and its Lightning indexer's keys (width ``index_head_dim``).

p: ``{"wkv", "wgate"}`` (V4 dense weights [w·d, D], `v4.linear`), ``"ape"`` fp32 [r, w·d], ``"norm"`` [d];
w = 2 when `overlap` (CSA), else 1 (HCA).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import compressor as comp41
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.model.v4.linear import dense_f32


def window_slots(kv, score, ape, ratio: int, overlap: bool):
    """Per-token fp32 kv / gate scores [B, T, w·d] -> the pooling slots of each closed window.

    Returns (kv, score) fp32 [B, S, r, d] (HCA) or [B, S, 2r, d] (CSA, `overlap`), S = T // ratio, with ``ape``
    [r, w·d] added to the scores; the absent Ca half of CSA's entry 0 is kv 0 / score −inf."""
    B, T, W = kv.shape
    S = T // ratio
    kv = kv[:, :S * ratio].reshape(B, S, ratio, W)
    score = score[:, :S * ratio].reshape(B, S, ratio, W) + ape.astype(jnp.float32)
    if not overlap:
        return kv, score
    d = W // 2
    prev_kv = jnp.concatenate([jnp.zeros((B, 1, ratio, d), kv.dtype), kv[:, :-1, :, :d]], axis=1)
    prev_sc = jnp.concatenate([jnp.full((B, 1, ratio, d), -jnp.inf, score.dtype), score[:, :-1, :, :d]], axis=1)
    return (jnp.concatenate([prev_kv, kv[..., d:]], axis=2), jnp.concatenate([prev_sc, score[..., d:]], axis=2))


def compress(p, x, ratio: int, overlap: bool, freqs, cfg, dt):
    """The compressed entries of a sequence starting at position 0: x [B, T, D] (the layer's normed attention
    input) -> [B, T // ratio, d] in `dt`, normed and RoPE'd at w·ratio."""
    B, T, _ = x.shape
    S = T // ratio
    kv, score = dense_f32(x, p["wkv"], cfg), dense_f32(x, p["wgate"], cfg)
    kv, score = window_slots(kv, score, p["ape"], ratio, overlap)
    latent = comp41.pool_groups(kv, score, p, cfg.rms_norm_eps, dt, is_exact(cfg))
    slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) * ratio, (B, S))
    return comp41.compressed_rot(latent, slot_pos, freqs, dt)
