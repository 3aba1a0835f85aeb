"""Pallas indexer kernel: index scores over the paged index keys, candidate blocks, top-k (docs/design/spec.md §4).

Entry `kernel` has the arguments of the seam `dsv41_jax.model.indexer.topk` (minus ``impl`` and
``retrieval_block``) plus ``interpret``, and returns exactly what the reference returns: the picked
slots ascending with the reference's −1 layout, and (at the candidate source) the canonical candidate
block ids. Registered as ``KERNEL_MODULES["indexer"]`` in `dsv41_jax.model.dispatch`.

Lowering: Pallas' **Triton** lowering (see `dsv41_jax.pallas.common`). The kernel reads index keys
through the page table, i.e. a row gather (``codes_ref[rows, cols]``), which Triton lowers to a
pointer gather and Mosaic GPU cannot express on Hopper. The kernels use only elementwise ops,
reductions, one 2-D dot, cumsum, while/for loops, ``pl.when`` and int-array-indexed ref loads/stores
(one indexer each), all of which have Triton lowering rules (jax/_src/pallas/triton/lowering.py); no
sort / top_k / lax gather / scatter primitive; every tensor has a power-of-two size; e8m0 / e4m3 codes
are bitcast to uint8 outside and decoded with integer ops inside, so no fp8 dtype reaches a kernel.
Checked: every variant lowers to Triton IR (``jit(...).trace(...).lower(lowering_platforms=("cuda",))``
on CPU), at the tests' shapes and at flash shapes.

Algorithm (why): the Triton lowering has no sort or top_k, and a per-block partial top-512 with a merge
would need a sorting network over 512+ lanes in registers per block (plus a merge tree) — bulky to
write with only 2-way join/concat and expensive in registers. Instead, two stages:

1. **Scoring** (`_dense_kernel`, `_cand_kernel`): fused page-table gather → in-kernel dequantization
   of the stored codes → q·k dot (bf16 MMA with fp32 accumulate in the bf16 flow; IEEE fp32 in the
   fp32 flow) → ReLU-weighted head sum, with SPEC's roundings (to ``dt`` after the dot, after the
   weight product, after the head sum) → causal limit. Writes ``dt`` scores for the live slots only
   (bounded by the live context: a dynamic trip count per row, no work past it), plus, at the
   candidate source, the block maxima. Grid (rows, splits): each program strides over the row's
   live slot blocks, decodes a block of keys once and scores it for all T queries of the row.
   Layers that mask to candidate blocks score only the candidate slots (the blocks in
   ``cand_blocks``: at most 2048 × 8 slots in flash instead of up to 1M), programs per query.
   The score round trip through HBM is 2 B (bf16) per slot and query, against 68 B of codes per slot.
2. **Selection** (`_select_kernel`, one program per query): a radix select on the order-preserving
   integer key of the score (the float's bits made monotone; 16 bits in the bf16 flow, 32 in fp32):
   4 bits per pass, 15 thresholds counted at once (``key >= thr`` summed over chunks), which finds
   the k-th largest key θ and the count above it; then one ascending pass compacts the picks with
   cumsums (keys > θ, then the lowest slots with key == θ — the reference's "lower slot wins"),
   stopping as soon as all are placed. Each pick is scattered straight to its final output position
   (the −1 layout of the reference, see `_select_kernel`), so no sort is ever needed. The same
   kernel selects the candidate blocks (the forced newest block keyed as +inf). Cost: 4 (bf16) or 8
   (fp32) reads of a query's live scores plus one partial read, all on one program; at batch 1 with
   very long contexts that is one SM per query — splitting the counting over slot ranges (partial
   counts merged between passes) is the next step if measurements call for it.

Identity with the reference: every score is SPEC's per-element arithmetic (`raw_scores`, each rounding
kept); the selection is exact integer logic on the scores (ties to the lower slot; −0 below +0 as
``lax.top_k`` orders them). Scores agree bitwise whenever the fp32 sums (the dot over dI, the head sum)
are exact, which fp4 keys and queries make the dot; otherwise their order matters (Triton's MMA and
tree reductions vs XLA's). Measured on CPU (interpret mode): scores equal SPEC's step-by-step
arithmetic and the *eagerly* run reference bit for bit; the *jitted* bf16 reference differs from both
on about half of random scores, because XLA fuses bf16 roundings away (docs/design/fastpath_attention.md, with
or without --xla_allow_excess_precision=false) — so in the bf16 flow on inexact values the kernel can
pick differently from the jitted reference/xla paths, being the one that follows SPEC. Other caveats:
with ``index_n_heads == 1`` XLA folds the head sum away and a reference score can be −0 where this one
is +0; NaN scores are not ordered as ``lax.top_k`` orders them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from dsv41_jax.model import dispatch, indexer
from dsv41_jax.model.codec import e2m1_decode, e4m3_decode, e8m0_decode
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas.common import is_pow2, log_choice, next_pow2, triton_params

# Slots scored per step of a scoring program (the dot's N; a multiple of the candidate block size).
SLOT_BLOCK = 64
# Slots per step of a selection program (the radix passes and the compaction).
SELECT_CHUNK = 512
# Aim for about this many scoring programs (H200: 132 SMs, a few resident programs each).
TARGET_PROGRAMS = 1024
_RADIX = 4  # bits resolved per counting pass
_BIG = 1 << 30  # "count" of thresholds at or below the −inf key: always enough


# ----------------------------------------------------------------------------------------- in-kernel helpers


def _cdiv(a, b: int):
    """ceil(a / b) for non-negative int32 scalars (lax.div truncates, = floor here)."""
    return lax.div(a + (b - 1), b)


def _order_key(s, nbits: int):
    """Monotone int32 key of fp32 scores `s` (total order: −inf < finite < +inf, −0 < +0).

    nbits = 16 for scores that are bf16 values (the low 16 bits carry nothing), 32 for fp32.
    """
    b = lax.bitcast_convert_type(s, jnp.int32)
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return k >> (32 - nbits) if nbits < 32 else k


def _host_key(x: float, nbits: int) -> int:
    b = int(np.array(x, np.float32).view(np.int32))
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return k >> (32 - nbits)


def _round(x, dt):
    """fp32 -> `dt` -> fp32: SPEC's rounding step (a no-op in the fp32 flow)."""
    return x if dt == jnp.float32 else x.astype(dt).astype(jnp.float32)


