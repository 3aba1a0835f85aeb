"""Radix prefix cache: reuse the cached state of finished / preempted requests.

What a V4.1 request's cache is made of, and where each part lives (model/cache.py):

* compressed latents and index keys: pool pages, addressed by ``loc // ratio`` — they belong to the
  token prefix and can be shared as pages;
* the 128-token window K=V of every layer, the compressor's half-filled group (``partial``), the
  Engram history (``engram_hist``) and, with DSpark, the draft's rings: per-*slot* rows, valid for
  exactly one position.

Design: **slot snapshots at request ends, pages by reference.** When a sample lets go of its slot
(finished, aborted or preempted) at position k (``num_cached``: every token < k is written, every
token ≥ k is not) and the host knows its tokens 0..k−1, the cache keeps

1. a reference to each of the sample's ``ceil(k / page_size)`` pages (the last one possibly partly
   filled — the sample writes nothing more into it);
2. a copy of the slot's rows (window ring, partial groups, Engram history, DSpark rings) in a
   *snapshot row* of a device pool separate from the cache pytree (``Runner.snaps``, so the compiled
   steps are untouched); the copy is the first op of the next dispatch, before any slot reset, so it
   sees the slot exactly as the sample left it (device order).

That (pages, snapshot) pair is the sample's state at exactly position k, whatever k is: mid-page,
mid compressor group, inside or beyond the window, after any Engram n-gram. A new sample whose known
tokens minus the last start with those k tokens resumes there: it shares the ``k // page_size`` full
pages (reference counted: never written again — a position's latent is written once), gets a fresh
copy of the partly filled page (it writes its own tokens ≥ k into it), and its slot rows are copied
from the snapshot (`RestoreOp`, before its first launch). Its cache then holds bit for bit what the
source's held at k, so it continues as the source would have — in the exact numerics mode
(``--dtype exact``, order-independent) the tokens and logits equal a cold run's; in the other modes a
hit changes the prefill chunking, as SGLang's does. The last known token is always recomputed
(its logits start the sample).

A second point per sample is its *prompt end* (k = len(prompt) − 1, where forks happen too): its
`SaveOp` is ``in_order``, placed right after the plan's prefill launch that writes position k − 1
and before anything else writes the slot. The sample runs on and writes positions ≥ k into the
shared partly filled page; that does not disturb the entry: a hit copies the page, and every entry
at a position ≥ k (a window row, a compressed latent of the group holding k, an index key) is
written again by the new sample before anything reads it (reads are masked by position; a group's
latent is read only once the group is complete). Chat clients send the previous answer back as
text that may re-tokenize differently, so the prompt-end point is often the one a next turn hits.

A third kind of point is a *branch point*, for prefixes that several requests share inside their
prompts (a shared system prompt followed by different questions): when a new sample's prompt goes
along the tree's paths further than the deepest point it can resume from (the paths go on with an
earlier request's tokens), the scheduler gives it a branch point at the last page boundary of the
shared part (`RadixTree.shared_len`, `Scheduler._cache_hit`): a prefill chunk ends there and an
in-order save follows it, as at the prompt end. The second request with a shared system prompt thus
makes the point, and every later one resumes there. Page-aligned because questions diverge at
different tokens: a point at the page boundary is shared by all of them; in the exact numerics mode
the cut chunk changes nothing, in the others it changes the chunking as a hit does.

Entries are the *points* of a radix tree over token ids (`RadixTree`): a lookup walks the new
prompt once and returns the deepest entry on its path. Each entry holds one snapshot row; the pool
has ``num_rows`` of them (`Runner`: ``--radix-cache-snapshots``, default 4 × max_running_requests). Entries are evicted least recently
used when a snapshot row or pool pages are needed; an entry matched (or saved in order) in the plan
being made is *pinned* (its restore / save is not in the runner's hands yet) and is not evicted
until the plan is complete. Pages the cache
alone holds count as free (`SharedPageAllocator.free_pages`, the cache its reclaimer): an ``ensure`` that needs them evicts
entries first, so the scheduler's page accounting is unchanged.

The scheduler admits, within the first few waiting samples, one whose cached prefix is a page
longer than the queue head's first (bounded longest-prefix-match, `Scheduler._next_waiting`).

HiCache L2 (``--enable-hierarchical-cache``, host pool of ``--hicache-ratio`` × the device pool's
pages): an evicted entry is *demoted* instead of dropped — a `SpillOp` (first of all in the next
dispatch, before anything can reuse its pages or row) copies each of its pages and its snapshot
row out (``copy_to_host_async``; numpy at the following dispatch), its device pages and row are
freed, and it stays in the tree as a host entry. A hit on it allocates fresh pages for all of its
ceil(k / page_size) pages and a `LoadOp` (in plan order, like a restore) writes the host copies into
them and the snapshot into the slot: the same bits as before the spill, so the same continuation.
The host pool has its own LRU (host entries dropped when a spill needs room). An entry whose
snapshot save has not been handed to the runner yet is dropped, not spilled (its spill would run
before its save).

An n > 1 group admitted together resumes too: its first sample restores the point and prefills the
rest, and the siblings fork from it at its prompt end as without the cache; when the point covers
the whole prompt (minus its last token) there is nothing to fork after, and each sibling restores it.

By design, prompt-logprob samples never resume from a point (every prompt position must be scored;
vLLM skips its prefix cache for them too); they still leave points behind. Spills and loads go page
by page (one small program each, compiled once).
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

from dsv41_jax.model.cache import CacheFullError
from dsv41_jax.serving.messages import LoadOp, RestoreOp, SaveOp, SpillOp  # the ops it hands the runner

__all__ = ["CacheEntry", "PrefixCache", "RadixTree"]

log = logging.getLogger("dsv41_jax.engine")

CACHE_OWNER = "<prefix-cache>"  # first element of an entry's allocator key: (CACHE_OWNER, entry id)


MIN_SNAPSHOT_ROWS = 64


def default_snapshot_rows(max_running_requests: int) -> int:
    """The snapshot pool's default size: 4 points per running request, at least 64 — a multi-turn
    workload keeps about two points per request (its prompt end and its end) plus the chunk ends of a
    shared prompt, and with 16 (4 running requests) the points of three conversations and their cold
    neighbours no longer fit one turn's cycle (scripts/bench_multiturn.py: the third turns missed)."""
    return max(4 * max_running_requests, MIN_SNAPSHOT_ROWS)


