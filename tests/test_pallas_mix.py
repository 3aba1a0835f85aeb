"""Pallas kernels for Engram (`pallas/engram_gather.py`) and mHC (`pallas/mhc_mix.py`) against their
references (issue 11 parts 3 and 4). Written once: natively on a GPU, in interpret mode elsewhere
(`pallas_impl` fixture).

Tolerances (and why):

* Engram gather: bitwise — one exact fp32 product (power-of-two scale) and one rounding, as the reference.
* Engram gate, hc_post, hc_pre: fp32 flow within a few fp32 ulps (rtol 2e-6, atol 2e-6: the gate's
  length-D sums are chunked, FMA contraction may differ on GPU); bf16 flow within one bf16 ulp of
  the reference (a few-ulp fp32 difference can cross one bf16 rounding boundary).
* mHC mixes from random streams: pre / post within 2e-6, comb within 5e-6 absolute (values <= 2 and
  <= 1): the n·D-long projection and Σh² are summed in another order (chunked, per split), and that
  ~1e-6 relative difference in the logits passes through sigmoid / 20 Sinkhorn steps.
* Sinkhorn itself: with streams and weights chosen so the projection is exact in any order, comb is
  within 16 fp32 ulps of the reference (whose own two forms differ by up to 9).

Shapes: ragged token counts (10 and 17 tokens with 16-token blocks), batch 1 (one token), rows whose
hash indices hit the same table row, the tiny preset's real shapes (n=4, D=64, 6 rows of 32) through
the seams, and D=512 for the mHC kernels alone (split-K over D in 4 splits, and unsplit).
Each kernel compiles for a handful of shapes only; the cases vary data where they can.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parting

from dsv41_jax.model import codec, dispatch, engram, mhc, norm
from dsv41_jax.pallas import costs
from dsv41_jax.pallas import engram_gather as eg
from dsv41_jax.pallas import mhc_mix as mm

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _hc_post_np(y, h, post, comb):
    """`mhc.hc_post` in numpy fp32, unrounded and uncontracted, in the kernels' static order:
    out_j = post_j·y + ((C[0, j]·h_0 + C[1, j]·h_1) + ...). y [..., D], h [..., n, D] -> fp32 [..., n, D]."""
    y, h, post, comb = (_f32(a) for a in (y, h, post, comb))
    n = h.shape[-2]
    outs = []
    for j in range(n):
        res = comb[..., 0, j, None] * h[..., 0, :]
        for i in range(1, n):
            res = res + comb[..., i, j, None] * h[..., i, :]
        outs.append(post[..., j, None] * y + res)
    return np.stack(outs, axis=-2)


def _assert_bf16_ulp(got, want, what=""):
    """|got - want| <= one bf16 ulp of want (both bf16-valued)."""
    g, w = _f32(got), _f32(want)
    bad = parting.bf16_ulps(g, w) > 1
    assert not bad.any(), f"{what}: {bad.sum()} values beyond 1 bf16 ulp, max diff {np.abs(g - w).max()}"


def _close(got, want, dt, what=""):
    if jnp.dtype(dt) == BF16:
        _assert_bf16_ulp(got, want, what)
    else:
        np.testing.assert_allclose(_f32(got), _f32(want), rtol=2e-6, atol=2e-6, err_msg=what)


# ------------------------------------------------------------------------------------------ Engram

def _table(rng, n_rows, de):
    codes = rng.integers(0, 256, (n_rows, de)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no e4m3 NaN codes (0x7F / 0xFF); keeps ±0 and subnormals
    table = jnp.asarray(codes.view(codec.FP8))
    sbytes = rng.integers(112, 143, (n_rows, de // 32)).astype(np.uint8)  # 2^-15 .. 2^15
    sbytes[5, 1] = 255  # the e8m0 NaN byte: kernel and reference share codec's NaN rule
    return table, jnp.asarray(sbytes.view(codec.E8M0))


@pytest.mark.parametrize("shape, dts", [((2, 5), (BF16, F32)), ((1, 1), (BF16,))], ids=["ragged10", "batch1"])
def test_engram_gather_bitwise(pallas_impl, shape, dts):
    rng = np.random.default_rng(1)
    R, de, n_rows = 6, 64, 40
    table, tscale = _table(rng, n_rows, de)
    rows = rng.integers(0, n_rows, (*shape, R)).astype(np.int32)
    rows[0, 0, :3] = 7  # several slots of one token on the same table row
    rows[-1, -1, -1] = 7  # and another token's slot too
    rows[0, 0, 3] = n_rows - 1  # the last row of the table
    rows[0, 0, 4] = 5  # the row with a NaN scale
    rows = jnp.asarray(rows)
    for dt in dts:
        got = eg.gather(table, tscale, rows, dt=dt, interpret=pallas_impl == "pallas_interpret")
        want = engram.gather_rows(table, tscale, rows, dt)
        assert got.shape == want.shape == (*shape, R * de) and got.dtype == dt
        np.testing.assert_array_equal(_f32(got), _f32(want), err_msg=str(dt))  # NaN == NaN here
        assert np.isnan(_f32(got)[0, 0, 4 * de + 32:5 * de]).all() and not np.isnan(_f32(got)[0, 0, :4 * de]).any()


@pytest.mark.parametrize("dt", [BF16, F32], ids=["bf16", "f32"])
def test_engram_gate(pallas_impl, dt):
    rng = np.random.default_rng(2)
    n, D = 4, 64
    h = jnp.asarray(rng.standard_normal((2, 5, n, D)), dt)
    kv = jnp.asarray(rng.standard_normal((2, 5, (n + 1) * D)), dt)
    kv = kv.at[0, 1, :D].set(0)  # a zero key: the gate's eps floor and rsqrt(eps) path
    qw, kw = (jnp.asarray(rng.uniform(0.5, 1.5, (n, D)), jnp.bfloat16) for _ in range(2))
    got = eg.gate(h, kv, qw, kw, eps=1e-20, dt=dt, interpret=pallas_impl == "pallas_interpret")
    _close(got, engram.gate(h, kv, qw, kw, 1e-20, dt), dt, "gate")


@pytest.mark.parametrize("act", ["bfloat16", "float32"])
def test_engram_op_through_the_seam(pallas_impl, tiny_cfg, tiny_params, act):
    """The tiny preset's Engram layer (6 rows of 32, n=4, D=64) via `engram.engram` and the switch."""
    lid = tiny_cfg.engram_layer_ids[0]
    p = tiny_params["layers"][lid]["engram"]
    tokens = jnp.asarray([[5, 9, 33, 70, 5, 9, 33]], jnp.int32)  # repeated n-grams: equal rows
    rows = engram.hash_rows(tiny_cfg, lid, tiny_params["derived"]["engram_token_map"], tokens)
    cfg = tiny_cfg.replace(act_dtype=act)
    dt = jnp.dtype(jnp.bfloat16 if act == "bfloat16" else jnp.float32)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((1, 7, cfg.hc_mult, cfg.hidden_size)), dt)
    want = engram.engram(p, h, rows, cfg.replace(impl="xla"), dt)
    got = engram.engram(p, h, rows, cfg.replace(impl=f"xla,engram={pallas_impl}"), dt)
    _close(got, want, dt, "engram")


