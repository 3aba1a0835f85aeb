"""Data-parallel attention, the serving side (issue 46): per-rank schedulers behind the DP controller,
rank-major launches, routing, per-rank metrics and the start-up refusals.

With ``--dp-size 4`` (on the suite's 8 fake devices: a [dp=4, tp=1] mesh; on a one-device machine the
4-rank schedule runs there as an ordinary schedule, the DP contract),
a batch of mixed concurrent requests — greedy and seeded sampling with logprobs, a shared system
prompt, a multi-turn conversation, n = 2, a constrained request, preemption — gives each request
exactly the tokens and logprobs it gets with dp = 1, in ``--dtype exact`` and in the deterministic
mode. Engines are on `configs.micro` with one batch bucket (8 rows: a dp = 4 launch is 4 ranks x 2) and
token buckets 1 and 16; each mode builds its dp = 1 and dp = 4 engine once per module.
"""

import itertools
import subprocess

import numpy as np
import pytest
from fastapi.testclient import TestClient

import configs
from dsv41_jax.model import cache as kvc
from dsv41_jax.serving.async_engine import AsyncEngine
from dsv41_jax.serving.dp_controller import merge
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.messages import Launch
from dsv41_jax.serving.metrics import ServerMetrics
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.server import ServerConfig, build_app
from servers import free_port, serve_cmd, user_env

# (context 128 and a 1024-token pool: the cache shapes of tests/test_prompt_logprobs.py's engine, so the exact-mode
# dp = 1 engine's three steps (decode, prefill, prompt logprobs) are that file's, shared through the run's cache)
KW = dict(model="tiny", page_size=16, context_length=128, max_running_requests=8, max_total_tokens=1024,
          chunked_prefill_size=16, batch_buckets=[8], token_buckets=[16], decode_log_interval=1000,
          enable_hierarchical_cache=True)
DP = dict(enable_dp_attention=True, dp_size=4)
MODES = {"exact": dict(dtype="exact"), "deterministic": dict(enable_deterministic_inference=True)}
_ids = itertools.count()


def _engine(mode: str, dp: bool) -> Engine:
    return Engine(EngineArgs(**KW, **MODES[mode], **(DP if dp else {})), cfg=configs.micro())


@pytest.fixture(scope="module")
def exact4():
    return _engine("exact", True)


class AllowSet:
    """A constraint: only ``allowed`` ids (clonable, never done)."""

    def __init__(self, allowed, vocab=320):
        self.allowed, self.vocab = list(allowed), vocab

    def allowed_mask(self):
        m = np.zeros(self.vocab, bool)
        m[self.allowed] = True
        return m

    def accept(self, t):
        assert t in self.allowed

    def is_done(self):
        return False

    def clone(self):
        return AllowSet(self.allowed, self.vocab)


def _workload(plp: bool = False):
    """(prompts, params, constraint index): a shared 24-token system prompt (3 requests), ragged others,
    greedy / seeded sampling with logprobs, n = 2, one constrained; ``plp``: one asks for prompt logprobs."""
    rng = np.random.default_rng(46)
    system = rng.integers(3, 300, 24).tolist()
    prompts = [system + rng.integers(3, 300, int(n)).tolist() for n in (5, 9, 3)]
    prompts += [rng.integers(3, 300, int(n)).tolist() for n in (30, 7, 18, 2, 12)]
    sps = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2) if i % 2 else
           SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True, logprobs=2)
           for i in range(len(prompts))]
    sps[4] = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, ignore_eos=True, logprobs=2)
    if plp:
        sps[5] = sps[5].replace(prompt_logprobs=2)
    return prompts, sps, 6


def _run(eng, prompts, sps, constrained=None):
    rids = [f"dp{next(_ids)}" for _ in prompts]
    free0 = eng.allocator.free_pages
    for i, (rid, p, sp) in enumerate(zip(rids, prompts, sps)):
        eng.add_request(rid, p, sp, constraint=AllowSet(range(40, 90)) if i == constrained else None)
    outs = {o.request_id: o for o in eng.run_until_done()}
    eng.allocator.check_invariants()
    assert eng.allocator.free_pages == free0
    return [outs[r] for r in rids]


def _result(out):
    return [(c.token_ids, c.logprobs, c.top_logprobs) for c in out.outputs], out.prompt_logprobs


