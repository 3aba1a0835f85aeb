"""The engine with DSpark (issue 13 parts 3-4): greedy with DSpark ≡ greedy without, token for token, with
rows accepting different lengths in one step; zero compilations across steps with different accept
lengths; pages and slots back after every request; constrained decoding with drafts checked by the
grammar; the simulated-accept-length knob (slow: its own step variant); no test-only input in the
production step; start-up errors. Prefill/decode handover (`serving.handover`): a second DSpark engine
prefills, its exported state (wire form) is decoded by the DSpark engine: the same tokens and logprob
bits as one engine, nothing prefilled on the decode side; bad states refused with the engines clean.
Forced drafts come from a test drafter (tests/oracle_drafter.py's `OracleDrafter`: the production
DSpark steps, with drafts an oracle fixes through the step's drafts input, the one constrained rows use).

Two module-scoped engines on `configs.mini` (tiny's mechanisms in 6 layers, its 3 DSpark stages) in the
exact numerics mode (fp64-accumulated matmuls: a verify chunk equals one-token steps), one without
DSpark and one with (γ = 3, tiny's block). Same
shapes as tests/test_dspark.py (batch 4, pages of 8, 25 pages, context 48) and one-token prefill
chunks, so the DSpark engine's plain step is the very program test_dspark compiles; shapes compile on
first use (no warm-up), and every request here runs on already compiled programs after the first.
Cost: ~120 CPU-s for the module with a cold compile cache, mostly compiling the DSpark verify step and
the draft-only step (constrained rows), each of which holds the draft's three stages.
"""

import dataclasses
import inspect
import itertools
import pickle

import numpy as np
import pytest

from dsv41_jax.serving import handover
from dsv41_jax.serving import speculator as spr
from dsv41_jax.serving.engine import Engine, EngineError
from dsv41_jax.serving.sampling import SamplingParams
from oracle_drafter import oracle_drafts

KW = dict(model="tiny", page_size=8, max_total_tokens=192, context_length=48, max_running_requests=4,
          chunked_prefill_size=1, batch_buckets=[4], skip_server_warmup=True, decode_log_interval=1000)
# 5 requests on 4 slots (one waits for a slot); prompt lengths put rows at different window (8) /
# ratio-group / candidate-block / index_topk phases while they speculate (as in test_dspark).
PROMPTS = [[5, 6, 7], list(range(10, 23)), [100] * 9, [41, 42, 43, 44, 45, 46], [7, 300, 12, 64, 9]]
N_NEW = 16
_ids = itertools.count()


@pytest.fixture(scope="module")
def cfg(mini_cfg):
    return mini_cfg.replace(act_dtype="exact")


@pytest.fixture(scope="module")
def plain_eng(cfg, mini_params):
    return Engine(cfg=cfg, params=mini_params, **KW)


@pytest.fixture(scope="module")
def spec_eng(cfg, mini_params):
    e = Engine(cfg=cfg, params=mini_params, speculative_algorithm="DSPARK", **KW)
    assert e.spec_gamma == cfg.dspark_block_size == 3
    return e


