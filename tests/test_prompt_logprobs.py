"""Prompt logprobs from the engine's prefill (issue 16 item 1): equal to the reference forward's
log-softmax at every prompt position, for prompts longer than one prefill chunk and for batched
prompts of different lengths; ``max_tokens=0`` scores the prompt alone.

One engine per module in the exact numerics mode (token bucket 16 = the chunk size, one batch bucket of
8) with ``warmup_prompt_logprobs`` (the all-logits variant compiled in the warm-up), so a 40-token prompt
is prefilled in 3 chunks through the all-logits variant and the first such request compiles nothing. The
reference is `forward` (jitted, same mode) on the prompts right-padded to one length (causal: padding
after a position changes nothing before it). The exact mode, because the paged decode step and the full
forward sum in different orders: in fp32 that once flipped an index / expert choice of micro's (JAX 0.12
at position 10 of a 33-token prompt: logprobs 0.75 apart). Tolerance: 2e-4 absolute on logprobs (what
is left differs in the fp32 log-softmax's rounding only)."""

import itertools

import jax
import numpy as np
import pytest

import configs
from dsv41_jax.model import forward
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams, SamplingParamsError

ENGINE_KW = dict(model="tiny", dtype="exact", page_size=16, context_length=128, max_running_requests=8,
                 max_total_tokens=1024, chunked_prefill_size=16, batch_buckets=[8], token_buckets=[16])
TOL = 2e-4
_ids = itertools.count()


@pytest.fixture(scope="module")
def eng():
    e = Engine(EngineArgs(**ENGINE_KW, warmup_prompt_logprobs=True), cfg=configs.micro())
    yield e
    assert e.allocator.free_pages == e.allocator.capacity


def test_first_prompt_logprobs_request_compiles_nothing(eng):
    """Issue 37: the first echo + logprobs request compiled the all-logits variant on first use (55 s
    for nano on a CPU). With ``warmup_prompt_logprobs`` the warm-up compiled it for every bucket, so
    the first such request -- prefill chunks with and without a sampling row -- adds no compilation
    to the engine's counter (which counts the all-logits programs once they exist). Runs first."""
    n0 = eng.num_compilations()
    assert eng.runner._extend_all is not None and eng.runner._extend_all._cache_size() >= 1
    (r,) = _run(eng, [list(range(5, 45))], SamplingParams(max_tokens=2, prompt_logprobs=2, logprobs=2))
    assert len(r["plp"]) == 40 and r["out"].finished
    assert eng.num_compilations() == n0


def test_warmup_prompt_logprobs_flag():
    """--warmup-prompt-logprobs parses, is documented, and is refused where it cannot act."""
    import argparse

    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert p.parse_args(["--warmup-prompt-logprobs"]).warmup_prompt_logprobs is True
    assert "--warmup-prompt-logprobs" in p.format_help()
    with pytest.raises(ValueError, match="warmup_prompt_logprobs"):
        EngineArgs(model="tiny", warmup_prompt_logprobs=True, skip_server_warmup=True)
    with pytest.raises(ValueError, match="warmup_prompt_logprobs"):
        EngineArgs(model="tiny", warmup_prompt_logprobs=True, enable_decoder_swa_bounded_replay=True,
                   disable_radix_cache=True)


REF_SHAPE = (4, 40)  # every test's prompts padded to one [B, T]: the reference forward compiles once


def _reference(eng, prompts):
    """log_softmax of the full forward: [REF_SHAPE[0], REF_SHAPE[1], V] fp32 (rows right-padded with 3,
    padding rows after the prompts'); row i is prompt i's."""
    assert len(prompts) <= REF_SHAPE[0] and max(len(p) for p in prompts) <= REF_SHAPE[1]
    toks = np.full(REF_SHAPE, 3, np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    logits = jax.jit(forward, static_argnames="cfg")(eng.params, jax.numpy.asarray(toks), eng.cfg)
    return np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))


def _run(eng, prompts, sp):
    rids = []
    for p in prompts:
        rids.append(f"p{next(_ids)}")
        eng.add_request(rids[-1], p, sp)
    outs = {}
    for o in eng.run_until_done():
        if o.prompt_logprobs is not None:
            outs.setdefault(o.request_id, {})["plp"] = o.prompt_logprobs
        if o.finished:
            outs.setdefault(o.request_id, {})["out"] = o
    return [outs[r] for r in rids]


def test_prompt_logprobs_match_forward_batched_multichunk(eng):
    rng = np.random.default_rng(16)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (40, 7, 23, 2)]  # 40 > 2 chunks of 16
    k = 3
    res = _run(eng, prompts, SamplingParams(max_tokens=2, temperature=0, logprobs=k, prompt_logprobs=k))
    ref = _reference(eng, prompts)
    for i, (p, r) in enumerate(zip(prompts, res)):
        plp = r["plp"]
        assert len(plp) == len(p) and plp[0] is None
        got = np.array([plp[t][0] for t in range(1, len(p))])
        want = ref[i, np.arange(len(p) - 1), p[1:]]
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        for t in range(1, len(p)):
            top = plp[t][1]
            assert len(top) == k
            order = np.argsort(-ref[i, t - 1], kind="stable")[:k]
            np.testing.assert_allclose([v for _, v in top], ref[i, t - 1, order], atol=TOL, rtol=0)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        out = r["out"].outputs[0]
        assert len(out.token_ids) == 2
        # the first generated token's logprob is the forward's at the last prompt position
        np.testing.assert_allclose(out.logprobs[0], ref[i, len(p) - 1, out.token_ids[0]], atol=TOL, rtol=0)


def test_max_tokens_zero_scores_prompt_alone(eng):
    rng = np.random.default_rng(17)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (33, 1, 5)]
    res = _run(eng, prompts, SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0))
    ref = _reference(eng, prompts)
    for i, (p, r) in enumerate(zip(prompts, res)):
        out = r["out"]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        plp = r["plp"]
        assert len(plp) == len(p) and plp[0] is None
        got = np.array([plp[t][0] for t in range(1, len(p))])
        np.testing.assert_allclose(got, ref[i, np.arange(len(p) - 1), p[1:]], atol=TOL, rtol=0)
        assert all(plp[t][1] == [] for t in range(1, len(p)))


def test_prompt_logprobs_validation(eng):
    with pytest.raises(SamplingParamsError):
        SamplingParams(max_tokens=0)  # 0 only with prompt_logprobs
    with pytest.raises(SamplingParamsError):
        eng.add_request("bad", [5, 6], SamplingParams(prompt_logprobs=eng.max_logprobs + 1))
