"""The scheduler without a model (issue 13 part 3): `Engine` over a mock runner, as JetStream's mock engine.

`MockRunner` has the runner's interface (allocator, slots, `execute`) and no device: a sampled token
is a fixed function of (request, position), so a request's tokens do not depend on batching, chunking,
preemption or speculation, and the tests can check the scheduler's decisions — admission by slots and
pages, the chunked-prefill budget, preemption order and resumption, the queue limit, DSpark rows that
accept different lengths in one step (stops and max_tokens inside a block, pages given back) — and
that pages and slots return to the free lists after every request. Each test takes well under a second.
"""

import asyncio

import numpy as np
import pytest

from dsv41_jax.serving.async_engine import AsyncEngine
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.request import QueueFullError
from dsv41_jax.serving.runner import Runner
from dsv41_jax.serving.runner_api import RUNNER_MEMBERS, RunnerProtocol
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.messages import ForkOp, Launch, SpecLaunch
from dsv41_jax.serving.tokenizer import load_tokenizer
from mock_runner import MockRunner, token_for

@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def make(tok, *, runner=None, **kw):
    args = dict(model="tiny", page_size=8, max_running_requests=4, chunked_prefill_size=8, max_prefill_tokens=16,
                batch_buckets=[4], token_buckets=[8], decode_log_interval=1000)
    args.update(kw)
    runner = runner or MockRunner()
    return Engine(EngineArgs(**args), runner=runner, tokenizer=tok)


def expected(rid: str, prompt: list, n: int) -> list:
    """The mock model's n tokens after ``prompt`` for sample 0 of request ``rid``."""
    return [token_for(rid, 0, len(prompt) + j) for j in range(n)]


def run_all(eng, reqs, check_each_step=None):
    for rid, prompt, sp in reqs:
        eng.add_request(rid, prompt, sp)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if check_each_step:
            check_each_step(eng)
    return outs


def assert_idle(eng):
    a = eng.allocator
    a.check_invariants()
    assert a.free_pages == a.capacity
    assert sorted(eng.scheduler.free_slots) == list(range(eng.runner.max_slots))
    assert eng.num_running == 0 and eng.num_waiting == 0 and not eng.has_unfinished()


def finished_hold_nothing(eng):
    """After every step: a finished sample holds no page and no slot."""
    for g in list(eng.output.groups.values()):
        for s in g.seqs:
            if s.status == "finished":
                assert not eng.allocator.has(s.key) and s.slot is None
    eng.allocator.check_invariants()


def test_runners_implement_the_protocol(tok):
    """The scheduler's tests drive it through `RunnerProtocol` alone: this module's mock and the prefix
    cache's checking mock implement it, as the device runner's class does; the engine refuses a runner
    that lacks a member (naming it). RUNNER_MEMBERS lists the protocol's members exactly."""
    from test_prefix_cache import CheckingRunner

    declared = set(RunnerProtocol.__annotations__) | {n for n in vars(RunnerProtocol) if n in
                                                      ("execute", "warmup", "num_compilations")}
    assert declared == set(RUNNER_MEMBERS)
    assert isinstance(MockRunner(), RunnerProtocol) and isinstance(CheckingRunner(), RunnerProtocol)
    assert all(callable(getattr(Runner, n)) for n in ("execute", "warmup", "num_compilations"))
    bad = MockRunner()
    del bad.launches
    with pytest.raises(TypeError, match="launches"):
        make(tok, runner=bad)