def _greedy(n=N_NEW):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(eng, prompts, sps, each_step=None):
    rids = [f"d{next(_ids)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, sps):
        eng.add_request(rid, p, sp)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        for g in list(eng.output.groups.values()):  # a finished sample holds no page and no slot
            for s in g.seqs:
                if s.status == "finished":
                    assert not eng.allocator.has(s.key) and s.slot is None
        eng.allocator.check_invariants()
        if each_step:
            each_step(eng)
    a = eng.allocator
    assert a.free_pages == a.capacity and sorted(eng.scheduler.free_slots) == list(range(eng.runner.max_slots))
    assert eng.num_running == 0 and eng.num_waiting == 0
    return [outs[r] for r in rids], rids


@pytest.fixture(scope="module")
def ref(plain_eng):
    outs, _ = run(plain_eng, PROMPTS, [_greedy()] * len(PROMPTS))
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_dspark_equals_plain_with_mixed_accept_lengths(spec_eng, ref):
    """Greedy through the DSpark engine gives the plain engine's tokens exactly. First with the draft's
    own proposals (random weights: it accepts little), then with an oracle draft (the test drafter
    `OracleDrafter`) proposing the reference tokens with a wrong one at a per-row, per-step
    position, so rows of one launch accept 0..γ drafts; no compilation across those steps."""
    g = spec_eng.spec_gamma
    outs, _ = run(spec_eng, PROMPTS, [_greedy()] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in outs] == ref
    own = spec_eng.stats()
    assert own["spec_verify_steps"] > 0

    n_comp = spec_eng.num_compilations()
    launches, by_rid = [], {}

    def oracle(L):
        launches.append(L)
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = by_rid[r.req_id]
            n = r.step  # drafts propose output tokens n, n+1, ...
            want = ref[i][n:n + g]
            out[b, :len(want)] = want
            k = (n + 2 * i + len(launches)) % (g + 1)  # the first wrong draft (k = γ: all right)
            if k < len(want):
                out[b, k] = (want[k] + 1) % spec_eng.vocab_size
        return out

    # the wrong-draft schedule below counts launches from a cold prefill: no prefix-cache hits on the
    # prompts just run (such hits keep the tokens, as checked above, but shift the schedule)
    spec_eng.prefix_cache.clear_cache()
    with oracle_drafts(spec_eng, oracle) as drafter:
        rids = [f"o{next(_ids)}" for _ in PROMPTS]
        by_rid.update({r: i for i, r in enumerate(rids)})
        for rid, p in zip(rids, PROMPTS):
            spec_eng.add_request(rid, p, _greedy())
        done = {}
        while spec_eng.has_unfinished():
            for o in spec_eng.step():
                if o.finished:
                    done[o.request_id] = o
            spec_eng.allocator.check_invariants()
    assert [done[r].outputs[0].token_ids for r in rids] == ref
    accepts = drafter.accepts()
    assert any(len(set(a)) > 1 for a in accepts), accepts  # rows accepting different lengths in one step
    assert {n for a in accepts for n in a} == set(range(g + 1))
    assert spec_eng.num_compilations() == n_comp  # zero recompilations across accept lengths
    st = spec_eng.stats()
    assert st["spec_accept_length"] > own["spec_accept_length"] and 0 < st["spec_accept_rate"] <= 1
    assert spec_eng.allocator.free_pages == spec_eng.allocator.capacity


def test_dspark_stops_max_tokens_and_sampling(spec_eng, ref):
    """Multi-token steps end at the right token: with an oracle draft accepting whole blocks, max_tokens
    below γ + 1 and a stop token inside an accepted block cut there (the tokens after it, committed to
    the cache, are dropped with it); a sampled row (temperature, top-p, penalties) runs through the same
    compiled verify step."""
    g = spec_eng.spec_gamma
    stop = ref[1][5]
    cut = ref[1].index(stop) + 1
    sps = [_greedy(2), _greedy().replace(stop_token_ids=[stop]),
           SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.5, max_tokens=9, seed=3, ignore_eos=True)]
    rids: list = []

    def oracle(L):  # the reference's tokens (all accepted) for the greedy rows, the draft's own for the other
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = rids.index(r.req_id)
            if i < 2:
                want = ref[i][r.step:r.step + g]
                out[b, :len(want)] = want
        return out

    n_comp = spec_eng.num_compilations()
    with oracle_drafts(spec_eng, oracle):
        rids += [f"s{next(_ids)}" for _ in range(3)]
        for rid, p, sp in zip(rids, PROMPTS[:3], sps):
            spec_eng.add_request(rid, p, sp)
        outs = {o.request_id: o for o in spec_eng.run_until_done()}
    o0, o1, o2 = (outs[r].outputs[0] for r in rids)
    assert o0.token_ids == ref[0][:2] and o0.finish_reason == "length"
    assert o1.token_ids == ref[1][:cut] and o1.finish_reason == "stop" and o1.stop_reason == stop
    assert outs[rids[1]].metrics["spec_accept_length"] > 1.5
    assert len(o2.token_ids) == 9 and o2.finish_reason == "length"
    assert spec_eng.num_compilations() == n_comp
    assert spec_eng.allocator.free_pages == spec_eng.allocator.capacity


def test_no_test_only_input_in_the_production_step(spec_eng):
    """The production DSpark launch is `speculator._spec_launch`: its inputs are the launch's own (the
    host-fixed drafts are the grammar walk's) — no accept override, no hook; the simulated accept
    length compiles its own variant (`_spec_launch_simulated`), and the runner holds no hook."""
    sp = spec_eng.runner.speculator
    assert type(sp) is spr.DSparkSpeculator and sp.simulate_accept_length is None
    assert sp._step.__wrapped__.func is spr._spec_launch  # jax.jit keeps the partial it wraps
    params = list(inspect.signature(spr._spec_launch).parameters)
    assert params[:8] == ["params", "state", "slot_tensors", "last_token", "batch", "step_counter", "drafts",
                          "allowed"]
    assert not {"accept_override", "forced_draft", "draft_hook", "hook", "oracle"} & set(params)
    assert "accept_override" in inspect.signature(spr._spec_launch_simulated).parameters
    assert not hasattr(spec_eng.runner, "draft_hook")
    assert not hasattr(spr.DSparkSpeculator, "fixed_drafts")  # no test hook in the production class


