"""The scheduler: decides what runs each iteration (admission, chunked-prefill budget, preemption,
prompt sharing, DSpark rows). Host-only and model-free: it sees the runner only through
`runner_api.RunnerProtocol` (``allocator``, ``prefix_cache``, ``max_slots``, ``scratch``), so its unit tests drive it
with model-free runners implementing that protocol (tests/test_scheduler.py, tests/test_prefix_cache.py),
as JetStream's mock engine does.

One iteration's plan (`Scheduler.schedule`) is a list of ops for the runner: `Launch` (rows of one
[B, T] step, B and T rounded up to the compiled buckets), `SpecLaunch` (DSpark rows: one [B, γ+1]
verify step) and fork copies. Policy (see engine.py's docstring for the why):

- Running samples contribute one row each: a decode row (newest token, position ``num_cached``), a
  replay row (a resumed sample's generated token, written again without sampling), a DSpark row
  (anchor + γ drafts, when DSpark is on and the row can speculate, see `_can_speculate`) or a prefill
  chunk (at most ``chunked_prefill_size`` tokens, all rows together at most ``max_prefill_tokens``).
- Waiting samples are admitted in priority order (a preempted one resumes before anything newer) while
  slots, prefill budget and pages allow (the whole prefill plus ``_reserve_ratio`` of what the running
  samples may still generate).
- When decode rows need pages the pool does not have ("decode_pages"), or the admitted prefills are
  blocked on pages ("prefill_pages"), the sample that arrived last is preempted (pages and slot freed,
  back to the queue). The oldest sample is never preempted while another runs.
- A DSpark row needs pages for start + γ + 1 tokens; when the pool cannot give them the row decodes
  plainly this iteration (never a preemption for speculation). After the step the runner's result
  says how many tokens were committed (`spec_done`), and the pages beyond them go back.

The host state (``num_cached``, ``n_inflight``, page tables) is advanced as if the plan had run, so the
next plan can be made before this one's tokens are read (the overlap schedule); a preemption needs the
in-flight tokens first: `schedule` then returns None and the engine reads them and asks again (nothing
calls back from the scheduler into the engine or the output processor).

The plan leaves as messages (`messages.Schedule`: frozen, no `Seq`); the scheduler keeps, host-side,
which sample each launch row belongs to (`Planned.seqs`), for reading the launch's result.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from dsv41_jax.model.decode import _bucket
from dsv41_jax.serving.engine_metrics import EngineMetrics
from dsv41_jax.serving.messages import ForkOp, ImportOp, Launch, Row, SamplingRow, Schedule, SpecLaunch
from dsv41_jax.serving.request import PREEMPTION_REASONS, RUNNING, WAITING, Seq
from dsv41_jax.serving.runner_api import RunnerProtocol

__all__ = ["Planned", "Scheduler"]

log = logging.getLogger("dsv41_jax.engine")

# Admission headroom (as SGLang's new_token_ratio): a sample is admitted when the pool also holds
# this fraction of the tokens the running samples may still generate. It rises after a preemption
# (admissions were too eager) and decays by one step per decode iteration (requests often stop early).
_RESERVE_INIT, _RESERVE_MIN, _RESERVE_BUMP, _RESERVE_DECAY = 0.5, 0.1, 0.3, 0.002
# Longest-prefix-match admission (prefix cache): fresh samples looked at behind the queue head, and
# how many times a head may be passed over.
_LPM_WINDOW, _LPM_MAX_SKIPS = 8, 4


@dataclass
class _Row:
    """A row while the plan is made (host-only: it holds the sample); `_freeze` turns it into a
    `messages.Row`."""

    seq: Seq
    start: int
    n: int
    tokens: list  # host tokens (empty for a decode row whose token is still on the device)
    from_prev: bool
    sample: bool
    step: int
    pages: list
    replay: bool = False  # a resumed sample's generated token, written again (not sampled)


@dataclass
class _Launch:
    rows: list
    B: int
    T: int
    spec: bool = False


@dataclass
class _Fork:
    op: ForkOp
    seqs: list  # the sibling that gets the copy


@dataclass(frozen=True)
class Planned:
    """One iteration as the engine keeps it (host-only): the `Schedule` the runner executes, and per launch
    (in `Schedule.launches` order) the samples its rows belong to, which the output processor reads the
    launch's result into. The runner never sees ``seqs``."""

    schedule: Schedule
    seqs: tuple  # per launch: tuple of `Seq`, one per row