@dataclass(eq=False)
class CacheEntry:
    """A cached state: its tokens (k of them), allocator key (holds its pages), snapshot row; on the
    host tier (``tier == "host"``) its pages and row live in the runner's host store instead."""

    tokens: tuple
    key: tuple
    row: int
    last_use: int = 0
    node: "Optional[_Node]" = None
    tier: str = "device"
    probation: bool = False  # a chunk-end point no request has hit yet: evicted first past a share (`_victim`)

    @property
    def k(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class _Node:
    label: tuple = ()  # tokens on the edge from the parent
    parent: "Optional[_Node]" = None
    children: dict = field(default_factory=dict)  # first token of the child's label -> child
    entry: Optional[CacheEntry] = None


class RadixTree:
    """A radix tree over token ids whose points (nodes ending a cached prefix) hold `CacheEntry`s.

    `insert(tokens, entry)` splits edges as needed; `longest(query)` returns the deepest entry whose
    tokens are a prefix of ``query`` (None when none is); `remove(entry)` drops it and prunes empty
    leaves. Edges are tuples; a lookup costs O(len(query))."""

    def __init__(self):
        self.root = _Node()

    def insert(self, tokens: tuple, entry: CacheEntry) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = leaf
                node = leaf
                break
            lab = child.label
            j = 0
            while j < len(lab) and i + j < len(tokens) and lab[j] == tokens[i + j]:
                j += 1
            if j < len(lab):  # split the edge at j
                mid = _Node(lab[:j], node)
                node.children[tokens[i]] = mid
                child.label, child.parent = lab[j:], mid
                mid.children[lab[j]] = child
                child = mid
            node, i = child, i + j
        if node.entry is not None and node.entry is not entry:
            raise ValueError("RadixTree.insert: an entry already ends at these tokens")
        node.entry = entry
        entry.node = node

    def find(self, tokens: tuple) -> Optional[CacheEntry]:
        e = self.longest(tokens)
        return e if e is not None and e.k == len(tokens) else None

    def longest(self, query) -> Optional[CacheEntry]:
        return self._walk(query)[0]

    def shared_len(self, query) -> int:
        """Length of the longest common prefix of ``query`` and any cached prefix (an edge may match
        in part): where ``query`` leaves the tree, whether or not a point is there."""
        return self._walk(query)[1]

    def _walk(self, query) -> tuple:
        """One walk down ``query``: (the deepest entry whose tokens prefix it or None, the length of
        its common prefix with the tree)."""
        node, i, best = self.root, 0, None
        n = len(query)
        while i < n:
            child = node.children.get(query[i])
            if child is None:
                break
            lab = child.label
            j = 0
            while j < len(lab) and i + j < n and lab[j] == query[i + j]:
                j += 1
            i += j
            if j < len(lab):
                break
            node = child
            if node.entry is not None:
                best = node.entry
        return best, i

    def remove(self, entry: CacheEntry) -> None:
        node = entry.node
        if node is None or node.entry is not entry:
            raise ValueError("RadixTree.remove: entry not in the tree")
        node.entry, entry.node = None, None
        while node is not self.root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.label[0]]
            node = parent
        # merge a point-less node with its only child (keeps the tree radix)
        if node is not self.root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.label = node.label + child.label
            child.parent = node.parent
            node.parent.children[node.label[0]] = child

    def entries(self) -> list:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.entry is not None:
                out.append(n.entry)
            stack.extend(n.children.values())
        return out


