"""Pallas kernels for mHC (docs/design/spec.md §2): entering a sublayer (hc_pre + the 24 mixes + Sinkhorn) and
leaving it (hc_post).

What is fused:

* `sublayer_enter` (the entry `kernel`) reads the streams h [M, n, D] **once**, per token block and
  D chunk, for everything a sublayer needs before it runs:
  - ``x_in = Σ_i pre_prev_i · h_i`` (hc_pre with the *previous* sublayer's pre, V4.1 ordering), written
    chunk by chunk, rounded once;
  - the mix projection ``h_flat [n·D] x fn[24, n·D]ᵀ`` as an fp32 (IEEE, not TF32) ``dot`` per chunk,
    and the joint Σh² for the RMS statistic;
  - then, per token: ``m = acc · rsqrt(Σh²/(n·D) + eps)``, the split with scales and bases (sigmoid,
    2·sigmoid) and the 20-iteration linear-space Sinkhorn on the n×n comb logits.
  The reference path runs hc_pre, an fp32 GEMM, the split and a Sinkhorn as separate XLA ops (h read
  twice, mixes materialized in between).
* `sublayer_exit`: ``out_j = post_j · y + Σ_i C[i, j] · h_i`` per token block and D chunk (one read
  of y and h, one write), same static summation order as `mhc.hc_post`.
* Fused with the neighbours (`mixes_enter(norm_weight=)`, `exit_enter`; the seams
  `mhc.sublayer_enter(norm_weight=)` and `mhc.sublayer_exit_enter`): the sublayer's RMSNorm of x_in (its
  Σx² of the rounded x_in summed per chunk and split beside Σh², the scaling in the tail kernel, in place
  on x_in's buffer) and one sublayer's exit with the next one's enter (each chunk of the new streams is
  written once and used from registers: not read back). At decode (B = 1, 40 splits) a sublayer boundary is
  then two launches (the exit + enter split pass, the norm tail) where it was five (exit, enter, tail, and
  XLA's mean and scale of the norm): docs/benchmarks.md, "Launches per decode step".

Layout in registers: the 24 mixes live as one [tokens, 32] tile (24 = (2+n)·n padded to the next
power of two; fn rows ≥ 24 are masked to zero). The Triton lowering has no slicing of register
tensors, so single mixes are taken out by a masked lane sum (exact: the other lanes add +0.0) and
Sinkhorn runs on n² per-token vectors [tokens] with the reference's static left-to-right row/column
sums, inside a `fori_loop` (unrolling 19 iterations of 16 vectors only bloats the kernel); pre, post
and comb go back as [tokens, n] / [tokens, n²] tiles assembled by masked lane writes, one store each.
``hc_mult`` must be a power of two (4 in every preset) for those tiles.

Split-K: at decode token counts one program per 16-token block would leave most SMs idle while each
reads the whole 2 MB fn, so the D axis can be split over a second grid axis (`splits`): each split
writes its chunk of x_in and a partial [tokens, 32] projection + partial Σh² (fp32), and a small
second kernel sums the partials in split order and runs the split/Sinkhorn tail. With one split
(prefill) the tail runs in the first kernel. `_default_splits` targets ~128 programs.

Lowering: Triton (`common.triton_params`). Mosaic GPU would also do for these dense tiles, but the
package uses one lowering (common.py) and the Triton one lowers everything here: masked
loads/stores for the ragged token tail (no padding copies; the Triton lowering does not mask partial
BlockSpec blocks, so refs are whole arrays and the token axis is blocked by hand), ``dot_general``
with HIGHEST precision as an IEEE fp32 ``tt.dot`` (DEFAULT would be TF32), exp/logistic/rsqrt,
``while`` loops. Block shapes are powers of two: 16 tokens (a Triton dot needs M ≥ 16), 32 mix lanes,
and a D chunk that is the largest power of two dividing D (≤ 128; D = 5120 in flash is not one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import dispatch
from dsv41_jax.model import mhc as mhc_ref
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common

__all__ = ["sublayer_enter", "sublayer_exit", "sublayer_exit_enter", "mixes_enter", "exit_enter",
           "post_mix"]

ENTER_TOKEN_BLOCK = 16  # Triton's dot needs M >= 16
ENTER_MAX_CHUNK = 128  # live fp32 tiles: h [16, 128] and fn [32, 128]
EXIT_TOKEN_BLOCK = 16
EXIT_MAX_CHUNK = 128
TARGET_PROGRAMS = 128  # ~ one per SM on an H100/H200 (132 SMs)
_HIGHEST = jax.lax.Precision.HIGHEST


def _pow2_chunk(d: int, cap: int) -> int:
    """Largest power of two dividing `d`, at most `cap`."""
    c = 1
    while c * 2 <= cap and d % (c * 2) == 0:
        c *= 2
    return c


def _default_splits(m: int, d: int) -> int:
    """Splits of D for the enter kernel: 1 when the token blocks alone fill ~`TARGET_PROGRAMS`
    programs, else the smallest divisor of the chunk count that does (or all chunks)."""
    blocks = pl.cdiv(m, ENTER_TOKEN_BLOCK)
    chunks = d // _pow2_chunk(d, ENTER_MAX_CHUNK)
    if blocks >= TARGET_PROGRAMS:
        return 1
    for s in range(1, chunks + 1):
        if chunks % s == 0 and blocks * s >= TARGET_PROGRAMS:
            return s
    return chunks


def _i(k: int):
    """A static index as an int32 scalar array: interpret mode's masked load/store discharge needs
    indexers with a ``shape`` (a bare Python int becomes a shapeless TypedInt there)."""
    return jnp.int32(k)


def _rows_in_bounds(lanes: int, rows: int):
    """Row indices 0..lanes-1 clamped to the `rows` that exist, for a [lanes, ...] tile over a
    [rows, ...] ref (lanes = rows rounded up to a power of two; the caller masks lanes >= rows).

    Why not ``pl.ds(0, lanes)``: JAX 0.12 validates static slices against the ref's shape at trace
    time ("Out of bound slice: start=0, size=32, ... dim=24") even when the load is masked. Clamped
    indices address only existing rows, so the access is in bounds on every JAX; Triton lowers
    integer-array indexers to the same pointer tensor a strided load uses. Interpret mode discharges
    all-slice or all-array indexers only, so a 2-D tile indexes its columns by an array too."""
    return jnp.minimum(jnp.arange(lanes, dtype=jnp.int32), rows - 1)


# ------------------------------------------------------------------------------- the per-token tail

def _lane(z, k: int):
    """Lane k of z [bt, L] as [bt] (exact: every other lane contributes +0.0)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
    return jnp.sum(jnp.where(lane == k, z, 0.0), axis=1)


