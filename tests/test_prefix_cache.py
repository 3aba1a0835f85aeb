"""The radix prefix cache (issue 15 part 1, `serving/prefix_cache.py`).

* `RadixTree`: longest cached prefix, edge splits and merges.
* The scheduler + allocator against a *model-checking* mock runner (no device): the mock keeps, per
  slot, per snapshot row and per page, the tokens whose state each holds, applies every op in the
  runner's order (saves, resets, restores / forks / launches) and checks that every row a launch
  runs sees exactly its own tokens before ``start`` in its slot and its pages. A randomized test
  interleaves arrivals (prompts extending earlier conversations), aborts, finishes, preemptions and
  evictions and checks reference counts and the pool's free count against the live requests and the
  cache after every step.
* The engine on `configs.mini` (tiny's mechanisms in 6 layers; test_engine_dspark's engine arguments,
  so the compiled steps are shared) in the exact numerics mode (order-independent: a cached prefix and a cold
  prefill give the same bits): a request whose prefix is cached gives the same tokens and logprobs
  as on a cold engine, for prefixes ending mid-page, mid compressor group, inside and beyond the
  window, through the Engram layers; and the ``cached_tokens`` / hit-rate reporting.
"""

import collections
import itertools

import jax
import numpy as np
import pytest

from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.messages import (ForkOp, LaunchResult, LoadOp, RestoreOp, SaveOp, SpecLaunch, SpillOp,
                                        StepResult)
from dsv41_jax.serving.prefix_cache import CACHE_OWNER, CacheEntry, PrefixCache, RadixTree
from dsv41_jax.serving.runner import SharedPageAllocator
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.tokenizer import load_tokenizer
from mock_runner import token_at

V = 320


# ------------------------------------------------------------------------------------------- tree


def _entry(tokens):
    return CacheEntry(tuple(tokens), (CACHE_OWNER, tuple(tokens)), 0)


def test_radix_tree_longest_prefix_split_and_merge():
    t = RadixTree()
    a, b, c = _entry([1, 2, 3, 4]), _entry([1, 2, 5]), _entry([1, 2])
    for e in (a, b, c):
        t.insert(e.tokens, e)
    assert t.longest([1, 2, 3, 4, 9]) is a
    assert t.longest([1, 2, 3, 9]) is c  # diverges inside a's edge: the point above it
    assert t.longest([1, 2, 5]) is b and t.longest([1, 2]) is c
    assert t.longest([1]) is None and t.longest([]) is None and t.longest([7, 1, 2]) is None
    assert t.find((1, 2, 3)) is None and t.find((1, 2, 5)) is b
    t.remove(c)
    assert t.longest([1, 2, 3, 9]) is None and t.longest([1, 2, 3, 4]) is a
    t.remove(b)  # the node above a loses its last other branch: merged into one edge
    assert list(t.root.children.values())[0].label == (1, 2, 3, 4)
    t.remove(a)
    assert not t.root.children and t.entries() == []
    with pytest.raises(ValueError):
        t.remove(a)


# ------------------------------------------------------------------------------------------- mock


def true_token(prompts: dict, row, pos: int) -> int:
    """The token at position pos of a row's sample: its prompt's (the test registered it), then the mock's."""
    return prompts[row.req_id][pos] if pos < row.prompt_len else token_at(row, pos)


