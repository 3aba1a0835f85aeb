"""KV cache state, its storage formats, the page allocator and memory planning (docs/design/spec.md §3–§5, §9).

The cache is a pytree of device arrays (donated to the decode step):

* ``window``      every target layer's last `sliding_window` K=V latents of each request, rings
                  indexed by ``pos mod W`` — [max_slots + 1, L, W, head_dim] (row max_slots is scratch
                  for padded batch rows; the layer axis second, so that a request's rows are one row).
* ``comp[src]``   per KV source: compressed latents (RoPE'd, fp4 fake-quantized), one per
                  ``ratio`` tokens — [num_pages · page_size / ratio, head_dim]. A token at position p
                  of a request lives at ``loc = page_table[p // page_size] · page_size + p % page_size``
                  and its group's latent at ``loc // ratio`` (page_size is a multiple of every ratio, so
                  a group never straddles pages). No mapping table.
* ``ikeys[src]``  per key owner: index keys, same addressing — [num_pages · page_size / ratio, dI].
* ``partial[src]`` per ratio>1 KV source: the group in progress, fp32 kv and score
                  [max_slots + 1, ratio, head_dim] (score −inf where a token has not arrived yet).
* ``engram_hist`` the last max_ngram−1 compressed ids per request [max_slots + 1, max_ngram − 1].

Storage (``kv_cache_dtype``): each store keeps the *codes* of the fake-quant the model applies, so
decoding gives the model's values exactly —

* ``"auto"`` (default): window fp8 e4m3 + e8m0 per-32 scales; compressed latents packed e2m1 + e4m3
  per-16 scales; index keys packed e2m1 + e8m0 per-32 scales. Lossless vs. the reference.
* ``"fp8_e4m3"``: every store in fp8 e4m3 + e8m0 per-32 scales (compressed latents are re-quantized
  from their fp4 values: lossy, see tests for the tolerance).
* ``"bfloat16"`` / ``"float32"``: the fake-quantized values themselves (debugging; lossless).

Sequence lengths and page tables are the scheduler's (host) state and travel in each batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import quant
from dsv41_jax.model.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "bfloat16", "float32")


class CacheFullError(RuntimeError):
    """The page pool cannot hold what was asked for (no page was overwritten)."""


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the cache.

    page_size: tokens per page (SGLang's default 256; a multiple of every compress ratio).
    num_pages: pages in each compressed / index-key pool.
    max_slots: requests that can hold per-request state (window rings, partial groups) at once.
    max_pages_per_seq: page-table width (max context = max_pages_per_seq · page_size).
    kv_cache_dtype: one of KV_CACHE_DTYPES.
    dp: data-parallel attention ranks. ``max_slots`` and ``num_pages`` are totals over the ranks and
        divide by ``dp``; each rank owns one contiguous block of slots (its own scratch row last) and of
        pages (its own null page first): `rank_slots`, `scratch_slot`, `rank_pages`. dp = 1 is the
        single-rank layout (slots 0..max_slots−1, scratch max_slots; null page 0).
    retrieval_block: compressed slots scored per step of the bounded retrieval loop (the "xla" indexer,
        `indexer.topk`); rounded up to a multiple of candidate_block_size. Small values exercise the
        multi-step merge in tests; it changes speed only, never a selection.
    """

    page_size: int = 256
    num_pages: int = 64
    max_slots: int = 8
    max_pages_per_seq: int = 16
    kv_cache_dtype: str = "auto"
    retrieval_block: int = 512
    dp: int = 1

    def validate(self, cfg: ModelConfig) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        for f in ("page_size", "num_pages", "max_slots", "max_pages_per_seq", "retrieval_block"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: must be >= 1, got {getattr(self, f)}")
        if self.dp < 1:
            raise ValueError(f"dp: must be >= 1, got {self.dp}")
        for f in ("max_slots", "num_pages"):
            if getattr(self, f) % self.dp:
                raise ValueError(f"{f}: {getattr(self, f)} is not divisible by dp={self.dp} (each rank owns an equal block)")
        if self.dp > 1 and self.num_pages // self.dp < 2:
            raise ValueError(f"num_pages: {self.num_pages} leaves fewer than 2 pages per dp rank (each rank reserves a null page)")
        for r in set(cfg.compress_ratios):
            if r > 0 and self.page_size % r:
                raise ValueError(f"page_size: {self.page_size} must be a multiple of every compress ratio ({r})")

    @property
    def max_context(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def replace(self, **kw) -> "CacheConfig":
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------------- rank blocks
# Every host-chosen index into a per-slot or per-page device array lives in its dp rank's block, so a
# schedule's ids are global and valid on one device, while a dp mesh can hold each block on its rank's
# devices (docs/design: DP attention).


def slot_rows(ccfg: CacheConfig) -> int:
    """Rows of every per-slot array: each rank's slots plus its scratch row (max_slots + dp)."""
    return ccfg.max_slots + ccfg.dp


def rank_slots(ccfg: CacheConfig, r: int) -> range:
    """Rank r's real slots (global ids), its scratch row excluded."""
    per = ccfg.max_slots // ccfg.dp
    return range(r * (per + 1), r * (per + 1) + per)


def scratch_slot(ccfg: CacheConfig, r: int = 0) -> int:
    """Rank r's scratch row: where its padded batch rows read and write (never a request's)."""
    per = ccfg.max_slots // ccfg.dp
    return r * (per + 1) + per


def rank_pages(ccfg: CacheConfig, r: int) -> range:
    """Rank r's pool pages (global ids); the first is its null page (page-table padding, never read)."""
    per = ccfg.num_pages // ccfg.dp
    return range(r * per, (r + 1) * per)


def slot_rank(ccfg: CacheConfig, slot: int) -> int:
    """The dp rank whose block holds slot ``slot`` (its scratch row included)."""
    return slot // (ccfg.max_slots // ccfg.dp + 1)


def padding_slots(ccfg: CacheConfig, B: int) -> np.ndarray:
    """int32 [B]: the scratch slot of each row's rank in a rank-major batch of B rows (dp = 1: max_slots)."""
    return np.repeat(np.array([scratch_slot(ccfg, r) for r in range(ccfg.dp)], np.int32), B // ccfg.dp)


def padding_pages(ccfg: CacheConfig, B: int) -> np.ndarray:
    """int32 [B, max_pages_per_seq]: each row's rank's null page in a rank-major batch (dp = 1: zeros)."""
    null = np.repeat(np.array([rank_pages(ccfg, r)[0] for r in range(ccfg.dp)], np.int32), B // ccfg.dp)
    return np.repeat(null[:, None], ccfg.max_pages_per_seq, axis=1)


# ----------------------------------------------------------------------------------------- codecs
# kind: "win" (fp8 pow2/32, window K=V), "comp" (fp4 e4m3/16, compressed latent), "ikey" (fp4 pow2/32).


def _codec(kind: str, mode: str) -> str:
    if mode == "auto":
        return {"win": "fp8", "comp": "fp4_e4m3", "ikey": "fp4_pow2"}[kind]
    if mode == "fp8_e4m3":
        return "fp8"
    return {"bfloat16": "bf16", "float32": "f32"}[mode]


def empty_store(kind: str, mode: str, lead: tuple, dim: int) -> dict:
    """Zeroed storage arrays for `lead + (dim,)` values."""
    # Scales start at 1.0, never 0: e8m0 has no zero (0.0 converts to NaN), and a NaN in a masked-out
    # entry would still poison the softmax numerator (0 · NaN).
    c = _codec(kind, mode)
    if c == "fp8":
        return {"q": jnp.zeros(lead + (dim,), quant.FP8), "s": jnp.ones(lead + (dim // 32,), quant.E8M0)}
    if c == "fp4_e4m3":
        return {"q": jnp.zeros(lead + (dim // 2,), jnp.uint8), "s": jnp.ones(lead + (dim // 16,), quant.FP8)}
    if c == "fp4_pow2":
        return {"q": jnp.zeros(lead + (dim // 2,), jnp.uint8), "s": jnp.ones(lead + (dim // 32,), quant.E8M0)}
    return {"v": jnp.zeros(lead + (dim,), jnp.bfloat16 if c == "bf16" else jnp.float32)}


def store_bytes_per_entry(kind: str, mode: str, dim: int) -> int:
    c = _codec(kind, mode)
    return {"fp8": dim + dim // 32, "fp4_e4m3": dim // 2 + dim // 16, "fp4_pow2": dim // 2 + dim // 32,
            "bf16": 2 * dim, "f32": 4 * dim}[c]


def fake_quant(kind: str, x, dt):
    """The model's fake-quant of `kind` (what attention/indexer use in the same step)."""
    if kind == "win":
        return quant.fake_quant_fp8(x, block=32, out_dtype=dt)
    if kind == "comp":
        return quant.fake_quant_fp4_e4m3(x, block=16, out_dtype=dt)
    return quant.fake_quant_fp4_pow2(x, block=32, out_dtype=dt)


def encode(kind: str, mode: str, x) -> dict:
    """Storage codes for pre-quantization values x [..., dim]."""
    c = _codec(kind, mode)
    if c == "fp8":
        if kind != "win":  # fp8_e4m3 mode: re-quantize the model's fp4 values to fp8
            x = fake_quant(kind, x, jnp.float32)
        q, s = quant.act_quant_fp8(x, block=32)
        return {"q": q, "s": quant.pow2_scale_to_e8m0(s)}
    if c == "fp4_e4m3":
        q, s = quant.quantize_fp4_e4m3(x, block=16)
        return {"q": q, "s": s}
    if c == "fp4_pow2":
        q, s = quant.quantize_fp4_pow2(x, block=32)
        return {"q": q, "s": s}
    return {"v": fake_quant(kind, x, jnp.float32).astype(jnp.bfloat16 if c == "bf16" else jnp.float32)}


def decode(kind: str, mode: str, st: dict, dt):
    """Values [..., dim] in `dt` from storage codes."""
    c = _codec(kind, mode)
    if c == "fp8":
        return quant.dequantize_fp8_act(st["q"], st["s"], block=32, out_dtype=dt)
    if c == "fp4_e4m3":
        return quant.dequantize_fp4(st["q"], st["s"], 16, out_dtype=dt)
    if c == "fp4_pow2":
        return quant.dequantize_fp4(st["q"], st["s"], 32, out_dtype=dt)
    return st["v"].astype(dt)


def store_set(st: dict, idx, val: dict) -> dict:
    """Scatter codes `val` (leading dims = idx.shape) into `st` at first-axis indices `idx`.

    Out-of-range indices (used for padded rows / tokens) are dropped, never written.
    """
    return {k: st[k].at[idx].set(val[k], mode="drop") for k in st}


def set_row(arr, rows, val):
    """arr[rows[b]] = val[b] for rows int32 [B] that are in range (a request's slot, or the scratch one).

    One row (B = 1) is a `dynamic_update_slice`: XLA turns a one-index scatter into one too, but keeps the
    scatter's out-of-range drop as a select of the old row first — two launches per array on a GPU, one
    here (decode at B = 1 writes a few of these per layer)."""
    if rows.shape[0] != 1:
        return arr.at[rows].set(val)
    return jax.lax.dynamic_update_slice(arr, val.astype(arr.dtype), (rows[0],) + (0,) * (arr.ndim - 1))


def store_get(st: dict, idx) -> dict:
    """Gather codes at first-axis indices `idx` (clamped; callers mask invalid entries)."""
    return {k: jnp.take(st[k], idx, axis=0, mode="clip") for k in st}


def store_get_layer(st: dict, rows, layer) -> dict:
    """Layer `layer` (an int or int32 scalar) of a stacked store's rows `rows` (clamped): codes of first axes
    [R, L, ...] -> [*rows.shape, ...], one gather (the window rings: `init_cache`)."""
    return {k: a[jnp.clip(rows, 0, a.shape[0] - 1), layer] for k, a in st.items()}


# ----------------------------------------------------------------------------------------- state


def init_cache(cfg: ModelConfig, ccfg: CacheConfig) -> dict:
    """A zeroed cache pytree for `cfg` (target layers; DSpark rings live with the draft state)."""
    ccfg.validate(cfg)
    mode = ccfg.kv_cache_dtype
    rows = slot_rows(ccfg)
    hd, W = cfg.head_dim, cfg.sliding_window
    # every layer's rings in one store, row (request) first: a step writes them all with one update per array
    state = {"window": empty_store("win", mode, (rows, cfg.num_hidden_layers, W), hd),
             "comp": {}, "ikeys": {}, "partial": {}}
    tokens = ccfg.num_pages * ccfg.page_size
    for src in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[src]
        state["comp"][str(src)] = empty_store("comp", mode, (tokens // r,), hd)
        if src in cfg.key_owner_ids:
            state["ikeys"][str(src)] = empty_store("ikey", mode, (tokens // r,), cfg.index_head_dim)
        if r > 1:
            state["partial"][str(src)] = {"kv": jnp.zeros((rows, r, hd), jnp.float32),
                                          "score": jnp.full((rows, r, hd), -jnp.inf, jnp.float32)}
    if cfg.engram_layer_ids:
        state["engram_hist"] = jnp.zeros((rows, cfg.engram_max_ngram_size - 1), jnp.int32)
    return state


def reset_slots(state: dict, slots, pad_compressed_id) -> dict:
    """Clear per-request state rows (partial groups, Engram history) for requests starting afresh.

    Window rings need no clearing: entries for positions < 0 are masked by position.
    """
    slots = jnp.asarray(slots, jnp.int32)
    out = dict(state)
    out["partial"] = {k: {"kv": v["kv"].at[slots].set(0.0), "score": v["score"].at[slots].set(-jnp.inf)}
                      for k, v in state["partial"].items()}
    if "engram_hist" in state:
        out["engram_hist"] = state["engram_hist"].at[slots].set(pad_compressed_id)
    return out


# ----------------------------------------------------------------------------------------- memory


def kv_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> dict:
    """Bytes of compressed state per token beyond the window, and window bytes per request.

    For flash in the default mode: 720 B of compressed latents + 170 B of index keys = 890 B/token.
    """
    comp = ikeys = 0.0
    for src in cfg.kv_source_layer_ids:
        r = cfg.compress_ratios[src]
        comp += store_bytes_per_entry("comp", kv_cache_dtype, cfg.head_dim) / r
        if src in cfg.key_owner_ids:
            ikeys += store_bytes_per_entry("ikey", kv_cache_dtype, cfg.index_head_dim) / r
    win_layer = cfg.sliding_window * store_bytes_per_entry("win", kv_cache_dtype, cfg.head_dim)
    dspark = cfg.num_nextn_predict_layers * win_layer
    return {"compressed_latents": comp, "index_keys": ikeys, "per_token": comp + ikeys,
            "window_per_request": win_layer * cfg.num_hidden_layers, "dspark_window_per_request": dspark}


def plan_memory(cfg: ModelConfig, budget_bytes: int, *, page_size: int = 256, max_slots: int = 64,
                max_context: Optional[int] = None, kv_cache_dtype: str = "auto",
                bytes_per_token: Optional[dict] = None) -> dict:
    """Split a byte budget into window rings for `max_slots` requests and paged pools.

    Returns a dict with bytes per token, the window bytes, the number of pages and tokens the pools
    hold, and a `CacheConfig`. Raises CacheFullError if the windows alone exceed the budget.
    bytes_per_token: `kv_bytes_per_token`'s dict for another cache layout (a DeepSeek-V4 model's,
    `model.v4.decode.kv_bytes_per_token`); None: this module's.
    """
    b = bytes_per_token or kv_bytes_per_token(cfg, kv_cache_dtype)
    win = (max_slots + 1) * b["window_per_request"]
    left = budget_bytes - win
    if left <= 0:
        raise CacheFullError(f"budget {budget_bytes} B is below the window rings of {max_slots} requests ({win} B)")
    per_page = b["per_token"] * page_size
    num_pages = int(left // per_page)
    if num_pages < 1:
        raise CacheFullError(f"budget leaves {left} B for pools, less than one page ({per_page} B)")
    mps = -(-(max_context or num_pages * page_size) // page_size)
    ccfg = CacheConfig(page_size=page_size, num_pages=num_pages, max_slots=max_slots,
                       max_pages_per_seq=min(mps, num_pages), kv_cache_dtype=kv_cache_dtype)
    return {"bytes_per_token": b["per_token"], "window_bytes": win, "num_pages": num_pages,
            "pool_tokens": num_pages * page_size, "pool_bytes": num_pages * per_page, "cache_config": ccfg,
            **{k: v for k, v in b.items() if k != "per_token"}}


# ----------------------------------------------------------------------------------------- pages


class PageAllocator:
    """Fixed-size pages from a free list; per-request page tables. Host-side, not traced.

    Page 0 is reserved as the "null" page that page-table padding points at (its contents are never
    read: every read is masked by position), so `num_pages − 1` pages are allocatable.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
        if num_pages < 2:
            raise ValueError("num_pages: need at least 2 (page 0 is reserved)")
        self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._tables: dict = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def pages(self, rid) -> list:
        return list(self._tables.get(rid, []))

    def has(self, rid) -> bool:
        return rid in self._tables

    def ensure(self, rid, num_tokens: int) -> list:
        """Grow `rid`'s table to hold `num_tokens` tokens. All-or-nothing: raises CacheFullError."""
        need = -(-num_tokens // self.page_size)
        if need > self.max_pages_per_seq:
            raise CacheFullError(f"request {rid!r}: {num_tokens} tokens need {need} pages, more than "
                                 f"max_pages_per_seq={self.max_pages_per_seq} (context {self.max_pages_per_seq * self.page_size})")
        table = self._tables.setdefault(rid, [])
        extra = need - len(table)
        if extra > len(self._free):
            if not table:
                del self._tables[rid]
            raise CacheFullError(f"request {rid!r}: needs {extra} more pages, {len(self._free)} free")
        for _ in range(max(extra, 0)):
            table.append(self._free.pop())
        return list(table)

    def truncate(self, rid, num_tokens: int) -> int:
        """Give back `rid`'s pages beyond those `num_tokens` tokens need (e.g. pages taken for a
        speculative verify window whose drafts were rejected); returns how many. The pages' contents
        need no clearing: nothing reads a position before it is written again."""
        table = self._tables.get(rid)
        if table is None:
            return 0
        keep = max(-(-num_tokens // self.page_size), 0)
        extra = table[keep:]
        del table[keep:]
        return self._release(extra)

    def free(self, rid) -> int:
        """Return every page of `rid` to the free list; returns how many."""
        return self._release(self._tables.pop(rid, []))

    def _release(self, pages) -> int:
        """Pages a request let go of back to the free list (a sharing allocator overrides this)."""
        self._free.extend(reversed(pages))
        return len(pages)

    def table_array(self, rids) -> np.ndarray:
        """int32 [len(rids), max_pages_per_seq]; unused entries point at the null page 0."""
        out = np.zeros((len(rids), self.max_pages_per_seq), np.int32)
        for i, rid in enumerate(rids):
            t = self._tables.get(rid, []) if rid is not None else []
            out[i, : len(t)] = t
        return out

    def check_invariants(self) -> None:
        """No page shared by two live requests or both live and free; none lost."""
        seen = set()
        for rid, t in self._tables.items():
            for p in t:
                if p in seen:
                    raise AssertionError(f"page {p} is shared (request {rid!r})")
                seen.add(p)
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list has duplicates")
        if seen & free:
            raise AssertionError(f"pages both live and free: {sorted(seen & free)}")
        if len(seen) + len(free) != self.capacity:
            raise AssertionError(f"{self.capacity - len(seen) - len(free)} pages lost")


def token_locs(page_table, positions, page_size: int):
    """Pool locations of token positions: page_table [B, P] int32, positions int32 [B, ...] -> [B, ...]."""
    page = jnp.take_along_axis(page_table, (positions // page_size).reshape(positions.shape[0], -1), axis=1,
                               mode="clip").reshape(positions.shape)
    return page * page_size + positions % page_size
