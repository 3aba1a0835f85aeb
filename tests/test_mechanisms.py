"""Each mechanism of the forward pass against a hand-checkable case (docs/design/spec.md §3, §4, §6)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import attention, compressor, indexer, moe

NEG = -jnp.inf


def test_ratio2_pooling_two_tokens():
    # Per-channel softmax over the 2 tokens of a group: channel 0 weights (1/4, 3/4), channel 1 (1/2, 1/2).
    kv = jnp.array([[1.0, 2.0], [3.0, 4.0]], jnp.float32)
    score = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]], jnp.float32)
    p = {"norm": {"weight": jnp.ones((2,), jnp.bfloat16)}}
    out = compressor.pool_groups(kv, score, p, 1e-20, jnp.float32)
    pooled = np.array([0.25 * 1 + 0.75 * 3, 0.5 * 2 + 0.5 * 4])
    expected = pooled / math.sqrt(np.mean(pooled ** 2))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_compress_ratio2_uses_complete_groups_only():
    D = hd = 32
    rng = np.random.default_rng(0)
    p = {"wkv": {"weight": jnp.asarray(rng.standard_normal((hd, D)), jnp.bfloat16)},
         "wgate": {"weight": jnp.asarray(rng.standard_normal((hd, D)), jnp.bfloat16)},
         "norm": {"weight": jnp.ones((hd,), jnp.bfloat16)}}
    x = jnp.asarray(rng.standard_normal((1, 5, D)), jnp.float32)
    lat = compressor.compress(p, x, 2, 1e-20, jnp.float32)
    assert lat.shape == (1, 2, hd)  # 5 tokens -> 2 complete groups; token 4 is a partial group
    x2 = x.at[0, 4].set(100.0)
    np.testing.assert_array_equal(np.asarray(compressor.compress(p, x2, 2, 1e-20, jnp.float32)), np.asarray(lat))
    # Group 1 is tokens 2 and 3: recompute it by hand.
    kv = np.asarray(x[0, 2:4]) @ np.asarray(p["wkv"]["weight"], np.float32).T
    sc = np.asarray(x[0, 2:4]) @ np.asarray(p["wgate"]["weight"], np.float32).T
    w = np.exp(sc - sc.max(0)) / np.exp(sc - sc.max(0)).sum(0)
    pooled = (w * kv).sum(0)
    np.testing.assert_allclose(np.asarray(lat[0, 1]), pooled / np.sqrt(np.mean(pooled ** 2)), rtol=2e-5, atol=1e-5)


def test_select_topk_ties_and_padding():
    s = jnp.array([[[3.0, 5.0, 5.0, 1.0, NEG, NEG],
                    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
                    [1.0, NEG, NEG, NEG, NEG, NEG],
                    [NEG, NEG, NEG, NEG, NEG, NEG]]], jnp.bfloat16)
    idx = np.asarray(indexer.select_topk(s, 4))
    assert idx[0, 0].tolist() == [0, 1, 2, 3]     # top-4 of 6, returned ascending
    assert idx[0, 1].tolist() == [0, 1, 2, 3]     # all tied: the lower slots win
    assert idx[0, 2].tolist() == [0, -1, -1, -1]  # one visible slot: the rest are −1
    assert idx[0, 3].tolist() == [-1, -1, -1, -1]  # nothing visible
    idx2 = np.asarray(indexer.select_topk(s, 2))
    assert idx2[0, 0].tolist() == [1, 2]           # 5, 5 beat 3
    assert idx2[0, 1].tolist() == [0, 1]
    # k larger than the number of slots is clamped to S.
    assert indexer.select_topk(s, 100).shape == (1, 4, 6)


def test_index_scores_hand_case():
    # 2 heads, dI = 2; keys for 3 slots; visible = 2 masks slot 2.
    q = jnp.array([[[[1.0, 0.0], [0.0, 1.0]]]], jnp.float32)  # [B=1, T=1, nI=2, dI=2]
    w = jnp.array([[[0.5, 2.0]]], jnp.float32)
    keys = jnp.array([[[1.0, 1.0], [-1.0, 3.0], [4.0, 4.0]]], jnp.float32)
    s = indexer.index_scores(q, w, keys, jnp.array([[2]], jnp.int32), jnp.float32)
    # slot 0: 0.5*relu(1) + 2*relu(1) = 2.5; slot 1: 0.5*relu(-1) + 2*relu(3) = 6; slot 2 invisible.
    assert np.asarray(s)[0, 0].tolist() == [2.5, 6.0, -np.inf]
    # bf16 flow rounds each product: w = 1/3 -> bf16(1/3)·1 is not exactly 1/3.
    sb = indexer.index_scores(q, jnp.array([[[1 / 3, 0.0]]]), keys, jnp.array([[3]], jnp.int32), jnp.bfloat16)
    assert sb.dtype == jnp.bfloat16
    assert float(sb[0, 0, 0]) == float(jnp.asarray(1 / 3, jnp.bfloat16))


def test_candidate_blocks():
    # 7 slots in blocks of 2: [0,1] [2,3] [4,5] [6]; newest visible slot 6 -> block 3 forced.
    s = jnp.array([[[1.0, 9.0, 2.0, 3.0, 8.0, 0.0, -5.0]]], jnp.bfloat16)
    m = np.asarray(indexer.candidate_mask(s, jnp.array([[7]]), 2, 2))
    # forced block 3 plus the best other block (max 9 in block 0).
    assert m[0, 0].tolist() == [True, True, False, False, False, False, True]
    m3 = np.asarray(indexer.candidate_mask(s, jnp.array([[7]]), 2, 3))
    assert m3[0, 0].tolist() == [True, True, False, False, True, True, True]
    # Only 3 slots visible (scores beyond are −inf): newest slot 2 -> block 1 forced; blocks with all −inf
    # are never kept even when the limit allows.
    s2 = jnp.array([[[1.0, 9.0, 2.0, NEG, NEG, NEG, NEG]]], jnp.bfloat16)
    m4 = np.asarray(indexer.candidate_mask(s2, jnp.array([[3]]), 2, 4))
    assert m4[0, 0].tolist() == [True, True, True, True, False, False, False]


def test_moe_bias_ranks_but_does_not_weight():
    class C:  # route() also reads the implementation switch and the numerics mode (linear.f32)
        gate_temp = 1.0
        norm_topk_prob = True
        routed_scaling_factor = 1.5
        impl = "auto"
        act_dtype = "float32"

    D, E = 4, 4
    # x = e0, so logits = W[:, 0].
    x = jnp.array([[1.0, 0.0, 0.0, 0.0]])
    logits = np.array([3.0, 2.0, 1.0, 25.0], np.float32)
    W = np.zeros((E, D), np.float32)
    W[:, 0] = logits
    bias = jnp.array([0.0, 0.0, 10.0, -100.0], jnp.float32)
    idx, w, s = moe.route({"weight": jnp.asarray(W, jnp.bfloat16), "bias": bias}, x, 2, C)
    sp = np.log1p(np.exp(logits))
    sp[3] = logits[3]  # torch softplus threshold: x > 20 -> x
    sc = np.sqrt(sp)
    np.testing.assert_allclose(np.asarray(s)[0], sc, rtol=1e-6)
    # Ranking by s + bias: expert 2 (1.31+10) then expert 0 (1.82); expert 3 has the best s but bias −100.
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 2]
    got = dict(zip(np.asarray(idx)[0].tolist(), np.asarray(w)[0].tolist()))
    tot = sc[0] + sc[2]
    assert got[2] == pytest.approx(sc[2] / tot * 1.5, rel=1e-6)  # weights from s alone, not s + bias
    assert got[0] == pytest.approx(sc[0] / tot * 1.5, rel=1e-6)


def test_moe_ties_go_to_lower_expert():
    class C:  # route() also reads the implementation switch and the numerics mode (linear.f32)
        gate_temp = 1.0
        norm_topk_prob = True
        routed_scaling_factor = 1.0
        impl = "auto"
        act_dtype = "float32"

    W = jnp.ones((4, 4), jnp.bfloat16)
    idx, _, _ = moe.route({"weight": W, "bias": jnp.zeros(4)}, jnp.ones((1, 4)), 2, C)
    assert np.asarray(idx)[0].tolist() == [0, 1]


def test_swiglu_clamps_and_weight_before_w2():
    # linear() stand-in: w1 gives g, w3 gives u, w2 is the identity.
    g = jnp.array([[20.0, -3.0, 1.0]])
    u = jnp.array([[50.0, -50.0, 2.0]])

    def lin(a, which):
        return {"g": g, "u": u}.get(which, a)

    out = moe.swiglu_expert(jnp.zeros((1, 3)), "g", "u", "id", jnp.array([0.5]), 10.0, jnp.float32, lin)
    gc = np.minimum(np.asarray(g), 10.0)
    uc = np.clip(np.asarray(u), -10, 10)
    expected = gc / (1 + np.exp(-gc)) * uc * 0.5
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6)


def test_attention_sink_and_joint_softmax():
    # One head, hd = 4; two window keys and one compressed key; sink adds exp(sink − max) to the denominator.
    q = jnp.array([[[[1.0, 0.0, 0.0, 0.0]]]])  # [1,1,1,4]
    win = jnp.array([[[2.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0]]])  # [1,2,4]
    comp = jnp.array([[[[4.0, 0.0, 1.0, 0.0]]]])  # [1,1,1,4]
    sink = jnp.array([0.7])
    out = attention.attend(q, win, jnp.array([[[True, True]]]), comp, jnp.array([[[True]]]), sink, jnp.float32)
    logits = np.array([2.0, 0.0, 4.0]) * 0.5  # hd^-0.5 = 0.5
    m = logits.max()
    p = np.exp(logits - m)
    denom = p.sum() + np.exp(0.7 - m)
    vals = np.array([[2.0, 0, 0, 1], [0, 0, 0, 3], [4, 0, 1, 0]])
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], (p[:, None] * vals).sum(0) / denom, rtol=1e-6)
    # Masked-out keys do not count; a row with nothing valid gives exactly 0.
    out2 = attention.attend(q, win, jnp.array([[[False, False]]]), comp, jnp.array([[[False]]]), sink, jnp.float32)
    assert np.all(np.asarray(out2) == 0)


def test_attention_bf16_numerator():
    # In the bf16 flow the probabilities in the numerator are rounded to bf16, the denominator is not.
    q = jnp.array([[[[1.0, 0.0]]]])
    win = jnp.array([[[0.3, 1.0], [0.0, 1.0]]])
    mask = jnp.array([[[True, True]]])
    comp = jnp.zeros((1, 1, 0, 2))
    cm = jnp.zeros((1, 1, 0), bool)
    out = attention.attend(q, win, mask, comp, cm, jnp.array([-1e9]), jnp.bfloat16)
    logits = np.array([0.3, 0.0]) * 2 ** -0.5
    p = np.exp(logits - logits.max())
    pb = np.asarray(jnp.asarray(p, jnp.bfloat16).astype(jnp.float32))
    exp = (pb[:, None] * np.array([[0.3, 1.0], [0.0, 1.0]])).sum(0) / p.sum()
    np.testing.assert_allclose(np.asarray(out, np.float32)[0, 0, 0], exp, rtol=8e-3)
    assert out.dtype == jnp.bfloat16