class CheckingRunner:
    """The runner's interface without a model; it tracks which tokens each slot row, snapshot row and
    page position holds and asserts that every launch row sees exactly its own history."""

    def __init__(self, *, num_pages=25, page_size=4, max_pages_per_seq=12, max_slots=4, rows=6, host_pages=0):
        rows = max(rows, 2 * max_slots)
        self.allocator = SharedPageAllocator(num_pages, page_size, max_pages_per_seq)
        self.prefix_cache = PrefixCache(self.allocator, rows, host_pages)
        self.n_loads = 0
        self.snapshot_rows = rows
        self.max_slots, self.scratch = max_slots, max_slots
        self.context_length = page_size * max_pages_per_seq
        self.vocab_size, self.max_logprobs, self.spec_gamma = V, 5, 0
        self.launches = 0
        self.slot_hist = collections.defaultdict(dict)  # slot -> {pos: token}
        self.snap_hist: dict = {}
        self.page_hist = collections.defaultdict(dict)  # page -> {offset: token}
        self.n_restores = 0
        self.prompts: dict = {}  # request id -> prompt ids (registered by `_mock_engine`'s add_request)

    def warmup(self, *a) -> int:
        return 0

    def num_compilations(self) -> int:
        return 0

    def execute(self, schedule) -> StepResult:
        ps = self.allocator.page_size
        ops = schedule.ops
        for op in ops:  # (spills first: their pages and rows may be reused by this schedule)
            if isinstance(op, SpillOp) and op.key in self.prefix_cache.host_entries:  # (as the runner: not
                # when the entry left the host tier before its spill ran)
                self.prefix_cache.host_store[op.key] = ([dict(self.page_hist[p]) for p in op.pages],
                                                     dict(self.snap_hist[op.row]))
        for op in ops:
            if isinstance(op, SaveOp) and not op.in_order:
                self.snap_hist[op.row] = dict(self.slot_hist[op.slot])
        for slot in schedule.resets:
            self.slot_hist[slot] = {}
        results = []
        for op in ops:
            if isinstance(op, SaveOp):
                if op.in_order:
                    self.snap_hist[op.row] = dict(self.slot_hist[op.slot])
                continue
            if isinstance(op, SpillOp):
                continue
            if isinstance(op, LoadOp):
                pages, row = self.prefix_cache.host_store[op.key]
                for p, h in zip(op.dst_pages, pages):
                    self.page_hist[p] = dict(h)
                self.slot_hist[op.slot] = dict(row)
                self.n_restores += 1
                self.n_loads += 1
                continue
            if isinstance(op, RestoreOp):
                self.slot_hist[op.slot] = dict(self.snap_hist[op.row])
                self.page_hist[op.dst_page] = dict(self.page_hist[op.src_page])
                self.n_restores += 1
                continue
            if isinstance(op, ForkOp):
                self.slot_hist[op.dst_slot] = dict(self.slot_hist[op.src_slot])
                self.page_hist[op.dst_page] = dict(self.page_hist[op.src_page])
                continue
            assert not isinstance(op, SpecLaunch)
            self.launches += 1
            toks = np.zeros((op.B,), np.int32)
            for b, r in enumerate(op.rows):
                hist = self.slot_hist[r.slot]
                want = {p: true_token(self.prompts, r, p) for p in range(r.start)}
                got = {p: hist.get(p) for p in range(r.start)}
                assert got == want, f"{r.key}: slot rows differ before {r.start}"
                for p in range(r.start):
                    assert self.page_hist[r.pages[p // ps]].get(p % ps) == want[p], f"{r.key}: page at {p}"
                for p in range(r.start, r.start + r.n):
                    hist[p] = true_token(self.prompts, r, p)
                    self.page_hist[r.pages[p // ps]][p % ps] = true_token(self.prompts, r, p)
                if r.sample:
                    toks[b] = token_at(r, r.start + r.n)
            results.append(LaunchResult(toks, np.zeros((op.B,), np.float32),
                                        np.zeros((op.B, self.max_logprobs), np.int32),
                                        np.zeros((op.B, self.max_logprobs), np.float32)))
        return StepResult(tuple(results))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def _mock_engine(tok, num_pages=25, host_pages=0, rows=6, **kw):
    args = dict(model="tiny", page_size=4, max_running_requests=4, chunked_prefill_size=4, max_prefill_tokens=8,
                batch_buckets=[4], token_buckets=[4], decode_log_interval=1000)
    args.update(kw)
    runner = CheckingRunner(page_size=args["page_size"], num_pages=num_pages,
                            max_slots=args["max_running_requests"], host_pages=host_pages, rows=rows)
    eng = Engine(EngineArgs(**args), runner=runner, tokenizer=tok)
    add = eng.add_request

    def add_request(rid, prompt, *a, **kw):  # the mock checks rows against the prompts it is told
        runner.prompts[rid] = list(prompt)
        return add(rid, prompt, *a, **kw)

    eng.add_request = add_request
    return eng


def _check_refs(eng) -> None:
    """Reference counts and the free count against the live requests and the cache entries."""
    a, c = eng.allocator, eng.prefix_cache
    a.check_invariants()
    holders = collections.Counter()
    live = set()
    for s in eng.scheduler.running:
        holders.update(a.pages(s.key))
        live.update(a.pages(s.key))
    for key in c.entries:
        holders.update(a.pages(key))
    assert dict(holders) == a._refs
    assert not live & set(a._free), "a page a running request holds is free"
    only_cache = {p for p in holders if p not in live}
    pinned_only = {p for p in only_cache if any(p in a.pages(k) for k in c.pinned if k in c.entries)}
    assert a.free_pages == a.capacity - len(live) - len(pinned_only)
    for g in list(eng.output.groups.values()):
        for s in g.seqs:
            if s.status == "finished":
                assert not a.has(s.key) and s.slot is None


def test_cache_hit_resumes_with_exact_history(tok):
    eng = _mock_engine(tok, rows=16)  # every point kept (eviction: the segmented-LRU tests below)
    p1 = list(range(20, 31))  # 11 tokens: ends mid-page (pages of 4)
    o = _run(eng, [("a", p1, 5)])["a"]
    conv = p1 + list(o.outputs[0].token_ids)  # 16 tokens; 15 written (the last sampled is not)
    # chunk ends at page boundaries (4, 8), prompt end, request end
    assert sorted(e.k for e in eng.prefix_cache.entries.values()) == [4, 8, 10, 15]
    outs = _run(eng, [("b", conv + [7, 8, 9], 3)])
    assert outs["b"].num_cached_tokens == 15 and eng.runner.n_restores == 1
    # a shorter request that diverges inside the cached prefix: the deepest point on its path (a
    # chunk end)
    outs = _run(eng, [("c", conv[:9] + [5, 5], 2)])
    assert outs["c"].num_cached_tokens == 8 and eng.runner.n_restores == 2
    # one that continues the first prompt differently: resumes at its prompt-end point
    outs = _run(eng, [("d", p1[:10] + [6, 6, 6], 2)])
    assert outs["d"].num_cached_tokens == 10 and eng.runner.n_restores == 3
    st = eng.stats()
    assert st["cached_prompt_tokens"] == 33 and 0 < st["cache_hit_rate"] < 1
    _check_refs(eng)
    assert eng.allocator.free_pages == eng.allocator.capacity


def test_longest_cached_prefix_admitted_first_bounded(tok):
    """One slot, a queue [x (nothing cached), y (12 tokens cached), z (12 cached)]: y and z overtake x
    (at least a page less prefill each), but x is passed over at most 4 times in a row."""
    eng = _mock_engine(tok, max_running_requests=1, batch_buckets=[1])
    p = list(range(40, 52))
    _run(eng, [("a", p, 1)])
    order = []
    for rid, prompt in [("x", list(range(100, 110)))] + [(f"y{i}", p + [i + 1, 1]) for i in range(6)]:
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["y0", "y1", "y2", "y3", "x", "y4", "y5"]
    assert eng.metrics["cached_prompt_tokens"] == 6 * 12
    _check_refs(eng)


def test_chunk_end_points_survive_a_cache_full_of_hit_entries(tok):
    """Segmented LRU over the snapshot rows: they are full of older entries that were hit or made at
    prompt ends (none on probation); a 18-token prompt then leaves chunk-end points at 4, 8, 12, 16.
    They evict one another only once they hold a quarter of the rows (2 of 8), so the point inside
    the 16-token prefix the next request shares survives and that request resumes from it (with
    unhit points evicted first regardless, a prompt's own points evicted each other and it missed)."""
    eng = _mock_engine(tok, max_running_requests=1, batch_buckets=[1], rows=8, num_pages=200)
    c = eng.prefix_cache
    assert c.num_rows == 8 and c.probation_rows == 2
    for i in range(4):
        _run(eng, [(f"f{i}", [30 + 3 * i, 31 + 3 * i, 32 + 3 * i], 1)])
    assert len(c.entries) == 8 and not any(e.probation for e in c.entries.values())
    S = list(range(100, 116))
    _run(eng, [("a", S + [7, 8], 1)])
    assert 16 in [e.k for e in c.entries.values() if e.probation]
    outs = _run(eng, [("b", S + [9, 9, 9], 1)])
    assert outs["b"].num_cached_tokens == 16
    _check_refs(eng)


def test_page_pressure_evicts_lru_leaves_not_a_path_in_use(tok):
    """12 pages of 4 tokens. A conversation x (points 4, 8 at chunk ends, 9 at its prompt end, 13 at
    its end), a cold prompt y (the same points), x's second turn (a hit at 13; points 15, 17) and a
    14-token cold prompt z that needs pages: they come from y's points (the least recently used
    leaves), and every point on x's path stays — an inner point's pages are held by the points below
    it, so evicting it first would free nothing. (Unhit points first, then LRU over every entry,
    evicted x's 4, 8 and 9 for no page.) x's third turn resumes at 17."""
    eng = _mock_engine(tok, max_running_requests=1, batch_buckets=[1], rows=16, num_pages=12)
    c = eng.prefix_cache
    path = lambda first: sorted(e.k for e in c.entries.values() if e.tokens[0] == first)
    X = list(range(20, 30))
    x1 = X + list(_run(eng, [("x", X, 4)])["x"].outputs[0].token_ids)
    _run(eng, [("y", list(range(60, 70)), 4)])
    assert path(20) == path(60) == [4, 8, 9, 13]
    x2 = x1 + [5, 5]
    o = _run(eng, [("x2", x2, 2)])["x2"]
    assert o.num_cached_tokens == 13 and path(20) == [4, 8, 9, 13, 15, 17]
    _run(eng, [("z", list(range(100, 114)), 2)])
    assert path(20) == [4, 8, 9, 13, 15, 17] and len(path(60)) < 4
    o = _run(eng, [("x3", x2 + list(o.outputs[0].token_ids) + [6], 1)])["x3"]
    assert o.num_cached_tokens == 17
    _check_refs(eng)


def test_hit_without_a_page_for_the_copy_falls_back_to_prefill(tok):
    """The pool is exactly full of a cached prefix's pages (its partial page would need a copy and
    no page is free): the hit is abandoned and the sample prefills itself in the same plan, evicting
    the entry (as test_preemption's whole-pool n = 2 request)."""
    eng = _mock_engine(tok, num_pages=13)  # 12 pages of 4 = 48 tokens
    p = list(range(20, 67))  # 47 tokens: needs every page
    outs = _run(eng, [("a", p, 1)])
    outs.update(_run(eng, [("b", p, 1)]))
    assert outs["b"].outputs[0].finish_reason == "length" and outs["b"].num_cached_tokens == 0
    _check_refs(eng)
    assert eng.allocator.free_pages == eng.allocator.capacity


def test_shared_system_prompt_gets_a_branch_point(tok):
    """A shared system prompt S (13 tokens) followed by different questions: the first request leaves
    points at its chunk end (8) and its own ends; the second resumes from the chunk end inside S (its
    first repeat hits) and, as it shares S with the tree's path, saves its state at S's last page
    boundary (12) while it prefills (its 8-token chunk is cut there); every later question — and a
    prompt that leaves S inside the cached page — resumes at 12."""
    eng = _mock_engine(tok, chunked_prefill_size=8, max_prefill_tokens=16, token_buckets=[8])
    S = list(range(20, 33))
    outs = _run(eng, [("a", S + [100, 101, 102], 2)])
    assert sorted(e.k for e in eng.prefix_cache.entries.values()) == [8, 15, 17]
    outs = _run(eng, [("b", S + [110, 111, 112, 113], 2)])
    assert outs["b"].num_cached_tokens == 8
    assert 12 in [e.k for e in eng.prefix_cache.entries.values()]
    outs = _run(eng, [("c", S + [120, 121], 3), ("d", S[:12] + [5, 5, 5], 1)])
    assert outs["c"].num_cached_tokens == 12 and outs["d"].num_cached_tokens == 12
    assert eng.runner.n_restores == 3
    # a prompt sharing less than a page with the tree makes no point (only its own ends: 8, 9)
    _run(eng, [("e", S[:3] + [7, 7, 7, 7, 7, 7], 1)])
    assert min(e.k for e in eng.prefix_cache.entries.values()) == 8
    _check_refs(eng)
    assert eng.allocator.free_pages == eng.allocator.capacity


def test_n_gt_1_groups_hit_the_cache(tok):
    """An n = 2 request whose prompt (minus its last token) is all cached: both samples restore the
    point (no prefill, no fork); one whose prompt goes on past the cached point: the first sample
    restores it, prefills the rest, and its sibling forks from it. The checking runner sees every
    sample's exact history."""
    eng = _mock_engine(tok)
    P = list(range(20, 31))
    _run(eng, [("a", P, 2)])
    eng.add_request("g", P, SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True))
    outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
    assert outs["g"].num_cached_tokens == 10 and eng.runner.n_restores == 2
    assert eng.metrics["num_forks"] == 0 and len(outs["g"].outputs) == 2
    eng.add_request("h", P + [50, 51, 52, 53, 54, 55], SamplingParams(temperature=0, max_tokens=3, n=2,
                                                                      ignore_eos=True))
    outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
    assert outs["h"].num_cached_tokens == 10 and eng.runner.n_restores == 3 and eng.metrics["num_forks"] == 1
    _check_refs(eng)
    assert eng.allocator.free_pages == eng.allocator.capacity


def _run(eng, reqs, each=None):
    for rid, prompt, n in reqs:
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        if each:
            each(eng)
    return outs


@pytest.mark.parametrize("seed,host,mixed", [(0, 0, False), (1, 0, False), (2, 0, False), (5, 0, True), (3, 30, False),
                                             (4, 30, True)])
def test_randomized_arrivals_aborts_finishes_evictions(tok, seed, host, mixed):
    """Conversations grow turn by turn (each prompt extends an earlier prompt + answer, or a random
    prefix of it) under a pool small enough to preempt and evict; requests are aborted at random;
    with and without a host tier (evictions spill there, hits load back), split and mixed launches;
    some requests are n = 2 groups, and prompts that leave an earlier one mid-way make branch points.
    After every step: reference counts = live holders, the free count = capacity − pages of the
    running requests (and of pinned entries); and the checking runner saw every row's exact history."""
    rng = np.random.default_rng(seed)
    eng = _mock_engine(tok, num_pages=16, host_pages=host, enable_mixed_chunk=mixed)
    a, c = eng.allocator, eng.prefix_cache
    history: list = [list(rng.integers(20, 300, size=int(rng.integers(2, 10))).tolist())]
    rid_n = itertools.count()
    n_rng = np.random.default_rng(100 + seed)
    live: dict = {}
    for step in range(220):
        if rng.random() < 0.35 and len(live) < 8:
            base = history[int(rng.integers(len(history)))]
            base = base if len(base) < 26 else base[:int(rng.integers(1, 10))]
            cut = len(base) if rng.random() < 0.6 else int(rng.integers(1, len(base) + 1))
            prompt = base[:cut] + rng.integers(20, 300, size=int(rng.integers(1, 5))).tolist()
            prompt = prompt[:30] or [21]
            rid = f"r{next(rid_n)}"
            n = 2 if n_rng.random() < 0.15 else 1  # n > 1 groups hit (and fork) too
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 14)),
                                                        ignore_eos=True, n=n))
            live[rid] = prompt
        if live and rng.random() < 0.06:
            eng.abort_request(sorted(live)[int(rng.integers(len(live)))])
        if rng.random() < 0.03:
            c.evict(a.capacity)  # forced eviction: everything unpinned goes
        for o in eng.step():
            if o.finished:
                prompt = live.pop(o.request_id)
                history.append(prompt + list(o.outputs[0].token_ids))
        _check_refs(eng)
    while eng.has_unfinished():
        eng.step()
        _check_refs(eng)
    assert eng.runner.n_restores >= 2 and eng.metrics["num_preemptions"] > 0 and eng.metrics["num_forks"] > 0
    if host:  # evicted entries went to the host tier and came back on hits
        assert c.spills > 0 and eng.runner.n_loads > 0 and c.host_used > 0
    assert a.free_pages == a.capacity
    c.clear_cache()
    assert len(a._free) == a.capacity and not c.entries and len(c.free_rows) == c.num_rows
    assert not c.host_entries and c.host_used == 0 and not c.host_store


