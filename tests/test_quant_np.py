"""quant_np (host-side weight quantizers) must be bitwise equal to the jnp quantizers in `quant`.

Bytes are compared raw (``.view(np.uint8)``), so a -0.0 vs +0.0, a NaN payload or a one-off scale
exponent all count as differences. The inputs are built to hit the edges of the scale rule:
all-zero blocks (amax floor), tiny magnitudes, block amax exactly qmax·2^k (amax/qmax an exact
power of two, where ceil(log2) must not round up) and one fp32 ulp above it (where it must), e4m3 /
e2m1 rounding ties, huge values and shapes that are not multiples of 32.

Inputs are normal fp32 (or zero): XLA's CPU/GPU backends flush fp32 subnormal *inputs* to zero, so
for a subnormal weight value the jnp result is backend-defined and not part of this contract (real
weights are never that small; the tiny blocks here sit at 2^-126..2^-118, below the amax floor).

Only a handful of shapes are used so the jnp side compiles a few programs at most.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.model import quant as Q
from dsv41_jax.model import quant_np as QN

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu


def raw(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def assert_bitwise(got, want, what):
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    gb, wb = raw(g), raw(w)
    bad = np.argwhere(gb != wb)
    assert bad.size == 0, (f"{what}: {len(bad)} bytes differ, first at {tuple(bad[0])}: "
                           f"numpy {gb[tuple(bad[0])]:#04x} vs jnp {wb[tuple(bad[0])]:#04x}")


def f32(x):
    return np.float32(x)


def edge_values(qmax: float, rng) -> list:
    """Lists of 32 fp32 values, each designed as one quantization block."""
    one_ulp_up = lambda v: np.nextafter(f32(v), f32(np.inf))  # noqa: E731
    blocks = [
        np.zeros(32, np.float32),                                   # amax floor
        np.full(32, -0.0, np.float32),                              # negative zeros keep their sign
        # tiny but normal fp32 (amax below the floor qmax·2^-126, so the scale is 2^-126)
        (rng.uniform(1, 4, 32) * rng.choice([-1, 1], 32)).astype(np.float32) * f32(2.0**-126),
        (rng.uniform(1, 4, 32) * rng.choice([-1, 1], 32)).astype(np.float32) * f32(2.0**-120),
        rng.standard_normal(32).astype(np.float32) * f32(2.0**-100),
        rng.standard_normal(32).astype(np.float32) * f32(1e30),     # huge
    ]
    for k in (-20, -7, -1, 0, 1, 5, 30):
        b = rng.uniform(-1, 1, 32).astype(np.float32) * f32(qmax * 2.0**k) * f32(0.9)
        b[rng.integers(32)] = f32(qmax * 2.0**k) * rng.choice([-1, 1])       # amax/qmax == 2^k exactly
        blocks.append(b)
        c = b.copy()
        c[rng.integers(32)] = one_ulp_up(qmax * 2.0**k)                      # amax/qmax just above 2^k
        blocks.append(c)
        d = b.copy()
        d[rng.integers(32)] = np.nextafter(f32(qmax * 2.0**k), f32(0))       # just below
        blocks.append(d)
    # amax a power of two (not qmax·2^k): 2^k/448 has a nonzero mantissa
    for k in (-3, 0, 4):
        b = rng.uniform(-1, 1, 32).astype(np.float32) * f32(2.0**k)
        b[3] = f32(2.0**k)
        blocks.append(b)
    return blocks


def e4m3_ties(rng):
    """A block with scale 1 (amax 448) whose other entries sit exactly between e4m3 grid points."""
    g = np.unique(np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64))
    g = g[np.isfinite(g) & (g >= 0) & (g <= 448)]
    mids = ((g[1:] + g[:-1]) / 2).astype(np.float32)
    b = rng.choice(mids, 32).astype(np.float32) * rng.choice([-1, 1], 32).astype(np.float32)
    b[0] = f32(448.0)
    return b


def e2m1_ties(rng):
    """A block with scale 1 (amax 6) whose other entries are the e2m1 ties and grid points."""
    vals = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                     0.1, 5.9], np.float32)
    b = np.concatenate([vals, -vals])
    b[7] = f32(6.0)
    return b


# ------------------------------------------------------------------------------------------------
# fp8 32x32 blocks
# ------------------------------------------------------------------------------------------------


def fp8_test_matrix(rows, cols, rng):
    """[rows, cols] random normal matrix with edge blocks written into 32x32 tiles."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * f32(0.05)
    blocks = edge_values(448.0, rng) + [e4m3_ties(rng)]
    tiles = [(i, j) for i in range(rows // 32) for j in range(cols // 32)]
    assert len(tiles) >= len(blocks)
    for (i, j), b in zip(tiles, blocks):
        # fill the tile with values drawn from b (so b's amax is the tile amax), then b itself
        t = w[32 * i:32 * i + 32, 32 * j:32 * j + 32]
        t[:] = rng.choice(b, (32, 32))
        t[np.arange(32), rng.permutation(32)] = b
    return w


@pytest.mark.parametrize("shape", [(330, 200), (47, 71)])
def test_fp8_block_bitwise(shape):
    rng = np.random.default_rng(shape[0])
    if shape == (330, 200):
        w = fp8_test_matrix(*shape, rng)  # 10x6 full tiles + a ragged edge
    else:  # ragged in both dims; edge blocks inside the partial tiles too
        w = rng.standard_normal(shape).astype(np.float32)
        w[32:, 64:] = 0.0                                  # the corner tile is all zero
        w[0:15, 32] = f32(448.0 * 2.0**-3)                 # tile (0, 1): amax/448 = 2^-3 exactly
        w[32:, :32] *= f32(1e-4)                           # tile (1, 0) ragged and small ...
        w[40, 0] = np.nextafter(f32(448.0 * 2.0**-10), f32(np.inf))  # ... amax/448 just above 2^-10
    qn, sn = QN.quantize_fp8_block_np(w)
    qj, sj = Q.quantize_fp8_block(jnp.asarray(w))
    assert qn.shape == shape and sn.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    assert_bitwise(qn, np.asarray(qj), "fp8 weight")
    assert_bitwise(sn, np.asarray(sj), "fp8 e8m0 scale")


def test_fp8_block_hand_checked_scales():
    """The numpy quantizer's scale exponents on hand-computed tiles (independent of the jnp one)."""
    w = np.zeros((64, 96), np.float32)
    w[0, 0] = 448.0                                        # tile (0,0): 448/448 = 1 -> 2^0
    w[0, 32] = np.nextafter(f32(448.0 * 2.0**-6), f32(np.inf))  # tile (0,1): just > 2^-6 -> 2^-5
    w[33, 0] = 1.0                                         # tile (1,0): 1/448 in (2^-9, 2^-8] -> 2^-8
    # tile (1,1) and (0,2),(1,2): zero -> floor 448*2^-126 -> 2^-126
    w[40, 70] = 448.0 * 2.0**-10                           # tile (1,2): exactly 2^-10
    q, s = QN.quantize_fp8_block_np(w)
    exps = raw(s).astype(int) - 127
    np.testing.assert_array_equal(exps, [[0, -5, -126], [-8, -126, -10]])
    assert q.astype(np.float32)[0, 0] == 448.0 and q.astype(np.float32)[33, 0] == 256.0
    assert q.astype(np.float32)[0, 32] == 224.0  # (448·2^-6 + ulp)/2^-5 = 224.00001 -> 224
    assert q.astype(np.float32)[40, 70] == 448.0


# ------------------------------------------------------------------------------------------------
# fp8 per-row (Engram tables): per-32 scales along each row
# ------------------------------------------------------------------------------------------------


def jnp_fp8_rows(w):
    """The per-row quantizer built from `quant.quantize_fp8_block`: every 32-wide group gets its own
    32x32 tile (its row 0; the other 31 rows zero, which never raises a tile's amax)."""
    r, d = w.shape
    g = w.reshape(r * d // 32, 32)
    tiles = np.zeros((g.shape[0], 32, 32), np.float32)
    tiles[:, 0, :] = g
    q, s = Q.quantize_fp8_block(jnp.asarray(tiles.reshape(-1, 32)))
    q = np.asarray(q).reshape(g.shape[0], 32, 32)[:, 0, :].reshape(r, d)
    return q, np.asarray(s).reshape(r, d // 32)


def test_fp8_rows_bitwise():
    rng = np.random.default_rng(7)
    blocks = edge_values(448.0, rng) + [e4m3_ties(rng)]
    n_rows = 12
    w = rng.standard_normal((n_rows, 128)).astype(np.float32)
    flat = w.reshape(-1, 32)
    flat[:len(blocks)] = np.stack(blocks)
    w = flat.reshape(n_rows, 128)
    qn, sn = QN.quantize_fp8_rows_np(w)
    qj, sj = jnp_fp8_rows(w)
    assert qn.shape == (n_rows, 128) and sn.shape == (n_rows, 4)
    assert_bitwise(qn, qj, "fp8-rows weight")
    assert_bitwise(sn, sj, "fp8-rows e8m0 scale")
    # and against the activation quant where its 1e-4 amax floor does not bite (amax > 1e-4 rows)
    xq, s = Q.act_quant_fp8(jnp.asarray(w))
    amax = np.abs(w.reshape(n_rows, 4, 32)).max(-1)
    ok = amax > 1e-4
    np.testing.assert_array_equal(np.asarray(s)[ok], sn.astype(np.float32)[ok])
    okx = np.repeat(ok, 32, axis=1)
    np.testing.assert_array_equal(raw(np.asarray(xq))[okx], raw(qn)[okx])


# ------------------------------------------------------------------------------------------------
# MXFP4 (routed experts)
# ------------------------------------------------------------------------------------------------


def test_mxfp4_bitwise_stacked_experts():
    rng = np.random.default_rng(11)
    E, out_dim, in_dim = 3, 16, 96
    w = rng.standard_normal((E, out_dim, in_dim)).astype(np.float32) * f32(0.1)
    blocks = edge_values(6.0, rng) + [e2m1_ties(rng)]
    flat = w.reshape(-1, 32)
    flat[:len(blocks)] = np.stack(blocks)
    w = flat.reshape(E, out_dim, in_dim)
    qn, sn = QN.quantize_mxfp4_np(w)
    assert qn.dtype == np.uint8 and qn.shape == (E, out_dim, in_dim // 2)
    assert sn.dtype == E8M0 and sn.shape == (E, out_dim, in_dim // 32)
    for e in range(E):  # quant.quantize_mxfp4 is 2-D: one expert at a time (same shape: one compile)
        qj, sj = Q.quantize_mxfp4(jnp.asarray(w[e]))
        assert_bitwise(qn[e], np.asarray(qj), f"mxfp4 packed, expert {e}")
        assert_bitwise(sn[e], np.asarray(sj), f"mxfp4 e8m0 scale, expert {e}")


def test_mxfp4_hand_checked():
    """Independent of jnp: scale exponent rule and the low-nibble-first packing."""
    w = np.zeros((2, 64), np.float32)
    w[0, :4] = [6.0, -0.5, 0.25, 0.75]          # amax 6 -> s = 1; 0.25 -> 0 (tie to even), 0.75 -> 1
    # amax/6 just above 2^-9 -> s = 2^-8: (6·2^-9 + ulp)/2^-8 -> 3; 3·2^-9/2^-8 = 1.5
    w[0, 32:34] = [np.nextafter(f32(6.0 * 2.0**-9), f32(np.inf)), f32(3.0 * 2.0**-9)]
    w[1, 0] = 6.0 * 2.0**-5                     # s = 2^-5 exactly
    q, s = QN.quantize_mxfp4_np(w)
    np.testing.assert_array_equal(raw(s).astype(int) - 127, [[0, -8], [-5, -126]])
    # byte 0: even element 6 (code 7) low, odd -0.5 (8|1 = 9) high -> 0x97; byte 1: 0 | 1<<4 = 0x20
    assert q[0, 0] == 0x97 and q[0, 1] == 0x20
    # byte 16: 3 (code 5) low, 1.5 (code 3) high -> 0x35
    assert q[0, 16] == 0x35
    assert q[1, 0] == 0x07
