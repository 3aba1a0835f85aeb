"""The o_proj kernel (dsv41_jax/pallas/o_proj.py: the attention kernel's split-K merge, the inverse RoPE and
the grouped fp8 wo_a in one launch) against its reference chain (`ref_o_proj`: `common.merge_splits`,
`rope.apply_rope(inverse=True)`, the wo_a einsum on the dequantized weight), natively on a GPU and in
interpret mode elsewhere (`pallas_impl`).

* **bitwise** in the bf16 flow on order-free weights (at most two nonzero codes per wo_a row: every fp32
  sum of the GEMM has at most two nonzero products, so any order gives the same sum), from split partials
  (with an empty split and padded heads) and from a merged output;
* **within a stated bound** in the fp32 flow (`_bound`: the GEMM's summation order and the rotation's
  FMA contraction, which XLA:CPU applies in some fusions and not in others), order-free and dense weights,
  from partials whose merge is exact in any order and from a merged output;
* the composition the decode step runs: the attention kernel's partials (merge=False, 3 splits) through
  o_proj equal its merged output through the chain; the seam (`attention.output_proj`) with the linear
  kernel against impl "xla";
* a run's stacked wo_a and sink read at the layer; refusals; the Triton lowering at flash shapes.

Shapes: 4 heads of 64 dims (16 rotated) in 2 groups of 128 inputs, R = 32; 2 and 3 rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, attention, quant
from dsv41_jax.model.plan import StepPlan
from dsv41_jax.model.rope import rope_freqs
from dsv41_jax.model.weights import Fp8
from dsv41_jax.pallas import common, costs
from dsv41_jax.pallas import o_proj as op

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
H, HD, RD, G, R = 4, 64, 16, 2, 32
I = H * HD // G


def _wo_a(rng, order_free: bool):
    w = rng.standard_normal((G * R, I)).astype(np.float32) * 0.1
    if order_free:
        keep = np.zeros_like(w, bool)
        for r in range(G * R):
            keep[r, rng.choice(I, 2, replace=False)] = True
        w = np.where(keep, w, 0.0)
    q, s = quant.quantize_fp8_block(jnp.asarray(w))
    return Fp8(weight=q, scale=s)


def _partials(rng, S, B, T, hp, exact_merge: bool = False):
    """Split partials; exact_merge: every split of a (row, head) has the same max (weights exp(0) = 1) and the
    sums are of small multiples of 1/8, so the merge's sums are exact in any order (XLA:CPU may contract or
    reorder the reference's, which in the fp32 flow shows in the last bit)."""
    m = rng.standard_normal((S, B, T, hp)).astype(np.float32)
    acc = rng.standard_normal((S, B, T, hp, HD)).astype(np.float32)
    l = rng.uniform(0.5, 3.0, (S, B, T, hp)).astype(np.float32)
    if exact_merge:
        m[:] = m[:1]
        acc = np.round(acc * 8) / 8
        l = np.round(l * 8) / 8
    m[1, 0, 0, :] = -np.inf  # an empty split for one row
    return {"acc": jnp.asarray(acc), "m": jnp.asarray(m), "l": jnp.asarray(l)}


def _run(pallas_impl, o, w, pos, fr, dt, sink=None, **kw):
    got = op.kernel(o, w, pos, fr, G, R, dt, sink=sink, interpret=pallas_impl == "pallas_interpret", **kw)
    want = op.ref_o_proj(o, w, pos, fr, G, R, dt, sink=sink)
    assert got.shape == want.shape and got.dtype == want.dtype == dt
    return np.asarray(got.astype(F32)), np.asarray(want.astype(F32))


def _setup(seed, order_free):
    """(rng, wo_a, freqs, sink, positions of 2 rows x 1 token) for the cases below."""
    rng = np.random.default_rng(seed)
    return (rng, _wo_a(rng, order_free), rope_freqs(RD, 10000.0), jnp.asarray(rng.standard_normal(H), F32),
            jnp.asarray(rng.integers(0, 100_000, (2, 1)), jnp.int32))


def test_bf16_flow_bitwise_on_order_free_weights(pallas_impl):
    rng, w, fr, sink, pos = _setup(1, True)
    got, want = _run(pallas_impl, _partials(rng, 3, 2, 1, 16), w, pos, fr, BF16, sink)  # 3 splits, heads padded
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)
    o = jnp.asarray(rng.standard_normal((1, 3, H, HD)), BF16)  # one split: the attention kernel's output as it is
    got, want = _run(pallas_impl, o, w, jnp.asarray(rng.integers(0, 100_000, (1, 3)), jnp.int32), fr, BF16)
    np.testing.assert_array_equal(got, want)