# ------------------------------------------------------------------------------------------- engine

# The plain engine of tests/test_engine_dspark.py (same shapes: its compiled programs are reused).
KW = dict(model="tiny", page_size=8, max_total_tokens=192, context_length=48, max_running_requests=4,
          chunked_prefill_size=1, batch_buckets=[4], skip_server_warmup=True, decode_log_interval=1000)


@pytest.fixture(scope="module")
def eng(mini_cfg, mini_params):
    e = Engine(cfg=mini_cfg.replace(act_dtype="exact"), params=mini_params, **KW)
    assert e.runner.snapshot_rows == 64  # 4 x 4 running requests, raised to the minimum
    yield e
    e.allocator.check_invariants()
    assert e.allocator.free_pages == e.allocator.capacity


def _greedy_lp(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)


def _run_eng(eng, reqs):
    """reqs: [(prompt, n)] all at once; returns the outputs in order."""
    rids = [f"e{next(_eids)}" for _ in reqs]
    for rid, (p, n) in zip(rids, reqs):
        eng.add_request(rid, p, _greedy_lp(n))
    outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
    eng.allocator.check_invariants()
    return [outs[r] for r in rids]


_eids = itertools.count()


def test_cached_prefix_equals_cold_exact(eng):
    """Conversations whose cached state ends at k = 5 (inside the window of 8, mid page of 8, mid
    ratio-2 group), 10 (beyond the window, mid page, group boundary), 13 (mid page, mid group) and 16
    (page and group boundary); every step runs the Engram layers (1 and 4), whose history is part of
    the snapshot. The next turn resumes from the cache and gives the tokens and logprobs (sampled
    and top-3) of the same request on a cold cache, bit for bit."""
    rng = np.random.default_rng(7)
    firsts = [(rng.integers(3, 319, size=a).tolist(), m) for a, m in ((3, 3), (8, 3), (10, 4), (12, 5))]
    eng.prefix_cache.clear_cache()
    outs = _run_eng(eng, firsts)
    ks = sorted(e.k for e in eng.prefix_cache.entries.values())
    # prompt ends (len − 1), request ends (len + m − 1) and the chunk ends at page boundaries (8: two prompts)
    assert ks == [2, 5, 7, 8, 8, 9, 10, 11, 13, 16]
    seconds = [(p + list(o.outputs[0].token_ids) + rng.integers(3, 319, size=2).tolist(), 3)
               for (p, _), o in zip(firsts, outs)]
    _warm_equals_cold(eng, seconds, [5, 10, 13, 16])


