"""The checkpoint's number codes, defined once: e4m3 (FP8), e8m0 (scales) and e2m1 (MXFP4) (docs/design/spec.md §6).

Every function here is written once over an array namespace ``xp`` (``numpy`` or ``jax.numpy``) with
integer shifts / masks, ``where`` and one bit cast, so the same definition serves as

* the **jnp** form (``xp=jnp``: `quant` wraps it in ``jax.jit``; it fuses, no table gathers),
* the **in-kernel** form (``xp=jnp`` on int32 values loaded from a Pallas ref: only ops that Triton
  and the interpreter both lower; fp8 dtypes never reach a kernel, codes enter as raw bytes),
* the **numpy** form (``xp=np``; the host decoders below are lookup tables *built by* the same
  definition, so a checkpoint dequantized on the host equals the device's bit for bit).

Formats (bytes as the safetensors checkpoint stores them)
--------------------------------------------------------
* e4m3 = float8_e4m3fn, byte ``s eeee mmm``: 1 sign, 4 exponent (bias 7), 3 mantissa bits;
  e = 0 is subnormal m·2^-9; finite range ±448; no infinities.
* e8m0 = float8_e8m0fnu, byte e: 2^(e−127) (byte 0 is 2^-127, an fp32 subnormal).
* e2m1 (MXFP4 element), 4-bit code ``s ee m``: ±{0, .5, 1, 1.5, 2, 3, 4, 6}, magnitude codes 0..7 in
  that order; two codes per byte, LOW nibble = EVEN element. Code 8 is −0.0 (so unpack → pack
  round-trips every byte).

NaN rule (one, everywhere): the dtypes' own (OCP MX / ``ml_dtypes``, which is what the
checkpoint's ``F8_E4M3`` / ``F8_E8M0`` tensor types mean): e4m3 bytes 0x7F / 0xFF and the e8m0 byte
0xFF decode to NaN; e2m1 has no NaN. The quantizers never produce these bytes (they clamp to ±448 and
clip scale exponents to [−127, 127]), so a NaN after decoding means a corrupt tensor and is
propagated, not hidden as a finite number. `tests/test_codec.py` checks every form against
``ml_dtypes`` on all 256 bytes (NaN positions included).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "E4M3_MAX", "E2M1_MAX", "E2M1_GRID", "FP8", "E8M0",
    "bitcast", "f32_from_bits", "bits_from_f32", "f32_exponent", "ceil_log2", "exp2_int",
    "e8m0_decode", "e4m3_decode", "e2m1_decode", "e2m1_to_e4m3",
    "e8m0_encode_exponent", "e8m0_encode_pow2", "round_e4m3", "round_e2m1", "e2m1_encode",
    "ACT_AMAX_FLOOR", "fp8_act_codes",
    "pack_nibbles", "unpack_nibbles",
    "e8m0_to_f32_np", "e4m3_to_f32_np", "unpack_fp4_np",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The checkpoint's two 8-bit dtypes, defined here only (`quant`, `checkpoint`, the kernels import them):
# numpy dtypes equal to jnp.float8_e4m3fn / jnp.float8_e8m0fnu (``==``, ``astype``, ``jnp.zeros`` take either).
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# Activation-quant amax floor (docs/design/spec.md §6: "amax >= 1e-4"): keeps amax/448 a normal fp32.
ACT_AMAX_FLOOR = 1e-4
# e2m1 magnitudes indexed by their 3-bit code (standard OCP MX encoding).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_F32_QNAN = 0x7FC00000
_F32_2M127 = 0x00400000  # 2^-127: exponent field 0, mantissa MSB set (an fp32 subnormal)
_F32_SIGN = -(1 << 31)  # int32 0x80000000


# ------------------------------------------------------------------------------------ fp32 bits


def bitcast(x, dtype, xp):
    """Reinterpret the bits of ``x`` as ``dtype`` (same width; same shape): numpy ``view`` or
    ``lax.bitcast_convert_type`` (jax imported lazily: the host forms must not need it)."""
    if xp is np:
        return np.asarray(x).view(dtype)
    import jax

    return jax.lax.bitcast_convert_type(x, dtype)


def f32_from_bits(bits, xp):
    """int32 bit patterns -> float32 (same shape)."""
    return bitcast(bits.astype(xp.int32), np.float32, xp)


def bits_from_f32(x, xp):
    """float32 -> int32 bit patterns (same shape)."""
    return bitcast(x.astype(xp.float32), np.int32, xp)


def f32_exponent(a, xp):
    """Unbiased exponent field of fp32 ``a`` (int32): floor(log2|a|) for normal ``a``; −127 for zero
    and subnormals."""
    return ((bits_from_f32(a, xp) >> 23) & 0xFF) - 127


def ceil_log2(v, xp):
    """Exact ceil(log2(v)) (int32) for positive *normal* fp32 ``v``, from the bit pattern: the
    exponent field, plus one unless the mantissa is zero (v an exact power of two). (``log2`` is not
    exact at powers of two on every backend, nor in numpy's fp32.)"""
    bits = bits_from_f32(v, xp)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(xp.int32)


def exp2_int(e, xp):
    """2^e as fp32 for integer ``e`` in [−126, 127], exact (built from the exponent field)."""
    return f32_from_bits((e.astype(xp.int32) + 127) << 23, xp)


# ------------------------------------------------------------------------------------ decoders


def e8m0_decode(byte, xp):
    """e8m0 exponent bytes (any integer dtype, values 0..255) -> fp32 2^(byte − 127); 255 -> NaN."""
    byte = byte.astype(xp.int32)
    return f32_from_bits(xp.where(byte == 0, _F32_2M127, xp.where(byte == 255, _F32_QNAN, byte << 23)), xp)


def e4m3_decode(byte, xp):
    """float8_e4m3fn bytes (any integer dtype, 0..255) -> fp32, exact (subnormals, ±0; 0x7F/0xFF NaN)."""
    byte = byte.astype(xp.int32)
    e = (byte >> 3) & 15
    m = byte & 7
    normal = f32_from_bits(((e + 120) << 23) | (m << 20), xp)  # 2^(e−7)·(1 + m/8)
    mag = xp.where(e == 0, m.astype(xp.float32) * (2.0 ** -9), normal)  # subnormal: m·2^-9
    mag = xp.where((byte & 0x7F) == 0x7F, np.nan, mag)
    return xp.where(byte >= 128, -mag, mag)


def e2m1_decode(code, xp):
    """4-bit e2m1 codes (any integer dtype, 0..15, bit 3 = sign) -> fp32 ±{0, .5, 1, 1.5, 2, 3, 4, 6}."""
    code = code.astype(xp.int32)
    e = (code >> 1) & 3
    m = code & 1
    normal = f32_from_bits(((e + 126) << 23) | (m << 22), xp)  # 2^(e−1)·(1 + m/2)
    mag = xp.where(e == 0, m.astype(xp.float32) * 0.5, normal)
    return xp.where(code >= 8, -mag, mag)


def e2m1_to_e4m3(code, xp):
    """4-bit e2m1 codes (integer, 0..15) -> the uint8 float8_e4m3fn byte of the same value (exact).

    Code s|ee|m: ee = 0 is 0 or 0.5 (m = 0 / 1; 0.5 is e4m3 exponent field 6, mantissa 0); otherwise
    2^(ee−1)·(1 + m/2), i.e. e4m3 exponent field ee + 6 and mantissa m << 2. Widening MXFP4 weights to
    e4m3 this way lets an fp8 dot consume them with no fp32 copy.
    """
    c = code.astype(xp.uint8)
    ee = (c >> 1) & 0x3
    m = c & 0x1
    mag = xp.where(ee == 0, m * xp.uint8(0x30), ((ee + 6) << 3) | (m << 2)).astype(xp.uint8)
    return ((c & 0x8) << 4) | mag


# ------------------------------------------------------------------------------------ encoders


def e8m0_encode_exponent(e, xp):
    """Integer exponents e in [−127, 127] -> uint8 e8m0 bytes of 2^e."""
    return (e.astype(xp.int32) + 127).astype(xp.uint8)


def e8m0_encode_pow2(s, xp):
    """Positive power-of-two fp32 scales -> uint8 e8m0 bytes (exact for 2^-127 .. 2^127).

    A non-power-of-two input is truncated to the power of two at or below it (the exponent field is
    kept, the mantissa dropped); 2^-127 (fp32 subnormal 0x00400000) has field 0 and maps to byte 0.
    Done on the bits: XLA's own f32 -> e8m0 convert rounds differently from ml_dtypes (3.0 -> 2 in
    XLA, 4 in ml_dtypes).
    """
    return ((bits_from_f32(s, xp) >> 23) & 0xFF).astype(xp.uint8)


def _round_half_even_int(v, xp):
    """Round-half-even of fp32 ``v`` in [0, 2^23) to an integer, as fp32: truncate, then compare the
    exact remainder (no round primitive: the Triton lowering has none)."""
    t = v.astype(xp.int32)
    frac = v - t.astype(xp.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))
    return (t + up.astype(xp.int32)).astype(xp.float32)


