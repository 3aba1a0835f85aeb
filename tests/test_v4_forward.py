"""DeepSeek-V4's forward in model/v4 (docs/design/v4.md): the tiny-v4 preset's random checkpoint written and read
back bit for bit, the forward's causality and decisions, the variants against plain formulas, the refusals.
(Its numbers against transformers' DeepseekV4ForCausalLM: tests/test_v4_transformers.py, marker v4check.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, forward, init_params, load_model
from dsv41_jax.model.v4 import compressor as comp4
from dsv41_jax.model.v4 import mhc as mhc4
from dsv41_jax.model.v4 import moe as moe4

CFG = ModelConfig.preset("tiny-v4").replace(act_dtype="exact")


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _run():
    """One forward of two rows that agree on their first 40 tokens (exact mode)."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, CFG.vocab_size, 72)
    b = a.copy()
    b[40:] = rng.integers(0, CFG.vocab_size, 32)
    tokens = np.stack([a, b]).astype(np.int32)
    logits, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(_params(), tokens, CFG, return_aux=True)
    return tokens, np.asarray(logits), jax.tree_util.tree_map(np.asarray, aux)


def test_make_checkpoint_tiny_v4_round_trip(tmp_path):
    """scripts/make_checkpoint.py --preset tiny-v4 writes the release layout (fp8 128x128 blocks, MXFP4 experts one
    tensor each, tid2eid); load_model reads it back bit for bit."""
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_checkpoint.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    assert mk.main(["--preset", "tiny-v4", "--out", str(tmp_path / "ck"), "--shards", "2", "--scale-format", "u8"]) == 0
    cfg, params = load_model(str(tmp_path / "ck"))
    assert cfg.replace(name="x") == ModelConfig.preset("tiny-v4").replace(name="x")
    want = jax.tree_util.tree_leaves_with_path(_params())
    got = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(got) == len(want)
    for path, w in want:
        g = got[path]
        assert g.dtype == w.dtype and g.shape == w.shape, path
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)), path
    names = set(__import__("json").load(open(tmp_path / "ck" / "model.safetensors.index.json"))["weight_map"])
    assert {"hc_head_fn", "layers.0.ffn.gate.tid2eid", "layers.2.attn.indexer.compressor.ape",
            "layers.3.attn.compressor.wgate.weight", "layers.2.ffn.experts.7.w2.scale",
            "layers.2.attn.wq_b.scale", "mtp.0.e_proj.scale", "mtp.0.hnorm.weight", "mtp.0.hc_head_fn",
            "mtp.0.ffn.experts.7.w1.weight", "mtp.0.ffn.gate.bias"} <= names and "layers.0.ffn.gate.bias" not in names


def test_forward_is_causal_and_finite():
    """Logits and every decision (CSA top-k, experts) at positions < 40 do not depend on the tokens after 40: the
    window, HCA's visible entries, CSA's indexer masks and the compressors' closed windows are causal."""
    tokens, logits, aux = _run()
    assert logits.shape == (2, 72, CFG.vocab_size) and np.isfinite(logits).all()
    assert np.array_equal(logits[0, :40], logits[1, :40])
    assert not np.array_equal(logits[0, 40:], logits[1, 40:])
    for kind in ("topk", "experts"):
        for lid, v in aux[kind].items():
            assert np.array_equal(v[0, :40], v[1, :40]), (kind, lid)


def test_decisions_follow_the_variants():
    """Hash-routed layers take tid2eid[token]; learned layers k distinct experts; CSA's picks are visible entries
    (w < (t+1) // 4), −1 only where fewer than index_topk are visible, and HCA layers have no picks."""
    tokens, _, aux = _run()
    p = _params()
    assert sorted(aux["topk"]) == [2, 4]
    for lid in range(CFG.num_hidden_layers):
        e = aux["experts"][lid]
        if lid in CFG.hash_layer_ids:
            assert np.array_equal(e, np.asarray(p["layers"][lid]["ffn"]["gate"]["tid2eid"])[tokens])
        else:
            assert (np.sort(e, -1)[..., 1:] != np.sort(e, -1)[..., :-1]).all()
    t = np.arange(72)
    visible = (t + 1) // 4
    for lid, sel in aux["topk"].items():
        assert sel.shape == (2, 72, CFG.index_topk)
        ok = sel >= 0
        assert (sel[ok] < np.broadcast_to(visible[None, :, None], sel.shape)[ok]).all()
        assert np.array_equal(ok.sum(-1), np.broadcast_to(np.minimum(visible, CFG.index_topk), (2, 72)))