def test_prompt_end_snapshot_equals_cold_exact(eng):
    """Prompt-end points (k = len(prompt) − 1 = 2, 7, 9, 11): saved while the request ran on, so the
    shared partial page also holds the source's later tokens (positions ≥ k, overwritten by the new
    request before any read). A different continuation of the same prompt prefix resumes there and
    equals a cold run."""
    rng = np.random.default_rng(8)
    firsts = [(rng.integers(3, 319, size=a).tolist(), m) for a, m in ((3, 3), (8, 3), (10, 4), (12, 5))]
    eng.prefix_cache.clear_cache()
    _run_eng(eng, firsts)
    thirds = [(p[:-1] + rng.integers(3, 319, size=2).tolist(), 3) for p, _ in firsts]
    _warm_equals_cold(eng, thirds, [2, 7, 9, 11])


def test_shared_system_prompt_hits_from_the_first_repeat_exact(eng):
    """Shared system prompts of 13 and 21 tokens, each followed by four different questions one
    after another: the first request saves points at its prefill chunk ends on page boundaries (8: the
    window's edge; 16: beyond it, with Engram history and compressor groups), so the second request —
    the first repeat — already resumes at the system prompt's last page boundary, as do the third and
    fourth; each equals its cold run (cache cleared) bit for bit: tokens, logprobs, top-3."""
    rng = np.random.default_rng(9)
    systems = [rng.integers(3, 319, size=n).tolist() for n in (13, 21)]
    turns = [[(S + rng.integers(3, 319, size=3).tolist(), 3) for S in systems] for _ in range(4)]
    eng.prefix_cache.clear_cache()
    warm = [_run_eng(eng, t) for t in turns]
    assert [[o.num_cached_tokens for o in w] for w in warm] == [[0, 0], [8, 16], [8, 16], [8, 16]]
    for t, w in zip(turns, warm):
        eng.prefix_cache.clear_cache()
        cold = _run_eng(eng, t)
        assert [o.num_cached_tokens for o in cold] == [0, 0]
        _assert_same_outputs(w, cold)
    eng.prefix_cache.clear_cache()