def _tile(vs):
    """[bt] vectors v_0..v_{k-1} -> [bt, k] (k a power of two), by masked lane writes (exact): one
    store per output instead of k narrow ones."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (vs[0].shape[0], len(vs)), 1)
    out = jnp.zeros(lane.shape, jnp.float32)
    for k, v in enumerate(vs):
        out = jnp.where(lane == k, v[:, None], out)
    return out


def _sinkhorn(c, n: int, iters: int, eps: float):
    """`mhc.sinkhorn` on n² per-token vectors: c[i][j] [bt] -> the same, row-softmax + eps, a column
    step, then iters−1 row/column steps; every sum left to right over the static index."""

    def rows(c):
        out = []
        for i in range(n):
            s = c[i][0]
            for j in range(1, n):
                s = s + c[i][j]
            out.append([c[i][j] / (s + eps) for j in range(n)])
        return out

    def cols(c):
        out = [[None] * n for _ in range(n)]
        for j in range(n):
            s = c[0][j]
            for i in range(1, n):
                s = s + c[i][j]
            for i in range(n):
                out[i][j] = c[i][j] / (s + eps)
        return out

    sm = []
    for i in range(n):
        mx = c[i][0]
        for j in range(1, n):
            mx = jnp.maximum(mx, c[i][j])
        e = [jnp.exp(c[i][j] - mx) for j in range(n)]
        s = e[0]
        for j in range(1, n):
            s = s + e[j]
        sm.append([e[j] / s + eps for j in range(n)])
    c = cols(sm)

    def body(_, flat):
        cc = [list(flat[i * n:(i + 1) * n]) for i in range(n)]
        cc = cols(rows(cc))
        return tuple(x for row in cc for x in row)

    flat = jax.lax.fori_loop(0, iters - 1, body, tuple(x for row in c for x in row))
    return [list(flat[i * n:(i + 1) * n]) for i in range(n)]


def _finish(acc, ss, lay, base_ref, scale_ref, pre_ref, post_ref, comb_ref, *, t0, tmask, n: int, k_total: int,
            norm_eps: float, hc_eps: float, iters: int):
    """acc [bt, L] (the raw projection), ss [bt] (Σh²) -> pre / post / comb stored for tokens t0.."""
    mix = (2 + n) * n
    L = acc.shape[1]
    r = jax.lax.rsqrt(ss / k_total + norm_eps)
    m = acc * r[:, None]
    lane = jnp.arange(L)
    # lay: the layer within a scan run's stacked base [n·mix] / scale [n·3] (0 for one layer's)
    sc = jnp.where(lane < n, scale_ref[lay * 3], jnp.where(lane < 2 * n, scale_ref[lay * 3 + 1], scale_ref[lay * 3 + 2]))
    base = pltriton.load(base_ref.at[_rows_in_bounds(L, mix) + lay * mix], mask=lane < mix, other=0.0)
    z = m * sc[None, :] + base[None, :]
    rows = pl.ds(t0, acc.shape[0])
    tm2 = tmask[:, None]
    pre = _tile([jax.nn.sigmoid(_lane(z, j)) + hc_eps for j in range(n)])
    post = _tile([2.0 * jax.nn.sigmoid(_lane(z, n + j)) for j in range(n)])
    pltriton.store(pre_ref.at[rows, :], pre, mask=tm2)
    pltriton.store(post_ref.at[rows, :], post, mask=tm2)
    c = [[_lane(z, 2 * n + n * i + j) for j in range(n)] for i in range(n)]
    c = _sinkhorn(c, n, iters, hc_eps)
    pltriton.store(comb_ref.at[rows, :], _tile([x for row in c for x in row]), mask=tm2)


# ------------------------------------------------------------------------------------------ kernels

def _enter_kernel(lay_ref, *refs, m: int, n: int, d: int, bt: int, bd: int, splits: int, lanes: int, exit_: bool,
                  norm: bool, norm_eps: float, hc_eps: float, iters: int):
    # lay_ref int32 [1]: the layer in a scan run's stacks (0: one layer's params).
    # refs, inputs: h_ref [M, n, D] (the streams), or with exit_ the previous sublayer's y_ref [M, D], h_ref [M, n, D],
    #   post_ref f32 [M, n], comb_ref f32 [M, n²] (the streams are hc_post of those, computed here); then pp_ref
    #   f32 [M, n]; fn_ref f32 [(layers·)mix, n·D]; base_ref f32 [(layers·)mix]; scale_ref f32 [(layers·)3].
    # refs, outputs: with exit_ the new streams hn_ref [M, n, D]; x_ref [M, D]; then pre [M, n], post [M, n],
    #   comb [M, n²] (splits == 1 without norm) or partial projections f32 [S, M, L], partial Σh² f32 [S, M]
    #   and with norm partial Σx² f32 [S, M] of the rounded x (the tail kernel finishes).
    if exit_:
        y_ref, h_ref, epost_ref, ecomb_ref, pp_ref, fn_ref, base_ref, scale_ref, *out_refs = refs
        hn_ref, x_ref, *out_refs = out_refs
    else:
        h_ref, pp_ref, fn_ref, base_ref, scale_ref, *out_refs = refs
        x_ref, *out_refs = out_refs
    i, s = pl.program_id(0), pl.program_id(1)
    t0 = i * bt
    rows = pl.ds(t0, bt)
    tmask = t0 + jnp.arange(bt) < m
    tm2 = tmask[:, None]
    fmask = (jnp.arange(lanes) < (2 + n) * n)[:, None]
    lay = lay_ref[0]
    frows = _rows_in_bounds(lanes, (2 + n) * n)[:, None] + lay * ((2 + n) * n)  # fn tile [lanes, bd]: both axes as index
    dlane = jnp.arange(bd, dtype=jnp.int32)                 # arrays (interpret mode takes no mix)
    per_split = d // splits
    pp = [pltriton.load(pp_ref.at[rows, _i(c)], mask=tmask, other=0.0) for c in range(n)]
    if exit_:  # the exiting sublayer's mixes, per token: loop-invariant
        epost = [pltriton.load(epost_ref.at[rows, _i(j)], mask=tmask, other=0.0)[:, None] for j in range(n)]
        ecomb = [[pltriton.load(ecomb_ref.at[rows, _i(n * c + j)], mask=tmask, other=0.0)[:, None] for j in range(n)]
                 for c in range(n)]

    def body(k, carry):
        acc, ss, xs = carry
        d0 = s * per_split + k * bd
        cols = pl.ds(d0, bd)
        if exit_:
            y = pltriton.load(y_ref.at[rows, cols], mask=tm2, other=0).astype(jnp.float32)
            hs = [pltriton.load(h_ref.at[rows, _i(c), cols], mask=tm2, other=0).astype(jnp.float32) for c in range(n)]
        x = None
        for c in range(n):
            if exit_:
                # hc_post: out_c = post_c·y + Σ_i C[i, c]·h_i (static order, as `_exit_kernel`), rounded to the
                # stream dtype, which is what the next sublayer reads
                res = None
                for i2 in range(n):
                    res = ecomb[i2][c] * hs[i2] if res is None else res + ecomb[i2][c] * hs[i2]
                hn = (epost[c] * y + res).astype(hn_ref.dtype)
                pltriton.store(hn_ref.at[rows, _i(c), cols], hn, mask=tm2)
                hc = hn.astype(jnp.float32)
            else:
                hc = pltriton.load(h_ref.at[rows, _i(c), cols], mask=tm2, other=0).astype(jnp.float32)
            f = pltriton.load(fn_ref.at[frows, (c * d + d0 + dlane)[None, :]], mask=fmask, other=0.0)
            acc = acc + jax.lax.dot_general(hc, f, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                            preferred_element_type=jnp.float32)
            ss = ss + jnp.sum(hc * hc, axis=1)
            # hc_pre with the previous sublayer's pre: static left-to-right order, as mhc.hc_pre
            x = pp[c][:, None] * hc if x is None else x + pp[c][:, None] * hc
        xr = x.astype(x_ref.dtype)
        pltriton.store(x_ref.at[rows, cols], xr, mask=tm2)
        if norm:  # RMSNorm's Σx² of the rounded x_in (what `norm.rmsnorm` squares)
            xf = xr.astype(jnp.float32)
            xs = xs + jnp.sum(xf * xf, axis=1)
        return acc, ss, xs

    zero = jnp.zeros((bt,), jnp.float32)
    acc, ss, xs = jax.lax.fori_loop(0, per_split // bd, body, (jnp.zeros((bt, lanes), jnp.float32), zero, zero))
    if splits == 1 and not norm:
        pre_ref, post_ref, comb_ref = out_refs
        _finish(acc, ss, lay, base_ref, scale_ref, pre_ref, post_ref, comb_ref, t0=t0, tmask=tmask, n=n,
                k_total=n * d, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    else:
        pm_ref, pss_ref, *pxs_ref = out_refs
        pltriton.store(pm_ref.at[s, rows, :], acc, mask=tm2)
        pltriton.store(pss_ref.at[s, rows], ss, mask=tmask)
        if norm:
            pltriton.store(pxs_ref[0].at[s, rows], xs, mask=tmask)


def _tail_kernel(lay_ref, *refs, m: int, n: int, d: int, bt: int, bd: int, splits: int, norm: bool, norm_eps: float,
                 hc_eps: float, iters: int):
    # refs: pm_ref f32 [S, M, L], pss_ref f32 [S, M], with norm pxs_ref f32 [S, M], x_ref [M, D] (raw x_in) and
    # w_ref [(layers·)D] (the norm weight); base_ref, scale_ref; outputs pre, post, comb, with norm xo_ref [M, D]
    # (x_ref's buffer: normed in place). Sums the split partials in split order, then the tail.
    if norm:
        pm_ref, pss_ref, pxs_ref, x_ref, w_ref, base_ref, scale_ref, pre_ref, post_ref, comb_ref, xo_ref = refs
    else:
        pm_ref, pss_ref, base_ref, scale_ref, pre_ref, post_ref, comb_ref = refs
    t0 = pl.program_id(0) * bt
    rows = pl.ds(t0, bt)
    tmask = t0 + jnp.arange(bt) < m
    tm2 = tmask[:, None]
    lay = lay_ref[0]
    acc = pltriton.load(pm_ref.at[_i(0), rows, :], mask=tm2, other=0.0)
    ss = pltriton.load(pss_ref.at[_i(0), rows], mask=tmask, other=0.0)
    for s in range(1, splits):
        acc = acc + pltriton.load(pm_ref.at[_i(s), rows, :], mask=tm2, other=0.0)
        ss = ss + pltriton.load(pss_ref.at[_i(s), rows], mask=tmask, other=0.0)
    _finish(acc, ss, lay, base_ref, scale_ref, pre_ref, post_ref, comb_ref, t0=t0, tmask=tmask, n=n, k_total=n * d,
            norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    if norm:
        # norm.rmsnorm: x · rsqrt(mean(x²) + eps) · w in fp32, rounded once (mean = Σx² / D)
        xs = pltriton.load(pxs_ref.at[_i(0), rows], mask=tmask, other=0.0)
        for s in range(1, splits):
            xs = xs + pltriton.load(pxs_ref.at[_i(s), rows], mask=tmask, other=0.0)
        r = jax.lax.rsqrt(xs / d + norm_eps)[:, None]

        def body(k, _):
            cols = pl.ds(k * bd, bd)
            xf = pltriton.load(x_ref.at[rows, cols], mask=tm2, other=0).astype(jnp.float32)
            w = pltriton.load(w_ref.at[pl.ds(lay * d + k * bd, bd)]).astype(jnp.float32)
            pltriton.store(xo_ref.at[rows, cols], (xf * r * w[None, :]).astype(xo_ref.dtype), mask=tm2)
            return 0

        jax.lax.fori_loop(0, d // bd, body, 0)


def _exit_kernel(y_ref, h_ref, post_ref, comb_ref, out_ref, *, m: int, n: int, bt: int, bd: int):
    # y_ref [M, D]; h_ref [M, n, D]; post_ref f32 [M, n]; comb_ref f32 [M, n²]; out_ref [M, n, D].
    i, k = pl.program_id(0), pl.program_id(1)
    t0, d0 = i * bt, k * bd
    tmask = t0 + jnp.arange(bt) < m
    tm2 = tmask[:, None]
    rows = pl.ds(t0, bt)
    y = pltriton.load(y_ref.at[rows, pl.ds(d0, bd)], mask=tm2, other=0).astype(jnp.float32)
    hs = [pltriton.load(h_ref.at[rows, _i(c), pl.ds(d0, bd)], mask=tm2, other=0).astype(jnp.float32) for c in range(n)]
    for j in range(n):
        res = None
        for c in range(n):
            w = pltriton.load(comb_ref.at[rows, _i(n * c + j)], mask=tmask, other=0.0)[:, None]
            res = w * hs[c] if res is None else res + w * hs[c]
        pj = pltriton.load(post_ref.at[rows, _i(j)], mask=tmask, other=0.0)[:, None]
        pltriton.store(out_ref.at[rows, _i(j), pl.ds(d0, bd)], (pj * y + res).astype(out_ref.dtype), mask=tm2)


# ------------------------------------------------------------------------------------------ wrappers

def _check_weights(n, d, fn, base, scale, layer, norm_weight, what):
    mix = (2 + n) * n
    if n & (n - 1):
        raise ValueError(f"{what}: hc_mult must be a power of two (Triton tiles [tokens, n], [tokens, n²]), got {n}")
    lead_p = () if layer is None else fn.shape[:1]
    if fn.shape != (*lead_p, mix, n * d) or base.shape != (*lead_p, mix) or scale.shape != (*lead_p, 3):
        raise ValueError(f"{what}: fn {fn.shape} / base {base.shape} / scale {scale.shape} do not fit streams of "
                         f"{n} x {d}" + ("" if layer is None else " (stacked: a leading layer axis)"))
    if norm_weight is not None and norm_weight.shape != (*lead_p, d):
        raise ValueError(f"{what}: norm weight {norm_weight.shape}, expected {(*lead_p, d)}")


def _streams(h, fn, base, scale, layer, norm_weight, dt, what):
    """h [..., n, D] checked against the weights and flattened: (n, D, lead shape, h [M, n, D], the enter's
    result for no token — (x_in, pre, post, comb) zeros — or None)."""
    n, d = h.shape[-2], h.shape[-1]
    lead = h.shape[:-2]
    _check_weights(n, d, fn, base, scale, layer, norm_weight, what)
    hf = h.reshape(-1, n, d)
    if hf.shape[0]:
        return n, d, lead, hf, None
    z = jnp.zeros((*lead, n), jnp.float32)
    return n, d, lead, hf, (jnp.zeros((*lead, d), dt), z, z, jnp.zeros((*lead, n, n), jnp.float32))


def _enter_call(streams, pre_prev, fn, base, scale, *, n, d, dt, splits, interpret, layer, norm_weight, norm_eps,
                hc_eps, iters, name):
    """The enter kernel (+ its tail) on token-flat operands; `streams` is (h [M, n, D],) or, fusing the
    previous sublayer's exit, (y [M, D], h [M, n, D], post f32 [M, n], comb f32 [M, n²]).
    Returns ([h_new,] x, pre, post, comb), token-flat."""
    exit_ = len(streams) == 4
    norm = norm_weight is not None
    m = streams[0].shape[0]
    mix = (2 + n) * n
    bt, bd, lanes = ENTER_TOKEN_BLOCK, _pow2_chunk(d, ENTER_MAX_CHUNK), common.next_pow2(mix)
    splits = _default_splits(m, d) if splits is None else int(splits)
    if (d // bd) % splits:
        raise ValueError(f"{name}: splits={splits} must divide the {d // bd} chunks of {bd} along D={d}")
    common.log_choice(name, interpret, token_block=bt, d_chunk=bd, splits=splits, fused_norm=norm)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    base_f, scale_f = base.astype(jnp.float32).reshape(-1), scale.astype(jnp.float32).reshape(-1)
    args = (lay, *streams, pre_prev.reshape(m, n).astype(jnp.float32), fn.astype(jnp.float32).reshape(-1, n * d),
            base_f, scale_f)
    nb = pl.cdiv(m, bt)
    tail = dict(norm_eps=float(norm_eps), hc_eps=float(hc_eps), iters=int(iters))
    mixes_shape = [jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m, n), jnp.float32),
                   jax.ShapeDtypeStruct((m, n * n), jnp.float32)]
    lead_shape = ([jax.ShapeDtypeStruct((m, n, d), dt)] if exit_ else []) + [jax.ShapeDtypeStruct((m, d), dt)]
    enter = functools.partial(_enter_kernel, m=m, n=n, d=d, bt=bt, bd=bd, splits=splits, lanes=lanes, exit_=exit_,
                              norm=norm, **tail)
    params = common.triton_params(num_warps=4, num_stages=2)
    if splits == 1 and not norm:
        return pl.pallas_call(enter, grid=(nb, 1), out_shape=lead_shape + mixes_shape, compiler_params=params,
                              interpret=interpret, name=name)(*args)
    part = [jax.ShapeDtypeStruct((splits, m, lanes), jnp.float32), jax.ShapeDtypeStruct((splits, m), jnp.float32)]
    outs = pl.pallas_call(enter, grid=(nb, splits), out_shape=lead_shape + part + part[1:] * norm,
                          compiler_params=params, interpret=interpret, name=name + "_split")(*args)
    lead, parts = list(outs[:len(lead_shape)]), outs[len(lead_shape):]
    tail_k = functools.partial(_tail_kernel, m=m, n=n, d=d, bt=bt, bd=bd, splits=splits, norm=norm, **tail)
    tparams = common.triton_params(num_warps=4, num_stages=1)
    if not norm:
        return (*lead, *pl.pallas_call(tail_k, grid=(nb,), out_shape=mixes_shape, compiler_params=tparams,
                                       interpret=interpret, name="mhc_mix_tail")(lay, *parts, base_f, scale_f))
    # the raw x_in's buffer is normed in place (operand 4 -> output 3)
    pre, post, comb, x = pl.pallas_call(
        tail_k, grid=(nb,), out_shape=mixes_shape + [lead_shape[-1]], compiler_params=tparams, interpret=interpret,
        input_output_aliases={4: 3}, name="mhc_mix_norm_tail",
    )(lay, *parts, lead[-1], norm_weight.reshape(-1), base_f, scale_f)
    return (*lead[:-1], x, pre, post, comb)


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "dt", "splits", "interpret"))
def mixes_enter(h, pre_prev, fn, base, scale, *, norm_eps: float, hc_eps: float, iters: int, dt,
                splits: int | None = None, interpret: bool = False, layer=None, norm_weight=None):
    """hc_pre(h, pre_prev) and the mixes of h, fused (`mhc.hc_pre` + `mhc.hc_mixes`), optionally with the
    sublayer's RMSNorm of x_in.

    h: [..., n, D] bf16 or fp32; pre_prev: [..., n] fp32; fn: fp32 [(2+n)·n, n·D]; base: fp32 [(2+n)·n];
    scale: fp32 [3]; norm_eps / hc_eps / iters: ``rms_norm_eps`` / ``hc_eps`` / ``hc_sinkhorn_iters``;
    dt: dtype of x_in; splits: how many parts D is split into (must divide D / chunk; default
    `_default_splits`); layer: with fn / base / scale (and norm_weight) a layer-scan run's stacks ([L, ...]
    each), the layer to read (an int32 scalar: read in place; a sliced operand would be copied by XLA per
    layer); norm_weight: None, or the sublayer's norm weight [D] (bf16): x_in comes back as
    ``norm.rmsnorm(x_in, norm_weight, norm_eps, dt)`` (its Σx² summed per chunk and split; the scaling
    runs in the tail kernel, which then always runs). Returns (x_in [..., D] dt, pre [..., n], post [..., n],
    comb [..., n, n]) fp32.
    """
    n, d, lead, hf, empty = _streams(h, fn, base, scale, layer, norm_weight, dt, "mhc enter")
    if empty is not None:
        return empty
    x, pre, post, comb = _enter_call((hf,), pre_prev, fn, base, scale, n=n, d=d, dt=dt, splits=splits,
                                     interpret=interpret, layer=layer, norm_weight=norm_weight, norm_eps=norm_eps,
                                     hc_eps=hc_eps, iters=iters, name="mhc_enter")
    return (x.reshape(*lead, d), pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n))


@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "dt", "splits", "interpret"))
def exit_enter(y, h, post, comb, pre_prev, fn, base, scale, *, norm_eps: float, hc_eps: float, iters: int, dt,
               splits: int | None = None, interpret: bool = False, layer=None, norm_weight=None):
    """One sublayer's exit and the next one's enter in one pass: ``h' = hc_post(y, h, post, comb)`` (`post_mix`)
    and `mixes_enter` of h' — each D chunk of h' is written once and used from registers, so h' is not read
    back and one launch goes.

    y: [..., D]; h: [..., n, D]; post fp32 [..., n], comb fp32 [..., n, n]: the exiting sublayer's; pre_prev,
    fn, base, scale, layer, norm_weight and the rest: `mixes_enter`'s, for the entered sublayer (pre_prev is
    the exiting sublayer's pre). Returns (h' [..., n, D] dt, x_in [..., D] dt, pre, post, comb) — h' equal to
    `post_mix`'s, the rest to `mixes_enter(h', ...)`'s, bit for bit (the same per-chunk arithmetic).
    """
    n, d, lead, hf, empty = _streams(h, fn, base, scale, layer, norm_weight, dt, "mhc exit+enter")
    if empty is not None:
        return (jnp.zeros(h.shape, dt), *empty)
    m = hf.shape[0]
    streams = (y.reshape(m, d), hf, post.reshape(m, n).astype(jnp.float32), comb.reshape(m, n * n).astype(jnp.float32))
    hn, x, pre, post2, comb2 = _enter_call(streams, pre_prev, fn, base, scale, n=n, d=d, dt=dt, splits=splits,
                                           interpret=interpret, layer=layer, norm_weight=norm_weight,
                                           norm_eps=norm_eps, hc_eps=hc_eps, iters=iters, name="mhc_exit_enter")
    return (hn.reshape(*lead, n, d), x.reshape(*lead, d), pre.reshape(*lead, n), post2.reshape(*lead, n),
            comb2.reshape(*lead, n, n))


@functools.partial(jax.jit, static_argnames=("dt", "interpret"))
def post_mix(y, h, post, comb, *, dt, interpret: bool = False):
    """`mhc.hc_post` as one kernel: y [..., D], h [..., n, D], post fp32 [..., n], comb fp32 [..., n, n]
    -> [..., n, D] in `dt` (``out_j = post_j·y + Σ_i C[i, j]·h_i`` in fp32, rounded once)."""
    n, d = h.shape[-2], h.shape[-1]
    lead = h.shape[:-2]
    hf = h.reshape(-1, n, d)
    m = hf.shape[0]
    if m == 0:
        return jnp.zeros(h.shape, dt)
    bt, bd = min(EXIT_TOKEN_BLOCK, common.next_pow2(m)), _pow2_chunk(d, EXIT_MAX_CHUNK)
    common.log_choice("mhc_exit", interpret, token_block=bt, d_chunk=bd)
    out = pl.pallas_call(
        functools.partial(_exit_kernel, m=m, n=n, bt=bt, bd=bd),
        grid=(pl.cdiv(m, bt), d // bd),
        out_shape=jax.ShapeDtypeStruct((m, n, d), dt),
        compiler_params=common.triton_params(num_warps=4, num_stages=1),
        interpret=interpret, name="mhc_exit",
    )(y.reshape(m, d), hf, post.reshape(m, n).astype(jnp.float32), comb.reshape(m, n * n).astype(jnp.float32))
    return out.reshape(*lead, n, d)


# ------------------------------------------------------------------------------------- seam entries

def supports(cfg, mode: str = "auto") -> bool:
    """Whether the mhc kernels run `cfg`: the fp32 numerics, hc_mult a power of two (Triton tiles)."""
    return not is_exact(cfg) and common.is_pow2(cfg.hc_mult)


def _xla(cfg):
    return cfg.replace(impl="xla")


def ref_sublayer_enter(h, pre_prev, fn, base, scale, cfg, dt, layer=None, norm_weight=None):
    """The oracle of `sublayer_enter`: `mhc.sublayer_enter` on its jnp path."""
    return mhc_ref.sublayer_enter(h, pre_prev, fn, base, scale, _xla(cfg), dt, layer, norm_weight)


def ref_sublayer_exit(y, h, post, comb, cfg, dt):
    """The oracle of `sublayer_exit`: `mhc.sublayer_exit` on its jnp path."""
    return mhc_ref.sublayer_exit(y, h, post, comb, _xla(cfg), dt)


def ref_sublayer_exit_enter(y, h, post, comb, pre_prev, fn, base, scale, cfg, dt, layer=None, norm_weight=None):
    """The oracle of `sublayer_exit_enter`: `mhc.sublayer_exit_enter` on its jnp path."""
    return mhc_ref.sublayer_exit_enter(y, h, post, comb, pre_prev, fn, base, scale, _xla(cfg), dt, layer, norm_weight)


def _check_mode(cfg):
    if is_exact(cfg):
        # The exact / deterministic modes accumulate the mix projection in fp64; these kernels are fp32
        # throughout.
        raise NotImplementedError("mhc Pallas kernels: the exact / deterministic numerics modes need impl "
                                  "mhc='xla' or 'reference' (the mix projection accumulates in fp64 there)")


def sublayer_enter(h, pre_prev, fn, base, scale, cfg, dt, *, interpret: bool = False, layer=None, norm_weight=None):
    """`mhc.sublayer_enter` on Pallas: (x_in [..., D] dt, pre, post [..., n], comb [..., n, n] fp32).
    layer / norm_weight: see `mixes_enter` (a scan run's stacks read in place; the sublayer's RMSNorm fused)."""
    _check_mode(cfg)
    return mixes_enter(h, pre_prev, fn, base, scale, norm_eps=float(cfg.rms_norm_eps), hc_eps=float(cfg.hc_eps),
                       iters=int(cfg.hc_sinkhorn_iters), dt=jnp.dtype(dt), interpret=interpret, layer=layer,
                       norm_weight=norm_weight)


def sublayer_exit_enter(y, h, post, comb, pre_prev, fn, base, scale, cfg, dt, *, interpret: bool = False, layer=None,
                        norm_weight=None):
    """`mhc.sublayer_exit_enter` on Pallas (`exit_enter`): (h' [..., n, D], (x_in, pre, post, comb))."""
    _check_mode(cfg)
    hn, *entered = exit_enter(y, h, post, comb, pre_prev, fn, base, scale, norm_eps=float(cfg.rms_norm_eps),
                              hc_eps=float(cfg.hc_eps), iters=int(cfg.hc_sinkhorn_iters), dt=jnp.dtype(dt),
                              interpret=interpret, layer=layer, norm_weight=norm_weight)
    return hn, tuple(entered)


def sublayer_exit(y, h, post, comb, cfg, dt, *, interpret: bool = False):
    """`mhc.sublayer_exit` on Pallas: [..., n, D] in `dt`."""
    _check_mode(cfg)
    return post_mix(y, h, post, comb, dt=jnp.dtype(dt), interpret=interpret)


dispatch.register("mhc", "kernel", kernel=sublayer_enter, reference=ref_sublayer_enter, supports=supports)
dispatch.register("mhc", "sublayer_exit", kernel=sublayer_exit, reference=ref_sublayer_exit, supports=supports)
dispatch.register("mhc", "sublayer_exit_enter", kernel=sublayer_exit_enter, reference=ref_sublayer_exit_enter,
                  supports=supports)