# --------------------------------------------------------------------------------------------- mHC

def _mhc_inputs(rng, lead, n, D, h_dt):
    h = jnp.asarray(rng.standard_normal((*lead, n, D)), h_dt)
    pp = jnp.asarray(rng.uniform(0, 1, (*lead, n)), jnp.float32)
    fn = jnp.asarray(rng.standard_normal(((2 + n) * n, n * D)) * (n * D) ** -0.5, jnp.float32)
    base = jnp.asarray(rng.standard_normal((2 + n) * n) * 0.3, jnp.float32)
    return h, pp, fn, base, jnp.asarray([0.5, 0.7, 1.3], jnp.float32)


def _ref_enter(h, pp, fn, base, scale, dt):
    mixes = mhc.hc_mixes(h, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, sinkhorn_iters=20)
    return (mhc.hc_pre(h, pp, dt), *mixes)


def _check_enter(got, want, dt, comb_atol=5e-6):
    x, pre, post, comb = got
    assert [a.shape for a in got] == [a.shape for a in want] and x.dtype == dt
    _close(x, want[0], dt, "x_in")
    np.testing.assert_allclose(_f32(pre), _f32(want[1]), rtol=0, atol=2e-6, err_msg="pre")
    np.testing.assert_allclose(_f32(post), _f32(want[2]), rtol=0, atol=2e-6, err_msg="post")
    np.testing.assert_allclose(_f32(comb), _f32(want[3]), rtol=0, atol=comb_atol, err_msg="comb")


