"""Pallas kernel: the attention output's way into wo_a — the split-K merge, the inverse RoPE and the grouped
fp8 wo_a GEMM — in one launch.

What a cached step computes after the attention kernel (the reference, `ref_o_proj`, is that chain):

    o = common.merge_splits(acc, m, l, sink).astype(dt)   # the kernel's split partials (S > 1)
    o = rope.apply_rope(o, positions[..., None], freqs, inverse=True, out_dtype=dt)
    y = linear.wo_a(o as [B, T, G, I], wo_a, ...)                     # per group: o_g · W_gᵀ, fp32 sums -> dt

On XLA:GPU that is three launches per layer (the merge, the RoPE, wo_a's grouped bf16 GEMM), and the
GEMM reads wo_a's load-time bf16 copy: 2 bytes per weight (flash: 67 MB per layer). Here each program
(an N tile of one group, a block of 16 rows) streams its group's I = heads·hd inputs in K chunks:

* merge: per chunk (within one head) the S partials are read and merged as `common.merge_splits` does (m_t =
  max over splits, 0 when all are −inf; w_s = exp(m_s − m_t); num = Σ_s acc_s·w_s left to right; denom =
  Σ_s l_s·w_s + exp(sink − m_t)), divided and rounded to dt. With one split the attention kernel already
  wrote o in dt, which is read as it is;
* inverse RoPE on the last rd dims of each head (interleaved pairs, angle fp32(pos)·f_i, the conjugate
  rotation: sin negated, `rope.apply_rope`'s order of terms), each pair's partner merged again from its own
  columns (the Triton lowering cannot permute register lanes), rounded to dt;
* wo_a from its stored fp8 pair (e4m3 codes + E8M0 per 32x32 block, decoded in registers: exact in bf16),
  so one bf16 dot per chunk forms the reference's exact products (fp32 IEEE dots in the fp32 flow), fp32
  sums rounded once to dt. Half the bytes of the bf16 copy.

The merge is redone by each of a group's N-tile programs (16 at flash shapes): the partials are small
(S·heads·hd fp32 per row, from L2 after the first reader). Numerics vs the chain: the same values, except
that the GEMM's fp32 sums (and the merge's Σ over splits on a GPU) are in the kernel's order: within fp32
reassociation; bitwise where every sum has at most two nonzero terms (tests/test_pallas_o_proj.py).

Inside a layer-scan run the weight and the sink are the run's stacks read at the layer (a sliced operand
of a Pallas call would be copied per layer). One device only (the linear seam refuses its kernels on a
mesh); fp32 numerics only (the exact / deterministic modes run the jnp chain). Lowering: Pallas Triton.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import codec, dispatch
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common, costs

NAME = "o_proj"
_MIN_DOT = common.MIN_DOT


def ref_o_proj(o, wo_a, positions, freqs, G: int, R: int, dt, sink=None):
    """The oracle: (merge,) inverse RoPE and wo_a as the jnp chain does them. o: [B, T, H, hd] in dt, or the
    attention kernel's partials {"acc": fp32 [S, B, T, hp, hd], "m", "l": fp32 [S, B, T, hp]} with `sink` fp32
    [H]; wo_a: a `weights.Fp8` (e4m3 [G·R, I], E8M0 [G·R/32, I/32]). Returns [B, T, G·R] in dt."""
    from dsv41_jax.model import quant
    from dsv41_jax.model.rope import apply_rope

    dt = jnp.dtype(dt)
    if isinstance(o, dict):
        H = sink.shape[0]
        hp = o["m"].shape[-1]
        o = common.merge_splits(o["acc"], o["m"], o["l"], jnp.pad(sink.astype(jnp.float32), (0, hp - H))).astype(dt)[:, :, :H]
    B, T, H, hd = o.shape
    o = apply_rope(o, positions[..., None], freqs, inverse=True, out_dtype=dt).reshape(B, T, G, H * hd // G)
    wdt = jnp.float32 if dt == jnp.float32 else jnp.bfloat16
    w = quant.dequantize_fp8_block(wo_a.weight, wo_a.scale, out_dtype=wdt).reshape(G, R, -1)
    if dt == jnp.float32:
        y = jnp.einsum("btgi,gri->btgr", o, w, precision=lax.Precision.HIGHEST)
    else:
        y = jnp.einsum("btgi,gri->btgr", o.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    return y.astype(dt).reshape(B, T, G * R)


def _kernel(lay_ref, *refs, c):
    """Program (N tile j, group g, row block i): out[rows, g·R + j-tile] over the group's I inputs."""
    if c["partials"]:
        acc_ref, m_ref, l_ref, sink_ref, pos_ref, f_ref, w_ref, s_ref, o_ref = refs
    else:
        x_ref, pos_ref, f_ref, w_ref, s_ref, o_ref = refs
    j, g, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bm, bn, bk, hd, rd, M, S, dt = c["bm"], c["bn"], c["bk"], c["hd"], c["rd"], c["M"], c["S"], c["dt"]
    hp, hpg = c["hp"], c["I"] // c["hd"]  # padded heads of the partials; heads per group
    lay = lay_ref[0]
    r0 = i * bm
    rows = jnp.minimum(r0 + lax.iota(jnp.int32, bm), M - 1)  # rows past M re-read row M − 1 (not stored)
    wrow = (lay * c["G"] + g) * c["R"] + j * bn  # the tile's first weight row in the (stacked) weight
    srow = lax.div(wrow + lax.iota(jnp.int32, bn), 32)
    pos = pos_ref[rows].astype(jnp.float32)
    lane = lax.iota(jnp.int32, bk)

    def merged(h, cols, stats):
        """o[rows, h, cols] in dt, widened: merged from the partials (one split's tile live at a time), or read."""
        if not c["partials"]:
            return x_ref[(rows * c["H"] + h)[:, None], cols[None, :]].astype(jnp.float32)
        mt, denom = stats

        def add(s, num):  # num = Σ_s acc_s · exp(m_s − m_t), left to right (exp recomputed: the same values)
            w = jnp.exp(m_ref[(s * M + rows) * hp + h] - mt)
            return num + acc_ref[((s * M + rows) * hp + h)[:, None], cols[None, :]] * w[:, None]

        first = acc_ref[((0 * M + rows) * hp + h)[:, None], cols[None, :]] * jnp.exp(m_ref[rows * hp + h] - mt)[:, None]
        num = lax.fori_loop(1, S, add, first)
        return (num / denom[:, None]).astype(dt).astype(jnp.float32)

    def kstep(kc, acc):
        h = g * hpg + lax.div(kc * bk, hd)  # a chunk lies in one head (bk divides hd)
        d = lax.rem(kc * bk, hd) + lane
        stats = None
        if c["partials"]:  # common.merge_splits' max (0 when every split is empty) and denominator, split by split
            mt = lax.fori_loop(1, S, lambda s, m: jnp.maximum(m, m_ref[(s * M + rows) * hp + h]), m_ref[rows * hp + h])
            mt = jnp.where(mt == -jnp.inf, 0.0, mt)

            def lsum(s, den):
                return den + l_ref[(s * M + rows) * hp + h] * jnp.exp(m_ref[(s * M + rows) * hp + h] - mt)

            den = lax.fori_loop(1, S, lsum, l_ref[rows * hp + h] * jnp.exp(m_ref[rows * hp + h] - mt))
            stats = (mt, den + jnp.exp(sink_ref[lay * c["sink_n"] + h] - mt))
        x = merged(h, d, stats)
        rope = d >= hd - rd
        xp = merged(h, jnp.where(rope, d ^ 1, d), stats)  # the pair's partner (the tail starts at an even dim)
        freq = f_ref[jnp.clip((d - (hd - rd)) // 2, 0, rd // 2 - 1)]
        ang = pos[:, None] * freq[None, :]
        cs, sn = jnp.cos(ang), -jnp.sin(ang)  # the inverse rotation: rope.apply_rope negates sin
        even = ((d & 1) == 0)[None, :]
        rot = jnp.where(even, x * cs - xp * sn, xp * sn + x * cs)
        xo = jnp.where(rope[None, :], rot, x).astype(dt)
        codes = w_ref[pl.ds(wrow, bn), pl.ds(kc * bk, bk)].astype(jnp.int32)
        scale = codec.e8m0_decode(s_ref[srow, pl.ds(kc * (bk // 32), bk // 32)].astype(jnp.int32), jnp)
        w = codec.e4m3_decode(codes, jnp) * jnp.broadcast_to(scale[:, :, None], (bn, bk // 32, 32)).reshape(bn, bk)
        if dt == jnp.float32:
            part = lax.dot_general(xo, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
        else:  # bf16 operands (the weight is exact in bf16): exact products, fp32 sums
            part = lax.dot_general(xo.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return acc + part

    acc = lax.fori_loop(0, c["I"] // bk, kstep, jnp.zeros((bm, bn), jnp.float32))
    live = (r0 + lax.iota(jnp.int32, bm) < M)[:, None]
    pltriton.store(o_ref.at[pl.ds(r0, bm), pl.ds(g * c["R"] + j * bn, bn)], acc.astype(o_ref.dtype), mask=live)


def _tiles(R: int, hd: int, rd: int, block_n=None, block_k=None) -> tuple:
    """(block_n, block_k) for R output rows per group, head_dim hd and rd rope dims, or NotImplementedError."""
    bn = block_n or math.gcd(R, 64)
    bk = block_k or math.gcd(hd, 64)  # 64-wide chunks: the merged tile, its partner and the weight tile in registers
    if (hd % bk or bk % 32 or not common.is_pow2(bk) or bn < _MIN_DOT or not common.is_pow2(bn) or R % bn or R % 32
            or hd & 1 or rd > hd):
        raise NotImplementedError(f"o_proj kernel: tiles block_n={bn} / block_k={bk} do not fit R={R}, head_dim={hd}"
                                  f" (rope dims {rd})")
    return bn, bk


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` runs `cfg`'s output projection: the fp32 numerics and its default tiles (`_tiles`)."""
    if is_exact(cfg):
        return False
    try:
        _tiles(cfg.o_lora_rank, cfg.head_dim, cfg.qk_rope_head_dim)
    except NotImplementedError:
        return False
    return True


def _u8(a):
    return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)


def kernel(o, wo_a, positions, freqs, G: int, R: int, dt, *, sink=None, layer=None, interpret: bool = False,
           block_n: int | None = None, block_k: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """`ref_o_proj` in one launch. o: [B, T, H, hd] in dt, or the attention kernel's partials dict (then `sink`:
    fp32 [H], or with `layer` a run's stack [n, H]); wo_a: a `weights.Fp8` (e4m3 [G·R, I], E8M0 [G·R/32,
    I/32], their uint8 bits too), or with `layer` the run's stacks; positions int32 [B, T]; freqs the layer's
    RoPE frequencies [rd/2]. Returns [B, T, G·R] in dt. Knobs: block_n (R tile), block_k (I chunk, dividing
    head_dim), Triton's num_warps / num_stages."""
    dt = jnp.dtype(dt)
    partials = isinstance(o, dict)
    if partials:
        S, B, T, hp, hd = o["acc"].shape
        if sink is None:
            raise ValueError("o_proj kernel: split partials need the attention sink")
        H = sink.shape[-1]
    else:
        B, T, H, hd = o.shape
        S, hp = 1, H
    rd = 2 * int(np.shape(freqs)[-1])
    I = H * hd // G
    w, s = wo_a.weight, wo_a.scale
    stacked = layer is not None
    if w.shape[-2:] != (G * R, I) or (w.ndim == 3) != stacked or (partials and (sink.ndim == 2) != stacked):
        raise ValueError(f"o_proj kernel: wo_a {w.shape} (sink {None if sink is None else sink.shape}) does not fit "
                         f"{G} groups of {R} x {I}" + (" stacked with a layer" if stacked else ""))
    bn, bk = _tiles(R, hd, rd, block_n, block_k)
    M = B * T
    if M == 0:
        return jnp.zeros((B, T, G * R), dt)
    bm = _MIN_DOT
    common.log_choice(NAME, interpret, block_n=bn, block_k=bk, splits=S, num_warps=num_warps)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    fr = jnp.asarray(np.asarray(freqs, np.float32) if not isinstance(freqs, jax.Array) else freqs, jnp.float32)
    wb = _u8(w).reshape(-1, I)
    sb = _u8(s).reshape(-1, I // 32)
    if partials:
        ins = [lay, o["acc"].reshape(S * M * hp, hd), o["m"].reshape(-1), o["l"].reshape(-1),
               sink.astype(jnp.float32).reshape(-1)]
    else:
        ins = [lay, o.reshape(M * H, hd)]
    ins += [positions.reshape(M).astype(jnp.int32), fr, wb, sb]

    def whole(a):
        return pl.BlockSpec(a.shape, lambda j, g, i, nd=a.ndim: (0,) * nd)

    out = jax.ShapeDtypeStruct((M, G * R), dt)
    c = dict(partials=partials, bm=bm, bn=bn, bk=bk, hd=hd, rd=rd, M=M, S=S, H=H, hp=hp, I=I, G=G, R=R, dt=dt,
             sink_n=H)
    # the bytes-moved contract (what scripts/bench_decode.py counts)
    cost = pl.CostEstimate(flops=2 * M * G * R * I, transcendentals=M * H * hd,
                           bytes_accessed=costs.o_proj_bytes_moved(M=M, G=G, R=R, I=I, H=H, hd=hd, itemsize=dt.itemsize,
                                                                   splits=S, heads_padded=hp, partials=partials))
    y = pl.pallas_call(
        functools.partial(_kernel, c=c), grid=(R // bn, G, pl.cdiv(M, bm)), in_specs=[whole(a) for a in ins],
        out_specs=whole(out), out_shape=out, interpret=interpret, cost_estimate=cost,
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        name=f"{NAME}_s{S}_n{bn}_k{bk}")(*ins)
    return y.reshape(B, T, G * R)


dispatch.register("linear", "o_proj", kernel=kernel, reference=ref_o_proj, supports=supports)
