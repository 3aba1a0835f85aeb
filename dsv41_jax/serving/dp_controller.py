"""The DP controller of data-parallel attention (issue 46; /work/coord/DP_CONTRACT.md): per-rank
schedulers, request routing, and one rank-major launch per kind per step.

With ``--enable-dp-attention --dp-size D`` the request state is split into D ranks. Rank r owns a block
of the slots (`cache.rank_slots`, its scratch row `cache.scratch_slot`), of the KV pool
(`cache.rank_pages`, its null page first), of the prefix cache's snapshot rows, and its own radix
tree and HiCache host tier: the runner builds one `runner.SharedPageAllocator` and one
`prefix_cache.PrefixCache` per rank. `DPController` runs one ordinary `scheduler.Scheduler` per rank
over a `RankView` of the runner (that rank's allocator, prefix cache and slots), so admission,
chunked prefill, preemption, n > 1 forks, prompt logprobs, constraints, DSpark rows and the prefix
cache work per rank exactly as on a single engine.

Routing (`--load-balance-method`): a new request (all its samples) goes to one rank for its life
(a preempted sample resumes on its rank):

- ``cache_aware`` (default; SGLang router's ``cache_aware`` policy): while the ranks' loads are balanced,
  the rank whose prefix cache, or whose requests routed so far, share the longest prefix with the
  prompt (at least a page; SGLang's router keeps the same kind of per-worker tree of routed prompts, so
  a burst of requests with one system prompt lands together before the first has been cached), even
  if the request must wait there for a slot; else the least loaded rank (on a tie, the one caching the
  fewest pages, then the one given the fewest requests: unshared prompts spread out instead of evicting
  a rank's shared prefixes). The loads are imbalanced, as SGLang's router decides it, when the most
  loaded rank has more than `BALANCE_ABS_THRESHOLD` requests more than the least loaded AND more than
  `BALANCE_REL_THRESHOLD` times its load; then every request goes to the least loaded rank. (A cap of a
  rank's worth of slots instead sent the third of three concurrent sharers on a 2-slot rank to a rank
  without the prefix: cached_tokens 0, depending on the HTTP arrival order.)
- ``round_robin``: ranks in turn;
- ``shortest_queue``: the rank with the fewest requests (running + waiting), the lowest on a tie.

One step (`schedule`): each rank plans as it would alone; the plans are merged into ONE schedule
whose launches are rank-major (`merge`): per launch kind (prefill, decode — or the mixed launch — and
DSpark) one launch of ``B = D · B_r`` rows, where B_r is the largest of the ranks' batch buckets for
that kind and T the largest token bucket (all ranks share it); rank r's rows sit at
``[r·B_r, (r+1)·B_r)``, padded with its own padding rows (`dp_layout.pad_row`: scratch slot, null
page); a rank without rows of that kind contributes B_r padding rows. The ops between launches (cache
restores / saves, forks, HiCache copies, imports) keep their place relative to their rank's launches;
ops of different ranks touch disjoint slots, pages and rows, so their relative order is free.
The padded rows' samples are None in `scheduler.Planned.seqs` (the output processor skips them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

from dsv41_jax.model import cache as kvc
from dsv41_jax.serving import dp_layout
from dsv41_jax.serving.messages import Launch, Schedule, SpecLaunch
from dsv41_jax.serving.prefix_cache import CacheEntry, RadixTree
from dsv41_jax.serving.request import RUNNING, Seq
from dsv41_jax.serving.scheduler import Planned, Scheduler

__all__ = ["DPController", "PoolTotals", "RankView", "merge"]

# prompts each rank's routing tree remembers (oldest forgotten first)
_ROUTED_PROMPTS = 4096
# cache_aware's load-imbalance test (SGLang router's --balance-abs-threshold / --balance-rel-threshold defaults)
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


@dataclass
class RankView:
    """What rank r's scheduler sees of the runner (`runner_api.RunnerProtocol`'s scheduler part): its
    page allocator, prefix cache (or None) and slots (global ids)."""

    rank: int
    allocator: Any
    prefix_cache: Any
    slots: tuple
    scratch: int
    deterministic: bool = False

    @property
    def max_slots(self) -> int:
        return len(self.slots)


class PoolTotals:
    """The ranks' page allocators as one pool, for usage figures (``free_pages``, ``used_pages``,
    ``capacity`` summed; ``page_size``) and `check_invariants` (each rank's)."""

    def __init__(self, allocators: list):
        self.allocators = allocators
        self.page_size = allocators[0].page_size

    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self.allocators)

    @property
    def used_pages(self) -> int:
        return sum(a.used_pages for a in self.allocators)

    @property
    def capacity(self) -> int:
        return sum(a.capacity for a in self.allocators)

    def check_invariants(self) -> None:
        for a in self.allocators:
            a.check_invariants()