# (token shape, D, stream dtype, splits): the tiny shape, 10 ragged tokens, unsplit (compiled once for
# this, the Sinkhorn and the seam test); 17 tokens (two blocks, ragged) at the decode default of 4
# splits of D = 512 (two kernels); one token, fp32 stream, D = 512 unsplit (the fused tail).
ENTER_CASES = [((2, 5), 64, BF16, None, 1), ((1, 17), 512, BF16, None, 4), ((1, 1), 512, F32, 1, 1)]


@pytest.mark.parametrize("lead, D, dt, splits, expect_splits", ENTER_CASES,
                         ids=["tiny10", "d512-17tok-s4", "d512-1tok-f32"])
def test_mhc_enter(pallas_impl, lead, D, dt, splits, expect_splits):
    n = 4
    h, pp, fn, base, scale = _mhc_inputs(np.random.default_rng(D + len(lead)), lead, n, D, dt)
    got = mm.mixes_enter(h, pp, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, dt=dt, splits=splits,
                         interpret=pallas_impl == "pallas_interpret")
    assert (splits or mm._default_splits(int(np.prod(lead)), D)) == expect_splits
    _check_enter(got, _ref_enter(h, pp, fn, base, scale, dt), dt)


def test_sinkhorn_to_a_few_ulps(pallas_impl):
    """Streams and fn on a coarse grid: the projection and Σh² are exact in any summation order, so
    the logits are the reference's and comb differs only by the Sinkhorn / softmax arithmetic: within
    16 fp32 ulps (the reference's own fori_loop and unrolled forms differ by up to 9 ulps on such
    inputs: 20 rounds of divisions by rounded sums)."""
    rng = np.random.default_rng(5)
    lead, n, D = (2, 5), 4, 64  # the tiny shape of test_mhc_enter: same compiled kernel
    h = jnp.asarray(rng.integers(-2, 3, (*lead, n, D)), BF16)
    pp = jnp.asarray(rng.uniform(0, 1, (*lead, n)), jnp.float32)
    fn = jnp.asarray(rng.integers(-4, 5, ((2 + n) * n, n * D)) / 64.0, jnp.float32)
    base = jnp.asarray(rng.integers(-8, 9, (2 + n) * n) / 8.0, jnp.float32)
    scale = jnp.asarray([0.5, 0.75, 1.25], jnp.float32)
    got = mm.mixes_enter(h, pp, fn, base, scale, norm_eps=1e-20, hc_eps=1e-6, iters=20, dt=BF16,
                         interpret=pallas_impl == "pallas_interpret")
    want = _ref_enter(h, pp, fn, base, scale, BF16)
    c, w = _f32(got[3]), _f32(want[3])
    ulps = np.abs(c - w) / np.spacing(np.abs(w))
    assert ulps.max() <= 16, ulps.max()
    _check_enter(got, want, BF16, comb_atol=1e-6)


@pytest.mark.parametrize("lead, D, dts", [((2, 5), 64, (BF16, F32)), ((1, 1), 512, (BF16,))],
                         ids=["tiny10", "d512-1tok"])
def test_mhc_exit(pallas_impl, lead, D, dts):
    rng = np.random.default_rng(6)
    n = 4
    post = jnp.asarray(rng.uniform(0, 2, (*lead, n)), jnp.float32)
    comb = jax.nn.softmax(jnp.asarray(rng.standard_normal((*lead, n, n)), jnp.float32), axis=-2)
    for dt in dts:
        y = jnp.asarray(rng.standard_normal((*lead, D)), dt)
        h = jnp.asarray(rng.standard_normal((*lead, n, D)), dt)
        got = mm.post_mix(y, h, post, comb, dt=dt, interpret=pallas_impl == "pallas_interpret")
        _close(got, mhc.hc_post(y, h, post, comb, dt), dt, f"hc_post {dt}")