def round_e4m3(y, xp):
    """Round fp32 ``y`` to the float8_e4m3fn grid, round-to-nearest-even, result kept in fp32.

    ``y`` should already be clamped to [−448, 448] (larger values round like an unbounded e4m3; ±inf
    and NaN pass through). The quantum at |y| is q = 2^(floor(log2|y|) − 3) for normal values and 2^-9
    below 2^-6 (subnormals share the min-normal quantum), so RNE is ``round_half_even(|y|/q)·q``, exact
    in fp32 (q a power of two; |y|/q < 16). Written with integer rounding and the sign copied by bits
    (no round / copysign), so the same definition runs inside a Triton kernel (`pallas.moe_mxfp4`).
    Every result is exactly representable, so a following cast to e4m3 is exact on every backend.
    """
    y = xp.asarray(y).astype(xp.float32)
    finite = xp.abs(y) < np.inf
    a = xp.where(finite, xp.abs(y), 0.0)  # (±inf / NaN are passed through below)
    e = xp.maximum(f32_exponent(a, xp), -6)
    r = _round_half_even_int(a * exp2_int(3 - e, xp), xp) * exp2_int(e - 3, xp)  # exact (powers of two)
    r = f32_from_bits(bits_from_f32(r, xp) | (bits_from_f32(y, xp) & _F32_SIGN), xp)  # −0 stays −0
    return xp.where(finite, r, y)


