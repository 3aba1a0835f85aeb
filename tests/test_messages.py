"""The engine's seams as messages (issue 46 item 1, `serving/messages.py`).

The scheduler's plan reaches the runner as a frozen `Schedule` and comes back as a frozen `StepResult`:
changing either raises, neither holds a request object (`Seq` / `Group`), and a runner that only ever
sees a *copy* of each schedule (pickled and unpickled, so no reference back into the engine) drives
the engine to exactly the mock model's outputs — through chunked prefill, preemption with replay,
n > 1 forks, prompt logprobs, constraints and DSpark rows. The scheduler calls nothing back: when it
needs the tokens in flight it returns None and the engine reads them first. Model-free, under a second.
(The device runner's side — it leaves a schedule as it was given, the speculator's state going in and
out as a `DeviceState` — is checked on compiled engines in test_engine.py and test_engine_dspark.py.)
"""

import dataclasses
import inspect
import pickle

import numpy as np
import pytest

from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.messages import (ForkOp, Launch, LaunchResult, Row, Schedule, SpecLaunch, StepResult)
from dsv41_jax.serving.request import Group, Seq
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.scheduler import Scheduler
from dsv41_jax.serving.tokenizer import load_tokenizer
from mock_runner import MockRunner, token_for


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


class CopyingRunner(MockRunner):
    """Executes a pickled copy of each schedule: it can use nothing but what the message carries."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.given: list = []

    def execute(self, schedule):
        assert isinstance(schedule, Schedule)
        self.given.append(schedule)
        return super().execute(pickle.loads(pickle.dumps(schedule)))


def _engine(tok, runner, **kw):
    args = dict(model="tiny", page_size=8, max_running_requests=4, chunked_prefill_size=8, max_prefill_tokens=16,
                batch_buckets=[4], token_buckets=[8], decode_log_interval=1000)
    args.update(kw)
    return Engine(EngineArgs(**args), runner=runner, tokenizer=tok)


def _walk(x, path="schedule"):
    """Every value reachable from a message, with its path."""
    yield path, x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _walk(getattr(x, f.name), f"{path}.{f.name}")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _walk(v, f"{path}[{i}]")
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _walk(v, f"{path}[{k!r}]")


class Digits:
    """A grammar with clone(): only odd token ids (lets constrained rows speculate)."""

    def __init__(self):
        self.n = 0

    def allowed_mask(self):
        return np.arange(320) % 2 == 1

    def accept(self, t):
        assert t % 2 == 1
        self.n += 1

    def is_done(self):
        return False

    def clone(self):
        c = Digits()
        c.n = self.n
        return c


def _odd_tokens(row, pos):
    return token_for(row.req_id, row.index, pos) | 1


def test_a_runner_given_copies_of_the_messages_drives_the_engine(tok):
    """Chunked prefill, preemption (a 9-page pool for three 20-token outputs), n > 1 (a fork), prompt
    logprobs: a runner that only sees pickled copies of the schedules gives the mock model's tokens; no
    message holds a Seq or a Group, and every row is plain data."""
    runner = CopyingRunner(num_pages=9, max_pages_per_seq=8)
    eng = _engine(tok, runner)
    prompts = [list(range(30, 39)), list(range(40, 49)), list(range(50, 59))]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, sp)
    eng.add_request("n2", list(range(60, 70)), SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True))
    eng.add_request("plp", list(range(70, 80)), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert eng.preemptions["decode_pages"] > 0 and eng.metrics["replayed_tokens"] > 0
    assert eng.metrics["num_forks"] > 0
    for i, p in enumerate(prompts):
        assert outs[f"p{i}"].outputs[0].token_ids == [token_for(f"p{i}", 0, len(p) + j) for j in range(20)]
    assert [o.token_ids for o in outs["n2"].outputs] == [[token_for("n2", k, 10 + j) for j in range(3)]
                                                        for k in range(2)]
    assert outs["plp"].prompt_logprobs[1][0] == pytest.approx(-0.01)
    kinds = {type(op) for s in runner.given for op in s.ops}
    assert {Launch, ForkOp} <= kinds
    for s in runner.given:
        for path, v in _walk(s):
            assert not isinstance(v, (Seq, Group)), path
        for L in s.launches:
            for r in L.rows:
                assert isinstance(r, Row) and all(isinstance(t, int) for t in r.tokens + r.pages)


def test_messages_are_frozen(tok):
    """Schedules, ops, rows, sampling rows and results refuse changes; their numpy arrays are read-only."""
    runner = MockRunner()
    eng = _engine(tok, runner)
    eng.add_request("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2),
                    constraint=Digits())
    runner.tokens = _odd_tokens
    eng.run_until_done()
    sched, res = next((s, r) for s, r in runner.log if s.sampling)
    L, lr = sched.launches[0], res.launches[0]
    for obj, field, value in [(sched, "ops", ()), (sched, "resets", ()), (L, "B", 1), (L.rows[0], "start", 0),
                              (L.rows[0], "pages", ()), (sched.sampling[0], "slot", 3), (res, "launches", ()),
                              (lr, "tokens", None)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, value)
    with pytest.raises(ValueError, match="read-only"):
        lr.tokens[0] = 1
    with pytest.raises(ValueError, match="read-only"):
        lr.lp[0] = 0.5
    masked = [r for s, _ in runner.log for L in s.launches for r in L.rows if r.allowed is not None]
    assert masked and not masked[0].allowed[0]  # the grammar's mask travels, read-only
    with pytest.raises(ValueError, match="read-only"):
        masked[0].allowed[0] = True
    # a mask handed in is copied into the row before it is frozen: the grammar's own array stays writable
    a = np.ones(4, bool)
    row = Row("r", 0, 0, 0, 1, (), False, True, 0, (1,), 2, allowed=a.copy())
    assert not row.allowed.flags.writeable and a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        LaunchResult(tokens=np.zeros(2, np.int32)).tokens[1] = 3


def test_dspark_rows_and_grammar_clones_cross_as_messages(tok):
    """DSpark launches cross the seam as `SpecLaunch` rows (anchor, start, pages), their results as
    (tokens, n_accept); a constrained row carries a snapshot (clone) of its grammar, never the sample's
    own; outputs equal the plain mock's."""
    walked = []

    class Walking(MockRunner):
        def execute(self, schedule):
            for L in schedule.launches:
                for r in L.rows:
                    if r.grammar is not None:
                        walked.append(r.grammar)
                        r.grammar.clone().accept(1)  # the runner's walk: on a clone of the snapshot
            return super().execute(schedule)

    runner = Walking(spec_gamma=3, accept=lambda row, start: start % 4, tokens=_odd_tokens)
    eng = _engine(tok, runner, speculative_algorithm="DSPARK")
    con = Digits()
    eng.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    eng.add_request("con", [5, 6, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), constraint=con)
    outs = {o.request_id: o for o in eng.run_until_done()}
    specs = [(L, r) for s, res in runner.log for L, r in zip(s.launches, res.launches) if isinstance(L, SpecLaunch)]
    assert specs and all(r.n_accept is not None and np.asarray(r.tokens).shape == (L.B, L.gamma + 1)
                         for L, r in specs)
    assert walked and all(g is not con for g in walked)
    assert con.n == 12  # the sample's grammar saw exactly its 12 tokens, none of the runner's walks
    for rid in ("free", "con"):
        assert outs[rid].outputs[0].token_ids == [token_for(rid, 0, 3 + j) | 1 for j in range(12)], rid