def _session(eng, hog_pages: int = 0, plp: bool = False):
    """The workload, then a second turn of the first conversation (its prompt + answer + a question),
    with every rank's pool cut to ``hog_pages`` free pages while the workload runs (0: not cut)."""
    prompts, sps, con = _workload(plp)
    hogs = []
    if hog_pages:
        for r, a in enumerate(eng.runner.allocators):
            left = a.free_pages - hog_pages
            while left > 0:
                k = min(left, eng.runner.ccfg.max_pages_per_seq)
                hogs.append((a, ("hog", r, len(hogs))))
                a.ensure(hogs[-1][1], k * a.page_size)
                left -= k
    before = eng.metrics["num_preemptions"]
    try:
        outs = _run(eng, prompts, sps, con)
    finally:
        for a, h in hogs:
            a.free(h)
    preempted = eng.metrics["num_preemptions"] - before
    turn2 = prompts[0] + list(outs[0].outputs[0].token_ids) + [77, 78, 79]
    outs += _run(eng, [turn2], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)])
    return [_result(o) for o in outs], preempted


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dp4_equals_dp1(mode, exact4):
    """Each request's tokens and logprobs with dp = 4 (one device; pools cut so samples preempt and the
    radix caches spill to their host tiers) equal dp = 1's, in the exact and the deterministic mode (in
    the exact one, prompt logprobs too: one more compiled variant)."""
    plp = mode == "exact"
    ref, _ = _session(_engine(mode, False), plp=plp)
    eng = exact4 if mode == "exact" else _engine(mode, True)
    before = list(eng.scheduler.assigned)
    got, preempted = _session(eng, hog_pages=5, plp=plp)
    assert preempted > 0 and eng.stats()["prefix_cache_spills"] > 0
    assert got == ref
    assert all(n > b for n, b in zip(eng.scheduler.assigned, before))  # every rank served some


def _add(eng, prompt, sp) -> tuple:
    """Queue a request; returns (its id, the rank the DP controller gave it)."""
    rid = f"dp{next(_ids)}"
    eng.add_request(rid, prompt, sp)
    return rid, eng.output.groups[rid].dp_rank


def test_cache_aware_routes_a_shared_prompt_to_one_rank(exact4):
    """cache_aware: requests sharing a system prompt go to the rank holding it and hit its radix cache
    from the second on — three at once on a rank of two slots too (the third waits there for a slot, as
    SGLang's router keeps a cache match while the loads are balanced); a burst sharing a prompt nobody
    cached yet lands on one rank too."""
    eng = exact4
    rng = np.random.default_rng(7)
    system = rng.integers(3, 300, 40).tolist()
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    _, r0 = _add(eng, system + [5, 6, 7], sp)
    eng.run_until_done()
    assert len(eng.scheduler.views[r0].slots) == 2  # more sharers than the rank has slots
    added = [_add(eng, system + tail, sp) for tail in ([8, 9], [10, 11, 12], [13])]
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert [r for _, r in added] == [r0, r0, r0]
    assert all(outs[rid].num_cached_tokens > 0 for rid, _ in added)
    # a burst: the routing tree knows a routed prompt before its rank has cached anything
    other = rng.integers(3, 300, 40).tolist()
    (_, ra), (_, rb) = _add(eng, other + [1, 2], sp), _add(eng, other + [3, 4], sp)
    assert ra == rb
    eng.run_until_done()


def test_round_robin_and_shortest_queue(exact4):
    eng, ctl = exact4, exact4.scheduler
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    try:
        ctl.method = "round_robin"
        ranks = [_add(eng, [11, 12, 13], sp)[1] for _ in range(6)]
        assert all((b - a) % 4 == 1 for a, b in zip(ranks, ranks[1:])), ranks
        eng.run_until_done()
        ctl.method = "shortest_queue"
        # least loaded first, the lowest rank on a tie
        assert [_add(eng, [11, 12, 13], sp)[1] for _ in range(6)] == [0, 1, 2, 3, 0, 1]
        eng.run_until_done()
    finally:
        ctl.method = "cache_aware"


def test_launches_are_rank_major_and_metrics_carry_dp_rank(exact4):
    eng = exact4
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    seen = []
    execute = eng.runner.execute

    def spy(schedule):
        seen.extend(op for op in schedule.ops if isinstance(op, Launch))
        return execute(schedule)

    eng.runner.execute = spy
    try:
        eng.scheduler.method = "round_robin"
        for i in range(3):
            eng.add_request(f"dp{next(_ids)}", [20 + i] * (5 + i), sp)
        eng.step()
        m = ServerMetrics(eng.stats)
        m.refresh()
        text = "\n".join(f"{s.name}{s.labels} {s.value}" for f in m.registry.collect() for s in f.samples)
        for r in range(4):
            assert f"dsv41:num_running_reqs{{'dp_rank': '{r}'}}" in text, text
            assert f"dsv41:token_usage{{'dp_rank': '{r}'}}" in text, text
        ranks = eng.stats()["dp_ranks"]
        assert sum(x["num_running_reqs"] + x["num_queue_reqs"] for x in ranks) == 3
        eng.run_until_done()
    finally:
        eng.runner.execute = execute
        eng.scheduler.method = "cache_aware"
    ccfg = eng.runner.ccfg
    for L in seen:
        per = L.B // 4
        assert L.B == 8 and len(L.rows) == 8
        for b, row in enumerate(L.rows):
            r = b // per
            assert row.slot in kvc.rank_slots(ccfg, r) or row.slot == kvc.scratch_slot(ccfg, r)
            assert all(p in kvc.rank_pages(ccfg, r) for p in row.pages)
            if row.n == 0:  # a padding row: its rank's scratch slot and null page
                assert row.slot == kvc.scratch_slot(ccfg, r) and row.pages == (kvc.rank_pages(ccfg, r)[0],)