def test_speculator_state_in_and_out_as_a_value(spec_eng):
    """The speculator takes the runner's `messages.DeviceState` and returns a new one with the launch's
    `LaunchResult`: it writes nothing into the runner (whose arrays it got donated: the runner keeps the
    returned state). A launch of B = 4 with no rows commits nothing and leaves last_token as it was."""
    from dsv41_jax.serving.messages import DeviceState, LaunchResult, SpecLaunch

    r, g = spec_eng.runner, spec_eng.spec_gamma
    assert "runner" not in inspect.signature(spr.DSparkSpeculator.launch).parameters
    dev = r.device_state
    assert isinstance(dev, DeviceState)
    last = np.asarray(dev.last_token).copy()
    held = (r.state, r.slot_tensors, r.last_token)
    new, res = r.speculator.launch(r.params, dev, SpecLaunch((), 4, g))
    assert all(a is b for a, b in zip((r.state, r.slot_tensors, r.last_token), held))  # the runner untouched
    r.device_state = new
    assert isinstance(new, DeviceState) and isinstance(res, LaunchResult)
    assert np.asarray(res.tokens).shape == (4, g + 1) and (np.asarray(res.tokens) == -1).all()
    assert np.asarray(res.n_accept).tolist() == [0] * 4
    assert np.array_equal(np.asarray(r.last_token), last)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.state = None


@pytest.mark.slow  # compiles the simulated variant of the verify step (~1 CPU-min)
def test_simulated_accept_length(cfg, mini_params):
    """--speculative-simulate-accept-length γ+1 (performance runs only): every row-step commits γ + 1
    tokens, the drafts unverified."""
    g = cfg.dspark_block_size
    eng = Engine(cfg=cfg, params=mini_params, speculative_algorithm="DSPARK",
                 speculative_simulate_accept_length=float(g + 1), **KW)
    (o,), _ = run(eng, [PROMPTS[3]], [_greedy(12)])
    assert len(o.outputs[0].token_ids) == 12 and o.metrics["spec_accept_length"] == g + 1


class NotMod3:
    """A grammar: every token id that is not a multiple of 3 (never done); `accept` checks the rule, so
    a committed token the grammar did not allow fails the test."""

    def __init__(self, vocab):
        self.vocab, self.n = vocab, 0

    def allowed_mask(self):
        return np.arange(self.vocab) % 3 != 0

    def accept(self, t):
        assert t % 3 != 0, f"committed token {t} is not allowed by the grammar"
        self.n += 1

    def is_done(self):
        return False

    def clone(self):
        c = NotMod3(self.vocab)
        c.n = self.n
        return c