def test_admission_by_slots_and_chunked_prefill_budget(tok):
    """6 requests, 4 slots: 4 admitted in arrival order, 2 wait; prefill chunks never exceed the chunk
    size, one step's prefill tokens never exceed max_prefill_tokens; every output is the mock model's."""
    eng = make(tok)
    prompts = [list(range(20, 20 + n)) for n in (19, 3, 11, 30, 5, 9)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    outs = {}
    max_running = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        max_running = max(max_running, eng.num_running)
        assert eng.last_step["prefill_tokens"] <= 16
        finished_hold_nothing(eng)
    assert max_running == 4
    for sched, _ in eng.runner.log:
        for op in sched.ops:
            if isinstance(op, Launch):
                assert all(r.n <= 8 for r in op.rows) and op.T in (1, 8) and op.B == 4
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"].outputs[0].token_ids == expected(f"r{i}", p, 6)
    first_admit = [r.req_id for sched, _ in eng.runner.log[:1] for op in sched.launches for r in op.rows]
    assert first_admit[0] == "r0"  # oldest first
    assert_idle(eng)


def test_preemption_newest_first_and_resumes_with_the_same_tokens(tok):
    """A pool too small for everyone: the newest sample is preempted ("decode_pages"), resumes by
    prefilling and replaying, and every request still gets exactly its tokens; pages and slots return."""
    eng = make(tok, runner=MockRunner(num_pages=9, max_pages_per_seq=8))  # 8 pages = 64 tokens for all
    prompts = [list(range(30, 30 + n)) for n in (9, 9, 9)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = run_all(eng, [(f"p{i}", p, sp) for i, p in enumerate(prompts)], finished_hold_nothing)
    assert eng.preemptions["decode_pages"] > 0
    assert outs["p0"].metrics["num_preemptions"] == 0  # the oldest is never preempted
    for i, p in enumerate(prompts):
        assert outs[f"p{i}"].outputs[0].token_ids == expected(f"p{i}", p, 20)
    assert eng.metrics["replayed_tokens"] > 0
    assert_idle(eng)


def test_queue_limit_refuses_and_aborts_free(tok):
    """The async front refuses a request beyond max_queued_requests (QueueFullError) while the loop
    is paused; an aborted request frees its pages and slot."""
    eng = make(tok)
    ae = AsyncEngine(eng, max_queued_requests=2)
    try:
        ae.pause().wait(5)
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

        async def main():
            gens = [ae.generate([5, 6, 7], sp, f"q{i}") for i in range(2)]
            tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
            for _ in range(100):
                await asyncio.sleep(0.01)
                if ae.num_queued() == 2 and not ae._n_pending_adds:
                    break
            with pytest.raises(QueueFullError):
                await ae.generate([5, 6, 7], sp, "q-over").__anext__()
            ae.resume()
            firsts = await asyncio.gather(*tasks)
            for g in gens:
                await g.aclose()
            return firsts

        firsts = asyncio.run(main())
        assert all(f.request_id.startswith("q") for f in firsts)
        for _ in range(200):
            if not eng.has_unfinished():
                break
            ae._wake.set()
            import time

            time.sleep(0.01)
    finally:
        ae.shutdown()
    assert_idle(eng)


@pytest.mark.parametrize("gamma", [3])
def test_dspark_rows_accept_different_lengths(tok, gamma, caplog):
    """DSpark rows of one launch accept different numbers of drafts (0..γ, by position); the engine
    appends each row's n_accept + 1 tokens, so outputs equal the plain run's; max_tokens and a stop token
    inside a block cut there; pages beyond each row's committed tokens go back after every step."""
    accept = lambda row, start: (start * 3 + int(row.req_id[1:])) % (gamma + 1)  # noqa: E731
    runner = MockRunner(spec_gamma=gamma, accept=accept)
    eng = make(tok, runner=runner, speculative_algorithm="DSPARK", decode_log_interval=4)
    prompts = [list(range(40, 40 + n)) for n in (5, 12, 3, 8)]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (17, 9, 22, 13)]
    stop_tok = expected("s3", prompts[3], 13)[6]
    sps[3] = sps[3].replace(stop_token_ids=[stop_tok])

    def check(e):
        finished_hold_nothing(e)
        for s in e.scheduler.running:  # no page beyond the committed tokens + the next row's needs
            if not s.spec_inflight:
                assert len(e.allocator.pages(s.key)) <= -(-(s.num_cached + 1) // 8) + (-(-(gamma + 1) // 8))

    with caplog.at_level("INFO", logger="dsv41_jax.engine"):
        outs = run_all(eng, [(f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))], check)
    assert any("Decode batch." in r.message and "accept len: " in r.message and "accept rate: " in r.message
               for r in caplog.records)
    mixed = [op for sched, res in runner.log for op, r in zip(sched.launches, res.launches)
             if isinstance(op, SpecLaunch) and len(set(np.asarray(r.n_accept)[:len(op.rows)].tolist())) > 1]
    assert mixed, "no DSpark launch had rows accepting different lengths"
    for i, p in enumerate(prompts[:3]):
        o = outs[f"s{i}"].outputs[0]
        assert o.token_ids == expected(f"s{i}", p, sps[i].max_tokens) and o.finish_reason == "length"
    o = outs["s3"].outputs[0]
    assert o.token_ids == expected("s3", prompts[3], 7) and o.finish_reason == "stop" and o.stop_reason == stop_tok
    st = eng.stats()
    assert st["spec_verify_steps"] > 0 and 1.0 <= st["spec_accept_length"] <= gamma + 1
    assert sum(st["spec_accept_hist"]) == st["spec_verify_steps"]
    m = outs["s0"].metrics
    assert m["spec_verify_steps"] > 0 and m["spec_accept_length"] >= 1.0
    assert_idle(eng)

    # /metrics: the engine's cumulative DSpark figures mirrored into counters, gauges and the histogram
    from dsv41_jax.serving.metrics import ServerMetrics

    sm = ServerMetrics(eng.stats)
    for _ in range(2):  # a second scrape adds nothing (counters mirror what is new)
        vals = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in sm.render().decode().splitlines()
                if ln.startswith("dsv41:spec")}
    assert vals["dsv41:spec_verify_steps_total"] == st["spec_verify_steps"]
    assert vals["dsv41:spec_accepted_tokens_total"] == st["spec_accepted_tokens"]
    assert vals["dsv41:spec_draft_tokens_total"] == gamma * st["spec_verify_steps"]
    assert vals["dsv41:spec_accept_length"] == pytest.approx(st["spec_accept_length"])
    assert vals["dsv41:spec_accept_rate"] == pytest.approx(st["spec_accept_rate"])
    assert vals["dsv41:spec_accept_length_per_step_count"] == st["spec_verify_steps"]
    assert vals['dsv41:spec_accept_length_per_step_bucket{le="1.0"}'] == st["spec_accept_hist"][0]
    assert vals["dsv41:spec_accept_length_per_step_sum"] == sum((n + 1) * c for n, c in
                                                               enumerate(st["spec_accept_hist"]))