def _kind(L, mixed: bool) -> int:
    """A launch's kind, in run order: 0 prefill (or the mixed launch), 1 decode, 2 DSpark."""
    if L.spec:
        return 2
    if mixed:
        return 0
    return 0 if any(not (r.sample or r.replay) for r in L.rows) else 1


def merge(plans: list, ccfg: kvc.CacheConfig, mixed: bool) -> Planned:
    """The ranks' plans (`Planned`, rank order) as one rank-major plan (see the module docstring)."""
    D = len(plans)
    phases = [[[] for _ in range(4)] for _ in range(D)]  # per rank: ops before launch kind k (k = 3: after all)
    launches = [dict() for _ in range(D)]  # per rank: kind -> (launch, its samples)
    for r, p in enumerate(plans):
        seqs = iter(p.seqs)
        pending = []
        for op in p.schedule.ops:
            if isinstance(op, (Launch, SpecLaunch)):
                k = _kind(op, mixed)
                assert k not in launches[r], "a rank planned two launches of one kind"
                launches[r][k] = (op, next(seqs))
                phases[r][k] += pending
                pending = []
            else:
                pending.append(op)
        phases[r][3] += pending
    ops, out_seqs = [], []
    for k in range(4):
        for r in range(D):
            ops += phases[r][k]
        here = [launches[r].get(k) for r in range(D)]
        if k == 3 or not any(here):
            continue
        L0 = next(h[0] for h in here if h is not None)
        B_r = max(h[0].B for h in here if h is not None)
        rows, seqs = [], []
        for r, h in enumerate(here):
            mine, who = (h[0].rows, h[1]) if h is not None else ((), ())
            pad = B_r - len(mine)
            rows += list(mine) + [dp_layout.pad_row(ccfg, r)] * pad
            seqs += list(who) + [None] * pad
        if L0.spec:
            ops.append(SpecLaunch(tuple(rows), D * B_r, L0.gamma))
        else:
            T = max(h[0].T for h in here if h is not None)
            ops.append(Launch(tuple(rows), D * B_r, T))
        out_seqs.append(tuple(seqs))
    s0 = plans[0].schedule
    sched = Schedule(tuple(ops), sum((p.schedule.resets for p in plans), ()),
                     sum((p.schedule.sampling for p in plans), ()), s0.eos_token_ids, -1)
    return Planned(sched, tuple(out_seqs))