def test_constrained_dspark_equals_constrained_plain(plain_eng, spec_eng):
    """Constrained greedy with DSpark ≡ constrained greedy without: the runner drafts first, walks each
    row's grammar through the drafts and masks the verify rows up to the first draft the grammar
    rejects. The oracle proposes the plain run's tokens with, per row and step, a grammar-rejected
    token (a multiple of 3) or a grammar-allowed wrong one at one position: both are rejected, the
    tokens before them accepted."""
    V, g = spec_eng.vocab_size, spec_eng.spec_gamma
    prompts = PROMPTS[:4]
    rids = [f"c{next(_ids)}" for _ in prompts]
    for rid, p in zip(rids, prompts):
        plain_eng.add_request(rid, p, _greedy(12), constraint=NotMod3(V))
    ref_c = {o.request_id: o.outputs[0].token_ids for o in plain_eng.run_until_done()}
    ref_c = [ref_c[r] for r in rids]
    assert all(t % 3 for r in ref_c for t in r)

    launches, by_rid, injected = [], {}, {"rejected_by_grammar": 0}

    def oracle(L):
        launches.append(L)
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = by_rid[r.req_id]
            n = r.step
            want = ref_c[i][n:n + g]
            out[b, :len(want)] = want
            k = (n + i + len(launches)) % (g + 1)
            if k < len(want):
                bad = (want[k] // 3) * 3 if (n + i) % 2 else (want[k] + 3) % V  # grammar-rejected / allowed
                injected["rejected_by_grammar"] += bad % 3 == 0
                out[b, k] = bad if bad != want[k] else (want[k] + 1) % V
        return out

    n_comp = None
    execute, grammars = spec_eng.runner.execute, []

    def only_reads(schedule):  # the runner walks the rows' grammars on clones: the schedule stays as given
        before = pickle.dumps(schedule)
        grammars.extend(r.grammar for L in schedule.launches for r in L.rows if r.grammar is not None)
        result = execute(schedule)
        assert pickle.dumps(schedule) == before
        return result

    spec_eng.runner.execute = only_reads
    try:
        with oracle_drafts(spec_eng, oracle) as drafter:
            rids = [f"c{next(_ids)}" for _ in prompts]
            by_rid.update({r: i for i, r in enumerate(rids)})
            for rid, p in zip(rids, prompts):
                spec_eng.add_request(rid, p, _greedy(12), constraint=NotMod3(V))
            done = {}
            while spec_eng.has_unfinished():
                for o in spec_eng.step():
                    if o.finished:
                        done[o.request_id] = o
                if launches and n_comp is None:
                    n_comp = spec_eng.num_compilations()  # the draft-only program compiled on first use
    finally:
        del spec_eng.runner.execute
    assert [done[r].outputs[0].token_ids for r in rids] == ref_c
    accepts = drafter.accepts()
    assert any(len(set(a)) > 1 for a in accepts) and injected["rejected_by_grammar"] > 0
    assert grammars and all(isinstance(c, NotMod3) for c in grammars)
    assert spec_eng.num_compilations() == n_comp
    assert spec_eng.allocator.free_pages == spec_eng.allocator.capacity


def test_startup_errors(cfg, mini_params):
    """Unsupported DSpark combinations are refused at start-up, naming the reason."""
    no_mtp = dict(mini_params, mtp=[])
    with pytest.raises(EngineError, match="no DSpark parameters"):
        Engine(cfg=cfg, params=no_mtp, speculative_algorithm="DSPARK", **KW)
    with pytest.raises(EngineError, match="block-size 4.*dspark_block_size"):
        Engine(cfg=cfg, params=mini_params, speculative_algorithm="DSPARK", speculative_dspark_block_size=4, **KW)
    with pytest.raises(EngineError, match="enable-mixed-chunk"):
        Engine(cfg=cfg, params=mini_params, speculative_algorithm="DSPARK", enable_mixed_chunk=True, **KW)


# ----------------------------------------------------------------------------------------------------
# Prefill/decode handover: a prefill engine's exported state, decoded by another engine
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill_eng(cfg, mini_params):
    """A second DSpark engine (the same compiled steps): its prefill writes the draft rings too."""
    return Engine(cfg=cfg, params=mini_params, speculative_algorithm="DSPARK", **KW)


def _prefill(eng, prompt, sp):
    """The handover request on a prefill engine -> (its wire form: manifest, buffer; first output)."""
    rid = f"p{next(_ids)}"
    eng.add_request(rid, prompt, sp.replace(max_tokens=1), handover=True)
    outs = [o for o in eng.run_until_done() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].prefilled_state is not None, outs[-1]
    assert eng.allocator.free_pages == eng.allocator.capacity  # its pages are back once exported
    return handover.pack(outs[-1].prefilled_state), outs[-1]


def test_handover_prefill_engine_then_dspark_decode_engine_equals_one_engine(prefill_eng, spec_eng, ref):
    """Prefill/decode disaggregation at the engine seam: a prefill engine prefills each prompt and samples
    the first token, exports the request's state (pages + slot rows, DSpark rings included), packed to
    its wire form; another engine with DSpark imports it and decodes. Greedy: exactly the tokens of one
    engine doing both (`ref`), all five requests at once (one waits for a slot), with DSpark steps on
    the decode engine and not one prompt token prefilled there. With logprobs, and sampled with the
    prefill engine's seed: exactly the decode engine's own aggregated run (tokens and logprob bits)."""
    layout = spec_eng.runner.handover_layout()
    states = []
    for i, p in enumerate(PROMPTS):
        (manifest, buf), first = _prefill(prefill_eng, p, _greedy())
        assert first.outputs[0].token_ids == ref[i][:1]
        states.append(handover.unpack(manifest, buf, layout))
    assert "dspark" in states[0].rows  # the draft rings travel with the slot's rows
    mid = spec_eng.stats()
    rids = [f"h{next(_ids)}" for _ in PROMPTS]
    for rid, p, st in zip(rids, PROMPTS, states):
        spec_eng.add_request(rid, p, _greedy(), prefilled=st)
    done = {o.request_id: o for o in spec_eng.run_until_done() if o.finished}
    assert [done[r].outputs[0].token_ids for r in rids] == ref
    after = spec_eng.stats()
    assert after["computed_prompt_tokens"] == mid["computed_prompt_tokens"]  # the decode engine prefilled nothing
    assert after["imported_prompt_tokens"] - mid["imported_prompt_tokens"] == sum(map(len, PROMPTS))
    assert after["handovers_imported"] - mid["handovers_imported"] == len(PROMPTS)
    assert after["handover_bytes_imported"] - mid["handover_bytes_imported"] == sum(s.nbytes for s in states) > 0
    assert after["spec_verify_steps"] > mid["spec_verify_steps"]  # DSpark ran on the decode side
    a = spec_eng.allocator
    assert a.free_pages == a.capacity and sorted(spec_eng.scheduler.free_slots) == list(range(spec_eng.runner.max_slots))

    # logprobs (rows that ask for them decode plainly) and sampling with the prefill engine's seed
    lp_sp = _greedy(8).replace(logprobs=2)
    hot = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, ignore_eos=True)
    for p, sp in ((PROMPTS[1], lp_sp), (PROMPTS[3], hot)):
        (manifest, buf), _ = _prefill(prefill_eng, p, sp)
        st = handover.unpack(manifest, buf, layout)
        assert sp.seed is None and st.seed is not None
        spec_eng.add_request("hd" + str(next(_ids)), p, sp, prefilled=st)
        moved = [o for o in spec_eng.run_until_done() if o.finished][0].outputs[0]
        alone, _ = run(spec_eng, [p], [sp.replace(seed=st.seed)])
        a0 = alone[0].outputs[0]
        assert (moved.token_ids, moved.logprobs, moved.top_logprobs) == (a0.token_ids, a0.logprobs, a0.top_logprobs)


