"""KV-pool pressure (issue 17): the scheduler queues, preempts and resumes, and never cuts short a
request that fits the pool alone; a request that cannot fit is refused at admission; an engine
fault reaches the client as an error; preemptions are counted per reason.

One engine per module (fp32, one batch bucket 8, token buckets 1 and 16) with a small pool: 384
tokens (24 pages of 16) for 8 slots, so a handful of requests already overflow it. With one batch
bucket every one-token step runs in the same compiled ``[8, 1]`` executable, whose rows are
bitwise independent, and a preempted sample resumes by prefilling its prompt in the same chunks and
*replaying* its generated tokens as one-token rows: its tokens are exactly those it gets alone.
"""

import asyncio
import itertools
import json
import time

import numpy as np
import pytest

import configs
from dsv41_jax.serving.engine import Engine, EngineError, PREEMPTION_REASONS
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

POOL = 384
ENGINE_KW = dict(model="tiny", dtype="float32", page_size=16, max_running_requests=8, max_total_tokens=POOL,
                 chunked_prefill_size=16, batch_buckets=[8], token_buckets=[16], decode_log_interval=25)
_ids = itertools.count()


@pytest.fixture(scope="module")
def eng():
    e = Engine(EngineArgs(**ENGINE_KW), cfg=configs.micro())
    assert e.context_length == POOL and e.allocator.capacity * 16 == POOL
    yield e
    assert e.allocator.free_pages == e.allocator.capacity


def _idle(eng) -> None:
    """Everything released: pages, slots, queues; page tables consistent."""
    eng.allocator.check_invariants()
    assert eng.allocator.free_pages == eng.allocator.capacity
    assert len(eng.scheduler.free_slots) == eng.runner.max_slots and sorted(eng.scheduler.free_slots) == list(range(eng.runner.max_slots))
    assert eng.num_running == 0 and eng.num_waiting == 0 and not eng.has_unfinished()


def _run_alone_like(eng, specs):
    """Reference tokens without pool pressure: the samples in groups whose whole need fits the pool
    at once (checked: no preemption happens), n=1 each. Returns {spec index: tokens}."""
    ref, group, pages = {}, [], 0
    groups = []
    for i, (prompt, sp) in enumerate(specs):
        need = -(-(len(prompt) + sp.max_tokens) // 16) + 1
        if group and (len(group) == 8 or pages + need > eng.allocator.capacity):
            groups.append(group)
            group, pages = [], 0
        group.append(i)
        pages += need
    groups.append(group)
    p0 = eng.metrics["num_preemptions"]
    for g in groups:
        rids = {}
        for i in g:
            rids[f"ref{next(_ids)}"] = i
            eng.add_request(list(rids)[-1], specs[i][0], specs[i][1])
        for o in eng.run_until_done():
            ref[rids[o.request_id]] = o.outputs[0].token_ids
    assert eng.metrics["num_preemptions"] == p0, "the reference runs must be free of pool pressure"
    _idle(eng)
    return ref


# ------------------------------------------------------------------------------------------- metrics


def test_preemption_counter_mirrors_the_engine_counts():
    """/metrics exports the engine's cumulative counts per reason: each scrape adds only what is
    new, so repeated scrapes never double count."""
    from dsv41_jax.serving.metrics import ServerMetrics

    counts = {"decode_pages": 0, "prefill_pages": 0}
    m = ServerMetrics(lambda: {"preemptions_by_reason": dict(counts)})

    def value(reason):
        name = f'dsv41:num_preemptions_total{{reason="{reason}"}}'
        return float(next(ln for ln in m.render().decode().splitlines() if ln.startswith(name)).split()[-1])

    assert value("decode_pages") == 0 and value("prefill_pages") == 0
    counts["decode_pages"] = 3
    assert value("decode_pages") == 3 and value("decode_pages") == 3
    counts.update(decode_pages=5, prefill_pages=2)
    assert (value("decode_pages"), value("prefill_pages")) == (5, 2)


# ------------------------------------------------------------------------------------------- admission


def test_request_that_cannot_fit_is_refused_at_admission(eng):
    with pytest.raises(EngineError, match=r"prompt \(300 tokens\) \+ max_tokens \(100\) = 400 tokens exceeds .*"
                                          r"384 tokens"):
        eng.add_request("too-big", list(range(3, 303)), SamplingParams(max_tokens=100))
    with pytest.raises(EngineError, match="exceeds"):  # n > 1: each sample must fit alone
        eng.add_request("too-big-n", list(range(3, 303)), SamplingParams(max_tokens=100, n=3, temperature=1.0))
    assert eng.num_waiting == 0 and "too-big" not in eng.output.groups


def test_n_samples_each_fitting_alone_all_complete(eng):
    """n=3 samples of 220 tokens each: together they need 660 tokens of a 384-token pool, but each
    fits alone, so all three complete (forked, then preempted and resumed), equal to n=1 runs."""
    prompt = np.random.default_rng(11).integers(3, 319, size=120).tolist()
    sp = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=100, ignore_eos=True)
    p0 = eng.metrics["num_preemptions"]
    eng.add_request("n3-big", prompt, sp)
    out = [o for o in eng.run_until_done() if o.finished][0]
    assert [c.finish_reason for c in out.outputs] == ["length"] * 3
    assert [len(c.token_ids) for c in out.outputs] == [100] * 3
    assert eng.metrics["num_preemptions"] > p0 and out.metrics["num_preemptions"] > 0
    _idle(eng)
    for j in range(3):
        eng.add_request(f"n3-single-{j}", prompt, sp.replace(n=1, seed=7 + j))
        alone = eng.run_until_done()[-1].outputs[0].token_ids
        assert alone == out.outputs[j].token_ids, f"sample {j}"


