"""Tests for dsv41_jax.model.quant (docs/design/spec.md §6 number formats, §3/§4 fake-quants).

References here are written independently of the module: numpy float64 arithmetic, ml_dtypes' own
(round-to-nearest-even) e4m3 cast, np.frexp for exponents, and a hand-written nibble decoder.
Hand-checked cases state the arithmetic in comments.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.model import numerics as N
from dsv41_jax.model import quant as Q

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3 = ml_dtypes.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# independent numpy references
# ------------------------------------------------------------------------------------------------


def np_ceil_log2(v):
    """Exact ceil(log2 v) for positive float32 v via frexp (v = m*2^e, m in [0.5, 1))."""
    m, e = np.frexp(np.asarray(v, np.float32))
    return np.where(m == 0.5, e - 1, e).astype(np.int64)


def np_act_quant(x):
    """docs/design/spec.md §6 act quant in numpy: returns (xq as float64 e4m3 values, s float64 per block)."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(1e-4)).astype(np.float32)
    s = np.ldexp(np.float32(1.0), np_ceil_log2(amax / np.float32(448.0))).astype(np.float32)
    y = np.clip(xb / s[..., None], -448, 448).astype(np.float32)
    xq = y.astype(E4M3).astype(np.float64).reshape(x.shape)
    return xq, s.astype(np.float64)


def np_unpack_fp4(b):
    b = np.asarray(b, np.uint8)
    lut = np.concatenate([GRID, -GRID])
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), np.float64)
    out[..., 0::2] = lut[b & 0xF]
    out[..., 1::2] = lut[b >> 4]
    return out


def np_round_e2m1(x):
    """Nearest grid value; on an exact tie the one with the even 3-bit magnitude code."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    d = np.abs(a[..., None] - GRID)
    best = d.min(-1, keepdims=True)
    cand = d == best
    codes = np.arange(8)
    # prefer even code among tied candidates
    score = np.where(cand, np.where(codes % 2 == 0, 0, 1), 9) * 10 + codes
    idx = score.argmin(-1)
    return np.sign(x) * GRID[idx]


def e4m3_values():
    """All finite e4m3fn values, sorted (float64)."""
    v = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def random_e4m3(rng, shape):
    """Random finite e4m3 values (random bytes, NaN bytes 0x7f/0xff excluded)."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b = np.where((b & 0x7F) == 0x7F, 0x7E, b).astype(np.uint8)
    return b.view(E4M3)


def bytes_of(s):
    return np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8)) if s.dtype != jnp.uint8 else np.asarray(s)


# ------------------------------------------------------------------------------------------------
# E8M0
# ------------------------------------------------------------------------------------------------


def test_e8m0_decode_hand_values():
    b = jnp.array([127, 128, 120, 0, 254], jnp.uint8)
    want = np.array([1.0, 2.0, 2.0**-7, 2.0**-127, 2.0**127], np.float32)
    got_u8 = np.asarray(Q.e8m0_to_f32(b))
    got_e8 = np.asarray(Q.e8m0_to_f32(jax.lax.bitcast_convert_type(b, Q.E8M0)))
    assert got_u8.dtype == np.float32 and got_e8.dtype == np.float32
    np.testing.assert_array_equal(got_u8, want)
    np.testing.assert_array_equal(got_e8, want)
    assert np.isnan(np.asarray(Q.e8m0_to_f32(jnp.array([255], jnp.uint8))))[0]


def test_pow2_scale_e8m0_roundtrip_all_exponents():
    e = np.arange(-127, 128)
    s = np.ldexp(np.float32(1.0), e).astype(np.float32)  # 2^-127 is an fp32 subnormal, still exact
    enc = Q.pow2_scale_to_e8m0(jnp.asarray(s))
    assert enc.dtype == Q.E8M0
    np.testing.assert_array_equal(bytes_of(enc), (e + 127).astype(np.uint8))
    np.testing.assert_array_equal(np.asarray(Q.e8m0_to_f32(enc)), s)


# ------------------------------------------------------------------------------------------------
# e2m1 rounding and packing
# ------------------------------------------------------------------------------------------------


def test_round_e2m1_spec_ties():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(ties))), want)
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(-ties))), -want)
    # just off each tie goes to the nearer neighbour
    lo = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]); hi = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(ties + np.float32(1e-3)))), hi)
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(ties - np.float32(1e-3)))), lo)


