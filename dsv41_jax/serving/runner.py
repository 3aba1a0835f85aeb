"""The runner: owns the device state and launches the jitted steps (plain and DSpark).

It holds the model parameters (loaded or given), the cache pytree (donated through every step; with
DSpark, plus the draft's rings), the page allocator (`SharedPageAllocator`, host-side: the scheduler
asks it for room, the runner's launches read its page tables), the per-slot sampling tensors and the
``last_token`` array the overlap schedule reads decode inputs from. `Runner.execute` runs one
`messages.Schedule` (frozen; only read) as device launches, asynchronously, and returns a
`messages.StepResult` at once (device arrays the output processor reads later):

The model family's side (cache layout, slot reset, memory bytes, the jitted step) is `model_step.ModelStep`,
chosen once from the config: `decode.extend` for V4.1, `v4.decode.extend` for DeepSeek-V4 (below, "extend").

- `Launch` [B, T]: first-token fill from ``last_token`` (decode rows whose input is still on the
  device), `decode.extend` (with DSpark: `dspark.extend_seeding`, which also writes the draft rings of
  every committed token), then sampling on the device (`_sample_rows`, constraint masks applied).
  A launch with prompt-logprob rows runs the all-logits variant and reduces on the device. With
  ``--enable-decoder-swa-bounded-replay`` a launch of more than one token per row runs
  `decode.extend_bounded` instead (layers after the last store layer only on each row's tokens at or
  after ``tail_lo`` = prompt length − sliding_window; one-token launches, i.e. decode, are unchanged).
- `SpecLaunch` [B, γ+1]: handed to the speculator (`speculator.DSparkSpeculator.launch`: one jitted
  verify-then-commit step per batch bucket; accept lengths are values) with the runner's
  `messages.DeviceState`, which it returns updated with the launch's result. Speculation is behind the
  `speculator.Speculator` seam (`NoSpeculation` without DSpark): it also gives the step plain
  launches run and the per-slot state it keeps in the cache.
- fork copies (`_fork_slot`), slot resets and sampling-row writes for admitted samples, the
  prefix cache's snapshot saves / restores and HiCache spills / loads, and the imports of states
  prefilled by another engine (`ImportOp`, `import_slot`; `handover`) — one method per op type
  (`_run_op`).

Set-up runs in steps with one job each (`__init__`: configure, load, place, plan memory, build the
cache, build the features).

Every (batch, tokens) bucket, and with DSpark the verify step per batch bucket, is compiled in
`warmup`; steady-state serving never compiles (tests count `num_compilations`).

DSpark (``--speculative-algorithm DSPARK``) is refused at start-up (EngineError, naming the reason)
with a checkpoint without DSpark stages, a block size above the checkpoint's and --enable-mixed-chunk.
On a mesh (--tp-size / --ep-size > 1) every feature runs: the DSpark rings and the prefix cache's
snapshot pool are placed by the cache's rules (`parallel.rules.state_shardings`), the DSpark steps
run the target's forward on the mesh as the plain step does and hold the cache to its shardings.
``--speculative-simulate-accept-length L`` (performance runs only) forces each DSpark row to commit
L tokens per step (floor/ceil by a seeded stream around a fractional L) whatever the verifier says:
the *drafts* are committed as if accepted, so the text is garbage and only the timing means anything.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import time
import zlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model.numerics import mode_name
from dsv41_jax.serving import dp_layout, model_step
from dsv41_jax.serving import sampling as smp
from dsv41_jax.serving.engine_args import MTP_ALGORITHMS, EngineArgs
from dsv41_jax.serving.engine_metrics import CacheLoads
from dsv41_jax.serving.messages import (DeviceState, ForkOp, ImportOp, Launch, LaunchResult, LoadOp, RestoreOp,
                                        SaveOp, Schedule, SpecLaunch, SpillOp, StepResult)
from dsv41_jax.serving.prefix_cache import PrefixCache, default_snapshot_rows
from dsv41_jax.serving.request import EngineError
from dsv41_jax.serving.sampling import SamplingTensors

__all__ = ["Runner", "SharedPageAllocator"]

log = logging.getLogger("dsv41_jax.engine")

_ADMIT_ROWS = 8  # slot resets / sampling-row updates are dispatched in groups of this many (one shape)
_CPU_MEM_FRACTION = 0.5
_ACCEL_MEM_FRACTION = 0.85


# ----------------------------------------------------------------------------------------------------
# Pages with sharing
# ----------------------------------------------------------------------------------------------------


class SharedPageAllocator(kvc.PageAllocator):
    """`PageAllocator` whose pages may be shared by several requests (reference counted).

    `share(src, dst, n)` gives ``dst`` the first ``n`` pages of ``src`` (they must be full and never
    written again); a page returns to the free list when its last holder frees it.

    ``reclaimer`` (None, or the prefix cache's controller `prefix_cache.PrefixCache`, which sets itself):
    pages it could give back count as free (`free_pages`), an `ensure` short of free-list pages asks
    it to ``reclaim`` them first, and every change of the page references is reported to it
    (``touch``).

    ``first_page``: the pages it hands out are ``first_page + 1 .. first_page + num_pages − 1`` (a dp
    rank's block, `cache.rank_pages`; ``first_page`` itself is the rank's null page, never handed out).
    0: the whole pool, page 0 null (dp = 1)."""

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int, first_page: int = 0):
        super().__init__(num_pages, page_size, max_pages_per_seq)
        self.first_page = first_page
        if first_page:
            self._free = [p + first_page for p in self._free]
        self._refs: dict = {}
        self.reclaimer = None

    def ensure(self, rid, num_tokens: int) -> list:
        before = len(self._tables.get(rid, []))
        need = max(0, -(-num_tokens // self.page_size) - before)
        if (self.reclaimer is not None and need > len(self._free)
                and -(-num_tokens // self.page_size) <= self.max_pages_per_seq):
            self.reclaimer.reclaim(need)
        # (new pages come off the free list: no cache entry holds them, the reclaimable count is unchanged)
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
        if self.reclaimer is not None:
            self.reclaimer.touch()

    def _release(self, pages) -> int:
        """Drop one reference to each page; those no one holds any more go back to the free list."""
        released = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                released.append(p)
        self._free.extend(reversed(released))
        if self.reclaimer is not None:
            self.reclaimer.touch()
        return len(released)

    @property
    def free_pages(self) -> int:
        """Pages on the free list, plus those the reclaimer (the prefix cache) alone holds."""
        return len(self._free) + (self.reclaimer.reclaimable() if self.reclaimer is not None else 0)

    @property
    def used_pages(self) -> int:
        """Pages requests (or pinned cache entries) need; what the cache alone holds counts as free."""
        return self.capacity - self.free_pages

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
        null = self.first_page
        if null in free or null in counts:
            raise AssertionError(f"the null page {null} was handed out")
        if any(not null < p < null + self.num_pages for p in set(counts) | free):
            raise AssertionError(f"a page outside {null + 1}..{null + self.num_pages - 1} was handed out")
        if set(counts) & free:
            raise AssertionError(f"pages both live and free: {sorted(set(counts) & free)}")
        if len(counts) + len(free) != self.capacity:
            raise AssertionError(f"{self.capacity - len(counts) - len(free)} pages lost")
        if self.reclaimer is not None:
            self.reclaimer.check_invariants()


# ----------------------------------------------------------------------------------------------------
# Jitted device helpers (module level: shared by every engine, compiled once per shape)
# ----------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("max_logprobs", "deterministic"), donate_argnums=(1, 2))
def _sample_rows(logits, slot_tensors, last_token, slots, step_counter, sample_mask, allowed, *, max_logprobs,
                 deterministic=False):
    """Sample the rows of a launch from their slots' tensors; scatter tokens into ``last_token`` and
    the penalty counts. Rows with ``sample_mask`` False change nothing. ``deterministic``: the
    sampler's fp64 sums (`sampling` module doc)."""
    n_rows = last_token.shape[0]
    t = jax.tree.map(lambda a: a[slots], slot_tensors)
    t = t.replace(valid=t.valid & sample_mask)
    x = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
    tokens, lp, (top_ids, top_vals) = smp.sample(x, t, step_counter, max_logprobs=max_logprobs,
                                                 deterministic=deterministic)
    rows = jnp.where(sample_mask, slots, n_rows)  # out of range: dropped
    counts = slot_tensors.output_counts.at[rows, tokens].add(1, mode="drop")
    last = last_token.at[rows].set(tokens, mode="drop")
    return tokens, lp, top_ids, top_vals, slot_tensors.replace(output_counts=counts), last


@functools.partial(jax.jit, static_argnames=("k", "deterministic"))
def _prompt_logprobs(logits, targets, *, k, deterministic=False):
    """Per-position scoring of a prefill launch on the device.

    logits: fp32 [B, T, V] (every position of each chunk); targets: int32 [B, T], the prompt token
    that follows each position. Returns (logprob fp32 [B, T] of the target, top-k ids int32
    [B, T, k], top-k logprobs fp32 [B, T, k]) from log_softmax over V (ties: lower id first; its sum
    in fp64 with ``deterministic``)."""
    lsm = smp.log_softmax(logits.astype(jnp.float32), deterministic)
    lp = jnp.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0]
    top_vals, top_ids = jax.lax.top_k(lsm, k)
    return lp, top_ids.astype(jnp.int32), top_vals