class PrefixCache:
    """The prefix cache's one controller: the radix tree of points, the device snapshot-row pool and the
    HiCache host tier. The scheduler talks to it (`cache_match`, `cache_insert`, `take_saves`,
    `take_spills`, `unpin_all`, ``tree``); the runner runs the ops it hands out (saves, restores,
    spills, loads) and keeps the host copies in ``host_store``.

    Its entries hold page references in the page allocator like requests (allocator key
    ``(CACHE_OWNER, id)``). It is the allocator's *reclaimer* (`runner.SharedPageAllocator`): pages
    held by unpinned entries alone count as free there, and an ``ensure`` that needs them calls
    `reclaim`, which evicts the least recently used leaf entries (`_victim`), so the scheduler's page
    accounting is unchanged."""

    def __init__(self, allocator, num_rows: int, host_pages: int = 0, first_row: int = 0):
        self.alloc = allocator
        self.page_size = allocator.page_size
        self.tree = RadixTree()
        self.entries: dict = {}  # key -> CacheEntry (device tier)
        # HiCache: entries whose pages went to host memory (key -> CacheEntry), their pages in total,
        # the host pool's size in pages (0: no host tier) and the runner's store {key: data}
        self.host_entries: dict = {}
        self.host_used = 0
        self.host_pages = host_pages
        self.host_store: dict = {}
        self.pending_spills: list = []
        self.unsaved: set = set()  # entries whose SaveOp is not handed to the runner yet
        self.spills = self.host_hits = 0
        # snapshot rows first_row .. first_row + num_rows − 1 (a dp rank's block of the pool; 0: all of it)
        self.free_rows = list(range(first_row + num_rows - 1, first_row - 1, -1))
        self.num_rows = num_rows
        # segmented LRU (`_victim`): the rows unhit chunk-end points may hold before they are the
        # first to go (with none, a long prompt's own points evicted each other)
        self.probation_rows = max(1, num_rows // 4)
        self.pinned: set = set()  # entry keys matched in the plan being made (restore not dispatched)
        self.pending_saves: list = []
        self._tick = itertools.count(1)
        self._ids = itertools.count()
        self._reclaim_cache: Optional[tuple] = None  # (version, count)
        self._version = 0
        self.hits = 0
        self.hit_tokens = 0
        allocator.reclaimer = self
        # optional observer of the tree's contents, called on the engine thread as
        # ``on_tree_event("stored" | "removed", tokens)`` when a cached prefix enters / leaves the tree
        # (both tiers: a host entry still gives hits); Dynamo's KV-aware routing publishes from it
        self.on_tree_event = None

    def _tree_event(self, kind: str, e: "CacheEntry") -> None:
        if self.on_tree_event is not None:
            self.on_tree_event(kind, e.tokens)

    # -- accounting (the allocator's reclaimer) ---------------------------------------------------
    def touch(self) -> None:
        """Page references changed: the reclaimable count is recomputed on the next ask."""
        self._version += 1

    _touch = touch

    def reclaimable(self) -> int:
        """Pages held by unpinned cache entries alone (freed if every such entry were evicted)."""
        if self._reclaim_cache is not None and self._reclaim_cache[0] == self._version:
            return self._reclaim_cache[1]
        held: collections.Counter = collections.Counter()
        tables, refs = self.alloc._tables, self.alloc._refs
        for key, e in self.entries.items():
            if key not in self.pinned:
                held.update(tables[key])
        n = sum(1 for p, c in held.items() if refs[p] == c)
        self._reclaim_cache = (self._version, n)
        return n

    def reclaim(self, free_target: int) -> None:
        """The allocator needs ``free_target`` pages on its free list: evict entries for them."""
        self.evict(free_target)

    @property
    def cached_pages(self) -> int:
        return len({p for key in self.entries for p in self.alloc._tables[key]})

    # -- eviction -------------------------------------------------------------------------------
    def _drop(self, e: CacheEntry, demote: bool = True) -> None:
        """Evict device entry e: to the host tier when there is one (its pages and row are copied
        out by a `SpillOp` before anything reuses them), else out of the tree."""
        n = len(self.alloc._tables[e.key])
        if demote and self.host_pages and e.key not in self.unsaved:
            while self.host_used + n > self.host_pages:  # the host pool's own LRU
                victims = [h for h in self.host_entries.values() if h.key not in self.pinned]
                if not victims:
                    break
                self._drop_host(min(victims, key=lambda h: h.last_use))
        # (an entry whose snapshot save is not dispatched yet is dropped: its spill would run first)
        if demote and self.host_used + n <= self.host_pages and e.key not in self.unsaved:
            self.pending_spills.append(SpillOp(e.key, tuple(self.alloc._tables[e.key]), e.row))
            e.tier = "host"
            self.host_entries[e.key] = e
            self.host_used += n
            self.spills += 1
        else:
            self.tree.remove(e)
            self._tree_event("removed", e)
        del self.entries[e.key]
        self.alloc.free(e.key)
        self.free_rows.append(e.row)
        e.row = -1
        self._touch()

    def _drop_host(self, e: CacheEntry) -> None:
        self.tree.remove(e)
        self._tree_event("removed", e)
        del self.host_entries[e.key]
        self.host_used -= -(-e.k // self.page_size)
        self.host_store.pop(e.key, None)

    def evict(self, free_target: int) -> int:
        """Evict unpinned entries (`_victim`: the least recently used leaf first) until ``free_target``
        pages are on the free list (or none is left); returns how many entries went."""
        n = 0
        while len(self.alloc._free) < free_target:
            e = self._victim()
            if e is None:
                break
            self._drop(e)
            n += 1
        return n

    def _victim(self, incoming: Optional[bool] = None) -> Optional[CacheEntry]:
        """The device entry to evict next (None: every one is pinned).

        ``incoming`` (a snapshot row is needed for a new entry; True: an unhit chunk-end point): a
        segmented LRU. Unhit chunk-end points (probation) may hold ``probation_rows`` rows, the
        others (hit, prompt-end, whole-sequence and branch points) the rest; when the newcomer's
        segment is at its share its own least recently used entry goes, else the other segment's
        (then over its share). So a long prompt's chunk ends cannot flush the points a conversation's
        next turn resumes from, and its own prompt ends cannot flush its chunk ends (evicted first
        regardless, they evicted one another and the next request with its system prompt missed).

        ``incoming=None`` (pages are needed): the least recently used leaf — a device entry no other
        device entry extends, the deeper on a tie — as SGLang's radix cache evicts. An inner point's
        pages are held by the points below it too, so evicting it first frees nothing and loses the
        point (unhit points first, then LRU over every entry, emptied a conversation's whole path
        for the pages of an older prompt's leaf)."""
        free = [e for e in self.entries.values() if e.key not in self.pinned]
        if not free:
            return None
        if incoming is None:
            leaves = self._device_leaves()
            return min([e for e in free if e.key in leaves] or free, key=lambda e: (e.last_use, -e.k))
        n_trial = sum(e.probation for e in self.entries.values())
        own_full = (n_trial >= self.probation_rows if incoming
                    else len(self.entries) - n_trial >= self.num_rows - self.probation_rows)
        segment = [e for e in free if e.probation == (incoming if own_full else not incoming)]
        return min(segment or free, key=lambda e: e.last_use)

    def _device_leaves(self) -> set:
        """Keys of the device entries that no other device entry extends."""
        out = set()
        stack = [(self.tree.root, False)]
        below = {}  # id(node) -> whether its subtree holds a device entry
        while stack:  # iterative post-order (a long conversation makes a deep tree)
            node, done = stack.pop()
            if not done:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children.values())
                continue
            sub = any(below[id(c)] for c in node.children.values())
            e = node.entry
            dev = e is not None and e.tier == "device"
            if dev and not sub:
                out.add(e.key)
            below[id(node)] = sub or dev
        return out

    def clear_cache(self) -> int:
        """Drop every unpinned entry (both tiers); returns how many."""
        es = [e for e in self.entries.values() if e.key not in self.pinned]
        for e in es:
            self._drop(e, demote=False)
        hs = [e for e in self.host_entries.values() if e.key not in self.pinned]
        for e in hs:
            self._drop_host(e)
        return len(es) + len(hs)

    # -- insert / match -------------------------------------------------------------------------
    def cache_insert(self, rid, slot: int, tokens: list, in_order: bool = False,
                     probation: bool = False) -> Optional[CacheEntry]:
        """Keep ``rid``'s state at position k = len(tokens): a reference to each of its first
        ceil(k / page_size) pages and a snapshot of slot ``slot`` (a `SaveOp`, queued in
        ``pending_saves``). For a released request, call before its pages are freed; ``in_order``: a
        running request at the end of its prompt (the entry is pinned until the plan is dispatched:
        its save is placed after the plan's launch, so its row must not change hands before).
        Returns the entry (an existing one for the same tokens is only refreshed), or None (no row
        could be freed). ``probation``: a chunk-end point kept on speculation (evicted before any
        point that was hit or made for a known reason once such points fill their share, `_victim`)."""
        k = len(tokens)
        n_pages = -(-k // self.page_size)
        if k < 1 or len(self.alloc._tables.get(rid, [])) < n_pages:
            return None
        tokens = tuple(tokens)
        old = self.tree.find(tokens)
        if old is not None and old.tier == "host" and old.key not in self.pinned:
            self._drop_host(old)  # replaced by the device copy made now
            old = None
        if old is not None:
            old.last_use = next(self._tick)
            old.probation = old.probation and probation
            return old
        if not self.free_rows:
            victim = self._victim(incoming=probation)
            if victim is not None:
                self._drop(victim)
            if not self.free_rows:
                return None
        key = (CACHE_OWNER, next(self._ids))
        e = CacheEntry(tokens, key, self.free_rows.pop(), next(self._tick), probation=probation)
        self.alloc.share(rid, key, n_pages)
        self.entries[key] = e
        self.tree.insert(tokens, e)
        self._tree_event("stored", e)
        self.pending_saves.append(SaveOp(slot, e.row, in_order))
        self.unsaved.add(key)
        if in_order:
            self.pinned.add(key)
        self._touch()
        return e

    def cache_match(self, rid, slot: int, query) -> tuple:
        """Give ``rid`` (holding no pages) the state of the deepest entry whose tokens prefix
        ``query``: its full pages shared, a fresh copy of its partial page. Returns (k, RestoreOp),
        or (0, None) on a miss (or when no page is free for the partial page's copy)."""
        e = self.tree.longest(query)
        if e is None:
            return 0, None
        k, ps = e.k, self.page_size
        e.probation = False
        self.pinned.add(e.key)
        self._touch()
        if e.tier == "host":  # HiCache hit: fresh pages, filled from the host copy (a LoadOp)
            try:
                self.alloc.ensure(rid, k)
            except CacheFullError:
                return self._miss(rid, e)
            e.last_use = next(self._tick)
            self.hits += 1
            self.host_hits += 1
            self.hit_tokens += k
            return k, LoadOp(e.key, tuple(self.alloc._tables[rid]), slot)
        n_full = k // ps
        self.alloc.share(e.key, rid, n_full)
        src = dst = 0
        if k % ps:
            try:
                self.alloc.ensure(rid, k)
            except CacheFullError:
                return self._miss(rid, e)
            src, dst = self.alloc._tables[e.key][n_full], self.alloc._tables[rid][n_full]
        e.last_use = next(self._tick)
        self.hits += 1
        self.hit_tokens += k
        return k, RestoreOp(e.row, slot, src, dst)

    def _miss(self, rid, e: CacheEntry) -> tuple:
        """No page for the copy: a miss after all. The entry is unpinned at once, so that the sample's
        own prefill may evict it in this very plan (the pool may be exactly full of its pages)."""
        self.alloc.free(rid)
        self.pinned.discard(e.key)
        self._touch()
        return 0, None

    def unpin_all(self) -> None:
        if self.pinned:
            self.pinned.clear()
            self._touch()

    def take_spills(self) -> list:
        out, self.pending_spills = self.pending_spills, []
        return out

    def take_saves(self, in_order: bool = False) -> list:
        """The queued saves of one kind (release saves, or in-order prompt-end saves)."""
        out = [op for op in self.pending_saves if op.in_order == in_order]
        self.pending_saves = [op for op in self.pending_saves if op.in_order != in_order]
        if not self.pending_saves:
            self.unsaved.clear()
        return out

    def check_invariants(self) -> None:
        """The tree, the tiers, the snapshot rows and the entries' pages agree (the allocator's own
        invariants are `SharedPageAllocator.check_invariants`, which calls this)."""
        es = self.tree.entries()
        if {e.key for e in es} != set(self.entries) | set(self.host_entries):
            raise AssertionError("radix tree and entry tables disagree")
        if set(self.entries) & set(self.host_entries):
            raise AssertionError("an entry on both tiers")
        hs = [e for e in es if e.tier == "host"]
        if sum(-(-e.k // self.page_size) for e in hs) != self.host_used or self.host_used > self.host_pages:
            raise AssertionError("host pool accounting")
        if any(e.key in self.alloc._tables for e in hs):
            raise AssertionError("a host entry holds device pages")
        es = [e for e in es if e.tier == "device"]
        rows = [e.row for e in es]
        if len(set(rows)) != len(rows) or set(rows) & set(self.free_rows):
            raise AssertionError("snapshot rows shared or both used and free")
        if len(rows) + len(self.free_rows) != self.num_rows:
            raise AssertionError("snapshot rows lost")
        for e in es:
            if len(self.alloc._tables.get(e.key, [])) != -(-e.k // self.page_size):
                raise AssertionError(f"cache entry {e.key} holds {len(self.alloc._tables.get(e.key, []))} pages for "
                                     f"{e.k} tokens")
            if self.tree.find(e.tokens) is not e:
                raise AssertionError("cache entry not found by its tokens")
