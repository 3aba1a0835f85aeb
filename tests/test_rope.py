"""Tests for dsv41_jax.model.rope (docs/design/spec.md §3, RoPE bullet).

Expected values are computed independently in the test with Python ``math`` (double), so the
tolerances are fp32-sized.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.rope import apply_rope, rope_freqs, yarn_correction_range

# Most checks go through one jitted entry point: it is the way the model calls apply_rope and
# it compiles once per shape instead of once per primitive (keeps the suite fast).  A few tests
# below call apply_rope eagerly as well.
rope = jax.jit(apply_rope, static_argnames=("inverse", "out_dtype"))


def _plain(i, rd, base):
    """base^(-2i/rd) in double."""
    return base ** (-2.0 * i / rd)


def _corr(r, rd, base, orig):
    return rd * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))


# ----------------------------------------------------------------------------- frequencies


def test_plain_freqs():
    rd, base = 64, 10000.0
    f = rope_freqs(rd, base)
    assert isinstance(f, np.ndarray) and f.dtype == np.float32 and f.shape == (rd // 2,)
    want = np.array([_plain(i, rd, base) for i in range(rd // 2)])
    np.testing.assert_allclose(f, want, rtol=1e-6, atol=0)
    assert f[0] == 1.0


def test_yarn_ramp_both_ends_small():
    # rd=16, base=1e4, orig=4096, betas 32/1: corr(32) = 2.618..., corr(1) = 5.628...
    # -> low = 2, high = 6, both strictly inside [0, rd/2 = 8).
    rd, base, factor, bf, bs, orig = 16, 10000.0, 4.0, 32, 1, 4096
    low = max(math.floor(_corr(bf, rd, base, orig)), 0)
    high = min(math.ceil(_corr(bs, rd, base, orig)), rd - 1)
    assert (low, high) == (2, 6)
    assert yarn_correction_range(rd, base, bf, bs, orig) == (low, high)

    f = rope_freqs(rd, base, yarn=(factor, bf, bs, orig))
    assert f.dtype == np.float32 and f.shape == (8,)
    for i in range(rd // 2):
        p = _plain(i, rd, base)
        if i <= low:  # fast pairs: untouched
            assert f[i] == pytest.approx(p, rel=1e-6), i
        elif i >= high:  # slow pairs: fully interpolated
            assert f[i] == pytest.approx(p / factor, rel=1e-6), i
    # In between: i = 4 -> ramp = (4-2)/(6-2) = 0.5; i = 3 -> 0.25.
    for i, ramp in [(3, 0.25), (4, 0.5), (5, 0.75)]:
        p = _plain(i, rd, base)
        want = p / factor * ramp + p * (1 - ramp)
        assert f[i] == pytest.approx(want, rel=1e-6), i
        # strictly between the two ends: the ramp direction is "more interpolation as i grows"
        assert p / factor < f[i] < p


def test_yarn_flash_values():
    rd, base, factor, bf, bs, orig = 64, 160000.0, 16.0, 32, 1, 65536
    # By hand: corr(32) = 64*ln(65536/(64*pi))/(2 ln 160000) = 15.45..., corr(1) = 24.70...
    c_fast = _corr(bf, rd, base, orig)
    c_slow = _corr(bs, rd, base, orig)
    assert 15 < c_fast < 16 and 24 < c_slow < 25
    low, high = max(math.floor(c_fast), 0), min(math.ceil(c_slow), rd - 1)
    assert (low, high) == (15, 25)
    assert yarn_correction_range(rd, base, bf, bs, orig) == (15, 25)

    f = rope_freqs(rd, base, yarn=(factor, bf, bs, orig))
    want = []
    for i in range(rd // 2):
        p = _plain(i, rd, base)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want.append(p / factor * ramp + p * (1 - ramp))
    np.testing.assert_allclose(f, np.array(want), rtol=1e-6, atol=0)
    assert f[low] == pytest.approx(_plain(low, rd, base), rel=1e-6)
    assert f[high] == pytest.approx(_plain(high, rd, base) / factor, rel=1e-6)
    assert f[31] == pytest.approx(_plain(31, rd, base) / factor, rel=1e-6)


def test_yarn_bad_tuple():
    with pytest.raises(ValueError):
        rope_freqs(16, 10000.0, yarn=(4.0, 32, 1))


# ----------------------------------------------------------------------------- rotation


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def test_position_zero_is_identity():
    f = rope_freqs(16, 10000.0, yarn=(4.0, 32, 1, 4096))
    x = _rand((3, 5, 40))
    y = apply_rope(x, jnp.zeros((3, 5), jnp.int32), f)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    xb = x.astype(jnp.bfloat16)
    yb = apply_rope(xb, jnp.int32(0), f)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb.astype(jnp.float32)), np.asarray(xb.astype(jnp.float32)))


def test_rope_then_inverse_is_identity():
    f = rope_freqs(64, 160000.0, yarn=(16.0, 32, 1, 65536))
    x = _rand((7, 4, 128), seed=1)
    pos = jnp.array([0, 1, 2, 63, 1000, 65535, 100000], jnp.int32)[:, None]
    y = rope(x, pos, f)
    z = rope(y, pos, f, inverse=True)
    np.testing.assert_allclose(np.asarray(z), np.asarray(x), atol=2e-6, rtol=1e-5)
    # and the forward rotation really moved something
    assert np.abs(np.asarray(y - x)).max() > 0.1


def test_hand_built_rotation():
    rd, base, hd, pos = 4, 10000.0, 8, 7
    f = rope_freqs(rd, base)  # [1, 0.01]
    x = jnp.array([9.0, 8.0, 7.0, 6.0, 1.0, 2.0, 3.0, 4.0], jnp.float32)
    y = np.asarray(apply_rope(x, jnp.int32(pos), f))
    yi = np.asarray(apply_rope(x, jnp.int32(pos), f, inverse=True))
    want, want_inv = [9.0, 8.0, 7.0, 6.0], [9.0, 8.0, 7.0, 6.0]
    for i, (a, b) in enumerate([(1.0, 2.0), (3.0, 4.0)]):
        th = float(np.float32(pos) * np.float32(f[i]))  # fp32(pos) * f_i
        c, s = math.cos(th), math.sin(th)
        want += [a * c - b * s, a * s + b * c]
        want_inv += [a * c + b * s, -a * s + b * c]
    np.testing.assert_allclose(y, np.array(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(yi, np.array(want_inv), rtol=1e-6, atol=1e-6)


def test_only_last_rd_dims_change():
    rd, hd = 16, 48
    f = rope_freqs(rd, 10000.0)
    x = _rand((6, hd), seed=2)
    pos = jnp.arange(1, 7, dtype=jnp.int32) * 13
    y = np.asarray(rope(x, pos, f))
    np.testing.assert_array_equal(y[:, : hd - rd], np.asarray(x)[:, : hd - rd])
    assert np.all(np.abs(y[:, hd - rd :] - np.asarray(x)[:, hd - rd :]).max(axis=-1) > 1e-3)
    # per-pair norms are preserved (it is a rotation)
    pn = lambda v: np.linalg.norm(v[:, hd - rd :].reshape(6, rd // 2, 2), axis=-1)
    np.testing.assert_allclose(pn(y), pn(np.asarray(x)), rtol=1e-5)


def test_relative_position_property():
    f = rope_freqs(32, 160000.0, yarn=(16.0, 32, 1, 65536))
    q = _rand((64,), seed=3)
    k = _rand((64,), seed=4)

    def dot(mq, nk):
        qr = rope(q, jnp.int32(mq), f)
        kr = rope(k, jnp.int32(nk), f)
        return float(jnp.dot(qr, kr, precision=jax.lax.Precision.HIGHEST))

    base = dot(5, 2)
    for mq, nk in [(13, 10), (103, 100), (1003, 1000), (40003, 40000)]:
        assert dot(mq, nk) == pytest.approx(base, rel=1e-4, abs=1e-4)
    assert abs(dot(9, 2) - base) > 1e-2  # a different offset gives a different score


def test_positions_broadcast_and_jit():
    f = rope_freqs(16, 10000.0)
    x = _rand((5, 3, 32), seed=5).astype(jnp.bfloat16)  # [T, H, hd]
    pos = jnp.array([0, 4, 9, 200, 4095], jnp.int32)
    y = apply_rope(x, pos[:, None], f)
    for h in range(3):
        np.testing.assert_array_equal(
            np.asarray(y[:, h].astype(jnp.float32)),
            np.asarray(rope(x[:, h], pos, f).astype(jnp.float32)),
        )
    yj = jax.jit(lambda a, p: apply_rope(a, p, f))(x, pos[:, None])
    np.testing.assert_array_equal(np.asarray(yj.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_bf16_rounded_once_and_out_dtype():
    f = rope_freqs(16, 10000.0)
    x = _rand((4, 24), seed=6).astype(jnp.bfloat16)
    pos = jnp.array([1, 7, 77, 777], jnp.int32)
    y32 = rope(x, pos, f, out_dtype=jnp.float32)  # the fp32 math on the bf16 values
    assert y32.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(y32), np.asarray(rope(x.astype(jnp.float32), pos, f))
    )
    yb = rope(x, pos, f)
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(yb.astype(jnp.float32)), np.asarray(y32.astype(jnp.bfloat16).astype(jnp.float32))
    )


def test_rope_wider_than_vector_rejected():
    with pytest.raises(ValueError):
        apply_rope(jnp.zeros((4, 8)), jnp.zeros((4,), jnp.int32), rope_freqs(16, 10000.0))
