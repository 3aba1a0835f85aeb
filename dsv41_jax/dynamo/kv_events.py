"""The radix prefix cache's contents as KV block events, for Dynamo's KV-aware router.

Dynamo's router keeps, per worker, a tree of the token blocks the worker holds (``kv_block_size``
tokens each) and sends a request to the worker whose blocks cover the longest prefix of its tokens.
A worker tells it what it holds with *stored* / *removed* events. Ours come from the prefix cache
(`serving.prefix_cache`): an entry of k tokens holds every page of those tokens, so it makes the
``k // page_size`` *full* pages of its prefix resumable on this worker (a partly filled last page
is copied on a hit and is not a block the router can count).

`KvBlockEvents` turns the cache's ``on_tree_event("stored" | "removed", tokens)`` calls into block
events at page granularity. Several entries share their leading blocks (two turns of one
conversation; requests with one system prompt), so each block is reference counted by the entries
that cover it: a block is *stored* when its first entry arrives and *removed* when its last one
leaves. An entry covering block i covers every block before it, so the newly stored blocks of an
insert are always a suffix of its chain (published with the block before them as parent) and the
blocks a removal frees are a suffix too (published deepest first).

A block's id is a chain hash: 64 bits of BLAKE2b over the parent block's id and the block's token
ids, as a signed integer (the publisher takes signed 64-bit ids). The router computes its own hashes
of the request's tokens; these ids only name blocks between this worker's events.

No Dynamo import here: the publisher is any object with ``publish_stored(token_ids,
num_block_tokens, block_hashes, parent_hash)`` and ``publish_removed(block_hashes)`` (Dynamo's
``KvEventPublisher``; the tests use a recorder).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Optional, Sequence

import numpy as np

__all__ = ["KvBlockEvents", "block_hashes"]


def block_hashes(tokens: Sequence[int], block_size: int) -> list:
    """Chain ids of the full blocks of ``tokens`` (signed 64-bit ints, one per block)."""
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        blk = np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype=np.int64).tobytes()
        h = hashlib.blake2b(parent.to_bytes(8, "little", signed=True) + blk, digest_size=8).digest()
        parent = int.from_bytes(h, "little", signed=True)
        out.append(parent)
    return out


class KvBlockEvents:
    """Reference-counted blocks of the prefix cache's entries -> stored / removed events.

    ``on_tree_event`` is the prefix cache's observer (called on the engine thread); ``publish`` is
    called with ``("stored", token_ids, num_block_tokens, hashes, parent)`` or ``("removed",
    hashes)`` in the order the events happened (the caller forwards them to the publisher)."""

    def __init__(self, block_size: int, publish):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.publish = publish
        self.refs: dict = {}  # block id -> entries covering it
        self.stored_events = self.removed_events = 0
        self._lock = threading.Lock()

    def on_tree_event(self, kind: str, tokens: Sequence[int]) -> None:
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return
        hs = block_hashes(tokens[:n * bs], bs)
        with self._lock:
            if kind == "stored":
                first_new: Optional[int] = None
                for i, h in enumerate(hs):
                    c = self.refs.get(h, 0)
                    if c == 0 and first_new is None:
                        first_new = i
                    self.refs[h] = c + 1
                if first_new is not None:
                    s = first_new
                    self.stored_events += 1
                    self.publish(("stored", [int(t) for t in tokens[s * bs:n * bs]], [bs] * (n - s), hs[s:],
                                  hs[s - 1] if s else None))
            elif kind == "removed":
                gone = []
                for h in hs:
                    c = self.refs.get(h, 0) - 1
                    if c < 0:
                        raise AssertionError("KvBlockEvents: a block removed more often than stored")
                    if c == 0:
                        del self.refs[h]
                        gone.append(h)
                    else:
                        self.refs[h] = c
                if gone:
                    self.removed_events += 1
                    self.publish(("removed", gone[::-1]))
            else:
                raise ValueError(f"unknown tree event {kind!r}")

    @property
    def num_blocks(self) -> int:
        """Blocks this worker currently advertises."""
        return len(self.refs)