class _Geo:
    """Static geometry shared by the kernels (shapes, page addressing, key codec)."""

    def __init__(self, *, B, T, nI, dI, P, N, S, ratio, page_size, codec, dt):
        self.B, self.T, self.nI, self.dI, self.P, self.N, self.S = B, T, nI, dI, P, N, S
        self.ratio, self.page_size, self.codec, self.dt = ratio, page_size, codec, dt

    def rows(self, pt_ref, b, j, live):
        """Pool rows of slots j [n] of batch row b (0 where not live): loc(j·ratio) // ratio."""
        tok = j * self.ratio
        pidx = jnp.minimum(lax.div(tok, self.page_size), self.P - 1)
        page = pt_ref[b * self.P + pidx]
        row = lax.div(page * self.page_size + lax.rem(tok, self.page_size), self.ratio)
        return jnp.where(live, jnp.clip(row, 0, self.N - 1), 0)

    def keys(self, code_refs, rows):
        """Decode the stored codes of pool rows [n] -> index keys [n, dI] in `dt` (as `cache.decode`)."""
        n, dI = rows.shape[0], self.dI
        r2 = jnp.broadcast_to(rows[:, None], (n, dI))
        c2 = jnp.broadcast_to(jnp.arange(dI, dtype=jnp.int32)[None, :], (n, dI))
        if self.codec == "raw":
            (v_ref,) = code_refs
            return v_ref[r2, c2].astype(jnp.float32).astype(self.dt)
        q_ref, s_ref = code_refs
        scale = e8m0_decode(s_ref[r2, c2 >> 5].astype(jnp.int32), jnp)
        if self.codec == "fp4":  # two codes per byte, low nibble = even element
            byte = q_ref[r2, c2 >> 1].astype(jnp.int32)
            v = e2m1_decode((byte >> ((c2 & 1) << 2)) & 15, jnp)
        else:
            v = e4m3_decode(q_ref[r2, c2].astype(jnp.int32), jnp)
        return (v * scale).astype(self.dt)

    def scores(self, qt, wt, keys):
        """Σ_h dt(w_h · ReLU(dt(q_h · k_j))) rounded to dt: qt [nIp, dI], wt [nIp], keys [n, dI] -> [n] fp32.

        The + 0.0 gives XLA's reduce semantics (init +0) to the head sum: an all-(−0) sum is +0.
        """
        hi = lax.Precision.HIGHEST if self.dt == jnp.float32 else None
        qk = lax.dot_general(qt, keys, (((1,), (1,)), ((), ())), precision=hi,
                             preferred_element_type=jnp.float32)  # [nIp, n]
        qk = _round(qk, self.dt)
        prod = _round(wt.astype(jnp.float32)[:, None] * jnp.maximum(qk, 0.0), self.dt)
        return _round(jnp.sum(prod, axis=0) + 0.0, self.dt)