def test_dspark_falls_back_to_plain_rows(tok):
    """Rows that cannot speculate decode plainly: logprobs requested, a constraint without clone() (the
    runner walks a clone through the drafts), a verify window past the context; nothing is preempted
    for speculation."""

    class AllowAll:
        def allowed_mask(self):
            return None

        def accept(self, t):
            pass

        def is_done(self):
            return False

    runner = MockRunner(spec_gamma=3, accept=lambda s, st: 3)
    eng = make(tok, runner=runner, speculative_algorithm="DSPARK")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("lp", [5, 6, 7], sp.replace(logprobs=1))
    eng.add_request("con", [5, 6, 7], sp, constraint=AllowAll())
    eng.add_request("free", [5, 6, 7], sp)
    outs = {o.request_id: o for o in eng.run_until_done()}
    spec_rids = {r.req_id for sched, _ in runner.log for op in sched.ops if isinstance(op, SpecLaunch) for r in op.rows}
    assert spec_rids == {"free"}
    assert all(len(outs[r].outputs[0].token_ids) == 8 for r in ("lp", "con", "free"))
    assert_idle(eng)

    # the verify window would pass the context (32 tokens): the last steps are plain rows
    runner = MockRunner(num_pages=5, max_pages_per_seq=4, spec_gamma=3, accept=lambda s, st: 0)
    eng = make(tok, runner=runner, speculative_algorithm="DSPARK")
    prompt = list(range(50, 70))
    eng.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert outs["a"].outputs[0].token_ids == expected("a", prompt, 11)
    kinds = [("spec" if isinstance(op, SpecLaunch) else "plain", op.rows[0].start) for sched, _ in runner.log
             for op in sched.ops if not isinstance(op, ForkOp) and op.rows and op.rows[0].n <= 4]
    assert ("spec", 28) in kinds and ("plain", 29) in kinds and not any(k == "spec" and st > 28 for k, st in kinds)
    assert_idle(eng)


def test_speculative_flags_validated():
    """The flags are honoured or refused: an unknown algorithm, a block size out of 1..5, or a DSpark
    knob without --speculative-algorithm are ValueErrors naming the field."""
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineArgs(speculative_algorithm="MEDUSA")  # (EAGLE / NEXTN: V4's MTP, tests/test_v4_engine.py)
    with pytest.raises(ValueError, match="speculative_dspark_block_size"):
        EngineArgs(speculative_algorithm="DSPARK", speculative_dspark_block_size=6)
    with pytest.raises(ValueError, match="speculative_dspark_block_size.*needs"):
        EngineArgs(speculative_dspark_block_size=2)
    with pytest.raises(ValueError, match="speculative_simulate_accept_length.*needs"):
        EngineArgs(speculative_simulate_accept_length=2.0)
    a = EngineArgs(speculative_algorithm="dspark", speculative_dspark_block_size=2)
    assert a.speculative_algorithm == "DSPARK"
    import argparse

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "3"])
    assert EngineArgs.from_cli_args(ns).speculative_dspark_block_size == 3
