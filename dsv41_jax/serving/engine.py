"""The serving engine: continuous batching over the paged cache.

`Engine` is the public front (`add_request`, `abort_request`, `step`, `run_until_done`, `stats`) over
three parts, each in its own module:

- `scheduler.Scheduler` decides what runs (admission, chunked-prefill budget, preemption, prompt
  sharing, which rows speculate); host-only, model-free (its unit tests use a mock runner);
- `runner.Runner` owns the device state (params, cache pytree, page allocator, sampling tensors) and
  launches the jitted steps: plain [B, T] extend + sampling, and DSpark [B, γ+1] verify steps;
- `output.OutputProcessor` turns launch results into tokens, text (`tokenizer.IncrementalDetokenizer`,
  the one detokenizer; the server uses its text), stops, constraints, logprobs, `RequestOutput`s
  and metrics.

The data they share (requests, samples, outputs, errors) is in `request`. They talk in messages
(`messages`): the scheduler's plan is a frozen `messages.Schedule` (rows as ints and tuples, no `Seq`),
`Runner.execute` returns a frozen `messages.StepResult`, and the output processor reads it into the
samples the scheduler planned the rows for (`scheduler.Planned`). Control flows one way: when the
scheduler needs the tokens still in flight (a preemption, a constraint mask, a DSpark anchor), it
says so (`Scheduler.needs_results`, or `schedule` returning None) and the engine reads them first.
One *scheduler iteration* per `Engine.step()`:

1. **Schedule** (host). Running sequences each contribute one row: a decode row (the newest token,
   position ``num_cached``) or a prefill chunk (at most ``chunked_prefill_size`` tokens, all rows
   together at most ``max_prefill_tokens``). Waiting sequences are admitted in arrival order
   (a preempted one resumes before anything newer) while slots (``max_running_requests``), prefill
   budget and pages allow: a sample is admitted only when the pool holds its whole prefill plus one
   page of headroom per running sample. When decode rows need pages the pool does not have
   (reason "decode_pages"), or no row can run because the admitted prefills are blocked on pages
   ("prefill_pages"), the sample that arrived last is **preempted**: its pages and slot are freed,
   it goes back to the queue, and later resumes by prefilling its prompt and then *replaying* its
   generated tokens as one-token rows that write the cache without sampling, so its cache is built
   by the same ``[B, 1]`` steps as the first time: greedy tokens are exactly those without
   preemption in the fp32 mode (given one batch bucket); with sampling the per-request key stream
   continues at the same token index and the penalty counts are rebuilt from the generated tokens.
   (The price of exact resumption: a replay takes one step per generated token, as a row of the
   decode batch, where a chunked recompute would take a few prefill launches. Measured on the tiny
   model, pool 1,024, 8 x (220-400 + 160 greedy tokens): recomputing generated tokens in prefill
   chunks left 7 of 8 requests equal to alone, the other flipping at token 137 with a top-2 gap of
   0.038 nats (an fp8 activation code changed with the executable, not a near-tie); replay: 8 of 8.)
   The oldest sample is never preempted while another runs, and `add_request` refuses (`EngineError`,
   HTTP 400) any request whose samples could not each fit the pool alone (prompt + max_tokens over
   context_length, which the memory plan caps at the pool), so every accepted request finishes:
   nothing is aborted for lack of memory. Preemptions are counted per reason (`Engine.preemptions`,
   the decode log line, ``/metrics``).
2. **Dispatch** (device, asynchronous). Decode rows run as one ``[B, 1]`` launch and prefill chunks
   as one ``[B, T]`` launch in the same iteration (``--enable-mixed-chunk``: one ``[B, T]`` launch
   holding both), B and T rounded up to the compiled buckets; every bucket is compiled in the
   warm-up, so steady-state serving never compiles. Rows whose chunk ends at the newest token are
   sampled on the device (`sampling.sample` on the rows gathered from the per-slot tensors; the
   constraint mask, if any, is applied to the logits first); the sampled tokens are scattered into
   a per-slot ``last_token`` array and into the penalty counts, on the device.
3. **Process** (host). Tokens are read back, detokenized incrementally, stop conditions checked,
   outputs emitted, finished sequences release their pages and slot.

DSpark speculative decoding (``--speculative-algorithm DSPARK``, `runner` / `speculative`): a decode
row that can speculate (`Scheduler.can_speculate`: host-known anchor, no logprobs, a constraint only
if it can be cloned, γ+1 positions within its context, pages for them) runs in a [B, γ+1] DSpark launch instead of the [B, 1]
one: the draft proposes γ tokens, the target verifies them in one forward, and the row commits
n_accept + 1 tokens (rows of one launch accept different numbers). The output processor appends them
one at a time, so stop tokens / strings, max_tokens and the context length cut at the right token;
the pages of rejected positions go back (`PageAllocator.truncate`). A constrained row's drafts are
checked by its grammar before verification (`DSparkSpeculator.grammar_masks`): the verify rows are masked up to
the first draft the grammar rejects, so no disallowed token is ever accepted. The next step's positions depend
on the accept lengths, so a sample with a DSpark row in flight is read before it is planned again
(overlap is kept for everything else). Greedy with DSpark gives exactly the tokens of greedy without
in the exact numerics mode (tests/test_engine_dspark.py); accept length and rate are in the decode log
line, `stats()` and ``/metrics``.

Host/device overlap ("overlap schedule", as SGLang's): with JAX's async dispatch, iteration k's
launches are enqueued *before* the host blocks on iteration k−1's tokens. A decode row whose input
token has not been read yet takes it on the device from ``last_token[slot]`` (a tiny jitted
gather), so building iteration k needs only host-known facts (positions, page tables, counts).
The host therefore detokenizes / checks stops / emits for k−1 while the device computes k. A
sequence that stopped at k−1 (stop token or string) has one wasted row in k, which is ignored; its
pages and slot are freed only when k−1 is processed, and any reuse is dispatched after k, so device
order keeps it safe. The engine synchronises (reads k−1 first) only when it must: before a
preemption (the resumed sequence needs all its tokens) and for rows with a constraint (the mask
depends on the previous token). ``--disable-overlap-schedule`` reads every iteration's tokens
before the next is prepared.

Prompt logprobs (``SamplingParams.prompt_logprobs``, for ``echo`` + ``logprobs`` scoring): a launch
holding a prefill chunk of such a sample runs the **all-logits** variant of the extend step
(``decode.jitted_extend(cfg, ccfg, True)``, compiled per (B, T) bucket in the warm-up with
``--warmup-prompt-logprobs``, else lazily on the first launch that needs it), and reduces its fp32
``[B, T, V]`` logits on the device (`_prompt_logprobs`) to the log-softmax of each next prompt
token ``[B, T]`` and the top ``max_logprobs`` ``[B, T, K]``; only those come back to the host. Prefill chunks cover positions
``0 .. len(prompt) - 2``, i.e. exactly the predictions of prompt tokens ``1 .. len(prompt) - 1``; the
last prompt token's row samples as usual. Such a sample never shares its prompt by forking (it
prefills itself), and ``max_tokens=0`` ends it ("length") once its prompt logprobs are read. With
``--enable-decoder-swa-bounded-replay`` (SWA bounded replay: prefill's late layers run only each
prompt's last sliding_window tokens, `decode.extend_bounded`) there are no exact prompt logits, so
`add_request` refuses such requests (`EngineError`: HTTP 400), saying why.

Prefill/decode disaggregation (`handover`): a prefill engine runs a request with ``handover=True``
(max_tokens = 1): when its first token is read and it finishes, `_on_release` exports its state (pages
of compressed latents and index keys, the slot's rows with the DSpark rings) into the final output's
``prefilled_state`` before the pages are freed. A decode engine takes it with ``prefilled=``: the
prefill engine's first token is appended at once, and on admission the scheduler gives the sample
pages for its prompt and an `ImportOp` (dispatched before the plan's launches) writes the state into
them and its slot; its next row is the first token's decode (or DSpark) row. Nothing is prefilled
(``imported_prompt_tokens`` counts the prompt instead of ``computed_prompt_tokens``); a preempted
sample re-imports the state (kept on the host until it finishes) and replays its generated tokens.

If the engine itself must end a request (a scheduler fault), the sample finishes with reason
"error" and `RequestOutput.error` says why; `AsyncEngine` turns it into `EngineInternalError`
(HTTP 500 / a stream error event), never a truncated success.

n > 1 shares the prompt: the n samples are admitted together; sample 0 prefills the prompt minus
its last token, then the others are **forked**: the full pages are shared (reference counted in
`SharedPageAllocator`), the partially filled last page is copied to a fresh page, and the slot
state (window rings, partial compressor groups, Engram history) is copied by one jitted
`_fork_slot`; then each sample feeds the last prompt token itself and samples with its own seed
(``seed + j``). If the pool has no page for the copy, that sample prefills the prompt itself.

Data-parallel attention (``--enable-dp-attention --dp-size D``): the runner splits the slots, the KV
pool, the snapshot rows and the prefix cache into D rank blocks, and the scheduler is a
`dp_controller.DPController` — one `Scheduler` per rank, a request routed to one rank
(``--load-balance-method``), each step's rank plans merged into rank-major launches of D x a rank's
batch bucket. Everything above works per rank; ``stats()`` adds ``dp_ranks`` (per-rank load).

Multi-process (``jax.distributed``, `multihost`): process 0 runs this engine and sends each `Schedule`
to the other processes before executing it; they only execute (`follow`) until the leader's `shutdown`.

Constraints (for grammar-constrained decoding): any object with ``allowed_mask() -> bool [V] |
None`` (None = unconstrained this step), ``accept(token_id)`` and ``is_done() -> bool``; with n > 1
it must also have ``clone()``. The mask is applied on the device; ``is_done()`` ends the request
with finish reason "stop".
"""