def test_round_e2m1_grid_fixed_and_random():
    g = np.concatenate([GRID, -GRID]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(g))), g)
    x = np.random.default_rng(0).uniform(-6, 6, size=4096).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(Q.round_e2m1(jnp.asarray(x))), np_round_e2m1(x).astype(np.float32))


def test_fp4_pack_low_nibble_is_even_element():
    # 0.5 -> code 1; -6 -> sign 8 | code 7 = 0xF.  even element in the low nibble: 0xF1.
    np.testing.assert_array_equal(np.asarray(Q.pack_fp4(jnp.array([0.5, -6.0]))), [0xF1])
    # 3 -> code 5: [3, 0] -> 0x05, [0, 3] -> 0x50, [-1, 1.5] -> (8|2) | 3<<4 = 0x3A
    np.testing.assert_array_equal(
        np.asarray(Q.pack_fp4(jnp.array([[3.0, 0.0, 0.0, 3.0, -1.0, 1.5]]))), [[0x05, 0x50, 0x3A]]
    )
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(jnp.array([0xF1], jnp.uint8))), [0.5, -6.0])


def test_fp4_pack_unpack_all_codes_and_random():
    vals = np.concatenate([GRID, -GRID]).astype(np.float32)  # all 16 codes (incl. -0)
    packed = Q.pack_fp4(jnp.asarray(vals))
    assert packed.dtype == jnp.uint8 and packed.shape == (8,)
    out = np.asarray(Q.unpack_fp4(packed))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, vals)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(vals))
    # every byte round-trips unpack -> pack bit-exactly (so -0 keeps its sign bit)
    allb = jnp.arange(256, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(Q.pack_fp4(Q.unpack_fp4(allb))), np.arange(256))
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(allb)), np_unpack_fp4(np.arange(256, dtype=np.uint8)))
    rng = np.random.default_rng(1)
    v = rng.choice(vals, size=(3, 5, 64)).astype(np.float32)
    p = Q.pack_fp4(jnp.asarray(v))
    assert p.shape == (3, 5, 32)
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(p)), v)
    np.testing.assert_array_equal(np_unpack_fp4(np.asarray(p)), v)


# ------------------------------------------------------------------------------------------------
# e4m3 rounding / activation quant
# ------------------------------------------------------------------------------------------------


def test_round_e4m3_matches_ml_dtypes_on_ties():
    g = e4m3_values()
    g = g[(g >= 0) & (g <= 448)]
    mids = ((g[1:] + g[:-1]) / 2).astype(np.float32)  # exact in fp32
    x = np.concatenate(
        [mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9)),
         g.astype(np.float32), np.random.default_rng(2).uniform(0, 448, 2000).astype(np.float32)]
    )
    x = np.concatenate([x, -x]).astype(np.float32)
    want = x.astype(E4M3).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(Q.round_e4m3(jnp.asarray(x))), want)


def test_act_quant_scale_rule_hand_checked():
    x = np.zeros((5, 32), np.float32)
    x[0, 0], x[0, 1] = 448.0, 0.3  # amax 448: 448/448 = 1 = 2^0 -> s = 1
    x[1, 3], x[1, 4] = -449.0, 449.0  # 449/448 > 1 -> s = 2; 449/2 = 224.5 -> e4m3 (step 16) -> 224
    # row 2: all zero -> amax floored at 1e-4: 1e-4/448 = 2.23e-7 in (2^-23, 2^-22] -> s = 2^-22
    x[3, 7] = 224.0  # 224/448 = 0.5 -> s = 2^-1
    x[4, 31] = -1.0  # 1/448 = 2.23e-3 in (2^-9, 2^-8] -> s = 2^-8
    xq, s = Q.act_quant_fp8(jnp.asarray(x.reshape(-1)))
    assert xq.dtype == Q.FP8 and s.dtype == jnp.float32
    assert xq.shape == (160,) and s.shape == (5,)
    np.testing.assert_array_equal(np.asarray(s), [1.0, 2.0, 2.0**-22, 0.5, 2.0**-8])
    q = np.asarray(xq.astype(jnp.float32)).reshape(5, 32)
    # 0.3 with s = 1: e4m3 step in [0.25, 0.5) is 2^-5; 0.3/2^-5 = 9.6 -> 10 -> 0.3125
    assert q[0, 0] == 448.0 and q[0, 1] == 0.3125
    assert q[1, 3] == -224.0 and q[1, 4] == 224.0
    assert not q[2].any()
    assert q[3, 7] == 448.0 and q[4, 31] == -256.0
    # fake_quant_fp8 = xq * s, default dtype = input dtype
    fq = Q.fake_quant_fp8(jnp.asarray(x.reshape(-1)))
    assert fq.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(fq).reshape(5, 32), q * np.asarray(s)[:, None])


