"""Number formats and quantized matmuls of DeepSeek-V4.1 Flash (docs/design/spec.md §6, §1 "Numerics", §3, §4).

Everything here is plain ``jax.numpy`` / ``jax.lax``: pure, jittable, shape-static. Pallas kernels may
replace the GEMMs for speed, but these functions are the numerical reference they must match.
The public functions are wrapped in ``jax.jit`` (block sizes and dtypes static): inside a caller's jit
they simply inline, and called eagerly they compile once per shape instead of dispatching ~40 tiny
ops one by one (seconds of per-op compilation on CPU).

Formats: the byte codes (e4m3 = ``FP8``, e8m0 = ``E8M0``, e2m1), their one NaN rule and the
checkpoint weight quantizers are defined in `codec` over an array namespace; this module holds their
jitted jnp forms and applies them (activation quant, fake-quants, GEMMs, cache codes). `quant_np`
runs the same definitions on the host.

Rounding is done by explicit fp32 arithmetic rather than by XLA's narrowing ``convert``:

* The result is then independent of the backend's f32 -> f8 lowering (some lower it through f16,
  which rounds twice and is not round-to-nearest-even; out-of-range values become NaN rather than
  saturate). Every value we finally ``astype`` to FP8 is already exactly on the e4m3 grid, so that
  cast is exact everywhere.
* Power-of-two scales use an exact ceil(log2(.)) from the fp32 bit pattern (as the reference's
  ``fast_log2_ceil`` does) instead of ``jnp.log2``, whose result for exact powers of two is not
  guaranteed to be an integer on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import codec
from dsv41_jax.model.codec import E2M1_GRID, E2M1_MAX, E4M3_MAX, E8M0, FP8  # noqa: F401  (re-exported)

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "FP8",
    "E8M0",
    "E2M1_GRID",
    "e8m0_to_f32",
    "pow2_scale_to_e8m0",
    "round_e4m3",
    "round_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "quantize_fp8_block",
    "dequantize_fp8_block",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "act_quant_fp8",
    "fake_quant_fp8",
    "fake_quant_fp4_pow2",
    "fake_quant_fp4_e4m3",
    "fp8_linear",
    "mxfp4_linear",
    "hadamard",
]

# Floors for the fp4 fake-quants (docs/design/spec.md §6): they make the smallest scale 2^-126 (pow2 variant) and
# 2^-9, the smallest positive e4m3 value (e4m3-scale variant).
_FP4_POW2_AMAX_FLOOR = 6.0 * 2.0**-126
_FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9

_HIGHEST = jax.lax.Precision.HIGHEST


def _ceil_log2(v):
    return codec.ceil_log2(v, jnp)


def _exp2_int(e):
    return codec.exp2_int(e, jnp)


# ---------------------------------------------------------------------------------------------
# Scalar formats (jnp forms of `codec`)
# ---------------------------------------------------------------------------------------------


@jax.jit
def e8m0_to_f32(s):
    """Decode E8M0 scales to fp32 (`codec.e8m0_decode`).

    Args:
      s: float8_e8m0fnu array, or uint8 array of raw exponent bytes e (any shape).
    Returns:
      float32 array, same shape: 2^(e-127); byte 0 gives 2^-127 (an fp32 subnormal), byte 255 NaN.

    Done on the bit pattern so it does not depend on how a backend lowers an e8m0 -> f32 convert.
    """
    s = jnp.asarray(s)
    if s.dtype == E8M0:
        s = jax.lax.bitcast_convert_type(s, jnp.uint8)
    elif s.dtype != jnp.uint8:
        raise TypeError(f"e8m0_to_f32 expects float8_e8m0fnu or uint8 exponent bytes, got {s.dtype}")
    return codec.e8m0_decode(s, jnp)


@jax.jit
def pow2_scale_to_e8m0(s_f32):
    """Encode positive power-of-two fp32 scales (any shape) as float8_e8m0fnu (`codec.e8m0_encode_pow2`)."""
    return codec.bitcast(codec.e8m0_encode_pow2(jnp.asarray(s_f32), jnp), E8M0, jnp)


@jax.jit
def round_e4m3(y):
    """`codec.round_e4m3`: fp32 [any] (clamped to ±448) -> fp32 on the e4m3 grid, round-to-nearest-even."""
    return codec.round_e4m3(y, jnp)


@jax.jit
def round_e2m1(x_f32):
    """`codec.round_e2m1`: fp32 [any] (clamped to ±6) -> fp32 on the e2m1 grid, ties to the even code."""
    return codec.round_e2m1(x_f32, jnp)


@jax.jit
def pack_fp4(v_f32):
    """Pack e2m1 grid values two per byte.

    Args:
      v_f32: float array [..., K], K even, every value on ±{0, .5, 1, 1.5, 2, 3, 4, 6} (off-grid values
        get the code of the largest grid magnitude <= |v|; round first with ``round_e2m1``).
    Returns:
      uint8 [..., K/2]: byte i = code(v[2i]) | code(v[2i+1]) << 4 (LOW nibble = EVEN element, as the
      checkpoint stores it). code = sign bit 3 | magnitude code 0..7. -0.0 keeps its sign bit.
    """
    return codec.pack_fp4(jnp.asarray(v_f32), jnp)


@jax.jit
def unpack_fp4(packed):
    """Unpack MXFP4 bytes to float32 grid values (bit arithmetic, `codec.e2m1_decode`).

    Args:
      packed: uint8 [..., K/2] (low nibble = even element).
    Returns:
      float32 [..., K].
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    return codec.e2m1_decode(codec.unpack_nibbles(packed, jnp), jnp)


