"""Pallas kernel of the linear seam: an fp8 / MXFP4 GEMM with the activation quant fused in (docs/design/spec.md §6).

`kernel(x, p, fmt, dt)` computes what `linear.fp8` (``fmt="fp8"``) and `linear.mxfp4` (``"mxfp4"``)
compute — the spec's GEMM of an fp8-quantized activation with a stored weight — in **one launch**:

* the activation quant (`quant.act_quant_fp8`: per 32 along K, amax ≥ 1e-4, s = 2^⌈log2(amax/448)⌉,
  e4m3 RNE of x/s) runs in registers on each K chunk, on the rows the program holds
  (`common.fake_quant_fp8`: `codec.fp8_act_codes`, the one definition), so no quantized copy of x is written;
* the weight is read at stored width — fp8: e4m3 bytes [N, K] and one E8M0 byte per 32×32 block
  ([⌈N/32⌉, K/32]); MXFP4: packed e2m1 [N, K/2] (as uint16 byte pairs, `common.flat`) and one
  E8M0 byte per 32 along K ([N, K/32]) — and decoded in registers with the shared `model.codec`
  definitions;
* both operands are then exact in bf16 (an e4m3 or e2m1 value times a power of two), so one bf16 dot
  per chunk with fp32 accumulation forms the exact products and sums them in fp32; the sum is rounded
  once to `dt`.

Why: at decode sizes the xla path is a chain of small launches — per matmul the K-blockwise partial sums
and their scaled sum, per quantized input its amax, the scale and the codes — each on a few thread blocks
(in the H200-target compile of the flash cut at B = 1, 30 calls of this kernel replace 86 kernels:
docs/benchmarks.md, "Launches per decode step"). Here a linear is one launch whose programs tile N (and
M), each streaming its weight rows once; the activation enters as it is (no pad).

Numerics vs. the xla path and the reference: the same products (exact) and the same roundings of the
activation; only the fp32 summation order inside the GEMM differs (the reference: one fp32 dot over K;
the xla small-M path: per-32-block partial sums, then a scaled sum over blocks). So a sum with at most
two nonzero products is bitwise the same on every path, and otherwise the fp32 output is within fp32
reassociation (tests/test_pallas_linear.py states the bounds). The exact / deterministic modes (fp64
accumulation) have no kernel: the seam refuses them.

Grid (N / block_n, ⌈M / block_m⌉): at decode sizes one row block, so N / block_n programs, each
streaming a [block_n, K] slab of the weight through K / block_k chunks; at prefill sizes every row block
re-reads its weight tiles (from L2 when they are still there: the order is not tuned, the kernel is
made for decode). A row block past the last row re-reads that row (clamped indices) and its extra
outputs are dropped. Inside a layer-scan run the weight is the run's stacks and a layer index (read in
place: a sliced operand would be copied). Only one device: on a mesh whose rules split the weights, a
Pallas call would make XLA gather every weight onto every device, so the step plan refuses the kernel there
(the xla path is partitioned by XLA).

Epilogues and prologues that take a neighbour's launches (`kernel`'s keywords; their callers `moe.moe`, which
reads the step plan, and the seam `linear.fp8_normed`): a gated pair (two weights streamed by the same programs and an
elementwise function of both outputs: the shared expert's w1 / w3 and its SwiGLU), an RMSNormed input (each
program sums its rows' squares first: q_norm inside wq_b) and a RoPE'd output (the pairs' partners through
an exact fp32 dot with the pair swap: the q RoPE). The output has exactly M rows (masked stores): a padded
output would be sliced by a copy before a Pallas consumer.

Block sizes of the arithmetic (declared per call, `kernel`'s ``act_block`` / ``weight_block``): V4.1's are the
defaults — the activation quantized per 32 along K, fp8 weight scales per 32 x 32 block (MXFP4: per 1 x 32, the
format's) — and its calls pass none (the same program, bit for bit). DeepSeek-V4 in its release numerics
(`model.v4.linear`, docs/design/v4.md "Kernels") passes its config's: activation per ``act_quant_block`` (128),
fp8 weights in ``weight_block_size`` (128 x 128) blocks — the release's blockwise fp8 GEMM, which V4's jnp path
computes as the fake-quantized activation times the exactly dequantized weight in fp32: the same exact products,
only the fp32 summation order differs, as for V4.1. Each K chunk holds whole blocks of both (block_k a multiple
of them); a weight row reads scale row ⌊n / weight_block[0]⌋.

Lowering: Pallas **Triton** (`common.triton_params`), as every kernel here; no fp8 dtype reaches the
kernel (codes and scales enter as their uint8 bits); block sizes are powers of two (block_n ≥ 16,
block_k ≥ 32, each dividing its dimension); rounding is integer arithmetic.
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

from dsv41_jax.model import codec, dispatch, linear, weights
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common, costs

NAME = costs.LINEAR_NAME
FORMATS = costs.LINEAR_FORMATS
_MIN_DOT = common.MIN_DOT

# The alternatives worth timing on a GPU (scripts/bench_kernels.py --ops linear); the first is the default.
# At decode a [64, K] fp8 slab per program gives flash's wq_b (32768 rows) 512 programs and its wq_a
# (1280 rows) 20: narrower tiles give the small matmuls more programs, deeper chunks longer loads.
TUNING_CANDIDATES = (
    dict(block_n=64, block_k=256, num_warps=4, num_stages=3),  # the default
    dict(block_n=32, block_k=256, num_warps=4, num_stages=3),
    dict(block_n=16, block_k=256, num_warps=4, num_stages=4),
    dict(block_n=128, block_k=128, num_warps=4, num_stages=4),
    dict(block_n=64, block_k=512, num_warps=8, num_stages=2),
)


# ------------------------------------------------------------------------------------- reference


def ref_linear(x, p, fmt: str, dt, cfg, *, act_block: int = 32, weight_block=None):
    """The oracle: the seam's "xla" GEMM (`linear.fp8` / `linear.mxfp4` with impl "xla"); `kernel`'s arguments. For a
    DeepSeek-V4 config (its release numerics: the blocks must be the config's, `v4_blocks`) V4's jnp GEMM,
    `v4.linear.dense` (fp8) / `v4.linear.expert` (MXFP4): the fake-quantized activation times the exactly
    dequantized weight, one fp32 dot."""
    cfg = cfg.replace(impl="xla")
    if is_v4(cfg) or (act_block, weight_block) != (32, None):
        from dsv41_jax.model.v4 import linear as linear4

        if (act_block, _weight_block(fmt, weight_block)) != v4_blocks(cfg, fmt):
            raise ValueError(f"quant_linear.ref_linear: blocks {act_block} / {weight_block} are not the config's "
                             f"{v4_blocks(cfg, fmt)} (only DeepSeek-V4's release numerics declare other blocks)")
        return linear4.dense(x, p, cfg, dt) if fmt == "fp8" else linear4.expert(x, p, cfg, dt)
    return linear.fp8(x, p, cfg, dt) if fmt == "fp8" else linear.mxfp4(x, p, cfg, dt)


def ref_linear_dual(x, p1, p2, fmt: str, dt, cfg):
    """The oracle of `kernel_dual`: the two GEMMs one after the other (`ref_linear`)."""
    return ref_linear(x, p1, fmt, dt, cfg), ref_linear(x, p2, fmt, dt, cfg)


def is_v4(cfg) -> bool:
    """Whether `cfg` is a DeepSeek-V4 config (its GEMMs declare their blocks: `v4_blocks`)."""
    return cfg.model_family == "deepseek_v4"


def _weight_block(fmt: str, weight_block):
    """The (rows, K) of one weight scale: as declared, else the format's default (fp8 32 x 32, MXFP4 1 x 32)."""
    return tuple(int(b) for b in weight_block) if weight_block is not None else (32, 32) if fmt == "fp8" else (1, 32)


def v4_blocks(cfg, fmt: str):
    """DeepSeek-V4's (act_block, weight_block) for a GEMM of format `fmt` in its release numerics: activation per
    ``act_quant_block``, fp8 weights in ``weight_block_size`` blocks, MXFP4 experts per 1 x 32 (the format's); None
    where the kernel's arithmetic is not V4's (``act_quant_block`` 0: V4 multiplies the unquantized activation)."""
    if not cfg.act_quant_block:
        return None
    return int(cfg.act_quant_block), (tuple(int(b) for b in cfg.weight_block_size) if fmt == "fp8" else (1, 32))


def _pow2_at_least_32(v) -> bool:
    return isinstance(v, int) and v >= 32 and not v & (v - 1)


def blocks_fit(act_block, weight_block, fmt: str) -> bool:
    """Whether the kernel takes these blocks: the activation block and the weight's K block powers of two >= 32 (a K
    chunk holds whole blocks of both), the fp8 weight's row block a power of two >= 32 too; MXFP4's is its 1 x 32."""
    wn, wk = _weight_block(fmt, weight_block) if weight_block is None or len(weight_block) == 2 else (0, 0)
    if fmt == "mxfp4":
        return _pow2_at_least_32(act_block) and (wn, wk) == (1, 32)
    return _pow2_at_least_32(act_block) and _pow2_at_least_32(wn) and _pow2_at_least_32(wk)


def supports(cfg, mode: str = "auto") -> bool:
    """Whether the linear kernel runs `cfg`: the fp32 numerics (not the exact / deterministic modes); for DeepSeek-V4
    only its release numerics (``act_quant_block`` set: `v4_blocks`), whose fp8 weight blocks the kernel takes
    (`blocks_fit`; a plain checkpoint has no fp8 GEMM) and in our own fp32 order (not ``release_order`` "torch_cpu").
    Each matmul's tiles are checked per call: a shape they do not divide is refused, NotImplementedError."""
    if is_exact(cfg):
        return False
    if not is_v4(cfg):
        return True
    blocks = v4_blocks(cfg, "fp8")
    return (blocks is not None and len(cfg.weight_block_size) == 2 and blocks_fit(*blocks, "fp8")
            and cfg.release_order != "torch_cpu")


def supports_v41(cfg, mode: str = "auto") -> bool:
    """`kernel_dual`'s: V4.1's blocks only (V4 does not call it), the fp32 numerics."""
    return not is_exact(cfg) and not is_v4(cfg)


# ------------------------------------------------------------------------------------------ kernel


def _fp8_tile(w_ref, s_ref, w0, srow, kc, bn: int, bk: int, wbk: int = 32):
    """Weight rows w0 .. w0 + bn − 1, K chunk kc (bk wide) of an fp8 weight, decoded in registers: e4m3 codes times
    their blocks' E8M0 scales (one per `wbk` along K; srow: each row's scale row), bf16 (exact)."""
    scale = codec.e8m0_decode(s_ref[srow, pl.ds(kc * (bk // wbk), bk // wbk)].astype(jnp.int32), jnp)
    w = codec.e4m3_decode(w_ref[pl.ds(w0, bn), pl.ds(kc * bk, bk)].astype(jnp.int32), jnp)
    return (w * common.expand(scale, wbk)).astype(jnp.bfloat16)


def _kernel(layer_ref, x_ref, *refs, c):
    """Program (tile j of N, row block i): o[i-rows, j-tile] = dt(fq8(x[i-rows]) · w[j-tile]ᵀ), the weight's
    rows read at layer_ref[0]'s offset in a run's stacks (0 for one layer's weight).

    refs: w_ref, s_ref, then with c["gated"] a second weight w2_ref, s2_ref (same shape: the two GEMMs share
    the activation's chunks and the output is ``act(dt(x·w), dt(x·w2))``), with c["norm"] the RMSNorm weight
    nw_ref [(layers·)K] (x is normed first: ``dt(x · rsqrt(Σx²/K + eps) · nw)``, `norm.rmsnorm`), and o_ref
    [M, N] (rows past M masked off: an output with padded rows would be sliced by a copy before a Pallas
    consumer)."""
    ws = [refs[:2], refs[2:4]] if c["gated"] else [refs[:2]]
    extra = list(refs[2 * len(ws):-1])
    nw_ref = extra.pop(0) if c["norm"] else None
    pos_ref, f_ref = (extra.pop(0), extra.pop(0)) if c["rope"] else (None, None)
    ys_ref, ord_ref = (extra.pop(0), extra.pop(0)) if c["combine"] else (None, None)
    o_ref = refs[-1]
    j, i = pl.program_id(0), pl.program_id(1)
    bm, bn, bk = c["bm"], c["bn"], c["bk"]
    r0, n0 = i * bm, j * bn
    nrow = n0 + lax.iota(jnp.int32, bn)
    srow = lax.div(nrow, c["wbn"]) if c["fmt"] == "fp8" else nrow  # fp8: one scale row per wbn (32) weight rows
    lay = layer_ref[0]
    srow = srow + lay * c["S"]
    w0 = n0 + lay * c["N"]  # the tile's first weight row in the (stacked) weight

    # x is not padded to whole row blocks (a pad would be one more launch per linear): the rows past M
    # read row M − 1 again (clamped indices, always in bounds) and their outputs are dropped.
    xrows = jnp.minimum(r0 + lax.iota(jnp.int32, bm), c["M"] - 1)

    def wtile(w_ref, s_ref, kc):
        if c["fmt"] == "fp8":
            return _fp8_tile(w_ref, s_ref, w0, srow, kc, bn, bk, c["wbk"])
        # MXFP4: packed e2m1 as uint16 byte pairs, 4 elements per pair
        scale = codec.e8m0_decode(s_ref[srow, pl.ds(kc * (bk // 32), bk // 32)].astype(jnp.int32), jnp)
        pairs = w_ref[pl.ds(w0, bn), pl.ds(kc * (bk // 4), bk // 4)].astype(jnp.int32)
        by = jnp.stack([pairs & 0xFF, pairs >> 8], axis=-1).reshape(bn, bk // 2)
        return (codec.e2m1_decode(codec.unpack_nibbles(by, jnp), jnp) * common.expand(scale, 32)).astype(jnp.bfloat16)

    if c["norm"]:  # the rows' Σx² first (x is a few KB per row: a second read of it hits L1 / L2)
        def sq(kc, ss):
            xb = x_ref[xrows, pl.ds(kc * bk, bk)].astype(jnp.float32)
            return ss + jnp.sum(xb * xb, axis=1)

        ss = lax.fori_loop(0, c["K"] // bk, sq, jnp.zeros((bm,), jnp.float32))
        r = lax.rsqrt(ss / c["K"] + c["eps"])[:, None]

    def kstep(kc, accs):
        xb = x_ref[xrows, pl.ds(kc * bk, bk)].astype(jnp.float32)
        if c["norm"]:  # norm.rmsnorm's fp32 formula, rounded to dt as its output is
            nw = nw_ref[pl.ds(lay * c["K"] + kc * bk, bk)].astype(jnp.float32)
            xb = (xb * r * nw[None, :]).astype(o_ref.dtype).astype(jnp.float32)
        xq = common.fake_quant_fp8(xb, c["ab"]).astype(jnp.bfloat16)  # exact: e4m3 value × 2^k
        return tuple(acc + common.dot_nt(xq, wtile(w_ref, s_ref, kc)) for acc, (w_ref, s_ref) in zip(accs, ws))

    accs = lax.fori_loop(0, c["K"] // bk, kstep, tuple(jnp.zeros((bm, bn), jnp.float32) for _ in ws))
    dt = o_ref.dtype
    if c["gated"]:  # each GEMM's output rounded to dt, as the separate calls give them to the activation
        out = c["act"](accs[0].astype(dt), accs[1].astype(dt))
    elif c["rope"]:
        out = _rope_epilogue(accs[0].astype(dt).astype(jnp.float32), pos_ref[xrows], f_ref, n0, c)
    elif c["combine"]:
        # moe.moe's last sum: dt(combine_slots(slots) + f32(dt(x·w))), the slots in ascending expert id
        # (the router kernel's order), folded left to right from 0 as combine_slots folds them
        k, kp = c["k"], c["kp"]
        cols = n0 + lax.iota(jnp.int32, bn)
        routed = None
        for q in range(k):
            slot = ord_ref[xrows * kp + q]
            yq = ys_ref[(xrows * k + slot)[:, None], cols[None, :]].astype(jnp.float32)
            routed = 0.0 + yq if routed is None else routed + yq
        out = routed + accs[0].astype(dt).astype(jnp.float32)
    else:
        out = accs[0]
    rmask = (r0 + lax.iota(jnp.int32, bm) < c["M"])[:, None]
    pltriton.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], out.astype(dt), mask=rmask)


def _dual_kernel(layer_ref, x_ref, w1_ref, s1_ref, w2_ref, s2_ref, o1_ref, o2_ref, *, c):
    """Two GEMMs of one input in one launch (`kernel_dual`): programs j < T1 compute tile j of x·w1ᵀ, the rest
    tile j − T1 of x·w2ᵀ (the branch picks the weight; the stores are masked to their output)."""
    j, i = pl.program_id(0), pl.program_id(1)
    bm, bn, bk, t1 = c["bm"], c["bn"], c["bk"], c["T1"]
    r0 = i * bm
    lay = layer_ref[0]
    xrows = jnp.minimum(r0 + lax.iota(jnp.int32, bm), c["M"] - 1)
    first = j < t1
    n0 = jnp.where(first, j, j - t1) * bn  # the tile's first output column in its own output

    def gemm(w_ref, s_ref, N):
        w0 = n0 + lay * N
        srow = lax.div(n0 + lax.iota(jnp.int32, bn), 32) + lay * (-(-N // 32))

        def kstep(kc, acc):
            xq = common.fake_quant_fp8(x_ref[xrows, pl.ds(kc * bk, bk)].astype(jnp.float32)).astype(jnp.bfloat16)
            return acc + common.dot_nt(xq, _fp8_tile(w_ref, s_ref, w0, srow, kc, bn, bk))

        return lax.fori_loop(0, c["K"] // bk, kstep, jnp.zeros((bm, bn), jnp.float32))

    acc = lax.cond(first, lambda: gemm(w1_ref, s1_ref, c["N1"]), lambda: gemm(w2_ref, s2_ref, c["N2"]))
    live = (r0 + lax.iota(jnp.int32, bm) < c["M"])[:, None]
    out = acc.astype(o1_ref.dtype)
    pltriton.store(o1_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], out, mask=live & first)
    pltriton.store(o2_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], out, mask=live & jnp.logical_not(first))


def _rope_epilogue(y, pos, f_ref, n0, c):
    """`rope.apply_rope` on the output tile y fp32 [bm, bn] (the GEMM's output rounded to dt): columns n0 ..
    n0 + bn − 1 of rows viewed as heads of c["hd"], whose last c["rd"] dims are rotated in interleaved pairs
    at angle fp32(pos)·f_i. A pair's partner (column ^ 1, in the same tile: bn is a multiple of 2) comes from
    a dot with the pair-swap permutation (each output is one product by 1.0 plus zeros: the partner itself; a
    bf16 dot in the bf16 flow, where y is bf16-valued, an IEEE fp32 one otherwise; the Triton lowering cannot
    permute register lanes otherwise). The result is rounded by the caller's store, as apply_rope rounds
    once."""
    bn, hd, rd = y.shape[1], c["hd"], c["rd"]
    col = n0 + lax.iota(jnp.int32, bn)
    d = lax.rem(col, hd)
    rope = d >= hd - rd
    lane = lax.iota(jnp.int32, bn)
    swap = lane[:, None] == (lane[None, :] ^ 1)  # [bn, bn]: column c takes lane c ^ 1
    if c["dt"] == jnp.bfloat16:  # y is bf16-valued: a bf16 dot with the 0/1 matrix is exact (tensor cores)
        yp = lax.dot_general(y.astype(jnp.bfloat16), swap.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    else:
        yp = lax.dot_general(y, swap.astype(jnp.float32), (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    freq = f_ref[jnp.clip((d - (hd - rd)) // 2, 0, rd // 2 - 1)]
    ang = pos.astype(jnp.float32)[:, None] * freq[None, :]
    cs, sn = jnp.cos(ang), jnp.sin(ang)
    even = ((d & 1) == 0)[None, :]
    rot = jnp.where(even, y * cs - yp * sn, yp * sn + y * cs)
    return jnp.where(rope[None, :], rot, y)


# ------------------------------------------------------------------------------------------- entry


def _plan(M: int, N: int, K: int, block_m, block_n, block_k, k_unit: int = 32) -> dict:
    """Static block sizes. Defaults: block_m the rows padded to a power of two (16 to 64), block_n 64 and
    block_k 256, each cut to the largest power of two dividing its dimension (block_k at least `k_unit`, the
    activation's and the weight's K blocks: a chunk holds whole blocks; 32 for V4.1, where the cut is >= 32)."""
    bm = block_m or min(64, max(_MIN_DOT, common.next_pow2(M)))
    bn = block_n or math.gcd(N, 64)
    bk = block_k or max(math.gcd(K, 256), k_unit)
    for name, v, dim, lo in (("block_m", bm, None, _MIN_DOT), ("block_n", bn, N, _MIN_DOT), ("block_k", bk, K, k_unit)):
        if v < lo or v & (v - 1) or (dim is not None and dim % v):
            raise NotImplementedError(f"quant_linear: {name}={v} must be a power of two >= {lo}"
                                      + (f" dividing {dim}" if dim is not None else "")
                                      + " (the kernel's tiles; run the linear op with impl 'xla' for this shape)")
    return dict(bm=bm, bn=bn, bk=bk)


def kernel(x, p, fmt: str, dt, cfg=None, *, interpret: bool = False, block_m: int | None = None,
           block_n: int | None = None, block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
           p_up=None, act=None, norm=None, rope=None, combine=None, act_block: int = 32, weight_block=None):
    """The quantized GEMM of the linear seam: x [..., K] (bf16 | fp32) times a stored weight -> [..., N] in `dt`.

    p: fp8 `weights.Fp8` (float8_e4m3fn [N, K], E8M0 [⌈N/32⌉, K/32]) (``fmt="fp8"``) or MXFP4 `weights.Mxfp4`
    (uint8 [N, K/2], E8M0 [N, K/32]) (``fmt="mxfp4"``); codes and scales may be their uint8 bits; or, inside a
    layer-scan run, a `weights.Stacked` of the run's stacks [n, ...] of these and the layer (int32 scalar): the
    kernel reads that layer's rows in place (a slice would be copied by XLA: a Pallas operand does not fuse
    with it).
    cfg: the model config (its exact / deterministic modes are refused). Knobs (static): block_m rows per
    program, block_n output columns per program, block_k K chunk, num_warps / num_stages (Triton).

    Blocks of the arithmetic (static, module doc): ``act_block`` the activation's fp8 quant block along K (32),
    ``weight_block`` (rows, K) of one fp8 weight scale (None: 32 x 32; MXFP4: its 1 x 32 only), powers of two
    >= 32; the scale is then [⌈N/rows⌉, K/K-block]. V4.1 passes none; DeepSeek-V4's release numerics pass its
    config's (`v4_blocks`: 128 and 128 x 128; a V4 config with other blocks, or outside those numerics, is refused).

    Gated pair (one launch instead of three): ``p_up`` (a second weight like `p`) with ``act`` (a static
    elementwise function of two [rows, N] arrays in `dt`, traceable by the Triton lowering): returns
    ``act(dt(x·p), dt(x·p_up))`` in `dt` — both weights streamed by the same programs, e.g. a SwiGLU
    expert's w1 / w3 and its activation.

    Normed input: ``norm=(weight, eps)`` with weight [K] (or, with a stacked `p`, the run's stacked norm
    weights [n, K], read at p's layer): the GEMM's input is ``norm.rmsnorm(x, weight, eps, dt)`` computed
    in-kernel (each program sums its rows' squares first) — the XLA norm's two launches go.

    RoPE'd output: ``rope=(positions int32 [...] (x's leading shape), freqs [rd/2] fp32, head_dim)``: the
    output viewed as [..., N / head_dim, head_dim] comes back as ``rope.apply_rope(out, positions[..., None],
    freqs, out_dtype=dt)`` (the q projection's RoPE, one launch fewer; head_dim even).

    Combined with the routed experts: ``combine=(slots, order, k)`` with slots [≥ M·k, N] in dt (token m's slot
    j at row m·k + j: the experts' kernel's output rows, padding rows after) and order int32 [M, kp] (each
    row's slots in ascending expert id in its first k lanes: the router kernel's): returns
    ``dt(moe.combine_slots(slots, ...) + f32(dt(x·p)))`` — the MoE's last sum, one launch fewer.
    """
    if cfg is not None and is_exact(cfg):
        raise NotImplementedError("quant_linear kernel: the exact / deterministic numerics modes accumulate in fp64, "
                                  "which this kernel does not; run the linear op with impl 'xla' or 'reference'")
    if fmt not in FORMATS:
        raise ValueError(f"quant_linear: fmt must be one of {FORMATS}, got {fmt!r}")
    if not blocks_fit(act_block, weight_block, fmt):
        raise NotImplementedError(f"quant_linear: activation block {act_block!r} / weight block {weight_block!r} "
                                  f"({fmt}): the kernel takes powers of two >= 32 (MXFP4: its own 1 x 32 scales)")
    wbn, wbk = _weight_block(fmt, weight_block)
    if cfg is not None and is_v4(cfg) and (act_block, (wbn, wbk)) != v4_blocks(cfg, fmt):
        raise NotImplementedError(
            f"quant_linear: DeepSeek-V4 config {cfg.name!r} with activation block {act_block} / weight block "
            f"{(wbn, wbk)}: the kernel runs V4 only in its release numerics, with its blocks {v4_blocks(cfg, fmt)} "
            f"(act_quant_block, weight_block_size)")
    dt = jnp.dtype(dt)
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"quant_linear kernel: x must be bf16 or fp32, got {x.dtype}")
    p, layer = weights.split(p)  # inside a layer-scan run: the run's stacks [n, ...] and the layer to read
    w, s = p.weight, p.scale
    if w.ndim != (2 if layer is None else 3):
        raise ValueError(f"quant_linear: weight of shape {w.shape} " + ("without" if layer is None else "with") +
                         " a layer index")
    N, S = w.shape[-2], s.shape[-2]
    K = w.shape[-1] * (2 if fmt == "mxfp4" else 1)
    k_unit = max(act_block, wbk)  # powers of two: a K chunk holds whole blocks of both
    if x.shape[-1] != K or K % k_unit:
        raise ValueError(f"quant_linear: x [..., {x.shape[-1]}] against a weight of K = {K} (K % {k_unit} must be 0)")
    if s.shape[-2:] != (-(-N // wbn), K // wbk):
        raise ValueError(f"quant_linear: scales {s.shape} for a weight [{N}, {K}] in {wbn} x {wbk} blocks")
    lead = x.shape[:-1]
    M = math.prod(lead)
    gated = p_up is not None
    if gated != (act is not None):
        raise ValueError("quant_linear: p_up and act go together")
    if gated:
        p_up, up_layer = weights.split(p_up)
        if p_up.weight.shape != w.shape or p_up.scale.shape != s.shape or (up_layer is None) != (layer is None):
            raise ValueError(f"quant_linear: the gated pair's weights differ: {w.shape} / {s.shape} vs "
                             f"{p_up.weight.shape} / {p_up.scale.shape}")
    if norm is not None and norm[0].shape != ((K,) if layer is None else (w.shape[0], K)):
        raise ValueError(f"quant_linear: norm weight of shape {norm[0].shape} for K = {K}"
                         + ("" if layer is None else f" and {w.shape[0]} stacked layers"))
    if rope is not None:
        if gated:
            raise ValueError("quant_linear: rope and a gated pair exclude each other")
        rpos, rfreqs, rhd = rope
        rd = 2 * int(np.shape(rfreqs)[-1])
        if rpos.shape != lead or N % rhd or rd > rhd or rhd % 2:
            raise ValueError(f"quant_linear: rope positions {rpos.shape} / rope dims {rd} / head_dim {rhd} do not fit "
                             f"x {x.shape} and N = {N}")
    if combine is not None:
        ys, order, ck = combine
        if gated or rope is not None or ys.shape[-1] != N or ys.shape[0] < M * ck or order.shape[0] != M:
            raise ValueError(f"quant_linear: combine slots {ys.shape} / order {order.shape} do not fit {M} rows of "
                             f"{N} (and exclude a gated pair and rope)")
    if M == 0:
        return jnp.zeros((*lead, N), dt)
    pl_ = _plan(M, N, K, block_m, block_n, block_k, k_unit)  # block_n a power of two >= 16: a pair never straddles
    bm, bn, bk = pl_["bm"], pl_["bn"], pl_["bk"]
    x2 = x.reshape(M, K)
    wb = common.flat(w, pairs=fmt == "mxfp4", kernel=NAME)  # [(n·)N, K or K/4]: a stack's layers one after another
    sb = common.flat(s, kernel=NAME)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    common.log_choice(NAME, interpret, block_m=bm, block_n=bn, block_k=bk, num_warps=num_warps, num_stages=num_stages)

    def whole(a):
        return pl.BlockSpec(a.shape, lambda j, i, nd=a.ndim: (0,) * nd)

    nw = 2 if gated else 1
    cost = pl.CostEstimate(flops=2 * nw * M * N * K, transcendentals=M * N if gated else 0,
                           bytes_accessed=costs.linear_bytes_moved(fmt, M=M, N=N, K=K, x_itemsize=x.dtype.itemsize,
                                                      out_itemsize=dt.itemsize, weights=nw,
                                                      weight_block=(wbn, wbk)))
    out = jax.ShapeDtypeStruct((M, N), dt)
    operands = [lay, x2, wb, sb]
    if gated:
        operands += [common.flat(p_up.weight, pairs=fmt == "mxfp4", kernel=NAME), common.flat(p_up.scale, kernel=NAME)]
    if norm is not None:
        operands.append(norm[0].reshape(-1))
    if rope is not None:
        operands += [rpos.reshape(M).astype(jnp.int32),
                     jnp.asarray(np.asarray(rfreqs, np.float32) if not isinstance(rfreqs, jax.Array) else rfreqs,
                                 jnp.float32)]
    if combine is not None:
        operands += [ys, order.reshape(-1).astype(jnp.int32)]
    declared = (act_block, weight_block) != (32, None)  # V4's blocks in the name (V4.1's names unchanged)
    tag = (f"_a{act_block}" + (f"_w{wbn}x{wbk}" if fmt == "fp8" else "")) if declared else ""
    tag += ("_gated" if gated else "") + ("_normed" if norm is not None else "") + ("_rope" if rope is not None else "")
    tag += "_combine" if combine is not None else ""
    y = pl.pallas_call(
        functools.partial(_kernel, c=dict(fmt=fmt, M=M, N=N, S=S, K=K, bm=bm, bn=bn, bk=bk, gated=gated, act=act,
                                          ab=int(act_block), wbn=wbn, wbk=wbk,
                                          norm=norm is not None, eps=None if norm is None else float(norm[1]),
                                          rope=rope is not None, hd=None if rope is None else int(rope[2]), dt=dt,
                                          rd=None if rope is None else rd, combine=combine is not None,
                                          k=None if combine is None else int(combine[2]),
                                          kp=None if combine is None else int(combine[1].shape[-1]))),
        grid=(N // bn, pl.cdiv(M, bm)), in_specs=[whole(a) for a in operands], out_specs=whole(out),
        out_shape=out,
        interpret=interpret, compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost, name=f"{NAME}_{fmt}{tag}_m{bm}_n{bn}_k{bk}")(*operands)
    return y.reshape(*lead, N)


def kernel_dual(x, p1, p2, fmt: str, dt, cfg=None, *, interpret: bool = False, block_k: int | None = None,
                num_warps: int = 4, num_stages: int = 3):
    """Two fp8 GEMMs of one activation in one launch: (`kernel`(x, p1), `kernel`(x, p2)) — e.g. a layer's wq_a and
    wkv, both of the normed attention input. p1 / p2: `weights.Fp8` [N1, K] / [N2, K] (or both a run's stacks,
    `weights.Stacked` at the same layer); N1, N2 multiples of 64. Programs over N1/64 + N2/64 tiles; each quantizes its
    activation chunks in-kernel as `kernel` does (the same values, bitwise the two calls)."""
    if cfg is not None and is_exact(cfg):
        raise NotImplementedError("quant_linear kernel: the exact / deterministic numerics modes accumulate in fp64, "
                                  "which this kernel does not; run the linear op with impl 'xla' or 'reference'")
    if fmt != "fp8":
        raise NotImplementedError(f"quant_linear.kernel_dual: fp8 weights only, got {fmt!r}")
    dt = jnp.dtype(dt)
    (p1, layer), (p2, layer2) = weights.split(p1), weights.split(p2)
    if (layer is None) != (layer2 is None):
        raise ValueError("quant_linear.kernel_dual: both weights must be a run's stacks (weights.Stacked) or neither")
    (N1, K), (N2, K2) = p1.weight.shape[-2:], p2.weight.shape[-2:]
    bn = 64
    if K != K2 or x.shape[-1] != K or N1 % bn or N2 % bn or K % 32:
        raise ValueError(f"quant_linear.kernel_dual: weights {p1.weight.shape} / {p2.weight.shape} for x {x.shape}"
                         f" (both N multiples of {bn}, one K)")
    lead = x.shape[:-1]
    M = math.prod(lead)
    if M == 0:
        return jnp.zeros((*lead, N1), dt), jnp.zeros((*lead, N2), dt)
    bk = _plan(M, N1, K, None, bn, block_k)["bk"]
    bm = min(64, max(_MIN_DOT, common.next_pow2(M)))
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    ops = [lay, x.reshape(M, K)] + [a for p in (p1, p2) for a in (common.flat(p.weight, kernel=NAME),
                                                                 common.flat(p.scale, kernel=NAME))]
    common.log_choice(NAME + "_dual", interpret, block_m=bm, block_n=bn, block_k=bk)

    def whole(a):
        return pl.BlockSpec(a.shape, lambda j, i, nd=a.ndim: (0,) * nd)

    outs = [jax.ShapeDtypeStruct((M, N1), dt), jax.ShapeDtypeStruct((M, N2), dt)]
    cost = pl.CostEstimate(flops=2 * M * (N1 + N2) * K, transcendentals=0,
                           bytes_accessed=sum(costs.linear_bytes_moved("fp8", M=M, N=n, K=K, x_itemsize=x.dtype.itemsize,
                                                          out_itemsize=dt.itemsize) for n in (N1, N2)))
    y1, y2 = pl.pallas_call(
        functools.partial(_dual_kernel, c=dict(M=M, K=K, N1=N1, N2=N2, T1=N1 // bn, bm=bm, bn=bn, bk=bk)),
        grid=((N1 + N2) // bn, pl.cdiv(M, bm)), in_specs=[whole(a) for a in ops], out_specs=[whole(o) for o in outs],
        out_shape=outs, interpret=interpret,
        compiler_params=common.triton_params(num_warps=num_warps, num_stages=num_stages), cost_estimate=cost,
        name=f"{NAME}_fp8_dual_m{bm}_n{bn}_k{bk}")(*ops)
    return y1.reshape(*lead, N1), y2.reshape(*lead, N2)


dispatch.register("linear", "kernel", kernel=kernel, reference=ref_linear, supports=supports)
dispatch.register("linear", "kernel_dual", kernel=kernel_dual, reference=ref_linear_dual, supports=supports_v41)