class DPController:
    """D per-rank schedulers behind the `scheduler.Scheduler` interface the engine and the output
    processor use (see the module docstring). runner: has ``allocators``, ``prefix_caches``, ``ccfg``;
    scheduler_kw: `Scheduler`'s keyword arguments (the rank batch buckets among them)."""

    def __init__(self, args, runner, *, method: str, **scheduler_kw):
        ccfg = runner.ccfg
        self.D, self.ccfg, self.method = ccfg.dp, ccfg, method
        self.mixed = bool(args.enable_mixed_chunk)
        self.page_size = ccfg.page_size
        det = bool(getattr(runner, "deterministic", False))
        self.views = [RankView(r, runner.allocators[r], runner.prefix_caches[r], tuple(kvc.rank_slots(ccfg, r)),
                               kvc.scratch_slot(ccfg, r), det) for r in range(self.D)]
        self.ranks = [Scheduler(args, v, **scheduler_kw) for v in self.views]
        self.args = args
        self.spec_gamma = self.ranks[0].spec_gamma
        self._rr = itertools.count()
        self._routed = [RadixTree() for _ in range(self.D)]
        self._routed_fifo: list = [[] for _ in range(self.D)]
        self._held: dict = {}  # rank -> its plan, while another rank waits for the in-flight tokens
        self.assigned = [0] * self.D  # requests routed to each rank (since start)

    # ------------------------------------------------------------------------------------ routing
    def load(self, r: int) -> int:
        """Rank r's requests: running and waiting (distinct request ids)."""
        s = self.ranks[r]
        return len({q.group.rid for q in s.running} | {q.group.rid for q in s.waiting})

    def route(self, prompt_ids) -> int:
        """The rank a new request with this prompt goes to (``--load-balance-method``)."""
        D = self.D
        if self.method == "round_robin":
            return next(self._rr) % D
        loads = [self.load(r) for r in range(D)]
        if self.method == "shortest_queue":
            return min(range(D), key=lambda r: (loads[r], r))
        # least loaded; on a tie the rank caching the least (then the one given the fewest requests), so
        # prompts nobody shares spread over the ranks instead of evicting the shared prefixes of rank 0
        least = min(range(D), key=lambda r: (loads[r], self._cached_pages(r), self.assigned[r], r))
        query = tuple(prompt_ids[:-1])
        match = [max(self._routed[r].shared_len(query),
                     self.views[r].prefix_cache.tree.shared_len(query) if self.views[r].prefix_cache else 0)
                 for r in range(D)]
        best = max(range(D), key=lambda r: (match[r], -loads[r], -r))
        hi, lo = max(loads), min(loads)
        imbalanced = hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo
        if match[best] >= self.page_size and not imbalanced:
            return best
        return least

    def _cached_pages(self, r: int) -> int:
        c = self.views[r].prefix_cache
        return c.cached_pages if c is not None else 0

    def _remember(self, r: int, prompt_ids) -> None:
        """Rank r's routing tree learns a routed prompt (cache_aware), forgetting its oldest past the cap."""
        tree, fifo = self._routed[r], self._routed_fifo[r]
        toks = tuple(prompt_ids[:-1])
        if not toks or tree.find(toks) is not None:
            return
        e = CacheEntry(toks, ("<routed>", r, len(fifo)), -1)
        tree.insert(toks, e)
        fifo.append(e)
        if len(fifo) > _ROUTED_PROMPTS:
            tree.remove(fifo.pop(0))

    def add(self, seqs: list) -> None:
        g = seqs[0].group
        r = self.route(g.prompt_ids)
        g.dp_rank = r
        self.assigned[r] += 1
        if self.method == "cache_aware":
            self._remember(r, g.prompt_ids)
        self.ranks[r].add(seqs)

    # ------------------------------------------------------------------------------------ per sample
    def _of(self, s: Seq) -> Scheduler:
        return self.ranks[s.group.dp_rank]

    def remove_waiting(self, s: Seq) -> None:
        self._of(s).remove_waiting(s)

    def release(self, s: Seq) -> None:
        self._of(s).release(s)

    def orphan_children(self, s: Seq) -> None:
        self._of(s).orphan_children(s)

    def spec_done(self, s: Seq, start: int, n_commit: int) -> None:
        self._of(s).spec_done(s, start, n_commit)

    def preempt(self, s: Seq, reason: str) -> None:
        self._of(s).preempt(s, reason)

    def decode_iteration_done(self) -> None:
        for s in self.ranks:
            s.decode_iteration_done()

    def stuck_victim(self) -> Seq:
        return next(s for s in self.ranks if s.running or s.waiting).stuck_victim()

    # ------------------------------------------------------------------------------------ views
    @property
    def running(self) -> list:
        return [q for s in self.ranks for q in s.running]

    @property
    def waiting(self) -> list:
        return [q for s in self.ranks for q in s.waiting]

    @property
    def free_slots(self) -> list:
        return [x for s in self.ranks for x in s.free_slots]

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.ranks)

    def rank_stats(self) -> list:
        """Per rank: num_running_reqs, num_queue_reqs, num_used_tokens, token_usage (the /metrics gauges
        with a ``dp_rank`` label) and the requests routed to it."""
        out = []
        for r, s in enumerate(self.ranks):
            a = s.allocator
            out.append({"dp_rank": r, "num_running_reqs": len({q.group.rid for q in s.running}),
                        "num_queue_reqs": s.num_waiting, "num_used_tokens": a.used_pages * a.page_size,
                        "token_usage": a.used_pages / a.capacity, "requests_assigned": self.assigned[r]})
        return out

    # ------------------------------------------------------------------------------------ plan
    def needs_results(self) -> bool:
        return any(s.needs_results() for s in self.ranks if s.rank not in self._held)

    def schedule(self, inflight: bool = False) -> Optional[Planned]:
        """One step's plan over every rank (`merge`), or None when a rank needs the in-flight tokens
        first (a preemption): the ranks that did plan keep their plans (held, not planned again) and
        the engine asks again after reading the tokens. (A sample of a held plan finishing meanwhile
        is what the overlap schedule already handles: its row is ignored, its slot and pages are
        reused only by later plans, dispatched after this one.)"""
        for r, s in enumerate(self.ranks):
            if r not in self._held:
                p = s.schedule(inflight=inflight)
                if p is not None:
                    self._held[r] = p
        if len(self._held) < self.D:
            return None
        plans, self._held = [self._held[r] for r in range(self.D)], {}
        if not any(p.schedule.ops for p in plans):
            return Planned(Schedule(()), ())
        return merge(plans, self.ccfg, self.mixed)