# ---------------------------------------------------------------------------------------------
# Weight formats (checkpoint)
# ---------------------------------------------------------------------------------------------


def _cdiv(a, b):
    return -(-a // b)


@functools.partial(jax.jit, static_argnames=('block',))
def quantize_fp8_block(w, block=32):
    """Quantize a float weight [out, in] to fp8 e4m3 with one power-of-two scale per block x block
    tile (`codec.fp8_block_codes`). Used to build checkpoints / test weights from float weights (the
    reference ships them already quantized), so it follows the same rule as the activation quant."""
    return codec.fp8_block_codes(w, jnp, block)


def _expand_block_scale(s, rows, cols, block):
    """[ceil(rows/b), ceil(cols/b)] fp32 tile scales -> [rows, cols] per-element scales."""
    s = jnp.repeat(jnp.repeat(s, block, axis=0), block, axis=1)
    return s[:rows, :cols]


@functools.partial(jax.jit, static_argnames=('out_dtype', 'block'))
def dequantize_fp8_block(w_e4m3, scale, out_dtype=jnp.float32, block=32):
    """Exact dequantization of a 32x32-block fp8 weight.

    Args:
      w_e4m3: float8_e4m3fn [out, in].
      scale: float8_e8m0fnu (or uint8 exponent bytes) [ceil(out/block), ceil(in/block)].
      out_dtype: result dtype. The product e4m3 * 2^k has 4 significant bits, so it is exact in
        fp32 and also in bf16 (barring bf16 subnormal underflow, which real scales never reach).
    Returns:
      out_dtype [out, in].
    """
    out_f, in_f = w_e4m3.shape
    s = e8m0_to_f32(scale)
    if s.shape != (_cdiv(out_f, block), _cdiv(in_f, block)):
        raise ValueError(f"scale shape {s.shape} does not match weight {w_e4m3.shape} / block {block}")
    w = w_e4m3.astype(jnp.float32) * _expand_block_scale(s, out_f, in_f, block)
    return w.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=('block',))
def quantize_mxfp4(w, block=32):
    """Quantize a float weight [out, in] to MXFP4 (e2m1 values, one power-of-two scale per 32 along
    ``in``; `codec.mxfp4_codes`): (packed uint8 [out, in/2], scale float8_e8m0fnu [out, in/block])."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_mxfp4 expects [out, in], got {w.shape}")
    return codec.mxfp4_codes(w, jnp, block)


@functools.partial(jax.jit, static_argnames=('out_dtype', 'block'))
def dequantize_mxfp4(packed, scale, out_dtype=jnp.float32, block=32):
    """Exact dequantization of an MXFP4 weight.

    Args:
      packed: uint8 [out, in/2] (low nibble = even element); or a float [out, in] weight taken as the
        element values themselves (training master weights).
      scale: float8_e8m0fnu (or uint8 exponent bytes) [out, in/block].
      out_dtype: result dtype (e2m1 * 2^k is exact in fp32 and bf16).
    Returns:
      out_dtype [out, in].
    """
    # A float `packed` is an already unpacked weight [out, in] (the fp32 master weights that
    # scripts/train_nano.py differentiates, with unit scales); uint8 is the stored format.
    v = packed.astype(jnp.float32) if jnp.issubdtype(packed.dtype, jnp.floating) else unpack_fp4(packed)
    s = e8m0_to_f32(scale)
    if s.shape != (v.shape[0], v.shape[1] // block):
        raise ValueError(f"scale shape {s.shape} does not match MXFP4 weight {v.shape} / block {block}")
    return (v * jnp.repeat(s, block, axis=1)).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Activation quant and fake-quants
# ---------------------------------------------------------------------------------------------


def _blocks(x, block, name):
    """fp32 view [..., K/block, block] of x [..., K]."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"{name}: last dimension {k} is not a multiple of block {block}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], k // block, block)