from __future__ import annotations

import logging
import random
import time
from typing import Optional, Sequence, Union

from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.engine_metrics import CacheLoads, EngineMetrics  # noqa: F401  (CacheLoads: engine.CacheLoads)
from dsv41_jax.serving.output import OutputProcessor
from dsv41_jax.serving.request import (FINISHED, PREEMPTION_REASONS, RUNNING, WAITING, CompletionOutput,  # noqa: F401
                                       EngineError, EngineInternalError, Group, QueueFullError, RequestOutput, Seq)
from dsv41_jax.serving.runner import Runner, SharedPageAllocator
from dsv41_jax.serving.runner_api import RUNNER_MEMBERS, RunnerProtocol
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.scheduler import Scheduler
from dsv41_jax.serving.tokenizer import IncrementalDetokenizer

# The one wording of the refusal (engine, LLM and the server's 400 all carry it).
BOUNDED_REPLAY_PLP_REFUSAL = ("prompt_logprobs: refused with --enable-decoder-swa-bounded-replay: its prefill runs "
                              "the late layers only on each prompt's last sliding_window tokens, so the other prompt "
                              "positions have no logits and the tail's are approximate (not equal to full prefill); "
                              "start the server without that flag to score prompts")

__all__ = ["BOUNDED_REPLAY_PLP_REFUSAL", "CompletionOutput", "Engine", "EngineError", "EngineInternalError",
           "QueueFullError", "RequestOutput",
           "SharedPageAllocator", "PREEMPTION_REASONS"]

