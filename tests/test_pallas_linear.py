"""The fused fp8 / MXFP4 GEMM kernel (dsv41_jax/pallas/quant_linear.py) against the linear seam's "xla"
path (`linear.fp8` / `linear.mxfp4`), natively on a GPU and in interpret mode elsewhere (`pallas_impl`).

Both compute the same per-element arithmetic — the same fp8 quantization of the activation (per 32
along K), the same exact products (bf16-exact operands), one rounding of the fp32 sum to the output
dtype — and differ only in the fp32 summation order. So:

* **bitwise** on "order-free" weights: every weight row has at most two nonzero codes (at random
  columns, under random scales), so each output is a sum of at most two nonzero products and every
  summation order gives the same fp32 sum. Everything else (the in-kernel activation quant, the weight
  and scale decode, which scale block a row and a K chunk read, the padding of rows, the tiles) must
  match bit for bit, in the bf16 and fp32 flows;
* **within a stated bound** on dense random weights: |kernel − exact| ≤ K·2^-24·(|x̂|·|ŵ|ᵀ) elementwise in
  the fp32 flow (the fp32-summation error bound of exact products, x̂, ŵ the quantized operands, "exact"
  an fp64 sum on the host — the xla path meets the same bound), and in the bf16 flow at most one bf16
  ulp of the output from the xla path's value (the two fp32 sums round to neighbouring bf16 values at most).

Shapes (interpret mode is slow: tiny grids): N with a partial 32-row scale block (fp8: 48 rows, 2 scale
rows), K = 320 (5 chunks of 64: K is 5·2^k like flash's), rows 1 (decode), 5 (ragged: a 16-row block),
70 (two 64-row blocks), and a [2, 3, K] activation (lead axes flattened).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, codec, dispatch, linear, quant, tiling
from dsv41_jax.model.rope import apply_rope, rope_freqs
from dsv41_jax.model.weights import Fp8, Mxfp4, Stacked
from dsv41_jax.pallas import costs
from dsv41_jax.pallas import quant_linear as ql
from dsv41_jax.parallel.plan import MeshPlan

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
_CFG = {m: ModelConfig.preset("tiny").replace(act_dtype=m, impl="xla") for m in ("bfloat16", "float32", "exact")}


def _weight(rng, fmt, N, K, order_free):
    """A stored weight: fp8 {e4m3 [N, K], E8M0 [⌈N/32⌉, K/32]} or MXFP4 {uint8 [N, K/2], E8M0 [N, K/32]}
    (scales 2^-5 .. 2^0). order_free: at most two nonzero codes per row."""
    if fmt == "fp8":
        if order_free:
            codes = np.zeros((N, K), np.uint8)
            cols = np.argsort(rng.random((N, K)), axis=-1)[:, :2]
            np.put_along_axis(codes, cols, rng.integers(1, 0x7F, (N, 2)).astype(np.uint8) |
                              (rng.integers(0, 2, (N, 2)) << 7).astype(np.uint8), axis=-1)
        else:
            codes = rng.integers(0, 256, (N, K)).astype(np.uint8)
            codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN codes
        w = jax.lax.bitcast_convert_type(jnp.asarray(codes), quant.FP8)
        srows = -(-N // 32)
    else:
        if order_free:
            c = np.zeros((N, K), np.uint8)
            cols = np.argsort(rng.random((N, K)), axis=-1)[:, :2]
            np.put_along_axis(c, cols, rng.integers(1, 16, (N, 2)).astype(np.uint8), axis=-1)
            c[c == 8] = 9  # -0 is not a nonzero
            codes = c[:, 0::2] | (c[:, 1::2] << 4)
        else:
            codes = rng.integers(0, 256, (N, K // 2)).astype(np.uint8)
        w = jnp.asarray(codes)
        srows = N
    s = jax.lax.bitcast_convert_type(jnp.asarray(rng.integers(122, 128, (srows, K // 32)).astype(np.uint8)), quant.E8M0)
    return (Fp8 if fmt == "fp8" else Mxfp4)(weight=w, scale=s)


_xla = jax.jit(lambda x, p, fmt, mode, dt: ql.ref_linear(x, p, fmt, dt, _CFG[mode]), static_argnums=(2, 3, 4))


def _kern(impl, **knobs):
    return jax.jit(lambda x, p, fmt, mode, dt: ql.kernel(x, p, fmt, dt, _CFG[mode], interpret=impl == "pallas_interpret",
                                                        **knobs), static_argnums=(2, 3, 4))


def _run(impl, x, p, fmt, mode, **knobs):
    dt = BF16 if mode == "bfloat16" else F32
    xin = x.astype(dt)
    got = _kern(impl, **knobs)(xin, p, fmt, mode, dt)
    want = _xla(xin, p, fmt, mode, dt)
    assert got.dtype == want.dtype == dt and got.shape == want.shape
    return np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))


# (seed, fmt, x shape, N, K)
CASES = {
    "fp8_b1": (1, "fp8", (1, 320), 96, 320),
    "fp8_ragged_partial_scale_block": (2, "fp8", (5, 320), 48, 320),
    "fp8_two_row_blocks": (3, "fp8", (70, 320), 64, 320),
    "fp8_lead_axes": (4, "fp8", (2, 3, 320), 32, 320),
    "mxfp4_b1": (5, "mxfp4", (1, 320), 64, 320),
    "mxfp4_ragged": (6, "mxfp4", (5, 256), 48, 256),
}


def _case(name, order_free):
    seed, fmt, xs, N, K = CASES[name]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(np.float32) * 2.0 ** rng.integers(-3, 4, xs)
    return jnp.asarray(x), _weight(rng, fmt, N, K, order_free), fmt


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_bitwise_on_order_free_weights(pallas_impl, name):
    x, p, fmt = _case(name, True)
    for mode in ("bfloat16", "float32"):
        got, want = _run(pallas_impl, x, p, fmt, mode)
        assert np.abs(want).max() > 0 and (want != 0).mean() > 0.5
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {mode}")


def _exact(x, p, fmt):
    """(fp64 x̂·ŵᵀ, fp64 |x̂|·|ŵ|ᵀ) on the host from the quantized operands."""
    xd = np.asarray(quant.fake_quant_fp8(x.astype(jnp.float32), out_dtype=jnp.float32), np.float64)
    if fmt == "fp8":
        wd = quant.dequantize_fp8_block(p.weight, p.scale, jnp.float32)
    else:
        wd = quant.dequantize_mxfp4(p.weight, p.scale, jnp.float32)
    wd = np.asarray(wd, np.float64)
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


@pytest.mark.parametrize("name", ["fp8_two_row_blocks", "fp8_b1", "mxfp4_ragged"])
def test_kernel_dense_weights_within_the_summation_bound(pallas_impl, name):
    x, p, fmt = _case(name, False)
    K = x.shape[-1]
    exact, mag = _exact(x, p, fmt)
    bound = K * 2.0 ** -24 * mag
    got, want = _run(pallas_impl, x, p, fmt, "float32")
    assert (np.abs(got - exact) <= bound).all(), float((np.abs(got - exact) / np.maximum(bound, 1e-30)).max())
    assert (np.abs(want - exact) <= bound).all()  # the oracle meets the same bound
    got, want = _run(pallas_impl, x, p, fmt, "bfloat16")
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -126))) - 7)
    assert (np.abs(got - want) <= ulp).all()


def test_tiling_knobs_change_no_bit_on_order_free_weights(pallas_impl):
    """Other tiles (narrow and wide output tiles, deep and shallow K chunks, 16-row blocks over 70 rows)
    give bitwise the same outputs (order-free weights), so a tuning candidate cannot change results."""
    x, p, fmt = _case("fp8_two_row_blocks", True)
    base, _ = _run(pallas_impl, x, p, fmt, "bfloat16")
    for kn in (dict(block_n=16, block_k=64), dict(block_n=64, block_k=32, block_m=16)):
        got, _ = _run(pallas_impl, x, p, fmt, "bfloat16", **kn)
        np.testing.assert_array_equal(got, base, err_msg=str(kn))


def test_in_kernel_activation_quant_edges(pallas_impl):
    """Rows built to hit the activation quant's edges (exact e4m3 ties, ±0, subnormals, block maxima at
    powers of two and at the 1e-4 floor, an all-zero row) against identity-like weights: each output is
    one product, so the kernel must reproduce `quant.fake_quant_fp8` of x bit for bit (−0 as +0)."""
    rng = np.random.default_rng(12)
    ties = (np.arange(8, 16) + 0.5) * 2.0 ** rng.integers(-9, 5, 8)
    rows = [np.concatenate([ties, -ties, [0.0, -0.0], 2.0 ** -np.arange(6, 18), [448.0, 2.0 ** -8]]),
            rng.standard_normal(32) * 2.0 ** rng.integers(-20, 10, 32), np.full(32, 3e-5), np.zeros(32)]
    K = 64
    x = np.stack([np.resize(r, K) for r in rows]).astype(np.float32)  # [4, 64]
    # weight row n holds code 0x38 (1.0) at column n only, scale 2^0: output [m, n] = x̂[m, n]
    codes = np.zeros((K, K), np.uint8)
    codes[np.arange(K), np.arange(K)] = 0x38
    p = Fp8(weight=jax.lax.bitcast_convert_type(jnp.asarray(codes), quant.FP8),
            scale=jax.lax.bitcast_convert_type(jnp.full((2, 2), 127, jnp.uint8), quant.E8M0))
    got = _kern(pallas_impl)(jnp.asarray(x), p, "fp8", "float32", F32)
    # + 0.0: a GEMM output is a sum that includes +0 products, so a quantized −0 comes out as +0
    want = np.asarray(quant.fake_quant_fp8(jnp.asarray(x), out_dtype=jnp.float32)) + np.float32(0.0)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


def test_shapes_the_tiles_cannot_cover_are_refused():
    x = jnp.zeros((1, 96), jnp.float32)
    with pytest.raises(NotImplementedError, match="block_n"):  # N = 24: no power-of-two tile >= 16 divides it
        ql.kernel(x, Fp8(weight=jnp.zeros((24, 96), quant.FP8), scale=jnp.zeros((1, 3), quant.E8M0)), "fp8", F32,
                  interpret=True)
    with pytest.raises(ValueError, match="K = 64"):
        ql.kernel(x, Fp8(weight=jnp.zeros((32, 64), quant.FP8), scale=jnp.zeros((1, 2), quant.E8M0)), "fp8", F32,
                  interpret=True)
    empty = ql.kernel(jnp.zeros((0, 64), jnp.float32), Fp8(weight=jnp.zeros((32, 64), quant.FP8),
                                                          scale=jnp.zeros((1, 2), quant.E8M0)), "fp8", BF16)
    assert empty.shape == (0, 32) and empty.dtype == BF16


# ------------------------------------------------------------------------------------------- seam

def test_seam_runs_the_kernel_and_refuses_the_exact_mode_and_a_mesh(pallas_impl, cpu8):
    """linear.fp8 / linear.mxfp4 with linear=<kernel> run the kernel (bitwise its direct call); the bf16
    matmul kinds keep the xla path; the exact / deterministic modes and a mesh are refused clearly."""
    x, p, fmt = _case("fp8_ragged_partial_scale_block", False)
    cfg = _CFG["float32"].replace(impl=f"xla,linear={pallas_impl}")
    got = jax.jit(lambda x, p: linear.fp8(x, p, cfg, F32))(x, p)
    want = _kern(pallas_impl)(x, p, "fp8", "float32", F32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    x4, p4, _ = _case("mxfp4_b1", False)
    got = jax.jit(lambda x, p: linear.mxfp4(x, p, cfg, F32))(x4, p4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_kern(pallas_impl)(x4, p4, "mxfp4", "float32", F32)))
    assert dispatch.kernel("linear", pallas_impl) is ql.kernel
    w = jnp.asarray(np.random.default_rng(3).standard_normal((16, 320)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(linear.f32(x, w, cfg)), np.asarray(linear.f32(x, w, _CFG["float32"])))
    for mode in (dict(act_dtype="exact"), dict(deterministic=True)):
        with pytest.raises(dispatch.ImplError, match="accumulates in fp64"):
            linear.fp8(x, p, _CFG["float32"].replace(impl=f"xla,linear={pallas_impl}", **mode), F32)
    par = MeshPlan(jax.sharding.Mesh(np.array(cpu8[:2]).reshape(1, 2), ("tp", "ep")))
    with tiling.on_mesh(par), pytest.raises(dispatch.ImplError, match="one device"):
        linear.fp8(x, p, cfg, F32)


def _swiglu(dt):
    from dsv41_jax.model import moe

    return lambda g, u: moe._swiglu_act(g, u, None, 0.75, dt)  # a limit inside the outputs' range: clamps bite


@pytest.mark.parametrize("name", ["fp8_b1", "fp8_ragged_partial_scale_block"])
def test_gated_pair_bitwise_on_order_free_weights(pallas_impl, name):
    """The gated pair (the shared expert's w1 / w3 + SwiGLU in one launch) equals the separate xla calls bit
    for bit on order-free weights (each GEMM output then is the same fp32 sum), bf16 and fp32 flows: the plan's
    linear kernel with ``p_up`` / ``act`` (as `moe.moe` calls it where `StepPlan.linear_kernel`) against its plain
    form there, ``act(linear.fp8(x, w1), linear.fp8(x, w3))`` on the xla seam; a stacked pair reads its layer in
    place."""
    from dsv41_jax.model.plan import StepPlan

    x, p1, fmt = _case(name, True)
    rng = np.random.default_rng(11)
    N, K = p1.weight.shape
    p3 = _weight(rng, fmt, N, K, True)
    for mode in ("bfloat16", "float32"):
        dt = BF16 if mode == "bfloat16" else F32
        kcfg = _CFG[mode].replace(impl=f"xla,linear={pallas_impl}")
        kernel = StepPlan.of(kcfg).kernels["linear", "kernel"]
        xin = x.astype(dt)
        got = jax.jit(lambda x, p1, p3: kernel(x, p1, "fp8", dt, kcfg, p_up=p3, act=_swiglu(dt)))(xin, p1, p3)
        want = jax.jit(lambda x, p1, p3: _swiglu(dt)(*(linear.fp8(x, q, _CFG[mode], dt) for q in (p1, p3))))(xin, p1,
                                                                                                            p3)
        g, u = (_xla(xin, q, fmt, mode, dt) for q in (p1, p3))
        np.testing.assert_array_equal(np.asarray(want.astype(F32)), np.asarray(_swiglu(dt)(g, u).astype(F32)))
        clamped = np.abs(np.asarray(u.astype(F32))) > 0.75
        assert clamped.any() and (~clamped).any()
        assert got.dtype == want.dtype == dt and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)), err_msg=f"{name} {mode}")
    st, st3 = (jax.tree_util.tree_map(lambda a: jnp.stack([jnp.zeros_like(a), a]), q) for q in (p1, p3))
    kern = ql.kernel(x, Stacked(st, jnp.int32(1)), fmt, F32, interpret=pallas_impl == "pallas_interpret",
                     p_up=Stacked(st3, jnp.int32(1)), act=_swiglu(F32))
    np.testing.assert_array_equal(np.asarray(kern), np.asarray(ql.kernel(x, p1, fmt, F32, p_up=p3, act=_swiglu(F32),
                                                                          interpret=pallas_impl == "pallas_interpret")))
    with pytest.raises(ValueError, match="go together"):
        ql.kernel(x, p1, fmt, F32, p_up=p3)


@pytest.mark.parametrize("name", ["fp8_b1", "fp8_ragged_partial_scale_block"])
def test_normed_input_equals_the_norm_then_the_gemm(pallas_impl, name):
    """``norm=`` (q_norm run inside wq_b's kernel, `linear.fp8_normed`) equals `norm.rmsnorm` then the GEMM, and
    with ``rope=`` (the q RoPE as its epilogue) `rope.apply_rope` of that:
    with integer-valued rows (Σx² exact in any order) and order-free weights, bit for bit, in the bf16 and fp32
    flows, through the seam against the xla seam (natively this also asks that Triton's rsqrt be XLA:GPU's:
    both call libdevice's). A stacked norm weight and weight (layer 1 of 2) read in place equal the unstacked
    call; mismatched stacking is refused."""
    from dsv41_jax.model import norm

    _, p, fmt = _case(name, True)
    seed, _, xs, N, K = CASES[name]
    rng = np.random.default_rng(seed + 100)
    x = jnp.asarray(rng.integers(-6, 7, xs).astype(np.float32))
    nw = jnp.asarray(rng.uniform(0.5, 2.0, K), BF16)
    interp = pallas_impl == "pallas_interpret"
    for mode in ("bfloat16", "float32"):
        dt = BF16 if mode == "bfloat16" else F32
        kcfg = _CFG[mode].replace(impl=f"xla,linear={pallas_impl}")
        xin = x.astype(dt)
        got = jax.jit(lambda x, nw, p: linear.fp8_normed(x, nw, 1e-6, p, kcfg, dt))(xin, nw, p)
        want = jax.jit(lambda x, nw, p: linear.fp8_normed(x, nw, 1e-6, p, _CFG[mode], dt))(xin, nw, p)
        oracle = _xla(norm.rmsnorm(xin, nw, 1e-6, dt), p, fmt, mode, dt)
        np.testing.assert_array_equal(np.asarray(want.astype(F32)), np.asarray(oracle.astype(F32)))
        assert got.dtype == dt and got.shape == want.shape
        assert np.abs(np.asarray(want.astype(F32))).max() > 0
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)), err_msg=mode)
        # + the q projection's RoPE as the epilogue: heads of N/3 with a rotated tail of half of them
        hd = N // 3
        rope = (jnp.asarray(rng.integers(0, 100_000, xs[:-1]), jnp.int32), rope_freqs(hd // 2, 10000.0), hd)
        got_r = jax.jit(lambda x, nw, p, pos: linear.fp8_normed(x, nw, 1e-6, p, kcfg, dt, rope=(pos, *rope[1:])))(
            xin, nw, p, rope[0])
        want_r = linear.fp8_normed(xin, nw, 1e-6, p, _CFG[mode], dt, rope=rope)
        heads = want.reshape(*want.shape[:-1], 3, hd)
        oracle = apply_rope(heads, rope[0][..., None], rope[1], out_dtype=dt).reshape(want.shape)
        np.testing.assert_array_equal(np.asarray(want_r.astype(F32)), np.asarray(oracle.astype(F32)))
        assert (np.asarray(want_r.astype(F32)) != np.asarray(want.astype(F32))).any()  # the rotation did something
        np.testing.assert_array_equal(np.asarray(got_r.astype(F32)), np.asarray(want_r.astype(F32)),
                                      err_msg=f"rope {mode}")
    st = jax.tree_util.tree_map(lambda a: jnp.stack([jnp.zeros_like(a), a]), p)
    nst = jnp.stack([jnp.ones_like(nw), nw])
    one = ql.kernel(x, p, fmt, F32, norm=(nw, 1e-6), interpret=interp)
    stacked = ql.kernel(x, Stacked(st, jnp.int32(1)), fmt, F32, norm=(nst, 1e-6), interpret=interp)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(one))
    with pytest.raises(ValueError, match="both be a run's stacks"):
        linear.fp8_normed(x, nw, 1e-6, Stacked(st, jnp.int32(1)), _CFG["float32"].replace(
            impl=f"xla,linear={pallas_impl}"), F32)
    with pytest.raises(ValueError, match="norm weight of shape"):
        ql.kernel(x, p, fmt, F32, norm=(nw[:-1], 1e-6))


def test_dual_gemm_bitwise_the_two_calls(pallas_impl):
    """`kernel_dual` (a layer's wq_a and wkv in one launch, `linear.fp8_dual`) equals the two single calls bit for
    bit on order-free weights (the same products; each sum has at most two nonzero terms, so the order the
    compiler gives a dot inside the kernel's branch cannot show), ragged rows and the bf16 / fp32 flows,
    through the seam; the xla seam gives the two xla calls; stacked weights read layer 1 of 2; mismatched
    weights are refused."""
    rng = np.random.default_rng(21)
    x = jnp.asarray(rng.standard_normal((5, 320)).astype(np.float32))
    p1, p2 = _weight(rng, "fp8", 128, 320, True), _weight(rng, "fp8", 64, 320, True)
    interp = pallas_impl == "pallas_interpret"
    for mode in ("bfloat16", "float32"):
        dt = BF16 if mode == "bfloat16" else F32
        kcfg = _CFG[mode].replace(impl=f"xla,linear={pallas_impl}")
        y1, y2 = jax.jit(lambda x, a, b: linear.fp8_dual(x, a, b, kcfg, dt))(x.astype(dt), p1, p2)
        for y, p in ((y1, p1), (y2, p2)):
            one = _kern(pallas_impl)(x.astype(dt), p, "fp8", mode, dt)
            assert y.dtype == dt and y.shape == one.shape
            np.testing.assert_array_equal(np.asarray(y.astype(F32)), np.asarray(one.astype(F32)), err_msg=mode)
        x1, x2 = linear.fp8_dual(x.astype(dt), p1, p2, _CFG[mode], dt)
        np.testing.assert_array_equal(np.asarray(x1.astype(F32)), np.asarray(_xla(x.astype(dt), p1, "fp8", mode, dt)
                                                                           .astype(F32)))
    st = [jax.tree_util.tree_map(lambda a: jnp.stack([jnp.zeros_like(a), a]), p) for p in (p1, p2)]
    s1, s2 = ql.kernel_dual(x, Stacked(st[0], jnp.int32(1)), Stacked(st[1], jnp.int32(1)), "fp8", F32,
                            interpret=interp)
    u1, u2 = ql.kernel_dual(x, p1, p2, "fp8", F32, interpret=interp)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(u1))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(u2))
    with pytest.raises(ValueError, match="both N multiples"):
        ql.kernel_dual(x, p1, _weight(rng, "fp8", 48, 320, False), "fp8", F32)
    with pytest.raises(ValueError, match="stacks"):
        ql.kernel_dual(x, Stacked(st[0], jnp.int32(1)), p2, "fp8", F32)


def test_combine_epilogue_is_the_moe_sum(pallas_impl):
    """``combine=`` (the shared expert's w2 with the routed experts' sum as its epilogue, `moe.moe`'s fused form)
    equals `moe.combine_slots` of the slots in the given order plus the plain kernel's output, rounded once:
    bit for bit (the same GEMM; the epilogue's fp32 sum in combine_slots' order), bf16 and fp32 flows, with the
    slot rows padded past M·k as the experts' kernel leaves them."""
    from dsv41_jax.model import moe

    x, p, fmt = _case("fp8_b1", False)
    N = p.weight.shape[0]
    rng = np.random.default_rng(31)
    k = 6
    idx = jnp.asarray(rng.choice(384, (1, k), replace=False).astype(np.int32))
    order = jnp.pad(jnp.argsort(idx, axis=1, stable=True).astype(jnp.int32), ((0, 0), (0, 2)))  # kp = 8 lanes
    interp = pallas_impl == "pallas_interpret"
    for dt in (BF16, F32):
        slots = jnp.asarray(rng.standard_normal((k + 16, N)), dt)  # 16 padding rows (never read)
        got = ql.kernel(x.astype(dt), p, fmt, dt, combine=(slots, order, k), interpret=interp)
        plain = ql.kernel(x.astype(dt), p, fmt, dt, interpret=interp)
        routed = moe.combine_slots(slots[:k].reshape(1, k, N), idx)
        want = (routed + plain.astype(jnp.float32)).astype(dt)
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)), err_msg=str(dt))
    with pytest.raises(ValueError, match="combine slots"):
        ql.kernel(x, p, fmt, F32, combine=(slots[:2], order, k))


# --------------------------------------------------------------------------------------- contract

FLASH_WQ_B = (32768, 1280)  # flash's q up-projection (64 heads x 512, q_lora_rank 1280)
FLASH_WQ_A = (1280, 5120)  # its q down-projection (hidden 5120)


def _flash_args(M: int, fmt: str = "fp8", shape=FLASH_WQ_B):
    N, K = shape
    sds = jax.ShapeDtypeStruct
    if fmt == "fp8":
        p = Fp8(weight=sds((N, K), quant.FP8), scale=sds((N // 32, K // 32), quant.E8M0))
    else:
        p = Mxfp4(weight=sds((N, K // 2), jnp.uint8), scale=sds((N, K // 32), quant.E8M0))
    return sds((M, K), BF16), p


def test_cost_estimate_is_the_bytes_moved_contract():
    """The call declares `costs.linear_bytes_moved` (the weight at stored width once, activation in, output out) as its
    cost estimate, and `costs.linear_call_geometry` recovers its arguments from the name and operand shapes (what
    scripts/bench_decode.py reads)."""
    N, K = FLASH_WQ_B
    for fmt, wbytes in (("fp8", N * K + N // 32 * K // 32), ("mxfp4", N * K // 2 + N * K // 32)):
        x, p = _flash_args(1, fmt)
        calls = [e for e in jax.make_jaxpr(lambda x, p: ql.kernel(x, p, fmt, BF16))(x, p).jaxpr.eqns
                 if e.primitive.name == "pallas_call"]
        assert len(calls) == 1 and calls[0].params["name"] == f"quant_linear_{fmt}_m16_n64_k256"
        geo = costs.linear_call_geometry(calls[0].params["name"], [v.aval for v in calls[0].invars], calls[0].params["out_avals"])
        assert geo == dict(fmt=fmt, M=1, N=N, K=K, x_itemsize=2, out_itemsize=2, weights=1)
        assert calls[0].params["cost_estimate"].bytes_accessed == costs.linear_bytes_moved(**geo) == wbytes + K * 2 + N * 2
        # the gated pair streams two weights
        calls = [e for e in jax.make_jaxpr(lambda x, p: ql.kernel(x, p, fmt, BF16, p_up=p, act=lambda g, u: g * u))(
            x, p).jaxpr.eqns if e.primitive.name == "pallas_call"]
        assert calls[0].params["name"] == f"quant_linear_{fmt}_gated_m16_n64_k256"
        geo = costs.linear_call_geometry(calls[0].params["name"], [v.aval for v in calls[0].invars], calls[0].params["out_avals"])
        assert calls[0].params["cost_estimate"].bytes_accessed == costs.linear_bytes_moved(**geo) == 2 * wbytes + K * 2 + N * 2
    assert costs.linear_call_geometry("moe_mxfp4_down_m16", [], []) is None


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """fp8 and MXFP4 at flash's wq_b shape lower to verified Triton IR for sm_90, decode (1 row) and
    prefill (4096 rows: 64-row blocks), and so does every tiling `TUNING_CANDIDATES` lists (at wq_a's
    shape, which each divides: what scripts/bench_kernels.py --ops linear times them on)."""
    if jax.default_backend() == "gpu":
        pytest.skip("the native tests compile the kernel on this GPU")
    from dsv41_jax.pallas.offline import capture_kernels

    for fmt, M, bm in (("fp8", 1, 16), ("mxfp4", 1, 16), ("fp8", 4096, 64)):
        ks = capture_kernels(lambda x, p: ql.kernel(x, p, fmt, BF16), *_flash_args(M, fmt))
        assert [k["name"] for k in ks] == [f"quant_linear_{fmt}_m{bm}_n64_k256"]
        assert "tt.dot" in ks[0]["ttir"] and "tt.load" in ks[0]["ttir"]
    # wq_b as the decode step runs it: q_norm in, the q RoPE out (64 heads of 512, 64 rotated dims)
    x, p = _flash_args(1, "fp8")
    ks = capture_kernels(lambda x, p, w, pos: ql.kernel(x, p, "fp8", BF16, norm=(w, 1e-6),
                                                         rope=(pos, rope_freqs(64, 10000.0), 512)),
                         x, p, jax.ShapeDtypeStruct((FLASH_WQ_B[1],), BF16), jax.ShapeDtypeStruct((1,), jnp.int32))
    assert [k["name"] for k in ks] == ["quant_linear_fp8_normed_rope_m16_n64_k256"] and "tt.dot" in ks[0]["ttir"]
    # wq_a and wkv in one launch (1280 and 512 rows of 5120)
    sds = jax.ShapeDtypeStruct
    pa, pk = (Fp8(weight=sds((n, 5120), quant.FP8), scale=sds((n // 32, 160), quant.E8M0)) for n in (1280, 512))
    ks = capture_kernels(lambda x, a, b: ql.kernel_dual(x, a, b, "fp8", BF16), sds((1, 5120), BF16), pa, pk)
    assert [k["name"] for k in ks] == ["quant_linear_fp8_dual_m16_n64_k256"] and "tt.dot" in ks[0]["ttir"]
    # the gated pair at flash's shared-expert shape (w1 / w3: 2048 x 5120 with the SwiGLU)
    from dsv41_jax.model import moe

    x, p = _flash_args(1, "fp8", (2048, 5120))
    ks = capture_kernels(lambda x, p: ql.kernel(x, p, "fp8", BF16, p_up=p, act=lambda g, u: moe._swiglu_act(
        g, u, None, 10.0, BF16)), x, p)
    assert [k["name"] for k in ks] == ["quant_linear_fp8_gated_m16_n64_k256"] and "tt.dot" in ks[0]["ttir"]
    assert ql.TUNING_CANDIDATES[0] == dict(block_n=64, block_k=256, num_warps=4, num_stages=3)
    for kn in ql.TUNING_CANDIDATES[1:]:
        ks = capture_kernels(lambda x, p, kn=kn: ql.kernel(x, p, "fp8", BF16, **kn), *_flash_args(1, "fp8", FLASH_WQ_A))
        assert [k["name"] for k in ks] == [f"quant_linear_fp8_m16_n{kn['block_n']}_k{kn['block_k']}"]