def _straight_through(fake_quant):
    """``fake_quant(x, block, out_dtype)`` with the straight-through estimator as its derivative.

    The forward is `fake_quant`'s, bit for bit. Its true derivative is zero almost everywhere
    (rounding), and the cast through float8 would also round the cotangent itself to e4m3; the
    straight-through estimator takes d out / d x = identity instead, so `jax.grad` through the model's
    fake-quantized activations reaches the weights before them (quantization-aware training,
    scripts/train_nano.py). Nothing in inference differentiates, so inference is unchanged.
    """
    f = jax.custom_jvp(fake_quant, nondiff_argnums=(1, 2))

    @f.defjvp
    def _jvp(block, out_dtype, primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x, block, out_dtype), t.astype(out_dtype)

    return f


@functools.partial(jax.jit, static_argnames=('block',))
def act_quant_fp8(x, block=32):
    """docs/design/spec.md §6 fp8 activation quant (every fp8/MXFP4 GEMM input, and the window-KV fake-quant):
    the jnp form of `codec.fp8_act_codes`, the one definition.

    Args:
      x: float array [..., K] (any float dtype; computed in fp32), K % block == 0.
    Returns:
      (xq float8_e4m3fn [..., K], s float32 [..., K/block]) with x ~= xq * s per block:
      amax = max(max|x_block|, 1e-4), s = 2^ceil(log2(amax/448)) (amax/448 rounded in fp32 first,
      then an exact ceil-log2), xq = e4m3 RNE of clamp(x/s, +-448). x/s is exact (s is a power of two).
    """
    y, e = codec.fp8_act_codes(_blocks(x, block, "act_quant_fp8").reshape(x.shape), jnp, block)
    return y.astype(FP8).reshape(x.shape), _exp2_int(e)  # exact: y is already on the e4m3 grid


def _fake_quant_fp8(x, block=32, out_dtype=None):
    """fp8 e4m3 fake-quant with power-of-two per-block scales (window KV store, DSpark rings).

    Args:
      x: float array [..., K], K % block == 0.
      out_dtype: result dtype, default x.dtype.
    Returns:
      out_dtype [..., K]: act_quant_fp8(x) multiplied back in fp32 (exact), then cast (exact in bf16 too).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xq, s = act_quant_fp8(x, block)
    xb = xq.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return (xb * s[..., None]).reshape(x.shape).astype(out_dtype)


_fake_quant_fp8_ste = _straight_through(_fake_quant_fp8)


@functools.partial(jax.jit, static_argnames=('block', 'out_dtype'))
def fake_quant_fp8(x, block=32, out_dtype=None):
    """`_fake_quant_fp8` (see there) with a straight-through derivative (`_straight_through`)."""
    return _fake_quant_fp8_ste(x, block, x.dtype if out_dtype is None else out_dtype)


def _fake_quant_fp4_pow2(x, block=32, out_dtype=None):
    """fp4 (e2m1) fake-quant with power-of-two per-block scales (index q and k, docs/design/spec.md §4/§6).

    Args:
      x: float array [..., K], K % block == 0.
      out_dtype: result dtype, default x.dtype.
    Returns:
      out_dtype [..., K]: s = 2^ceil(log2(max(amax, 6*2^-126)/6)); round_e2m1(clamp(x/s, +-6)) * s,
      all in fp32, then one cast.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xb = _blocks(x, block, "fake_quant_fp4_pow2")
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _FP4_POW2_AMAX_FLOOR)
    # amax <= fp32 max gives e <= 126; the floor gives e >= -126, so 2^e is a normal fp32.
    s = _exp2_int(_ceil_log2(amax / E2M1_MAX))[..., None]
    v = round_e2m1(jnp.clip(xb / s, -E2M1_MAX, E2M1_MAX)) * s
    return v.reshape(x.shape).astype(out_dtype)


_fake_quant_fp4_pow2_ste = _straight_through(_fake_quant_fp4_pow2)


@functools.partial(jax.jit, static_argnames=('block', 'out_dtype'))
def fake_quant_fp4_pow2(x, block=32, out_dtype=None):
    """`_fake_quant_fp4_pow2` (see there) with a straight-through derivative (`_straight_through`)."""
    return _fake_quant_fp4_pow2_ste(x, block, x.dtype if out_dtype is None else out_dtype)


