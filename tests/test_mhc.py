"""Tests for dsv41_jax.model.mhc (docs/design/spec.md §2).

Expected values come from plain-Python (double) re-derivations written in the test.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model.mhc import hc_mixes, hc_post, hc_pre, sinkhorn

BF16 = jnp.bfloat16

# Jitted entry points (how the model calls them; one compile per shape instead of one per
# primitive keeps the suite fast).  The hand-checked tests call the functions eagerly.
j_pre = jax.jit(hc_pre, static_argnums=2)
j_post = jax.jit(hc_post, static_argnums=4)


def _sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def _py_sinkhorn(logits, iters, eps):
    """docs/design/spec.md §2 Sinkhorn on a list-of-lists, in double."""
    n = len(logits)
    c = []
    for row in logits:
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        s = sum(e)
        c.append([v / s + eps for v in e])

    def cols(c):
        cs = [sum(c[i][j] for i in range(n)) + eps for j in range(n)]
        return [[c[i][j] / cs[j] for j in range(n)] for i in range(n)]

    def rows(c):
        return [[v / (sum(r) + eps) for v in r] for r in c]

    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    return c


# ----------------------------------------------------------------------------- Sinkhorn


def test_sinkhorn_20_iters():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((6, 4, 4)).astype(np.float32) * 3)
    c = np.asarray(sinkhorn(logits, 20, 1e-6))
    assert c.dtype == np.float32 and c.shape == (6, 4, 4)
    assert np.all(c > 0)
    np.testing.assert_allclose(c.sum(-2), 1.0, atol=1e-5)  # ends on a column step
    np.testing.assert_allclose(c.sum(-1), 1.0, atol=5e-2)  # rows: only approximately
    want = [_py_sinkhorn(np.asarray(logits[b]).tolist(), 20, 1e-6) for b in range(6)]
    np.testing.assert_allclose(c, np.array(want), rtol=1e-5, atol=1e-6)


def test_sinkhorn_ends_on_column_step():
    # A skewed matrix: after one iteration (softmax rows, then columns) the columns sum to 1
    # but the rows clearly do not.
    logits = jnp.array([[4.0, 0.0, 0.0], [4.0, 1.0, 0.0], [0.0, 0.0, 3.0]], jnp.float32)
    c = np.asarray(sinkhorn(logits, 1, 1e-6))
    np.testing.assert_allclose(c.sum(0), 1.0, atol=1e-5)
    assert np.abs(c.sum(1) - 1.0).max() > 0.2
    # With more iterations the row error shrinks, the column sums stay at 1.
    c5 = np.asarray(sinkhorn(logits, 5, 1e-6))
    np.testing.assert_allclose(c5.sum(0), 1.0, atol=1e-5)
    assert np.abs(c5.sum(1) - 1.0).max() < np.abs(c.sum(1) - 1.0).max()


def test_sinkhorn_2x2_one_iteration_by_hand():
    # rows softmax: [0, 0] -> [1/2, 1/2]; [ln 3, 0] -> [3/4, 1/4].  eps = 0.01 (large, so it
    # shows): +eps -> [[.51, .51], [.76, .26]]; column sums 1.27, .77 (+eps -> 1.28, .78).
    eps = 0.01
    c = np.asarray(sinkhorn(jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]], jnp.float32), 1, eps))
    want = np.array([[0.51 / 1.28, 0.51 / 0.78], [0.76 / 1.28, 0.26 / 0.78]])
    np.testing.assert_allclose(c, want, rtol=2e-6)
    # column sums are 1 only up to eps: (x)/(x+eps)
    np.testing.assert_allclose(c.sum(0), [1.27 / 1.28, 0.77 / 0.78], rtol=2e-6)


def test_sinkhorn_jit_and_bad_iters():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4)).astype(np.float32))
    f = jax.jit(functools.partial(sinkhorn, iters=20, eps=1e-6))
    np.testing.assert_allclose(np.asarray(f(logits)), np.asarray(sinkhorn(logits, 20, 1e-6)), rtol=1e-6)
    with pytest.raises(ValueError):
        sinkhorn(logits, 0, 1e-6)


# ----------------------------------------------------------------------------- hc_mixes

# n = 2, D = 2: mix width (2+n)*n = 8, hc_dim n*D = 4.
# h = [[1, 3], [1, -1]] -> stream-major flat [1, 3, 1, -1] (stream-minor would be [1, 1, 3, -1]);
# mean(h^2) = 12/4 = 3; with norm_eps = 1 the rsqrt is exactly 0.5.
H_TINY = [[1.0, 3.0], [1.0, -1.0]]
FN_TINY = [
    [1, 0, 0, 0],  # pre0   -> flat[0] = 1
    [0, 1, 0, 0],  # pre1   -> flat[1] = 3   (would be 1 if flattened stream-minor)
    [0, 0, 1, 0],  # post0  -> 1
    [0, 0, 0, 1],  # post1  -> -1
    [2, 0, 0, 0],  # C[0,0] -> 2
    [0, 2, 0, 0],  # C[0,1] -> 6
    [0, 0, -2, 0],  # C[1,0] -> -2
    [0, 0, 0, 0],  # C[1,1] -> 0
]
BASE_TINY = [0.1, -0.2, 0.3, -0.4, 0.5, 0.0, -0.5, 0.25]
SCALE_TINY = [2.0, 0.5, 1.5]


def _tiny_expected(hc_eps, iters):
    flat = [v for stream in H_TINY for v in stream]
    r = 1.0 / math.sqrt(sum(v * v for v in flat) / 4 + 1.0)
    assert r == 0.5
    m = [sum(a * b for a, b in zip(row, flat)) * r for row in FN_TINY]
    pre = [_sig(m[i] * SCALE_TINY[0] + BASE_TINY[i]) + hc_eps for i in range(2)]
    post = [2 * _sig(m[2 + i] * SCALE_TINY[1] + BASE_TINY[2 + i]) for i in range(2)]
    logits = [[m[4 + 2 * i + j] * SCALE_TINY[2] + BASE_TINY[4 + 2 * i + j] for j in range(2)] for i in range(2)]
    return m, pre, post, _py_sinkhorn(logits, iters, hc_eps)


def _tiny_args():
    return (
        jnp.array(H_TINY, jnp.float32),
        jnp.array(FN_TINY, jnp.float32),
        jnp.array(BASE_TINY, jnp.float32),
        jnp.array(SCALE_TINY, jnp.float32),
    )


def test_hc_mixes_tiny_layout():
    hc_eps, iters = 0.01, 3  # a big hc_eps so its use is visible
    h, fn, base, scale = _tiny_args()
    pre, post, comb = hc_mixes(h, fn, base, scale, norm_eps=1.0, hc_eps=hc_eps, sinkhorn_iters=iters)
    assert pre.shape == (2,) and post.shape == (2,) and comb.shape == (2, 2)
    assert pre.dtype == post.dtype == comb.dtype == jnp.float32
    m, want_pre, want_post, want_comb = _tiny_expected(hc_eps, iters)
    assert m == [0.5, 1.5, 0.5, -0.5, 1.0, 3.0, -1.0, 0.0]
    np.testing.assert_allclose(np.asarray(pre), want_pre, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(post), want_post, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(comb), np.array(want_comb), rtol=1e-5)
    # hc_eps is added to pre (on top of the sigmoid)
    np.testing.assert_allclose(
        np.asarray(pre) - hc_eps, [_sig(m[i] * 2.0 + BASE_TINY[i]) for i in range(2)], rtol=1e-5
    )
    # comb is row-major.  A converged 2x2 doubly-stochastic matrix is symmetric, so look at
    # one iteration, where reading the logits transposed gives a clearly different matrix.
    _, _, c1 = hc_mixes(h, fn, base, scale, norm_eps=1.0, hc_eps=hc_eps, sinkhorn_iters=1)
    logits = [[m[4 + 2 * i + j] * 1.5 + BASE_TINY[4 + 2 * i + j] for j in range(2)] for i in range(2)]
    assert logits == [[2.0, 4.5], [-2.0, 0.25]]
    np.testing.assert_allclose(np.asarray(c1), np.array(_py_sinkhorn(logits, 1, hc_eps)), rtol=1e-5)
    col_major = _py_sinkhorn([list(r) for r in zip(*logits)], 1, hc_eps)
    assert np.abs(np.asarray(c1) - np.array(col_major)).max() > 0.1


def test_hc_mixes_batched_post_range_and_jit():
    rng = np.random.default_rng(2)
    n, d, t = 4, 8, 5
    h = jnp.asarray(rng.standard_normal((t, n, d)).astype(np.float32) * 3)
    fn = jnp.asarray(rng.standard_normal(((2 + n) * n, n * d)).astype(np.float32) * 2)
    base = jnp.asarray(rng.standard_normal(((2 + n) * n,)).astype(np.float32))
    # moderate scales: with large ones the fp32 sigmoid saturates and post hits 2.0 exactly
    scale = jnp.array([0.3, 0.3, 1.0], jnp.float32)
    kw = dict(norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)
    pre, post, comb = hc_mixes(h, fn, base, scale, **kw)
    assert pre.shape == (t, n) and post.shape == (t, n) and comb.shape == (t, n, n)
    assert np.all(np.asarray(post) > 0) and np.all(np.asarray(post) < 2)
    assert np.all(np.asarray(pre) >= 1e-6)
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-5)
    # each token equals the unbatched call (up to fp32 matmul summation order)
    jm = jax.jit(functools.partial(hc_mixes, **kw))
    p1, q1, c1 = jm(h[3], fn, base, scale)
    np.testing.assert_allclose(np.asarray(pre[3]), np.asarray(p1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(post[3]), np.asarray(q1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(comb[3]), np.asarray(c1), rtol=1e-5, atol=1e-7)
    # jit of the batched call
    for a, b in zip(jm(h, fn, base, scale), (pre, post, comb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # bf16 streams: the mixes are the fp32 math on the bf16 values
    hb = h.astype(BF16)
    for a, b in zip(jm(hb, fn, base, scale), jm(hb.astype(jnp.float32), fn, base, scale)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hc_mixes_shape_checks():
    h, fn, base, scale = _tiny_args()
    kw = dict(norm_eps=1.0, hc_eps=1e-6, sinkhorn_iters=2)
    with pytest.raises(ValueError):
        hc_mixes(h, fn[:6], base, scale, **kw)
    with pytest.raises(ValueError):
        hc_mixes(h, fn, base[:6], scale, **kw)


# ----------------------------------------------------------------------------- hc_pre / hc_post


def test_hc_pre_by_hand():
    h = jnp.array([[1.0, 2.0, -3.0], [4.0, 0.5, 1.0]], jnp.float32)  # n=2, D=3
    pre = jnp.array([0.5, 2.0], jnp.float32)
    out = hc_pre(h, pre, jnp.float32)
    assert out.shape == (3,) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), [0.5 * 1 + 2 * 4, 0.5 * 2 + 2 * 0.5, 0.5 * -3 + 2 * 1])
    # batched, one-hot (the first layer's pre_prev) picks stream 0
    hb = jnp.stack([h, 2 * h])
    oh = jnp.array([[1.0, 0.0], [1.0, 0.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(hc_pre(hb, oh)), np.asarray(hb[:, 0]))


def test_hc_post_by_hand():
    y = jnp.array([1.0, -2.0], jnp.float32)  # D=2
    h = jnp.array([[3.0, 1.0], [-1.0, 5.0]], jnp.float32)  # n=2
    post = jnp.array([0.5, 1.5], jnp.float32)
    comb = jnp.array([[0.25, 0.75], [0.125, 0.875]], jnp.float32)  # not symmetric
    out = np.asarray(hc_post(y, h, post, comb, jnp.float32))
    want = [
        [post[j] * y[d] + sum(comb[i, j] * h[i, d] for i in range(2)) for d in range(2)]
        for j in range(2)
    ]
    want = np.array([[float(v) for v in row] for row in want])
    # by hand: out_0 = .5*[1,-2] + .25*[3,1] + .125*[-1,5] = [1.125, -0.125]
    np.testing.assert_array_equal(want[0], [1.125, -0.125])
    np.testing.assert_array_equal(out, want)


def _dyadic(rng, shape, num, den):
    """Random multiples of 1/den in [-num/den, num/den]: exact in bf16 / fp32 as needed."""
    return rng.integers(-num, num + 1, size=shape).astype(np.float64) / den


def test_bf16_rounded_once():
    # Inputs are dyadic so the fp32 math is exact; the result has more bits than bf16 keeps,
    # so the single final rounding is what is being checked (against float64 -> bf16).
    rng = np.random.default_rng(3)
    t, n, d = 3, 4, 16
    h = _dyadic(rng, (t, n, d), 64, 16)  # <= 7 significant bits: exact in bf16
    y = _dyadic(rng, (t, d), 64, 16)
    pre = _dyadic(rng, (t, n), 512, 256)
    post = _dyadic(rng, (t, n), 512, 256)
    comb = _dyadic(rng, (t, n, n), 512, 256)
    hb, yb = jnp.asarray(h, BF16), jnp.asarray(y, BF16)
    assert np.array_equal(np.asarray(hb.astype(jnp.float32)), h)

    want_pre = np.einsum("tn,tnd->td", pre, h)
    want_post = post[:, :, None] * y[:, None, :] + np.einsum("tij,tid->tjd", comb, h)
    got_pre = j_pre(hb, jnp.asarray(pre, jnp.float32), BF16)
    got_post = j_post(yb, hb, jnp.asarray(post, jnp.float32), jnp.asarray(comb, jnp.float32), BF16)
    assert got_pre.dtype == BF16 and got_post.dtype == BF16
    np.testing.assert_array_equal(
        np.asarray(got_pre.astype(jnp.float32)), np.asarray(jnp.asarray(want_pre, jnp.float32).astype(BF16).astype(jnp.float32))
    )
    np.testing.assert_array_equal(
        np.asarray(got_post.astype(jnp.float32)), np.asarray(jnp.asarray(want_post, jnp.float32).astype(BF16).astype(jnp.float32))
    )
    # the test really exercises rounding
    assert not np.array_equal(np.asarray(got_post.astype(jnp.float32)), want_post)

    # Single vs per-term rounding: 1*(1 + 2^-8) + 1*2^-8 = 1 + 2^-7 (a bf16 value), while
    # rounding the first product to bf16 (tie -> even -> 1.0) would give 1.0.
    ones = jnp.ones((2, 1), BF16)
    p = jnp.array([1 + 2.0**-8, 2.0**-8], jnp.float32)
    assert float(j_pre(ones, p, BF16)[0]) == 1 + 2.0**-7
    c = jnp.array([[1 + 2.0**-8, 0.0], [2.0**-8, 0.0]], jnp.float32)
    o = j_post(jnp.zeros((1,), BF16), ones, jnp.zeros((2,), jnp.float32), c, BF16)
    assert float(o[0, 0]) == 1 + 2.0**-7


def test_pre_post_jit_default_dtype():
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.standard_normal((2, 4, 8)), BF16)
    y = jnp.asarray(rng.standard_normal((2, 8)), BF16)
    pre = jnp.asarray(rng.random((2, 4)), jnp.float32)
    comb = jnp.asarray(rng.random((2, 4, 4)), jnp.float32)
    a = jax.jit(hc_pre)(h, pre)
    b = jax.jit(hc_post)(y, h, pre, comb)
    assert a.dtype == BF16 and b.dtype == BF16 and b.shape == (2, 4, 8)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(hc_pre(h, pre).astype(jnp.float32)))
    np.testing.assert_array_equal(
        np.asarray(b.astype(jnp.float32)), np.asarray(hc_post(y, h, pre, comb).astype(jnp.float32))
    )
    f32 = jax.jit(hc_pre, static_argnums=2)(h, pre, jnp.float32)
    assert f32.dtype == jnp.float32