# ----------------------------------------------------------------------------------------- scoring kernels


def _dense_kernel(*refs, geo: _Geo, n_codes: int, Bs: int, split: int, bs: int, make_cand: bool):
    """Scores of every live slot of a batch row, for all its queries; block maxima at the candidate source.

    Grid (B, split). Inputs: vis [B, T] (clamped to [0, S]), row_live [B] (max_t vis), page table
    [B·P], codes, q [B, T, nIp, dI], w [B, T, nIp]. Outputs: scores [B, T, Wd] dt (slot j of query t
    at [b, t, j]; −inf past the query's `vis`; written for the live slot blocks only), and, if
    make_cand, block maxima [B, T, Wb] dt.
    """
    vis_ref, rl_ref, pt_ref = refs[:3]
    code_refs = refs[3:3 + n_codes]
    q_ref, w_ref, sc_ref = refs[3 + n_codes:6 + n_codes]
    bsc_ref = refs[6 + n_codes] if make_cand else None
    b, p = pl.program_id(0), pl.program_id(1)
    L = rl_ref[b]
    iters = _cdiv(jnp.maximum(_cdiv(L, Bs) - p, 0), split)
    nbc = Bs // bs
    lane = jnp.arange(Bs, dtype=jnp.int32)

    grp = jnp.arange(nbc, dtype=jnp.int32)[:, None] == lax.div(lane, bs)[None, :]  # [nbc, Bs] block membership
    # Decode (T = 1): the query and its weights stay in registers across the row's blocks.
    qw0 = (q_ref[b, 0], w_ref[b, 0]) if geo.T == 1 else None

    def emit(t, c, j, keys, qt, wt):
        vt = vis_ref[b, t]
        s = jnp.where(j < vt, geo.scores(qt, wt, keys), -jnp.inf)
        sc_ref[b, t, pl.ds(c * Bs, Bs)] = s.astype(sc_ref.dtype)
        if make_cand:
            bm = jnp.max(jnp.where(grp, s[None, :], -jnp.inf), axis=1)
            bsc_ref[b, t, pl.ds(c * nbc, nbc)] = bm.astype(bsc_ref.dtype)

    def block(i, carry):
        c = p + i * split
        j = c * Bs + lane
        keys = geo.keys(code_refs, geo.rows(pt_ref, b, j, j < L))
        if qw0 is not None:  # the row's only query sees this block (L = its visible count)
            emit(0, c, j, keys, *qw0)
            return carry

        def query(t, carry2):
            @pl.when(c * Bs < vis_ref[b, t])  # queries that see none of this block skip it
            def _():
                emit(t, c, j, keys, q_ref[b, t], w_ref[b, t])

            return carry2

        return lax.fori_loop(0, geo.T, query, carry)

    lax.fori_loop(0, iters, block, 0)