def test_n_samples_that_fill_the_whole_pool(eng):
    """Each sample needs every page (383 + 1 tokens of 384): the samples cannot share the prompt
    (no page left for a sibling's copy of the partial page), so they run one after the other."""
    prompt = np.random.default_rng(12).integers(3, 319, size=383).tolist()
    eng.add_request("n2-whole-pool", prompt, SamplingParams(n=2, temperature=0, max_tokens=1, ignore_eos=True))
    out = [o for o in eng.run_until_done() if o.finished][0]
    assert [(c.finish_reason, len(c.token_ids)) for c in out.outputs] == [("length", 1)] * 2
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy
    _idle(eng)


# ------------------------------------------------------------------------------------------- the issue's reproduction


REPS = 4  # the issue's 10 repetitions are the slow soak below (test_issue_reproduction_exact_geometry_...)


def test_eight_concurrent_requests_repeated_all_complete(eng, caplog):
    """The issue's reproduction at this pool's scale: 8 concurrent greedy requests, each 55% of the
    pool alone (prompt 60-120 + 40 tokens of 384; the issue: 220-400 + 160 of 1,024), REPS times.
    Every one completes with all its tokens (it used to come back "abort" after a few dozen), and
    equals the same request run without pressure."""
    rng = np.random.default_rng(170)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    p0 = dict(eng.preemptions)
    reps = []
    with caplog.at_level("INFO", logger="dsv41_jax.engine"):
        for rep in range(REPS):
            prompts = [rng.integers(3, 319, size=int(rng.integers(60, 121))).tolist() for _ in range(8)]
            rids = [f"rep{rep}-{i}" for i in range(8)]
            for r, p in zip(rids, prompts):
                eng.add_request(r, p, sp)
            outs = {o.request_id: o for o in eng.run_until_done()}
            _idle(eng)
            for r in rids:
                c = outs[r].outputs[0]
                assert (c.finish_reason, len(c.token_ids)) == ("length", 40), (r, c.finish_reason, len(c.token_ids))
            reps.append((prompts, [outs[r].outputs[0].token_ids for r in rids]))
    assert eng.preemptions["decode_pages"] > p0["decode_pages"]  # the pool was really under pressure
    assert not any(r.levelname == "ERROR" for r in caplog.records)
    assert any("#preempted:" in r.message and "decode_pages" in r.message for r in caplog.records)
    prompts, got = reps[0]
    ref = _run_alone_like(eng, [(p, sp) for p in prompts])
    assert [ref[i] for i in range(8)] == got


# ------------------------------------------------------------------------------------------- stress