def test_export_import_slot_round_trip(eng):
    """The state-transfer seam (`Runner.export_slot` / `import_slot`, the unit the prefix cache snapshots):
    a slot's rows and pages exported to host arrays, imported into another slot and other pages, export
    again the same bits; a page count mismatch is refused."""
    eng.prefix_cache.clear_cache()
    _run_eng(eng, [(list(range(30, 50)), 2)])  # slots and pages now hold a request's state
    eng.prefix_cache.clear_cache()
    r = eng.runner
    a = r.export_slot(0, [1, 2, 3])
    assert any(np.any(x != 0) for x in jax.tree_util.tree_leaves(a["rows"])) and len(a["pages"]) == 3
    r.import_slot(a, 1, [4, 5, 6])
    b = r.export_slot(1, [4, 5, 6])
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    with pytest.raises(ValueError, match="pages"):
        r.import_slot(a, 1, [4, 5])
    r.reset_slots([1])


@pytest.fixture(scope="module")
def host_eng(mini_cfg, mini_params):
    """The same engine with the host tier (the same compiled steps; only the page copies are new)."""
    e = Engine(cfg=mini_cfg.replace(act_dtype="exact"), params=mini_params, enable_hierarchical_cache=True,
               hicache_ratio=1.5, **KW)
    assert e.prefix_cache.host_pages == int(1.5 * e.allocator.capacity)
    yield e
    e.allocator.check_invariants()