def test_act_quant_matches_reference_and_is_dtype_independent():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 6, 128)) * np.exp(rng.uniform(-8, 8, (4, 6, 1)))).astype(np.float32)
    x[0, 0, :32] = 0.0
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # make it bf16-exact
    xq, s = Q.act_quant_fp8(jnp.asarray(x))
    rq, rs = np_act_quant(x)
    np.testing.assert_array_equal(np.asarray(xq.astype(jnp.float32)), rq)
    np.testing.assert_array_equal(np.asarray(s), rs)
    # bf16 input: computed in fp32 -> identical result
    xq2, s2 = Q.act_quant_fp8(jnp.asarray(x, jnp.bfloat16))
    np.testing.assert_array_equal(bytes_of(xq2), bytes_of(xq))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
    fq = Q.fake_quant_fp8(jnp.asarray(x, jnp.bfloat16))
    assert fq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(fq.astype(jnp.float32)), (rq.reshape(4, 6, 4, 32) * rs[..., None]).reshape(x.shape)
    )


def test_act_quant_rejects_ragged_k():
    with pytest.raises(ValueError):
        Q.act_quant_fp8(jnp.zeros((2, 40)))


# ------------------------------------------------------------------------------------------------
# fp8 block weights
# ------------------------------------------------------------------------------------------------


def test_fp8_block_roundtrip_exact_on_grid():
    rng = np.random.default_rng(4)
    out_f, in_f = 70, 100  # not multiples of 32: 3 x 4 blocks with ragged edges
    base = random_e4m3(rng, (out_f, in_f)).astype(np.float32)
    base = np.clip(base, -224, 224)  # keep every non-anchor |v| <= 224 ...
    k = rng.integers(-12, 13, size=(3, 4))
    for bi in range(3):
        for bj in range(4):
            # ... and one anchor per block in (224, 448] so the block amax / 448 lies in (2^-1, 2^0]
            base[bi * 32, bj * 32] = rng.choice([240.0, 288.0, 416.0, -448.0, 448.0])
    w = base * np.ldexp(1.0, np.repeat(np.repeat(k, 32, 0), 32, 1)[:out_f, :in_f]).astype(np.float32)
    wq, s = Q.quantize_fp8_block(jnp.asarray(w))
    assert wq.dtype == Q.FP8 and wq.shape == (out_f, in_f)
    assert s.dtype == Q.E8M0 and s.shape == (3, 4)
    np.testing.assert_array_equal(bytes_of(s), (k + 127).astype(np.uint8))
    np.testing.assert_array_equal(np.asarray(wq.astype(jnp.float32)), base)
    np.testing.assert_array_equal(np.asarray(Q.dequantize_fp8_block(wq, s)), w)
    deq_bf16 = Q.dequantize_fp8_block(wq, s, jnp.bfloat16)
    assert deq_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(deq_bf16.astype(jnp.float32)), w)  # exact in bf16 too
    # uint8 exponent bytes accepted as scale
    np.testing.assert_array_equal(np.asarray(Q.dequantize_fp8_block(wq, jnp.asarray(bytes_of(s)))), w)


def test_fp8_block_scale_rule_and_zero_block():
    w = np.zeros((64, 64), np.float32)
    w[0, 0] = 448.0  # block (0,0): s = 1
    w[0, 40] = 449.0  # block (0,1): 449/448 > 1 -> s = 2; 224.5 -> 224
    w[40, 0] = -0.75  # block (1,0): 0.75/448 in (2^-10, 2^-9] -> s = 2^-9; -0.75/2^-9 = -384
    # block (1,1) all zero: floored amax -> s = 2^-126 (byte 1), values 0
    wq, s = Q.quantize_fp8_block(jnp.asarray(w))
    np.testing.assert_array_equal(bytes_of(s), [[127, 128], [118, 1]])
    q = np.asarray(wq.astype(jnp.float32))
    assert q[0, 0] == 448.0 and q[0, 40] == 224.0 and q[40, 0] == -384.0
    assert not q[32:, 32:].any()
    assert np.isfinite(np.asarray(Q.dequantize_fp8_block(wq, s))).all()


