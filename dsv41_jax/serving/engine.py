"""The serving engine: continuous batching over the paged cache (issue 5 item 1).

`Engine` owns the model parameters, the cache state (donated through every step), a page allocator
and per-slot sampling tensors, and runs one *scheduler iteration* per `Engine.step()`:

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
(``decode.jitted_extend(cfg, ccfg, True)``, compiled lazily, per (B, T) bucket, on the first launch that
needs it; never in the warm-up), and reduces its fp32 ``[B, T, V]`` logits on the device
(`_prompt_logprobs`) to the log-softmax of each next prompt token ``[B, T]`` and the top
``max_logprobs`` ``[B, T, K]``; only those come back to the host. Prefill chunks cover positions
``0 .. len(prompt) - 2``, i.e. exactly the predictions of prompt tokens ``1 .. len(prompt) - 1``; the
last prompt token's row samples as usual. Such a sample never shares its prompt by forking (it
prefills itself), and ``max_tokens=0`` ends it ("length") once its prompt logprobs are read.

If the engine itself must end a request (a scheduler fault), the sample finishes with reason
"error" and `RequestOutput.error` says why; `AsyncEngine` turns it into `EngineInternalError`
(HTTP 500 / a stream error event), never a truncated success.

n > 1 shares the prompt: the n samples are admitted together; sample 0 prefills the prompt minus
its last token, then the others are **forked**: the full pages are shared (reference counted in
`SharedPageAllocator`), the partially filled last page is copied to a fresh page, and the slot
state (window rings, partial compressor groups, Engram history) is copied by one jitted
`_fork_slot`; then each sample feeds the last prompt token itself and samples with its own seed
(``seed + j``). If the pool has no page for the copy, that sample prefills the prompt itself.

Constraints (for grammar-constrained decoding): any object with ``allowed_mask() -> bool [V] |
None`` (None = unconstrained this step), ``accept(token_id)`` and ``is_done() -> bool``; with n > 1
it must also have ``clone()``. The mask is applied on the device; ``is_done()`` ends the request
with finish reason "stop".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model.decode import _bucket
from dsv41_jax.serving import sampling as smp
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams, SamplingTensors
from dsv41_jax.serving.tokenizer import IncrementalDetokenizer

__all__ = ["CompletionOutput", "Engine", "EngineError", "EngineInternalError", "QueueFullError", "RequestOutput",
           "SharedPageAllocator", "PREEMPTION_REASONS"]

log = logging.getLogger("dsv41_jax.engine")

_ADMIT_ROWS = 8  # slot resets / sampling-row updates are dispatched in groups of this many (one shape)
# Admission headroom (as SGLang's new_token_ratio): a sample is admitted when the pool also holds
# this fraction of the tokens the running samples may still generate. It rises after a preemption
# (admissions were too eager) and decays by one step per decode iteration (requests often stop early).
_RESERVE_INIT, _RESERVE_MIN, _RESERVE_BUMP, _RESERVE_DECAY = 0.5, 0.1, 0.3, 0.002
_CPU_MEM_FRACTION = 0.5
_ACCEL_MEM_FRACTION = 0.85


class EngineError(ValueError):
    """A request the engine cannot take (prompt too long or empty, bad token id...); HTTP 400."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queued_requests`` (the server answers 503). The one definition:
    the server imports it from here."""


class EngineInternalError(RuntimeError):
    """The engine had to end an accepted request early (a scheduler fault, not the request's): the
    server answers 500 (non-streaming) or sends an error event (streaming), never a truncated 200."""


# Why a running sample was preempted (the ``reason`` label of the preemption counter):
# "decode_pages": the decode rows (new tokens, or the replay of a resumed sample) need pages the pool
#   does not have; "prefill_pages": no row could run because the admitted prefills are blocked on pages.
PREEMPTION_REASONS = ("decode_pages", "prefill_pages")


# ----------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------


@dataclass
class CompletionOutput:
    """One sample of a request. In "delta" outputs (streaming) ``text`` / ``token_ids`` /
    ``logprobs`` / ``top_logprobs`` hold only what is new since the previous output.

    logprobs: the sampled tokens' logprobs (None unless the request asked for logprobs).
    top_logprobs: per token, ``[(token_id, logprob), ...]`` of the ``logprobs`` most likely tokens.
    finish_reason: None (running), "stop" (stop token / string / constraint done), "length"
    (max_tokens or context length), "abort" (the client's abort) or "error" (the engine had to end
    the request: `RequestOutput.error` says why). stop_reason: the stop string or token id matched.
    """

    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    # filled by LLM.chat
    reasoning_content: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: Optional[str] = None  # set when the engine ended a sample with finish_reason "error"
    # with SamplingParams.prompt_logprobs: per prompt token (len(prompt_token_ids)), None for the first,
    # else (logprob, [(token_id, logprob), ...] top-k). Set in the first output after all are computed
    # (the final one for output_kind "final").
    prompt_logprobs: Optional[list] = None


# ----------------------------------------------------------------------------------------------------
# Pages with sharing
# ----------------------------------------------------------------------------------------------------


class SharedPageAllocator(kvc.PageAllocator):
    """`PageAllocator` whose pages may be shared by several requests (reference counted).

    `share(src, dst, n)` gives ``dst`` the first ``n`` pages of ``src`` (they must be full and never
    written again); a page returns to the free list when its last holder frees it."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        super().__init__(num_pages, page_size, max_pages_per_seq)
        self._refs: dict = {}

    def ensure(self, rid, num_tokens: int) -> list:
        before = len(self._tables.get(rid, []))
        table = super().ensure(rid, num_tokens)
        for p in table[before:]:
            self._refs[p] = 1
        return table

    def pages_needed(self, rid, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(self._tables.get(rid, [])))

    def share(self, src, dst, n_pages: int) -> None:
        if self._tables.get(dst):
            raise ValueError(f"share: {dst!r} already holds pages")
        pages = list(self._tables.get(src, []))[:n_pages]
        if len(pages) < n_pages:
            raise ValueError(f"share: {src!r} holds {len(pages)} pages, fewer than {n_pages}")
        self._tables[dst] = pages
        for p in pages:
            self._refs[p] += 1

    def free(self, rid) -> int:
        table = self._tables.pop(rid, [])
        released = []
        for p in table:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                released.append(p)
        self._free.extend(reversed(released))
        return len(released)

    @property
    def used_pages(self) -> int:
        return self.capacity - len(self._free)

    def check_invariants(self) -> None:
        counts: dict = collections.Counter()
        for rid, t in self._tables.items():
            if len(set(t)) != len(t):
                raise AssertionError(f"request {rid!r} holds a page twice")
            counts.update(t)
        if dict(counts) != self._refs:
            raise AssertionError("reference counts do not match the page tables")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list has duplicates")
        if 0 in free or 0 in counts:
            raise AssertionError("the null page 0 was handed out")
        if set(counts) & free:
            raise AssertionError(f"pages both live and free: {sorted(set(counts) & free)}")
        if len(counts) + len(free) != self.capacity:
            raise AssertionError(f"{self.capacity - len(counts) - len(free)} pages lost")


# ----------------------------------------------------------------------------------------------------
# Jitted device helpers (module level: shared by every engine, compiled once per shape)
# ----------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("max_logprobs",), donate_argnums=(1, 2))
def _sample_rows(logits, slot_tensors, last_token, slots, step_counter, sample_mask, allowed, *, max_logprobs):
    """Sample the rows of a launch from their slots' tensors; scatter tokens into ``last_token`` and
    the penalty counts. Rows with ``sample_mask`` False change nothing."""
    n_rows = last_token.shape[0]
    t = jax.tree.map(lambda a: a[slots], slot_tensors)
    t = t.replace(valid=t.valid & sample_mask)
    x = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
    tokens, lp, (top_ids, top_vals) = smp.sample(x, t, step_counter, max_logprobs=max_logprobs)
    rows = jnp.where(sample_mask, slots, n_rows)  # out of range: dropped
    counts = slot_tensors.output_counts.at[rows, tokens].add(1, mode="drop")
    last = last_token.at[rows].set(tokens, mode="drop")
    return tokens, lp, top_ids, top_vals, slot_tensors.replace(output_counts=counts), last


@functools.partial(jax.jit, static_argnames=("k",))
def _prompt_logprobs(logits, targets, *, k):
    """Per-position scoring of a prefill launch on the device.

    logits: fp32 [B, T, V] (every position of each chunk); targets: int32 [B, T], the prompt token
    that follows each position. Returns (logprob fp32 [B, T] of the target, top-k ids int32
    [B, T, k], top-k logprobs fp32 [B, T, k]) from log_softmax over V (ties: lower id first)."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0]
    top_vals, top_ids = jax.lax.top_k(lsm, k)
    return lp, top_ids.astype(jnp.int32), top_vals


@jax.jit
def _last_logits(logits, n_new):
    """[B, T, V] -> [B, V] at each row's last real token (what the last-only variant returns)."""
    last = jnp.maximum(n_new - 1, 0)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


@jax.jit
def _fill_first_token(tokens, from_prev, slot, last_token):
    """tokens[:, 0] ← last_token[slot] where from_prev (decode rows whose input is still on device)."""
    return tokens.at[:, 0].set(jnp.where(from_prev, last_token[slot], tokens[:, 0]))


@functools.partial(jax.jit, donate_argnums=(0,))
def _reset_rows(state, slots, pad_id):
    return kvc.reset_slots(state, slots, pad_id)


@functools.partial(jax.jit, static_argnames=("page_size", "ratios"), donate_argnums=(0,))
def _fork_slot(state, src, dst, src_page, dst_page, *, page_size, ratios):
    """Copy slot ``src``'s rows to slot ``dst`` and page ``src_page``'s pool entries to ``dst_page``."""
    row = lambda a: a.at[dst].set(a[src])  # noqa: E731
    out = dict(state)
    out["window"] = [jax.tree.map(row, w) for w in state["window"]]
    out["partial"] = {k: jax.tree.map(row, v) for k, v in state["partial"].items()}
    if "engram_hist" in state:
        out["engram_hist"] = row(state["engram_hist"])
    r_of = dict(ratios)

    def page_copy(store, r):
        n = page_size // r

        def one(a):
            z = (0,) * (a.ndim - 1)
            blk = jax.lax.dynamic_slice(a, (src_page * n,) + z, (n,) + a.shape[1:])
            return jax.lax.dynamic_update_slice(a, blk, (dst_page * n,) + z)

        return jax.tree.map(one, store)

    out["comp"] = {k: page_copy(v, r_of[k]) for k, v in state["comp"].items()}
    out["ikeys"] = {k: page_copy(v, r_of[k]) for k, v in state["ikeys"].items()}
    return out


# ----------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class _Group:
    """A user request: the prompt and its n samples."""

    def __init__(self, rid, prompt, prompt_ids, params, n, output_kind, arrival, order):
        self.rid, self.prompt, self.prompt_ids, self.params = rid, prompt, prompt_ids, params
        self.order = order  # arrival order: the scheduling priority (older first)
        self.n, self.output_kind, self.arrival = n, output_kind, arrival
        self.arrival_perf = time.perf_counter() - max(0.0, time.time() - arrival)
        self.seqs: list = []
        self.finished_time: Optional[float] = None
        self.emitted_final = False
        self.sent_plp = False

    @property
    def finished(self) -> bool:
        return all(s.status == FINISHED for s in self.seqs)


class _Seq:
    """One sample (the unit the scheduler runs)."""

    def __init__(self, group: _Group, index: int, params: SamplingParams, detok, constraint):
        self.group, self.index, self.params, self.detok, self.constraint = group, index, params, detok, constraint
        self.key = (group.rid, index)
        self.prompt_ids = group.prompt_ids
        self.output_ids: list = []
        self.lps: list = []
        self.tops: list = []
        self.cum_lp = 0.0
        n_p = len(self.prompt_ids)
        self.want_plp = params.prompt_logprobs is not None
        self.plp: list = [None] * n_p if self.want_plp else []  # per prompt position: (lp, top)
        self.plp_missing = max(0, n_p - 1) if self.want_plp else 0
        self.status = WAITING
        self.slot: Optional[int] = None
        self.num_cached = 0  # tokens written to the cache (host view, counting dispatched launches)
        self.n_inflight = 0  # sampled on the device, not read yet
        self.fork_src: Optional["_Seq"] = None  # fork child: waiting for the source's prefix
        self.priority = (group.order, index)  # smaller runs first and is preempted last
        self.error: Optional[str] = None  # why the engine ended it (finish_reason "error")
        self.ever_admitted = False
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.num_preemptions = 0
        # streaming: what was already emitted
        self.sent_tokens = 0
        self.delta_text = ""
        self.sent_final = False

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.n_inflight

    @property
    def n_out(self) -> int:
        return len(self.output_ids) + self.n_inflight

    def tokens(self, a: int, b: int) -> list:
        p = self.prompt_ids
        if b <= len(p):
            return list(p[a:b])
        return (list(p[a:]) if a < len(p) else []) + self.output_ids[max(0, a - len(p)): b - len(p)]


@dataclass
class _Row:
    seq: _Seq
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
    tokens: Any = None
    lp: Any = None
    top_ids: Any = None
    top_vals: Any = None
    want_top: bool = False
    plp: Any = None  # (lp [B, T], top_ids [B, T, K], top_vals [B, T, K]) on the device (prompt logprobs)


# ----------------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------------


def _device_memory_bytes(args: EngineArgs) -> tuple:
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
            if stats.get("bytes_limit"):
                return int(stats["bytes_limit"]), f"{dev.platform} bytes_limit", _ACCEL_MEM_FRACTION
        except Exception:  # noqa: BLE001 (backends without memory_stats)
            pass
    if args.cpu_memory_budget:
        return int(args.cpu_memory_budget), "--cpu-memory-budget", _CPU_MEM_FRACTION
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return int(total), "physical RAM", _CPU_MEM_FRACTION if dev.platform == "cpu" else _ACCEL_MEM_FRACTION


def _tree_bytes(tree) -> int:
    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree)))