def _cand_kernel(*refs, geo: _Geo, n_codes: int, Bs: int, split: int, bs: int, kb_in: int):
    """Scores of the candidate slots of one query (layers that mask to the candidate blocks).

    Grid (B, T, split). Domain index u ∈ [0, lim) ↦ slot cand_blocks[b, t, u // bs]·bs + u % bs.
    Inputs: vis [B, T] (clamped), lim [B, T] (= #valid candidate blocks · bs), cand_blocks [B, T, kb_in],
    page table [B·P], codes, q, w. Output: scores [B, T, Wc] dt (−inf where the slot is not visible).
    """
    vis_ref, lim_ref, cb_ref, pt_ref = refs[:4]
    code_refs = refs[4:4 + n_codes]
    q_ref, w_ref, sc_ref = refs[4 + n_codes:7 + n_codes]
    b, t, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lim, vt = lim_ref[b, t], vis_ref[b, t]
    iters = _cdiv(jnp.maximum(_cdiv(lim, Bs) - p, 0), split)
    lane = jnp.arange(Bs, dtype=jnp.int32)

    def block(i, carry):
        c = p + i * split
        u = c * Bs + lane
        e = lax.div(u, bs)
        blk = cb_ref[b, t, jnp.minimum(e, kb_in - 1)]
        j = blk * bs + (u - e * bs)
        live = (u < lim) & (blk >= 0) & (j < vt)
        keys = geo.keys(code_refs, geo.rows(pt_ref, b, jnp.where(live, j, 0), live))
        s = geo.scores(q_ref[b, t], w_ref[b, t], keys)
        sc_ref[b, t, pl.ds(c * Bs, Bs)] = jnp.where(live, s, -jnp.inf).astype(sc_ref.dtype)
        return carry

    lax.fori_loop(0, iters, block, 0)


# ----------------------------------------------------------------------------------------- selection kernel


def _select_kernel(*refs, kind: str, n: int, C: int, nbits: int, S: int, bs: int, nb: int, kb_in: int):
    """Top-`n` of one query's domain by (score desc, index asc), written in ascending order.

    Grid (B, T). kind: "slots" (domain = slots [0, vis)), "cand" (domain = candidate slots, mapped
    through cand_blocks) or "blocks" (domain = candidate blocks [0, ceil(vis / bs)), the block holding
    the newest visible slot keyed as +inf). Inputs: visible [B, T] (unclamped), [lim [B, T],
    cand_blocks [B, T, kb_in] for "cand"], scores [B, T, W] dt, and the output buffer's initial value
    (−1 everywhere; aliased to the output [B, T, n + C]).

    Radix select: θ = the largest key x with #(key ≥ x) ≥ n, 4 bits per pass; thresholds at or below
    the −inf key count as "enough" (every slot past the domain is −inf too), so θ = key(−inf) exactly
    when fewer than n scores are finite. `above` = #(key > θ) falls out of the passes.
    Output layout (the reference's): the picked set is the finite picks F (f_0 < f_1 < …) plus, when
    |F| < n, the m = n − |F| lowest −inf slots ("fillers", shown as −1). Pick f_i then sits at
    i + min(m, f_i − i) (f_i − i is the number of non-F slots below it, of which the first m are
    fillers); every other position keeps −1. Blocks use m = 0: kept ids first, then −1 padding.
    Positions of lanes that pick nothing go to a private dump region [n, n + C) (distinct per lane),
    so the scatter never has two writers of one address.
    """
    if kind == "cand":
        vis_ref, lim_ref, cb_ref, sc_ref, _init, out_ref = refs
    else:
        vis_ref, sc_ref, _init, out_ref = refs
    b, t = pl.program_id(0), pl.program_id(1)
    visible = vis_ref[b, t]
    vis = jnp.clip(visible, 0, S)
    k_ninf, k_pinf = _host_key(-np.inf, nbits), _host_key(np.inf, nbits)
    if kind == "slots":
        L = vis
    elif kind == "blocks":
        L = _cdiv(vis, bs)
        forced = jnp.where(visible > 0, lax.div(jnp.maximum(visible, 1) - 1, bs), -1)
        forced = jnp.where(forced < nb, forced, -1)
    else:
        L = lim_ref[b, t]
    nch = _cdiv(L, C)
    lane = jnp.arange(C, dtype=jnp.int32)

    def chunk(c):
        u = c * C + lane
        key = _order_key(sc_ref[b, t, pl.ds(c * C, C)].astype(jnp.float32), nbits)
        key = jnp.where(u < L, key, k_ninf)
        if kind == "blocks":
            key = jnp.where(u == forced, k_pinf, key)
        return u, key

    # --- radix select: θ and #(key > θ)
    r = jnp.arange(1 << _RADIX, dtype=jnp.int32)
    base = jnp.int32(-(1 << (nbits - 1)))
    above = jnp.int32(0)
    for pss in range(nbits // _RADIX):
        step = 1 << (nbits - _RADIX * (pss + 1))
        thr = base + r * step  # r·step may wrap in int32; the sums are in range, hence exact

        def count(c, acc, thr=thr):
            _, key = chunk(c)
            return acc + jnp.sum((key[:, None] >= thr[None, :]).astype(jnp.int32), axis=0)

        cnt = lax.fori_loop(0, nch, count, jnp.zeros((1 << _RADIX,), jnp.int32))
        cnt = jnp.where(thr > k_ninf, cnt, _BIG)
        i = jnp.sum(((cnt >= n) & (r >= 1)).astype(jnp.int32))
        above = jnp.where(i == (1 << _RADIX) - 1, above, jnp.sum(jnp.where(r == i + 1, cnt, 0)))
        base = base + i * step
    theta = base
    finite_theta = theta > k_ninf
    need = n - above  # picks among key == θ (lowest index first), when θ is finite
    n_take = jnp.where(finite_theta, n, above)
    m = 0 if kind == "blocks" else jnp.where(finite_theta, 0, n - above)

    # --- ascending compaction, straight to the output positions
    def cond(st):
        c, taken, _ = st
        return (c < nch) & (taken < n_take)

    def body(st):
        c, taken, eqs = st
        u, key = chunk(c)
        eq = (key == theta) & finite_theta
        eqi = eq.astype(jnp.int32)
        take = (key > theta) | (eq & (eqs + jnp.cumsum(eqi) <= need))
        ti = take.astype(jnp.int32)
        rank = taken + jnp.cumsum(ti) - 1
        if kind == "cand":
            e = lax.div(u, bs)
            j = cb_ref[b, t, jnp.minimum(e, kb_in - 1)] * bs + (u - e * bs)
        else:
            j = u
        pos = jnp.where(take, rank + jnp.minimum(m, j - rank), n + lane)
        out_ref[b, t, pos] = jnp.where(take, j, -1)
        return c + 1, taken + jnp.sum(ti), eqs + jnp.sum(eqi)

    lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), jnp.int32(0)))


