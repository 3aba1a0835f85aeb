"""DeepSeek-V4 through the serving engine (issue 48): the runner runs `model.v4.decode.extend` (`serving.model_step`).

tiny-v4 (2 sliding, 2 CSA ratio 4, 2 HCA ratio 8 layers, hash-routed MoE, pre-mix mHC) in the exact numerics mode,
one engine for the module: 2 slots, one batch bucket (2), token buckets 1 and 16, pages of 8. Two prompts of
different lengths run together, so rows are ragged, prefill is chunked (16-token chunks cutting CSA / HCA windows
anywhere) and the compressor state is carried from prefill into decode. Reference: one V4 full forward
(`model.forward`) over each prompt + the engine's output: greedy is right iff the forward's argmax at every
generated position is the token the engine chose; logprobs are the forward's log_softmax there. Tolerance: 1e-5
absolute (the exact mode's sums are order-independent; XLA's fp32 transcendentals at the suite's -O0 differ per
program shape by ~1e-6, tests/test_v4_decode.py).
"""

import functools
import itertools

import jax
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, forward, init_params
from dsv41_jax.serving.engine import Engine, EngineError
from dsv41_jax.serving.sampling import SamplingParams

CFG = ModelConfig.preset("tiny-v4").replace(act_dtype="exact")
KW = dict(model="tiny", page_size=8, max_total_tokens=256, context_length=64, max_running_requests=2,
          chunked_prefill_size=16, batch_buckets=[2], token_buckets=[16], skip_server_warmup=True,
          decode_log_interval=1000)
PROMPTS = [list(np.random.default_rng(1).integers(0, CFG.vocab_size, 37)),
           list(np.random.default_rng(2).integers(0, CFG.vocab_size, 22))]
N_NEW = 12
ATOL = 1e-5
_ids = itertools.count()


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def eng():
    return Engine(cfg=CFG, params=_params(), **KW)


_forward = jax.jit(forward, static_argnames=("cfg",))


def forward_logprobs(seqs):
    """log_softmax of the V4 forward over each sequence (right-padded into one [B, L] call: causal, so padding
    changes nothing before it): a list of fp64 [len, V]."""
    L = 64  # one shape for every call of the module
    toks = np.zeros((len(seqs), L), np.int32)
    for b, s in enumerate(seqs):
        toks[b, :len(s)] = s
    lg = np.asarray(_forward(_params(), toks, CFG), np.float64)
    lsm = lg - lg.max(-1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
    return [lsm[b, :len(s)] for b, s in enumerate(seqs)]


def run(eng, prompts, params_of):
    for i, p in enumerate(prompts):
        eng.add_request(f"v4-{next(_ids)}", prompt_token_ids=[int(t) for t in p], sampling_params=params_of(i))
    outs = sorted(eng.run_until_done(), key=lambda o: int(o.request_id.split("-")[1]))
    assert all(o.finished and o.error is None for o in outs)
    return [o.outputs[0] for o in outs]


def check_against_forward(prompts, samples, top: int):
    ref = forward_logprobs([list(p) + s.token_ids for p, s in zip(prompts, samples)])
    for p, s, lsm in zip(prompts, samples, ref):
        n = len(p)
        rows = lsm[n - 1:n - 1 + len(s.token_ids)]  # row n-1+j predicts token j
        np.testing.assert_allclose(s.logprobs, rows[np.arange(len(s.token_ids)), s.token_ids], atol=ATOL, rtol=0)
        for j, tl in enumerate(s.top_logprobs):
            ids = [t for t, _ in tl]
            want = sorted(range(CFG.vocab_size), key=lambda v: (-rows[j, v], v))[:top]
            assert ids == want, j
            np.testing.assert_allclose([v for _, v in tl], rows[j, ids], atol=ATOL, rtol=0)
    return ref


def test_greedy_chunked_prefill_and_decode_equal_the_forward(eng):
    assert eng.runner.model_step.family == "deepseek_v4"
    samples = run(eng, PROMPTS, lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.0, logprobs=3))
    ref = check_against_forward(PROMPTS, samples, top=3)
    for p, s, lsm in zip(PROMPTS, samples, ref):
        assert len(s.token_ids) == N_NEW
        # the forward's greedy continuation: its argmax at every generated position is the engine's token
        assert list(lsm[len(p) - 1:-1].argmax(-1)) == s.token_ids
    # pages and slots back
    assert eng.allocator.used_pages == 0


def test_seeded_sampling_is_reproducible_and_scored_by_the_forward(eng):
    sp = lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.9, top_p=0.95, seed=11 + i, logprobs=2)  # noqa: E731
    a = run(eng, PROMPTS, sp)
    b = run(eng, PROMPTS, sp)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]  # bitwise: same programs, same inputs
    check_against_forward(PROMPTS, a, top=2)
    c = run(eng, PROMPTS[:1], lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.9, top_p=0.95, seed=99))
    assert c[0].token_ids != a[0].token_ids  # another seed, another draw (12 tokens at T = 0.9)


def test_unsupported_v4_flags_are_refused_at_start():
    with pytest.raises(EngineError, match="DeepSeek-V4 checkpoint: not supported with --speculative-algorithm DSPARK"):
        Engine(cfg=CFG, params=_params(), speculative_algorithm="DSPARK", **KW)
    with pytest.raises(EngineError, match="not supported with --enable-decoder-swa-bounded-replay"):
        Engine(cfg=CFG, params=_params(), enable_decoder_swa_bounded_replay=True, disable_radix_cache=True, **KW)
    with pytest.raises(EngineError, match="not supported with a mesh"):
        Engine(cfg=CFG, params=_params(), tp_size=2, **KW)