def e4m3_encode(v, xp):
    """fp32 values already on the float8_e4m3fn grid (`round_e4m3` of a clamped input: |v| ≤ 448, finite)
    -> their e4m3 bytes (int32 0..255), from the bits: normal |v| ≥ 2^-6 keep the exponent (rebiased by
    −120) and the top three mantissa bits; subnormals are m·2^-9 (m = |v|·2^9, exact); the sign bit is
    copied (−0 -> 0x80). The same bytes as a cast to float8_e4m3fn, with integer ops only (no fp8 dtype:
    it runs inside a Triton kernel, `pallas.window_codes`)."""
    b = bits_from_f32(v, xp)
    e = ((b >> 23) & 0xFF) - 127
    mag = xp.where(e >= -6, ((e + 7) << 3) | ((b >> 20) & 7),
                   (xp.abs(v) * 512.0).astype(xp.int32))  # subnormal: m exact (|v| < 2^-6 -> m < 8)
    return mag | ((b >> 24) & 0x80)


def round_e2m1(x, xp):
    """Round fp32 ``x`` (already clamped to ±6) to the e2m1 grid, ties to the even code (spec.md §6:
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); sign kept (small negatives give −0.0).

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; in each band an even multiple of the
    spacing is an even code, so RNE of |x|/spacing (exact) times the spacing is the spec rule. At the
    band edges (2, 4) both spacings agree because the edges are even codes.
    """
    x = xp.asarray(x).astype(xp.float32)
    a = xp.abs(x)
    q = xp.where(a < 2.0, 0.5, xp.where(a < 4.0, 1.0, 2.0)).astype(xp.float32)
    return xp.copysign(xp.round(a / q) * q, x)


def e2m1_encode(v, xp):
    """fp32 e2m1 grid values -> uint8 4-bit codes (sign bit 3 | magnitude code; −0.0 keeps its sign).

    An off-grid value gets the code of the largest grid magnitude <= |v| (round with `round_e2m1`).
    """
    v = xp.asarray(v).astype(xp.float32)
    a = xp.abs(v)
    mag = xp.zeros(v.shape, xp.uint8)
    for g in E2M1_GRID[1:]:  # code = number of nonzero grid values <= |v|
        mag = mag + (a >= g).astype(xp.uint8)
    return mag | (xp.signbit(v).astype(xp.uint8) << 3)