def _row_message(r: _Row, spec: bool) -> Row:
    """The frozen `messages.Row` of a planned row (``spec``: of a DSpark launch). Made when the plan is
    complete, i.e. when the runner used to read the sample: a constrained row is planned only after its
    tokens were read, so its mask is the one for the row's token; a DSpark row gets a snapshot (clone)
    of its grammar, which the runner walks (on a clone of its own) through the drafts."""
    s = r.seq
    plp = None
    if s.want_plp and not (r.sample or r.replay):
        plp = tuple(s.tokens(r.start + 1, r.start + r.n + 1))
    allowed = grammar = None
    if r.sample and s.constraint is not None:
        if spec:
            grammar = s.constraint.clone()
        else:
            a = s.constraint.allowed_mask()
            if a is not None:
                allowed = np.array(a, bool).reshape(-1)  # a copy: the message's is read-only
    return Row(s.group.rid, s.index, s.slot, r.start, r.n, tuple(r.tokens), r.from_prev, r.sample, r.step,
               tuple(r.pages), len(s.prompt_ids), r.replay, int(s.params.logprobs or 0) if r.sample else 0, plp,
               allowed, grammar)


class Scheduler:
    """Decides each iteration's rows. Single-threaded; owned by `Engine`.

    args: `EngineArgs` (max_prefill_tokens, chunked prefill, mixed chunk, prefix sharing); runner: has
    ``allocator``, ``max_slots``, ``scratch``; context_length: per-request token limit; batch_buckets /
    token_buckets: the compiled shapes; spec_gamma: DSpark proposals per step (0: off); metrics: the
    engine's `EngineMetrics` (counted into); eos_token_ids: for the sampling rows of admitted samples;
    on_release: sees a sample before its pages and slot are freed.
    """

    def __init__(self, args, runner: RunnerProtocol, *, context_length: int, batch_buckets: list, token_buckets: list,
                 metrics: EngineMetrics, spec_gamma: int = 0, eos_token_ids: tuple = (),
                 on_release: Optional[Callable[[Seq], None]] = None):
        self.args, self.runner = args, runner
        self.allocator = runner.allocator
        self.page_size = runner.allocator.page_size
        self.context_length = context_length
        self.max_context = runner.allocator.max_pages_per_seq * runner.allocator.page_size
        self.batch_buckets, self.token_buckets = batch_buckets, token_buckets
        self.chunk_cap = token_buckets[-1]
        self.metrics = metrics
        self.eos_token_ids = tuple(eos_token_ids)
        self.spec_gamma = int(spec_gamma)
        self.spec_batch_buckets = [b for b in batch_buckets]
        self.on_release = on_release
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        # the slots it hands out: the runner's ``slots`` (a dp rank's block, `cache.rank_slots`), else all
        self.slots = list(getattr(runner, "slots", None) or range(runner.max_slots))
        self.rank = getattr(runner, "rank", 0)  # the dp rank it schedules (0: the only one)
        self.free_slots = self.slots[::-1]
        self.pending_resets: list = []  # slots to reset on the device before the next launches
        self.pending_sampling: list = []  # admitted samples whose sampling rows the runner must write
        self.reserve_ratio = _RESERVE_INIT
        self._room_blocked = False  # this plan: an admitted prefill chunk waits for pages
        self._inflight = False  # this plan: launches are dispatched whose results are not read yet
        self._again = False  # the last `schedule` returned None: the next one goes on with its plan
        self.cache = runner.prefix_cache  # the radix prefix cache's controller (prefix_cache.py), or None
        self.pending_restores: list = []  # this plan's RestoreOps (dispatched before its launches)
        self.pending_imports: list = []  # this plan's ImportOps (prefilled states of admitted samples)

    # ------------------------------------------------------------------------------------ queue
    def add(self, seqs: list) -> None:
        self.waiting.extend(seqs)

    def remove_waiting(self, s: Seq) -> None:
        try:
            self.waiting.remove(s)
        except ValueError:
            pass

    @property
    def num_waiting(self) -> int:
        return len({s.group.rid for s in self.waiting})

    # ------------------------------------------------------------------------------------ plan
    def needs_results(self) -> bool:
        """Whether the next plan needs the tokens in flight first: a constraint mask, a DSpark row's anchor
        and position depend on them (with DSpark on, the overlap schedule thus only covers rows that never
        speculate). The engine reads its in-flight results before `schedule` when this holds."""
        return any((s.constraint is not None and s.n_inflight) or s.spec_inflight
                   or (self.spec_gamma and s.n_inflight and self._may_speculate(s)) for s in self.running)

    def schedule(self, inflight: bool = False) -> Optional[Planned]:
        """This iteration's plan (its schedule has no ops when nothing can run), or None when a preemption
        needs the in-flight tokens first (``inflight``: launches are dispatched whose results are not read
        yet); the engine then reads them and asks again. With the prefix cache, the snapshot saves of
        samples released since the last plan and this plan's restores come first (`_cache_ops`). The slot
        resets and sampling rows of admitted samples go with the first schedule that has ops."""
        self._inflight = inflight
        if self.cache is not None and not self._again:
            self.cache.unpin_all()  # the previous plan's restores are dispatched
        ops = self._plan()
        self._again = ops is None  # (then what this attempt pinned stays pinned for the next)
        if ops is None:
            return None
        imports, self.pending_imports = self.pending_imports, []
        return self._freeze(self._cache_ops(imports + ops))

    def _freeze(self, ops: list) -> Planned:
        """The plan as messages: launches of frozen rows, forks without their samples; the slot resets and
        the sampling rows of admitted samples (those still running: one admitted and preempted in the same
        plan has no slot) when there are ops to run."""
        msgs, seqs = [], []
        for op in ops:
            if isinstance(op, _Launch):
                rows = tuple(_row_message(r, op.spec) for r in op.rows)
                msgs.append(SpecLaunch(rows, op.B, op.T - 1) if op.spec else Launch(rows, op.B, op.T))
                seqs.append(tuple(r.seq for r in op.rows))
            else:
                msgs.append(op.op if isinstance(op, _Fork) else op)
        resets, sampling = (), ()
        if msgs:
            resets = tuple(self.pending_resets)
            sampling = tuple(SamplingRow(s.slot, s.params, tuple(s.prompt_ids), tuple(s.output_ids))
                             for s in self.pending_sampling if s.status == RUNNING and s.slot is not None)
            self.pending_resets, self.pending_sampling = [], []
        return Planned(Schedule(tuple(msgs), resets, sampling, self.eos_token_ids, self.rank), tuple(seqs))

    def _cache_ops(self, ops: list) -> list:
        if self.cache is None:
            return ops
        pre = self.cache.take_spills() + self.cache.take_saves() + self.pending_restores
        self.pending_restores = []
        # the plan is complete and goes to the runner as it is: its restores and saves now precede
        # anything a later eviction could dispatch, so nothing needs pinning any more (an idle or
        # paused engine then counts every cached page as free)
        self.cache.unpin_all()
        return pre + ops

    def active(self, s: Seq) -> bool:
        """Running, not waiting for a fork or a DSpark result, and not already at max_tokens / the
        context length."""
        if s.status != RUNNING or s.fork_src is not None or s.spec_inflight:
            return False
        mt = s.params.max_tokens
        if mt is not None and s.n_out >= mt and not (mt == 0 and s.num_cached < len(s.prompt_ids) - 1):
            return False  # (max_tokens=0 with prompt logprobs: active while prefilling)
        return s.total_len < self.context_length

    def decodable(self, s: Seq) -> bool:
        """In the one-token-per-step phase: the prompt's last token onwards. A resumed sample first
        *replays* its generated tokens here (rows that write the cache without sampling), so its
        cache is built by the same [B, 1] steps as when the tokens were generated: with one batch
        bucket the resumed sample's tokens are exactly those it gets without preemption."""
        return self.active(s) and s.num_cached >= len(s.prompt_ids) - 1

    def prefilling(self, s: Seq) -> bool:
        return self.active(s) and s.num_cached < len(s.prompt_ids) - 1

    def pick_victim(self) -> Optional[Seq]:
        """The running sample that arrived last (fork children waiting for their source excepted):
        the oldest sample is never preempted while another runs, so it always progresses."""
        cands = [s for s in self.running if s.fork_src is None]
        return max(cands, key=lambda s: s.priority) if cands else None

    def _decode_row(self, s: Seq) -> Row:
        """s's next one-token row: its newest token (sampled), or a replayed one (not sampled)."""
        self.allocator.ensure(s.key, s.num_cached + 1)
        sample = s.num_cached == s.total_len - 1
        from_prev = sample and s.n_inflight > 0
        tok = [] if from_prev else s.tokens(s.num_cached, s.num_cached + 1)
        return _Row(s, s.num_cached, 1, tok, from_prev, sample, s.n_out, self.allocator.pages(s.key), not sample)

    def _plan(self) -> Optional[list]:
        """This iteration's device work: launches (and fork copies between them), with the host state
        (num_cached, in-flight counts, pages) advanced as if they had run. None: a preemption is
        needed and the in-flight tokens must be read first."""
        dec_seqs = self._reserve_decode_pages()
        if dec_seqs is None:
            return None
        budget = self.args.max_prefill_tokens
        pre_rows = []
        self._room_blocked = False
        for s in sorted((s for s in self.running if self.prefilling(s)), key=lambda s: s.priority):
            if budget <= 0:
                break
            row = self._prefill_row(s, budget)
            if row is not None:
                pre_rows.append(row)
                budget -= row.n
        pre_rows += self._admit_waiting(budget)
        # forks: sources whose prompt (minus its last token) is now all dispatched
        fork_ops = []
        for r in pre_rows:
            if r.seq.num_cached == len(r.seq.prompt_ids) - 1:
                fork_ops += self._fork(r.seq)
                if self.cache is not None:  # prompt-end snapshot, saved right after this plan's prefill launch
                    self.cache.cache_insert(r.seq.key, r.seq.slot, r.seq.tokens(0, r.seq.num_cached), in_order=True)
            elif self.cache is not None and self._chunk_point(r.seq):  # a chunk-end or branch point
                branch = r.seq.num_cached == r.seq.branch_at
                self.cache.cache_insert(r.seq.key, r.seq.slot, r.seq.tokens(0, r.seq.num_cached), in_order=True,
                                        probation=not branch)
                if branch:
                    r.seq.branch_at = 0
        # (prompt-end saves go where fork copies go: right after the launch holding the prefill rows)
        cache_saves = self.cache.take_saves(in_order=True) if self.cache is not None else []
        dec_rows = self._decode_rows(dec_seqs, pre_rows, fork_ops)
        spec_rows = self._spec_rows(dec_rows)
        if spec_rows:
            picked = {id(r.seq) for r in spec_rows}
            dec_rows = [r for r in dec_rows if id(r.seq) not in picked]
        for r in dec_rows:
            r.seq.num_cached += 1
            if r.sample:
                r.seq.n_inflight += 1
            else:
                self.metrics.add("replayed_tokens")
        if not pre_rows and not dec_rows and not spec_rows:
            return self._unblock_prefills()
        ops = self._assemble(pre_rows, cache_saves + fork_ops, dec_rows)
        if spec_rows:
            ops.append(_Launch(spec_rows, _bucket(len(spec_rows), self.spec_batch_buckets), self.spec_gamma + 1, True))
        return ops

    def _reserve_decode_pages(self) -> Optional[list]:
        """Pages for every sample in the one-token phase, preempting the newest while the pool is
        short. Returns those samples (oldest first), or None when the in-flight tokens must be read
        before a preemption."""
        alloc = self.allocator
        while True:
            dec_seqs = [s for s in self.running if self.decodable(s)]
            need = sum(alloc.pages_needed(s.key, s.num_cached + 1) for s in dec_seqs)
            if need <= alloc.free_pages:
                break
            victim = self.pick_victim()
            if victim is None:
                break  # nothing to preempt (cannot happen with requests that fit): run those that fit
            if self._inflight:
                return None
            self.preempt(victim, "decode_pages")
        dec_seqs.sort(key=lambda s: s.priority)
        out = []
        for s in dec_seqs:
            if alloc.pages_needed(s.key, s.num_cached + 1) <= alloc.free_pages:
                alloc.ensure(s.key, s.num_cached + 1)
                out.append(s)
        return out

    def _admission_pages(self, members: list) -> int:
        """Pages a waiting sample (with its fork siblings) needs to be admitted: its whole prefill and
        replay plus its first new token (a fork sibling: its copy of the partial page), plus headroom
        for the share `reserve_ratio` of what the running samples may still generate, so that
        admissions rarely force a preemption."""
        s = members[0]
        need = self.allocator.pages_needed(None, s.total_len) + (len(members) - 1)
        future = sum(self.remaining(q) for q in self.running)
        return need + math.ceil(future * self.reserve_ratio / self.page_size)

    def remaining(self, s: Seq) -> int:
        """Tokens s may still generate (max_tokens, or up to the context length)."""
        room = self.context_length - s.total_len
        mt = s.params.max_tokens
        return max(0, room if mt is None else min(room, mt - s.n_out))

    def _admit_waiting(self, budget: int) -> list:
        """Admit waiting samples in priority order (a preempted one resumes before anything newer)
        while slots, prefill budget and pages allow; returns their first prefill chunks."""
        rows = []
        while self.waiting and budget > 0 and not self._room_blocked:  # blocked prefills go first
            head, s = self.waiting[0], self._next_waiting()
            members = self._fork_group(s) or [s]
            if len(self.free_slots) < len(members):
                break
            if self._admission_pages(members) > self.allocator.free_pages and self.running:
                break
            if self.allocator.pages_needed(None, s.total_len) + len(members) - 1 > self.allocator.free_pages:
                break  # (nothing running) pages held outside the scheduler: if it persists, `unstick` reports it
            for q in members:
                self.waiting.remove(q)
                self._admit(q)
            self._cache_hit(s)
            if s is not head:
                head.lpm_skips += 1
            # n > 1: siblings fork from s once it has prefilled; when the cache held all of it (s has
            # no prefill left to fork after), each restores the point itself (or prefills on a miss)
            whole = s.num_cached == len(s.prompt_ids) - 1
            for q in members[1:]:
                if whole:
                    self._cache_hit(q)
                else:
                    q.fork_src = s
            if len(s.prompt_ids) > 1:
                row = self._prefill_row(s, budget)
                if row is not None:
                    rows.append(row)
                    budget -= row.n
        return rows

    def _decode_rows(self, dec_seqs: list, pre_rows: list, fork_ops: list) -> list:
        """One-token rows: the samples that had pages reserved, plus (split launches) those whose
        prefill was just dispatched, whose next token runs in the decode launch after the prefill.
        (The host state is advanced by `_plan`, after DSpark picked its rows.)"""
        alloc = self.allocator
        rows = [self._decode_row(s) for s in dec_seqs]
        have = {id(s) for s in dec_seqs}
        if self.args.enable_mixed_chunk:  # one launch: a sample gets one row; fork copies run after it
            have |= {id(r.seq) for r in pre_rows} | {id(q) for op in fork_ops for q in op.seqs}
        for s in sorted(self.running, key=lambda s: s.priority):
            if (id(s) not in have and self.decodable(s)
                    and alloc.pages_needed(s.key, s.num_cached + 1) <= alloc.free_pages):
                rows.append(self._decode_row(s))
        return rows

    # ------------------------------------------------------------------------------------ DSpark
    def _may_speculate(self, s: Seq) -> bool:
        """The request's own reasons allow DSpark rows (see `can_speculate`). In the deterministic mode only
        greedy rows speculate: a sampled row's draws differ between a DSpark step and a plain one, and
        whether it can speculate at a step (host-known anchor) depends on the rest of the batch."""
        if getattr(self.runner, "deterministic", False) and not s.params.greedy:
            return False
        return (s.constraint is None or hasattr(s.constraint, "clone")) and s.params.logprobs is None

    def can_speculate(self, s: Seq) -> bool:
        """Whether s's next step may be a DSpark row (else it decodes plainly): DSpark is on; the row
        samples s's next token from a host-known anchor (not a replay, nothing in flight, at least one
        generated token — the first comes from the plain step after the prompt); it asks for no
        logprobs (the verify step returns none); a constraint, if any, can be cloned (the runner walks
        a clone through the drafts before verifying them, `DSparkSpeculator.grammar_masks`); and the γ+1 verify
        positions fit its context."""
        g = self.spec_gamma
        if g <= 0 or not self._may_speculate(s):
            return False
        if s.n_inflight or not s.output_ids or s.num_cached != s.total_len - 1:
            return False
        return s.num_cached + g + 1 <= self.max_context

    def _spec_rows(self, dec_rows: list) -> list:
        """Turn the decode rows that can speculate into DSpark rows, oldest first, while the pool has
        the pages of their verify window (start + γ + 1 tokens); the others stay plain."""
        if self.spec_gamma <= 0:
            return []
        alloc, g = self.allocator, self.spec_gamma
        out = []
        for r in sorted(dec_rows, key=lambda r: r.seq.priority):
            s = r.seq
            if not (r.sample and self.can_speculate(s)):
                continue
            if len(out) == self.spec_batch_buckets[-1]:
                break
            if alloc.pages_needed(s.key, s.num_cached + g + 1) > alloc.free_pages:
                continue  # no pages for the verify window: a plain step this iteration
            alloc.ensure(s.key, s.num_cached + g + 1)
            out.append(_Row(s, s.num_cached, g + 1, [s.output_ids[-1]], False, True, s.n_out, alloc.pages(s.key)))
            s.spec_inflight = True
        return out

    def spec_done(self, s: Seq, start: int, n_commit: int) -> None:
        """A DSpark row of s committed n_commit tokens (anchor + accepted drafts) at start..: advance
        the host state and give back the pages taken for rejected positions."""
        s.spec_inflight = False
        if s.status != RUNNING:
            return
        s.num_cached = start + n_commit
        self.allocator.truncate(s.key, s.num_cached)

    # ------------------------------------------------------------------------------------ helpers
    def _unblock_prefills(self) -> Optional[list]:
        """No row could run: the admitted prefills are blocked on pages others hold. Preempt the
        newest sample (after reading the in-flight tokens) and plan again; [] when nothing runs."""
        if not any(self.prefilling(s) for s in self.running):
            return []
        victim = self.pick_victim()
        if victim is None:
            return []
        if self._inflight:
            return None
        self.preempt(victim, "prefill_pages")
        return self._plan()

    def _assemble(self, pre_rows: list, fork_ops: list, dec_rows: list) -> list:
        if self.args.enable_mixed_chunk:
            return ([self._launch(dec_rows + pre_rows)] if dec_rows or pre_rows else []) + fork_ops
        ops: list = []
        if pre_rows:
            ops.append(self._launch(pre_rows))
        ops += fork_ops
        if dec_rows:
            ops.append(self._launch(dec_rows))
        return ops

    def _launch(self, rows: list) -> _Launch:
        T = _bucket(max(r.n for r in rows), self.token_buckets)
        B = _bucket(len(rows), self.batch_buckets)
        return _Launch(rows, B, T)

    def _prefill_row(self, s: Seq, budget: int) -> Optional[Row]:
        """The next chunk of s's prompt (all but its last token), within budget; advances
        s.num_cached. Chunks end at multiples of the chunk size, as when the sample runs alone (and
        at its branch point, if the prefix cache gave it one: see `_cache_hit`), and a chunk the pool
        has no room for waits whole (None; `_room_blocked` set) instead of being cut: same chunks,
        same numerics, whatever the pressure."""
        alloc = self.allocator
        n = min(len(s.prompt_ids) - 1 - s.num_cached, self.chunk_cap - s.num_cached % self.chunk_cap, budget)
        if s.branch_at > s.num_cached:  # the chunk ends at the branch point, whose state is saved there
            n = min(n, s.branch_at - s.num_cached)
        if n <= 0:
            return None
        if alloc.pages_needed(s.key, s.num_cached + n) > alloc.free_pages:
            self._room_blocked = True
            return None
        alloc.ensure(s.key, s.num_cached + n)
        row = _Row(s, s.num_cached, n, s.tokens(s.num_cached, s.num_cached + n), False, False, s.n_out,
                  alloc.pages(s.key))
        s.num_cached += n
        self.metrics.add("computed_prompt_tokens", n)
        return row

    def _fork_group(self, s: Seq) -> Optional[list]:
        """The n fresh samples of s's request to admit together with prompt sharing, or None (then
        they are admitted one by one: too many for the slots, or the prompt plus one page per
        sibling would not fit the pool even when empty)."""
        g = s.group
        if (g.n < 2 or s.index != 0 or s.ever_admitted or self.args.disable_prefix_sharing or s.want_plp
                or len(g.prompt_ids) < 2 or g.n > len(self.slots)
                or self.allocator.pages_needed(None, len(g.prompt_ids)) + g.n - 1 > self.allocator.capacity):
            return None
        if not all(q.status == WAITING and not q.ever_admitted for q in g.seqs):
            return None
        return list(g.seqs)

    def _next_waiting(self) -> Seq:
        """The sample to admit next: the queue head, except that with the prefix cache a fresh
        single sample among the first `_LPM_WINDOW` whose cached prefix is at least a page longer
        than the head's goes first (SGLang's longest-prefix-match policy, bounded): it needs that
        much less prefill, so the same budget admits more. A preempted sample, an n > 1 group and a
        head already passed over `_LPM_MAX_SKIPS` times are never overtaken (no starvation)."""
        s = self.waiting[0]
        if (self.cache is None or s.ever_admitted or s.group.n > 1 or s.lpm_skips >= _LPM_MAX_SKIPS
                or len(self.waiting) < 2):
            return s
        best, best_k = s, self._cached_len(s)
        for q in itertools.islice(self.waiting, 1, _LPM_WINDOW):
            if q.ever_admitted or q.group.n > 1:
                continue
            k = self._cached_len(q)
            if k >= best_k + self.page_size:
                best, best_k = q, k
        return best

    def _cached_len(self, s: Seq) -> int:
        if s.want_plp:
            return 0
        e = self.cache.tree.longest(s.tokens(0, s.total_len - 1))
        return e.k if e is not None else 0

    def _cache_hit(self, s: Seq) -> None:
        """A just-admitted sample resumes from the deepest cached state its known tokens (minus the
        last, whose logits start it) extend: pages shared, slot rows restored before its first
        launch. Not for prompt-logprob samples: every prompt position must be scored, so they
        prefill from 0 (as vLLM skips its prefix cache for them); they still leave points behind.

        Branch point: when the prompt shares more with the tree than the deepest point gives (a
        shared system prompt followed by another question: the tree's path goes on with an earlier
        request's tokens), the sample saves its own state at the last page boundary of the shared
        part while it prefills (a chunk ends there; an in-order save right after it), so the next
        request with that prefix resumes there."""
        s.cached_tokens = s.branch_at = 0
        if s.prefilled is not None:
            self._import(s)
            return
        if self.cache is None:
            return
        query = s.tokens(0, s.total_len - 1)
        k = 0
        if not s.want_plp:
            k, op = self.cache.cache_match(s.key, s.slot, query)
            if op is not None:
                s.num_cached = k
                s.cached_tokens = min(k, len(s.prompt_ids))
                self.pending_restores.append(op)
                self.metrics.add("cached_prompt_tokens", s.cached_tokens)
        n_pre = len(s.prompt_ids) - 1
        b = min(self.cache.tree.shared_len(query), n_pre) // self.page_size * self.page_size
        if s.num_cached < b < n_pre:
            s.branch_at = b

    def _import(self, s: Seq) -> None:
        """A just-admitted sample that comes with its prefilled state (`handover`): pages for its
        prompt, an `ImportOp` writing the state into them and its slot; it then decodes from its first
        token (a resumed one replays its generated tokens from there) and prefills nothing."""
        n = len(s.prompt_ids)
        self.allocator.ensure(s.key, n)
        pages = self.allocator.pages(s.key)[:-(-n // self.page_size)]
        self.pending_imports.append(ImportOp(s.slot, tuple(pages), s.prefilled))
        s.num_cached = n
        self.metrics.add("imported_prompt_tokens", n)

    def _chunk_point(self, s: Seq) -> bool:
        """Whether s's prefill chunk just planned ends at a point the prefix cache keeps: its branch
        point (`_cache_hit`) or any page boundary (chunks end at multiples of the chunk size, so with
        the default sizes every chunk end is one). Points at chunk ends make a shared prefix hit from
        its first repeat: the second request with a system prompt resumes from the last chunk end
        inside it (and saves its own branch point at the prompt's last page boundary for the rest)."""
        k = s.num_cached
        return k > 0 and (k == s.branch_at or k % self.page_size == 0)

    def _cache_insert(self, s: Seq) -> None:
        """Keep s's state at num_cached in the prefix cache (before its pages are freed), when it is
        well defined: its slot holds s's rows for every token < num_cached and the host knows those
        tokens (a DSpark row or a fork copy in flight, or a slot admitted in the plan being made
        whose reset / restore is not dispatched yet, would make the snapshot wrong: skipped)."""
        k = s.num_cached
        if (self.cache is None or s.slot is None or s.fork_src is not None or s.spec_inflight or k < 1
                or k > len(s.prompt_ids) + len(s.output_ids) or s.slot in self.pending_resets
                or not self.allocator.has(s.key)):
            return
        self.cache.cache_insert(s.key, s.slot, s.tokens(0, k))

    def _admit(self, s: Seq) -> None:
        s.status = RUNNING
        s.slot = self.free_slots.pop()
        s.num_cached = 0
        s.ever_admitted = True
        self.running.append(s)
        self.pending_resets.append(s.slot)
        self.pending_sampling.append(s)

    def preempt(self, s: Seq, reason: str) -> None:
        """Back to the queue (in priority order); resumes later by prefilling its prompt and replaying
        its generated tokens. Counted per reason."""
        assert s.n_inflight == 0 and not s.spec_inflight and reason in PREEMPTION_REASONS
        log.info("preempting %s#%d (%s: %d tokens cached, %d generated; %d/%d pages used)", s.group.rid, s.index,
                 reason, s.num_cached, len(s.output_ids), self.allocator.used_pages, self.allocator.capacity)
        self.metrics.preempted(reason)
        self.reserve_ratio = min(1.0, self.reserve_ratio + _RESERVE_BUMP)
        s.num_preemptions += 1
        self.release(s)
        s.status = WAITING
        s.num_cached = 0
        self.orphan_children(s)
        self._requeue(s)

    def decode_iteration_done(self) -> None:
        """A decode iteration was processed: admissions may be a little more eager again."""
        self.reserve_ratio = max(_RESERVE_MIN, self.reserve_ratio - _RESERVE_DECAY)

    def _requeue(self, s: Seq) -> None:
        """Insert s into the waiting queue by priority (the queue stays sorted: new arrivals are
        appended and are younger than anything ever admitted)."""
        i = 0
        for i, q in enumerate(self.waiting):
            if q.priority > s.priority:
                break
        else:
            i = len(self.waiting)
        self.waiting.insert(i, s)

    def orphan_children(self, s: Seq) -> None:
        """Fork children still waiting for s: they prefill the prompt themselves."""
        for q in s.group.seqs:
            if q.fork_src is s:
                q.fork_src = None
                if q.status == RUNNING and q.slot is not None:
                    q.num_cached = 0
                    self.pending_resets.append(q.slot)

    def release(self, s: Seq) -> None:
        """Free s's pages and slot (it finished, was aborted or preempted); ``on_release`` sees s first."""
        if self.on_release is not None:
            self.on_release(s)
        if s in self.running:
            self.running.remove(s)
        if s.status == WAITING:
            self.remove_waiting(s)
        self._cache_insert(s)
        self.allocator.free(s.key)
        if s.slot is not None:
            self.free_slots.append(s.slot)
            s.slot = None

    def stuck_victim(self) -> Seq:
        """The sample to fail when the scheduler had work and no move (see `Engine._unstick`)."""
        s = self.pick_victim() if self.running else self.waiting[0]
        return s if s is not None else self.running[-1]

    def _fork(self, src: Seq) -> list:
        """src has (in this iteration's launches) prefilled its prompt minus the last token: give its
        waiting siblings the same cache (full pages shared, the partial page copied, slot rows
        copied). Returns the device copies to dispatch after the launch."""
        alloc, ps = self.allocator, self.page_size
        k = src.num_cached
        n_full = k // ps
        src_pages = alloc.pages(src.key)
        ops = []
        for q in src.group.seqs:
            if q.fork_src is not src:
                continue
            q.fork_src = None
            if k % ps and alloc.free_pages < 1:
                q.num_cached = 0
                self.pending_resets.append(q.slot)
                log.info("fork of %s#%d: no free page for the partial page; it prefills itself", q.group.rid,
                         q.index)
                continue
            alloc.share(src.key, q.key, n_full)
            src_page = dst_page = 0
            if k % ps:
                alloc.ensure(q.key, k)
                src_page, dst_page = src_pages[n_full], alloc.pages(q.key)[n_full]
            ops.append(_Fork(ForkOp(src.slot, q.slot, src_page, dst_page), [q]))
            q.num_cached = k
            self.metrics.add("shared_prompt_tokens", k)
            self.metrics.add("num_forks")
        return ops
