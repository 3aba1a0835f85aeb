"""Number formats and quantized matmuls of DeepSeek-V4.1 Flash (docs/design/spec.md §6, §1 "Numerics", §3, §4).

Everything here is plain ``jax.numpy`` / ``jax.lax``: pure, jittable, shape-static. Pallas kernels may
replace the GEMMs for speed, but these functions are the numerical reference they must match.
The public functions are wrapped in ``jax.jit`` (block sizes and dtypes static): inside a caller's jit
they simply inline, and called eagerly they compile once per shape instead of dispatching ~40 tiny
ops one by one (seconds of per-op compilation on CPU).

Formats
-------
* ``FP8``  = float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; finite range ±448, smallest
  subnormal 2^-9, no infinities (0x7f / 0xff are NaN).
* ``E8M0`` = float8_e8m0fnu: a bare biased exponent byte e, value 2^(e-127); e = 255 is NaN. All block
  scales in the checkpoint are stored this way (``scale_fmt ue8m0``).
* e2m1 (MXFP4 element, fake-quant grid): ±{0, .5, 1, 1.5, 2, 3, 4, 6}; magnitude codes 0..7 in that
  order, sign in bit 3. Two values per byte, LOW nibble = EVEN element.

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
import numpy as np

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
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu

# e2m1 magnitudes indexed by their 3-bit code (standard OCP MX encoding).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decode table for a full 4-bit code: bit 3 is the sign. Code 8 decodes to -0.0 so that
# unpack -> pack round-trips every byte.
_FP4_LUT = np.array(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=np.float32)

# Activation-quant amax floor (docs/design/spec.md §6: "amax >= 1e-4").
_ACT_AMAX_FLOOR = 1e-4
# Floors for the fp4 fake-quants (docs/design/spec.md §6): they make the smallest scale 2^-126 (pow2 variant) and
# 2^-9, the smallest positive e4m3 value (e4m3-scale variant).
_FP4_POW2_AMAX_FLOOR = 6.0 * 2.0**-126
_FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
# Floors for checkpoint-building quantizers (not in the reference, which never sees all-zero
# blocks): chosen so amax/qmax is the smallest normal fp32 (2^-126), which keeps the bit-level
# ceil-log2 exact and the scale a valid E8M0 value.
_W_FP8_AMAX_FLOOR = E4M3_MAX * 2.0**-126
_W_FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126

_HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# Scalar-format helpers
# ---------------------------------------------------------------------------------------------


def _f32_exponent(a):
    """Unbiased exponent field of fp32 ``a`` (int32, same shape): floor(log2|a|) for normal ``a``;
    -127 for zero and subnormals."""
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    return ((bits >> 23) & 0xFF) - 127


def _ceil_log2(v):
    """Exact ceil(log2(v)) (int32) for positive *normal* fp32 ``v``, from the bit pattern:
    the exponent field, plus one unless the mantissa is zero (v an exact power of two)."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    return exp + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def _exp2_int(e):
    """2^e as fp32 for int32 ``e`` in [-126, 127], exact (built from the exponent field)."""
    e = e.astype(jnp.int32)
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _e8m0_from_exponent(e):
    """E8M0 array holding 2^e for int32 ``e`` in [-127, 127]."""
    return jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)