def test_overlapping_windows_are_the_formula():
    """CSA's slots of entry w: Ca (first half) of window w−1's tokens, then Cb of window w's, ape added per slot;
    entry 0's Ca half absent. HCA: window w's tokens, ape added."""
    rng = np.random.default_rng(0)
    r, d, T = 4, 3, 13
    kv, g = rng.standard_normal((2, 1, T, 2 * d)).astype(np.float32)
    ape = rng.standard_normal((r, 2 * d)).astype(np.float32)
    skv, ssc = map(np.asarray, comp4.window_slots(jnp.asarray(kv), jnp.asarray(g), jnp.asarray(ape), r, True))
    assert skv.shape == (1, T // r, 2 * r, d)
    for w in range(T // r):
        for j in range(r):
            assert np.array_equal(skv[0, w, r + j], kv[0, w * r + j, d:])
            assert np.array_equal(ssc[0, w, r + j], g[0, w * r + j, d:] + ape[j, d:])
            if w == 0:
                assert (skv[0, 0, j] == 0).all() and (ssc[0, 0, j] == -np.inf).all()
            else:
                assert np.array_equal(skv[0, w, j], kv[0, (w - 1) * r + j, :d])
                assert np.array_equal(ssc[0, w, j], g[0, (w - 1) * r + j, :d] + ape[j, :d])
    hkv, hsc = map(np.asarray, comp4.window_slots(jnp.asarray(kv), jnp.asarray(g), jnp.asarray(ape), r, False))
    assert np.array_equal(hkv[0, 1], kv[0, 4:8]) and np.array_equal(hsc[0, 1], g[0, 4:8] + ape)


def test_hc_head_is_the_formula():
    rng = np.random.default_rng(1)
    n, D = 4, 8
    h = rng.standard_normal((3, n, D)).astype(np.float32)
    fn = rng.standard_normal((n, n * D)).astype(np.float32)
    base, scale = rng.standard_normal(n).astype(np.float32), np.float32([0.7])
    got = np.asarray(mhc4.head_collapse(jnp.asarray(h), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), CFG,
                                        jnp.float32))
    flat = h.reshape(3, -1).astype(np.float64)
    flat = flat / np.sqrt((flat ** 2).mean(-1, keepdims=True) + CFG.rms_norm_eps)
    pre = 1 / (1 + np.exp(-(flat @ fn.T * scale[0] + base))) + CFG.hc_eps
    np.testing.assert_allclose(got, (pre[..., None] * h).sum(1), rtol=1e-5, atol=1e-6)


def test_grouped_mxfp4_experts_equal_the_reference():
    """moe=xla (V4.1's grouped MXFP4 path) == the every-expert reference, bit for bit in the exact mode, with a
    hash table row naming experts in any order."""
    ex = _params()["layers"][2]["ffn"]["experts"]
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, CFG.hidden_size)), jnp.float32)
    idx = jnp.asarray([[3, 1], [0, 7], [7, 0], [2, 5], [6, 4]], jnp.int32)
    w = jnp.asarray(rng.random((5, 2)), jnp.float32)
    ref = moe4.routed(ex, x, idx, w, CFG.replace(impl="moe=reference"), jnp.float32)
    xla = moe4.routed(ex, x, idx, w, CFG.replace(impl="moe=xla"), jnp.float32)
    assert np.array_equal(np.asarray(ref), np.asarray(xla))


@pytest.mark.parametrize("impl", ["attention=pallas", "mhc=pallas"])
def test_kernels_and_decode_are_refused(impl):
    with pytest.raises(NotImplementedError, match=rf"^DeepSeek-V4: {impl}: "):  # (exact mode; tests/test_v4_kernels.py)
        forward(_params(), np.zeros((1, 8), np.int32), CFG.replace(impl=impl))
    with pytest.raises(NotImplementedError, match="paged decode step"):
        CFG.layer_plan(0)