def _bound(o_merged, w):
    """|kernel − chain| bound in the fp32 flow: the GEMM's fp32 sums in another order (I·2^-24·Σ|x||w|) plus the
    rotation's two-term sums, which XLA:CPU may contract into an FMA in one and not the other (≤ 2^-23·(|a| +
    |b|) per rotated input), all as 2^-24·(I + 8)·(x_mag · |w|ᵀ) with x_mag = |o| + |o's partner| on rotated dims."""
    o = np.abs(np.asarray(o_merged, np.float64))
    d = np.arange(HD)
    rope = d >= HD - RD
    xm = np.where(rope, o + o[..., np.where(rope, d ^ 1, d)], o).reshape(*o.shape[:2], G, I)
    wd = np.abs(np.asarray(quant.dequantize_fp8_block(w.weight, w.scale, F32), np.float64)).reshape(G, R, I)
    return (I + 8) * 2.0 ** -24 * np.einsum("btgi,gri->btgr", xm, wd).reshape(*o.shape[:2], G * R)


@pytest.mark.parametrize("order_free", [True, False], ids=["order_free", "dense"])
def test_fp32_flow_within_the_summation_bound(pallas_impl, order_free):
    rng, w, fr, sink, pos = _setup(2, order_free)
    parts = _partials(rng, 3, 2, 1, 16, exact_merge=True)  # the merge exact in any order: only the rest differs
    got, want = _run(pallas_impl, parts, w, pos, fr, F32, sink)
    o = common.merge_splits(parts["acc"], parts["m"], parts["l"], jnp.pad(sink, (0, 12)))[:, :, :H]
    assert np.abs(want).max() > 0
    assert (np.abs(got - want) <= _bound(o, w)).all(), float(np.max(np.abs(got - want) - _bound(o, w)))
    o = jnp.asarray(rng.standard_normal((1, 3, H, HD)), F32)
    got, want = _run(pallas_impl, o, w, jnp.asarray(rng.integers(0, 100_000, (1, 3)), jnp.int32), fr, F32)
    assert (np.abs(got - want) <= _bound(o, w)).all()


def test_stacked_weight_and_sink_read_at_the_layer(pallas_impl):
    rng, w, fr, sink, pos = _setup(3, False)
    parts = _partials(rng, 3, 2, 1, 16)
    interp = pallas_impl == "pallas_interpret"
    one = op.kernel(parts, w, pos, fr, G, R, BF16, sink=sink, interpret=interp)
    st = jax.tree_util.tree_map(lambda v: jnp.stack([jnp.zeros_like(v), v]), w)
    two = op.kernel(parts, st, pos, fr, G, R, BF16, sink=jnp.stack([jnp.zeros_like(sink), sink]),
                    layer=jnp.int32(1), interpret=interp)
    np.testing.assert_array_equal(np.asarray(two.astype(F32)), np.asarray(one.astype(F32)))
    with pytest.raises(ValueError, match="does not fit"):
        op.kernel(parts, st, pos, fr, G, R, BF16, sink=sink, interpret=interp)  # stacked weight, no layer
    with pytest.raises(ValueError, match="need the attention sink"):
        op.kernel(parts, w, pos, fr, G, R, BF16, interpret=interp)