# (token shape, D, splits): 10 ragged tokens unsplit (the norm then needs the tail kernel too); one token at
# D = 512 in 4 splits (decode's shape: partial Σx² per split)
FUSED_CASES = [((2, 5), 64, None), ((1, 1), 512, 4)]


@pytest.mark.parametrize("lead, D, splits", FUSED_CASES, ids=["tiny10", "d512-1tok-s4"])
def test_mhc_fused_norm_and_exit_enter(pallas_impl, lead, D, splits):
    """The sublayer's RMSNorm fused into the enter kernel's tail, and the exit + enter pass (`exit_enter`),
    against the jnp references: h' = hc_post within one bf16 ulp, x_in = rmsnorm(hc_pre(h')) within one bf16
    ulp of the reference computed from the kernel's own h', the mixes within test_mhc_enter's tolerances.
    In interpret mode the fused pass is the separate kernels' arithmetic (the same per-chunk ops): the mixes and
    x_in bit for bit; h' bit for bit except at a bf16 rounding tie, where jax 0.12's XLA:CPU contracts the exit
    kernel's multiply-adds into FMAs and the fused pass's not (`parting.bf16_tie_parts`; natively a compiler may
    contract anywhere, so only the tolerances are asserted there). A layer-stacked norm weight / fn read in place
    (layer 1 of 2) equals the unstacked call."""
    n, interp = 4, pallas_impl == "pallas_interpret"
    rng = np.random.default_rng(40 + D)
    h, pp, fn, base, scale = _mhc_inputs(rng, lead, n, D, BF16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, D), BF16)
    y = jnp.asarray(rng.standard_normal((*lead, D)), BF16)
    post = jnp.asarray(rng.uniform(0, 2, (*lead, n)), jnp.float32)
    comb = jax.nn.softmax(jnp.asarray(rng.standard_normal((*lead, n, n)), jnp.float32), axis=-2)
    kw = dict(norm_eps=1e-20, hc_eps=1e-6, iters=20, dt=BF16, splits=splits, interpret=interp)
    hn, *entered = mm.exit_enter(y, h, post, comb, pp, fn, base, scale, norm_weight=w, **kw)
    _assert_bf16_ulp(hn, mhc.hc_post(y, h, post, comb, BF16), "h'")
    x_ref, *mixes_ref = _ref_enter(hn, pp, fn, base, scale, BF16)
    want = (norm.rmsnorm(x_ref, w, 1e-20, BF16), *mixes_ref)
    _check_enter(entered, want, BF16)
    alone = mm.mixes_enter(hn, pp, fn, base, scale, norm_weight=w, **kw)
    _check_enter(alone, want, BF16)
    if interp:
        separate = mm.post_mix(y, h, post, comb, dt=BF16, interpret=True)
        assert parting.bf16_tie_parts(_f32(hn), _f32(separate), _hc_post_np(y, h, post, comb)) == []
        for a, b in zip(entered, alone):
            np.testing.assert_array_equal(_f32(a), _f32(b))
    # stacked: layer 1 of a two-layer run's fn / base / scale / norm weight
    st = [jnp.stack([jnp.zeros_like(a), a]) for a in (fn, base, scale, w)]
    stacked = mm.exit_enter(y, h, post, comb, pp, *st[:3], norm_weight=st[3], layer=jnp.int32(1), **kw)
    for a, b in zip(stacked, (hn, *entered)):
        np.testing.assert_array_equal(_f32(a), _f32(b))