def pack_nibbles(codes, xp):
    """uint8 4-bit codes [..., K] (K even) -> bytes [..., K/2], LOW nibble = EVEN element."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got {codes.shape}")
    c = codes.astype(xp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(packed, xp):
    """Bytes [..., K/2] -> uint8 4-bit codes [..., K] (low nibble first)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return xp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(v, xp):
    """e2m1 grid values [..., K] (K even) -> packed uint8 [..., K/2] (`e2m1_encode` + `pack_nibbles`)."""
    return pack_nibbles(e2m1_encode(v, xp), xp)


# ------------------------------------------------------------------------------------ activation quant


def fp8_act_codes(x, xp, block=32):
    """The spec's (§6) fp8 activation quant, defined once (`quant.act_quant_fp8`, the window codes, the
    fp8 / MXFP4 GEMM kernels' in-kernel input quant all call it).

    Args:
      x: fp32 [..., K], K % block == 0 (a jnp array, a numpy array, or a tile loaded inside a Pallas kernel).
    Returns:
      (y fp32 [..., K/block, block]: x / s on the e4m3 grid (`round_e4m3` of the clamped quotient; cast to
      float8_e4m3fn or `e4m3_encode` it: exact), e int32 [..., K/block]: the scale exponent, s = 2^e).
      amax = max(max|x_block|, 1e-4); e = ⌈log2(amax/448)⌉ with amax/448 rounded in fp32 first (exact
      ceil-log2 from the bits); x / s is computed as x · 2^−e (exact: s is a power of two, e in [−22, 120]).

    Written with reshape / max / integer shifts / where only (no round, no division), so the same
    definition lowers inside a Triton kernel (`pallas.common.fake_quant_fp8`, `pallas.window_codes`).
    """
    *lead, k = x.shape
    xb = x.reshape(*lead, k // block, block)
    amax = xp.maximum(xp.max(xp.abs(xb), axis=-1), ACT_AMAX_FLOOR)
    e = ceil_log2(amax / E4M3_MAX, xp)  # amax / 448 ≥ 2.2e-7: a normal fp32
    y = xp.clip(xb * exp2_int(-e, xp)[..., None], -E4M3_MAX, E4M3_MAX)
    return round_e4m3(y, xp), e


# ------------------------------------------------------------------------------------ checkpoint weight quantizers
# Floors (not in the reference, which never sees all-zero blocks): chosen so amax/qmax is the smallest
# normal fp32 (2^-126), which keeps the bit-level ceil-log2 exact and the scale a valid e8m0 value.
_W_FP8_AMAX_FLOOR = E4M3_MAX * 2.0**-126
_W_FP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126


def _cdiv(a, b):
    return -(-a // b)


def _groups(w, block, name, xp):
    """fp32 view [..., d/block, block] of w [..., d]."""
    w = xp.asarray(w).astype(xp.float32)
    if w.shape[-1] % block:
        raise ValueError(f"{name}: last dimension {w.shape[-1]} is not a multiple of {block}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // block, block)


def _pow2_scale_exponent(amax, floor, qmax, xp):
    """Exponent e of the power-of-two scale 2^ceil(log2(max(amax, floor)/qmax)), clipped to [−126, 127]."""
    return xp.clip(ceil_log2(xp.maximum(amax, floor) / qmax, xp), -126, 127)


def fp8_block_codes(w, xp, block=32):
    """The 32x32-block fp8 weight rule over namespace ``xp`` (jnp: `quantize_fp8_block`; numpy:
    `quant_np.quantize_fp8_block_np`).

    Args:
      w: float array [out, in] (math in fp32). out/in need not be multiples of block.
    Returns:
      (w_e4m3 float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/block), ceil(in/block)]) with
      w ~= w_e4m3 * scale (broadcast per tile). Per tile s = 2^ceil(log2(amax/448)) (amax over the real,
      unpadded elements, floored at 448*2^-126 so all-zero tiles get a valid scale), then
      e4m3 RNE of clamp(w/s, +-448).
    """
    w = xp.asarray(w).astype(xp.float32)
    if w.ndim != 2:
        raise ValueError(f"fp8_block_codes expects [out, in], got {w.shape}")
    out_f, in_f = w.shape
    ob, ib = _cdiv(out_f, block), _cdiv(in_f, block)
    # Zero padding never raises a tile's amax, so padded tiles quantize like the real ones.
    wp = xp.pad(w, ((0, ob * block - out_f), (0, ib * block - in_f)))
    t = wp.reshape(ob, block, ib, block)
    e = _pow2_scale_exponent(xp.max(xp.abs(t), axis=(1, 3)), _W_FP8_AMAX_FLOOR, E4M3_MAX, xp)
    y = xp.clip(t / exp2_int(e, xp)[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    q = round_e4m3(y, xp).reshape(ob * block, ib * block)[:out_f, :in_f]
    return q.astype(FP8), bitcast(e8m0_encode_exponent(e, xp), E8M0, xp)


def fp8_row_codes(w, xp, block=32):
    """fp8 with per-``block`` power-of-two scales along the last axis (Engram tables), over ``xp``:
    [..., d] -> (float8_e4m3fn [..., d], float8_e8m0fnu [..., d/block]); the `fp8_block_codes` rule
    (floor 448*2^-126) on 1 x block groups."""
    x = _groups(w, block, "fp8_row_codes", xp)
    e = _pow2_scale_exponent(xp.max(xp.abs(x), axis=-1), _W_FP8_AMAX_FLOOR, E4M3_MAX, xp)
    y = xp.clip(x / exp2_int(e, xp)[..., None], -E4M3_MAX, E4M3_MAX)
    q = round_e4m3(y, xp).reshape(*x.shape[:-2], -1)
    return q.astype(FP8), bitcast(e8m0_encode_exponent(e, xp), E8M0, xp)


def mxfp4_codes(w, xp, block=32):
    """The MXFP4 weight rule over namespace ``xp`` (jnp: `quantize_mxfp4`; numpy:
    `quant_np.quantize_mxfp4_np`).

    Args:
      w: float array [..., out, in], in % block == 0 (math in fp32).
    Returns:
      (packed uint8 [..., out, in/2], scale float8_e8m0fnu [..., out, in/block]). Per group
      s = 2^ceil(log2(amax/6)) (amax floored at 6*2^-126 so all-zero groups work), values
      round_e2m1(clamp(w/s, +-6)).
    """
    g = _groups(w, block, "mxfp4_codes", xp)
    e = _pow2_scale_exponent(xp.max(xp.abs(g), axis=-1), _W_FP4_AMAX_FLOOR, E2M1_MAX, xp)
    v = round_e2m1(xp.clip(g / exp2_int(e, xp)[..., None], -E2M1_MAX, E2M1_MAX), xp).reshape(*g.shape[:-2], -1)
    return pack_fp4(v, xp), bitcast(e8m0_encode_exponent(e, xp), E8M0, xp)


# ------------------------------------------------------------------------------------ host (numpy) decoders
# Lookup tables generated by the definitions above (numpy form): one take per element, bit-equal to them.

_E8M0_F32 = e8m0_decode(np.arange(256), np)
_E4M3_F32 = e4m3_decode(np.arange(256), np)
# Byte -> (even element, odd element) of a packed MXFP4 byte.
_FP4_PAIR_F32 = np.stack([e2m1_decode(np.arange(256) & 15, np), e2m1_decode(np.arange(256) >> 4, np)], -1)


def _bytes(a, dtype, name):
    a = np.asarray(a)
    if a.dtype == dtype:
        return a.view(np.uint8)
    if a.dtype == np.uint8:
        return a
    raise TypeError(f"{name} expects {dtype} or uint8 bytes, got {a.dtype}")


def e8m0_to_f32_np(s) -> np.ndarray:
    """float8_e8m0fnu (or uint8 exponent bytes) array -> fp32 2^(e−127), same shape (host)."""
    return _E8M0_F32[_bytes(s, E8M0, "e8m0_to_f32_np")]


def e4m3_to_f32_np(q) -> np.ndarray:
    """float8_e4m3fn (or uint8 bytes) array -> fp32, same shape (host)."""
    return _E4M3_F32[_bytes(q, FP8, "e4m3_to_f32_np")]


def unpack_fp4_np(packed) -> np.ndarray:
    """Packed MXFP4 uint8 [..., K/2] (low nibble = even element) -> fp32 grid values [..., K] (host)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"unpack_fp4_np expects uint8, got {packed.dtype}")
    return _FP4_PAIR_F32[packed].reshape(*packed.shape[:-1], 2 * packed.shape[-1])