@jax.jit
def e8m0_to_f32(s):
    """Decode E8M0 scales to fp32.

    Args:
      s: float8_e8m0fnu array, or uint8 array of raw exponent bytes e (any shape).
    Returns:
      float32 array, same shape: 2^(e-127); byte 0 gives 2^-127 (an fp32 subnormal), byte 255 NaN.

    Done on the bit pattern so it does not depend on how a backend lowers an e8m0 -> f32 convert.
    """
    s = jnp.asarray(s)
    if s.dtype == jnp.uint8:
        byte = s
    elif s.dtype == E8M0:
        byte = jax.lax.bitcast_convert_type(s, jnp.uint8)
    else:
        raise TypeError(f"e8m0_to_f32 expects float8_e8m0fnu or uint8 exponent bytes, got {s.dtype}")
    e = byte.astype(jnp.int32)
    bits = jnp.where(
        e == 0,
        jnp.int32(0x00400000),  # 2^-127: exponent field 0, mantissa MSB set (subnormal)
        jnp.where(e == 255, jnp.int32(0x7FC00000), e << 23),  # NaN / 2^(e-127)
    )
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@jax.jit
def pow2_scale_to_e8m0(s_f32):
    """Encode positive power-of-two fp32 scales as E8M0 (exact for 2^-127 .. 2^127).

    Args:
      s_f32: float array (any shape) of powers of two.
    Returns:
      float8_e8m0fnu array, same shape.

    A non-power-of-two input is truncated to the power of two at or below it (the exponent field is
    kept, the mantissa dropped). Note XLA's own f32 -> e8m0 ``astype`` rounds differently from
    ml_dtypes (e.g. 3.0 -> 2 in XLA, 4 in ml_dtypes), which is why this is done on the bits.
    """
    s = jnp.asarray(s_f32).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    field = (bits >> 23) & 0xFF
    # 2^-127 is the fp32 subnormal 0x00400000: exponent field 0 maps to byte 0 as well.
    return jax.lax.bitcast_convert_type(field.astype(jnp.uint8), E8M0)