def test_handover_refusals_leave_the_engines_clean(plain_eng, prefill_eng, spec_eng):
    """A state the decode engine cannot take is refused at `add_request` (`HandoverError`, a 400 on a
    server), before anything is allocated: truncated or corrupted bytes, missing pages, another prompt,
    a prefill engine without DSpark (no draft rings), a request too long for the decode engine's pool;
    the prefill side refuses what it cannot hand over (max_tokens != 1, n > 1). Both engines' pages and
    slots stay at their baseline, and a prefill engine's request ended early (abort) leaves no state."""
    layout = spec_eng.runner.handover_layout()
    p = PROMPTS[1]
    (manifest, buf), _ = _prefill(prefill_eng, p, _greedy())
    with pytest.raises(handover.HandoverError, match="truncated"):
        handover.unpack(manifest, buf[:-5], layout)
    bad = buf.copy()
    bad[len(bad) // 2] ^= 1
    with pytest.raises(handover.HandoverError, match="corrupted"):
        handover.unpack(manifest, bad, layout)
    with pytest.raises(handover.HandoverError, match="layout"):
        handover.unpack(dict(manifest, num_pages=manifest["num_pages"] - 1), buf, layout)
    st = handover.unpack(manifest, buf, layout)
    short = dataclasses.replace(st, pages=st.pages[:-1])
    with pytest.raises(handover.HandoverError, match="pages"):
        spec_eng.add_request("r1", p, _greedy(), prefilled=short)
    with pytest.raises(handover.HandoverError, match="another prompt"):
        spec_eng.add_request("r2", p[:-1] + [p[-1] + 1], _greedy(), prefilled=st)
    with pytest.raises(EngineError, match="exceeds"):  # the decode engine's pool cannot hold it
        spec_eng.add_request("r3", p, _greedy(40), prefilled=st)
    (pm, pbuf), _ = _prefill(plain_eng, p, _greedy())
    with pytest.raises(handover.HandoverError, match="layout"):  # no DSpark rings for the DSpark engine
        handover.unpack(pm, pbuf, layout)
    with pytest.raises(handover.HandoverError, match="structure"):
        spec_eng.add_request("r4", p, _greedy(), prefilled=handover.unpack(pm, pbuf, plain_eng.runner.handover_layout()))
    with pytest.raises(EngineError, match="max_tokens=1"):
        prefill_eng.add_request("r5", p, _greedy(3), handover=True)
    with pytest.raises(EngineError, match="n must be 1"):
        prefill_eng.add_request("r6", p, _greedy(1).replace(n=2, temperature=1.0), handover=True)
    prefill_eng.add_request("r7", p, _greedy(1), handover=True)
    prefill_eng.step()
    prefill_eng.abort_request("r7")
    outs = prefill_eng.run_until_done()
    assert [o.outputs[0].finish_reason for o in outs] == ["abort"] and outs[0].prefilled_state is None
    for e in (prefill_eng, spec_eng, plain_eng):
        a = e.allocator
        assert a.free_pages == a.capacity and sorted(e.scheduler.free_slots) == list(range(e.runner.max_slots))
        assert not e.has_unfinished() and not e.output.groups
