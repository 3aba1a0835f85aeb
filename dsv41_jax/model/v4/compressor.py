"""Every CSA / HCA layer's own compressor (docs/design/v4.md, "Compressor").

A variant of V4.1's ratio-r pooling (`compressor.pool_groups`: per-channel softmax over a window's slots in
fp32, then the weighted RMSNorm): the learned position bias ``ape`` [r, w·d] is added to the gate scores, and
CSA's windows overlap — its projections are 2·d wide, each token giving a series Ca (``[..., :d]``) and Cb
(``[..., d:]``); entry w pools Ca of window w−1 (slots 0..r−1) and Cb of window w (slots r..2r−1), the Ca half
of entry 0 absent (score −inf, kv 0). Entries are then RoPE'd at position w·r (`compressor.compressed_rot`)
and, in the release numerics, quantized as the release stores them (`v4.numerics`: an attention compressor's
non-RoPE channels fp8, an indexer's keys Hadamard-rotated FP4). The same routine makes CSA's attention entries
(width ``head_dim``) and its Lightning indexer's keys (width ``index_head_dim``, ``index=True``).

p: ``{"wkv", "wgate"}`` (V4 dense weights [w·d, D], `v4.linear`), ``"ape"`` fp32 [r, w·d], ``"norm"`` [d];
w = 2 when `overlap` (CSA), else 1 (HCA).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import compressor as comp41
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.model.v4.linear import dense_f32
from dsv41_jax.model.v4.numerics import index_rotated, kv_entries
from dsv41_jax.model.v4.torch_order import rope_fn


def window_slots(kv, score, ape, ratio: int, overlap: bool, windows=None, base=None):
    """Per-position fp32 kv / gate scores [B, N, w·d] -> the pooling slots of windows `windows`.

    windows: int32 [B, M] window ids (default: every window closed in the N positions, 0 .. N // ratio − 1);
    base: int32 [B], the position of index 0 of kv / score (default 0: a sequence from position 0; a decode
    chunk passes its buffer of the last 2·ratio cached positions + the chunk). Returns (kv, score) fp32
    [B, M, r, d] (HCA) or [B, M, 2r, d] (CSA, `overlap`) with ``ape`` [r, w·d] added to the scores; the absent
    Ca half of CSA's entry 0 is kv 0 / score −inf. Window ids whose positions lie outside the buffer give
    clamped (meaningless) slots: callers drop those windows."""
    B, N, W = kv.shape
    if windows is None:
        windows = jnp.broadcast_to(jnp.arange(N // ratio, dtype=jnp.int32), (B, N // ratio))
    base = jnp.zeros((B,), jnp.int32) if base is None else base
    i = jnp.arange(ratio, dtype=jnp.int32)
    ape = ape.astype(jnp.float32)

    def at(first):  # [B, M, r, W]: positions first[b, m] + i of the buffer
        idx = jnp.clip(first[..., None] + i - base[:, None, None], 0, N - 1).reshape(B, -1)
        return tuple(jnp.take_along_axis(a, idx[..., None], axis=1).reshape(idx.shape[0], -1, ratio, W)
                     for a in (kv, score))

    cur_kv, cur_sc = at(windows * ratio)
    cur_sc = cur_sc + ape
    if not overlap:
        return cur_kv, cur_sc
    d = W // 2
    prev_kv, prev_sc = at((windows - 1) * ratio)
    first = (windows == 0)[..., None, None]
    prev_kv = jnp.where(first, 0.0, prev_kv[..., :d])
    prev_sc = jnp.where(first, -jnp.inf, prev_sc[..., :d] + ape[:, :d])
    return (jnp.concatenate([prev_kv, cur_kv[..., d:]], axis=2),
            jnp.concatenate([prev_sc, cur_sc[..., d:]], axis=2))


def pool(p, kv, score, windows, ratio: int, freqs, cfg, dt, index: bool = False):
    """Slots (`window_slots`) [B, M, slots, d] of windows int32 [B, M] -> the entries [B, M, d] in `dt`:
    `compressor.pool_groups` (softmax over the slots, weighted sum, kv norm), RoPE'd at w·ratio, then quantized
    as stored (`v4.numerics.kv_entries`; an indexer's keys, `index`: `v4.numerics.index_rotated`)."""
    latent = comp41.pool_groups(kv, score, p, cfg.rms_norm_eps, dt, is_exact(cfg))
    entries = rope_fn(cfg)(latent, windows * ratio, freqs, out_dtype=dt)  # `compressor.compressed_rot`'s RoPE
    return index_rotated(entries, cfg, dt) if index else kv_entries(entries, cfg, dt)


def project(p, x, cfg):
    """Per-token fp32 (kv, gate score) [B, T, w·d] of the compressor's wkv / wgate."""
    return dense_f32(x, p["wkv"], cfg), dense_f32(x, p["wgate"], cfg)


def compress(p, x, ratio: int, overlap: bool, freqs, cfg, dt, index: bool = False):
    """The compressed entries of a sequence starting at position 0: x [B, T, D] (the layer's normed attention
    input) -> [B, T // ratio, d] in `dt`, normed and RoPE'd at w·ratio (`index`: an indexer's keys, `pool`)."""
    B, T, _ = x.shape
    kv, score = project(p, x, cfg)
    windows = jnp.broadcast_to(jnp.arange(T // ratio, dtype=jnp.int32), (B, T // ratio))
    return pool(p, *window_slots(kv, score, p["ape"], ratio, overlap, windows), windows, ratio, freqs, cfg, dt,
                index=index)