@jax.jit
def round_e4m3(y):
    """Round fp32 ``y`` to the float8_e4m3fn grid, round-to-nearest-even, result kept in fp32.

    Args:
      y: float32 array, any shape, already clamped to [-448, 448] (values beyond round like an
        unbounded e4m3 and are not saturated here).
    Returns:
      float32 array, same shape, every value exactly representable in e4m3fn.

    The quantum of e4m3 at |y| is 2^(floor(log2|y|) - 3) for normal values and 2^-9 below 2^-6
    (subnormals share the min-normal quantum), so RNE is ``round_half_even(|y|/q) * q``, which is
    exact in fp32 because q is a power of two.
    """
    y = y.astype(jnp.float32)
    a = jnp.abs(y)
    e = jnp.maximum(_f32_exponent(a), -6)
    q = _exp2_int(e - 3)
    r = jax.lax.round(a / q, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * q
    return jnp.copysign(r, y)


@jax.jit
def round_e2m1(x_f32):
    """Round to the e2m1 grid ±{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code.

    Args:
      x_f32: float32 array, any shape, already clamped to [-6, 6].
    Returns:
      float32 array, same shape, on the grid (sign kept, so small negatives give -0.0).

    Ties go to the value whose 3-bit magnitude code is even, as docs/design/spec.md §6 lists: 0.25->0, 0.75->1,
    1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in
    [4, 6]; in each band an even multiple of the spacing is an even code, so RNE of |x|/spacing
    (exact: the spacing is a power of two) times the spacing is exactly the spec rule. At the band
    edges (2, 4) both candidate spacings agree because the edges are even codes.
    """
    x = x_f32.astype(jnp.float32)
    a = jnp.abs(x)
    q = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    r = jax.lax.round(a / q, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * q
    return jnp.copysign(r, x)


# ---------------------------------------------------------------------------------------------
# FP4 packing
# ---------------------------------------------------------------------------------------------


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
    v = jnp.asarray(v_f32).astype(jnp.float32)
    if v.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {v.shape}")
    a = jnp.abs(v)
    mag = jnp.zeros(v.shape, jnp.uint8)
    for g in E2M1_GRID[1:]:  # code = number of nonzero grid values <= |v|
        mag = mag + (a >= g).astype(jnp.uint8)
    code = mag | (jnp.signbit(v).astype(jnp.uint8) << 3)
    code = code.reshape(*v.shape[:-1], v.shape[-1] // 2, 2)
    return code[..., 0] | (code[..., 1] << 4)


@jax.jit
def unpack_fp4(packed):
    """Unpack MXFP4 bytes to float32 grid values.

    Args:
      packed: uint8 [..., K/2] (low nibble = even element).
    Returns:
      float32 [..., K].
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"unpack_fp4 expects uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return jnp.asarray(_FP4_LUT)[codes.astype(jnp.int32)]


# ---------------------------------------------------------------------------------------------
# Weight formats (checkpoint)
# ---------------------------------------------------------------------------------------------


def _cdiv(a, b):
    return -(-a // b)


@functools.partial(jax.jit, static_argnames=('block',))
def quantize_fp8_block(w, block=32):
    """Quantize a float weight to fp8 e4m3 with one power-of-two scale per block x block tile.

    Used to build checkpoints / test weights from float weights (the reference ships them already
    quantized), so it follows the same rule as the activation quant.

    Args:
      w: float array [out, in] (any float dtype; math in fp32). out/in need not be multiples of block.
      block: tile edge (32 in the checkpoint).
    Returns:
      (w_e4m3 float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/block), ceil(in/block)]) with
      w ~= w_e4m3 * scale (broadcast per tile). Per tile s = 2^ceil(log2(amax/448)) (amax over the real,
      unpadded elements, floored at 448*2^-126 so all-zero tiles get a valid scale), then
      e4m3 RNE of clamp(w/s, +-448).
    """
    w = jnp.asarray(w).astype(jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block expects [out, in], got {w.shape}")
    out_f, in_f = w.shape
    ob, ib = _cdiv(out_f, block), _cdiv(in_f, block)
    # Zero padding never raises a tile's amax, so padded tiles quantize like the real ones.
    wp = jnp.pad(w, ((0, ob * block - out_f), (0, ib * block - in_f)))
    t = wp.reshape(ob, block, ib, block)
    amax = jnp.max(jnp.abs(t), axis=(1, 3))
    amax = jnp.maximum(amax, _W_FP8_AMAX_FLOOR)
    e = jnp.clip(_ceil_log2(amax / E4M3_MAX), -126, 127)
    s = _exp2_int(e)
    y = jnp.clip(t / s[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    q = round_e4m3(y).reshape(ob * block, ib * block)[:out_f, :in_f]
    return q.astype(FP8), _e8m0_from_exponent(e)


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
    """Quantize a float weight to MXFP4 (e2m1 values, one power-of-two scale per 32 along ``in``).

    Args:
      w: float array [out, in], in % block == 0 (math in fp32).
    Returns:
      (packed uint8 [out, in/2], scale float8_e8m0fnu [out, in/block]). Per group
      s = 2^ceil(log2(amax/6)) (amax floored at 6*2^-126 so all-zero groups work), values
      round_e2m1(clamp(w/s, +-6)).
    """
    w = jnp.asarray(w).astype(jnp.float32)
    if w.ndim != 2 or w.shape[1] % block:
        raise ValueError(f"quantize_mxfp4 expects [out, in] with in % {block} == 0, got {w.shape}")
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), _W_FP4_AMAX_FLOOR)
    e = jnp.clip(_ceil_log2(amax / E2M1_MAX), -126, 127)
    s = _exp2_int(e)
    v = round_e2m1(jnp.clip(g / s[..., None], -E2M1_MAX, E2M1_MAX)).reshape(out_f, in_f)
    return pack_fp4(v), _e8m0_from_exponent(e)


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
    """docs/design/spec.md §6 fp8 activation quant (every fp8/MXFP4 GEMM input, and the window-KV fake-quant).

    Args:
      x: float array [..., K] (any float dtype; computed in fp32), K % block == 0.
    Returns:
      (xq float8_e4m3fn [..., K], s float32 [..., K/block]) with x ~= xq * s per block:
      amax = max(max|x_block|, 1e-4), s = 2^ceil(log2(amax/448)) (amax/448 rounded in fp32 first,
      then an exact ceil-log2), xq = e4m3 RNE of clamp(x/s, +-448). x/s is exact (s is a power of two).
    """
    xb = _blocks(x, block, "act_quant_fp8")
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _ACT_AMAX_FLOOR)
    # amax >= 1e-4 keeps amax/448 a normal fp32, and amax is at most ~3.4e38 so e <= 120.
    s = _exp2_int(_ceil_log2(amax / E4M3_MAX))
    y = jnp.clip(xb / s[..., None], -E4M3_MAX, E4M3_MAX)
    xq = round_e4m3(y).astype(FP8).reshape(x.shape)  # exact: already on the e4m3 grid
    return xq, s


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
