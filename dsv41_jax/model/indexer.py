"""Two-level sparse retrieval: index keys, index scores, candidate blocks, top-k (docs/design/spec.md §4).

Shapes: B batch, T queries, S compressed slots, nI = index_n_heads, dI = index_head_dim.
Scores are bf16 with −inf for slots a query may not pick; ties go to the lower slot (``lax.top_k``).

The seam is `topk` (op "indexer" of `dispatch`): index queries and head weights in, the key owner's
*stored codes* and the page table in, selections resolved to compressed slots out. `retrieve` is the
one index-selection routine of an index-source layer, shared by the full forward and the cached path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dispatch, linear, quant
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import (DETERMINISTIC, HIGHEST, einsum_exact, is_exact, linear_bf16, round_f32,
                                      round_to, x64_scope)
from dsv41_jax.model.rope import apply_rope

NEG_INF = -jnp.inf


def index_keys_rot(p, latent, slot_pos, freqs, eps, dt, exact: bool = False):
    """Index keys before their fp4 fake-quant: k_norm(wk · latent) → RoPE at j·ratio.

    latent: [B, S, hd] bf16 pre-RoPE unquantized; slot_pos int32 [B, S] or [S]. Returns [B, S, dI].
    `exact`: wk accumulates in fp64 (exact numerics mode).
    """
    k = rmsnorm(linear_bf16(latent, p["wk"]["weight"], dt, exact), p["k_norm"]["weight"], eps, dt, exact)
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
    w = linear_bf16(x, p["weights_proj"]["weight"], dt, exact=is_exact(cfg))  # a plain bf16 matmul (spec §1)
    w = (w * (dI ** -0.5 * nI ** -0.5)).astype(dt)
    return q, w


def raw_scores(q, w, keys, dt, exact: bool = False):
    """Σ_h w_h · ReLU(q_h · k_j), rounded to `dt` after each step, no visibility mask.

    q [B, T, nI, dI], w [B, T, nI], keys [B, S, dI] -> [B, T, S] in `dt`. fp32 accumulation inside each
    sum (the q·k dot over dI, then the sum over heads). `exact` (exact numerics mode): both sums
    accumulate in fp64 and round once to fp32, so a score does not depend on how many slots or queries
    are scored together (the reference's one pass vs the bounded loop's blocks).
    """
    if exact and exact >= DETERMINISTIC:
        # the same steps in fp64, each rounded to fp32 and then to `dt` by reduce-precision ops
        # (`numerics.round_to`), which XLA keeps in every fusion (a convert chain such as bf16 -> fp32 it
        # may fold away, so the step roundings would depend on how the scoring is fused)
        with x64_scope():
            f64 = jnp.float64
            rd = lambda x: round_to(round_f32(x), dt)  # noqa: E731
            qk = rd(jnp.einsum("bthd,bsd->bths", q.astype(f64), keys.astype(f64), precision=HIGHEST))
            prod = rd(w.astype(f64)[..., None] * jnp.maximum(qk, 0.0))
            return rd(jnp.sum(prod, axis=2)).astype(jnp.float32).astype(dt)
    if exact:
        qk = einsum_exact("bthd,bsd->bths", q, keys).astype(dt)
        prod = (w.astype(jnp.float32)[..., None] * jax.nn.relu(qk.astype(jnp.float32))).astype(dt)
        with x64_scope():
            return jnp.sum(prod.astype(jnp.float64), axis=2).astype(jnp.float32).astype(dt)
    qk = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                    precision=HIGHEST).astype(dt)
    prod = (w.astype(jnp.float32)[..., None] * jax.nn.relu(qk.astype(jnp.float32))).astype(dt)
    return jnp.sum(prod.astype(jnp.float32), axis=2).astype(dt)


def index_scores(q, w, keys, visible, dt, exact: bool = False):
    """score(t, j) = Σ_h w_h · ReLU(q_h · k_j), rounded to `dt` after each step; −inf where j ≥ visible.

    q [B, T, nI, dI], w [B, T, nI], keys [B, S, dI], visible int32 [B, T] (= (t+1)//ratio).
    Returns [B, T, S] in `dt`. `exact`: see `raw_scores`.
    """
    score = raw_scores(q, w, keys, dt, exact)
    S = keys.shape[1]
    ok = jnp.arange(S)[None, None, :] < visible[..., None]
    return jnp.where(ok, score, jnp.asarray(NEG_INF, dt))


def _canonical_blocks(vals, blocks):
    """Kept blocks (score > −inf) ascending, then −1 padding: int32 [B, T, kb]."""
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.sort(jnp.where(vals > NEG_INF, blocks, big), axis=-1)
    return jnp.where(ids == big, -1, ids).astype(jnp.int32)


def candidate_blocks(scores, visible, block_size: int, topk_blocks: int):
    """Level-1 candidates as block ids: int32 [B, T, kb], kb = min(topk_blocks, n_blocks).

    Blocks of `block_size` slots aligned at 0 (last padded with −inf) score by their max; the block of
    the newest visible slot is forced to +inf (and counts toward the limit); keep the top kb blocks
    (ties: lower block) whose score is > −inf. Returned canonically: kept ids ascending, then −1.
    """
    B, T, S = scores.shape
    nb = -(-S // block_size)
    if nb == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    pad = nb * block_size - S
    sc = jnp.pad(scores, ((0, 0), (0, 0), (0, pad)), constant_values=NEG_INF)
    bscore = jnp.max(sc.reshape(B, T, nb, block_size), axis=-1)
    newest_block = (visible - 1) // block_size  # -1 when nothing is visible
    forced = (jnp.arange(nb)[None, None, :] == newest_block[..., None]) & (visible[..., None] > 0)
    bscore = jnp.where(forced, jnp.asarray(jnp.inf, bscore.dtype), bscore)
    vals, blocks = jax.lax.top_k(bscore, min(topk_blocks, nb))
    return _canonical_blocks(vals, blocks)


def blocks_to_mask(blocks, num_slots: int, block_size: int):
    """Candidate block ids int32 [B, T, kb] (−1 = none) -> bool [B, T, num_slots] (True inside a kept block)."""
    B, T, _ = blocks.shape
    nb = -(-num_slots // block_size)
    keep = jnp.zeros((B, T, nb + 1), bool)
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    keep = keep.at[bi, ti, jnp.where(blocks >= 0, blocks, nb)].set(True)[..., :nb]
    return jnp.repeat(keep, block_size, axis=-1)[..., :num_slots]


def candidate_mask(scores, visible, block_size: int, topk_blocks: int):
    """Level-1 candidates as a mask: bool [B, T, S], True for slots inside a kept block (`candidate_blocks`)."""
    S = scores.shape[-1]
    return blocks_to_mask(candidate_blocks(scores, visible, block_size, topk_blocks), S, block_size)


def _ascending_picks(vals, idx):
    """Top-k picks (vals, slot idx) -> slots ascending, −1 where the pick's score is −inf."""
    order = jnp.argsort(idx, axis=-1)
    idx = jnp.take_along_axis(idx, order, axis=-1)
    vals = jnp.take_along_axis(vals, order, axis=-1)
    return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)


