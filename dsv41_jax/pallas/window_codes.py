"""Pallas kernel: a layer's window K=V from the wkv GEMM's output to its stored fp8 codes, in one launch.

What a cached step does with this layer's new K=V (`attention.q_codes` and its kernel forms; the reference,
`ref_window_codes`, is the jnp composition the seam runs otherwise):

    kv     = norm.rmsnorm(y, kv_norm, eps, dt)                    # y = wkv(x) [M, hd] in dt
    kv_rot = rope.apply_rope(kv, positions, freqs, out_dtype=dt)  # the last rd dims, interleaved pairs
    codes  = cache.encode("win", mode, kv_rot)                    # fp8: quant.act_quant_fp8 per 32

XLA:GPU runs that as four to five launches per layer (the norm's mean, then the RoPE + quant chain:
amax, scale, codes; the H200-target kernel table in docs/results/launches_h200_target/). Here one
program per block of 16 tokens holds each token's whole row ([16, hd] fp32 in registers; hd = 512 in
flash) and does all of it:

* RMSNorm as `norm.rmsnorm` (fp32: x·rsqrt(Σx²/hd + eps)·w, rounded once to dt; Σx² in the kernel's
  order);
* RoPE as `rope.apply_rope` (angle = fp32(pos)·f_i, cos / sin in fp32, (a, b) -> (a·cos − b·sin,
  a·sin + b·cos), rounded once to dt). The Triton lowering cannot slice register tensors, so each pair's
  partner comes from a second gather of the row at the partner columns (col ^ 1 in the rotated tail),
  normed the same way (bitwise the partner's value);
* the window codec "fp8" (`codec.fp8_act_codes`, `quant.act_quant_fp8`'s one definition: per 32,
  amax ≥ 1e-4, s = 2^⌈log2(amax/448)⌉, e4m3 RNE of clamp(x/s, ±448)) with the bytes made by integer ops
  (`codec.e4m3_encode`, `codec.e8m0_encode_exponent`): no fp8 dtype in the kernel.

Other window codecs (the fp8_e4m3 / bf16 / fp32 ``kv_cache_dtype`` modes keep fp8 for the window except
bf16 / fp32) have no kernel: the seam runs the jnp composition for them (logged once). The exact /
deterministic modes have no kernel either (the attention seam refuses its kernels there).

With ``ring=`` (a plain one-token step: `decode.extend_uncommitted`'s ring_now) the kernel also writes each
token's codes into the cache's window rings in place (input / output aliased), at entry position mod W of
its request's row and this layer: the write `decode.commit` would make after the step, without its launch
and, in a layer-scan run, without stacking the codes per layer for it. The entry it overwrites holds
position p − W, which the query at p does not see, so the attention kernel may read the rings after it.

Inside a layer-scan run the norm weight is the run's stack [n, hd] read at the layer (a sliced operand
of a Pallas call would be copied per layer). Lowering: Pallas Triton (`common.triton_params`), whole-array
refs with masked stores for the token tail and clamped row indices for loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import codec, dispatch, quant
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.pallas import common, costs

NAME = "window_codes"
TOKEN_BLOCK = 16


def ref_window_codes(y, norm_w, positions, freqs, eps: float, dt, mode: str = "auto") -> dict:
    """The oracle: `cache.encode("win", mode, apply_rope(rmsnorm(y, norm_w, eps, dt), positions, freqs, dt))`."""
    kv = rmsnorm(y, norm_w, eps, dt)
    return kvc.encode("win", mode, apply_rope(kv, positions, freqs, out_dtype=dt))


def _geometry_ok(hd: int, rd: int) -> bool:
    """head_dim a power of two (a multiple of 32), the rope dims an even tail of it."""
    return hd % 32 == 0 and common.is_pow2(hd) and rd <= hd and rd % 2 == 0 and (hd - rd) % 2 == 0


def supports(cfg, mode: str = "auto") -> bool:
    """Whether the kernel makes `cfg`'s window codes with ``kv_cache_dtype`` `mode`: the fp32 numerics, the
    "fp8" window codec, and head / rope dims it tiles (`_geometry_ok`)."""
    return (not is_exact(cfg) and kvc._codec("win", mode) == "fp8"
            and _geometry_ok(cfg.head_dim, cfg.qk_rope_head_dim))


def _kernel(*refs, c):
    """Program i: tokens i·bm .. i·bm + bm − 1 (rows past M load row M − 1 and are not stored; into the ring
    they write row M − 1's bytes to its place again)."""
    lay_ref, y_ref, w_ref, pos_ref, f_ref = refs[:5]
    if c["ring"]:
        rr_ref, rw_ref, rl_ref = refs[5:8]  # ring rows, write flags, ring layer (inputs 8, 9: the ring, aliased)
        q_ref, s_ref, rq_ref, rs_ref = refs[10:]
    else:
        q_ref, s_ref = refs[5:]
    bm, hd, rd, M, dt = c["bm"], c["hd"], c["rd"], c["M"], c["dt"]
    r0 = pl.program_id(0) * bm
    rows = jnp.minimum(r0 + lax.iota(jnp.int32, bm), M - 1)
    col = lax.iota(jnp.int32, hd)
    rope = col >= hd - rd
    partner = jnp.where(rope, col ^ 1, col)  # the tail starts at an even column: pairs (2i, 2i + 1)
    lay = lay_ref[0]

    def normed(cols):  # norm.rmsnorm's formula on the row's columns `cols`, rounded to dt, widened
        y = y_ref[rows[:, None], cols[None, :]].astype(jnp.float32)
        w = w_ref[lay * hd + cols].astype(jnp.float32)
        return y, w

    y, w = normed(col)
    yp, wp = normed(partner)
    r = lax.rsqrt(jnp.sum(y * y, axis=1) / hd + c["eps"])[:, None]
    kv = (y * r * w[None, :]).astype(dt).astype(jnp.float32)
    kvp = (yp * r * wp[None, :]).astype(dt).astype(jnp.float32)
    # rope.apply_rope: angle = fp32(pos) · f_i, pair i of the tail = columns hd − rd + 2i, 2i + 1
    freq = f_ref[jnp.clip((col - (hd - rd)) // 2, 0, rd // 2 - 1)]
    ang = pos_ref[rows].astype(jnp.float32)[:, None] * freq[None, :]
    cs, sn = jnp.cos(ang), jnp.sin(ang)
    even = (col & 1) == 0
    rot = jnp.where(even[None, :], kv * cs - kvp * sn, kvp * sn + kv * cs)
    v = jnp.where(rope[None, :], rot, kv).astype(dt).astype(jnp.float32)
    # quant.act_quant_fp8 per 32 (`codec.fp8_act_codes`), to bytes
    yq, e = codec.fp8_act_codes(v, jnp)
    qb = codec.e4m3_encode(yq, jnp).reshape(bm, hd)
    sb = codec.e8m0_encode_exponent(e, jnp)
    live = (r0 + lax.iota(jnp.int32, bm) < M)[:, None]
    pltriton.store(q_ref.at[pl.ds(r0, bm), :], qb.astype(jnp.uint8), mask=live)
    pltriton.store(s_ref.at[pl.ds(r0, bm), :], sb, mask=live)
    if c["ring"]:  # the ring entry pos mod W of the token's row (a dropped token's: the scratch row's)
        W = c["W"]
        ring_row = jnp.where(rw_ref[rows] != 0, rr_ref[rows], c["R"] - 1)
        dest = (ring_row * c["L"] + rl_ref[0] + c["base"]) * W + lax.rem(pos_ref[rows], W)
        rq_ref[dest[:, None], col[None, :]] = qb.astype(jnp.uint8)
        rs_ref[dest[:, None], lax.iota(jnp.int32, hd // 32)[None, :]] = sb


def kernel(y, norm_w, positions, freqs, eps: float, dt, *, layer=None, ring=None, interpret: bool = False):
    """The window codes of "fp8" (`ref_window_codes` with that codec) from the wkv output y [..., hd] (dt).

    norm_w: the kv_norm weight [hd] (bf16), or with `layer` (int32 scalar) a run's stack [n, hd];
    positions: int32 [...] (y's leading shape); freqs: the layer's RoPE frequencies [rd/2] (numpy / jax
    fp32, `attention.layer_freqs`); eps: ``rms_norm_eps``; dt: the act dtype (y's). Returns {"q":
    float8_e4m3fn [..., hd], "s": float8_e8m0fnu [..., hd/32]}, `cache.encode("win", ...)`'s layout.

    ring: None, or (store, rows, write, ring_layer, ring_base) to also write each token's codes into the
    window rings in place — store the cache's rings {"q": fp8 [R, L, W, hd], "s": e8m0 [R, L, W, hd/32]};
    rows / write int32 [...] (y's leading shape) each token's ring row and whether it is written (0: it
    goes to the scratch row R − 1 instead); the layer ring_base + ring_layer (an int or int32 scalar;
    ring_base static). Then returns (codes, the store with entry position mod W of each token's row and
    layer written), the store's buffers updated in place (aliased)."""
    hd = y.shape[-1]
    lead = y.shape[:-1]
    rd = 2 * int(np.shape(freqs)[-1])
    if not _geometry_ok(hd, rd):
        raise NotImplementedError(f"window_codes kernel: head_dim {hd} must be a power of two (a multiple of 32) "
                                  f"and the rope dims {rd} an even tail of it")
    if norm_w.shape != ((hd,) if layer is None else (norm_w.shape[0], hd)):
        raise ValueError(f"window_codes kernel: norm weight {norm_w.shape} for head_dim {hd}"
                         + ("" if layer is None else " (stacked: a leading layer axis)"))
    M = int(np.prod(lead, dtype=np.int64))
    if M == 0:
        codes = {"q": jnp.zeros((*lead, hd), quant.FP8), "s": jnp.zeros((*lead, hd // 32), quant.E8M0)}
        return codes if ring is None else (codes, ring[0])
    dt = jnp.dtype(dt)
    bm = TOKEN_BLOCK
    common.log_choice(NAME, interpret, token_block=bm, head_dim=hd, rope_dims=rd)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    fr = jnp.asarray(np.asarray(freqs, np.float32) if not isinstance(freqs, jax.Array) else freqs, jnp.float32)
    ins = [lay, y.reshape(M, hd), norm_w.reshape(-1), positions.reshape(M).astype(jnp.int32), fr]
    out_shape = [jax.ShapeDtypeStruct((M, hd), jnp.uint8), jax.ShapeDtypeStruct((M, hd // 32), jnp.uint8)]
    c = dict(bm=bm, hd=hd, rd=rd, M=M, dt=dt, eps=float(eps), ring=ring is not None)
    aliases = {}
    if ring is not None:
        store, rows, write, ring_layer, ring_base = ring
        if isinstance(ring_layer, int):  # a static layer is one static index (no operand to add at run time)
            ring_layer, ring_base = ring_layer + ring_base, 0
        R, L, W = store["q"].shape[:3]
        if store["q"].shape != (R, L, W, hd) or store["s"].shape != (R, L, W, hd // 32):
            raise ValueError(f"window_codes kernel: ring store {store['q'].shape} / {store['s'].shape}, expected "
                             f"[R, L, W, {hd}] / [R, L, W, {hd // 32}]")
        flat = [lax.bitcast_convert_type(store[k], jnp.uint8).reshape(R * L * W, -1) for k in ("q", "s")]
        ins += [rows.reshape(M).astype(jnp.int32), write.reshape(M).astype(jnp.int32),
                jnp.reshape(jnp.asarray(ring_layer, jnp.int32), (1,))] + flat
        out_shape += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
        aliases = {len(ins) - 2: 2, len(ins) - 1: 3}
        c.update(R=R, L=L, W=W, base=int(ring_base))

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, nd=a.ndim: (0,) * nd)

    outs = pl.pallas_call(
        functools.partial(_kernel, c=c),
        grid=(pl.cdiv(M, bm),), in_specs=[whole(a) for a in ins], out_shape=out_shape,
        out_specs=[whole(a) for a in out_shape], input_output_aliases=aliases,
        # 8 warps: the [16, hd] fp32 row tiles (the values, their partners, cos / sin) fit without spilling
        compiler_params=common.triton_params(num_warps=8, num_stages=1), interpret=interpret, name=NAME,
        cost_estimate=pl.CostEstimate(flops=12 * M * hd, transcendentals=3 * M * hd,
                                      bytes_accessed=costs.window_codes_bytes_moved(M=M, hd=hd, itemsize=dt.itemsize,
                                                                                    ring=ring is not None)),
    )(*ins)
    codes = {"q": lax.bitcast_convert_type(outs[0], quant.FP8).reshape(*lead, hd),
             "s": lax.bitcast_convert_type(outs[1], quant.E8M0).reshape(*lead, hd // 32)}
    if ring is None:
        return codes
    return codes, {"q": lax.bitcast_convert_type(outs[2].reshape(store["q"].shape), quant.FP8),
                   "s": lax.bitcast_convert_type(outs[3].reshape(store["s"].shape), quant.E8M0)}


dispatch.register("attention", "window_codes", kernel=kernel, reference=ref_window_codes, supports=supports)