def _fake_quant_fp4_e4m3(x, block=16, out_dtype=None):
    """fp4 (e2m1) fake-quant with e4m3 per-block scales (compressed KV latents, docs/design/spec.md §3/§6).

    Args:
      x: float array [..., K], K % block == 0.
      out_dtype: result dtype, default x.dtype.
    Returns:
      out_dtype [..., K]: s = e4m3_RNE(max(amax, 6*2^-9)/6) (the scale itself on the e4m3 grid, >= 2^-9);
      round_e2m1(clamp(x/s, +-6)) * s in fp32, then one cast.

    x/s is a true fp32 division (s is generally not a power of two, so this is not the same as
    multiplying by 1/s). The product grid*s has at most 2+4 significant bits, exact in fp32 and bf16.
    The scale is saturated at 448 (amax > 2688): the reference's torch cast would give NaN at
    amax/6 >= 480; real normed latents never get near either.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xb = _blocks(x, block, "fake_quant_fp4_e4m3")
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _FP4_E4M3_AMAX_FLOOR)
    s = round_e4m3(jnp.minimum(amax / E2M1_MAX, E4M3_MAX))[..., None]
    v = round_e2m1(jnp.clip(xb / s, -E2M1_MAX, E2M1_MAX)) * s
    return v.reshape(x.shape).astype(out_dtype)


_fake_quant_fp4_e4m3_ste = _straight_through(_fake_quant_fp4_e4m3)


@functools.partial(jax.jit, static_argnames=('block', 'out_dtype'))
def fake_quant_fp4_e4m3(x, block=16, out_dtype=None):
    """`_fake_quant_fp4_e4m3` (see there) with a straight-through derivative (`_straight_through`)."""
    return _fake_quant_fp4_e4m3_ste(x, block, x.dtype if out_dtype is None else out_dtype)


@functools.partial(jax.jit, static_argnames=('out_dtype',))
def hadamard(x, out_dtype=None):
    """Normalized Walsh–Hadamard rotation along the last axis (DeepSeek-V4's index queries / keys before their FP4
    fake-quant, `fast_hadamard_transform.hadamard_transform(x, scale=d^-½)`).

    Args:
      x: float array [..., d], d a power of two.
      out_dtype: result dtype, default x.dtype.
    Returns:
      out_dtype [..., d]: x · H_d · d^-½ with H_d Sylvester's ±1 matrix (H_1 = [1], H_2k = [[H, H], [H, −H]],
      symmetric, H·H = d·I), computed in fp32 by log2(d) butterfly stages (a + b, a − b; stride 1 first), scaled
      once and rounded once. Orthonormal: applied to both operands it leaves their dot products unchanged.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: the last dimension {d} is not a power of two")
    y = x.astype(jnp.float32)
    lead = y.shape[:-1]
    h = 1
    while h < d:
        z = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = z[..., 0, :], z[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return (y * jnp.float32(d ** -0.5)).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Linear layers
# ---------------------------------------------------------------------------------------------


def _dot_nk(x, w, precision, preferred):
    """x [..., K] . w[N, K]^T -> [..., N]."""
    return jax.lax.dot_general(
        x,
        w,
        dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred,
    )


def _dequant_act(x, block=32):
    """act_quant_fp8 then exact dequant to fp32 [..., K]."""
    return fake_quant_fp8(x, block, out_dtype=jnp.float32)


@functools.partial(jax.jit, static_argnames=('out_dtype',))
def fp8_linear(x, w_e4m3, scale, out_dtype=jnp.bfloat16):
    """GEMM with a 32x32-block fp8 weight and fp8-quantized input (docs/design/spec.md §6).

    Args:
      x: float array [..., K] (any float dtype), K % 32 == 0.
      w_e4m3: float8_e4m3fn [N, K].
      scale: float8_e8m0fnu (or uint8 exponent bytes) [ceil(N/32), ceil(K/32)].
      out_dtype: result dtype (bf16 in the model).
    Returns:
      out_dtype [..., N].

    SPEC: y = sum over K-blocks b, in order, of fp32(xq_b . wq_b) * s_x[b] * s_w[n//32, b], rounded
    once to out_dtype. Here both operands are dequantized exactly first (xq*s_x and wq*s_w are e4m3
    times a power of two, exact in fp32), so every product xq*wq*s_x*s_w is the same real number and
    the fp32 HIGHEST-precision matmul differs from the spec only in fp32 summation order/grouping
    (an error of a few fp32 ulps of sum|terms|, far below the final bf16 rounding). HIGHEST stops
    GPUs from using TF32 for the fp32 dot. (The dequantized operands are also exact in bf16, so a bf16
    dot with fp32 accumulation would be equally faithful; this reference keeps fp32.)
    """
    xd = _dequant_act(x)
    wd = dequantize_fp8_block(w_e4m3, scale, jnp.float32)
    if xd.shape[-1] != wd.shape[1]:
        raise ValueError(f"fp8_linear: x last dim {xd.shape[-1]} != weight K {wd.shape[1]}")
    return _dot_nk(xd, wd, _HIGHEST, jnp.float32).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=('out_dtype',))