log = logging.getLogger("dsv41_jax.engine")


class Engine:
    """The engine front (see the module docstring). Single-threaded: call `add_request`,
    `abort_request` and `step` from one thread (`AsyncEngine` runs it in a background thread).

    ``runner``: a ready runner (e.g. a model-free mock in the scheduler's tests) instead of building
    `Runner(args, cfg=cfg, params=params)`; it must implement `runner_api.RunnerProtocol` (checked)."""

    def __init__(self, args: Optional[EngineArgs] = None, *, cfg=None, params=None, tokenizer=None, runner=None,
                 **kw):
        if args is None:
            args = EngineArgs.from_kwargs(**kw)
        elif kw:
            args = args.replace(**kw)
        self.args = args
        t0 = time.perf_counter()
        self.runner = runner if runner is not None else Runner(args, cfg=cfg, params=params)
        r = self.runner
        if not isinstance(r, RunnerProtocol):
            missing = [n for n in RUNNER_MEMBERS if not hasattr(r, n)]
            raise TypeError(f"Engine: the runner lacks {', '.join(missing)} (runner_api.RunnerProtocol)")
        if tokenizer is None:
            from dsv41_jax.serving.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        if tokenizer.vocab_size > r.vocab_size:
            raise EngineError(f"tokenizer has {tokenizer.vocab_size} tokens, more than vocab_size={r.vocab_size}")
        self.load_time = getattr(r, "load_time", time.perf_counter() - t0)
        self.context_length = r.context_length
        self.vocab_size = r.vocab_size
        self.max_logprobs = r.max_logprobs
        # data-parallel attention (`dp_controller`): the runner's ranks; launches hold dp x a rank's rows
        self.dp = getattr(getattr(r, "ccfg", None), "dp", 1)
        if self.dp != args.dp_size:
            raise EngineError(f"the runner has {self.dp} dp ranks, the arguments ask for dp_size={args.dp_size}")
        rank_buckets = args.rank_batch_buckets() if self.dp > 1 else args.resolved_batch_buckets()
        self.batch_buckets = [self.dp * b for b in rank_buckets]  # (dp = 1: resolved_batch_buckets)
        self.token_buckets = args.resolved_token_buckets()
        self.overlap = not args.disable_overlap_schedule
        self.spec_gamma = r.spec_gamma

        self.metrics = EngineMetrics()  # the one owner of the counters (scheduler, output and engine count into it)
        self._pending: list = []  # [(Planned, StepResult)] executed, results not read yet (the overlap schedule)
        sched_kw = dict(context_length=self.context_length, batch_buckets=rank_buckets,
                        token_buckets=self.token_buckets, metrics=self.metrics, spec_gamma=self.spec_gamma,
                        eos_token_ids=self.eos_token_ids, on_release=self._on_release)
        if self.dp > 1:  # one scheduler per rank behind the DP controller (routing, rank-major launches)
            from dsv41_jax.serving.dp_controller import DPController, PoolTotals

            self._pool = PoolTotals(r.allocators)
            self.scheduler = DPController(args, r, method=args.resolved_load_balance_method, **sched_kw)
            log.info("data-parallel attention: %d ranks of %d slots, load balance %s", self.dp,
                     r.max_slots // self.dp, args.resolved_load_balance_method)
        else:
            self._pool = r.allocator
            self.scheduler = Scheduler(args, r, **sched_kw)
        self.output = OutputProcessor(self.scheduler, self._pool, page_size=r.allocator.page_size,
                                      context_length=self.context_length, eos_token_ids=self.eos_token_ids,
                                      metrics=self.metrics, decode_log_interval=args.decode_log_interval,
                                      spec_gamma=self.spec_gamma)
        self._group_counter = 0
        self._rng = random.Random(args.random_seed)
        self._iter = 0
        self.warmup_time = 0.0
        self.warmup_shapes = 0
        self.warmup_cache_loads = 0
        self.last_step: dict = {}
        if self.spec_gamma:
            if args.speculative_algorithm in ("EAGLE", "NEXTN"):
                log.info("MTP speculative decoding (%s): a top-1 chain of γ = %d drafts per step from DeepSeek-V4's "
                         "MTP layer%s", args.speculative_algorithm, self.spec_gamma,
                         "; the overlap schedule waits for speculative rows" if self.overlap else "")
            else:
                log.info("DSpark speculative decoding: γ = %d proposals per step (of the checkpoint's %s)%s",
                         self.spec_gamma, getattr(getattr(r, "cfg", None), "dspark_block_size", "?"),
                         "; the overlap schedule waits for DSpark rows" if self.overlap else "")
        if not args.skip_server_warmup:
            self.warmup()

    # ------------------------------------------------------------------------------------ parts
    @property
    def preemptions(self) -> dict:
        """Preemptions per reason (the /metrics counter), from `EngineMetrics`."""
        return self.metrics.preemptions

    @property
    def allocator(self):
        """The page allocator (with dp ranks: `dp_controller.PoolTotals`, the ranks' pools as one)."""
        return self._pool

    def _allocator_of(self, s: Seq):
        """The page allocator of s's dp rank."""
        return getattr(self.runner, "allocators", [self.runner.allocator])[s.group.dp_rank]

    @property
    def prefix_cache(self):
        """The radix prefix cache's controller (`prefix_cache.PrefixCache`), or None when it is off."""
        return self.runner.prefix_cache

    @property
    def cfg(self):
        return self.runner.cfg

    @property
    def params(self):
        return self.runner.params

    def num_compilations(self) -> int:
        """Compiled variants held by the jitted functions the runner calls (extend, DSpark step,
        sampling, helpers)."""
        return self.runner.num_compilations()

    def warmup(self) -> None:
        """Compile every (batch, tokens) bucket (and the DSpark step per batch bucket) and the helpers.
        The log line says how many of those programs XLA compiled and how many were loaded from the
        persistent compilation cache (a warm restart compiles nothing)."""
        t0 = time.perf_counter()
        n0 = self.num_compilations()
        kw = {"prompt_logprobs": True} if self.args.warmup_prompt_logprobs else {}
        with CacheLoads() as loads:
            self.warmup_shapes = self.runner.warmup(self.batch_buckets, self.token_buckets, **kw)
        self.warmup_time = time.perf_counter() - t0
        programs = self.num_compilations() - n0
        self.warmup_cache_loads = min(loads.count, programs)
        log.info("warm-up done: %d shapes, %d programs (%d compiled, %d loaded from the compilation cache) in %.1fs",
                 self.warmup_shapes, programs, programs - self.warmup_cache_loads, self.warmup_cache_loads,
                 self.warmup_time)

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Union[str, Sequence[int], None] = None,
                    sampling_params: Optional[SamplingParams] = None, *, prompt_token_ids=None, constraint=None,
                    output_kind: str = "final", arrival_time: Optional[float] = None,
                    drop_token_ids: Sequence[int] = (), handover: bool = False, prefilled=None) -> None:
        """Queue a request. `prompt` is text (tokenized without special tokens) or token ids.
        output_kind "final": one output when the request finishes (cumulative); "delta": an output
        after every step that produced something (new text / tokens only). drop_token_ids: token ids
        left out of the text (the server's choice while it keeps special tokens; see `IncrementalDetokenizer`).

        Prefill/decode disaggregation (`handover`): ``handover=True`` (a prefill engine; needs n = 1 and
        max_tokens = 1) exports the request's state when it finishes, in its final output's
        ``prefilled_state``; ``prefilled=`` that `handover.PrefilledState` (a decode engine; the same
        prompt) starts the request from it: the state is written into this engine's pages on
        admission, the first token is the prefill engine's, and nothing is prefilled here. A state that
        does not fit this engine (layout, prompt) raises `handover.HandoverError` (an EngineError)."""
        if self.is_follower:
            raise EngineError("this process follows a multi-process engine: requests go to process 0 (the leader)")
        if request_id in self.output.groups:
            raise EngineError(f"request_id {request_id!r} is already in use")
        if output_kind not in ("final", "delta"):
            raise ValueError(f"output_kind: 'final' or 'delta', got {output_kind!r}")
        p = sampling_params or SamplingParams()
        p.validate(max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        if p.prompt_logprobs is not None and self.args.enable_decoder_swa_bounded_replay:
            raise EngineError(BOUNDED_REPLAY_PLP_REFUSAL)
        text = None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                text = prompt
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is None:
                raise EngineError("prompt: give text or token ids")
            else:
                prompt_token_ids = prompt
        else:
            text = prompt if isinstance(prompt, str) else None
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise EngineError("prompt: must contain at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise EngineError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if len(ids) >= self.context_length:
            raise EngineError(f"prompt: {len(ids)} tokens leave no room in context_length={self.context_length}")
        if constraint is not None and p.n > 1 and not hasattr(constraint, "clone"):
            raise EngineError("constraint: n > 1 needs a constraint with clone()")
        if handover or prefilled is not None:
            p = self._check_handover(ids, p, handover, prefilled)
        self._check_fits(ids, p)
        g = Group(request_id, text, ids, p, p.n, output_kind, arrival_time or time.time(), self._group_counter)
        g.handover = handover
        self._group_counter += 1
        children = p.child_params() if p.n > 1 else [p]
        for j, cp in enumerate(children):
            if cp.seed is None:
                cp = cp.replace(seed=self._rng.getrandbits(63))
            det = IncrementalDetokenizer.for_params(self.tokenizer, ids, cp, drop_token_ids)
            con = constraint if j == 0 or constraint is None else constraint.clone()
            g.seqs.append(Seq(g, j, cp, det, con))
        self.output.groups[request_id] = g
        self.metrics.add("prompt_tokens", len(ids))
        if prefilled is not None:  # the prefill engine's first token, then (unless it ends it) decode from the state
            s = g.seqs[0]
            s.prefilled = prefilled
            self.metrics.add("handovers_imported")
            self.metrics.add("handover_bytes_imported", prefilled.nbytes)
            self.output.append_token(s, prefilled.first_token, prefilled.first_logprob, prefilled.first_top,
                                     time.perf_counter())
            if s.status != FINISHED:
                self.scheduler.add(g.seqs)
            return
        if p.max_tokens == 0 and len(ids) == 1:  # nothing to compute: the first token has no logprob
            for s in g.seqs:
                self.output.finish(s, "length")
        else:
            self.scheduler.add(g.seqs)

    def _check_handover(self, ids: list, p: SamplingParams, handover: bool, prefilled) -> SamplingParams:
        """Refuse a handover request this engine cannot serve as asked (`add_request`); returns its
        sampling parameters (a decode request without a seed continues the prefill engine's)."""
        from dsv41_jax.serving.handover import HandoverError, check_layout

        if handover and prefilled is not None:
            raise EngineError("handover and prefilled: a request is either prefilled here or decoded here")
        if getattr(self.runner, "processes", 1) > 1:
            raise EngineError("prefill/decode handover: not supported by a multi-process engine (the state lives "
                              "on every process's devices)")
        if p.n != 1:
            raise EngineError("prefill/decode handover: n must be 1")
        if p.prompt_logprobs is not None:
            raise EngineError("prefill/decode handover: prompt_logprobs are not carried over")
        if handover:
            if p.max_tokens != 1:
                raise EngineError(f"handover: the prefill engine samples exactly the first token (max_tokens=1), "
                                  f"got max_tokens={p.max_tokens}")
            return p
        if list(prefilled.prompt_ids) != ids:
            raise HandoverError(f"prefilled state: it covers another prompt ({len(prefilled.prompt_ids)} tokens) "
                                f"than this request's ({len(ids)} tokens)")
        if p.logprobs is not None and (prefilled.first_logprob is None or
                                       len(prefilled.first_top or ()) < p.logprobs):
            raise HandoverError("prefilled state: the request asks for logprobs the prefill engine did not record")
        check_layout(prefilled, self.runner.handover_layout())
        n_pages = -(-len(ids) // self.allocator.page_size)
        if len(prefilled.pages) != n_pages:
            raise HandoverError(f"prefilled state: {len(prefilled.pages)} pages for a {len(ids)}-token prompt, "
                                f"which fills {n_pages} pages of {self.allocator.page_size} tokens (truncated?)")
        return p if p.seed is not None else p.replace(seed=prefilled.seed)

    def _on_release(self, s: Seq) -> None:
        """A handover request that finished (its first token sampled): export its state (pages and slot
        still hold it) for the final output, before the scheduler frees them."""
        g = s.group
        if not g.handover or s.finish_reason not in ("stop", "length") or s.slot is None:
            return
        from dsv41_jax.serving.handover import PrefilledState

        n = len(s.prompt_ids)
        pages = self._allocator_of(s).pages(s.key)[:-(-n // self.allocator.page_size)]
        if s.num_cached < n or len(pages) * self.allocator.page_size < n:
            return  # (cannot happen: the first token is sampled after the whole prompt) no state: no handover
        data = self.runner.export_slot(s.slot, pages)
        want_lp = s.params.logprobs is not None
        g.handover_state = PrefilledState(list(s.prompt_ids), s.output_ids[0], s.params.seed, data["rows"],
                                          data["pages"], s.lps[0] if want_lp else None,
                                          list(s.tops[0]) if want_lp else None)
        self.metrics.add("handovers_exported")
        self.metrics.add("handover_bytes_exported", g.handover_state.nbytes)

    def _check_fits(self, ids: list, p: SamplingParams) -> None:
        """Refuse, at admission, a request that could never run to its end: every sample must fit
        the KV pool alone (prompt + max_tokens within context_length, which the memory plan caps at
        the pool's size), so the scheduler can always finish it by preempting others; a request
        accepted here is never cut short for lack of memory. (n > 1 needs nothing more: the samples
        are admitted together only when the pool has room, else they run one by one.)"""
        if p.max_tokens is None:
            return  # runs to the context length ("length"), which fits by construction
        total = len(ids) + p.max_tokens
        if total > self.context_length:
            pool = self.allocator.capacity * self.allocator.page_size
            raise EngineError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) = {total} tokens exceeds "
                              f"this engine's per-request limit of {self.context_length} tokens (context_length; "
                              f"the KV pool holds {pool}); reduce the prompt or max_tokens")

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request: its pages and slots are freed at once; an "abort" output is emitted."""
        g = self.output.groups.get(request_id)
        if g is None or g.finished:
            return False
        for s in g.seqs:
            if s.status == WAITING:
                self.scheduler.remove_waiting(s)
            if s.status != FINISHED:
                self.output.finish(s, "abort")
        self.metrics.add("requests_aborted")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending or self.output.touched)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------------------------ processes
    @property
    def is_follower(self) -> bool:
        """A follower process of a multi-process engine (`multihost`): it takes no requests, it runs `follow`."""
        return getattr(self.runner, "is_follower", False)

    def follow(self) -> int:
        """A follower's loop: execute the leader's schedules until its shutdown; the number executed."""
        return self.runner.follow()

    def shutdown(self) -> None:
        """Release what outlives the engine's steps: a multi-process leader stops its followers."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list:
        """One scheduler iteration; returns the `RequestOutput`s produced. The scheduler's plan goes to the
        runner as a frozen `messages.Schedule`; the runner's `messages.StepResult` is read by the output
        processor now (``--disable-overlap-schedule``) or one iteration later (the overlap schedule)."""
        self._iter += 1
        n_processed = self.output.n_processed
        if self._pending and self.scheduler.needs_results():
            self._read_pending()  # a constraint mask or a DSpark row depends on the tokens in flight
        planned = self.scheduler.schedule(inflight=bool(self._pending))
        if planned is None:  # a preemption needs the in-flight tokens first
            self._read_pending()
            planned = self.scheduler.schedule()
        sched = planned.schedule
        launches = sched.launches
        done = []
        if sched:
            launches_before = self.runner.launches
            result = self.runner.execute(sched)
            if launches:  # (a schedule of copies alone has nothing to read)
                done = [(planned, result)]
            self.metrics.add("launches", self.runner.launches - launches_before)
        self.last_step = {"launches": [(L.B, L.T) for L in launches],
                          "prefill_tokens": sum(r.n for L in launches if not L.spec for r in L.rows
                                                if not (r.sample or r.replay)),
                          "replay_rows": sum(1 for L in launches for r in L.rows if r.replay),
                          "decode_rows": sum(1 for L in launches for r in L.rows if r.sample),
                          "spec_rows": sum(1 for L in launches if L.spec for r in L.rows if r.n)}
        if self.overlap:
            done, self._pending = self._pending, done
        self.output.process(done)
        if (not launches and not self._pending and self.output.n_processed == n_processed
                and (self.scheduler.running or self.scheduler.waiting)):
            self._unstick()  # nothing ran, nothing was read: the plan saw the current state and had no move
        self.metrics.add("steps")
        return self.output.emit()

    def run_until_done(self) -> list:
        out = []
        while self.has_unfinished():
            out += self.step()
        return out

    def _read_pending(self) -> None:
        """Read the in-flight results now (before a preemption, a constraint mask or a DSpark row)."""
        done, self._pending = self._pending, []
        self.output.process(done)

    def _unstick(self) -> None:
        """The scheduler had work, saw the current state and found no move. With requests checked by
        `_check_fits` this cannot happen (the oldest sample always fits once the others are
        preempted); if it does, it is an engine fault: end one sample with an error (the client
        gets an error, not a truncated answer) rather than spin forever."""
        s = self.scheduler.stuck_victim()
        free = self.allocator.free_pages
        self._fail(s, f"internal error: the scheduler could not place {s.group.rid}#{s.index} "
                      f"({s.total_len} tokens, {free} of {self.allocator.capacity} pages free, "
                      f"{len(self.scheduler.free_slots)} slots free)")

    def _fail(self, s: Seq, message: str) -> None:
        """End s with finish_reason "error" and `message` (see `EngineInternalError`)."""
        log.error("%s", message)
        if s.status == WAITING:
            self.scheduler.remove_waiting(s)
        s.error = message
        self.metrics.add("requests_failed")
        self.output.finish(s, "error")

    # ------------------------------------------------------------------------------------ expert distribution
    def _expert_recorder(self):
        rec = getattr(self.runner, "expert_recorder", None)
        if rec is None:
            raise EngineError("the expert distribution recorder is off: start the engine with "
                              "--expert-distribution-recorder")
        return rec

    def start_expert_distribution_record(self) -> dict:
        """Clear the routed-expert counts and record from now on (SGLang's /start_expert_distribution_record);
        EngineError when the recorder is off (as for the other two)."""
        self._expert_recorder().start()
        return {"recording": True}

    def stop_expert_distribution_record(self) -> dict:
        """Record nothing more; the counts so far are kept for the dump."""
        self._expert_recorder().stop()
        return {"recording": False}

    def dump_expert_distribution_record(self, path: Optional[str] = None) -> dict:
        """Write the counts as the distribution file ``--init-expert-location`` reads (`experts.ExpertRecorder.dump`;
        path None: --expert-distribution-recorder-file). Returns {"path", "num_layers", "num_experts",
        "assignments"}. Counts the launches dispatched so far (it reads their device results)."""
        return self._expert_recorder().dump(path)

    # ------------------------------------------------------------------------------------ metrics
    def throughput(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        return self.output.throughput(window)

    def stats(self) -> dict:
        """Metrics for the server: requests, token usage, throughput, latencies, cache hit rate, DSpark
        accept length / rate / histogram (``spec_*``, with DSpark on)."""
        a = self.allocator
        m = self.metrics.snapshot()
        reused = m["shared_prompt_tokens"] + m["cached_prompt_tokens"]  # forked n > 1 prompts + prefix-cache hits
        computed = m["computed_prompt_tokens"] + reused
        ps = a.page_size
        out = {
            "num_running_reqs": len({s.group.rid for s in self.scheduler.running}),
            "num_running_seqs": len(self.scheduler.running),
            "num_queue_reqs": self.num_waiting,
            "num_used_tokens": a.used_pages * ps,
            "max_total_num_tokens": a.capacity * ps,
            "token_usage": a.used_pages / a.capacity,
            "gen_throughput": self.throughput(),
            "cache_hit_rate": (reused / computed) if computed else 0.0,
            "ttft_s": list(self.output.ttft),
            "itl_s": list(self.output.itl),
            "e2e_s": list(self.output.e2e),
            "num_compilations": self.num_compilations(),
            "preemptions_by_reason": dict(self.preemptions),
            **m,
        }
        if self.spec_gamma:
            out.update(self.output.spec_summary(), spec_gamma=self.spec_gamma)
        caches = [c for c in getattr(self.runner, "prefix_caches", [self.prefix_cache]) if c is not None]
        if caches:  # the radix prefix cache (and its host tier; with dp ranks: summed over them)
            out.update(prefix_cache_entries=sum(len(c.entries) for c in caches),
                       prefix_cache_host_entries=sum(len(c.host_entries) for c in caches),
                       prefix_cache_hits=sum(c.hits for c in caches),
                       prefix_cache_host_hits=sum(c.host_hits for c in caches),
                       prefix_cache_spills=sum(c.spills for c in caches))
        if self.dp > 1:  # per rank (the /metrics gauges with a dp_rank label)
            out["dp_ranks"] = self.scheduler.rank_stats()
        return out