def test_mhc_seams(pallas_impl, tiny_cfg, tiny_params):
    """sublayer_enter / sublayer_exit: "reference" / "xla" are today's calls bit for bit; the Pallas
    impl on the tiny preset's real weights (n=4, D=64, 10 tokens) agrees within the stated tolerances."""
    lp = tiny_params["layers"][3]
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((2, 5, tiny_cfg.hc_mult, tiny_cfg.hidden_size)), BF16)
    pp = jnp.asarray(rng.uniform(0, 1, (2, 5, tiny_cfg.hc_mult)), jnp.float32)
    w = (lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
    y = jnp.asarray(rng.standard_normal((2, 5, tiny_cfg.hidden_size)), BF16)
    outs = {}
    for impl in ("reference", "xla", pallas_impl):
        cfg = tiny_cfg.replace(impl=f"xla,mhc={impl}")
        enter = mhc.sublayer_enter(h, pp, *w, cfg, BF16)
        outs[impl] = enter, mhc.sublayer_exit(y, h, enter[2], enter[3], cfg, BF16)
        if impl != pallas_impl:
            mixes = mhc.sublayer_mixes(h, *w, cfg)
            for a, b in zip(enter, (mhc.hc_pre(h, pp, BF16), *mixes)):
                np.testing.assert_array_equal(_f32(a), _f32(b))
            np.testing.assert_array_equal(_f32(outs[impl][1]), _f32(mhc.hc_post(y, h, enter[2], enter[3], BF16)))
    _check_enter(outs[pallas_impl][0], outs["reference"][0], BF16)
    ref_exit = mhc.hc_post(y, h, outs[pallas_impl][0][2], outs[pallas_impl][0][3], BF16)
    _assert_bf16_ulp(outs[pallas_impl][1], ref_exit, "exit")
    with pytest.raises(NotImplementedError, match="exact"):
        mhc.sublayer_enter(h, pp, *w, tiny_cfg.replace(act_dtype="exact", impl=f"xla,mhc={pallas_impl}"), F32)
    # the fused seams: norm_weight and sublayer_exit_enter are the separate calls ("reference" / "xla": bit for
    # bit; Pallas: within the tolerances)
    nw = lp["ffn_norm"]["weight"]
    post, comb = outs["reference"][0][2], outs["reference"][0][3]
    for impl in ("reference", "xla", pallas_impl):
        cfg = tiny_cfg.replace(impl=f"xla,mhc={impl}")
        hn, entered = mhc.sublayer_exit_enter(y, h, post, comb, pp, *w, cfg, BF16, norm_weight=nw)
        h_ref = mhc.hc_post(y, h, post, comb, BF16)
        x_ref = norm.rmsnorm(mhc.hc_pre(h_ref, pp, BF16), nw, tiny_cfg.rms_norm_eps, BF16)
        if impl == pallas_impl:
            _assert_bf16_ulp(hn, h_ref, "exit_enter h'")
            _check_enter(entered, (x_ref, *mhc.sublayer_mixes(hn, *w, tiny_cfg.replace(impl="xla,mhc=reference"))),
                         BF16)
        else:
            np.testing.assert_array_equal(_f32(hn), _f32(h_ref))
            for a, b in zip(entered, (x_ref, *mhc.sublayer_mixes(h_ref, *w, cfg))):
                np.testing.assert_array_equal(_f32(a), _f32(b))


def test_mhc_exact_mode_auto_is_xla(pallas_impl):
    """Exact mode: "auto" resolving to the fp32 Pallas kernels (as on a GPU) runs "xla" instead (`dispatch.resolve`,
    which the seams and the step plan read); an explicit Pallas choice stays what was asked for (and the kernel
    refuses the exact mode)."""
    assert dispatch.resolve("auto", "mhc", backend="gpu", f64=True) == "xla"
    assert dispatch.resolve(f"mhc={pallas_impl}", "mhc", backend="gpu", f64=True) == pallas_impl
    assert dispatch.resolve("auto", "mhc", backend="gpu", f64=False) == "pallas"


# ------------------------------------------------------------------------------------------- bench

def test_bench_inputs_match_their_xla_functions():
    """costs' engram / mhc bench_inputs: every part's kernel and XLA function take the same args and give
    the same shapes and dtypes (traced only); bytes_moved is positive and grows with tokens."""
    assert dispatch.kernel("engram", "pallas") is eg.kernel and dispatch.kernel("mhc", "pallas") is mm.sublayer_enter
    for bench_inputs, bytes_moved, kw in ((costs.engram_bench_inputs, costs.engram_bytes_moved, {"table_rows": 64}),
                                          (costs.mhc_bench_inputs, costs.mhc_bytes_moved, {})):
        cases = bench_inputs(3, interpret=True, **kw)
        for part, (kfn, xfn, args) in cases.items():
            a, b = jax.eval_shape(kfn, *args), jax.eval_shape(xfn, *args)
            assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), part
            for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                assert (u.shape, u.dtype) == (v.shape, v.dtype), part
            assert 0 < bytes_moved(part, 1) < bytes_moved(part, 64), part
