"""The window-codes kernel (dsv41_jax/pallas/window_codes.py: kv_norm + RoPE + fp8 window codes of a layer's
new K=V in one launch) against its reference (`ref_window_codes`: norm.rmsnorm, rope.apply_rope,
cache.encode("win")), natively on a GPU and in interpret mode elsewhere (`pallas_impl`).

Bitwise: the kernel computes the reference's ops on the reference's values; only Σx² of the norm is summed
in the kernel's order, and on these inputs that sum is the same in any order in interpret mode (it is a
row of 512 fp32 squares; natively this also asks that Triton's rsqrt / cos / sin be XLA:GPU's — both
call libdevice). Shapes: the tiny preset's (head_dim 64, 16 rope dims, 10 ragged tokens over one 16-token
block), flash's (512, 64) at one token and at 17 tokens (two blocks, ragged) in the fp32 flow; a zero row
(the amax floor), large positions (past 64K), values that use e4m3 subnormals; a stacked norm weight. With
``ring=`` the kernel also writes the codes into the cache's rings: equal to the commit's write.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, attention, dispatch
from dsv41_jax.model import cache as kvc
from dsv41_jax.model.plan import Pending, StepPlan
from dsv41_jax.model.rope import rope_freqs
from dsv41_jax.pallas import window_codes as wc

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)


def _bytes(codes):
    return {k: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8)) for k, v in codes.items()}


def _inputs(rng, lead, hd, dt):
    y = rng.standard_normal((*lead, hd)) * 3.0
    y[..., :8] *= 2.0 ** -14  # small entries: e4m3 subnormal codes after the per-32 scale
    if y.size > hd:
        y.reshape(-1, hd)[0] = 0.0  # a zero row: the norm gives zeros, the scale is the amax floor's
    pos = rng.integers(0, 200_000, lead).astype(np.int32)
    return jnp.asarray(y, dt), jnp.asarray(rng.uniform(0.5, 1.5, hd), BF16), jnp.asarray(pos)


@pytest.mark.parametrize("lead, hd, rd, dt", [((2, 5), 64, 16, BF16), ((1, 1), 512, 64, BF16),
                                              ((1, 17), 512, 64, F32)], ids=["tiny10", "flash-1tok", "flash-17tok-f32"])
def test_kernel_bitwise_the_reference(pallas_impl, lead, hd, rd, dt):
    rng = np.random.default_rng(hd + len(lead))
    y, w, pos = _inputs(rng, lead, hd, dt)
    fr = rope_freqs(rd, 10000.0)
    got = wc.kernel(y, w, pos, fr, 1e-6, dt, interpret=pallas_impl == "pallas_interpret")
    want = wc.ref_window_codes(y, w, pos, fr, 1e-6, dt, "auto")
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    g, r = _bytes(got), _bytes(want)
    sub = ((r["q"] & 0x78) == 0) & ((r["q"] & 7) != 0)
    assert sub.any() and ((r["q"] & 0x78) != 0).any()  # subnormal codes and normal ones occur
    for k in ("q", "s"):
        np.testing.assert_array_equal(g[k], r[k], err_msg=k)
    # a run's stacked norm weight, layer 1 of 2 (layer 0 zeros: reading it would give other codes)
    st = jnp.stack([jnp.zeros_like(w), w])
    got1 = wc.kernel(y, st, pos, fr, 1e-6, dt, layer=jnp.int32(1), interpret=pallas_impl == "pallas_interpret")
    for k in ("q", "s"):
        np.testing.assert_array_equal(_bytes(got1)[k], g[k], err_msg=f"stacked {k}")


def test_seam_runs_the_kernel_for_fp8_windows_only(pallas_impl, tiny_cfg, tiny_params):
    """The plan's window-codes form (`StepPlan.q_codes`): with the attention kernel and an fp8 window codec
    (`StepPlan.window_codes_kernel`) the kernel's codes, equal to the plain form's (impl xla) bit for bit; a bf16
    window (kv_cache_dtype "bfloat16") runs the plain form even with the kernel chosen."""
    p = tiny_params["layers"][2]["attn"]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 5, tiny_cfg.hidden_size)), BF16)
    pos = jnp.asarray(rng.integers(0, 5000, (2, 5)), jnp.int32)
    fr = attention.layer_freqs(tiny_cfg, tiny_cfg.layer_plan(2))
    kcfg = tiny_cfg.replace(impl=f"xla,attention={pallas_impl}")
    pend = Pending(positions=None, window=(None,) * tiny_cfg.num_hidden_layers, partial={}, restore=None)

    def window_codes(cfg, mode):
        step = StepPlan.of(cfg, None, x.shape[:2], mode)
        _, _, codes, _, left = step.q_codes(p, x, pos, fr, cfg, BF16, mode, {}, pend, (None, None, 0, 2))
        assert left.window[2] is codes  # left for commit (not the one-token, keep-all step: no ring write)
        return codes

    assert StepPlan.of(kcfg, None, x.shape[:2], "auto").window_codes_kernel
    got = window_codes(kcfg, "auto")
    want = window_codes(tiny_cfg.replace(impl="xla"), "auto")
    np.testing.assert_array_equal(_bytes(got)["q"], _bytes(want)["q"])
    np.testing.assert_array_equal(_bytes(got)["s"], _bytes(want)["s"])
    want_enc = kvc.encode("win", "auto", attention.project_kv(p, x, pos, fr, tiny_cfg.replace(impl="xla"), BF16))
    np.testing.assert_array_equal(_bytes(want)["q"], _bytes(want_enc)["q"])

    assert StepPlan.of(kcfg, None, x.shape[:2], "bfloat16").q_codes is attention.q_codes  # the plain form
    bf = window_codes(kcfg, "bfloat16")
    np.testing.assert_array_equal(np.asarray(bf["v"].astype(F32)), np.asarray(kvc.encode(
        "win", "bfloat16", attention.project_kv(p, x, pos, fr, kcfg, BF16))["v"].astype(F32)))


@pytest.mark.parametrize("B", [3, 20])
def test_kernel_writes_the_rings_as_the_commit_does(pallas_impl, B):
    """With ``ring=`` the kernel also writes each token's codes into the cache's rings [R, L, W, ...] in place,
    at layer ring_base + ring_layer (a traced index), entry position mod W of the token's row: bitwise what
    `decode._window_write` (the commit's write) makes, on every row but the scratch one, which takes the
    codes of the tokens not written (write = 0) instead of dropping them; the codes it returns are the
    reference's. B = 20: two token blocks (the second ragged: its lanes past B rewrite token B − 1's bytes)."""
    from dsv41_jax.model import decode as dec

    rng = np.random.default_rng(31)
    hd, R, L, W = 64, B + 1, 4, 8
    fr = rope_freqs(16, 1e4)
    y, w, _ = _inputs(rng, (B, 1), hd, BF16)
    pos = jnp.asarray(rng.integers(0, 300, (B, 1)), jnp.int32)
    ring = kvc.encode("win", "auto", jnp.asarray(rng.standard_normal((R, L, W, hd)), jnp.float32))
    rows = jnp.asarray(rng.permutation(B)[:, None], jnp.int32)
    write = jnp.asarray((np.arange(B) % 3 != 2)[:, None], jnp.int32)  # every third token is a padded row's
    f = jax.jit(lambda y, w, pos, ring, rows, write, k: wc.kernel(
        y, w, pos, fr, 1e-6, BF16, ring=(ring, rows, write, k, 1), interpret=pallas_impl == "pallas_interpret"))
    codes, got = f(y, w, pos, ring, rows, write, jnp.int32(1))
    ref = _bytes(wc.ref_window_codes(y, w, pos, fr, 1e-6, BF16, "auto"))
    for k, v in _bytes(codes).items():
        np.testing.assert_array_equal(v, ref[k], err_msg=k)
    want = dec._window_write(ring, rows[:, 0], pos, write[:, 0], jax.tree_util.tree_map(lambda a: a[None], codes), W,
                             layer=2)
    g, wnt, c = _bytes(got), _bytes(want), _bytes(codes)
    dropped = [b for b in range(B) if not write[b, 0]]
    for k in g:
        np.testing.assert_array_equal(g[k][:R - 1], wnt[k][:R - 1], err_msg=k)
        for b in dropped:  # its scratch entry holds the codes of a dropped token of its column (any of them)
            col = int(pos[b, 0]) % W
            assert any(np.array_equal(g[k][R - 1, 2, col], c[k][o, 0]) for o in dropped if int(pos[o, 0]) % W == col), k


def test_shapes_it_cannot_cover_are_refused(tiny_cfg):
    y = jnp.zeros((1, 96), BF16)
    with pytest.raises(NotImplementedError, match="power of two"):
        wc.kernel(y, jnp.ones((96,), BF16), jnp.zeros((1,), jnp.int32), rope_freqs(16, 1e4), 1e-6, BF16)
    with pytest.raises(ValueError, match="norm weight"):
        wc.kernel(jnp.zeros((1, 64), BF16), jnp.ones((32,), BF16), jnp.zeros((1,), jnp.int32), rope_freqs(16, 1e4),
                  1e-6, BF16)
    assert wc.supports(tiny_cfg, "auto") and wc.supports(tiny_cfg, "fp8_e4m3") and not wc.supports(tiny_cfg, "bfloat16")
    assert not wc.supports(tiny_cfg.replace(deterministic=True))  # the fp64 modes have no kernel
    assert dispatch.supports("attention", "window_codes", tiny_cfg, "fp8_e4m3")


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """Flash's window (head_dim 512, 64 rope dims) lowers to verified Triton IR for sm_90 at one token and a
    64-token chunk."""
    if jax.default_backend() == "gpu":
        pytest.skip("offline lowering is for machines without a GPU; here test_kernel_bitwise_the_reference compiles it "
                    "natively at flash's shapes")
    from dsv41_jax.pallas.offline import capture_kernels

    cfg = ModelConfig.preset("flash")
    fr = rope_freqs(cfg.qk_rope_head_dim, cfg.rope_theta)
    for M in (1, 64):
        sds = jax.ShapeDtypeStruct
        ks = capture_kernels(lambda y, w, p: wc.kernel(y, w, p, fr, cfg.rms_norm_eps, BF16),
                             sds((M, cfg.head_dim), BF16), sds((cfg.head_dim,), BF16), sds((M,), jnp.int32))
        assert [k["name"] for k in ks] == ["window_codes"] and "tt.store" in ks[0]["ttir"]
        # and writing the rings too (the scattered stores into every layer's rings, 65 request rows)
        store = {"q": sds((65, cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim), jnp.float8_e4m3fn),
                 "s": sds((65, cfg.num_hidden_layers, cfg.sliding_window, cfg.head_dim // 32), jnp.float8_e8m0fnu)}
        ks = capture_kernels(lambda y, w, p, st, r, wr, k: wc.kernel(y, w, p, fr, cfg.rms_norm_eps, BF16,
                                                                    ring=(st, r, wr, k, 3)),
                             sds((M, cfg.head_dim), BF16), sds((cfg.head_dim,), BF16), sds((M,), jnp.int32), store,
                             sds((M,), jnp.int32), sds((M,), jnp.int32), sds((), jnp.int32))
        assert [k["name"] for k in ks] == ["window_codes"] and ks[0]["ttir"].count("tt.store") >= 4
