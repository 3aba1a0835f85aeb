"""Compressor: the compressed latents written by KV-source layers (docs/design/spec.md §3).

Ratio 1: one latent per token, ``norm(wkv · x)`` as a plain bf16 matmul.
Ratio r > 1: tokens ``j·r .. j·r+r−1`` are pooled per channel with a softmax over the group of
``wgate · x`` scores, in fp32 with weights widened from bf16, then rounded and normed.

Latents returned here are bf16, pre-RoPE and unquantized: that is what the indexer's keys are made
from. `compressed_kv` then makes what attention reads (RoPE at ``j·r`` + fp4 fake-quant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import indexer, quant
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import (DETERMINISTIC, is_exact, linear_bf16, linear_f32, round_f32, softmax_f32, sum_f32,
                                      x64_scope)
from dsv41_jax.model.rope import apply_rope


def group_kv_scores(p, x, exact: bool = False):
    """Per-token fp32 (kv, score) of a ratio>1 compressor: x [..., D] -> ([..., hd], [..., hd]).

    `exact` (the exact numerics mode, `numerics.is_exact`): fp64-accumulated, so the result does not
    depend on how many tokens are projected together (a prefill chunk vs one decode token)."""
    return linear_f32(x, p["wkv"]["weight"], exact), linear_f32(x, p["wgate"]["weight"], exact)


def pool_groups(kv, score, p, eps, dt, exact: bool = False):
    """Per-channel softmax pooling of complete groups.

    kv, score: fp32 [..., r, hd] (score −inf where a slot of the group is absent). Returns the normed
    latent [..., hd] in `dt`. `exact`: the softmax's and the pooling's sums (and the norm's mean)
    accumulate in fp64; at the deterministic level every op of the softmax and the pooling is evaluated
    in fp64 and rounded to fp32 as the fp32 chain rounds (`numerics.round_f32`).
    """
    if exact and exact >= DETERMINISTIC:
        # the softmax and the pooling as the bf16 flow's fp32 chain, each op evaluated in fp64 and rounded
        # to fp32 where that chain rounds (`numerics.round_f32`; numerics module doc)
        r = round_f32
        with x64_scope():
            sc = score.astype(jnp.float64)
            e = r(jnp.exp(r(sc - jnp.max(sc, axis=-2, keepdims=True))))
            w = r(e * r(1.0 / r(jnp.sum(e, axis=-2, keepdims=True))))  # XLA's form of softmax's e / sum
            latent = r(jnp.sum(r(w * kv.astype(jnp.float64)), axis=-2)).astype(jnp.float32).astype(dt)
    else:
        w = softmax_f32(score, -2, exact)
        latent = sum_f32(w * kv, -2, exact).astype(dt)
    return rmsnorm(latent, p["norm"]["weight"], eps, dt, exact)


def compress(p, x, ratio: int, eps, dt, exact: bool = False):
    """Latents for all complete groups of a sequence that starts at position 0.

    x: [B, T, D] (the layer's normed attention input) -> [B, T // ratio, hd] in `dt`. `exact`: the
    projections accumulate in fp64 (exact numerics mode).
    """
    B, T, _ = x.shape
    if ratio == 1:
        return rmsnorm(linear_bf16(x, p["wkv"]["weight"], dt, exact), p["norm"]["weight"], eps, dt, exact)
    S = T // ratio
    xs = x[:, : S * ratio]
    kv, score = group_kv_scores(p, xs, exact)
    hd = kv.shape[-1]
    return pool_groups(kv.reshape(B, S, ratio, hd), score.reshape(B, S, ratio, hd), p, eps, dt, exact)


def compressed_kv(latent, slot_pos, freqs, dt):
    """What attention reads from a compressed slot: RoPE at the slot's position, then fp4 fake-quant.

    latent: [..., S, hd]; slot_pos: int32 broadcastable to latent.shape[:-1] (= j·ratio).
    The fp4 variant with e4m3 scales over groups of 16, on **all** head_dim dims (docs/design/spec.md §3).
    """
    return quant.fake_quant_fp4_e4m3(compressed_rot(latent, slot_pos, freqs, dt), block=16, out_dtype=dt)


def compressed_rot(latent, slot_pos, freqs, dt):
    """A compressed latent RoPE'd at its slot position j·ratio, before the fp4 fake-quant."""
    return apply_rope(latent, slot_pos, freqs, out_dtype=dt)


def compress_chunk(p, x, start, n_new, slot, positions, valid, partial, ratio: int, eps, dt, exact: bool = False):
    """Latents of the groups a cached step's chunk completes (`decode.attention_cached`, a KV source): x [B, T, D]
    normed input; start, n_new, slot int32 [B] (the batch's); positions int32 / valid bool [B, T]; partial: the
    cache's partial groups {"kv", "score"} fp32 [R, r, hd] (None at ratio 1).

    Returns (latent [B, G, hd] in dt, slot j int32 [B, G], complete bool [B, G], group buffers).
    ratio 1: G = T, one latent per real token, no buffers (None). ratio r > 1: the chunk's tokens are
    placed in the groups they belong to (G = T // r + 2 covers any alignment), the first group seeded
    with the request's partial group; complete groups are pooled exactly as the full forward pools
    them. The buffers {"kv", "score"} fp32 [B, G, r, hd] let `partial_after` derive the partial group
    after any prefix of the chunk (the whole chunk, or only its accepted tokens).
    """
    if ratio == 1:
        return compress(p, x, 1, eps, dt, exact), positions, valid, None
    B, T, _ = x.shape
    r = ratio
    G = T // r + 2
    kv, score = group_kv_scores(p, x, exact)  # fp32 [B, T, hd]
    hd = kv.shape[-1]
    g0 = start // r
    rel = positions // r - g0[:, None]  # group of each token, relative to g0
    qpos = positions % r
    pk = partial["kv"][slot]  # [B, r, hd]
    ps = partial["score"][slot]
    buf_kv = jnp.zeros((B, G, r, hd), jnp.float32).at[:, 0].set(pk)
    buf_sc = jnp.full((B, G, r, hd), -jnp.inf, jnp.float32).at[:, 0].set(ps)
    bi = jnp.arange(B)[:, None]
    gi = jnp.where(valid, rel, G)  # padding tokens -> out of range (dropped)
    buf_kv = buf_kv.at[bi, gi, qpos].set(kv, mode="drop")
    buf_sc = buf_sc.at[bi, gi, qpos].set(score, mode="drop")
    latent = pool_groups(buf_kv, buf_sc, p, eps, dt, exact)  # [B, G, hd]
    j = g0[:, None] + jnp.arange(G)[None, :]
    end = start + n_new
    complete = (j * r + r - 1) < end[:, None]
    return latent, j.astype(jnp.int32), complete, {"kv": buf_kv, "score": buf_sc}


def store_chunk(p, x, st, key: str, batch, positions, valid, freqs, ratio: int, cfg, ccfg, dt, keep_old: bool):
    """A KV source's cache writes for a cached step's chunk (`decode.attention_cached`): the latents of the groups
    the chunk completes (`compress_chunk`), RoPE'd at their slot positions and encoded, into its compressed pool
    ``st["comp"][key]`` at the pool rows of the batch's page table (`indexer.pool_index`; incomplete groups go
    out of range, dropped), and — a source with an indexer — their index keys into ``st["ikeys"][key]`` likewise.
    p: the layer's ``attn`` params; x [B, T, D] its normed input; batch: the step's batch (start, n_new, slot,
    page_table); positions int32 / valid bool [B, T].

    Returns (st' (new dicts; `st` is not modified), the group buffers for `partial_after` (None at ratio 1),
    restore data or None): with `keep_old` (a speculative step) {"dest", "last", "comp"[, "ikeys"]}: where each
    group went, its last position and the codes it overwrote (`decode.commit` puts back those of rejected
    groups)."""
    mode, r = ccfg.kv_cache_dtype, ratio
    latent, j, complete, buf = compress_chunk(p["compressor"], x, batch["start"], batch["n_new"], batch["slot"],
                                              positions, valid, st["partial"].get(key), r, cfg.rms_norm_eps, dt,
                                              is_exact(cfg))
    oob = jax.tree_util.tree_leaves(st["comp"][key])[0].shape[0]  # out of range: dropped
    dest = jnp.where(complete, indexer.pool_index(batch["page_table"], j, r, ccfg.page_size), oob)
    saved = {"dest": dest, "last": j * r + r - 1, "comp": kvc.store_get(st["comp"][key], dest)} if keep_old else None
    rot = compressed_rot(latent, j * r, freqs, dt)
    st = dict(st, comp={**st["comp"], key: kvc.store_set(st["comp"][key], dest, kvc.encode("comp", mode, rot))})
    if key in st["ikeys"]:
        if saved is not None:
            saved["ikeys"] = kvc.store_get(st["ikeys"][key], dest)
        krot = indexer.index_keys_rot(p["indexer"], latent, j * r, freqs, cfg.rms_norm_eps, dt, is_exact(cfg))
        st["ikeys"] = {**st["ikeys"], key: kvc.store_set(st["ikeys"][key], dest, kvc.encode("ikey", mode, krot))}
    return st, buf, saved


def partial_after(partial, buf, start, end, slot, r: int):
    """The partial-group state once positions < `end` are in: the group holding position `end` (its
    entries for positions >= end cleared: kv 0, score −inf), or a cleared group when `end` starts a
    fresh one. partial: {"kv", "score"} fp32 [R, r, hd]; buf: `compress_chunk`'s buffers; start, end,
    slot int32 [B]."""
    gl = end // r - start // r
    keep_kv = jnp.take_along_axis(buf["kv"], gl[:, None, None, None], axis=1)[:, 0]  # [B, r, hd]
    keep_sc = jnp.take_along_axis(buf["score"], gl[:, None, None, None], axis=1)[:, 0]
    have = (jnp.arange(r)[None, :] < (end % r)[:, None])[:, :, None]  # empty when end % r == 0
    keep_kv = jnp.where(have, keep_kv, 0.0)
    keep_sc = jnp.where(have, keep_sc, -jnp.inf)
    return {"kv": partial["kv"].at[slot].set(keep_kv), "score": partial["score"].at[slot].set(keep_sc)}
