"""DeepSeek-V4 through the serving engine (issue 48): the runner runs `model.v4.decode.extend` (`serving.model_step`).

micro-v4 (tests/configs.py: tiny-v4 cut to 3 layers, each V4 mechanism once: a sliding hash-routed layer, a CSA
(ratio 4) and an HCA (ratio 8) layer, pre-mix mHC, tiny-v4's MTP layer) in the exact numerics mode, one engine for
the module: 2 slots, one batch bucket (2), token buckets 1 and 16, pages of 8. Two prompts of
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

import configs

from dsv41_jax.model import forward, init_params
from dsv41_jax.serving.engine import Engine, EngineError
from dsv41_jax.serving.sampling import SamplingParams

CFG = configs.micro_v4().replace(act_dtype="exact")
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
    with pytest.raises(EngineError, match="not supported with --expert-distribution-recorder"):
        Engine(cfg=CFG, params=_params(), expert_distribution_recorder=True, **KW)
    # MTP flags: SGLang's spelling, top-1 chains only; EAGLE on a V4.1 checkpoint (a DSpark draft) is refused
    from dsv41_jax.serving.engine_args import EngineArgs

    with pytest.raises(ValueError, match="speculative_eagle_topk: must be 1"):
        EngineArgs(speculative_algorithm="EAGLE", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens: must be --speculative-num-steps \\+ 1"):
        EngineArgs(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_num_draft_tokens=3)
    with pytest.raises(ValueError, match="needs --speculative-algorithm EAGLE or NEXTN"):
        EngineArgs(speculative_algorithm="DSPARK", speculative_num_steps=2)
    assert EngineArgs(speculative_algorithm="eagle", speculative_num_draft_tokens=4).resolved_mtp_steps() == 3
    with pytest.raises(EngineError, match="MTP speculation runs DeepSeek-V4's MTP layer"):
        Engine(model="tiny", speculative_algorithm="EAGLE", skip_server_warmup=True)


# ---------------------------------------------------------------- prefix cache (per-layer compressor state)


def test_prefix_cache_hit_equals_cold(eng):
    """A prompt run again restores its snapshot (window rings, every CSA / HCA layer's compressor projections,
    the pool pages of its closed windows) and prefills only the rest: tokens and logprobs bit for bit those of
    the cold run; a prompt sharing only a prefix is scored by the forward as usual."""
    rng = np.random.default_rng(7)
    p = list(rng.integers(0, CFG.vocab_size, 41))
    branch = p[:29] + list(rng.integers(0, CFG.vocab_size, 6))  # cuts a CSA window (4) and an HCA window (8)
    sp = lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.0, logprobs=2)  # noqa: E731
    eng.add_request("cold", prompt_token_ids=p, sampling_params=sp(0))
    cold = {o.request_id: o for o in eng.run_until_done()}["cold"]
    assert not cold.num_cached_tokens
    eng.add_request("warm", prompt_token_ids=p, sampling_params=sp(0))
    eng.add_request("branch", prompt_token_ids=branch, sampling_params=sp(0))
    outs = {o.request_id: o for o in eng.run_until_done()}
    warm = outs["warm"]
    assert warm.num_cached_tokens and warm.num_cached_tokens >= 32, warm.num_cached_tokens
    assert outs["branch"].num_cached_tokens, "the shared prefix was not reused"
    a, b = cold.outputs[0], warm.outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
    check_against_forward([p, branch], [b, outs["branch"].outputs[0]], top=2)


# ---------------------------------------------------------------- MTP speculation (EAGLE / NEXTN)


@pytest.fixture(scope="module")
def mtp_eng():
    e = Engine(cfg=CFG, params=_params(), speculative_algorithm="EAGLE", speculative_num_steps=2,
               speculative_eagle_topk=1, speculative_num_draft_tokens=3, **KW)
    assert e.spec_gamma == 2
    return e


def test_mtp_greedy_equals_plain_greedy(eng, mtp_eng):
    """Greedy with MTP speculation gives the plain engine's tokens exactly: with the MTP layer's own drafts, and
    with an oracle fixing drafts (the reference with a wrong token at a per-row, per-step position) so rows of
    one launch accept 0..γ drafts — each accepted prefix committed by re-running the target step, the MTP layer
    catching up on it. The MTP rows are also checked by acceptance: its own drafts accept what the model-level
    `v4.speculative.greedy_mtp` (tests/test_v4_mtp.py) accepts for the same prompt."""
    from oracle_drafter import oracle_drafts

    greedy = lambda i: SamplingParams(max_tokens=N_NEW, temperature=0.0)  # noqa: E731
    ref = [s.token_ids for s in run(eng, PROMPTS, greedy)]
    own = run(mtp_eng, PROMPTS, greedy)
    assert [s.token_ids for s in own] == ref
    st = mtp_eng.stats()
    assert st["spec_verify_steps"] > 0
    g = mtp_eng.spec_gamma
    mtp_eng.prefix_cache.clear_cache()
    by_rid, seen = {}, {}

    def oracle(L):
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = by_rid[r.req_id]
            want = ref[i][r.step:r.step + g]
            out[b, :len(want)] = want
            seen[i] = seen.get(i, -1) + 1
            k = (seen[i] + i) % (g + 1)  # the first wrong draft, cycling per row (k = γ: all right)
            if k < len(want):
                out[b, k] = (want[k] + 1) % CFG.vocab_size
        return out

    with oracle_drafts(mtp_eng, oracle) as drafter:
        rids = [f"o{next(_ids)}" for _ in PROMPTS]
        by_rid.update({r: i for i, r in enumerate(rids)})
        for rid, p in zip(rids, PROMPTS):
            mtp_eng.add_request(rid, prompt_token_ids=[int(t) for t in p], sampling_params=greedy(0))
        done = {o.request_id: o for o in mtp_eng.run_until_done()}
    assert [done[r].outputs[0].token_ids for r in rids] == ref
    assert {n for a in drafter.accepts() for n in a} == set(range(g + 1))
    assert mtp_eng.allocator.used_pages == 0


def test_mtp_drafts_equal_the_model_level_loop(mtp_eng):
    """The engine's MTP state (lagged rows written by prefill chunks, the speculative step's row s − 1, the
    catch-up after each commit) gives exactly the drafts of the model-level loop (`v4.speculative.greedy_mtp`:
    the prompt in one chunk, its MTP cache caught up after every verify) for one request alone: the same γ drafts
    at every verify step (read with the production draft-only launch, then verified as the step's drafts), cold
    and again from the prefix cache (the snapshot holds the MTP ring and the last target streams)."""
    from dsv41_jax.model.cache import CacheConfig
    from dsv41_jax.model.v4.speculative import greedy_mtp
    from dsv41_jax.serving import speculator as spr

    p = [int(t) for t in PROMPTS[0]]
    ref_drafts = []
    toks, stats = greedy_mtp(_params(), p, N_NEW, CFG, CacheConfig(page_size=8, num_pages=12, max_slots=1,
                                                                   max_pages_per_seq=8), gamma=mtp_eng.spec_gamma,
                             propose=lambda out, d: ref_drafts.append(list(d)) or d)

    class Recording(spr.MTPSpeculator):
        def launch(self, params, dev, L, warm=False):
            if warm or not L.rows:
                return super().launch(params, dev, L, warm)
            batch, step = self.batch(L)
            drafts = np.asarray(self._propose(params, dev.state, dev.slot_tensors, batch, step)).astype(np.int32)
            got.append(drafts[0].tolist())
            return self.verify(params, dev, L, batch, step, drafts, self.grammar_masks(params, dev, L, batch, step,
                                                                                       drafts))

    base = mtp_eng.runner.speculator
    rec = Recording.__new__(Recording)
    rec.__dict__.update(base.__dict__)
    mtp_eng.runner.speculator = rec
    mtp_eng.prefix_cache.clear_cache()
    try:
        for run_ in ("cold", "cached"):  # the second restores the prompt's snapshot, MTP ring and streams included
            got = []
            mtp_eng.add_request(f"alone-{run_}", prompt_token_ids=p,
                                sampling_params=SamplingParams(max_tokens=N_NEW, temperature=0.0))
            (o,) = mtp_eng.run_until_done()
            assert bool(o.num_cached_tokens) == (run_ == "cached"), o.num_cached_tokens
            assert o.outputs[0].token_ids == toks
            assert got == ref_drafts[:len(got)] and len(got) == stats["steps"], (run_, got, ref_drafts)
            assert (o.metrics["spec_verify_steps"], o.metrics["spec_accepted_tokens"]) == (stats["steps"],
                                                                                            stats["accepted"])
    finally:
        mtp_eng.runner.speculator = base