def test_the_attention_kernels_partials_through_o_proj(pallas_impl, tiny_cfg, tiny_params):
    """What decode runs: `sparse_attention(merge=False)` hands its split partials to `output_proj`, whose
    o_proj kernel merges them; equal (bf16 flow, bitwise) to the attention kernel's own merge followed by the
    chain; through the seam (o_proj + wo_b on the kernels) within one bf16 ulp of impl "xla"."""
    from dsv41_jax.pallas import sparse_attention as sa

    cfg = tiny_cfg
    args, kw = costs.attention_bench_inputs(2, 256, 1, cfg_like="tiny", seed=4)
    interp = pallas_impl == "pallas_interpret"
    parts = sa.kernel(*args, **kw, num_splits=3, merge=False, interpret=interp)
    assert isinstance(parts, dict) and parts["acc"].shape[0] == 3
    merged = sa.kernel(*args, **kw, num_splits=3, interpret=interp)
    q, sink, positions = args[0], args[1], args[6]
    p = dict(tiny_params["layers"][3]["attn"], attn_sink=sink)  # the sink the partials were made with
    fr = attention.layer_freqs(cfg, cfg.layer_plan(3))
    G_, R_ = cfg.o_groups, cfg.o_lora_rank
    got = op.kernel(parts, p["wo_a"], positions, fr, G_, R_, q.dtype, sink=sink, interpret=interp)
    want = op.ref_o_proj(merged, p["wo_a"], positions, fr, G_, R_, q.dtype)
    np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
    # the seam: output_proj with the linear kernel (o_proj + wo_b) vs impl "xla", from the merged output
    kcfg, xcfg = cfg.replace(impl=f"xla,linear={pallas_impl}"), cfg.replace(impl="xla")
    kstep, xstep = StepPlan.of(kcfg, None, q.shape[:2]), StepPlan.of(xcfg, None, q.shape[:2])
    assert kstep.linear_kernel and not xstep.linear_kernel
    y_k = attention.output_proj(kstep, p, parts, positions, fr, kcfg, q.dtype)
    y_x = attention.output_proj(xstep, p, merged, positions, fr, xcfg, q.dtype)
    # the same wo_b input; wo_b's kernel and xla GEMMs sum in other orders: one bf16 ulp at most (test_pallas_linear)
    a, b = np.asarray(y_k.astype(F32)), np.asarray(y_x.astype(F32))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 2.0 ** -126))) - 7)
    assert (np.abs(a - b) <= ulp).all(), float(np.abs(a - b).max())
    with pytest.raises(ValueError, match="need the o_proj kernel"):
        attention.output_proj(xstep, p, parts, positions, fr, xcfg, q.dtype)


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """Flash's shapes (64 heads of 512 in 8 groups, R 1024), from 11 split partials at one row and from a merged
    output at 64 rows, lower to verified Triton IR for sm_90."""
    if jax.default_backend() == "gpu":
        pytest.skip("offline lowering is for machines without a GPU; here the tests above compile the kernel natively "
                    "(tiny shapes) and scripts/gpu_check.sh's flash-cut decode at flash's shapes")
    from dsv41_jax.pallas.offline import capture_kernels

    c = ModelConfig.preset("flash")
    Gf, Rf, Hf, hd = c.o_groups, c.o_lora_rank, c.num_attention_heads, c.head_dim
    sds = jax.ShapeDtypeStruct
    w = Fp8(weight=sds((Gf * Rf, c.o_group_in), quant.FP8), scale=sds((Gf * Rf // 32, c.o_group_in // 32), quant.E8M0))
    fr = rope_freqs(c.qk_rope_head_dim, c.rope_theta)
    parts = {"acc": sds((11, 1, 1, Hf, hd), F32), "m": sds((11, 1, 1, Hf), F32), "l": sds((11, 1, 1, Hf), F32)}
    ks = capture_kernels(lambda o, w, p, s: op.kernel(o, w, p, fr, Gf, Rf, BF16, sink=s), parts, w,
                         sds((1, 1), jnp.int32), sds((Hf,), F32))
    assert [k["name"] for k in ks] == ["o_proj_s11_n64_k64"] and "tt.dot" in ks[0]["ttir"]
    ks = capture_kernels(lambda o, w, p: op.kernel(o, w, p, fr, Gf, Rf, BF16), sds((64, 1, Hf, hd), BF16), w,
                         sds((64, 1), jnp.int32))
    assert [k["name"] for k in ks] == ["o_proj_s1_n64_k64"]
    # its cost estimate is the bytes-moved contract bench_decode counts: the fp8 pair once, the partials once, out
    eqns = jax.make_jaxpr(lambda o, w, p, s: op.kernel(o, w, p, fr, Gf, Rf, BF16, sink=s))(
        parts, w, sds((1, 1), jnp.int32), sds((Hf,), F32)).jaxpr.eqns
    (call,) = [e for e in eqns if e.primitive.name == "pallas_call"]
    I_ = c.o_group_in
    assert call.params["cost_estimate"].bytes_accessed == (Gf * Rf * I_ + Gf * Rf // 32 * I_ // 32
                                                           + 11 * Hf * (hd + 2) * 4 + Gf * Rf * 2)
