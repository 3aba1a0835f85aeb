"""The reference forward pass: causality, real drops by the sparse selection, jit behaviour, flash shapes.

The model tests run on `configs.mini` (tiny's sizes and every mechanism of its layout in 6 layers: the
properties are the forward's, at ~0.64x tiny's compile time); the goldens elsewhere stay on tiny."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from dsv41_jax.model import ModelConfig, forward, init_params, param_shapes

T = 40  # > window (8); 20 ratio-2 groups, 40 ratio-1 slots > index_topk (4) and 3 candidate blocks of 2


FWD = jax.jit(forward, static_argnames=("cfg", "return_aux"))  # one jit: the tests share its programs


def _fwd_aux(params, tokens, cfg):
    return FWD(params, tokens, cfg, return_aux=True)


# Three forward programs for the module: [11, T] with aux in bf16 and fp32 (test_causality; the bf16 one is also
# test_selection_really_drops's and test_fp32_mode_close_to_bf16's, on row 0 = `tokens`; the fp32 one is also
# test_batch_rows_are_independent's) and [1, T] fp32 without aux (test_batch_rows_are_independent, test_fp32_mode_...).


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(7), (1, T), 3, 300, dtype=jnp.int32)


# Boundaries for tiny's sizes (mini has them): window 8 (k = 8, 9), ratio-2 groups (odd/even k), candidate blocks of 2 slots
# (ratio-1 slots 12/13, ratio-2 slots 2 tokens each), plus late positions where top-k is saturated.
CAUSAL_KS = [1, 7, 8, 9, 12, 13, 16, 25, 32, 39]


def _causal_batch(tokens):
    """[1 + len(CAUSAL_KS), T]: row 0 is `tokens`, row i changes token CAUSAL_KS[i - 1]."""
    variants = [tokens[0]]
    for k in CAUSAL_KS:
        variants.append(tokens[0].at[k].set((tokens[0, k] + 17) % 300 + 3))
    return jnp.stack(variants)


@pytest.fixture(scope="module")
def bf16_causal(mini_params, mini_cfg, tokens):
    """(logits, aux) of the bf16 [11, T] forward of `_causal_batch(tokens)`: run once for the three tests that read it."""
    return _fwd_aux(mini_params, _causal_batch(tokens), mini_cfg)


@pytest.mark.parametrize("mode", ["bfloat16", "float32"])
def test_causality(mini_params, mini_cfg, tokens, bf16_causal, mode):
    cfg = mini_cfg.replace(act_dtype=mode)
    out = bf16_causal if mode == "bfloat16" else _fwd_aux(mini_params, _causal_batch(tokens), cfg)
    logits = np.asarray(out[0])
    assert np.isfinite(logits).all()
    for i, k in enumerate(CAUSAL_KS, start=1):
        d_before = np.abs(logits[i, :k] - logits[0, :k]).max() if k else 0.0
        assert d_before <= 1e-6, f"changing token {k} moved logits before it by {d_before}"
        assert np.abs(logits[i, k] - logits[0, k]).max() > 0, f"changing token {k} did not change its own logits"


def test_batch_rows_are_independent(mini_params, mini_cfg32, tokens):
    """A row among 10 others (the [11, T] shape of test_causality[float32]: its program) == alone."""
    others = jax.random.randint(jax.random.key(9), (len(CAUSAL_KS), T), 3, 300, dtype=jnp.int32)
    batch = np.asarray(_fwd_aux(mini_params, jnp.concatenate([others[:3], tokens, others[3:]]), mini_cfg32)[0])
    one = np.asarray(FWD(mini_params, tokens, mini_cfg32))
    np.testing.assert_allclose(batch[3], one[0], atol=1e-5, rtol=0)


def test_selection_really_drops(mini_cfg, bf16_causal):
    """On `tokens` (row 0 of test_causality's bf16 batch: its program, the aux is per row)."""
    cfg = mini_cfg
    _, aux = bf16_causal
    t_last = T - 1
    for lid, sel in aux["topk"].items():
        sel = np.asarray(sel)[0]
        r = cfg.compress_ratios[lid]
        visible = (t_last + 1) // r
        picked = sel[t_last][sel[t_last] >= 0]
        assert visible > cfg.index_topk and len(picked) == cfg.index_topk, (lid, picked, visible)
        assert len(set(picked.tolist())) == len(picked)
        assert np.all(np.diff(picked) > 0)  # ascending
        # Early queries see fewer slots than top-k: the rest are −1.
        t_early = 2 * r  # (t+1)//r = 2 visible slots (r=1: 3)
        early = sel[t_early]
        assert (early >= 0).sum() == (t_early + 1) // r and (early[(early >= 0).sum():] == -1).all()
        # Never a slot the query cannot see.
        for t in range(T):
            assert sel[t][sel[t] >= 0].max(initial=-1) < (t + 1) // r
    # Candidate blocks (the candidate source's) drop visible slots; a re-scoring layer picks only inside them.
    cand = np.asarray(aux["cand"][cfg.candidate_source_layer_id])[0]
    n_cand = cand[t_last].sum()
    assert n_cand == cfg.candidate_topk_blocks * cfg.candidate_block_size < (t_last + 1)
    rescoring = [p.layer_id for p in cfg.layer_plans() if p.uses_candidates]
    assert rescoring
    for lid in rescoring:
        sel = np.asarray(aux["topk"][lid])[0]
        for t in range(T):
            s = sel[t][sel[t] >= 0]
            assert cand[t][s].all(), (lid, t, s)
        # Its own query and weights: it does not simply copy the candidate source's selection.
        assert (sel != np.asarray(aux["topk"][cfg.candidate_source_layer_id])[0]).any()
    # The newest visible slot's block is always a candidate.
    for t in range(T):
        assert cand[t][t]  # ratio 1: newest slot = t


@pytest.mark.parametrize("which", ["tiny", "mini"])
def test_consumers_reuse_topk(which):
    plans = (ModelConfig.preset("tiny") if which == "tiny" else configs.mini()).layer_plans()
    consumers = [p for p in plans if p.compress_ratio > 0 and not p.is_index_source]
    assert consumers
    for p in consumers:
        assert p.index_source < p.layer_id and plans[p.index_source].is_index_source
    # One consumer reuses a re-scoring layer's top-k (mini: 5 reuses 4's, tiny: 9 reuses 8's).
    assert any(plans[p.index_source].uses_candidates for p in consumers)


def test_jit_compiles_once_per_shape():
    """One trace per token shape, none per call (no Python branch on a traced value). On tiny's
    3-layer cut (`configs.micro`): the property is the forward's, at a third of tiny's compile time.
    The second shape is only lowered: `lower` traces as a call would, without a second compile."""
    cfg = configs.micro()
    params = init_params(cfg, jax.random.key(0))
    traces = []

    def f(params, toks):
        traces.append(toks.shape)
        return forward(params, toks, cfg)

    jf = jax.jit(f)
    a = jnp.zeros((1, 12), jnp.int32)
    jf(params, a).block_until_ready()
    jf(params, a + 5).block_until_ready()
    jf(params, a + 7).block_until_ready()
    assert len(traces) == 1
    jf.lower(params, jnp.zeros((1, 13), jnp.int32))
    assert traces == [(1, 12), (1, 13)]
    jf(params, a + 9).block_until_ready()  # the first shape's program is still the one called
    assert len(traces) == 2


def test_fp32_mode_close_to_bf16(mini_params, mini_cfg32, tokens, bf16_causal):
    # the programs test_causality[bfloat16] (aux; row 0 is `tokens`) and test_batch_rows_are_independent ([1, T] fp32)
    a = np.asarray(bf16_causal[0])[:1]
    b = np.asarray(FWD(mini_params, tokens, mini_cfg32))
    # Different dtype flows (bf16 roundings vs none) agree loosely on the first positions.
    assert np.corrcoef(a[0, 0], b[0, 0])[0, 1] > 0.95


def test_flash_forward_shapes_abstractly():
    """The flash forward traces to the right shape. 4 tokens: two ratio-2 groups, a partial window. On
    CPU the trace time grows with the tokens, because the grouped MoE's scoped row tiles grow with its
    groups (min(tokens·k, E)): on an AMD EPYC 16 tokens traced in 37 s, 4 tokens in 13 s."""
    cfg = ModelConfig.preset("flash")
    shapes = param_shapes(cfg)
    toks = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    out = jax.eval_shape(lambda p, t: forward(p, t, cfg), shapes, toks)
    assert out.shape == (1, 4, 129280) and out.dtype == jnp.float32