def test_fp8_block_random_error_bound_and_reference():
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((96, 80)) * 0.05).astype(np.float32)
    w[:32, :32] *= 1e4  # blocks of very different magnitude
    wq, s = Q.quantize_fp8_block(jnp.asarray(w))
    s32 = np.asarray(Q.e8m0_to_f32(s))
    sfull = np.repeat(np.repeat(s32, 32, 0), 32, 1)[:96, :80]
    deq = np.asarray(Q.dequantize_fp8_block(wq, s)).astype(np.float64)
    err = np.abs(deq - w)
    # RNE with 3 mantissa bits: relative error <= 2^-4 for normals; absolute <= 2^-10 * s in the
    # subnormal range (step 2^-9 * s)
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * sfull))
    # and it is exactly the reference: per-block amax rule + ml_dtypes RNE cast (the last block
    # column holds only 16 real columns: its amax must ignore the padding)
    q = np.asarray(wq.astype(jnp.float32))
    for bi in range(3):
        for bj in range(3):
            sl = (slice(bi * 32, bi * 32 + 32), slice(bj * 32, bj * 32 + 32))
            blk = w[sl]
            e = np_ceil_log2(np.float32(np.abs(blk).max()) / np.float32(448))
            assert s32[bi, bj] == 2.0**e
            ref = (blk / np.float32(2.0**e)).astype(E4M3).astype(np.float32)
            np.testing.assert_array_equal(q[sl], ref)


# ------------------------------------------------------------------------------------------------
# MXFP4 weights
# ------------------------------------------------------------------------------------------------


def test_mxfp4_quantize_hand_checked():
    w = np.zeros((2, 64), np.float32)
    # row 0, group 0: amax 6 -> 6/6 = 1 -> s = 1 (byte 127); values 6, -3, 0.75 -> 1 (tie, even), 0.25 -> 0
    w[0, :4] = [6.0, -3.0, 0.75, 0.25]
    # row 0, group 1: amax 6.01 -> s = 2 (byte 128); 6.01/2 = 3.005 -> 3 -> 6; 2.5/2 = 1.25 -> 1 -> 2
    w[0, 32:34] = [6.01, 2.5]
    # row 1, group 0: amax 3 -> 3/6 = 0.5 -> s = 0.5 (byte 126); 1.25/0.5 = 2.5 -> 2 -> 1.0
    w[1, :2] = [-3.0, 1.25]
    # row 1, group 1: all zero -> floor -> s = 2^-126 (byte 1)
    packed, s = Q.quantize_mxfp4(jnp.asarray(w))
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 32)
    assert s.dtype == Q.E8M0 and s.shape == (2, 2)
    np.testing.assert_array_equal(bytes_of(s), [[127, 128], [126, 1]])
    deq = np.asarray(Q.dequantize_mxfp4(packed, s))
    want = np.zeros_like(w)
    want[0, :4] = [6.0, -3.0, 1.0, 0.0]
    want[0, 32:34] = [6.0, 2.0]
    want[1, :2] = [-3.0, 1.0]
    np.testing.assert_array_equal(deq, want)
    # 6 -> code 7, -3 -> 8|5 = 0xD : byte 0 = 0xD7
    assert int(packed[0, 0]) == 0xD7


def test_mxfp4_roundtrip_exact_on_grid_and_random_reference():
    rng = np.random.default_rng(6)
    vals = rng.choice(np.concatenate([GRID, -GRID]), size=(16, 128))
    vals[:, ::32] = rng.choice([4.0, -6.0, 6.0], size=(16, 4))  # group amax in (3, 6] -> scale 2^k
    k = rng.integers(-20, 21, size=(16, 4))
    w = (vals * np.ldexp(1.0, np.repeat(k, 32, 1))).astype(np.float32)
    packed, s = Q.quantize_mxfp4(jnp.asarray(w))
    np.testing.assert_array_equal(bytes_of(s), (k + 127).astype(np.uint8))
    np.testing.assert_array_equal(np_unpack_fp4(np.asarray(packed)), vals)
    np.testing.assert_array_equal(np.asarray(Q.dequantize_mxfp4(packed, s)), w)
    np.testing.assert_array_equal(np.asarray(Q.dequantize_mxfp4(packed, s, jnp.bfloat16).astype(jnp.float32)), w)
    # random data: equals the numpy reference rule
    w = rng.standard_normal((8, 96)).astype(np.float32)
    packed, s = Q.quantize_mxfp4(jnp.asarray(w))
    g = w.reshape(8, 3, 32)
    e = np_ceil_log2(np.abs(g).max(-1) / np.float32(6))
    sc = np.ldexp(1.0, e)[..., None]
    want = (np_round_e2m1(np.clip(g / sc, -6, 6)) * sc).reshape(8, 96)
    np.testing.assert_array_equal(np.asarray(Q.dequantize_mxfp4(packed, s)), want)