class Engine:
    """The scheduler. Single-threaded: call `add_request`, `abort_request` and `step` from one
    thread (`AsyncEngine` runs it in a background thread)."""

    def __init__(self, args: Optional[EngineArgs] = None, *, cfg=None, params=None, tokenizer=None, **kw):
        if args is None:
            args = EngineArgs.from_kwargs(**kw)
        elif kw:
            args = args.replace(**kw)
        self.args = args
        t0 = time.perf_counter()
        from dsv41_jax.model.config import ModelConfig

        if cfg is None:
            cfg = ModelConfig.from_pretrained(args.model)
        if args.dtype != "auto" and cfg.act_dtype != args.act_dtype:
            cfg = cfg.replace(act_dtype=args.act_dtype)
        if cfg.impl != args.impl:
            cfg = cfg.replace(impl=args.impl)
        try:
            chosen = args.resolved_impl()
        except ValueError as e:
            raise EngineError(f"--impl {args.impl!r}: {e}") from None
        log.info("impl %r: %s", args.impl, ", ".join(f"{op}={name}" for op, name in chosen.items()))
        self.cfg = cfg
        # --tp / --ep: the mesh is built (and an impossible combination refused, MeshError) before any
        # weight is loaded; tp = ep = 1 runs unsharded on the default device.
        self.mesh = None
        if args.tp_size != 1 or args.ep_size != 1:
            from dsv41_jax.parallel.mesh import make_mesh

            self.mesh = make_mesh(args.tp_size, args.ep_size, cfg=cfg)
        from dsv41_jax.parallel.host_table import host_table_requested, offload_engram

        self.engram_host_table = bool(cfg.engram_layer_ids) and host_table_requested(args.engram_host_table)
        if params is None:
            if args.model == "tiny" and not os.path.isdir(args.model):
                from dsv41_jax.model.params import init_params

                params = init_params(cfg, jax.random.key(args.random_seed))
            else:
                from dsv41_jax.model.checkpoint import load_params

                # straight onto the mesh's shardings (no whole-tensor copy on one device first)
                params = load_params(args.model, cfg, self.mesh, engram_host_table=self.engram_host_table)
        if self.mesh is not None:
            from dsv41_jax.parallel import rules

            params = rules.shard_params(params, cfg, self.mesh, engram_host_table=self.engram_host_table)
        elif self.engram_host_table:
            params = offload_engram(params)
        from dsv41_jax.model import layer_scan

        # runs of plan-identical layers stacked once here, so the step's scans read them in place
        # (stacking inside the step would copy their weights on every call)
        params = layer_scan.prepare(params, cfg)
        self.params = params
        if tokenizer is None:
            from dsv41_jax.serving.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer or args.model)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        if tokenizer.vocab_size > cfg.vocab_size:
            raise EngineError(f"tokenizer has {tokenizer.vocab_size} tokens, more than vocab_size={cfg.vocab_size}")
        self.vocab_size = cfg.vocab_size
        self.pad_compressed_id = (int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
                                  if cfg.engram_layer_ids else 0)
        self.load_time = time.perf_counter() - t0

        # -- memory plan
        self.ccfg, self.memory_plan = self._plan_memory()
        ccfg = self.ccfg
        self.context_length = self.memory_plan["context_length"]  # per request (prompt + output)
        self.max_slots = ccfg.max_slots
        self.scratch = ccfg.max_slots
        self.batch_buckets = args.resolved_batch_buckets()
        self.token_buckets = args.resolved_token_buckets()
        self.chunk_cap = self.token_buckets[-1]
        self.max_logprobs = min(args.max_logprobs, self.vocab_size)
        self.overlap = not args.disable_overlap_schedule

        # -- device state
        if self.mesh is None:
            self.state = kvc.init_cache(cfg, ccfg)
        else:
            from dsv41_jax.parallel import rules

            self.state = rules.init_cache(cfg, ccfg, self.mesh)
        self._reset_device_slots(list(range(self.max_slots + 1)))
        self.slot_tensors = SamplingTensors.from_params([None] * (self.max_slots + 1), self.vocab_size)
        self.last_token = jnp.zeros((self.max_slots + 1,), jnp.int32)
        self._allow_all: dict = {}
        self._extend = dec.jitted_extend(cfg, ccfg, False, self.mesh, self.engram_host_table)
        self._extend_all = None  # the all-logits variant (prompt logprobs): made on first use
        self._ratios = tuple((k, cfg.compress_ratios[int(k)]) for k in sorted(self.state["comp"]))
        self.allocator = SharedPageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)

        # -- host state
        self._groups: dict = {}
        self._waiting: collections.deque = collections.deque()
        self._running: list = []
        self._free_slots = list(range(self.max_slots - 1, -1, -1))
        self._pending: list = []
        self._touched: dict = {}
        self._group_counter = 0
        self._reserve_ratio = _RESERVE_INIT
        self._room_blocked = False  # this plan: an admitted prefill chunk waits for pages
        self._n_processed = 0  # launches whose tokens were read (progress detection)
        self._pending_resets: list = []
        self._pending_sampling: list = []
        self._rng = random.Random(args.random_seed)
        self._iter = 0
        self._decode_iters = 0
        self._last_log = (time.perf_counter(), 0)
        self.warmup_time = 0.0
        self.warmup_shapes = 0
        self.last_step: dict = {}

        # -- metrics
        self.preemptions = {r: 0 for r in PREEMPTION_REASONS}  # per reason (the /metrics counter)
        self.metrics = {"num_preemptions": 0, "replayed_tokens": 0, "requests_failed": 0, "prompt_tokens": 0,
                        "generation_tokens": 0, "requests_finished": 0,
                        "requests_aborted": 0, "shared_prompt_tokens": 0, "computed_prompt_tokens": 0,
                        "num_forks": 0, "steps": 0, "launches": 0}
        self.ttft = collections.deque(maxlen=10000)
        self.itl = collections.deque(maxlen=100000)
        self.e2e = collections.deque(maxlen=10000)
        self._gen_times = collections.deque(maxlen=4096)  # (time, tokens) per processed launch
        if not args.skip_server_warmup:
            self.warmup()

    # ------------------------------------------------------------------------------------ setup
    def _plan_memory(self):
        args, cfg = self.args, self.cfg
        ps, S = args.page_size, args.max_running_requests
        mode = args.cache_dtype
        want_ctx = args.context_length or cfg.max_position_embeddings
        ctx = -(-want_ctx // ps) * ps
        b = kvc.kv_bytes_per_token(cfg, mode)
        info = {"page_size": ps, "max_running_requests": S, "bytes_per_token": b["per_token"],
                "window_bytes": (S + 1) * b["window_per_request"]}
        if args.max_total_tokens:
            num_pages = -(-args.max_total_tokens // ps) + 1
            info["source"] = "--max-total-tokens"
        else:
            total, source, default_frac = _device_memory_bytes(args)
            frac = args.mem_fraction_static if args.mem_fraction_static is not None else default_frac
            weights = _tree_bytes(self.params)
            budget = int(total * frac) - weights
            plan = kvc.plan_memory(cfg, budget, page_size=ps, max_slots=S, max_context=ctx, kv_cache_dtype=mode)
            num_pages = min(plan["num_pages"], S * (ctx // ps) + 1)
            info.update(source=f"{frac:.2f} x {source} ({total / 2**30:.1f} GiB) - weights {weights / 2**20:.1f} MiB",
                        budget_bytes=budget)
        num_pages = max(num_pages, 2)
        ctx = min(ctx, (num_pages - 1) * ps)
        if min(ctx, want_ctx) < 2:
            raise EngineError("the KV pool is too small for a single request")
        ccfg = kvc.CacheConfig(page_size=ps, num_pages=num_pages, max_slots=S, max_pages_per_seq=ctx // ps,
                               kv_cache_dtype=mode)
        ccfg.validate(cfg)
        info.update(num_pages=num_pages, pool_tokens=(num_pages - 1) * ps, context_length=min(ctx, want_ctx),
                    pool_bytes=int(num_pages * ps * b["per_token"]))
        log.info("KV cache (%s): page_size=%d, %d pages = %d tokens, pools %.1f MiB (%.0f B/token), window rings "
                 "%.1f MiB for %d slots, context_length=%d, kv_cache_dtype=%s, act dtype=%s", info["source"], ps,
                 num_pages - 1, info["pool_tokens"], info["pool_bytes"] / 2**20, b["per_token"],
                 info["window_bytes"] / 2**20, S, info["context_length"], mode, cfg.act_dtype)
        return ccfg, info

    def _jitted(self) -> list:
        fns = [self._extend, _sample_rows, _fill_first_token, _reset_rows, _fork_slot, smp._scatter_rows]
        if self._extend_all is not None:
            fns += [self._extend_all, _prompt_logprobs, _last_logits]
        return fns

    def num_compilations(self) -> int:
        """Compiled variants held by the jitted functions the engine calls (extend, sampling, helpers)."""
        return int(sum(f._cache_size() for f in self._jitted()))

    def warmup(self) -> None:
        """Compile every (batch, tokens) bucket and the helpers, with a progress line per shape."""
        t0 = time.perf_counter()
        shapes = [(B, T) for T in self.token_buckets for B in self.batch_buckets]
        P = self.ccfg.max_pages_per_seq
        n0 = self.num_compilations()
        for i, (B, T) in enumerate(shapes):
            ts = time.perf_counter()
            z = np.zeros((B,), np.int32)
            self._device_launch(None, np.zeros((B, T), np.int32), z, z, np.full((B,), self.scratch, np.int32),
                                np.zeros((B, P), np.int32), np.zeros((B,), bool), np.zeros((B,), bool), z,
                                force_sample=(T == self.token_buckets[0]))
            jax.block_until_ready(self.state)
            log.info("warm-up [%d/%d] batch=%d tokens=%d: %.1fs", i + 1, len(shapes), B, T, time.perf_counter() - ts)
        self._reset_device_slots([self.scratch])
        self.slot_tensors = self.slot_tensors.update_slots([self.scratch] * _ADMIT_ROWS, [None] * _ADMIT_ROWS)
        self.state = _fork_slot(self.state, np.int32(self.scratch), np.int32(self.scratch), np.int32(0), np.int32(0),
                                page_size=self.ccfg.page_size, ratios=self._ratios)
        jax.block_until_ready(self.state)
        self.warmup_time = time.perf_counter() - t0
        self.warmup_shapes = len(shapes)
        self.metrics["launches"] = 0
        log.info("warm-up done: %d shapes, %d compilations in %.1fs", len(shapes), self.num_compilations() - n0,
                 self.warmup_time)

    def _reset_device_slots(self, slots: list) -> None:
        for i in range(0, len(slots), _ADMIT_ROWS):
            part = slots[i:i + _ADMIT_ROWS]
            part = part + [self.scratch] * (_ADMIT_ROWS - len(part))
            self.state = _reset_rows(self.state, np.asarray(part, np.int32), np.int32(self.pad_compressed_id))

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Union[str, Sequence[int], None] = None,
                    sampling_params: Optional[SamplingParams] = None, *, prompt_token_ids=None, constraint=None,
                    output_kind: str = "final", arrival_time: Optional[float] = None) -> None:
        """Queue a request. `prompt` is text (tokenized without special tokens) or token ids.
        output_kind "final": one output when the request finishes (cumulative); "delta": an output
        after every step that produced something (new text / tokens only)."""
        if request_id in self._groups:
            raise EngineError(f"request_id {request_id!r} is already in use")
        if output_kind not in ("final", "delta"):
            raise ValueError(f"output_kind: 'final' or 'delta', got {output_kind!r}")
        p = sampling_params or SamplingParams()
        p.validate(max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
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
        self._check_fits(ids, p)
        g = _Group(request_id, text, ids, p, p.n, output_kind, arrival_time or time.time(), self._group_counter)
        self._group_counter += 1
        children = p.child_params() if p.n > 1 else [p]
        for j, cp in enumerate(children):
            if cp.seed is None:
                cp = cp.replace(seed=self._rng.getrandbits(63))
            det = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=cp.skip_special_tokens,
                                         stop=cp.stop, include_stop_str_in_output=cp.include_stop_str_in_output,
                                         min_tokens=cp.min_tokens)
            con = constraint if j == 0 or constraint is None else constraint.clone()
            g.seqs.append(_Seq(g, j, cp, det, con))
        self._groups[request_id] = g
        if p.max_tokens == 0 and len(ids) == 1:  # nothing to compute: the first token has no logprob
            for s in g.seqs:
                self._finish(s, "length")
        else:
            self._waiting.extend(g.seqs)
        self.metrics["prompt_tokens"] += len(ids)

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
            pool = self.allocator.capacity * self.ccfg.page_size
            raise EngineError(f"prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) = {total} tokens exceeds "
                              f"this engine's per-request limit of {self.context_length} tokens (context_length; "
                              f"the KV pool holds {pool}); reduce the prompt or max_tokens")

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request: its pages and slots are freed at once; an "abort" output is emitted."""
        g = self._groups.get(request_id)
        if g is None or g.finished:
            return False
        for s in g.seqs:
            if s.status == WAITING:
                try:
                    self._waiting.remove(s)
                except ValueError:
                    pass
            if s.status != FINISHED:
                self._finish(s, "abort")
        self.metrics["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._pending or self._touched)

    @property
    def num_waiting(self) -> int:
        return len({s.group.rid for s in self._waiting})

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------------------------ step
    def step(self) -> list:
        """One scheduler iteration; returns the `RequestOutput`s produced."""
        self._iter += 1
        n_processed = self._n_processed
        ops = self._schedule()
        launches = [op for op in ops if isinstance(op, _Launch)]
        if ops:
            self._dispatch(ops)
        self.last_step = {"launches": [(L.B, L.T) for L in launches],
                          "prefill_tokens": sum(r.n for L in launches for r in L.rows if not (r.sample or r.replay)),
                          "replay_rows": sum(1 for L in launches for r in L.rows if r.replay),
                          "decode_rows": sum(1 for L in launches for r in L.rows if r.sample)}
        if self.overlap:
            done, self._pending = self._pending, launches
            self._process(done)
        else:
            self._process(launches)
        if (not launches and not self._pending and self._n_processed == n_processed
                and (self._running or self._waiting)):
            self._unstick()  # nothing ran, nothing was read: the plan saw the current state and had no move
        self.metrics["steps"] += 1
        return self._emit()

    def run_until_done(self) -> list:
        out = []
        while self.has_unfinished():
            out += self.step()
        return out

    def _sync(self) -> None:
        """Read the in-flight tokens now (before a preemption or a constraint mask)."""
        done, self._pending = self._pending, []
        self._process(done)

    # ------------------------------------------------------------------------------------ scheduling
    def _active(self, s: _Seq) -> bool:
        """Running, not waiting for a fork, and not already at max_tokens / the context length."""
        if s.status != RUNNING or s.fork_src is not None:
            return False
        mt = s.params.max_tokens
        if mt is not None and s.n_out >= mt and not (mt == 0 and s.num_cached < len(s.prompt_ids) - 1):
            return False  # (max_tokens=0 with prompt logprobs: active while prefilling)
        return s.total_len < self.context_length

    def _decodable(self, s: _Seq) -> bool:
        """In the one-token-per-step phase: the prompt's last token onwards. A resumed sample first
        *replays* its generated tokens here (rows that write the cache without sampling), so its
        cache is built by the same [B, 1] steps as when the tokens were generated: with one batch
        bucket the resumed sample's tokens are exactly those it gets without preemption."""
        return self._active(s) and s.num_cached >= len(s.prompt_ids) - 1

    def _prefilling(self, s: _Seq) -> bool:
        return self._active(s) and s.num_cached < len(s.prompt_ids) - 1

    def _schedule(self) -> list:
        if self._pending and any(s.constraint is not None and s.n_inflight for s in self._running):
            self._sync()
        for _ in range(2):
            ops = self._plan()
            if ops is not None:
                return ops
            self._sync()  # a preemption needs the in-flight tokens first
        return []

    def _pick_victim(self) -> Optional[_Seq]:
        """The running sample that arrived last (fork children waiting for their source excepted):
        the oldest sample is never preempted while another runs, so it always progresses."""
        cands = [s for s in self._running if s.fork_src is None]
        return max(cands, key=lambda s: s.priority) if cands else None

    def _decode_row(self, s: _Seq) -> _Row:
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
        for s in sorted((s for s in self._running if self._prefilling(s)), key=lambda s: s.priority):
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
        dec_rows = self._decode_rows(dec_seqs, pre_rows, fork_ops)
        if not pre_rows and not dec_rows:
            return self._unblock_prefills()
        return self._assemble(pre_rows, fork_ops, dec_rows)

    def _reserve_decode_pages(self) -> Optional[list]:
        """Pages for every sample in the one-token phase, preempting the newest while the pool is
        short. Returns those samples (oldest first), or None when the in-flight tokens must be read
        before a preemption."""
        alloc = self.allocator
        while True:
            dec_seqs = [s for s in self._running if self._decodable(s)]
            need = sum(alloc.pages_needed(s.key, s.num_cached + 1) for s in dec_seqs)
            if need <= alloc.free_pages:
                break
            victim = self._pick_victim()
            if victim is None:
                break  # nothing to preempt (cannot happen with requests that fit): run those that fit
            if self._pending:
                return None
            self._preempt(victim, "decode_pages")
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
        for the share `_reserve_ratio` of what the running samples may still generate, so that
        admissions rarely force a preemption."""
        s = members[0]
        need = self.allocator.pages_needed(None, s.total_len) + (len(members) - 1)
        future = sum(self._remaining(q) for q in self._running)
        return need + math.ceil(future * self._reserve_ratio / self.ccfg.page_size)

    def _remaining(self, s: _Seq) -> int:
        """Tokens s may still generate (max_tokens, or up to the context length)."""
        room = self.context_length - s.total_len
        mt = s.params.max_tokens
        return max(0, room if mt is None else min(room, mt - s.n_out))

    def _admit_waiting(self, budget: int) -> list:
        """Admit waiting samples in priority order (a preempted one resumes before anything newer)
        while slots, prefill budget and pages allow; returns their first prefill chunks."""
        rows = []
        while self._waiting and budget > 0 and not self._room_blocked:  # blocked prefills go first
            s = self._waiting[0]
            members = self._fork_group(s) or [s]
            if len(self._free_slots) < len(members):
                break
            if self._admission_pages(members) > self.allocator.free_pages and self._running:
                break
            if self.allocator.pages_needed(None, s.total_len) + len(members) - 1 > self.allocator.free_pages:
                break  # (nothing running) pages held outside the scheduler: if it persists, `_unstick` reports it
            for q in members:
                self._waiting.remove(q)
                self._admit(q)
            for q in members[1:]:
                q.fork_src = s
            if len(s.prompt_ids) > 1:
                row = self._prefill_row(s, budget)
                if row is not None:
                    rows.append(row)
                    budget -= row.n
        return rows

    def _decode_rows(self, dec_seqs: list, pre_rows: list, fork_ops: list) -> list:
        """One-token rows: the samples that had pages reserved, plus (split launches) those whose
        prefill was just dispatched, whose next token runs in the decode launch after the prefill."""
        alloc = self.allocator
        rows = [self._decode_row(s) for s in dec_seqs]
        have = {id(s) for s in dec_seqs}
        if self.args.enable_mixed_chunk:  # one launch: a sample gets one row; fork copies run after it
            have |= {id(r.seq) for r in pre_rows} | {id(q) for op in fork_ops for q in op[5]}
        for s in sorted(self._running, key=lambda s: s.priority):
            if (id(s) not in have and self._decodable(s)
                    and alloc.pages_needed(s.key, s.num_cached + 1) <= alloc.free_pages):
                rows.append(self._decode_row(s))
        for r in rows:
            r.seq.num_cached += 1
            if r.sample:
                r.seq.n_inflight += 1
            else:
                self.metrics["replayed_tokens"] += 1
        return rows

    def _unblock_prefills(self) -> Optional[list]:
        """No row could run: the admitted prefills are blocked on pages others hold. Preempt the
        newest sample (after reading the in-flight tokens) and plan again; [] when nothing runs."""
        if not any(self._prefilling(s) for s in self._running):
            return []
        victim = self._pick_victim()
        if victim is None:
            return []
        if self._pending:
            return None
        self._preempt(victim, "prefill_pages")
        return self._plan()

    def _assemble(self, pre_rows: list, fork_ops: list, dec_rows: list) -> list:
        if self.args.enable_mixed_chunk:
            return [self._launch(dec_rows + pre_rows)] + fork_ops
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

    def _prefill_row(self, s: _Seq, budget: int) -> Optional[_Row]:
        """The next chunk of s's prompt (all but its last token), within budget; advances
        s.num_cached. Chunks end at multiples of the chunk size, as when the sample runs alone, and
        a chunk the pool has no room for waits whole (None; `_room_blocked` set) instead of being
        cut: same chunks, same numerics, whatever the pressure."""
        alloc = self.allocator
        n = min(len(s.prompt_ids) - 1 - s.num_cached, self.chunk_cap - s.num_cached % self.chunk_cap, budget)
        if n <= 0:
            return None
        if alloc.pages_needed(s.key, s.num_cached + n) > alloc.free_pages:
            self._room_blocked = True
            return None
        alloc.ensure(s.key, s.num_cached + n)
        row = _Row(s, s.num_cached, n, s.tokens(s.num_cached, s.num_cached + n), False, False, s.n_out,
                   alloc.pages(s.key))
        s.num_cached += n
        self.metrics["computed_prompt_tokens"] += n
        return row

    def _fork_group(self, s: _Seq) -> Optional[list]:
        """The n fresh samples of s's request to admit together with prompt sharing, or None (then
        they are admitted one by one: too many for the slots, or the prompt plus one page per
        sibling would not fit the pool even when empty)."""
        g = s.group
        if (g.n < 2 or s.index != 0 or s.ever_admitted or self.args.disable_prefix_sharing or s.want_plp
                or len(g.prompt_ids) < 2 or g.n > self.max_slots
                or self.allocator.pages_needed(None, len(g.prompt_ids)) + g.n - 1 > self.allocator.capacity):
            return None
        if not all(q.status == WAITING and not q.ever_admitted for q in g.seqs):
            return None
        return list(g.seqs)

    def _admit(self, s: _Seq) -> None:
        s.status = RUNNING
        s.slot = self._free_slots.pop()
        s.num_cached = 0
        s.ever_admitted = True
        self._running.append(s)
        self._pending_resets.append(s.slot)
        self._pending_sampling.append(s)

    def _preempt(self, s: _Seq, reason: str) -> None:
        """Back to the queue (in priority order); resumes later by prefilling its prompt and replaying
        its generated tokens. Counted per reason."""
        assert s.n_inflight == 0 and reason in PREEMPTION_REASONS
        log.info("preempting %s#%d (%s: %d tokens cached, %d generated; %d/%d pages used)", s.group.rid, s.index,
                 reason, s.num_cached, len(s.output_ids), self.allocator.used_pages, self.allocator.capacity)
        self.metrics["num_preemptions"] += 1
        self.preemptions[reason] += 1
        self._reserve_ratio = min(1.0, self._reserve_ratio + _RESERVE_BUMP)
        s.num_preemptions += 1
        self._release(s)
        s.status = WAITING
        s.num_cached = 0
        self._orphan_children(s)
        self._requeue(s)

    def _requeue(self, s: _Seq) -> None:
        """Insert s into the waiting queue by priority (the queue stays sorted: new arrivals are
        appended and are younger than anything ever admitted)."""
        i = 0
        for i, q in enumerate(self._waiting):
            if q.priority > s.priority:
                break
        else:
            i = len(self._waiting)
        self._waiting.insert(i, s)

    def _orphan_children(self, s: _Seq) -> None:
        """Fork children still waiting for s: they prefill the prompt themselves."""
        for q in s.group.seqs:
            if q.fork_src is s:
                q.fork_src = None
                if q.status == RUNNING and q.slot is not None:
                    q.num_cached = 0
                    self._pending_resets.append(q.slot)

    def _release(self, s: _Seq) -> None:
        if s in self._running:
            self._running.remove(s)
        self.allocator.free(s.key)
        if s.slot is not None:
            self._free_slots.append(s.slot)
            s.slot = None

    def _unstick(self) -> None:
        """The scheduler had work, saw the current state and found no move. With requests checked by
        `_check_fits` this cannot happen (the oldest sample always fits once the others are
        preempted); if it does, it is an engine fault: end one sample with an error (the client
        gets an error, not a truncated answer) rather than spin forever."""
        s = self._pick_victim() if self._running else self._waiting[0]
        if s is None:
            s = self._running[-1]
        free = self.allocator.free_pages
        self._fail(s, f"internal error: the scheduler could not place {s.group.rid}#{s.index} "
                      f"({s.total_len} tokens, {free} of {self.allocator.capacity} pages free, "
                      f"{len(self._free_slots)} slots free)")

    def _fail(self, s: _Seq, message: str) -> None:
        """End s with finish_reason "error" and `message` (see `EngineInternalError`)."""
        log.error("%s", message)
        if s.status == WAITING and s in self._waiting:
            self._waiting.remove(s)
        s.error = message
        self.metrics["requests_failed"] += 1
        self._finish(s, "error")

    def _fork(self, src: _Seq) -> list:
        """src has (in this iteration's launches) prefilled its prompt minus the last token: give its
        waiting siblings the same cache (full pages shared, the partial page copied, slot rows
        copied). Returns the device copies to dispatch after the launch."""
        alloc, ps = self.allocator, self.ccfg.page_size
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
                self._pending_resets.append(q.slot)
                log.info("fork of %s#%d: no free page for the partial page; it prefills itself", q.group.rid,
                         q.index)
                continue
            alloc.share(src.key, q.key, n_full)
            src_page = dst_page = 0
            if k % ps:
                alloc.ensure(q.key, k)
                src_page, dst_page = src_pages[n_full], alloc.pages(q.key)[n_full]
            ops.append(("fork", src.slot, q.slot, src_page, dst_page, [q]))
            q.num_cached = k
            self.metrics["shared_prompt_tokens"] += k
            self.metrics["num_forks"] += 1
        return ops

    # ------------------------------------------------------------------------------------ dispatch
    def _dispatch(self, ops: list) -> None:
        # slot admissions first (device order: after everything already dispatched)
        if self._pending_resets:
            self._reset_device_slots(self._pending_resets)
            self._pending_resets = []
        if self._pending_sampling:
            self._admit_sampling(self._pending_sampling)
            self._pending_sampling = []
        P = self.ccfg.max_pages_per_seq
        for op in ops:
            if not isinstance(op, _Launch):
                _, a, b, pa, pb, _ = op
                self.state = _fork_slot(self.state, np.int32(a), np.int32(b), np.int32(pa), np.int32(pb),
                                        page_size=self.ccfg.page_size, ratios=self._ratios)
                continue
            L = op
            B, T = L.B, L.T
            tokens = np.zeros((B, T), np.int32)
            start = np.zeros((B,), np.int32)
            n_new = np.zeros((B,), np.int32)
            slot = np.full((B,), self.scratch, np.int32)
            pt = np.zeros((B, P), np.int32)
            from_prev = np.zeros((B,), bool)
            sample_mask = np.zeros((B,), bool)
            step = np.zeros((B,), np.int32)
            for b, r in enumerate(L.rows):
                if r.tokens:
                    tokens[b, :len(r.tokens)] = r.tokens
                start[b], n_new[b], slot[b] = r.start, r.n, r.seq.slot
                pt[b, :len(r.pages)] = r.pages
                from_prev[b] = r.from_prev
                sample_mask[b] = r.sample
                step[b] = r.step
            L.want_top = any(r.sample and (r.seq.params.logprobs or 0) > 0 for r in L.rows)
            targets = None
            if any(r.seq.want_plp and not (r.sample or r.replay) for r in L.rows):
                targets = np.zeros((B, T), np.int32)
                for b, r in enumerate(L.rows):
                    if r.seq.want_plp and not (r.sample or r.replay):
                        targets[b, :r.n] = r.seq.tokens(r.start + 1, r.start + r.n + 1)
            self._device_launch(L, tokens, start, n_new, slot, pt, from_prev, sample_mask, step, targets=targets)

    def _device_launch(self, L, tokens, start, n_new, slot, pt, from_prev, sample_mask, step,
                       force_sample: bool = False, targets=None) -> None:
        """Enqueue one launch: first-token fill, extend, sampling. Host inputs stay numpy (the jit
        fast path transfers them; ``jax.device_put`` costs ~10x more host time) and every call
        passes the same kinds of arguments, so the warm-up's compilations are the ones reused."""
        toks = _fill_first_token(tokens, from_prev, slot, self.last_token)
        batch = {"tokens": toks, "start": start, "n_new": n_new, "slot": slot, "page_table": pt}
        if targets is None:
            logits, self.state = self._extend(self.params, self.state, batch)
        else:  # prompt logprobs: every position's logits, reduced on the device
            if self._extend_all is None:
                log.info("compiling the all-logits extend variant (prompt logprobs) on first use")
                self._extend_all = dec.jitted_extend(self.cfg, self.ccfg, True, self.mesh, self.engram_host_table)
            all_logits, self.state = self._extend_all(self.params, self.state, batch)
            L.plp = _prompt_logprobs(all_logits, targets, k=self.max_logprobs)
            logits = _last_logits(all_logits, n_new) if sample_mask.any() else None
        self.metrics["launches"] += 1
        if not (force_sample or sample_mask.any()):
            return
        B, V = tokens.shape[0], self.vocab_size
        rows = L.rows if L is not None else []
        if any(r.seq.constraint is not None and r.sample for r in rows):
            m = np.ones((B, V), bool)
            for b, r in enumerate(rows):
                if r.sample and r.seq.constraint is not None:
                    a = r.seq.constraint.allowed_mask()
                    if a is not None:
                        a = np.asarray(a, bool).reshape(-1)
                        m[b, :] = False
                        m[b, : min(V, a.shape[0])] = a[:V]
            allowed = jax.device_put(m)
        else:
            allowed = self._allow_all.get(B)
            if allowed is None:
                allowed = self._allow_all[B] = jax.device_put(np.ones((B, V), bool))
        out = _sample_rows(logits, self.slot_tensors, self.last_token, slot, step, sample_mask, allowed,
                           max_logprobs=self.max_logprobs)
        tokens_d, lp, top_ids, top_vals, self.slot_tensors, self.last_token = out
        if L is not None:
            L.tokens, L.lp, L.top_ids, L.top_vals = tokens_d, lp, top_ids, top_vals

    def _admit_sampling(self, seqs: list) -> None:
        seqs = [s for s in seqs if s.status == RUNNING and s.slot is not None]
        for i in range(0, len(seqs), _ADMIT_ROWS):
            part = seqs[i:i + _ADMIT_ROWS]
            pad = _ADMIT_ROWS - len(part)
            slots = [s.slot for s in part] + [self.scratch] * pad
            plist = [s.params for s in part] + [None] * pad
            prompts = [s.prompt_ids for s in part] + [None] * pad
            outs = [s.output_ids for s in part] + [None] * pad
            self.slot_tensors = self.slot_tensors.update_slots(slots, plist, prompt_token_ids=prompts,
                                                               output_token_ids=outs,
                                                               eos_token_ids=self.eos_token_ids)

    # ------------------------------------------------------------------------------------ results
    def _process(self, launches: list) -> None:
        now = None
        n_tok = 0
        for L in launches:
            self._n_processed += 1
            if L.plp is not None:
                self._process_prompt_logprobs(L)
            if L.tokens is None:
                continue
            toks = np.asarray(L.tokens)
            lps = np.asarray(L.lp)
            top_ids = np.asarray(L.top_ids) if L.want_top else None
            top_vals = np.asarray(L.top_vals) if L.want_top else None
            now = time.perf_counter()
            for b, r in enumerate(L.rows):
                if not r.sample:
                    continue
                s = r.seq
                s.n_inflight -= 1
                if s.status != RUNNING:
                    continue
                top = None
                k = s.params.logprobs
                if k and top_ids is not None:
                    top = [(int(top_ids[b, j]), float(top_vals[b, j])) for j in range(k)]
                self._append_token(s, int(toks[b]), float(lps[b]), top, now)
                n_tok += 1
        if n_tok:
            self._gen_times.append((now, n_tok))
            self.metrics["generation_tokens"] += n_tok
        if launches and any(L.T == 1 for L in launches):
            self._decode_iters += 1
            self._reserve_ratio = max(_RESERVE_MIN, self._reserve_ratio - _RESERVE_DECAY)
            if self.args.decode_log_interval and self._decode_iters % self.args.decode_log_interval == 0:
                self._log_decode()

    def _process_prompt_logprobs(self, L: _Launch) -> None:
        """Store a launch's prompt logprobs in its samples (position j of a chunk starting at `start`
        scores prompt token start + j + 1); a max_tokens=0 sample ends once it has them all."""
        lp, ids, vals = (np.asarray(a) for a in L.plp)
        for b, r in enumerate(L.rows):
            s = r.seq
            if not s.want_plp or r.sample or r.replay or s.status != RUNNING:
                continue
            k = s.params.prompt_logprobs
            for j in range(r.n):
                pos = r.start + j + 1
                if s.plp[pos] is None:
                    s.plp_missing -= 1
                s.plp[pos] = (float(lp[b, j]), [(int(ids[b, j, q]), float(vals[b, j, q])) for q in range(k)])
            self._touched[s.group.rid] = s.group
            if s.plp_missing == 0 and s.params.max_tokens == 0:
                self._finish(s, "length")

    def _append_token(self, s: _Seq, tok: int, lp: float, top, now: float) -> None:
        p = s.params
        s.output_ids.append(tok)
        if p.logprobs is not None:
            s.lps.append(lp)
            s.tops.append(top or [])
            s.cum_lp += lp
        if s.first_token_time is None:
            s.first_token_time = now
            self.ttft.append(now - s.group.arrival_perf)
        else:
            self.itl.append(now - s.last_token_time)
        s.last_token_time = now
        self._touched[s.group.rid] = s.group
        if s.constraint is not None:
            s.constraint.accept(tok)
        idx = len(s.output_ids) - 1
        if tok in s.params.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            if idx >= p.min_tokens:
                s.stop_reason = tok
                self._finish(s, "stop")
                return
        s.delta_text += s.detok.add(tok)
        if s.detok.stopped:
            s.stop_reason = s.detok.stop_str
            self._finish(s, "stop")
        elif p.max_tokens is not None and len(s.output_ids) >= p.max_tokens:
            self._finish(s, "length")
        elif len(s.prompt_ids) + len(s.output_ids) >= self.context_length:  # (not counting in-flight tokens)
            self._finish(s, "length")
        elif s.constraint is not None and s.constraint.is_done():
            self._finish(s, "stop")

    def _finish(self, s: _Seq, reason: str) -> None:
        if s.status == FINISHED:
            return
        if reason != "stop" or s.detok.stop_str is None:
            s.delta_text += s.detok.finish()
        s.finish_reason = reason
        self._release(s)
        s.status = FINISHED
        self._orphan_children(s)  # fork children of an aborted source prefill themselves
        g = s.group
        self._touched[g.rid] = g
        if g.finished:
            g.finished_time = time.perf_counter()
            self.e2e.append(g.finished_time - g.arrival_perf)
            if reason not in ("abort", "error"):
                self.metrics["requests_finished"] += 1

    # ------------------------------------------------------------------------------------ outputs
    def _completion(self, s: _Seq, delta: bool) -> CompletionOutput:
        want_lp = s.params.logprobs is not None
        if delta:
            a = s.sent_tokens
            text, s.delta_text = s.delta_text, ""
        else:
            a = 0
            text = s.detok.text
            s.delta_text = ""
        ids = s.output_ids[a:]
        s.sent_tokens = len(s.output_ids)
        return CompletionOutput(
            index=s.index, text=text, token_ids=list(ids), finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            logprobs=list(s.lps[a:]) if want_lp else None, top_logprobs=list(s.tops[a:]) if want_lp else None,
            cumulative_logprob=s.cum_lp if want_lp else None)

    def _emit(self) -> list:
        out = []
        for rid, g in self._touched.items():
            fin = g.finished
            if g.output_kind == "final":
                if not fin or g.emitted_final:
                    continue
                comps = [self._completion(s, False) for s in g.seqs]
            else:
                comps = [self._completion(s, True) for s in g.seqs
                         if s.sent_tokens < len(s.output_ids) or s.delta_text or
                         (s.status == FINISHED and not s.sent_final)]
                for s in g.seqs:
                    if s.status == FINISHED:
                        s.sent_final = True
                if not comps and not fin:
                    continue
            if fin:
                g.emitted_final = True
                self._groups.pop(rid, None)
            error = next((s.error for s in g.seqs if s.error), None)
            plp = None
            s0 = g.seqs[0]
            if s0.want_plp and s0.plp_missing == 0 and not g.sent_plp:
                plp, g.sent_plp = list(s0.plp), True
            out.append(RequestOutput(rid, g.prompt, g.prompt_ids, comps, fin, self._group_metrics(g), error, plp))
        self._touched = {}
        return out

    def _group_metrics(self, g: _Group) -> dict:
        firsts = [s.first_token_time for s in g.seqs if s.first_token_time is not None]
        return {"arrival_time": g.arrival, "ttft_s": (min(firsts) - g.arrival_perf) if firsts else None,
                "e2e_s": (g.finished_time - g.arrival_perf) if g.finished_time is not None else None,
                "prompt_tokens": len(g.prompt_ids),
                "completion_tokens": sum(len(s.output_ids) for s in g.seqs),
                "num_preemptions": sum(s.num_preemptions for s in g.seqs)}

    # ------------------------------------------------------------------------------------ metrics
    def throughput(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        if not self._gen_times:
            return 0.0
        now = time.perf_counter()
        pts = [(t, n) for t, n in self._gen_times if now - t <= window]
        if len(pts) < 2:
            return 0.0
        span = pts[-1][0] - pts[0][0]
        return sum(n for _, n in pts[1:]) / span if span > 0 else 0.0

    def _log_decode(self) -> None:
        t, n0 = self._last_log
        now = time.perf_counter()
        gen = self.metrics["generation_tokens"]
        tput = (gen - n0) / (now - t) if now > t else 0.0
        self._last_log = (now, gen)
        a = self.allocator
        log.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                 "#queue-req: %d, #preempted: %d (%s)", len(self._running), a.used_pages * self.ccfg.page_size,
                 a.used_pages / a.capacity, tput, self.num_waiting, self.metrics["num_preemptions"],
                 ", ".join(f"{r} {n}" for r, n in self.preemptions.items()))

    def stats(self) -> dict:
        """Metrics for the server: requests, token usage, throughput, latencies, cache hit rate."""
        a = self.allocator
        m = dict(self.metrics)
        computed = m["computed_prompt_tokens"] + m["shared_prompt_tokens"]
        return {
            "num_running_reqs": len({s.group.rid for s in self._running}),
            "num_running_seqs": len(self._running),
            "num_queue_reqs": self.num_waiting,
            "num_used_tokens": a.used_pages * self.ccfg.page_size,
            "max_total_num_tokens": a.capacity * self.ccfg.page_size,
            "token_usage": a.used_pages / a.capacity,
            "gen_throughput": self.throughput(),
            "cache_hit_rate": (m["shared_prompt_tokens"] / computed) if computed else 0.0,
            "ttft_s": list(self.ttft),
            "itl_s": list(self.itl),
            "e2e_s": list(self.e2e),
            "num_compilations": self.num_compilations(),
            "preemptions_by_reason": dict(self.preemptions),
            **m,
        }