def test_host_tier_round_trip_equals_cold_exact(host_eng):
    """Every cached state is evicted from the device pool to the host tier (pages and snapshot row
    copied out, device pages freed); the next turns load them back (fresh pages) and equal a cold
    run bit for bit, as in `test_cached_prefix_equals_cold_exact`."""
    eng, a, c = host_eng, host_eng.allocator, host_eng.prefix_cache
    rng = np.random.default_rng(7)
    firsts = [(rng.integers(3, 319, size=n).tolist(), m) for n, m in ((3, 3), (8, 3), (10, 4), (12, 5))]
    outs = _run_eng(eng, firsts)
    eng.step()  # dispatches the last snapshot saves (an entry is spilled only once its save ran)
    c.evict(a.capacity)
    assert not c.entries and len(a._free) == a.capacity and c.spills == 10  # (2 of them chunk-end points)
    a.check_invariants()
    seconds = [(p + list(o.outputs[0].token_ids) + rng.integers(3, 319, size=2).tolist(), 3)
               for (p, _), o in zip(firsts, outs)]
    _warm_equals_cold(eng, seconds, [5, 10, 13, 16])
    assert c.host_hits == 4 and eng.stats()["prefix_cache_host_hits"] == 4


def _warm_equals_cold(eng, reqs, want_cached):
    warm = _run_eng(eng, reqs)
    assert [o.num_cached_tokens for o in warm] == want_cached
    eng.prefix_cache.clear_cache()
    cold = _run_eng(eng, reqs)
    assert [o.num_cached_tokens for o in cold] == [0] * len(reqs)
    _assert_same_outputs(warm, cold)
    eng.prefix_cache.clear_cache()


