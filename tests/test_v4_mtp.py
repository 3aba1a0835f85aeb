"""DeepSeek-V4's MTP draft (model/v4/mtp.py, model/v4/speculative.py) on micro-v4 (tests/configs.py: tiny-v4 cut to one
sliding hash-routed, one CSA and one HCA layer, with tiny-v4's MTP layer) in the exact mode: the MTP layer's
paged step ≡ its full-sequence reference; greedy decoding with MTP speculation == plain greedy token for token,
with the MTP's own drafts and with an oracle that makes full and partial acceptances happen; a checkpoint without
mtp.* tensors (what transformers writes) loads without the draft, and speculation then refuses clearly."""

import functools
import types

import jax
import numpy as np
import pytest

import configs

from dsv41_jax.model import ModelConfig, forward, init_params
from dsv41_jax.model.cache import CacheConfig
from dsv41_jax.model.v4 import mtp
from dsv41_jax.model.v4 import speculative as sp

CFG = configs.micro_v4().replace(act_dtype="exact")
CCFG = CacheConfig(page_size=16, num_pages=8, max_slots=1, max_pages_per_seq=4)
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, CFG.vocab_size, 13)]
N = 9


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _reference():
    return sp.greedy(_params(), PROMPT, N, CFG, CCFG)


def test_mtp_step_equals_its_forward():
    """The MTP layer over 30 rows of target streams: chunks of 11, 1, 7, ... through its window cache give the
    reference pass's logits (<= 1e-5) and the same experts."""
    params = _params()
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, (1, 31)).astype(np.int32)
    _, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(params, tokens[:, :30], CFG, return_aux=True)
    h, nxt = aux["streams"], tokens[:, 1:]
    ref, raux = jax.jit(mtp.forward, static_argnames=("cfg", "return_aux"))(params, h, nxt, CFG, return_aux=True)
    step = jax.jit(mtp.extend, static_argnames=("cfg", "ccfg"))
    state, done, got = mtp.init_state(CFG, CCFG), 0, []
    pt = (np.arange(CCFG.max_pages_per_seq, dtype=np.int32) + 1)[None]
    for T in (11, 1, 7, 11):
        batch = {"tokens": nxt[:, done:done + T], "start": np.array([done], np.int32), "n_new": np.array([T], np.int32),
                 "slot": np.zeros(1, np.int32), "page_table": pt}
        lg, state, _ = step(params, state, h[:, done:done + T], batch, CFG, CCFG)
        got.append(np.asarray(lg))
        done += T
    np.testing.assert_allclose(np.concatenate(got, 1), np.asarray(ref), atol=1e-5, rtol=0)
    assert np.isfinite(np.asarray(ref)).all() and sorted(raux["experts"]) == [0]


def test_greedy_with_mtp_equals_plain_greedy():
    ref = _reference()
    out, stats = sp.greedy_mtp(_params(), PROMPT, N, CFG, CCFG, gamma=2)
    assert out == ref
    assert 1 <= stats["steps"] <= N - 1 and 0 <= stats["accepted"] <= 2 * stats["steps"]


def test_accepted_and_rejected_drafts_keep_the_output():
    """An oracle proposes the true continuation, wrong at every third proposal: steps accept 2, 1 or 0 drafts, the
    commit re-runs the step for the accepted prefix, and the output is still plain greedy's."""
    ref = _reference()
    seen = []

    def oracle(out, drafts):
        prop = [ref[len(out) + i] if len(out) + i < len(ref) else 0 for i in range(len(drafts))]
        seen.append(len(seen))
        if len(seen) % 3 == 2:
            prop[1] = (prop[1] + 1) % CFG.vocab_size
        return prop

    out, stats = sp.greedy_mtp(_params(), PROMPT, N, CFG, CCFG, gamma=2, propose=oracle)
    assert out == ref
    assert stats["accepted"] > stats["steps"]  # mostly accepted ...
    assert stats["accepted"] < 2 * stats["steps"]  # ... but not always


def test_checkpoint_without_mtp_tensors_loads_without_the_draft(tmp_path):
    from dsv41_jax.model.v4.checkpoint import load_params, save_checkpoint

    cfg = ModelConfig.preset("tiny-v4")  # num_nextn_predict_layers 1 in config.json, as transformers writes it
    save_checkpoint(dict(init_params(cfg, jax.random.key(1)), mtp=[]), cfg, str(tmp_path))
    params = load_params(str(tmp_path), cfg)
    assert params["mtp"] == [] and len(params["layers"]) == cfg.num_hidden_layers
    with pytest.raises(ValueError, match="no MTP layer"):
        sp.greedy_mtp(params, PROMPT, 2, cfg, CCFG)
    with pytest.raises(NotImplementedError, match="DSpark head"):
        mtp.require(params, types.SimpleNamespace(draft_kind="dspark"))  # a 0731 / 0813 config's draft kind
