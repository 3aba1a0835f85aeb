"""The release's fp32 steps in the order torch evaluates its ``inference/model.py`` on an x86 CPU (research only).

``ModelConfig.release_order`` "torch_cpu" (V4 only; "" = our own order, XLA's): research/v4_release_forward.py
holds our V4 forward against the release's model.py run by torch on CPU. Both round to bf16 / fp8 / fp4 at the
same points, but an fp32 value a few ulps apart can cross a bf16 rounding midpoint, and the fp8 quantizers after
it turn that bf16 ulp into a whole fp8 step (docs/benchmarks.md, "DeepSeek-V4 against a copy of the release's
inference/model.py": with our own order the logits parted at position 9). Traced op by op, this module computes
what parted them as torch 2.13 + MKL 2024.2 do on an AVX-512 machine, each fp32 operation bit for bit:

* ``x.square().mean(-1)`` — ATen's inner sum (`row_sum`): the row cut into 8-lane vectors (its reduction
  kernel is the AVX2 one), 4 interleaved vector accumulators each summed in order, added 0+1+2+3, the 8 lanes
  then added left to right; the mean is that sum / K.
* ``torch.rsqrt`` — 1 / sqrt (two roundings; `rsqrt`).
* ``F.linear`` in fp32 — MKL's sgemm (`linear`): the K axis in blocks of 192, each block a sequential FMA chain
  from 0, the blocks' partial sums added in order (measured for [128, 512] x [24, 512], the mix projection of
  a 2 x 64 batch, and smaller batches); a 4-wide output (hc_head's) is another kernel (`linear`'s doc).
* ``torch.sigmoid`` / ``F.softmax`` — ATen's vectorized ``1 / (1 + exp(-x))`` and ``exp(x − max) · (1 / Σ)``
  with Sleef's ``expf_u10`` (`exp`; ``torch.exp`` itself takes another path, not used here); Σ over 4 in order.
* ``torch.polar`` — glibc's ``sinf`` / ``cosf`` per table entry (`_sin_cos`); the complex64 product with its
  products and sums rounded apart (`apply_rope`).

Used for: mHC's mixes, hc_pre, hc_post and hc_head (`hc_mixes`, `hc_pre`, `hc_post`, `head_collapse`), every
RMSNorm (`rmsnorm`), RoPE (`apply_rope`; the frequencies' power correctly rounded, as torch's: `rope.rope_freqs`'
``exact_pow``). The attention and the index scores run at the deterministic level (`exact_level`; the attention
as the script's rendering of the release's ``sparse_attn`` kernel does). The GEMMs of the quantized linears and
the compressor's stay in our order: they agree bit for bit after their bf16 rounding on the comparison config.

Every fp32 operation is evaluated in fp64 and rounded to fp32 (`numerics.round_f32`): +, −, ×, ÷ and √ so
evaluated are the IEEE fp32 operations, an FMA is exact up to a double rounding (an fp64 sum within 2^-53 of an
fp32 midpoint), and no XLA fusion can contract or reorder across the roundings. The GEMMs are sequential loops
over K and the sums are rendered for K <= 512 only: for the tiny comparison configs, not for serving.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import norm as norm41
from dsv41_jax.model import rope as rope41
from dsv41_jax.model.numerics import DETERMINISTIC, is_exact, round_f32, x64_scope

ORDERS = ("", "torch_cpu")
MKL_KC = 192  # MKL sgemm's K block on AVX-512 (measured: module doc)
LANES, ILP = 8, 4  # ATen's sum: 8-lane vectors, 4 accumulators

_R = round_f32
_F64 = jnp.float64


def _f(c):
    """An fp32 constant as an fp64 scalar."""
    return jnp.asarray(jnp.float32(c), _F64)


def fma(a, b, c):
    """fp32 fma(a, b, c) of fp32-valued fp64 arrays (a·b exact in fp64, one rounding to fp64, one to fp32)."""
    return _R(a * b + c)


def _pow2(q):
    """2^q (fp64, exact) of integer-valued fp64 `q` in [-1022, 1023], from the bits."""
    e = (q.astype(jnp.int64) + 1023) << 52
    return jax.lax.bitcast_convert_type(e, _F64)


def exp(d):
    """Sleef's ``expf_u10`` (ATen's ``Vectorized<float>::exp``) of fp32-valued fp64 `d`, fp32-valued fp64 out."""
    q = jnp.round(_R(d * _f(1.442695040888963407359924681001892137)))  # vrint: to nearest, ties to even
    s = fma(q, _f(-0.693145751953125), d)
    s = fma(q, _f(-1.428606765330187045e-06), s)
    u = jnp.broadcast_to(_f(0.000198527617612853646278381), s.shape)
    for c in (0.00139304355252534151077271, 0.00833336077630519866943359, 0.0416664853692054748535156,
              0.166666671633720397949219, 0.5):
        u = fma(u, s, _f(c))
    u = _R(1.0 + fma(_R(s * s), u, s))
    u = _R(u * _pow2(q))  # vldexp2
    return jnp.where(d < -104.0, 0.0, jnp.where(d > 100.0, jnp.inf, u))


def sigmoid(x):
    """ATen's vectorized fp32 sigmoid: 1 / (1 + exp(0 − x))."""
    return _R(1.0 / _R(1.0 + exp(_R(0.0 - x))))