def _assert_same_outputs(warm, cold):
    for w, c in zip(warm, cold, strict=True):
        wo, co = w.outputs[0], c.outputs[0]
        assert wo.token_ids == co.token_ids
        assert wo.logprobs == co.logprobs  # exact: the same bits
        assert wo.top_logprobs == co.top_logprobs


def test_snapshot_rows_come_out_of_the_memory_budget(tiny_cfg, tiny_params):
    """The snapshot pool is paid from the KV budget: with --radix-cache-snapshots 3 the pool gets the
    same 10 pages as without the cache when the budget has 3 window rows more; by default the rows
    are capped to a quarter of the budget; 0 rows, or rows with the cache off, are refused."""
    import jax

    from dsv41_jax.model import cache as kvc

    if jax.devices()[0].platform != "cpu":
        pytest.skip("the CPU memory stand-in")
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(tiny_params))
    b = kvc.kv_bytes_per_token(tiny_cfg)
    S, ps, w = 4, 16, b["window_per_request"]
    budget = int((S + 1 + 3) * w + 10 * ps * b["per_token"]) + 1
    kw = dict(model="tiny", page_size=ps, context_length=64, max_running_requests=S, mem_fraction_static=0.5,
              skip_server_warmup=True)
    e = Engine(EngineArgs(cpu_memory_budget=2 * (weights + budget), radix_cache_snapshots=3, **kw),
               cfg=tiny_cfg, params=tiny_params)
    assert e.runner.ccfg.num_pages == 10 and e.runner.snapshot_rows == 3 and e.prefix_cache.num_rows == 3
    e = Engine(EngineArgs(cpu_memory_budget=2 * (weights + budget), **kw), cfg=tiny_cfg, params=tiny_params)
    assert e.runner.snapshot_rows == int(budget * 0.25 // w) < 4 * S  # < the default 64 too
    with pytest.raises(ValueError, match="radix_cache_snapshots"):
        EngineArgs(radix_cache_snapshots=0, **kw)
    with pytest.raises(ValueError, match="disable-radix-cache"):
        EngineArgs(radix_cache_snapshots=2, disable_radix_cache=True, **kw)
    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        EngineArgs(hicache_ratio=2, **kw)
    with pytest.raises(ValueError, match="hicache_ratio"):
        EngineArgs(hicache_ratio=0, enable_hierarchical_cache=True, **kw)
    with pytest.raises(ValueError, match="radix cache"):
        EngineArgs(enable_hierarchical_cache=True, disable_radix_cache=True, **kw)
