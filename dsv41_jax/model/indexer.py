"""Two-level sparse retrieval: index keys, index scores, candidate blocks, top-k (SPEC §4).

Shapes: B batch, T queries, S compressed slots, nI = index_n_heads, dI = index_head_dim.
Scores are bf16 with −inf for slots a query may not pick; ties go to the lower slot (``lax.top_k``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import linear, quant
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import HIGHEST, linear_bf16
from dsv41_jax.model.rope import apply_rope

NEG_INF = -jnp.inf


def index_keys_rot(p, latent, slot_pos, freqs, eps, dt):
    """Index keys before their fp4 fake-quant: k_norm(wk · latent) → RoPE at j·ratio.

    latent: [B, S, hd] bf16 pre-RoPE unquantized; slot_pos int32 [B, S] or [S]. Returns [B, S, dI].
    """
    k = rmsnorm(linear_bf16(latent, p["wk"]["weight"], dt), p["k_norm"]["weight"], eps, dt)
    return apply_rope(k, slot_pos, freqs, out_dtype=dt)


def index_keys(p, latent, slot_pos, freqs, eps, dt):
    """Index keys of a key owner: `index_keys_rot` → fp4 fake-quant (pow2 scales, groups of 32)."""
    return quant.fake_quant_fp4_pow2(index_keys_rot(p, latent, slot_pos, freqs, eps, dt), block=32, out_dtype=dt)


def index_query(p, qr, x, positions, freqs, cfg, dt):
    """Index query and head weights at an index source.

    qr: [B, T, q_lora] the layer's normed q latent; x: [B, T, D] normed sublayer input;
    positions: int32 [B, T]. Returns q [B, T, nI, dI] (RoPE + fp4) and w [B, T, nI] (in `dt`).
    """
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    q = linear.fp8(qr, p["wq_b"], cfg, dt)
    q = q.reshape(q.shape[:-1] + (nI, dI))
    q = apply_rope(q, positions[..., None], freqs, out_dtype=dt)
    q = quant.fake_quant_fp4_pow2(q, block=32, out_dtype=dt)
    w = linear.plain_bf16(x, p["weights_proj"]["weight"], cfg, dt)
    w = (w * (dI ** -0.5 * nI ** -0.5)).astype(dt)
    return q, w


def index_scores(q, w, keys, visible, dt):
    """score(t, j) = Σ_h w_h · ReLU(q_h · k_j), rounded to `dt` after each step; −inf where j ≥ visible.

    q [B, T, nI, dI], w [B, T, nI], keys [B, S, dI], visible int32 [B, T] (= (t+1)//ratio).
    Returns [B, T, S] in `dt`.
    """
    qk = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                    precision=HIGHEST).astype(dt)
    prod = (w.astype(jnp.float32)[..., None] * jax.nn.relu(qk.astype(jnp.float32))).astype(dt)
    score = jnp.sum(prod.astype(jnp.float32), axis=2).astype(dt)
    S = keys.shape[1]
    ok = jnp.arange(S)[None, None, :] < visible[..., None]
    return jnp.where(ok, score, jnp.asarray(NEG_INF, dt))


def candidate_mask(scores, visible, block_size: int, topk_blocks: int):
    """Level-1 candidates: bool [B, T, S], True for slots inside a kept block.

    Blocks of `block_size` slots aligned at 0 (last padded with −inf) score by their max; the block of
    the newest visible slot is forced to +inf (and counts toward the limit); keep the top
    min(topk_blocks, n_blocks) blocks whose score is > −inf.
    """
    B, T, S = scores.shape
    nb = -(-S // block_size)
    if nb == 0:
        return jnp.zeros((B, T, S), bool)
    pad = nb * block_size - S
    sc = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=NEG_INF)
    bscore = jnp.max(sc.reshape(B, T, nb, block_size), axis=-1)
    newest_block = (visible - 1) // block_size  # -1 when nothing is visible
    forced = (jnp.arange(nb)[None, None, :] == newest_block[..., None]) & (visible[..., None] > 0)
    bscore = jnp.where(forced, jnp.asarray(jnp.inf, bscore.dtype), bscore)
    kb = min(topk_blocks, nb)
    vals, blocks = jax.lax.top_k(bscore, kb)
    keep = jnp.zeros((B, T, nb), bool)
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    keep = keep.at[bi, ti, blocks].set(vals > NEG_INF)
    return jnp.repeat(keep, block_size, axis=-1)[..., :S]


def select_topk(scores, k: int):
    """Top-k slots per query, ascending, −1 for picks whose score is −inf. scores [B, T, S] -> int32 [B, T, k']

    k' = min(k, S) (static); the visible-count limit is enforced by the −inf → −1 rule.
    """
    B, T, S = scores.shape
    kk = min(k, S)
    if kk == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    vals, idx = jax.lax.top_k(scores, kk)
    order = jnp.argsort(idx, axis=-1)
    idx = jnp.take_along_axis(idx, order, axis=-1)
    vals = jnp.take_along_axis(vals, order, axis=-1)
    return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)