@jax.jit
def _last_logits(logits, n_new):
    """[B, T, V] -> [B, V] at each row's last real token (what the last-only variant returns)."""
    last = jnp.maximum(n_new - 1, 0)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


def _first_token(tokens, from_prev, slot, last_token):
    """tokens[:, 0] ← last_token[slot] where from_prev (decode rows whose input is still on device)."""
    return tokens.at[:, 0].set(jnp.where(from_prev, last_token[slot], tokens[:, 0]))


_fill_first_token = jax.jit(_first_token)


@functools.lru_cache(maxsize=None)
def _fill_first_token_rows(mesh):
    """`_first_token` with its tokens split over "dp" (a data-parallel mesh: the step's batch rows are)."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(_first_token, out_shardings=NamedSharding(mesh, PartitionSpec("dp")))


@functools.lru_cache(maxsize=None)
def _gather_to_all(mesh):
    """Identity with every output replicated on ``mesh``: a launch's results (tokens, logprobs) made
    readable on each process of a multi-process engine (`multihost`; a dp-split array is not). Every
    process calls it, so the gather runs inside a step all of them enqueue."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, PartitionSpec()))


@functools.partial(jax.jit, static_argnames=("reset",), donate_argnums=(0,))
def _reset_rows(state, slots, pad_id, *, reset):
    """``reset`` (the model step's `reset_slots`) on the slots ``slots``, jitted (one shape: `_ADMIT_ROWS`)."""
    return reset(state, slots, pad_id)


# per-slot rows of the cache pytree (window rings, partial groups, Engram history, DSpark rings)
_SLOT_ROW_KEYS = ("window", "partial", "engram_hist", "dspark", "mtp")  # "mtp": V4's MTP state (mtp_speculative)


def _slot_rows(state) -> dict:
    return {k: state[k] for k in _SLOT_ROW_KEYS if k in state}


def empty_snapshots(state, num_rows: int, mesh=None) -> dict:
    """The prefix cache's snapshot pool: the per-slot rows of ``state`` with ``num_rows`` rows
    (each leaf [num_rows, ...] where the cache's is [max_slots + 1, ...]); on a mesh placed by the
    cache's own rules (`rules.state_shardings`: the row axis split as the slot axis is)."""
    snaps = jax.tree.map(lambda a: np.zeros((num_rows,) + a.shape[1:], a.dtype), _slot_rows(state))
    if mesh is None:
        return jax.tree.map(jnp.asarray, snaps)
    from dsv41_jax.parallel import rules

    return rules.place_state(snaps, mesh)


@functools.partial(jax.jit, donate_argnums=(0,))
def _save_snapshot(snaps, state, slot, row):
    """snaps[row] ← slot ``slot``'s rows of the cache (a prefix-cache entry's snapshot)."""
    return jax.tree.map(lambda s, a: s.at[row].set(a[slot]), snaps, _slot_rows(state))


def _copy_page(state: dict, src_page, dst_page, page_size: int, ratios) -> dict:
    """``state`` with pool page ``src_page``'s compressed-latent and index-key entries copied to ``dst_page``."""
    r_of = dict(ratios)

    def page_copy(store, r):
        n = page_size // r

        def one(a):
            z = (0,) * (a.ndim - 1)
            blk = jax.lax.dynamic_slice(a, (src_page * n,) + z, (n,) + a.shape[1:])
            return jax.lax.dynamic_update_slice(a, blk, (dst_page * n,) + z)

        return jax.tree.map(one, store)

    out = dict(state)
    out["comp"] = {k: page_copy(v, r_of[k]) for k, v in state["comp"].items()}
    out["ikeys"] = {k: page_copy(v, r_of[k]) for k, v in state["ikeys"].items()}
    return out


@functools.partial(jax.jit, static_argnames=("page_size", "ratios"), donate_argnums=(0,))
def _restore_snapshot(state, snaps, row, slot, src_page, dst_page, *, page_size, ratios):
    """Slot ``slot``'s rows ← snaps[row], and page ``src_page`` copied to ``dst_page`` (a prefix-cache hit)."""
    out = _set_slot_rows(state, jax.tree.map(lambda s: s[row], snaps), slot)
    return _copy_page(out, src_page, dst_page, page_size, ratios)


@functools.partial(jax.jit, static_argnames=("page_size", "ratios"))
def _gather_page(state, page, *, page_size, ratios):
    """HiCache spill: pool page ``page``'s compressed-latent / index-key entries (a copy)."""
    r_of = dict(ratios)

    def blk(store, r):
        n = page_size // r
        return jax.tree.map(lambda a: jax.lax.dynamic_slice(a, (page * n,) + (0,) * (a.ndim - 1),
                                                            (n,) + a.shape[1:]), store)

    return {"comp": {k: blk(v, r_of[k]) for k, v in state["comp"].items()},
            "ikeys": {k: blk(v, r_of[k]) for k, v in state["ikeys"].items()}}


@functools.partial(jax.jit, static_argnames=("page_size", "ratios"), donate_argnums=(0,))
def _scatter_page(state, blocks, page, *, page_size, ratios):
    """HiCache load: `_gather_page`'s ``blocks`` written into pool page ``page``."""
    r_of = dict(ratios)

    def put(store, b, r):
        n = page_size // r
        return jax.tree.map(lambda a, x: jax.lax.dynamic_update_slice(a, x.astype(a.dtype),
                                                                      (page * n,) + (0,) * (a.ndim - 1)), store, b)

    out = dict(state)
    out["comp"] = {k: put(v, blocks["comp"][k], r_of[k]) for k, v in state["comp"].items()}
    out["ikeys"] = {k: put(v, blocks["ikeys"][k], r_of[k]) for k, v in state["ikeys"].items()}
    return out


@jax.jit
def _get_snapshot(snaps, row):
    return jax.tree.map(lambda s: s[row], snaps)


def _set_slot_rows(state: dict, rows: dict, slot) -> dict:
    """``state`` with slot ``slot``'s per-request rows (`_slot_rows`) replaced by ``rows``."""
    out = dict(state)
    out.update(jax.tree.map(lambda a, r: a.at[slot].set(r.astype(a.dtype)), _slot_rows(state), rows))
    return out


@jax.jit
def _get_slot_rows(state, slot):
    """Slot ``slot``'s per-request rows of the cache (a copy; `_slot_rows` keys)."""
    return jax.tree.map(lambda a: a[slot], _slot_rows(state))


@functools.partial(jax.jit, donate_argnums=(0,))
def _put_snapshot(state, rows, slot):
    """HiCache load: slot ``slot``'s rows ← a snapshot row brought back from the host."""
    return _set_slot_rows(state, rows, slot)


@functools.partial(jax.jit, static_argnames=("page_size", "ratios"), donate_argnums=(0,))
def _fork_slot(state, src, dst, src_page, dst_page, *, page_size, ratios):
    """Copy slot ``src``'s rows to slot ``dst`` and page ``src_page``'s pool entries to ``dst_page``."""
    row = lambda a: a.at[dst].set(a[src])  # noqa: E731
    out = dict(state)
    out["window"] = jax.tree.map(row, state["window"])
    out["partial"] = {k: jax.tree.map(row, v) for k, v in state["partial"].items()}
    if "engram_hist" in state:
        out["engram_hist"] = row(state["engram_hist"])
    out = _copy_page(out, src_page, dst_page, page_size, ratios)
    if "dspark" in state:  # the DSpark rings hold the prompt's draft KV, per slot
        out["dspark"] = [jax.tree.map(row, r) for r in state["dspark"]]
    if "mtp" in state:  # DeepSeek-V4's MTP ring and last target streams, per slot
        out["mtp"] = jax.tree.map(row, state["mtp"])
    return out