def mxfp4_linear(x, packed, scale, out_dtype=jnp.bfloat16):
    """GEMM with an MXFP4 weight (routed experts) and fp8-quantized input (docs/design/spec.md §6).

    Args:
      x: float array [..., K] (any float dtype), K % 32 == 0.
      packed: uint8 [N, K/2] (low nibble = even element).
      scale: float8_e8m0fnu (or uint8 exponent bytes) [N, K/32].
      out_dtype: result dtype (bf16 in the model).
    Returns:
      out_dtype [..., N].

    Same construction as ``fp8_linear``: exact dequantization of both operands, fp32 HIGHEST matmul,
    one final rounding; equal to the spec's per-32 partial-product sum up to fp32 summation order.
    """
    xd = _dequant_act(x)
    wd = dequantize_mxfp4(packed, scale, jnp.float32)
    if xd.shape[-1] != wd.shape[1]:
        raise ValueError(f"mxfp4_linear: x last dim {xd.shape[-1]} != weight K {wd.shape[1]}")
    return _dot_nk(xd, wd, _HIGHEST, jnp.float32).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# Packed storage of fake-quantized values (KV / index-key caches)
# ---------------------------------------------------------------------------------------------
# A cache stores the *codes* of a fake-quant, so that decoding them gives exactly the fake-quant's
# output: dequantize_fp4(*quantize_fp4_e4m3(x)) == fake_quant_fp4_e4m3(x, out_dtype=f32), bitwise.


@functools.partial(jax.jit, static_argnames=('block',))
def quantize_fp4_pow2(x, block=32):
    """Codes of `fake_quant_fp4_pow2`: (packed uint8 [..., K/2], scale E8M0 [..., K/block])."""
    xb = _blocks(x, block, "quantize_fp4_pow2")
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _FP4_POW2_AMAX_FLOOR)
    s = _exp2_int(_ceil_log2(amax / E2M1_MAX))
    v = round_e2m1(jnp.clip(xb / s[..., None], -E2M1_MAX, E2M1_MAX))
    return pack_fp4(v.reshape(x.shape)), pow2_scale_to_e8m0(s)


@functools.partial(jax.jit, static_argnames=('block',))
def quantize_fp4_e4m3(x, block=16):
    """Codes of `fake_quant_fp4_e4m3`: (packed uint8 [..., K/2], scale FP8 e4m3 [..., K/block])."""
    xb = _blocks(x, block, "quantize_fp4_e4m3")
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _FP4_E4M3_AMAX_FLOOR)
    s = round_e4m3(jnp.minimum(amax / E2M1_MAX, E4M3_MAX))
    v = round_e2m1(jnp.clip(xb / s[..., None], -E2M1_MAX, E2M1_MAX))
    return pack_fp4(v.reshape(x.shape)), s.astype(FP8)


@functools.partial(jax.jit, static_argnames=('block', 'out_dtype'))
def dequantize_fp4(packed, scale, block, out_dtype=jnp.float32):
    """packed uint8 [..., K/2] with per-`block` scales (E8M0 or e4m3) [..., K/block] -> [..., K]."""
    v = unpack_fp4(packed)
    s = e8m0_to_f32(scale) if scale.dtype in (jnp.uint8, E8M0) else scale.astype(jnp.float32)
    K = v.shape[-1]
    v = v.reshape(v.shape[:-1] + (K // block, block)) * s[..., None]
    return v.reshape(v.shape[:-2] + (K,)).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=('block', 'out_dtype'))
def dequantize_fp8_act(xq, s, block=32, out_dtype=jnp.float32):
    """Inverse of `act_quant_fp8`: e4m3 [..., K] with fp32 or E8M0 scales [..., K/block] -> [..., K]."""
    sf = e8m0_to_f32(s) if s.dtype in (jnp.uint8, E8M0) else s.astype(jnp.float32)
    K = xq.shape[-1]
    v = xq.astype(jnp.float32).reshape(xq.shape[:-1] + (K // block, block)) * sf[..., None]
    return v.reshape(xq.shape).astype(out_dtype)
