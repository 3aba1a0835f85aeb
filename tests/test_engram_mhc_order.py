"""Engram's gate by hand and its batch independence, and mHC's "pre from previous sublayer" ordering inside the
forward (docs/design/spec.md §2, §5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs

from dsv41_jax.model import forward, init_params, numerics, quant
from dsv41_jax.model.engram import engram, gate
from dsv41_jax.model.weights import Fp8


def test_engram_gate_by_hand():
    rng = np.random.default_rng(0)
    n, D, de, R = 2, 32, 32, 6  # 2 streams, 3 orders x 2 heads = 6 rows of 32
    table = rng.standard_normal((10, de)).astype(np.float32)
    tq = table.astype(quant.FP8)  # values within e4m3 range, scale byte 127 = 1.0
    p = {"embed": {"weight": jnp.asarray(tq), "scale": jnp.ones((10, de // 32), quant.E8M0)},
         "q_weight": jnp.asarray(rng.uniform(0.5, 1.5, (n, D)), jnp.bfloat16),
         "k_weight": jnp.asarray(rng.uniform(0.5, 1.5, (n, D)), jnp.bfloat16)}
    wkv = rng.standard_normal((n * D + D, R * de)).astype(np.float32) / 8
    p["wkv"] = Fp8(*quant.quantize_fp8_block(jnp.asarray(wkv)))
    h = rng.standard_normal((1, 1, n, D)).astype(np.float32)
    rows = jnp.array([[[0, 3, 5, 7, 9, 2]]], jnp.int32)
    class C:  # the fields engram() reads: eps, the implementation switch, the numerics mode
        rms_norm_eps = 1e-20
        impl = "auto"
        act_dtype = "float32"
    out = np.asarray(engram(p, jnp.asarray(h), rows, C, jnp.float32))
    # Independent computation: gather, fp8 GEMM (quantized input), gate per stream.
    emb = np.asarray(tq.astype(np.float32))[np.asarray(rows)[0, 0]].reshape(-1)
    kv = np.asarray(quant.fp8_linear(jnp.asarray(emb)[None], p["wkv"].weight, p["wkv"].scale,
                                     out_dtype=jnp.float32))[0]
    keys, value = kv[: n * D].reshape(n, D), kv[n * D:]
    w = np.asarray(p["q_weight"], np.float32) * np.asarray(p["k_weight"], np.float32)
    hh = h[0, 0]
    for c in range(n):
        d = (hh[c] * w[c] * keys[c]).sum() / np.sqrt((hh[c] ** 2).mean()) / np.sqrt((keys[c] ** 2).mean()) / np.sqrt(D)
        g = 1 / (1 + np.exp(-np.sign(d) * np.sqrt(max(abs(d), 1e-6))))
        np.testing.assert_allclose(out[0, 0, c], hh[c] + g * value, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("level", [numerics.EXACT_SUMS, numerics.DETERMINISTIC])
def test_engram_gate_rows_do_not_depend_on_the_batch(level):
    """The exact / deterministic gate over a [16, 1] batch (one device's decode step) equals the same rows in
    [2, 1] batches (a dp = 8 rank's) bit for bit. Before its rsqrts ran in fp64 (`numerics.rsqrt_f32`), the
    [16]-row program contracted the fp32 Newton step of XLA's rsqrt into an FMA and the [2]-row one did not:
    47 of these 4096 outputs parted by 1 ulp (-O0, AMD EPYC; the exact mode's dp server logprobs by 1-3 ulp)."""
    rng = np.random.default_rng(0)
    n, D = 4, 64  # micro's streams and width
    h = rng.standard_normal((16, 1, n, D)).astype(np.float32)
    kv = rng.standard_normal((16, 1, n * D + D)).astype(np.float32)
    qw, kw = (jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16) for _ in range(2))
    f = jax.jit(lambda h, kv: gate(h, kv, qw, kw, 1e-20, jnp.float32, level))
    full = np.asarray(f(h, kv))
    split = np.concatenate([np.asarray(f(h[i:i + 2], kv[i:i + 2])) for i in range(0, 16, 2)])
    np.testing.assert_array_equal(split, full)


def test_pre_from_previous_sublayer():
    """A sublayer's pre is consumed by the NEXT sublayer: layer 0's ffn pre (fPre) must not change layer 0's
    output state, only what layer 1's attention reads; layer 0's attn pre (aPre) feeds layer 0's ffn.
    On `configs.micro` (fp32 mode): the ordering is layer 0's and 1's, and 3 layers compile fast."""
    cfg = configs.micro().replace(act_dtype="float32")
    params = init_params(cfg, jax.random.key(0))
    toks = jnp.asarray([[5, 9, 33, 70, 101, 150, 200, 250, 7, 8, 9, 10]], jnp.int32)
    f = jax.jit(forward, static_argnames=("cfg", "return_aux"))
    base, aux = f(params, toks, cfg, return_aux=True)

    def bumped(key):
        p = jax.tree_util.tree_map(lambda x: x, params)
        lp = dict(p["layers"][0])
        lp[key] = lp[key].at[0:cfg.hc_mult].add(3.0)  # the pre slice of that sublayer's mix bias
        p["layers"] = [lp] + list(p["layers"][1:])
        return f(p, toks, cfg, return_aux=True)

    lg_f, aux_f = bumped("hc_ffn_base")
    np.testing.assert_array_equal(np.asarray(aux_f["layer_inputs"][1]), np.asarray(aux["layer_inputs"][1]))
    assert np.abs(np.asarray(lg_f) - np.asarray(base)).max() > 1e-3
    lg_a, aux_a = bumped("hc_attn_base")
    assert np.abs(np.asarray(aux_a["layer_inputs"][1]) - np.asarray(aux["layer_inputs"][1])).max() > 1e-3