# ----------------------------------------------------------------------------------------- entry


def _codes(ikeys: dict, mode: str):
    """Stored codes -> (codec, [arrays]) with e8m0 / e4m3 bitcast to uint8 (decoded in the kernel)."""
    if mode == "auto":
        return "fp4", [ikeys["q"], lax.bitcast_convert_type(ikeys["s"], jnp.uint8)]
    if mode == "fp8_e4m3":
        return "fp8", [lax.bitcast_convert_type(ikeys["q"], jnp.uint8),
                       lax.bitcast_convert_type(ikeys["s"], jnp.uint8)]
    if mode in ("bfloat16", "float32"):
        return "raw", [ikeys["v"]]
    raise ValueError(f"indexer_topk: unknown kv_cache_dtype {mode!r}")


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _Setup:
    """What every stage of one call shares: geometry, the codes as kernel inputs, padded q / w."""

    def __init__(self, q, w, ikeys, page_table, visible, *, ratio, page_size, mode, dt, interpret):
        dt = jnp.dtype(dt)
        B, T, nI, dI = q.shape
        P = page_table.shape[1]
        S = P * page_size // ratio
        if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise NotImplementedError(f"indexer_topk: dt {dt} (bfloat16 or float32 only)")
        if dI < 16 or not is_pow2(dI):
            raise NotImplementedError(f"indexer_topk: index_head_dim {dI} must be a power of two >= 16")
        self.codec, self.codes = _codes(ikeys, mode)
        self.geo = _Geo(B=B, T=T, nI=nI, dI=dI, P=P, N=self.codes[0].shape[0], S=S, ratio=ratio,
                        page_size=page_size, codec=self.codec, dt=dt)
        self.B, self.T, self.S, self.dt, self.interpret = B, T, S, dt, interpret
        self.nbits = 16 if dt == jnp.bfloat16 else 32
        self.params = triton_params(num_warps=4, num_stages=2)
        # Heads padded to a power of two ≥ 16 (the dot's M): zero queries and weights add +0 to the sum.
        nIp = max(16, next_pow2(nI))
        self.qp = jnp.pad(q.astype(dt), ((0, 0), (0, 0), (0, nIp - nI), (0, 0)))
        self.wp = jnp.pad(w.astype(dt), ((0, 0), (0, 0), (0, nIp - nI)))
        self.visible = visible.astype(jnp.int32)
        self.vis = jnp.clip(self.visible, 0, S)
        self.pt = page_table.astype(jnp.int32).reshape(-1)

    def call(self, fn, grid, out_shape, *ins, aliases=None, **static):
        return pl.pallas_call(_kernel_fn(fn, **static), out_shape=out_shape, grid=grid, interpret=self.interpret,
                              compiler_params=self.params, input_output_aliases=aliases or {})(*ins)

    def dense(self, *, Bs, width_mult, block_size, make_candidates, target_programs):
        """`_dense_kernel`: (scores [B, T, Wd] dt, block maxima [B, T, Wb] dt or absent)."""
        B, T, S, dt = self.B, self.T, self.S, self.dt
        nblk = -(-S // Bs)
        split = max(1, min(nblk, -(-target_programs // B)))
        outs = [jax.ShapeDtypeStruct((B, T, _round_up(nblk * Bs, width_mult)), dt)]
        if make_candidates:
            outs.append(jax.ShapeDtypeStruct((B, T, _round_up(nblk * (Bs // block_size), width_mult)), dt))
        return self.call(_dense_kernel, (B, split), tuple(outs), self.vis, jnp.max(self.vis, axis=1), self.pt,
                         *self.codes, self.qp, self.wp, geo=self.geo, n_codes=len(self.codes), Bs=Bs, split=split,
                         bs=block_size, make_cand=make_candidates)

    def candidate_scores(self, cb, lim, *, Bs, width_mult, block_size, target_programs):
        """`_cand_kernel`: scores of the candidate slots [B, T, Wc] dt."""
        B, T = self.B, self.T
        kb_in = cb.shape[-1]
        nch = -(-(kb_in * block_size) // Bs)
        split = max(1, min(nch, -(-target_programs // (B * T))))
        out = jax.ShapeDtypeStruct((B, T, _round_up(nch * Bs, width_mult)), self.dt)
        return self.call(_cand_kernel, (B, T, split), out, self.vis, lim, cb, self.pt, *self.codes, self.qp,
                         self.wp, geo=self.geo, n_codes=len(self.codes), Bs=Bs, split=split, bs=block_size,
                         kb_in=kb_in)

    def select(self, kind, scores, n, *, C, block_size, extra=()):
        """`_select_kernel` over one domain: int32 [B, T, n]."""
        B, T = self.B, self.T
        init = jnp.full((B, T, n + C), -1, jnp.int32)
        ins = (self.visible,) + tuple(extra) + (scores, init)
        out = self.call(_select_kernel, (B, T), jax.ShapeDtypeStruct(init.shape, jnp.int32), *ins,
                        aliases={len(ins) - 1: 0}, kind=kind, n=n, C=C, nbits=self.nbits, S=self.S,
                        bs=block_size, nb=-(-self.S // block_size), kb_in=extra[1].shape[-1] if extra else 1)
        return out[..., :n]


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` runs `cfg`: the fp32 numerics, index_head_dim a power of two ≥ 16, the candidate
    block size a power of two; every ``kv_cache_dtype`` `mode`."""
    return (not is_exact(cfg) and cfg.index_head_dim >= 16 and is_pow2(cfg.index_head_dim)
            and is_pow2(cfg.candidate_block_size))


def _check_tile(name: str, v: int) -> None:
    if v < 16 or v & (v - 1):
        raise ValueError(f"indexer_topk: {name} = {v} must be a power of two >= 16")


def kernel(q, w, ikeys, page_table, visible, *, ratio: int, page_size: int, mode: str, k: int, dt,
           cand_blocks=None, make_candidates: bool = False, block_size: int = 1, topk_blocks: int = 0,
           interpret: bool = False, slot_block: int = SLOT_BLOCK, select_chunk: int = SELECT_CHUNK,
           target_programs: int = TARGET_PROGRAMS):
    """The indexer seam (`dsv41_jax.model.indexer.topk`) as Pallas kernels.

    q [B, T, nI, dI] dt, w [B, T, nI] dt, ikeys: the key owner's stored codes (first axis = pool rows),
    page_table int32 [B, P], visible int32 [B, T]; cand_blocks int32 [B, T, kb_in] (canonical: valid
    ids ascending, then −1 — what the candidate source returns) or None. Returns (sel int32
    [B, T, min(k, S)], cand int32 [B, T, min(topk_blocks, ceil(S / block_size))] or None), identical to
    the reference. slot_block / select_chunk: tile sizes (powers of two ≥ 16); target_programs: the
    scoring programs to aim for (how a row's slot blocks are split). Tests shrink all three to run the
    multi-step loops on small shapes. dt must be bfloat16 or float32; dI a power of two ≥ 16; the
    candidate block size a power of two at the candidate source.
    """
    B, T = visible.shape
    S = page_table.shape[1] * page_size // ratio
    kk = min(k, S)
    kb = min(topk_blocks, -(-S // block_size)) if make_candidates else 0
    if kk == 0:
        z = jnp.zeros((B, T, 0), jnp.int32)
        return z, (z if make_candidates else None)
    _check_tile("slot_block", slot_block)
    _check_tile("select_chunk", select_chunk)
    if make_candidates and not is_pow2(block_size):
        raise NotImplementedError(f"indexer_topk: candidate_block_size {block_size} must be a power of two")
    st = _Setup(q, w, ikeys, page_table, visible, ratio=ratio, page_size=page_size, mode=mode, dt=dt,
                interpret=interpret)
    C = select_chunk
    Bs = max(slot_block, block_size) if make_candidates else slot_block
    log_choice("indexer_topk", interpret, slot_block=Bs, select_chunk=C, nbits=st.nbits, codec=st.codec)

    sel = cand = None
    if make_candidates or cand_blocks is None:
        res = st.dense(Bs=Bs, width_mult=C, block_size=block_size, make_candidates=make_candidates,
                       target_programs=target_programs)
        if cand_blocks is None:
            sel = st.select("slots", res[0], kk, C=C, block_size=block_size)
        if make_candidates:
            cand = (st.select("blocks", res[1], kb, C=C, block_size=block_size) if kb > 0
                    else jnp.zeros((B, T, 0), jnp.int32))
    if cand_blocks is not None:
        cb = cand_blocks.astype(jnp.int32)
        if cb.shape[-1] == 0:  # no candidate block at all: every pick is a −inf filler
            sel = jnp.full((B, T, kk), -1, jnp.int32)
        else:
            lim = jnp.sum(cb >= 0, axis=-1).astype(jnp.int32) * block_size
            sc = st.candidate_scores(cb, lim, Bs=slot_block, width_mult=C, block_size=block_size,
                                     target_programs=target_programs)
            sel = st.select("cand", sc, kk, C=C, block_size=block_size, extra=(lim, cb))
    return sel, cand


def dense_scores(q, w, ikeys, page_table, visible, *, ratio: int, page_size: int, mode: str, dt,
                 interpret: bool = False, slot_block: int = SLOT_BLOCK, target_programs: int = TARGET_PROGRAMS):
    """The scoring stage alone (tests, inspection): scores [B, T, S] in `dt`, docs/design/spec.md §4's arithmetic.

    Entry [b, t, j] is the score for j < visible[b, t]; past it: −inf inside the row's live slot
    blocks, unwritten (undefined) beyond them.
    """
    _check_tile("slot_block", slot_block)
    st = _Setup(q, w, ikeys, page_table, visible, ratio=ratio, page_size=page_size, mode=mode, dt=dt,
                interpret=interpret)
    (sc,) = st.dense(Bs=slot_block, width_mult=1, block_size=1, make_candidates=False,
                     target_programs=target_programs)
    return sc[..., :st.S]


def _kernel_fn(fn, **static):
    def kern(*refs):
        return fn(*refs, **static)

    kern.__name__ = fn.__name__.lstrip("_")
    return kern


__all__ = ["kernel", "dense_scores", "SLOT_BLOCK", "SELECT_CHUNK"]


# the reference: the seam's own "reference" implementation (`indexer.topk`'s default impl), same arguments
dispatch.register("indexer", "kernel", kernel=kernel, reference=indexer.topk, supports=supports)