def _random_request(rng):
    kind = rng.random()
    if kind < 0.7:
        plen, mt = int(rng.integers(1, 40)), int(rng.integers(1, 17))
    elif kind < 0.9:
        plen, mt = int(rng.integers(40, 120)), int(rng.integers(8, 25))
    else:  # about half the pool alone
        plen, mt = int(rng.integers(150, 200)), int(rng.integers(10, 25))
    greedy = rng.random() < 0.5
    sp = SamplingParams(n=int(rng.choice([1, 1, 1, 2, 3])), temperature=0.0 if greedy else float(rng.uniform(0.5, 1.2)),
                        top_k=-1 if greedy else int(rng.choice([-1, 20])), seed=int(rng.integers(0, 2**31)),
                        presence_penalty=float(rng.choice([0.0, 0.0, 0.7])), max_tokens=mt, ignore_eos=True)
    prompt = rng.integers(3, 319, size=plen).tolist()
    stream = rng.random() < 0.3
    abort_after = int(rng.integers(1, 12)) if rng.random() < 0.1 else None
    return prompt, sp, stream, abort_after


def _burst(eng, rng, n_req, burst):
    """n_req requests arriving over ~24 steps (a few per step), some streaming, some aborted by the
    client a few steps after arrival; run until idle. Returns the per-request records."""
    reqs = []
    for i in range(n_req):
        prompt, sp, stream, abort_after = _random_request(rng)
        arrive = int(rng.integers(0, 24))
        reqs.append(dict(rid=f"b{burst}-{i}", prompt=prompt, sp=sp, stream=stream, arrive=arrive,
                         abort_at=None if abort_after is None else arrive + abort_after, aborted=False,
                         deltas={j: [] for j in range(sp.n)}, reasons={}, final=None))
    by_rid = {r["rid"]: r for r in reqs}
    step = 0
    while step < 24 or eng.has_unfinished():
        for r in reqs:
            if r["arrive"] == step:
                eng.add_request(r["rid"], r["prompt"], r["sp"], output_kind="delta" if r["stream"] else "final")
            if r["abort_at"] == step:
                r["aborted"] = eng.abort_request(r["rid"])
        for o in eng.step():
            r = by_rid[o.request_id]
            assert r["final"] is None, "no output after the last"
            for c in o.outputs:
                if r["stream"]:
                    r["deltas"][c.index] += c.token_ids
                if c.finish_reason is not None:
                    assert c.index not in r["reasons"], "a sample ends once"
                    r["reasons"][c.index] = c.finish_reason
            if o.finished:
                r["final"] = o
        step += 1
    _idle(eng)
    return reqs


# requests per burst: 25 in the default run, 50 (the original soak, ~1 min more) under -m slow
@pytest.mark.parametrize("burst_size", [25, pytest.param(50, marks=pytest.mark.slow)])
def test_stress_bursts_fp32_equal_alone(eng, caplog, burst_size):
    """4 x burst_size requests in 4 bursts (mixed prompt lengths, max_tokens, n, greedy and seeded sampling
    with penalties, streaming, client aborts; the third burst without the overlap schedule, the
    fourth with mixed chunks) through the 384-token pool: every request the client did not abort
    completes with all its max_tokens (ignore_eos), none ends "abort" or "error" otherwise, the
    pool and the slots return to their starting counts after each burst, and every sample's tokens
    equal those it gets without pool pressure (n > 1: sample j as n=1 with seed + j) — except in
    the mixed-chunk burst, whose one-token rows run in the [8, 16] executable (other rounding)."""
    rng = np.random.default_rng(1717)
    p0, r0 = dict(eng.preemptions), eng.metrics["replayed_tokens"]
    done = []
    with caplog.at_level("INFO", logger="dsv41_jax.engine"):
        for burst in range(4):
            eng.overlap = burst != 2
            eng.args.enable_mixed_chunk = burst == 3
            try:
                done += [(burst, r) for r in _burst(eng, rng, burst_size, burst)]
            finally:
                eng.overlap = True
                eng.args.enable_mixed_chunk = False
    assert not any(r.levelname == "ERROR" for r in caplog.records)
    n_aborted = resumed = 0
    specs, where = [], []
    for burst, r in done:
        o = r["final"]
        assert o is not None and o.finished and o.error is None, r["rid"]
        assert [c.index for c in o.outputs] == list(range(r["sp"].n)) or r["stream"]
        if r["aborted"]:
            n_aborted += 1
            assert set(r["reasons"].values()) <= {"abort", "length"}
            assert "abort" in r["reasons"].values(), r["rid"]
            continue
        assert r["reasons"] == {j: "length" for j in range(r["sp"].n)}, r["rid"]
        if burst == 3:
            continue
        resumed += o.metrics["num_preemptions"] > 0
        for j in range(r["sp"].n):
            # a stream's answer is its deltas added up; its last output has each sample's end
            got = r["deltas"][j] if r["stream"] else o.outputs[j].token_ids
            assert len(got) == r["sp"].max_tokens, (r["rid"], j)
            specs.append((r["prompt"], r["sp"].replace(n=1, seed=r["sp"].seed + j)))
            where.append((r["rid"], j, got))
    # the bursts really stressed the pool (25 per burst, seed 1717: 7 aborted, 115 samples compared,
    # 5 resumed, 11 decode-page preemptions): bounds that fail if aborts or preemptions stop happening
    n_req = 4 * burst_size
    assert 0.02 * n_req <= n_aborted <= 0.2 * n_req and len(specs) > 0.45 * n_req
    grew = {k: eng.preemptions[k] - p0[k] for k in PREEMPTION_REASONS}
    assert grew["decode_pages"] > 5 and sum(grew.values()) == eng.metrics["num_preemptions"] - sum(p0.values())
    # the comparison covers resumed samples, some replaying generated tokens
    assert resumed >= 3 and eng.metrics["replayed_tokens"] > r0
    ref = _run_alone_like(eng, specs)
    bad = [(rid, j) for i, (rid, j, got) in enumerate(where) if ref[i] != got]
    assert not bad, f"{len(bad)} samples differ from their pressure-free run, first {bad[:5]}"