def test_merge_pads_each_rank_and_keeps_op_order():
    """`merge`: per kind one launch of D x the largest rank bucket, each rank's rows then its padding; a
    rank's ops stay between its own launches."""
    from dsv41_jax.serving.messages import ForkOp, RestoreOp, Row, Schedule
    from dsv41_jax.serving.scheduler import Planned

    ccfg = kvc.CacheConfig(page_size=16, num_pages=8, max_slots=4, max_pages_per_seq=2, dp=2)

    def row(slot, page, n, sample=False):
        return Row("x", 0, slot, 0, n, (1,) * n, False, sample, 0, (page,), n)

    pre0, dec0 = Launch((row(0, 1, 5),), 1, 16), Launch((row(1, 2, 1, True),), 1, 1)
    restore1, fork0 = RestoreOp(4, 3, 0, 0), ForkOp(0, 1, 0, 0)
    dec1 = Launch((row(3, 5, 1, True), row(4, 6, 1, True)), 2, 1)
    p0 = Planned(Schedule((pre0, fork0, dec0), resets=(0,)), (("a",), ("b",)))
    p1 = Planned(Schedule((restore1, dec1), rank=1), (("c", "d"),))
    out = merge([p0, p1], ccfg, mixed=False)
    ops = out.schedule.ops
    assert [type(o).__name__ for o in ops] == ["Launch", "ForkOp", "RestoreOp", "Launch"]
    pre, dec = ops[0], ops[3]
    assert (pre.B, pre.T, dec.B, dec.T) == (2, 16, 4, 1)
    assert [r.slot for r in pre.rows] == [0, kvc.scratch_slot(ccfg, 1)]
    assert [r.slot for r in dec.rows] == [1, kvc.scratch_slot(ccfg, 0), 3, 4]
    assert out.seqs == (("a", None), ("b", None, "c", "d"))
    assert out.schedule.resets == (0,)


def test_refusals():
    with pytest.raises(ValueError, match="need --enable-dp-attention"):
        EngineArgs(**dict(KW, dp_size=4))
    with pytest.raises(ValueError, match="not divisible by dp_size=3"):
        EngineArgs(**dict(KW, enable_dp_attention=True, dp_size=3))
    with pytest.raises(ValueError, match="no effect without --dp-size"):
        EngineArgs(**dict(KW, load_balance_method="round_robin"))
    with pytest.raises(ValueError, match="must be one of"):
        EngineArgs(**dict(KW, **DP, load_balance_method="random"))
    with pytest.raises(ValueError, match="not implemented with --dp-size"):
        EngineArgs(**dict(KW, **DP, enable_decoder_swa_bounded_replay=True, disable_radix_cache=True,
                          enable_hierarchical_cache=False))
    with pytest.raises(ValueError, match="needs 8 devices, only 4"):
        EngineArgs(**dict(KW, **DP, tp_size=2)).check_devices(4)
    assert EngineArgs(**KW, **DP).resolved_load_balance_method == "cache_aware"


def test_cli_refuses_more_devices_than_exist():
    """--dp-size 4 on one CPU device: one line, exit 2, before anything loads (the alias spelling too)."""
    env = user_env()
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(serve_cmd() + ["--model", "tiny", "--port", str(free_port()), "--enable-dp-attention",
                                      "--data-parallel-size", "4"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dp_size: --dp-size 4 x --tp-size 1 needs 4 devices, only 1"), last
    assert "xla_force_host_platform_device_count=4" in last


def test_server_completion_with_dp(exact4):
    """A request through the OpenAI server on the dp = 4 engine (last: the async engine takes it over)."""
    ae = AsyncEngine(exact4)
    try:
        cfg = ServerConfig(model_name="tiny", context_length=exact4.context_length, vocab_size=exact4.vocab_size)
        client = TestClient(build_app(ae, exact4.tokenizer, cfg))
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                                                 "temperature": 0, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4
        assert len(body["choices"][0]["logprobs"]["tokens"]) == 4
    finally:
        ae.shutdown()