# ------------------------------------------------------------------------------------------------
# fp4 fake-quants
# ------------------------------------------------------------------------------------------------


def test_fake_quant_fp4_pow2_hand_checked():
    x = np.zeros(96, np.float32)
    # block 0: amax 3 -> 3/6 = 0.5 = 2^-1 -> s = 0.5
    x[:9] = [3.0, 1.1, -0.6, 0.2, 0.125, 0.875, 2.5, 1.75, -2.9]
    # x/s = 6, 2.2, -1.2, 0.4, 0.25(tie), 1.75(tie), 5(tie), 3.5(tie), -5.8
    #    -> 6, 2, -1, 0.5, 0, 2, 4, 4, -6 ; times 0.5:
    want0 = [3.0, 1.0, -0.5, 0.25, 0.0, 1.0, 2.0, 2.0, -3.0]
    # block 1: all zero (s = 2^-126) -> zeros
    # block 2: amax 7 -> 7/6 = 1.17 -> s = 2; x/s = 3.5(tie)->4, 0.5, 0.25(tie)->0, -1.5, 0.15->0, 2.5(tie)->2
    x[64:70] = [7.0, 1.0, 0.5, -3.0, 0.3, 5.0]
    want2 = [8.0, 1.0, 0.0, -3.0, 0.0, 4.0]
    want = np.zeros(96, np.float32)
    want[:9] = want0
    want[64:70] = want2
    got = Q.fake_quant_fp4_pow2(jnp.asarray(x))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    # bf16 in -> bf16 out, same values (the bf16-rounded inputs are nowhere near a decision point)
    gb = Q.fake_quant_fp4_pow2(jnp.asarray(x, jnp.bfloat16))
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gb.astype(jnp.float32)), want)
    assert Q.fake_quant_fp4_pow2(jnp.asarray(x), out_dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_fake_quant_fp4_e4m3_hand_checked():
    x = np.zeros(64, np.float32)
    # block 0: amax 4.5 -> 4.5/6 = 0.75 (on the e4m3 grid) -> s = 0.75
    #   x/s = 6, 2, 1.2, -2.67, 0.25(tie), 3.5(tie) -> 6, 2, 1, -3, 0, 4 -> times 0.75:
    x[:6] = [4.5, 1.5, 0.9, -2.0, 0.1875, 2.625]
    # block 1: amax 6.6 -> 1.1 -> e4m3 RNE (step 1/8 in [1, 2)): 1.1 -> 1.125 = s
    #   x/s = 5.87 -> 6, 2.93 -> 3, -0.89 -> -1 -> 6.75, 3.375, -1.125
    x[16:19] = [6.6, 3.3, -1.0]
    # block 2: amax 6.3 -> 1.05 -> e4m3 RNE -> 1.0 = s; 6.3 clamps to 6; -0.4 -> -0.5
    x[32:34] = [6.3, -0.4]
    # block 3: amax 3*2^-10 < 6*2^-9 -> floored -> s = 2^-9; x/s = 1.5 -> 1.5 -> 3*2^-10; 2^-12/2^-9 = 1/8 -> 0
    x[48:50] = [3 * 2.0**-10, 2.0**-12]
    want = np.zeros(64, np.float32)
    want[:6] = [4.5, 1.5, 0.75, -2.25, 0.0, 3.0]
    want[16:19] = [6.75, 3.375, -1.125]
    want[32:34] = [6.0, -0.5]
    want[48:50] = [3 * 2.0**-10, 0.0]
    got = Q.fake_quant_fp4_e4m3(jnp.asarray(x))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)
    gb = Q.fake_quant_fp4_e4m3(jnp.asarray(x), out_dtype=jnp.bfloat16)
    assert gb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(gb.astype(jnp.float32)), want)  # all exact in bf16