def test_llm_raises_when_the_engine_fails_a_request(eng, monkeypatch):
    """Offline `LLM.generate` does not hand back a request the engine ended early."""
    from dsv41_jax.llm import LLM
    from dsv41_jax.serving.engine import EngineInternalError

    mark = [318, 317, 316]
    orig = eng.output.append_token

    def faulty(s, tok, lp, top, now):
        orig(s, tok, lp, top, now)
        if s.prompt_ids[:3] == mark and len(s.output_ids) == 2 and s.status == "running":
            eng._fail(s, "internal error: injected engine fault")

    monkeypatch.setattr(eng.output, "append_token", faulty)
    llm = LLM(engine=eng)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(EngineInternalError, match="1 request\\(s\\) failed: internal error: injected engine fault"):
        llm.generate([[5, 6, 7], mark + [9]], sp, use_tqdm=False)
    _idle(eng)
    assert [len(o.outputs[0].token_ids) for o in llm.generate([[5, 6, 7]], sp, use_tqdm=False)] == [6]


# ------------------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def app_client(eng):
    import httpx  # a test dependency; fastapi and prometheus_client are hard dependencies

    from dsv41_jax.serving.async_engine import AsyncEngine
    from dsv41_jax.serving.engine import EngineError as EE, QueueFullError
    from dsv41_jax.serving.server import ServerConfig, build_app

    ae = AsyncEngine(eng)
    cfg = ServerConfig(model_name="tiny", context_length=eng.context_length, vocab_size=eng.vocab_size,
                       enable_metrics=True, reasoning_parser=None, tool_call_parser=None)
    app = build_app(ae, eng.tokenizer, cfg, queue_full_errors=(QueueFullError,), bad_request_errors=(EE,))
    yield ae, lambda: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600)
    ae.shutdown()


def test_http_concurrent_requests_complete_and_metrics_count_preemptions(eng, app_client):
    """The issue's setting over HTTP (in process): 8 concurrent completions through the small pool
    all come back 200 with every token; an over-context request is a 400; /metrics has the
    preemption counter per reason, equal to the engine's counts."""
    ae, client = app_client
    rng = np.random.default_rng(99)
    prompts = [rng.integers(3, 319, size=int(rng.integers(60, 121))).tolist() for _ in range(8)]

    async def main():
        async with client() as c:
            body = dict(model="tiny", max_tokens=40, temperature=0, ignore_eos=True)
            rs = await asyncio.gather(*[c.post("/v1/completions", json={**body, "prompt": p}) for p in prompts])
            too_big = await c.post("/v1/completions", json={**body, "prompt": [3 + i % 300 for i in range(350)]})
            metrics = await c.get("/metrics")
        return rs, too_big, metrics

    rs, too_big, metrics = asyncio.run(main())
    for r in rs:
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 40
    # (whether these preempt depends on how the requests meet the engine thread's steps: the
    # engine-level tests count preemptions deterministically; here /metrics must equal the engine)
    assert too_big.status_code == 400
    err = too_big.json()["error"]
    assert err["type"] == "invalid_request_error" and "context length" in err["message"]
    text = metrics.text
    for reason in PREEMPTION_REASONS:
        name = f'dsv41:num_preemptions_total{{reason="{reason}"}}'
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        assert float(line.split()[-1]) == eng.preemptions[reason]