def select_topk(scores, k: int):
    """Top-k slots per query, ascending, −1 for picks whose score is −inf. scores [B, T, S] -> int32 [B, T, k']

    k' = min(k, S) (static); the visible-count limit is enforced by the −inf → −1 rule.
    """
    B, T, S = scores.shape
    kk = min(k, S)
    if kk == 0:
        return jnp.zeros((B, T, 0), jnp.int32)
    vals, idx = jax.lax.top_k(scores, kk)
    return _ascending_picks(vals, idx)


# ----------------------------------------------------------------------------------------- the seam


def pool_index(page_table, slots, ratio: int, page_size: int):
    """Compressed-pool row of compressed slot j of each batch row: loc(j·ratio) // ratio.

    page_table int32 [B, P]; slots int32 [B, ...] -> int32 [B, ...]. Slots past the page table clamp
    to its last page (callers mask them).
    """
    return kvc.token_locs(page_table, slots * ratio, page_size) // ratio


# Default slots scored per step of the bounded loop (`_topk_xla`; `CacheConfig.retrieval_block` on the
# cached path): large enough that a long context takes few steps, small enough that a short one wastes
# little. Rounded up to a multiple of the candidate block size.
RETRIEVAL_BLOCK = 512


def topk(q, w, ikeys, page_table, visible, *, ratio: int, page_size: int, mode: str, k: int, dt,
         cand_blocks=None, make_candidates: bool = False, block_size: int = 1, topk_blocks: int = 0,
         impl: str = "reference", retrieval_block: int = RETRIEVAL_BLOCK, exact: bool = False):
    """The indexer seam: top-k compressed slots of each query over a key owner's paged index keys.

    Inputs (B rows, T queries per row, nI = index_n_heads, dI = index_head_dim):
      q           [B, T, nI, dI] `dt`   index queries (RoPE'd, fp4 fake-quantized: `index_query`)
      w           [B, T, nI]     `dt`   head weights (already scaled by dI^−0.5 · nI^−0.5)
      ikeys       dict of stored codes of the key owner's pool, first axis = pool rows N
                  (`cache.empty_store("ikey", mode, (N,), dI)`, e.g. {"q": uint8 [N, dI/2] packed
                  e2m1, "s": e8m0 [N, dI/32]} in the default mode); decoded with `cache.decode`
      page_table  int32 [B, P]  the rows' pages; slot j of row b lives at pool row
                  `pool_index(page_table, j, ratio, page_size)` = loc(j·ratio) // ratio
      visible     int32 [B, T]  slots query t may see, (pos + 1) // ratio; the live context of a row
                  is its largest `visible`
      cand_blocks int32 [B, T, kb] or None: level-1 candidate block ids (ascending, −1 = none) from the
                  candidate source; when given, slots outside those blocks score −inf first
      make_candidates: this layer is the candidate source: also return its candidate blocks (scored on
                  its own unmasked scores)
    Static: ratio, page_size, mode (kv_cache_dtype), k (index_topk), dt, block_size / topk_blocks
    (candidate_block_size / candidate_topk_blocks), impl ("reference" | "xla" | Pallas), retrieval_block,
    exact (the exact numerics mode: fp64-accumulated scores, `raw_scores`; "reference" and "xla" only).

    S = P · page_size // ratio is the slot extent of the page table (static).
    Returns (sel int32 [B, T, min(k, S)]: picked slots ascending, −1 for picks whose score is −inf —
    the layout `select_topk` gives over all S slots, bit for bit;
    cand int32 [B, T, min(topk_blocks, ceil(S / block_size))] candidate block ids (ascending, −1
    padding) if make_candidates, else None).

    Scores are docs/design/spec.md §4's bf16 (or fp32 in the fp32 mode) with ties to the lower slot; both
    implementations give identical selections, since every score is the same per-element arithmetic
    (bf16 caveat: docs/design/fastpath_attention.md, "excess precision"). A Pallas kernel registered for
    "indexer" is called with these arguments (minus `impl`, `retrieval_block`) plus `interpret`.
    """
    S = page_table.shape[1] * page_size // ratio
    B, T = visible.shape
    kk = min(k, S)
    kb = min(topk_blocks, -(-S // block_size)) if make_candidates else 0
    if kk == 0:  # nothing can ever be selected
        return jnp.zeros((B, T, 0), jnp.int32), (jnp.zeros((B, T, 0), jnp.int32) if make_candidates else None)
    if impl == "reference":
        return _topk_reference(q, w, ikeys, page_table, visible, ratio=ratio, page_size=page_size, mode=mode,
                               k=k, dt=dt, cand_blocks=cand_blocks, make_candidates=make_candidates,
                               block_size=block_size, topk_blocks=topk_blocks, exact=exact)
    if impl == "xla":
        return _topk_xla(q, w, ikeys, page_table, visible, ratio=ratio, page_size=page_size, mode=mode, k=kk,
                         kb=kb, dt=dt, cand_blocks=cand_blocks, make_candidates=make_candidates,
                         block_size=block_size, retrieval_block=retrieval_block, exact=exact)
    if exact:
        raise dispatch.ImplError(f"indexer: the exact / deterministic numerics modes have no {impl!r} implementation (fp64 "
                                 f"accumulation is for the jnp paths: use impl 'indexer=xla' or 'reference')")
    return dispatch.kernel("indexer", impl)(
        q, w, ikeys, page_table, visible, ratio=ratio, page_size=page_size, mode=mode, k=k, dt=dt,
        cand_blocks=cand_blocks, make_candidates=make_candidates, block_size=block_size,
        topk_blocks=topk_blocks, interpret=impl == "pallas_interpret")


def _topk_reference(q, w, ikeys, page_table, visible, *, ratio, page_size, mode, k, dt, cand_blocks,
                    make_candidates, block_size, topk_blocks, exact=False):
    """The reference: decode all S slots the page table can address, score them all, top-k once."""
    B = visible.shape[0]
    S = page_table.shape[1] * page_size // ratio
    jj = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
    keys = kvc.decode("ikey", mode, kvc.store_get(ikeys, pool_index(page_table, jj, ratio, page_size)), dt)
    scores = index_scores(q, w, keys, visible, dt, exact)
    cand = candidate_blocks(scores, visible, block_size, topk_blocks) if make_candidates else None
    if cand_blocks is not None:
        scores = jnp.where(blocks_to_mask(cand_blocks, S, block_size), scores, jnp.asarray(NEG_INF, scores.dtype))
    return select_topk(scores, k), cand


def _topk_xla(q, w, ikeys, page_table, visible, *, ratio, page_size, mode, k, kb, dt, cand_blocks,
              make_candidates, block_size, retrieval_block, exact=False):
    """Retrieval bounded by the live context: a loop over blocks of slots with a running top-k.

    Design (why a loop rather than length buckets): the trip count is dynamic — ceil(L / Bs) steps for
    L = the largest `visible` in the batch — so one compiled step serves every context length, and a
    64-token context scores one block of Bs slots whatever `max_context` the page table allows. The
    caller needs no bucketing and recompiles nothing as contexts grow. Each step gathers the codes of
    Bs consecutive slots through the page table (only pages the rows hold, or page-table padding for
    rows with less context, masked), scores them, and merges them into a running top-k (and, at the
    candidate source, a running top-kb of block scores).

    Identical selections to `_topk_reference`, −1 layout included, by construction:
    * Steps run from the highest live block down to block 0, and each merge is
      ``top_k(concat[new block, running])``: `lax.top_k` breaks ties by position, the new block's
      slots are all lower than the running ones, and the running entries are kept in `top_k` order
      (equal scores in ascending slot order) — so every merge picks by (score desc, slot asc), the
      global rule.
    * The running top-k starts as −inf "fillers" standing for slots L', L'+1, … (L' = the live blocks'
      end). Those slots are −inf in the reference (not visible), and they come after every real slot
      in the order, so a filler is picked exactly when the reference picks that −inf slot; with
      `_ascending_picks` the −1 entries land where the reference puts them.
    * Blocks of slots beyond S (padding of the last step) are −inf and never outrank a real slot,
      since k ≤ S.
    * Candidate blocks: Bs is a multiple of block_size, so a step holds whole blocks; block scores,
      the forced newest block and the merge follow the same rules; only blocks with score > −inf are
      kept, so −inf fillers never matter there.
    The per-slot arithmetic is `raw_scores` on the same operands, so scores agree bitwise as long as
    the dot over dI is evaluated in the same order (measured: bitwise on CPU; see
    tests/test_fastpath_attention.py).
    """
    B, T = visible.shape
    S = page_table.shape[1] * page_size // ratio
    Bs = -(-min(retrieval_block, -(-S // block_size) * block_size) // block_size) * block_size
    n_max = -(-S // Bs)
    nbc = Bs // block_size  # candidate blocks per step
    nb = -(-S // block_size)  # real candidate blocks
    vis = jnp.minimum(visible, S)
    n_live = jnp.clip((jnp.max(vis) + Bs - 1) // Bs, 0, n_max).astype(jnp.int32)
    end = n_live * Bs
    ninf = jnp.asarray(NEG_INF, dt)
    bi = jnp.arange(B)[:, None, None]
    ti = jnp.arange(T)[None, :, None]
    run_v = jnp.full((B, T, k), NEG_INF, dt)
    run_i = jnp.broadcast_to(end + jnp.arange(k, dtype=jnp.int32), (B, T, k))
    carry = (run_v, run_i)
    if make_candidates:
        carry += (jnp.full((B, T, kb), NEG_INF, dt),
                  jnp.broadcast_to(n_live * nbc + jnp.arange(kb, dtype=jnp.int32), (B, T, kb)))

    def body(i, carry):
        c = n_live - 1 - i
        j0 = c * Bs
        jj = j0 + jnp.arange(Bs, dtype=jnp.int32)  # [Bs] slots of this step
        rows = pool_index(page_table, jnp.broadcast_to(jj[None, :], (B, Bs)), ratio, page_size)
        keys = kvc.decode("ikey", mode, kvc.store_get(ikeys, rows), dt)  # [B, Bs, dI]
        sc = raw_scores(q, w, keys, dt, exact)
        sc = jnp.where(jj[None, None, :] < vis[..., None], sc, ninf)  # [B, T, Bs]
        out = ()
        if make_candidates:
            bv, bidx = carry[2], carry[3]
            bsc = jnp.max(sc.reshape(B, T, nbc, block_size), axis=-1)
            gb = c * nbc + jnp.arange(nbc, dtype=jnp.int32)  # global block ids
            # The newest visible block, from the unclamped `visible` as the reference does: a padding
            # query past the table end (visible > S) forces no block; padded blocks (≥ nb) never.
            forced = ((gb[None, None, :] == ((visible - 1) // block_size)[..., None]) & (visible[..., None] > 0)
                      & (gb < nb)[None, None, :])
            bsc = jnp.where(forced, jnp.asarray(jnp.inf, dt), bsc)
            cv = jnp.concatenate([bsc, bv], axis=-1)
            ci = jnp.concatenate([jnp.broadcast_to(gb, (B, T, nbc)), bidx], axis=-1)
            bv, pos = jax.lax.top_k(cv, kb)
            out = (bv, jnp.take_along_axis(ci, pos, axis=-1))
        if cand_blocks is not None:
            local = cand_blocks - c * nbc
            local = jnp.where((cand_blocks >= 0) & (local >= 0) & (local < nbc), local, nbc)
            inblk = jnp.zeros((B, T, nbc + 1), bool).at[bi, ti, local].set(True)[..., :nbc]
            sc = jnp.where(jnp.repeat(inblk, block_size, axis=-1), sc, ninf)
        cv = jnp.concatenate([sc, carry[0]], axis=-1)
        ci = jnp.concatenate([jnp.broadcast_to(jj, (B, T, Bs)), carry[1]], axis=-1)
        v, pos = jax.lax.top_k(cv, k)
        return (v, jnp.take_along_axis(ci, pos, axis=-1)) + out

    carry = jax.lax.fori_loop(0, n_live, body, carry)
    sel = _ascending_picks(carry[0], carry[1])
    cand = _canonical_blocks(carry[2], carry[3]) if make_candidates else None
    return sel, cand


def retrieve(p, qr, x, positions, freqs, plan, ctx, ikeys, page_table, *, page_size: int, mode: str,
             cfg, dt, retrieval_block: int = RETRIEVAL_BLOCK):
    """Index selection of an index-source layer: the one routine `forward` and the cached path share.

    p: the layer's ``indexer`` params; qr [B, T, q_lora] its normed q latent; x [B, T, D] its normed
    sublayer input; positions int32 [B, T]; freqs its RoPE frequencies; ikeys / page_table: the key
    owner's stored index-key codes and the page table addressing them (see `topk`). Index query →
    scores → (candidate blocks at the candidate source; candidate mask at layers past it) → top-k.
    Returns (ctx', rec): ctx' is `ctx` (not modified) with ctx'["topk"][layer] (int32 [B, T, k']) and, at
    the candidate source, ctx'["cand"] (block ids [B, T, kb]); rec is the layer's record for the
    forward's aux: {"topk": the same top-k[, "cand": the candidate *mask* bool [B, T, S]]} (for
    tests/tools; dead code under jit unless returned).
    """
    lid, r = plan.layer_id, plan.compress_ratio
    visible = (positions + 1) // r
    iq, iw = index_query(p, qr, x, positions, freqs, cfg, dt)
    sel, cand = topk(iq, iw, ikeys, page_table, visible, ratio=r, page_size=page_size, mode=mode,
                     k=cfg.index_topk, dt=dt, cand_blocks=ctx["cand"] if plan.uses_candidates else None,
                     make_candidates=plan.is_candidate_source, block_size=cfg.candidate_block_size,
                     topk_blocks=cfg.candidate_topk_blocks, impl=dispatch.resolve(cfg, "indexer"),
                     retrieval_block=retrieval_block, exact=is_exact(cfg))
    ctx = dict(ctx, topk={**ctx["topk"], lid: sel})
    rec = {"topk": sel}
    if plan.is_candidate_source:
        ctx["cand"] = cand
        S = page_table.shape[1] * page_size // r
        rec["cand"] = blocks_to_mask(cand, S, cfg.candidate_block_size)
    return ctx, rec