def sum_seq(x, axis):
    """Left-to-right fp32 sum over a (short) `axis` from 0: ATen's sum over 4 terms."""
    x = jnp.moveaxis(x, axis, 0)
    acc = x[0]
    for i in range(1, x.shape[0]):
        acc = _R(acc + x[i])
    return acc


def softmax_last(z):
    """``F.softmax(z, -1)`` (ATen's last-dim kernel): e = exp(z − max); e · (1 / Σ e), Σ in order."""
    e = exp(_R(z - jnp.max(z, axis=-1, keepdims=True)))
    return _R(e * _R(1.0 / sum_seq(e, -1))[..., None])


def row_sum(x):
    """ATen's fp32 inner sum over the last axis K (module doc). K a multiple of 32 and at most 512 (ATen adds a
    cascade level beyond 16 rows of 4 vectors; not rendered)."""
    K = x.shape[-1]
    if K % (LANES * ILP) or K > 512:
        raise NotImplementedError(f"torch-order sum over {K}: only multiples of {LANES * ILP} up to 512 are rendered")
    v = x.reshape(x.shape[:-1] + (K // (LANES * ILP), ILP, LANES))
    acc = v[..., 0, :, :]
    for i in range(1, v.shape[-3]):
        acc = _R(acc + v[..., i, :, :])  # [.., ILP, LANES]
    p = sum_seq(acc, -2)  # the 4 accumulators, 0 + 1 + 2 + 3
    return sum_seq(p, -1)  # the 8 lanes


def rsqrt(x):
    """``torch.rsqrt`` on CPU: 1 / sqrt(x), each rounded."""
    return _R(1.0 / _R(jnp.sqrt(x)))


def linear(x, w):
    """MKL's fp32 ``F.linear(x, w)``: x [.., K], w [N, K] (fp32 values in fp64) -> [.., N] (module doc). A 4-wide
    output (``hc_head``'s projection) is another MKL kernel: 4 accumulators over k mod 4, products and sums rounded
    apart (no FMA), added (a0 + a2) + (a1 + a3)."""
    K = x.shape[-1]
    xk = jnp.moveaxis(x, -1, 0)  # [K, ..]
    zeros = jnp.zeros(x.shape[:-1] + (w.shape[0],), _F64)
    if w.shape[0] == 4:
        if K % 4:
            raise NotImplementedError(f"torch-order 4-wide linear over K = {K}: only multiples of 4 are rendered")

        def lane(j):
            return jax.lax.fori_loop(0, K // 4, lambda i, a: _R(a + _R(xk[4 * i + j][..., None] * w[:, 4 * i + j])),
                                     zeros)
        a = [lane(j) for j in range(4)]
        return _R(_R(a[0] + a[2]) + _R(a[1] + a[3]))
    out = None
    for k0 in range(0, K, MKL_KC):
        def body(k, acc, k0=k0):
            return fma(xk[k0 + k][..., None], w[:, k0 + k], acc)
        part = jax.lax.fori_loop(0, min(MKL_KC, K - k0), body, zeros)
        out = part if out is None else _R(out + part)
    return out


def hc_mixes(h, fn, base, scale, *, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """`mhc.hc_mixes` (same arguments and results: pre [.., n], post [.., n], comb [.., n, n], fp32) as the
    release's ``Block.hc_pre`` + kernel.py's ``hc_split_sinkhorn`` compute them under torch on CPU."""
    n, d = h.shape[-2:]
    with x64_scope():
        x = h.reshape(h.shape[:-2] + (n * d,)).astype(jnp.float32).astype(_F64)
        ms = _R(row_sum(_R(x * x)) / (n * d))
        r = rsqrt(_R(ms + _f(norm_eps)))
        m = _R(linear(x, fn.astype(jnp.float32).astype(_F64)) * r[..., None])
        sc = scale.astype(jnp.float32).astype(_F64)
        b = base.astype(jnp.float32).astype(_F64)
        eps = _f(hc_eps)
        pre = _R(sigmoid(_R(_R(m[..., :n] * sc[0]) + b[:n])) + eps)
        post = _R(2.0 * sigmoid(_R(_R(m[..., n:2 * n] * sc[1]) + b[n:2 * n])))
        c = _R(_R(m[..., 2 * n:] * sc[2]) + b[2 * n:]).reshape(h.shape[:-2] + (n, n))
        c = _R(softmax_last(c) + eps)
        c = _R(c / _R(sum_seq(c, -2)[..., None, :] + eps))
        for _ in range(sinkhorn_iters - 1):
            c = _R(c / _R(sum_seq(c, -1)[..., :, None] + eps))
            c = _R(c / _R(sum_seq(c, -2)[..., None, :] + eps))
        return pre.astype(jnp.float32), post.astype(jnp.float32), c.astype(jnp.float32)


def hc_pre(h, pre, dt):
    """`mhc.hc_pre` as the release's ``torch.sum(pre.unsqueeze(-1) * x, dim=2)``: each product rounded, summed over
    the streams from 0 in order (no FMA), rounded to `dt`."""
    with x64_scope():
        p = _R(pre.astype(jnp.float32).astype(_F64)[..., :, None] * h.astype(jnp.float32).astype(_F64))
        return sum_seq(p, -2).astype(jnp.float32).astype(dt)


def hc_post(y, h, post, comb, dt):
    """`mhc.hc_post` as the release's ``post · y + torch.sum(comb · residual, dim=2)``: every product and sum its
    own fp32 rounding (no FMA), the streams summed in order, rounded to `dt`."""
    with x64_scope():
        f = lambda a: a.astype(jnp.float32).astype(_F64)  # noqa: E731
        res = sum_seq(_R(f(comb)[..., :, :, None] * f(h)[..., :, None, :]), -3)  # [.., n_j, D]
        return _R(_R(f(post)[..., :, None] * f(y)[..., None, :]) + res).astype(jnp.float32).astype(dt)


# glibc's sinf / cosf (Arm optimized-routines' sincosf, evaluated in fp64): what ``torch.polar`` calls per entry
# of the release's rotary table (``precompute_freqs_cis``). Angles |x| >= 120 take glibc's large-argument
# reduction, not rendered: there the table is the correctly rounded cos / sin (glibc differs in ~1 % of entries).
_HPI_INV, _HPI = float.fromhex("0x1.45F306DC9C883p+23"), float.fromhex("0x1.921FB54442D18p0")
_COS = tuple(float.fromhex(v) for v in ("0x1p0", "-0x1.ffffffd0c621cp-2", "0x1.55553e1068f19p-5",
                                          "-0x1.6c087e89a359dp-10", "0x1.99343027bf8c3p-16"))
_SIN = tuple(float.fromhex(v) for v in ("-0x1.555545995a603p-3", "0x1.1107605230bc4p-7", "-0x1.994eb3774cf24p-13"))


def _sincos_poly(x, x2, n, neg):
    """glibc's ``sinf_poly``: the sine polynomial for even quadrants `n`, the cosine one (negated where `neg`)
    for odd ones; fp64."""
    s = x + x * x2 * _SIN[0] + (x * x2 * x2) * (_SIN[1] + x2 * _SIN[2])
    c = [jnp.where(neg, -v, v) for v in _COS]
    x4 = x2 * x2
    cc = (c[0] + x2 * c[1]) + x4 * c[2] + (x4 * x2) * (c[3] + x2 * c[4])
    return jnp.where(n % 2 == 1, cc, s)


def _sin_cos(angle):
    """(sin, cos) of fp32 angles as glibc's sinf / cosf (fp32 values in fp64)."""
    y = angle.astype(jnp.float32)
    x = y.astype(_F64)
    ay = jnp.abs(y)
    n = (jnp.trunc(x * _HPI_INV).astype(jnp.int32) + 0x800000) >> 24
    xr = x - n.astype(_F64) * _HPI
    sign = jnp.where((n % 4 == 1) | (n % 4 == 2), -1.0, 1.0)
    neg = (n & 2) != 0
    big_s = _sincos_poly(xr * sign, xr * xr, n, neg)
    big_c = _sincos_poly(xr * sign, xr * xr, n ^ 1, neg)
    small = ay < jnp.float32(float.fromhex("0x1.921FB6p-1"))
    tiny = ay < jnp.float32(2.0 ** -12)
    zero = jnp.zeros_like(n)
    sm_s = jnp.where(tiny, x, _sincos_poly(x, x * x, zero, False))
    sm_c = jnp.where(tiny, 1.0, _sincos_poly(x, x * x, zero + 1, False))
    s = jnp.where(small, sm_s, big_s)
    c = jnp.where(small, sm_c, big_c)
    far = ay >= 120.0
    s, c = jnp.where(far, jnp.sin(x), s), jnp.where(far, jnp.cos(x), c)
    return _R(s), _R(c)


def apply_rope(x, positions, freqs, inverse: bool = False, out_dtype=None):
    """`rope.apply_rope` (same arguments) as the release's ``apply_rotary_emb``: the table from glibc's sin / cos of
    fp32(pos) · f, the pairs multiplied as ATen's complex64 product — (a·c − b·d, a·d + b·c), each product and sum
    its own rounding (no FMA); the conjugate for `inverse` — and written back in `out_dtype`."""
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    half = int(jnp.shape(freqs)[-1])
    rd, hd = 2 * half, x.shape[-1]
    lead = x.shape[:-1]
    with x64_scope():
        pos = jnp.broadcast_to(jnp.asarray(positions), lead).astype(jnp.float32)
        angle = pos[..., None] * jnp.asarray(freqs, jnp.float32)  # fp32, as torch.outer
        s, c = _sin_cos(angle)
        if inverse:
            s = -s
        tail = x[..., hd - rd:].astype(jnp.float32).astype(_F64).reshape(*lead, half, 2)
        a, b = tail[..., 0], tail[..., 1]
        re = _R(_R(a * c) - _R(b * s))
        im = _R(_R(a * s) + _R(b * c))
        rot = jnp.stack([re, im], -1).reshape(*lead, rd).astype(jnp.float32).astype(out_dtype)
    return jnp.concatenate([x[..., :hd - rd].astype(out_dtype), rot], axis=-1) if rd < hd else rot


def rope_fn(cfg):
    """The RoPE of `cfg`'s order: `apply_rope` with ``release_order`` "torch_cpu", else `rope.apply_rope`."""
    return apply_rope if cfg.release_order == "torch_cpu" else rope41.apply_rope


def exact_level(cfg):
    """The ``exact`` level of `attention.attend` and `indexer.index_scores`: with ``release_order`` "torch_cpu" the
    deterministic one (every sum exact, exps correctly rounded, each fp32 / bf16 step rounded where the release
    rounds) — what research/v4_release_forward.py's rendering of the release's ``sparse_attn`` kernel computes too (a
    GPU kernel's fp32 order is neither side's), and what torch's bf16 index scores come to (their fp32 sums of
    FP4-valued products are exact); XLA:CPU otherwise hands the index scores to a library fusion ("ynn_fusion") that
    skips a bf16 step rounding (785 of layer 2's scores moved) — else `numerics.is_exact`."""
    return DETERMINISTIC if cfg.release_order == "torch_cpu" else is_exact(cfg)


def rmsnorm(x, weight, eps, dt, exact=0):
    """`norm.rmsnorm` (same arguments; `exact` unused) as the release's ``RMSNorm``: x fp32, var = ATen's mean of
    x² (`row_sum` / d), x · (1 / sqrt(var + eps)), then weight · x, each step rounded; -> `dt`."""
    with x64_scope():
        xd = x.astype(jnp.float32).astype(_F64)
        ms = _R(row_sum(_R(xd * xd)) / x.shape[-1])
        rs = rsqrt(_R(ms + _f(eps)))
        return _R(weight.astype(jnp.float32).astype(_F64) * _R(xd * rs[..., None])).astype(jnp.float32).astype(dt)


def norm_fn(cfg):
    """The RMSNorm of `cfg`'s order: `rmsnorm` with ``release_order`` "torch_cpu", else `norm.rmsnorm`."""
    return rmsnorm if cfg.release_order == "torch_cpu" else norm41.rmsnorm


def head_collapse(h, fn, base, scale, cfg, dt):
    """`v4.mhc.head_collapse` (same arguments) as the release's ``ParallelHead.hc_head`` under torch on CPU."""
    n, d = h.shape[-2:]
    with x64_scope():
        x = h.reshape(h.shape[:-2] + (n * d,)).astype(jnp.float32).astype(_F64)
        r = rsqrt(_R(_R(row_sum(_R(x * x)) / (n * d)) + _f(cfg.rms_norm_eps)))
        m = _R(linear(x, fn.astype(jnp.float32).astype(_F64)) * r[..., None])
        f = lambda a: a.astype(jnp.float32).astype(_F64)  # noqa: E731
        pre = _R(sigmoid(_R(_R(m * f(scale)[0]) + f(base))) + _f(cfg.hc_eps))
        return hc_pre(h, pre.astype(jnp.float32), dt)
