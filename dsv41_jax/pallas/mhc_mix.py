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
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import mhc as mhc_ref
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common

__all__ = ["kernel", "sublayer_enter", "sublayer_exit", "mixes_enter", "bench_inputs", "bytes_moved"]

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

def _enter_kernel(lay_ref, h_ref, pp_ref, fn_ref, base_ref, scale_ref, *out_refs, m: int, n: int, d: int, bt: int,
                  bd: int, splits: int, lanes: int, norm_eps: float, hc_eps: float, iters: int):
    # lay_ref int32 [1]: the layer in a scan run's stacks (0: one layer's params); h_ref [M, n, D]; pp_ref
    # f32 [M, n]; fn_ref f32 [(layers·)mix, n·D]; base_ref f32 [(layers·)mix]; scale_ref f32 [(layers·)3].
    # out_refs: x_ref [M, D], then pre [M, n], post [M, n], comb [M, n²] (splits == 1)
    #           or partial projections f32 [S, M, L] and partial Σh² f32 [S, M] (splits > 1).
    x_ref = out_refs[0]
    i, s = pl.program_id(0), pl.program_id(1)
    t0 = i * bt
    tmask = t0 + jnp.arange(bt) < m
    tm2 = tmask[:, None]
    fmask = (jnp.arange(lanes) < (2 + n) * n)[:, None]
    lay = lay_ref[0]
    frows = _rows_in_bounds(lanes, (2 + n) * n)[:, None] + lay * ((2 + n) * n)  # fn tile [lanes, bd]: both axes as index
    dlane = jnp.arange(bd, dtype=jnp.int32)                 # arrays (interpret mode takes no mix)
    per_split = d // splits
    pp = [pltriton.load(pp_ref.at[pl.ds(t0, bt), _i(c)], mask=tmask, other=0.0) for c in range(n)]

    def body(k, carry):
        acc, ss = carry
        d0 = s * per_split + k * bd
        x = None
        for c in range(n):
            hc = pltriton.load(h_ref.at[pl.ds(t0, bt), _i(c), pl.ds(d0, bd)], mask=tm2, other=0).astype(jnp.float32)
            f = pltriton.load(fn_ref.at[frows, (c * d + d0 + dlane)[None, :]], mask=fmask, other=0.0)
            acc = acc + jax.lax.dot_general(hc, f, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                            preferred_element_type=jnp.float32)
            ss = ss + jnp.sum(hc * hc, axis=1)
            # hc_pre with the previous sublayer's pre: static left-to-right order, as mhc.hc_pre
            x = pp[c][:, None] * hc if x is None else x + pp[c][:, None] * hc
        pltriton.store(x_ref.at[pl.ds(t0, bt), pl.ds(d0, bd)], x.astype(x_ref.dtype), mask=tm2)
        return acc, ss

    init = (jnp.zeros((bt, lanes), jnp.float32), jnp.zeros((bt,), jnp.float32))
    acc, ss = jax.lax.fori_loop(0, per_split // bd, body, init)
    if splits == 1:
        pre_ref, post_ref, comb_ref = out_refs[1:]
        _finish(acc, ss, lay, base_ref, scale_ref, pre_ref, post_ref, comb_ref, t0=t0, tmask=tmask, n=n,
                k_total=n * d, norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)
    else:
        pm_ref, pss_ref = out_refs[1:]
        pltriton.store(pm_ref.at[s, pl.ds(t0, bt), :], acc, mask=tm2)
        pltriton.store(pss_ref.at[s, pl.ds(t0, bt)], ss, mask=tmask)


def _tail_kernel(lay_ref, pm_ref, pss_ref, base_ref, scale_ref, pre_ref, post_ref, comb_ref, *, m: int, n: int,
                 d: int, bt: int, splits: int, norm_eps: float, hc_eps: float, iters: int):
    # pm_ref f32 [S, M, L]; pss_ref f32 [S, M]: sum the split partials in split order, then the tail.
    t0 = pl.program_id(0) * bt
    tmask = t0 + jnp.arange(bt) < m
    acc = pltriton.load(pm_ref.at[_i(0), pl.ds(t0, bt), :], mask=tmask[:, None], other=0.0)
    ss = pltriton.load(pss_ref.at[_i(0), pl.ds(t0, bt)], mask=tmask, other=0.0)
    for s in range(1, splits):
        acc = acc + pltriton.load(pm_ref.at[_i(s), pl.ds(t0, bt), :], mask=tmask[:, None], other=0.0)
        ss = ss + pltriton.load(pss_ref.at[_i(s), pl.ds(t0, bt)], mask=tmask, other=0.0)
    _finish(acc, ss, lay_ref[0], base_ref, scale_ref, pre_ref, post_ref, comb_ref, t0=t0, tmask=tmask, n=n, k_total=n * d,
            norm_eps=norm_eps, hc_eps=hc_eps, iters=iters)


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

@functools.partial(jax.jit, static_argnames=("norm_eps", "hc_eps", "iters", "dt", "splits", "interpret"))
def mixes_enter(h, pre_prev, fn, base, scale, *, norm_eps: float, hc_eps: float, iters: int, dt,
                splits: int | None = None, interpret: bool = False, layer=None):
    """hc_pre(h, pre_prev) and the mixes of h, fused (`mhc.hc_pre` + `mhc.hc_mixes`).

    h: [..., n, D] bf16 or fp32; pre_prev: [..., n] fp32; fn: fp32 [(2+n)·n, n·D]; base: fp32 [(2+n)·n];
    scale: fp32 [3]; norm_eps / hc_eps / iters: ``rms_norm_eps`` / ``hc_eps`` / ``hc_sinkhorn_iters``;
    dt: dtype of x_in; splits: how many parts D is split into (must divide D / chunk; default
    `_default_splits`); layer: with fn / base / scale a layer-scan run's stacks ([L, ...] each), the layer to
    read (an int32 scalar: read in place; a sliced operand would be copied by XLA per layer). Returns (x_in [..., D] dt, pre [..., n], post [..., n], comb [..., n, n]) fp32.
    """
    n, d = h.shape[-2], h.shape[-1]
    lead = h.shape[:-2]
    mix = (2 + n) * n
    if n & (n - 1):
        raise ValueError(f"mhc enter kernel: hc_mult must be a power of two (Triton tiles [tokens, n], "
                         f"[tokens, n²]), got {n}")
    lead_p = () if layer is None else fn.shape[:1]
    if fn.shape != (*lead_p, mix, n * d) or base.shape != (*lead_p, mix) or scale.shape != (*lead_p, 3):
        raise ValueError(f"mhc enter: fn {fn.shape} / base {base.shape} / scale {scale.shape} do not fit h {h.shape}"
                         + ("" if layer is None else " (stacked: a leading layer axis)"))
    hf = h.reshape(-1, n, d)
    m = hf.shape[0]
    if m == 0:
        z = jnp.zeros((*lead, n), jnp.float32)
        return jnp.zeros((*lead, d), dt), z, z, jnp.zeros((*lead, n, n), jnp.float32)
    bt, bd, lanes = ENTER_TOKEN_BLOCK, _pow2_chunk(d, ENTER_MAX_CHUNK), common.next_pow2(mix)
    splits = _default_splits(m, d) if splits is None else int(splits)
    if (d // bd) % splits:
        raise ValueError(f"mhc enter: splits={splits} must divide the {d // bd} chunks of {bd} along D={d}")
    common.log_choice("mhc_enter", interpret, token_block=bt, d_chunk=bd, splits=splits)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    args = (lay, hf, pre_prev.reshape(m, n).astype(jnp.float32), fn.astype(jnp.float32).reshape(-1, n * d),
            base.astype(jnp.float32).reshape(-1), scale.astype(jnp.float32).reshape(-1))
    nb = pl.cdiv(m, bt)
    tail = dict(norm_eps=float(norm_eps), hc_eps=float(hc_eps), iters=int(iters))
    mixes_shape = [jax.ShapeDtypeStruct((m, n), jnp.float32), jax.ShapeDtypeStruct((m, n), jnp.float32),
                   jax.ShapeDtypeStruct((m, n * n), jnp.float32)]
    x_shape = jax.ShapeDtypeStruct((m, d), dt)
    enter = functools.partial(_enter_kernel, m=m, n=n, d=d, bt=bt, bd=bd, splits=splits, lanes=lanes, **tail)
    params = common.triton_params(num_warps=4, num_stages=2)
    if splits == 1:
        x, pre, post, comb = pl.pallas_call(enter, grid=(nb, 1), out_shape=[x_shape] + mixes_shape,
                                            compiler_params=params, interpret=interpret, name="mhc_enter")(*args)
    else:
        x, pm, pss = pl.pallas_call(
            enter, grid=(nb, splits),
            out_shape=[x_shape, jax.ShapeDtypeStruct((splits, m, lanes), jnp.float32),
                       jax.ShapeDtypeStruct((splits, m), jnp.float32)],
            compiler_params=params, interpret=interpret, name="mhc_enter_split")(*args)
        pre, post, comb = pl.pallas_call(
            functools.partial(_tail_kernel, m=m, n=n, d=d, bt=bt, splits=splits, **tail),
            grid=(nb,), out_shape=mixes_shape, compiler_params=common.triton_params(num_warps=4, num_stages=1),
            interpret=interpret, name="mhc_mix_tail")(lay, pm, pss, args[4], args[5])
    return (x.reshape(*lead, d), pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n))


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

def _check_mode(cfg):
    if is_exact(cfg):
        # The exact / deterministic modes accumulate the mix projection in fp64; these kernels are fp32
        # throughout.
        raise NotImplementedError("mhc Pallas kernels: the exact / deterministic numerics modes need impl "
                                  "mhc='xla' or 'reference' (the mix projection accumulates in fp64 there)")


def sublayer_enter(h, pre_prev, fn, base, scale, cfg, dt, *, interpret: bool = False, layer=None):
    """`mhc.sublayer_enter` on Pallas: (x_in [..., D] dt, pre, post [..., n], comb [..., n, n] fp32).
    layer: see `mixes_enter` (a scan run's stacked fn / base / scale, read in place)."""
    _check_mode(cfg)
    return mixes_enter(h, pre_prev, fn, base, scale, norm_eps=float(cfg.rms_norm_eps), hc_eps=float(cfg.hc_eps),
                       iters=int(cfg.hc_sinkhorn_iters), dt=jnp.dtype(dt), interpret=interpret, layer=layer)


kernel = sublayer_enter  # dispatch.KERNEL_ENTRY


def sublayer_exit(y, h, post, comb, cfg, dt, *, interpret: bool = False):
    """`mhc.sublayer_exit` on Pallas: [..., n, D] in `dt`."""
    _check_mode(cfg)
    return post_mix(y, h, post, comb, dt=jnp.dtype(dt), interpret=interpret)


# ------------------------------------------------------------------------------------------- bench

def _flash_dims():
    from dsv41_jax.model.config import ModelConfig

    c = ModelConfig.preset("flash")
    return c.hc_mult, c.hidden_size, float(c.rms_norm_eps), float(c.hc_eps), int(c.hc_sinkhorn_iters)


def bench_inputs(tokens: int, *, seed: int = 0, interpret: bool = False) -> dict:
    """Flash-shaped inputs for scripts/bench_kernels.py: ``{part: (kernel_fn, xla_fn, args)}``.

    "enter": (h [tokens, 4, 5120] bf16, pre_prev, fn [24, 20480], base, scale) -> (x_in bf16, pre, post,
    comb), against the "xla" implementation (hc_pre + hc_mixes with the unrolled Sinkhorn);
    "exit": (y [tokens, 5120] bf16, h, post, comb) -> h' bf16, against `mhc.hc_post`.
    """
    n, D, neps, heps, iters = _flash_dims()
    rng = np.random.default_rng(seed)  # numpy: no device compiles to build the inputs
    bf = jnp.dtype(jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((tokens, n, D), np.float32).astype(bf))
    pp = jnp.asarray(rng.uniform(0, 1, (tokens, n)).astype(np.float32))
    fn = jnp.asarray((rng.standard_normal(((2 + n) * n, n * D)) * (n * D) ** -0.5).astype(np.float32))
    base = jnp.asarray((rng.standard_normal((2 + n) * n) * 0.1).astype(np.float32))
    scale = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    y = jnp.asarray(rng.standard_normal((tokens, D), np.float32).astype(bf))
    post = jnp.asarray(rng.uniform(0, 2, (tokens, n)).astype(np.float32))
    comb = rng.uniform(0, 1, (tokens, n, n)).astype(np.float32)
    comb = jnp.asarray(comb / comb.sum(axis=-2, keepdims=True))

    def xla_enter(h, pp, fn, base, scale):
        mixes = mhc_ref.hc_mixes(h, fn, base, scale, norm_eps=neps, hc_eps=heps, sinkhorn_iters=iters, unroll=True)
        return (mhc_ref.hc_pre(h, pp, bf), *mixes)

    return {
        "enter": (functools.partial(mixes_enter, norm_eps=neps, hc_eps=heps, iters=iters, dt=bf, interpret=interpret),
                  jax.jit(xla_enter), (h, pp, fn, base, scale)),
        "exit": (functools.partial(post_mix, dt=bf, interpret=interpret),
                 jax.jit(lambda y, h, p, c: mhc_ref.hc_post(y, h, p, c, bf)), (y, h, post, comb)),
    }


def bytes_moved(part: str, tokens: int) -> int:
    """Minimum HBM bytes of one call of `part` at flash shapes (bf16 stream), for bandwidth."""
    n, D, *_ = _flash_dims()
    mix = (2 + n) * n
    if part == "enter":
        return tokens * (2 * n * D + 4 * n + 2 * D + 4 * (2 * n + n * n)) + 4 * (mix * n * D + mix + 3)
    if part == "exit":
        return tokens * (2 * D + 2 * n * D + 4 * (n + n * n) + 2 * n * D)
    raise ValueError(f"unknown part {part!r}; parts: enter, exit")