# ------------------------------------------------------------------------------------------------
# linears
# ------------------------------------------------------------------------------------------------


def _check_against_f64(got32, got_bf16, ref, absterms):
    """fp32 result within fp32 summation error; bf16 result within one bf16 rounding."""
    tol32 = 1e-5 * absterms + 1e-30
    assert np.all(np.abs(got32 - ref) <= tol32)
    bf = np.asarray(got_bf16.astype(jnp.float32), np.float64)
    assert np.all(np.abs(bf - ref) <= 2.0**-8 * np.abs(ref) + tol32)
    exact = ref.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.mean(bf == exact) > 0.97


def _random_fp8_weight(rng, n, k):
    wq = random_e4m3(rng, (n, k))
    sb = rng.integers(118, 124, size=(-(-n // 32), k // 32)).astype(np.uint8)
    return wq, sb


def test_fp8_linear_matches_blockwise_partial_sums():
    rng = np.random.default_rng(7)
    n, k = 40, 96  # n not a multiple of 32: the scale grid is cropped
    wq, sb = _random_fp8_weight(rng, n, k)
    x = (rng.standard_normal((2, 3, k)) * np.array([1.0, 30.0, 0.01])[:, None]).astype(np.float32)
    x = x.astype(ml_dtypes.bfloat16)
    xq, xs = np_act_quant(x.astype(np.float32))
    w64 = wq.astype(np.float64)
    ws = np.ldexp(1.0, sb.astype(np.int64) - 127)
    ref = np.zeros((2, 3, n))
    absterms = np.zeros((2, 3, n))
    for b in range(k // 32):  # SPEC: per-32 partial products x act scale x weight scale, in K order
        sl = slice(32 * b, 32 * b + 32)
        part = xq[..., sl] @ w64[:, sl].T
        sc = xs[..., b][..., None] * ws[np.arange(n) // 32, b]
        ref += part * sc
        absterms += (np.abs(xq[..., sl]) @ np.abs(w64[:, sl]).T) * sc
    xj = jnp.asarray(x)
    wj = jnp.asarray(wq)
    sj = jax.lax.bitcast_convert_type(jnp.asarray(sb), Q.E8M0)
    y32 = Q.fp8_linear(xj, wj, sj, out_dtype=jnp.float32)
    yb = Q.fp8_linear(xj, wj, sj)
    assert y32.shape == (2, 3, n) and y32.dtype == jnp.float32 and yb.dtype == jnp.bfloat16
    _check_against_f64(np.asarray(y32, np.float64), yb, ref, absterms)
    # the check has teeth: skipping the activation quant is far outside the tolerance
    unq = x.astype(np.float64) @ (w64 * np.repeat(np.repeat(ws, 32, 0), 32, 1)[:n]).T
    assert np.any(np.abs(unq - ref) > 1e-3 * absterms)
    # uint8 scale bytes and fp32 input of the same values give the same result
    np.testing.assert_array_equal(
        np.asarray(Q.fp8_linear(jnp.asarray(x.astype(np.float32)), wj, jnp.asarray(sb), jnp.float32)),
        np.asarray(y32),
    )


def test_mxfp4_linear_matches_reference():
    rng = np.random.default_rng(8)
    n, k = 24, 128
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    sb = rng.integers(120, 130, size=(n, k // 32)).astype(np.uint8)
    x = (rng.standard_normal((5, k)) * 3).astype(np.float32).astype(ml_dtypes.bfloat16)
    xq, xs = np_act_quant(x.astype(np.float32))
    wv = np_unpack_fp4(packed)
    ws = np.ldexp(1.0, sb.astype(np.int64) - 127)
    ref = np.zeros((5, n))
    absterms = np.zeros((5, n))
    for b in range(k // 32):
        sl = slice(32 * b, 32 * b + 32)
        sc = xs[:, b][:, None] * ws[:, b][None, :]
        ref += (xq[:, sl] @ wv[:, sl].T) * sc
        absterms += (np.abs(xq[:, sl]) @ np.abs(wv[:, sl]).T) * sc
    sj = jax.lax.bitcast_convert_type(jnp.asarray(sb), Q.E8M0)
    y32 = Q.mxfp4_linear(jnp.asarray(x), jnp.asarray(packed), sj, out_dtype=jnp.float32)
    yb = Q.mxfp4_linear(jnp.asarray(x), jnp.asarray(packed), sj)
    assert y32.shape == (5, n) and yb.dtype == jnp.bfloat16
    _check_against_f64(np.asarray(y32, np.float64), yb, ref, absterms)
    # nibble order matters: swapping nibbles gives a clearly different product
    swapped = ((packed >> 4) | (packed << 4)).astype(np.uint8)
    ysw = np.asarray(Q.mxfp4_linear(jnp.asarray(x), jnp.asarray(swapped), sj, out_dtype=jnp.float32))
    assert np.any(np.abs(ysw - ref) > 1e-3 * absterms)


def test_bf16_and_f32_linear():
    """numerics.linear_bf16 / linear_f32 (the plain-matmul kinds; quant.bf16_linear/f32_linear were
    duplicates and are gone), including the exact mode's fp64 accumulation."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 64)).astype(np.float32)  # not bf16-exact: linear_bf16 must round it
    w = rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)
    xb64 = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    w64 = w.astype(np.float64)
    ref = xb64 @ w64.T
    absterms = np.abs(xb64) @ np.abs(w64).T
    y = N.linear_bf16(jnp.asarray(x), jnp.asarray(w), jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 16)
    # One rounding of an (exact-product, fp32-accumulated) sum to bf16: within 2^-8 relative + fp32 noise.
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= 2.0**-8 * np.abs(ref) + 1e-6 * absterms)
    assert np.any(np.abs(x.astype(np.float64) @ w64.T - ref) > 1e-4 * absterms)  # rounding x matters
    y32 = N.linear_bf16(jnp.asarray(x), jnp.asarray(w), jnp.float32)  # fp32 mode: x not rounded
    ref32 = x.astype(np.float64) @ w64.T
    assert y32.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(y32) - ref32) <= 1e-6 * (np.abs(x) @ np.abs(w64).T))
    wf = rng.standard_normal((16, 64)).astype(np.float32)
    yf = N.linear_f32(jnp.asarray(x, jnp.float32), jnp.asarray(w))  # bf16 weight widened
    assert yf.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(yf) - ref32) <= 1e-6 * (np.abs(x) @ np.abs(w64).T))
    # Exact mode: fp64 accumulation then one fp32 rounding == the float64 reference rounded to fp32.
    ye = np.asarray(N.linear_f32(jnp.asarray(x), jnp.asarray(wf), exact=True))
    np.testing.assert_array_equal(ye, (x.astype(np.float64) @ wf.astype(np.float64).T).astype(np.float32))
    yeb = np.asarray(jax.jit(lambda a, b: N.linear_bf16(a, b, jnp.float32, exact=True))(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_array_equal(yeb, ref32.astype(np.float32))
    assert yeb.dtype == np.float32


# ------------------------------------------------------------------------------------------------
# jit
# ------------------------------------------------------------------------------------------------


def test_everything_jits_and_matches_eager():
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32), jnp.bfloat16)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    wq, ws = Q.quantize_fp8_block(jnp.asarray(w))
    wq_j, ws_j = jax.jit(Q.quantize_fp8_block)(jnp.asarray(w))
    np.testing.assert_array_equal(bytes_of(wq_j), bytes_of(wq))
    np.testing.assert_array_equal(bytes_of(ws_j), bytes_of(ws))
    pk, ps = Q.quantize_mxfp4(jnp.asarray(w))
    pk_j, ps_j = jax.jit(Q.quantize_mxfp4)(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(pk_j), np.asarray(pk))
    np.testing.assert_array_equal(bytes_of(ps_j), bytes_of(ps))
    cases = [
        (functools.partial(Q.fp8_linear, out_dtype=jnp.float32), (x, wq, ws)),
        (Q.mxfp4_linear, (x, pk, ps)),
        (Q.fake_quant_fp8, (x,)),
        (Q.fake_quant_fp4_pow2, (x,)),
        (Q.fake_quant_fp4_e4m3, (x,)),
        (Q.dequantize_fp8_block, (wq, ws)),
        (Q.dequantize_mxfp4, (pk, ps)),
        (lambda a: Q.act_quant_fp8(a)[1], (x,)),
        (Q.e8m0_to_f32, (ws,)),
    ]
    for fn, args in cases:
        eager = np.asarray(fn(*args).astype(jnp.float32))
        jitted = np.asarray(jax.jit(fn)(*args).astype(jnp.float32))
        np.testing.assert_array_equal(jitted, eager)