# ----------------------------------------------------------------------------------------------------
# Runner
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


def _bytes_by_device(tree) -> dict:
    """{device: bytes of the shards of ``tree``'s device arrays it holds} (host arrays are not counted)."""
    per: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        sh = getattr(x, "sharding", None)
        if sh is None:
            continue
        n = int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize
        for d in sh.device_set:
            per[d] = per.get(d, 0) + n
    return per


def _bytes_per_device(tree) -> int:
    """The most bytes of ``tree``'s leaves any one device holds (their shards; a leaf on one device: all)."""
    return max(_bytes_by_device(tree).values(), default=0)



class Runner:
    """Device state and launches (see the module docstring). Built by `Engine`; single-threaded."""

    def __init__(self, args: EngineArgs, *, cfg=None, params=None):
        """Set-up in steps, one job each: `_configure` (the config, the mesh, what is refused before any
        weight is read), `_load_params`, `_place` (onto the mesh / the host table, layer runs
        stacked), `_plan_memory` (the KV pool, the snapshot pool), `_build_cache` (the cache pytree and
        the per-slot tensors), `_build_features` (the speculator and the steps, the prefix cache with its
        host tier)."""
        self.args = args
        t0 = time.perf_counter()
        self.cfg = self._configure(cfg)
        self.params = self._place(self._load_params(params))
        self.vocab_size = self.cfg.vocab_size
        self.pad_compressed_id = (int(np.asarray(self.params["derived"]["engram_token_map"])
                                      [self.cfg.engram_pad_token_id]) if self.cfg.engram_layer_ids else 0)
        self.load_time = time.perf_counter() - t0
        self.ccfg, self.memory_plan = self._plan_memory()
        self._check_same_plan()  # (several processes: before anything sized by the plan is placed)
        self.model_step = self._step_cls(self.cfg, self.ccfg, self.step_mesh, self.engram_host_table)
        self.context_length = self.memory_plan["context_length"]  # per request (prompt + output)
        self.dp = self.ccfg.dp  # data-parallel attention ranks (--dp-size; 1: off)
        self.max_slots = self.ccfg.max_slots
        self.scratch = kvc.scratch_slot(self.ccfg, 0)  # (dp = 1: max_slots)
        self.max_logprobs = min(args.max_logprobs, self.vocab_size)
        self.speculator = self._make_speculator()
        self.expert_recorder = self._make_recorder()
        self._build_cache()
        self._build_features()
        self.launches = 0
        self.channel = self._connect_processes()
        self.memory_by_device = self.memory_per_device()
        for d, m in self.memory_by_device.items():
            log.info("memory on %s: parameters %.1f MiB (DSpark draft %.1f), KV pool + window rings %.1f MiB, "
                     "DSpark rings %.1f MiB, prefix-cache snapshot pool %.1f MiB; host tier %.1f MiB of host memory",
                     d, m["params"] / 2**20, m["draft_params"] / 2**20, m["kv"] / 2**20, m["draft_rings"] / 2**20,
                     m["snapshots"] / 2**20, m["host_tier"] / 2**20)

    def _check_same_plan(self) -> None:
        """With several processes: they must plan the same cache (the memory plan reads this machine's memory)
        and compile the same buckets, else their programs differ (a collective of other sizes aborts)."""
        if self.processes == 1:
            return
        from jax.experimental import multihost_utils

        rows = getattr(self, "_planned_snapshot_rows", None)
        rows = self._snapshot_rows() if rows is None else rows
        # (the compiled buckets too: a follower compiling other shapes than the leader's would run other programs)
        a = self.args
        buckets = zlib.crc32(repr((a.resolved_batch_buckets(), a.resolved_token_buckets(), a.page_size,
                                   a.max_running_requests, a.max_logprobs)).encode()) % (1 << 31)
        plan = [self.ccfg.num_pages, self.ccfg.max_pages_per_seq, rows, self.memory_plan["context_length"], buckets]
        try:
            multihost_utils.assert_equal(np.asarray(plan, np.int32), "")
        except AssertionError:
            raise EngineError(f"{self.processes} processes planned different engines (pages, pages per request, "
                              "snapshot rows, context length, a hash of the buckets / page size / slots / logprobs; "
                              f"this process: {plan}): give every process the same flags, with --max-total-tokens "
                              "and --context-length explicit") from None

    def _connect_processes(self):
        """With several processes: the leader's step channel (`multihost.StepChannel`); None for one process."""
        if self.processes == 1:
            return None
        from dsv41_jax.serving.multihost import StepChannel

        self._batch_shardings = None
        if self.mesh is not None:
            from dsv41_jax.parallel import rules

            self._batch_shardings = rules.batch_shardings(self.mesh)
        return StepChannel.connect()

    @property
    def is_follower(self) -> bool:
        """A follower process of a multi-process engine: it only executes the leader's schedules (`follow`)."""
        return self.channel is not None and not self.channel.is_leader

    def follow(self) -> int:
        """A follower's loop (`multihost.follow`): execute the leader's schedules until it stops."""
        from dsv41_jax.serving.multihost import follow

        return follow(self)

    def shutdown(self) -> None:
        """The leader tells its followers to stop (a multi-process engine); nothing for one process."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.close()

    def _place_batch(self, batch: dict) -> dict:
        """The step's host batch as it is passed: numpy on one process (the jit fast path), global arrays on
        the batch's shardings with several (a numpy argument to a step split over another process's
        devices is refused by jit)."""
        if self.processes == 1:
            return batch
        return jax.device_put(batch, {k: self._batch_shardings[k] for k in batch})

    def _put(self, x):
        """A host array onto the device(s): replicated over the mesh with several processes."""
        if self.processes == 1:
            return jax.device_put(x)
        from dsv41_jax.parallel import rules

        return jax.device_put(x, rules.replicated(self.mesh))

    def memory_per_device(self) -> dict:
        """{device: {"params", "draft_params" (the DSpark stages, part of params), "kv" (the cache pytree
        without the DSpark rings), "draft_rings", "snapshots" (the prefix cache's snapshot pool),
        "host_tier" (HiCache: host bytes of its page pool when full, one copy)}} in bytes."""
        params = _bytes_by_device(self.params)
        draft = _bytes_by_device(self.params.get("mtp") or []) if self.spec_gamma else {}
        kv = _bytes_by_device({k: v for k, v in self.state.items() if k not in ("dspark", "mtp")})
        rings = _bytes_by_device((self.state.get("dspark") or [], self.state.get("mtp") or {}))
        snaps = _bytes_by_device(self.snaps) if self.snaps is not None else {}
        # (one host copy: the cache is replicated, so every device's shards are the same bytes; each host
        # entry also keeps its snapshot row, one row's bytes per entry, not counted here)
        host = int(self.dp * self.host_pages * self.ccfg.page_size * self.memory_plan["bytes_per_token"])
        return {d: {"params": params.get(d, 0), "draft_params": draft.get(d, 0), "kv": kv.get(d, 0),
                    "draft_rings": rings.get(d, 0), "snapshots": snaps.get(d, 0), "host_tier": host}
                for d in sorted(set(params) | set(kv), key=str)}

    # ------------------------------------------------------------------------------------ setup
    def _configure(self, cfg):
        """The model config as the flags ask (dtype, impl, deterministic), the mesh (an impossible one
        refused, MeshError), the Engram host table and DSpark's γ — all before any weight is read."""
        args = self.args
        from dsv41_jax.model.config import ModelConfig

        if cfg is None:
            cfg = ModelConfig.from_pretrained(args.model)
        if args.dtype != "auto" and cfg.act_dtype != args.act_dtype:
            cfg = cfg.replace(act_dtype=args.act_dtype)
        if cfg.impl != args.impl:
            cfg = cfg.replace(impl=args.impl)
        if args.enable_deterministic_inference and not cfg.deterministic:
            cfg = cfg.replace(deterministic=True)
        # jax.distributed with several processes: process 0 leads, the others execute its steps (`multihost`)
        self.processes = jax.process_count()
        if self.processes > 1:
            from dsv41_jax.serving import multihost

            multihost.refuse(args)
        # the model family's step (`model_step`): chosen once here, from the config
        self._step_cls = model_step.for_config(cfg)
        self._step_cls.refuse(args, cfg)
        log.info("model family %s: %s", cfg.model_family, self._step_cls(cfg).describe())
        try:
            chosen = args.resolved_impl()
        except ValueError as e:
            raise EngineError(f"--impl {args.impl!r}: {e}") from None
        log.info("impl %r: %s", args.impl, ", ".join(f"{op}={name}" for op, name in chosen.items()))
        # the sampler's fp64 vocabulary sums (static in its jits): in the deterministic mode and in exact mode,
        # whose logprobs would otherwise part in the last fp32 bit between the programs XLA builds for one
        # device and for a mesh (issue 49: prefix-cache hits on --tp 2 --ep 4 with DSpark, 1 ulp)
        self.deterministic = bool(cfg.deterministic) or cfg.act_dtype == "exact"
        if cfg.deterministic:
            log.warning("deterministic inference ON (--enable-deterministic-inference): numerics %s — activations "
                        "rounded as in the %s flow, every order-sensitive sum accumulated in fp64, Pallas kernels "
                        "off, the sampler's sums in fp64: a request's tokens and logprobs do not depend on the batch, "
                        "chunking, cache hits, preemption, speculation or the mesh", mode_name(cfg), cfg.act_dtype)
        # --tp / --ep / --dp-size: tp = ep = dp = 1 runs unsharded on the default device. Data-parallel ranks
        # run on the [dp, tp] mesh (each rank's rows and state on its own tp group, `parallel.dp`); on a
        # machine with ONE device and tp = ep = 1 the rank-major schedule runs there as it is (the DP
        # contract: an ordinary schedule, the same results; the server refuses that, `check_devices`)
        self.mesh = None
        D = args.dp_size
        one_device = D > 1 and args.tp_size == args.ep_size == 1 and len(jax.devices()) == 1
        if (args.tp_size != 1 or args.ep_size != 1 or D > 1) and not one_device:
            from dsv41_jax.parallel.mesh import make_mesh

            self.mesh = make_mesh(args.tp_size, args.ep_size, dp=D, cfg=cfg)
        elif one_device:
            log.info("--dp-size %d on one device: the %d ranks' schedules run there (no dp mesh)", D, D)
        from dsv41_jax.parallel.host_table import host_table_requested

        self.engram_host_table = bool(cfg.engram_layer_ids) and host_table_requested(args.engram_host_table)
        self.spec_gamma = self._check_speculative(cfg)
        self.par = self._mesh_plan(cfg)
        L = args.speculative_simulate_accept_length  # (EngineArgs refuses it without DSpark)
        self.simulate_accept_length = float(L) if L is not None and self.spec_gamma else None
        if self.simulate_accept_length is not None:
            if not 1.0 <= L <= self.spec_gamma + 1:
                raise EngineError(f"simulated accept length {L}: must be in 1..{self.spec_gamma + 1} (γ + 1)")
            log.warning("DSpark: simulated accept length %.2f (PERFORMANCE RUNS ONLY: drafts are committed "
                        "unverified, the text is meaningless)", L)
        return cfg

    def _mesh_plan(self, cfg):
        """The mesh plan the steps run (None: one device): with --ep-num-redundant-experts R its expert location
        (`experts.plan_location`: the distribution file read and placed, or EngineError before any weight is
        read). The steps are handed the plan only then (else the mesh itself, as the jitted steps are keyed)."""
        from dsv41_jax.parallel.plan import MeshPlan
        from dsv41_jax.serving import experts

        par = MeshPlan.of(self.mesh)
        loc = experts.plan_location(self.args, cfg, par)
        if loc is None:
            return par
        try:
            return dataclasses.replace(par, expert_location=loc)
        except ValueError as e:  # the plan's own checks (the placement's device count)
            raise EngineError(str(e)) from None

    @property
    def step_mesh(self):
        """What the jitted steps are given: the mesh plan when it carries redundant experts, else the mesh."""
        return self.par if self.par is not None and self.par.expert_location is not None else self.mesh

    def _load_params(self, params):
        """The parameters: given, random for ``--model tiny``, or read from the checkpoint (straight onto
        the mesh's shardings: no whole-tensor copy on one device first)."""
        args, cfg = self.args, self.cfg
        if params is None:
            if args.model == "tiny" and not os.path.isdir(args.model):
                from dsv41_jax.model.params import init_params

                params = init_params(cfg, jax.random.key(args.random_seed))
            else:
                from dsv41_jax.parallel.plan import load_params

                params = load_params(args.model, cfg, self.mesh, engram_host_table=self.engram_host_table)
        if self.spec_gamma and len(params.get("mtp") or []) < cfg.num_nextn_predict_layers:
            what = "MTP layer" if self._mtp else "DSpark"
            raise EngineError(f"--speculative-algorithm {args.speculative_algorithm}: the checkpoint has no {what} "
                              f"parameters (mtp.*: {len(params.get('mtp') or [])} of {cfg.num_nextn_predict_layers} "
                              "loaded)")
        return params

    def _place(self, params):
        """Parameters onto the mesh by the rules (the DSpark stages too) or the Engram tables to the host;
        runs of plan-identical layers stacked once here, so the step's scans read them in place
        (stacking inside the step would copy their weights on every call); with redundant experts each MoE
        layer's routed experts stored as its E + R physical experts (`eplb.expand_params`)."""
        from dsv41_jax.parallel.host_table import offload_engram

        if self.mesh is not None:
            from dsv41_jax.parallel import rules

            params = rules.shard_params(params, self.cfg, self.mesh, engram_host_table=self.engram_host_table)
        elif self.engram_host_table:
            params = offload_engram(params)
        params = self._step_cls(self.cfg).prepare(params)
        if self.step_mesh is self.par and self.par is not None:  # redundant experts
            from dsv41_jax.parallel import eplb

            params = eplb.expand_params(params, self.par.expert_location)
        return params

    def _make_recorder(self):
        """`experts.ExpertRecorder` with --expert-distribution-recorder, else None."""
        if not self.args.expert_distribution_recorder:
            return None
        from dsv41_jax.serving.experts import ExpertRecorder

        path = self.args.resolved_distribution_file
        log.info("expert distribution recorder ON: routed-expert counts of every launch, per MoE layer; written to "
                 "%s at shutdown and on POST /dump_expert_distribution_record", os.path.abspath(path))
        return ExpertRecorder(self.cfg.num_hidden_layers, self.cfg.n_routed_experts, path)

    def _make_speculator(self):
        """`speculator.DSparkSpeculator` with DSpark on, else `speculator.NoSpeculation`."""
        from dsv41_jax.serving.speculator import DSparkSpeculator, MTPSpeculator, NoSpeculation, V4DSparkSpeculator

        if not self.spec_gamma:
            return NoSpeculation(self.model_step)
        if self._mtp:
            return MTPSpeculator(self.cfg, self.ccfg, self.spec_gamma, self.args.random_seed, self.mesh)
        if self.cfg.model_family == "deepseek_v4":  # Flash-0731 / Pro-0813's DSpark head (V4Step.refuse: one device)
            return V4DSparkSpeculator(self.cfg, self.ccfg, self.spec_gamma, self.args.random_seed, self.mesh)
        return DSparkSpeculator(self.cfg, self.ccfg, self.spec_gamma, self.step_mesh, self.simulate_accept_length,
                                self.args.random_seed)

    def _build_cache(self) -> None:
        """The cache pytree (on the mesh by the rules; with the speculator's per-slot state), every slot
        reset, the per-slot sampling tensors and ``last_token``."""
        cfg, ccfg = self.cfg, self.ccfg
        self.state = self.speculator.seed_state(self.model_step.init_cache())
        self._check_rank_blocks()
        rows = kvc.slot_rows(ccfg)  # every rank's slots and its scratch row (dp = 1: max_slots + 1)
        self.reset_slots(list(range(rows)))
        self.slot_tensors = SamplingTensors.from_params([None] * rows, self.vocab_size)
        self.last_token = jnp.zeros((rows,), jnp.int32)
        if self.mesh is not None:
            # replicated on the mesh from the start, as every launch returns them: otherwise the first
            # launches (and the warm-up's precompile) see other input shardings than the later ones, and
            # jit traces and compiles each extend shape twice
            from dsv41_jax.parallel import rules

            if self.dp > 1:  # per-slot rows: rank blocks over "dp", as the cache's slot axis
                from jax.sharding import NamedSharding, PartitionSpec

                rep = NamedSharding(self.mesh, PartitionSpec("dp"))
            else:
                rep = rules.replicated(self.mesh)
            self.slot_tensors, self.last_token = jax.device_put((self.slot_tensors, self.last_token), rep)
        # the first-token fill of a launch, its tokens placed as the step's batch takes them
        self._fill = _fill_first_token_rows(self.mesh) if self.dp > 1 and self.mesh is not None else _fill_first_token
        self._allow_all: dict = {}
        self._ratios = tuple((k, cfg.compress_ratios[int(k)]) for k in sorted(self.state["comp"]))

    def _check_rank_blocks(self) -> None:
        """Every per-slot array of the cache has the rank blocks' rows (`cache.slot_rows`): with dp ranks a
        shorter one would drop the writes of the last ranks' slots. Refused at start-up (EngineError) rather than served wrong."""
        want = kvc.slot_rows(self.ccfg)
        for k in _SLOT_ROW_KEYS:
            for x in jax.tree_util.tree_leaves(self.state.get(k)):
                if x.shape[0] != want:
                    what = "--speculative-algorithm DSPARK" if k == "dspark" else f"the cache's {k!r} state"
                    raise EngineError(f"{what} with --dp-size {self.ccfg.dp}: its per-slot rows number {x.shape[0]}, "
                                      f"not the {want} of the dp rank blocks")

    def _build_features(self) -> None:
        """The steps plain launches run (the speculator's; SWA bounded replay when on) and the page
        allocator: with the radix prefix cache its snapshot pool (placed as the cache is) and host tier."""
        args, ccfg = self.args, self.ccfg
        self._extend = self._extend_step(False)  # with DSpark: also writes the draft rings
        self._extend_all = None  # the all-logits variant (prompt logprobs): made on first use
        self._extend_bounded = self._bounded_replay(self.cfg, ccfg)  # None unless --enable-decoder-swa-bounded-replay
        # the radix prefix cache (prefix_cache.py): one snapshot row per entry
        self.snapshot_rows = getattr(self, "_planned_snapshot_rows", None)
        if self.snapshot_rows is None:
            self.snapshot_rows = self._snapshot_rows()
        D, P_r = ccfg.dp, ccfg.num_pages // ccfg.dp
        self.host_pages = 0  # per rank
        if self.snapshot_rows and args.enable_hierarchical_cache:  # HiCache L2: R x the device pool, on the host
            self.host_pages = int(args.resolved_hicache_ratio() * (P_r - 1))
            log.info("hierarchical cache: host pool of %d pages%s (%.1f x the device pool)", self.host_pages,
                     f" per dp rank ({D} ranks)" if D > 1 else "", args.resolved_hicache_ratio())
        self._host_unsettled: list = []  # (rank, host-store key) whose device-to-host copies are in flight
        # one page allocator (and prefix cache, host tier, snapshot rows) per dp rank, over its own block
        self.allocators = [SharedPageAllocator(P_r, ccfg.page_size, ccfg.max_pages_per_seq,
                                               first_page=kvc.rank_pages(ccfg, r)[0]) for r in range(D)]
        self.allocator = self.allocators[0]
        if not self.snapshot_rows:
            self.prefix_caches = [None] * D
            self.prefix_cache = self.snaps = None
            return
        R_r = self.snapshot_rows // D
        self.prefix_caches = [PrefixCache(a, R_r, self.host_pages, first_row=r * R_r)
                              for r, a in enumerate(self.allocators)]
        self.prefix_cache = self.prefix_caches[0]
        self.snaps = empty_snapshots(self.state, self.snapshot_rows, self.mesh)
        log.info("radix prefix cache: %d snapshot rows (%.1f MiB per device)", self.snapshot_rows,
                 _bytes_per_device(self.snaps) / 2**20)
        # compile the two copies now (tiny programs), even with --skip-server-warmup, so that serving
        # never compiles on a first save / hit (row 0 and the scratch slot hold nothing yet)
        kw = dict(page_size=ccfg.page_size, ratios=self._ratios)
        self.snaps = _save_snapshot(self.snaps, self.state, np.int32(self.scratch), np.int32(0))
        self.state = _restore_snapshot(self.state, self.snaps, np.int32(0), np.int32(self.scratch), np.int32(0),
                                       np.int32(0), **kw)
        if self.host_pages:  # and the host tier's copies (page 0 is the null page: never read)
            blk = _gather_page(self.state, np.int32(0), **kw)
            self.state = _scatter_page(self.state, blk, np.int32(0), **kw)
            self.state = _put_snapshot(self.state, _get_snapshot(self.snaps, np.int32(0)), np.int32(self.scratch))

    def _extend_step(self, all_logits: bool):
        """The step plain launches run: the speculator's, or with --expert-distribution-recorder the step that
        also returns its routed-expert counts (`experts.jitted_extend_recording`; EngineArgs refuses the
        recorder with the speculator's own steps)."""
        if self.expert_recorder is None:
            return self.speculator.extend_step(all_logits)
        from dsv41_jax.parallel.plan import MeshPlan
        from dsv41_jax.serving import experts

        return experts.jitted_extend_recording(self.cfg, self.ccfg, all_logits, MeshPlan.of(self.step_mesh),
                                               self.engram_host_table)

    def _snapshot_rows(self) -> int:
        """Rows of the prefix cache's snapshot pool (--radix-cache-snapshots, default 4 per slot and at least
        64: `prefix_cache.default_snapshot_rows`); 0 (off) with --disable-radix-cache."""
        if self.args.disable_radix_cache:
            return 0
        rows = self.args.radix_cache_snapshots or default_snapshot_rows(self.args.max_running_requests)
        D = self.args.dp_size
        return -(-rows // D) * D  # rank blocks of equal size (dp = 1: as asked)

    def _bounded_replay(self, cfg, ccfg):
        """The SWA bounded replay step (`decode.extend_bounded`, late_tail = sliding_window) used for launches of
        more than one token per row, or None when --enable-decoder-swa-bounded-replay is off. EngineArgs has
        refused the combinations it does not implement; the attention kernel is checked here (the window
        lower bound has no Pallas kernel). Logs, once at start-up, what the mode does and that prompt
        logprobs are refused."""
        if not self.args.enable_decoder_swa_bounded_replay:
            return None
        from dsv41_jax.model import dispatch

        impl = dispatch.resolve(cfg, "attention")
        if dispatch.is_kernel(impl):
            raise EngineError(f"--enable-decoder-swa-bounded-replay: the attention op resolves to {impl!r}, which has "
                              "no kernel for the replay's window bound; pass e.g. --impl 'auto,attention=xla'")
        S = dec.last_store_layer(cfg)
        W = cfg.sliding_window
        log.warning("SWA bounded replay ON (--enable-decoder-swa-bounded-replay): prefill runs layers 0-%d on every "
                    "token and layers %d-%d only on each request's last %d prompt tokens; NOT numerically equal to "
                    "full prefill, so requests asking for prompt logprobs are refused (HTTP 400)", S, S + 1,
                    cfg.num_hidden_layers - 1, W)
        return dec.jitted_extend(cfg, ccfg, late_tail=W)

    def _extend_for(self, T: int):
        """The extend step a launch of T tokens per row runs: the bounded replay one for T > 1 when on (a
        one-token launch is decode: unchanged), else the plain one."""
        return self._extend_bounded if (self._extend_bounded is not None and T > 1) else self._extend

    def _tail_lo(self, rows, B: int) -> np.ndarray:
        """int32 [B]: each row's first position the bounded replay's late layers compute, max(0, prompt length −
        sliding_window) (its prompt's last W tokens: the window the first decode steps read); padded rows 0."""
        out = np.zeros((B,), np.int32)
        W = self.cfg.sliding_window
        for b, r in enumerate(rows):
            out[b] = max(0, r.prompt_len - W)
        return out

    def _check_speculative(self, cfg) -> int:
        """γ (DSpark proposals per step), 0 when off; EngineError naming any unsupported combination."""
        args = self.args
        self._mtp = args.speculative_algorithm in MTP_ALGORITHMS
        if args.speculative_algorithm is None:
            return 0
        if self._mtp:
            return self._check_mtp(cfg)
        name = "--speculative-algorithm DSPARK"
        if cfg.num_nextn_predict_layers < 1:
            raise EngineError(f"{name}: this checkpoint has no DSpark stages (num_nextn_predict_layers = 0, "
                              "no mtp.* parameters)")
        G = cfg.dspark_block_size
        gamma = G if args.speculative_dspark_block_size is None else args.speculative_dspark_block_size
        if not 1 <= gamma <= G:
            raise EngineError(f"--speculative-dspark-block-size {gamma}: the checkpoint's DSpark block is "
                              f"{G} (dspark_block_size); choose 1..{G}")
        if args.enable_mixed_chunk:
            raise EngineError(f"{name} with --enable-mixed-chunk: not supported (DSpark rows run as their own "
                              "[B, γ+1] launch)")
        return gamma

    def _check_mtp(self, cfg) -> int:
        """γ for --speculative-algorithm EAGLE / NEXTN (DeepSeek-V4's MTP layer); EngineError naming what is not
        supported (another model family, a checkpoint without the layer, a compressed MTP layer, mixed chunks)."""
        args = self.args
        name = f"--speculative-algorithm {args.speculative_algorithm}"
        if cfg.model_family != "deepseek_v4" or cfg.draft_kind != "mtp":
            raise EngineError(f"{name}: MTP speculation runs DeepSeek-V4's MTP layer; this checkpoint's draft is "
                              f"{cfg.draft_kind!r} (use --speculative-algorithm DSPARK)")
        if cfg.num_nextn_predict_layers != 1:
            raise EngineError(f"{name}: the checkpoint has {cfg.num_nextn_predict_layers} MTP layers; one is implemented")
        from dsv41_jax.model.config_v4 import draft_kinds

        if draft_kinds(cfg)[0] != "sliding":
            raise EngineError(f"{name}: a {draft_kinds(cfg)[0].upper()} MTP layer (the released one is sliding-window "
                              "only; a compressed one's paged state is not wired)")
        if args.enable_mixed_chunk:
            raise EngineError(f"{name} with --enable-mixed-chunk: not supported (speculative rows run as their own "
                              "[B, γ+1] launch)")
        return args.resolved_mtp_steps()

    def _plan_memory(self):
        args, cfg = self.args, self.cfg
        ps, S = args.page_size, args.max_running_requests
        D = args.dp_size  # data-parallel attention: the pool and the slots split into D equal rank blocks
        mode = args.cache_dtype
        want_ctx = args.context_length or cfg.max_position_embeddings
        ctx = -(-want_ctx // ps) * ps
        b = self._step_cls(cfg).kv_bytes_per_token(mode)
        info = {"page_size": ps, "max_running_requests": S, "bytes_per_token": b["per_token"],
                "window_bytes": (S + D) * b["window_per_request"]}
        if args.max_total_tokens:
            pages = -(-args.max_total_tokens // ps)
            num_pages = (-(-pages // D) + 1) * D  # each rank: its share of the pages + its null page (D = 1: pages + 1)
            info["source"] = "--max-total-tokens"
        else:
            total, source, default_frac = _device_memory_bytes(args)
            frac = args.mem_fraction_static if args.mem_fraction_static is not None else default_frac
            weights = _bytes_per_device(self.params)  # per device: a mesh splits them
            budget = int(total * frac) - weights
            # the prefix cache's snapshot rows hold per-slot rows (windows, and with DSpark its rings): taken
            # from the budget; by default at most a quarter of it (fewer rows, or none: cache off, logged)
            rows = self._snapshot_rows()
            per_row = b["window_per_request"] + (b["dspark_window_per_request"] if self.spec_gamma else 0)
            if rows and self.args.radix_cache_snapshots is None:
                rows = min(rows, max(0, int(budget * 0.25 // per_row)))
                rows -= rows % D
                if rows < self._snapshot_rows():
                    log.info("radix prefix cache: %d snapshot rows fit a quarter of the KV budget", rows)
            self._planned_snapshot_rows = rows
            budget -= int(rows * per_row)
            plan = kvc.plan_memory(cfg, budget, page_size=ps, max_slots=S, max_context=ctx, kv_cache_dtype=mode,
                                   bytes_per_token=b)
            num_pages = min(plan["num_pages"] // D, (S // D) * (ctx // ps) + 1) * D
            info.update(source=f"{frac:.2f} x {source} ({total / 2**30:.1f} GiB) - weights {weights / 2**20:.1f} MiB",
                        budget_bytes=budget)
        num_pages = max(num_pages, 2 * D)
        ctx = min(ctx, (num_pages // D - 1) * ps)  # a request lives in one rank's pool
        if min(ctx, want_ctx) < 2:
            raise EngineError("the KV pool is too small for a single request")
        ccfg = kvc.CacheConfig(page_size=ps, num_pages=num_pages, max_slots=S, max_pages_per_seq=ctx // ps,
                               kv_cache_dtype=mode, dp=D)
        try:
            ccfg.validate(cfg)
        except ValueError as e:
            raise EngineError(f"KV cache layout: {e}") from None
        info.update(num_pages=num_pages, pool_tokens=(num_pages - D) * ps, context_length=min(ctx, want_ctx),
                    pool_bytes=int(num_pages * ps * b["per_token"]), dp=D)
        log.info("KV cache (%s): page_size=%d, %d pages = %d tokens, pools %.1f MiB (%.0f B/token), window rings "
                 "%.1f MiB for %d slots, context_length=%d, kv_cache_dtype=%s, act dtype=%s", info["source"], ps,
                 num_pages - D, info["pool_tokens"], info["pool_bytes"] / 2**20, b["per_token"],
                 info["window_bytes"] / 2**20, S, info["context_length"], mode, cfg.act_dtype)
        if D > 1:  # each rank's share of the KV / state memory (on a dp mesh: what each rank's devices hold)
            for r in range(D):
                log.info("dp rank %d: slots %d..%d (scratch %d), pages %d..%d (%d tokens), KV pool %.1f MiB + window "
                         "rings %.1f MiB", r, kvc.rank_slots(ccfg, r)[0], kvc.rank_slots(ccfg, r)[-1],
                         kvc.scratch_slot(ccfg, r), kvc.rank_pages(ccfg, r)[0], kvc.rank_pages(ccfg, r)[-1],
                         (num_pages // D - 1) * ps, info["pool_bytes"] / D / 2**20, info["window_bytes"] / D / 2**20)
        return ccfg, info


    def _jitted(self) -> list:
        fns = [self._extend, _sample_rows, self._fill, _reset_rows, _fork_slot, smp._scatter_rows,
               _save_snapshot, _restore_snapshot, _gather_page, _scatter_page, _get_snapshot, _put_snapshot,
               _get_slot_rows]
        fns += self.speculator.jitted()
        if self._extend_all is not None:
            fns += [self._extend_all, _prompt_logprobs, _last_logits]
        if self._extend_bounded is not None:
            fns.append(self._extend_bounded)
        if self.processes > 1:
            fns.append(_gather_to_all(self.mesh))
        return fns

    def num_compilations(self) -> int:
        """Compiled variants held by the jitted functions the runner calls (extend, DSpark step,
        sampling, helpers)."""
        return int(sum(f._cache_size() for f in self._jitted()))

    def warmup(self, batch_buckets: list, token_buckets: list, prompt_logprobs: bool = False) -> int:
        """Compile every (batch, tokens) bucket, the DSpark step per batch bucket and the helpers, with a
        progress line per shape; with prompt_logprobs also the all-logits variant of every (batch,
        tokens) bucket (--warmup-prompt-logprobs). Returns the number of shapes."""
        shapes = [(B, T) for T in token_buckets for B in batch_buckets]
        if self.spec_gamma:
            shapes += [(B, -1) for B in batch_buckets]  # T = −1: the DSpark verify step
        self._precompile_extend([(B, T) for B, T in shapes if T >= 0])
        if prompt_logprobs and self._extend_all is None:
            self._extend_all = self._extend_step(True)
        for i, (B, T) in enumerate(shapes):
            ts = time.perf_counter()
            if T < 0:
                warm = SpecLaunch((), B, self.spec_gamma)
                self.device_state, _ = self.speculator.launch(self.params, self.device_state, warm, warm=True)
                what = f"DSpark draft + verify (tokens {self.spec_gamma + 1})"
            else:
                z = np.zeros((B,), np.int32)
                pad_slot, pad_pt = kvc.padding_slots(self.ccfg, B), kvc.padding_pages(self.ccfg, B)
                self._device_launch(None, np.zeros((B, T), np.int32), z, z, pad_slot, pad_pt, np.zeros((B,), bool),
                                    np.zeros((B,), bool), z, force_sample=(T == token_buckets[0]))
                what = f"tokens={T}"
                if prompt_logprobs:  # a prompt-logprobs launch whose rows also sample (every program it runs)
                    self._device_launch(None, np.zeros((B, T), np.int32), z, z, pad_slot, pad_pt,
                                        np.zeros((B,), bool), np.ones((B,), bool), z,
                                        targets=np.zeros((B, T), np.int32))
                    what += " (+ prompt logprobs)"
            jax.block_until_ready(self.state)
            log.info("warm-up [%d/%d] batch=%d %s: %.1fs", i + 1, len(shapes), B, what, time.perf_counter() - ts)
        self.reset_slots([self.scratch])
        self.slot_tensors = self.slot_tensors.update_slots([self.scratch] * _ADMIT_ROWS, [None] * _ADMIT_ROWS)
        self.state = _fork_slot(self.state, np.int32(self.scratch), np.int32(self.scratch), np.int32(0), np.int32(0),
                                page_size=self.ccfg.page_size, ratios=self._ratios)
        jax.block_until_ready(self.state)
        self.launches = 0
        return len(shapes)

    def _precompile_extend(self, shapes: list) -> None:
        """Lower and compile the extend step of every (B, T) in `shapes` concurrently, one thread per
        shape (at most one per CPU core), before the warm-up runs them one by one.

        XLA's compile and the persistent cache's executable load release the GIL, so on a warm start the
        shapes' executables load side by side instead of in turn (2 shapes: ~13 s → ~9 s on 2 cores).
        `jit` keeps what ``lower(...).compile()`` built for the same arguments, so the warm-up launches
        that follow reuse these executables (they compile nothing: `num_compilations` counts them once).
        The arguments are the ones `_device_launch` passes (same kinds, shardings and dtypes)."""
        if len(shapes) < 2:
            return
        import concurrent.futures as cf

        jobs = []
        for B, T in shapes:
            z = np.zeros((B,), np.int32)
            pad_slot = kvc.padding_slots(self.ccfg, B)
            toks = self._fill(np.zeros((B, T), np.int32), np.zeros((B,), bool), pad_slot, self.last_token)
            batch = {"tokens": toks, "start": z, "n_new": z, "slot": pad_slot,
                     "page_table": kvc.padding_pages(self.ccfg, B)}
            if self._extend_for(T) is self._extend_bounded:
                batch["tail_lo"] = z
            jobs.append(self._place_batch(batch))
        ts = time.perf_counter()
        workers = max(1, min(len(jobs), os.cpu_count() or 1))
        with CacheLoads() as loads, cf.ThreadPoolExecutor(workers, thread_name_prefix="warmup-compile") as ex:
            list(ex.map(lambda b: self._extend_for(b["tokens"].shape[1]).lower(self.params, self.state, b).compile(),
                        jobs))
        # say what happened: a warm start loads these from the persistent cache, it compiles nothing
        log.info("warm-up: %d extend shapes prepared in %d threads in %.1fs (%d compiled, %d loaded from the "
                 "compilation cache)", len(jobs), workers, time.perf_counter() - ts,
                 max(0, len(jobs) - loads.count), min(loads.count, len(jobs)))

    def reset_slots(self, slots: list) -> None:
        for i in range(0, len(slots), _ADMIT_ROWS):
            part = slots[i:i + _ADMIT_ROWS]
            part = part + [self.scratch] * (_ADMIT_ROWS - len(part))
            self.state = _reset_rows(self.state, np.asarray(part, np.int32), np.int32(self.pad_compressed_id),
                                     reset=self.model_step.reset_slots)

    def write_sampling(self, rows: tuple, eos_token_ids) -> None:
        """Write the sampling rows (`messages.SamplingRow`: parameters, prompt mask, counts of already
        generated tokens) of admitted samples into their slots."""
        for i in range(0, len(rows), _ADMIT_ROWS):
            part = list(rows[i:i + _ADMIT_ROWS])
            pad = _ADMIT_ROWS - len(part)
            slots = [r.slot for r in part] + [self.scratch] * pad
            plist = [r.params for r in part] + [None] * pad
            prompts = [list(r.prompt_ids) for r in part] + [None] * pad
            outs = [list(r.output_ids) for r in part] + [None] * pad
            self.slot_tensors = self.slot_tensors.update_slots(slots, plist, prompt_token_ids=prompts,
                                                               output_token_ids=outs, eos_token_ids=eos_token_ids)

    # ------------------------------------------------------------------------------------ execute
    def execute(self, schedule: Schedule) -> StepResult:
        """Enqueue one schedule and return its result at once (device arrays: the overlap schedule reads
        them later). HiCache spills first (their pages and rows may be reused by this schedule), then the
        snapshot saves of released samples (before the resets: a released slot may be reset for its next
        owner), slot resets and sampling rows of admitted samples (device order: after everything
        already enqueued), then every op in order (`_run_op`: one method per op type). The schedule is
        only read. A multi-process leader first sends it to the followers (`multihost`), which run the same."""
        if self.channel is not None and self.channel.is_leader:
            self.channel.send(schedule)
        self._settle_host()
        ops = schedule.ops
        for op in ops:
            if isinstance(op, SpillOp):
                self._spill(op)
        for op in ops:
            if isinstance(op, SaveOp) and not op.in_order:
                self._save(op)
        if schedule.resets:
            self.reset_slots(list(schedule.resets))
        if schedule.sampling:
            self.write_sampling(schedule.sampling, schedule.eos_token_ids)
        results = [self._run_op(op) for op in ops]
        return StepResult(tuple(r for op, r in zip(ops, results) if isinstance(op, (Launch, SpecLaunch))))

    @functools.singledispatchmethod
    def _run_op(self, op) -> Optional[LaunchResult]:
        raise TypeError(f"Runner.execute: unknown op {type(op).__name__}")

    @_run_op.register
    def _(self, op: SpillOp) -> None:
        pass  # ran first of all (`execute`)

    @_run_op.register
    def _(self, op: SaveOp) -> None:
        if op.in_order:  # a prompt-end / chunk-end snapshot, after the launch that wrote its tokens
            self._save(op)

    @_run_op.register
    def _(self, op: ForkOp) -> None:
        self.state = _fork_slot(self.state, np.int32(op.src_slot), np.int32(op.dst_slot), np.int32(op.src_page),
                                np.int32(op.dst_page), page_size=self.ccfg.page_size, ratios=self._ratios)

    @_run_op.register
    def _(self, op: LoadOp) -> None:
        self._load(op)

    @_run_op.register
    def _(self, op: ImportOp) -> None:
        self.import_slot({"rows": op.state.rows, "pages": op.state.pages}, op.slot, list(op.pages))

    @_run_op.register
    def _(self, op: RestoreOp) -> None:
        self.state = _restore_snapshot(self.state, self.snaps, np.int32(op.row), np.int32(op.slot),
                                       np.int32(op.src_page), np.int32(op.dst_page),
                                       page_size=self.ccfg.page_size, ratios=self._ratios)

    @_run_op.register
    def _(self, op: SpecLaunch) -> LaunchResult:
        dev, res = self.speculator.launch(self.params, self.device_state, op)
        self.device_state = dev
        self.launches += 1
        return res

    @_run_op.register
    def _(self, op: Launch) -> LaunchResult:
        return self._launch(op)

    @property
    def device_state(self) -> DeviceState:
        """The per-slot device state the speculator takes and returns (`messages.DeviceState`)."""
        return DeviceState(self.state, self.slot_tensors, self.last_token)

    @device_state.setter
    def device_state(self, dev: DeviceState) -> None:
        self.state, self.slot_tensors, self.last_token = dev.state, dev.slot_tensors, dev.last_token

    def _save(self, op: SaveOp) -> None:
        self.snaps = _save_snapshot(self.snaps, self.state, np.int32(op.slot), np.int32(op.row))

    def _launch(self, L: Launch) -> LaunchResult:
        """One [B, T] launch: rows packed, prompt-logprob targets, `_device_launch`."""
        B, T = L.B, L.T
        hb = dec.pack_rows([{"tokens": r.tokens, "n_new": r.n, "start": r.start, "slot": r.slot,
                             "page_table": r.pages} for r in L.rows], T, B, self.ccfg)
        from_prev = np.zeros((B,), bool)
        sample_mask = np.zeros((B,), bool)
        step = np.zeros((B,), np.int32)
        for b, r in enumerate(L.rows):
            from_prev[b] = r.from_prev
            sample_mask[b] = r.sample
            step[b] = r.step
        targets = None
        if L.want_plp:
            targets = np.zeros((B, T), np.int32)
            for b, r in enumerate(L.rows):
                if r.plp_targets is not None:
                    targets[b, :r.n] = r.plp_targets
        return self._device_launch(L, hb["tokens"], hb["start"], hb["n_new"], hb["slot"], hb["page_table"],
                                   from_prev, sample_mask, step, targets=targets, tail_lo=self._tail_lo(L.rows, B))

    # ------------------------------------------------------------------------------------ HiCache
    def _spill(self, op: SpillOp) -> None:
        """Copy an evicted entry's pages and snapshot row out of the device pools (async: the copies
        are device arrays whose host transfer starts now; `_settle_host` makes them numpy)."""
        cache = self._cache_of_row(op.row)
        if op.key not in cache.host_entries:
            return  # dropped from the host tier before its spill ran
        kw = dict(page_size=self.ccfg.page_size, ratios=self._ratios)
        blocks = [_gather_page(self.state, np.int32(p), **kw) for p in op.pages]
        row = _get_snapshot(self.snaps, np.int32(op.row))
        for x in jax.tree_util.tree_leaves((blocks, row)):
            x.copy_to_host_async()
        cache.host_store[op.key] = (blocks, row)
        self._host_unsettled.append((cache, op.key))

    # ------------------------------------------------------------------------------------ state transfer
    def export_slot(self, slot: int, pages: list) -> dict:
        """A request's cache state as host arrays, the unit the prefix cache snapshots: {"rows": slot
        ``slot``'s per-request rows (window rings, partial groups, Engram history, DSpark rings; each leaf
        the cache's without its slot axis), "pages": per page of ``pages`` its compressed-latent and
        index-key entries}. Read after everything dispatched before (device order); numpy, one copy
        (the cache is replicated over a mesh). For moving a request between engines (`import_slot`)."""
        kw = dict(page_size=self.ccfg.page_size, ratios=self._ratios)
        out = {"rows": _get_slot_rows(self.state, np.int32(slot)),
               "pages": [_gather_page(self.state, np.int32(p), **kw) for p in pages]}
        return jax.tree.map(np.asarray, out)

    def import_slot(self, data: dict, slot: int, pages: list) -> None:
        """`export_slot`'s ``data`` written into slot ``slot`` and pool pages ``pages`` (as many as it
        holds; the caller allocated them). Dispatched in device order, like a HiCache load."""
        if len(pages) != len(data["pages"]):
            raise ValueError(f"import_slot: {len(data['pages'])} pages of data for {len(pages)} pool pages")
        kw = dict(page_size=self.ccfg.page_size, ratios=self._ratios)
        for p, blk in zip(pages, data["pages"]):
            self.state = _scatter_page(self.state, blk, np.int32(p), **kw)
        self.state = _put_snapshot(self.state, data["rows"], np.int32(slot))

    def handover_layout(self) -> tuple:
        """(rows, page): the structures `export_slot` gives for a slot's rows and for one page, as
        pytrees of ``jax.ShapeDtypeStruct`` (what a state moved from another engine must match)."""
        kw = dict(page_size=self.ccfg.page_size, ratios=self._ratios)
        rows = jax.eval_shape(_get_slot_rows, self.state, np.int32(0))
        page = jax.eval_shape(functools.partial(_gather_page, **kw), self.state, np.int32(0))
        strip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731 (no shardings: host arrays)
        return jax.tree.map(strip, rows), jax.tree.map(strip, page)

    def _settle_host(self) -> None:
        """Spilled copies into host memory (numpy), releasing their device buffers."""
        for cache, key in self._host_unsettled:
            if key in cache.host_store:
                cache.host_store[key] = jax.tree.map(np.asarray, cache.host_store[key])
        self._host_unsettled = []

    def _cache_of_row(self, row: int) -> PrefixCache:
        """The prefix cache (dp rank) owning snapshot row ``row``."""
        return self.prefix_caches[dp_layout.rank_of_row(self.snapshot_rows, self.dp, row)]

    def _load(self, op: LoadOp) -> None:
        """A host-tier hit: the entry's pages into the request's fresh pages, its snapshot into the slot."""
        blocks, row = self.prefix_caches[kvc.slot_rank(self.ccfg, op.slot)].host_store[op.key]
        kw = dict(page_size=self.ccfg.page_size, ratios=self._ratios)
        for p, blk in zip(op.dst_pages, blocks):
            self.state = _scatter_page(self.state, blk, np.int32(p), **kw)
        self.state = _put_snapshot(self.state, row, np.int32(op.slot))

    def _record(self, L: Optional[Launch], out: tuple) -> tuple:
        """(logits, state) of a step's outputs; the recording step's counts (a third output) go to the recorder
        (a warm-up launch, L None, records nothing)."""
        if self.expert_recorder is None:
            return out
        if L is not None:
            self.expert_recorder.add(out[2])
        return out[:2]

    def _device_launch(self, L: Optional[Launch], tokens, start, n_new, slot, pt, from_prev, sample_mask, step,
                       force_sample: bool = False, targets=None, tail_lo=None) -> LaunchResult:
        """Enqueue one launch: first-token fill, extend, sampling; returns its result (device arrays; tokens
        None when no row samples). Host inputs stay numpy (the jit fast path transfers them;
        ``jax.device_put`` costs ~10x more host time) and every call passes the same kinds of arguments, so
        the warm-up's compilations are the ones reused. tail_lo int32 [B] (`_tail_lo`; None: zeros) is read
        only by the bounded replay step. L: the launch (None: a warm-up launch), for its rows' masks."""
        toks = self._fill(tokens, from_prev, slot, self.last_token)
        batch = {"tokens": toks, "start": start, "n_new": n_new, "slot": slot, "page_table": pt}
        extend = self._extend_for(tokens.shape[1])
        if extend is self._extend_bounded:
            if targets is not None:  # Engine.add_request refuses them; never silently approximate
                raise EngineError("prompt logprobs with --enable-decoder-swa-bounded-replay")
            batch["tail_lo"] = np.zeros((tokens.shape[0],), np.int32) if tail_lo is None else tail_lo
        batch = self._place_batch(batch)
        plp = None
        if targets is None:
            logits, self.state = self._record(L, extend(self.params, self.state, batch))
        else:  # prompt logprobs: every position's logits, reduced on the device
            if self._extend_all is None:
                log.info("the all-logits extend variant (prompt logprobs) compiles on first use "
                         "(--warmup-prompt-logprobs compiles it in the warm-up)")
                self._extend_all = self._extend_step(True)
            all_logits, self.state = self._record(L, self._extend_all(self.params, self.state, batch))
            plp = _prompt_logprobs(all_logits, targets, k=self.max_logprobs, deterministic=self.deterministic)
            logits = _last_logits(all_logits, n_new) if sample_mask.any() else None
        self.launches += 1
        if plp is not None and self.processes > 1:
            plp = _gather_to_all(self.mesh)(plp)
        if not (force_sample or sample_mask.any()):
            return LaunchResult(plp=plp)
        B, V = tokens.shape[0], self.vocab_size
        rows = L.rows if L is not None else ()
        if any(r.allowed is not None for r in rows):
            m = np.ones((B, V), bool)
            for b, r in enumerate(rows):
                if r.allowed is not None:
                    m[b, :] = False
                    m[b, : min(V, r.allowed.shape[0])] = r.allowed[:V]
            allowed = self._put(m)
        else:
            allowed = self._allow_all.get(B)
            if allowed is None:
                allowed = self._allow_all[B] = self._put(np.ones((B, V), bool))
        out = _sample_rows(logits, self.slot_tensors, self.last_token, slot, step, sample_mask, allowed,
                           max_logprobs=self.max_logprobs, deterministic=self.deterministic)
        tokens_d, lp, top_ids, top_vals, self.slot_tensors, self.last_token = out
        if self.processes > 1:  # readable on the leader (a dp-split array is not): gathered inside the program
            tokens_d, lp, top_ids, top_vals = _gather_to_all(self.mesh)((tokens_d, lp, top_ids, top_vals))
        return LaunchResult(tokens_d, lp, top_ids, top_vals, plp=plp)