def test_http_engine_fault_is_an_error_not_a_short_answer(eng, app_client, monkeypatch):
    """The engine ends a request itself (injected here after its 3rd token through the engine's own
    `_fail` path): a non-streaming client gets HTTP 500 with an OpenAI error body, a streaming one
    an error event and no finish_reason, never HTTP 200 with a partial answer."""
    ae, client = app_client
    mark = [317, 316, 315, 314]
    orig = eng.output.append_token

    def faulty(s, tok, lp, top, now):
        orig(s, tok, lp, top, now)
        if s.prompt_ids[:4] == mark and len(s.output_ids) == 3 and s.status == "running":
            eng._fail(s, "internal error: injected engine fault")

    monkeypatch.setattr(eng.output, "append_token", faulty)
    body = dict(model="tiny", max_tokens=20, temperature=0, ignore_eos=True, prompt=mark + [5, 6, 7])

    async def main():
        async with client() as c:
            plain = await c.post("/v1/completions", json=body)
            stream = await c.post("/v1/completions", json={**body, "stream": True})
            ok = await c.post("/v1/completions", json={**body, "prompt": [5, 6, 7]})
        return plain, stream, ok

    plain, stream, ok = asyncio.run(main())
    assert plain.status_code == 500
    e = plain.json()["error"]
    assert e["type"] == "server_error" and "injected engine fault" in e["message"]
    events = [json.loads(ln[6:]) for ln in stream.text.splitlines() if ln.startswith("data: {")]
    assert "injected engine fault" in events[-1]["error"]["message"]
    assert not any(ch.get("finish_reason") for ev in events[:-1] for ch in ev.get("choices", []))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert eng.metrics["requests_failed"] >= 2
    deadline = time.monotonic() + 120  # a hang guard on a terminal state (the loop thread drains)
    while eng.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.allocator.free_pages == eng.allocator.capacity



@pytest.mark.slow
def test_issue_reproduction_exact_geometry_ten_repetitions():
    """The issue's exact reproduction (a soak, ~5 min on the 2-core VM, so `slow`): pool 1,024 tokens,
    page 16, 8 slots, 8 concurrent greedy requests of 220-400 prompt tokens + 160 with ignore_eos, 10
    repetitions. Every request completes with all 160 tokens (it used to come back "abort" after 31-82),
    the pool is whole again after each repetition, and repetition 0 equals each request run alone."""
    e = Engine(EngineArgs(model="tiny", dtype="float32", max_total_tokens=1024, page_size=16,
                          max_running_requests=8, chunked_prefill_size=64, batch_buckets=[8], token_buckets=[64]))
    sp = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    first = None
    for rep in range(10):
        rng = np.random.default_rng(rep)
        prompts = [rng.integers(3, 319, size=int(rng.integers(220, 401))).tolist() for _ in range(8)]
        for i, p in enumerate(prompts):
            e.add_request(f"r{rep}-{i}", p, sp)
        outs = {o.request_id: o for o in e.run_until_done()}
        res = [outs[f"r{rep}-{i}"].outputs[0] for i in range(8)]
        assert all((c.finish_reason, len(c.token_ids)) == ("length", 160) for c in res), rep
        _idle(e)
        if first is None:
            first = (prompts, [c.token_ids for c in res])
    assert e.preemptions["decode_pages"] > 0  # the pool really was under pressure
    prompts, got = first
    for i, p in enumerate(prompts):
        e.add_request(f"alone{i}", p, sp)
        assert e.run_until_done()[-1].outputs[0].token_ids == got[i], i