def test_scheduler_calls_nothing_back(tok):
    """The scheduler gets no callback into the engine (no ``sync`` / ``has_inflight``): under preemption
    with the overlap schedule it answers None (the in-flight tokens are needed first), the engine reads
    them, and the next answer is a plan made on the tokens read."""
    assert not {"sync", "has_inflight"} & set(inspect.signature(Scheduler.__init__).parameters)
    eng = _engine(tok, MockRunner(num_pages=9, max_pages_per_seq=8))
    calls = []
    schedule = eng.scheduler.schedule

    def spy(inflight=False):
        calls.append((inflight, eng.output.n_processed))
        out = schedule(inflight)
        calls[-1] += (out is None,)
        return out

    eng.scheduler.schedule = spy
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"p{i}", list(range(30 + 10 * i, 39 + 10 * i)), sp)
    eng.run_until_done()
    assert eng.preemptions["decode_pages"] > 0
    again = [i for i, c in enumerate(calls) if c[2]]
    assert again and all(calls[i][0] for i in again)  # None only while results were in flight
    for i in again:  # the next call: nothing in flight, the results read in between
        assert calls[i + 1][0] is False and calls[i + 1][1] > calls[i][1] and not calls[i + 1][2]
    assert StepResult().launches == () and not Schedule(())
