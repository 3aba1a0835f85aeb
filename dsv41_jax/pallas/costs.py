"""Benchmark inputs and bytes-moved contracts of the Pallas kernels, kept out of the kernel modules.

Per kernel: ``*_bench_inputs`` builds realistic (flash-shaped unless told) inputs for
scripts/bench_kernels.py and the lowering tests; ``*_bytes_moved`` is the kernel's bytes-moved contract —
the minimal HBM bytes of one call, what achieved bandwidth is measured against and, for the MoE, linear,
o_proj, route and window-codes kernels, what their ``pl.CostEstimate`` declares to XLA;
``*_call_geometry`` recovers a contract's arguments from a pallas_call's name and operand shapes in a
jaxpr (scripts/bench_decode.py counts calls this way). Nothing here runs in a model step except the
contracts the kernels declare as their cost estimates.

This module imports no kernel module at import time (the kernels import it for their cost estimates);
the bench inputs that hand back kernel functions import their module when called.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import engram, mhc, quant
from dsv41_jax.model.config import ModelConfig
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.weights import Fp8, Mxfp4

MOE_NAME = "moe_mxfp4"  # the MoE kernel's pallas_call names start with it (`moe_call_geometry` reads them)
MOE_PARTS = ("gate_up", "down")
LINEAR_NAME = "quant_linear"
LINEAR_FORMATS = ("fp8", "mxfp4")


# ---------------------------------------------------------------- engram (pallas/engram_gather.py)


def _engram_dims():
    c = ModelConfig.preset("flash")
    R = (c.engram_max_ngram_size - 1) * c.engram_n_heads
    return c.hc_mult, c.hidden_size, R, c.engram_head_dim, float(c.rms_norm_eps)


ENGRAM_TABLE_ROWS = 1 << 20  # 256 MiB of codes: far above L2, so random rows miss the cache as the real table's do


def engram_bench_inputs(tokens: int, *, seed: int = 0, interpret: bool = False, table_rows: int = ENGRAM_TABLE_ROWS) -> dict:
    """Flash-shaped inputs for scripts/bench_kernels.py: ``{part: (kernel_fn, xla_fn, args)}``.

    Parts: "gather" (rows -> emb [tokens, 24·256] bf16) and "gate" (h [tokens, 4, 5120] bf16, kv
    [tokens, 5·5120] bf16 -> h'). ``kernel_fn(*args)`` and ``xla_fn(*args)`` return the same array
    (xla_fn is the model's reference code, jitted). The table has `table_rows` rows instead of 384M
    (only the 24 gathered rows per token are read either way). The wkv GEMM between them is the
    "linear" seam's and is not benchmarked here.
    """
    from dsv41_jax.pallas import engram_gather as eg

    n, D, R, de, eps = _engram_dims()
    rng = np.random.default_rng(seed)  # numpy: no device compiles to build the inputs
    table = jnp.asarray(rng.standard_normal((table_rows, de), np.float32).astype(quant.FP8))
    tscale = jnp.asarray(rng.integers(120, 135, (table_rows, de // 32)).astype(np.uint8).view(quant.E8M0))
    rows = jnp.asarray(rng.integers(0, table_rows, (tokens, R)).astype(np.int32))
    h = jnp.asarray(rng.standard_normal((tokens, n, D), np.float32).astype(jnp.bfloat16))
    kv = jnp.asarray(rng.standard_normal((tokens, (n + 1) * D), np.float32).astype(jnp.bfloat16))
    qk = jnp.asarray(rng.uniform(0.5, 1.5, (2, n, D)).astype(jnp.bfloat16))
    bf = jnp.dtype(jnp.bfloat16)
    return {
        "gather": (functools.partial(eg.gather, dt=bf, interpret=interpret),
                   jax.jit(functools.partial(engram.gather_rows, dt=bf)), (table, tscale, rows)),
        "gate": (functools.partial(eg.gate, eps=eps, dt=bf, interpret=interpret),
                 jax.jit(lambda h, kv, q, kk: engram.gate(h, kv, q, kk, eps, bf)), (h, kv, qk[0], qk[1])),
    }


def engram_bytes_moved(part: str, tokens: int) -> int:
    """Minimum HBM bytes of one call of `part` at flash shapes (bf16 activations), for bandwidth."""
    n, D, R, de, _ = _engram_dims()
    if part == "gather":
        return tokens * R * (4 + de + de // 32 + 2 * de)  # row index, codes, scale bytes, bf16 emb
    if part == "gate":
        return tokens * (2 * n * D + 2 * (n + 1) * D + 2 * n * D) + 2 * 2 * n * D  # h, kv, out; q/k weights
    raise ValueError(f"unknown part {part!r}; parts: gather, gate")


# ------------------------------------------------------------------------- mhc (pallas/mhc_mix.py)


def _mhc_dims():
    c = ModelConfig.preset("flash")
    return c.hc_mult, c.hidden_size, float(c.rms_norm_eps), float(c.hc_eps), int(c.hc_sinkhorn_iters)


def mhc_bench_inputs(tokens: int, *, seed: int = 0, interpret: bool = False) -> dict:
    """Flash-shaped inputs for scripts/bench_kernels.py: ``{part: (kernel_fn, xla_fn, args)}``.

    "enter": (h [tokens, 4, 5120] bf16, pre_prev, fn [24, 20480], base, scale) -> (x_in bf16, pre, post,
    comb), against the "xla" implementation (hc_pre + hc_mixes with the unrolled Sinkhorn);
    "exit": (y [tokens, 5120] bf16, h, post, comb) -> h' bf16, against `mhc.hc_post`;
    "enter_norm": "enter" with the sublayer's RMSNorm fused (+ w [5120] bf16), against "enter"'s xla
    function then `norm.rmsnorm`; "exit_enter": (y, h, post, comb, pre_prev, fn, base, scale, w) -> (h', x_in
    normed, pre, post, comb) in one pass (`exit_enter`), against hc_post then "enter_norm"'s xla function.
    """
    from dsv41_jax.pallas import mhc_mix as mm

    n, D, neps, heps, iters = _mhc_dims()
    rng = np.random.default_rng(seed)  # numpy: no device compiles to build the inputs
    bf = jnp.dtype(jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((tokens, n, D), np.float32).astype(bf))
    pp = jnp.asarray(rng.uniform(0, 1, (tokens, n)).astype(np.float32))
    fn = jnp.asarray((rng.standard_normal(((2 + n) * n, n * D)) * (n * D) ** -0.5).astype(np.float32))
    base = jnp.asarray((rng.standard_normal((2 + n) * n) * 0.1).astype(np.float32))
    scale = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    y = jnp.asarray(rng.standard_normal((tokens, D), np.float32).astype(bf))
    post = jnp.asarray(rng.uniform(0, 2, (tokens, n)).astype(np.float32))
    comb = rng.uniform(0, 1, (tokens, n, n)).astype(np.float32)
    comb = jnp.asarray(comb / comb.sum(axis=-2, keepdims=True))

    def xla_enter(h, pp, fn, base, scale):
        mixes = mhc.hc_mixes(h, fn, base, scale, norm_eps=neps, hc_eps=heps, sinkhorn_iters=iters, unroll=True)
        return (mhc.hc_pre(h, pp, bf), *mixes)

    w = jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32).astype(bf))

    def xla_enter_norm(h, pp, fn, base, scale, w):
        x, *mixes = xla_enter(h, pp, fn, base, scale)
        return (rmsnorm(x, w, neps, bf), *mixes)

    def xla_exit_enter(y, h, post, comb, pp, fn, base, scale, w):
        hn = mhc.hc_post(y, h, post, comb, bf)
        return (hn, *xla_enter_norm(hn, pp, fn, base, scale, w))

    kw = dict(norm_eps=neps, hc_eps=heps, iters=iters, dt=bf, interpret=interpret)
    return {
        "enter": (functools.partial(mm.mixes_enter, **kw), jax.jit(xla_enter), (h, pp, fn, base, scale)),
        "exit": (functools.partial(mm.post_mix, dt=bf, interpret=interpret),
                 jax.jit(lambda y, h, p, c: mhc.hc_post(y, h, p, c, bf)), (y, h, post, comb)),
        "enter_norm": (lambda h, pp, fn, base, scale, w: mm.mixes_enter(h, pp, fn, base, scale, norm_weight=w, **kw),
                       jax.jit(xla_enter_norm), (h, pp, fn, base, scale, w)),
        "exit_enter": (lambda y, h, post, comb, pp, fn, base, scale, w: mm.exit_enter(
            y, h, post, comb, pp, fn, base, scale, norm_weight=w, **kw),
            jax.jit(xla_exit_enter), (y, h, post, comb, pp, fn, base, scale, w)),
    }


def mhc_bytes_moved(part: str, tokens: int) -> int:
    """Minimum HBM bytes of one call of `part` at flash shapes (bf16 stream), for bandwidth."""
    n, D, *_ = _mhc_dims()
    mix = (2 + n) * n
    if part == "enter":
        return tokens * (2 * n * D + 4 * n + 2 * D + 4 * (2 * n + n * n)) + 4 * (mix * n * D + mix + 3)
    if part == "exit":
        return tokens * (2 * D + 2 * n * D + 4 * (n + n * n) + 2 * n * D)
    if part == "enter_norm":  # + the weight, and x_in read back and rewritten normed by the tail
        return mhc_bytes_moved("enter", tokens) + 2 * D + tokens * 2 * 2 * D
    if part == "exit_enter":  # exit's bytes + enter_norm's, less h' read back by the enter
        return mhc_bytes_moved("exit", tokens) + mhc_bytes_moved("enter_norm", tokens) - tokens * 2 * n * D
    raise ValueError(f"unknown part {part!r}; parts: enter, exit, enter_norm, exit_enter")


# ---------------------------------------------------------- attention (pallas/sparse_attention.py)


def _attention_store(key, kind: str, mode: str, lead: tuple, hd: int) -> dict:
    """Valid random storage codes (no NaN patterns) built on device without a float detour."""
    c = kvc._codec(kind, mode)
    k1, k2 = jax.random.split(key)
    if c == "fp8":
        qb = jax.random.bits(k1, lead + (hd,), jnp.uint8)
        qb = jnp.where((qb & 0x7F) == 0x7F, qb ^ 1, qb)  # 0x7f / 0xff are NaN in e4m3fn
        sb = jax.random.randint(k2, lead + (hd // 32,), 118, 124).astype(jnp.uint8)  # 2^-9 .. 2^-4
        return {"q": lax.bitcast_convert_type(qb, quant.FP8), "s": lax.bitcast_convert_type(sb, quant.E8M0)}
    if c == "fp4_e4m3":
        pb = jax.random.bits(k1, lead + (hd // 2,), jnp.uint8)  # every byte is two valid e2m1 codes
        sb = jax.random.randint(k2, lead + (hd // 16,), 0x20, 0x40).astype(jnp.uint8)  # e4m3 2^-3 .. 2^1
        return {"q": pb, "s": lax.bitcast_convert_type(sb, quant.FP8)}
    v = jax.random.normal(k1, lead + (hd,), jnp.float32)
    return {"v": v.astype(jnp.bfloat16 if c == "bf16" else jnp.float32)}


@functools.partial(jax.jit, static_argnums=tuple(range(1, 9)))
def _attention_tensors(key, mode, n_pool, B, T, H, hd, W, dtype):
    """Pool, ring and chunk codes, queries and sinks in one computation (one compile, made on device)."""
    ks = jax.random.split(key, 5)
    comp = _attention_store(ks[0], "comp", mode, (n_pool,), hd)
    ring = _attention_store(ks[1], "win", mode, (B + 1, W), hd)
    new = _attention_store(ks[2], "win", mode, (B, T), hd)
    q = (jax.random.normal(ks[3], (B, T, H, hd), jnp.float32) * 0.5).astype(dtype)
    sink = jax.random.normal(ks[4], (H,), jnp.float32)
    return comp, ring, new, q, sink


def attention_bench_inputs(batch: int, context: int, T: int, *, cfg_like: str = "flash", mode: str = "auto", seed: int = 0,
                 ratio: int | None = None, page_size: int = 256, dtype=jnp.bfloat16,
                 max_pool_bytes: int = 8 << 30):
    """Realistic inputs of one call: `batch` rows, each with `context` tokens already cached (the ring
    full once context ≥ window) and a chunk of T new tokens; top-k = index_topk slots per query
    (fewer while the context holds fewer complete groups), random and distinct, through a shuffled page
    table. Shapes from the preset (flash: H 64, head_dim 512, window 128, top-k 512); ratio defaults to
    the preset's first compressed layer's (flash: 2). Codes are random valid bit patterns made on the
    device. The pool holds every row's pages when that fits in `max_pool_bytes`; beyond, the rows'
    pages are drawn at random from a pool of that size (reads stay scattered: `attention_bytes_moved` counts
    distinct rows).

    Returns (args, kwargs) for `kernel(*args, **kwargs, interpret=False)` (kwargs: ratio, page_size,
    window, mode) — the same call works for `attention.sparse_attention(..., impl="xla")`.
    """
    cfg = ModelConfig.preset(cfg_like)
    H, hd, W, K = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.index_topk
    if ratio is None:
        ratio = next(r for r in cfg.compress_ratios if r > 0)
    if page_size % ratio:
        raise ValueError(f"page_size {page_size} must be a multiple of ratio {ratio}")
    key = jax.random.key(seed, impl="rbg")  # XLA's RngBitGenerator: quick to compile, fast on device
    rng = np.random.default_rng(seed)
    B = batch
    pages_per_row = -(-(context + T) // page_size)
    entry = kvc.store_bytes_per_entry("comp", mode, hd)
    need = B * pages_per_row + 1
    cap = max(2, int(max_pool_bytes // (page_size // ratio * entry)))
    num_pages = min(need, cap)
    if need <= cap:
        pt = rng.permutation(np.arange(1, num_pages))[: B * pages_per_row].reshape(B, pages_per_row)
    else:
        pt = rng.integers(1, num_pages, size=(B, pages_per_row))
    pt = jnp.asarray(pt.astype(np.int32))
    comp, ring, new, q, sink = _attention_tensors(key, mode, num_pages * page_size // ratio, B, T, H, hd, W,
                                               jnp.dtype(dtype).name)
    start = jnp.full((B,), context, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.ones((B, T), bool)
    ring_rows = jnp.arange(B, dtype=jnp.int32)
    sel = np.full((B, T, K), -1, np.int32)
    for t in range(T):
        n_vis = (context + t + 1) // ratio
        k = min(K, n_vis)
        if k:
            # Distinct slots per query (a random choice, as top-k of random scores would be).
            sel[:, t, :k] = np.argsort(rng.random((B, n_vis)), axis=1)[:, :k]
    args = (q, sink, ring, ring_rows, new, start, positions, valid, comp, pt, jnp.asarray(sel))
    return args, dict(ratio=ratio, page_size=page_size, window=W, mode=mode)


def attention_bytes_moved(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, *, ratio: int,
                page_size: int, window: int, mode: str, **_) -> int:
    """Minimal HBM bytes of one call: q and the output, sink and metadata, each distinct window entry
    (ring W per row + the chunk's keys) and each distinct pool row selected (host-side count; the
    kernel reads a row once per query and head block, repeats mostly from L2)."""
    B, T, H, hd = q.shape
    isz = jnp.dtype(q.dtype).itemsize
    win_e = kvc.store_bytes_per_entry("win", mode, hd)
    total = 2 * B * T * H * hd * isz + 4 * H
    total += 4 * (2 * B + 2 * B * T) + 4 * int(np.prod(page_table.shape)) + 4 * int(np.prod(sel.shape))
    total += B * T * win_e
    if ring is not None:
        total += B * window * win_e
    if comp is not None and sel.shape[-1]:
        s = np.asarray(sel)
        pt = np.asarray(page_table)
        tok = np.maximum(s, 0) * ratio
        page = np.take_along_axis(pt, np.minimum(tok // page_size, pt.shape[1] - 1).reshape(B, -1), axis=1)
        rows = (page.reshape(s.shape) * page_size + tok % page_size) // ratio
        n_rows = len(np.unique(rows[s >= 0]))
        total += n_rows * kvc.store_bytes_per_entry("comp", mode, hd)
    return int(total)


# ---------------------------------------------------------------- indexer (pallas/indexer_topk.py)


def indexer_bench_inputs(batch: int, context: int, T: int, *, mode: str = "auto", seed: int = 0, kind: str = "dense",
                 dt=jnp.bfloat16):
    """Flash-shaped (args, kwargs) for `kernel`: `batch` rows each holding `context` tokens, T queries
    at the newest positions (T = 1 decode, a few for verify, up to 64 for prefill chunks).

    kind: "dense" (a ratio-2 key owner, layers 2/8/14: score every live slot), "source" (layer 20,
    ratio 1: also make the candidate blocks) or "masked" (layers 24–36, ratio 1: score only the
    candidate blocks; random canonical candidate sets that include the newest block).
    Shapes from docs/design/spec.md §4 / `ModelConfig.preset("flash")`: nI = 32, dI = 128, top-k 512, 2048 candidate
    blocks of 8, page size 256. Codes are random e2m1 values with scales 2^-5..2^2 (as the cache
    stores them; fp4 values re-quantized in the fp8 mode); pages shuffled in the pool.
    """
    cfg = ModelConfig.preset("flash")
    nI, dI, ps = cfg.index_n_heads, cfg.index_head_dim, 256
    ratio = 2 if kind == "dense" else 1
    pages = -(-context // ps)
    n_pages = batch * pages + 1
    N = n_pages * ps // ratio
    key = jax.random.key(seed)
    k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
    perm = jax.random.permutation(k1, jnp.arange(1, n_pages, dtype=jnp.int32))
    page_table = perm.reshape(batch, pages)
    if mode == "auto":
        ikeys = {"q": jax.random.randint(k2, (N, dI // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                 "s": lax.bitcast_convert_type(jax.random.randint(k3, (N, dI // 32), 122, 130, jnp.int32)
                                               .astype(jnp.uint8), quant.E8M0)}
    elif mode == "fp8_e4m3":
        # What the cache holds in this mode: fp4 values re-quantized to fp8, i.e. e4m3 bytes of the e2m1
        # grid ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (a random byte would be unrealistic, and its dot inexact).
        grid = jnp.asarray([0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C], jnp.int32)
        code = jax.random.randint(k2, (N, dI), 0, 16, jnp.int32)
        byte = (grid[code & 7] | ((code >> 3) << 7)).astype(jnp.uint8)
        ikeys = {"q": lax.bitcast_convert_type(byte, quant.FP8),
                 "s": lax.bitcast_convert_type(jax.random.randint(k3, (N, dI // 32), 122, 130, jnp.int32)
                                               .astype(jnp.uint8), quant.E8M0)}
    else:
        raise ValueError(f"indexer_bench_inputs: mode {mode!r} (auto or fp8_e4m3)")
    q = quant.fake_quant_fp4_pow2(jax.random.normal(k4, (batch, T, nI, dI), jnp.float32), block=32, out_dtype=dt)
    w = (jax.random.normal(k5, (batch, T, nI), jnp.float32) * (dI ** -0.5 * nI ** -0.5)).astype(dt)
    pos = context - T + jnp.arange(T, dtype=jnp.int32)
    visible = jnp.broadcast_to((pos + 1) // ratio, (batch, T)).astype(jnp.int32)
    kw = dict(ratio=ratio, page_size=ps, mode=mode, k=cfg.index_topk, dt=dt, cand_blocks=None,
              make_candidates=kind == "source", block_size=cfg.candidate_block_size,
              topk_blocks=cfg.candidate_topk_blocks)
    if kind == "masked":
        S = pages * ps // ratio
        nb = -(-S // cfg.candidate_block_size)
        kb = min(cfg.candidate_topk_blocks, nb)
        newest = (visible - 1) // cfg.candidate_block_size  # [B, T]
        r = jax.random.uniform(k6, (batch, T, nb))
        r = jnp.where(jnp.arange(nb)[None, None, :] == newest[..., None], 2.0, r)  # newest always kept
        r = jnp.where(jnp.arange(nb)[None, None, :] <= newest[..., None], r, -1.0)  # only visible blocks
        vals, ids = lax.top_k(r, kb)
        ids = jnp.where(vals >= 0, ids, jnp.iinfo(jnp.int32).max)
        ids = jnp.sort(ids, axis=-1)
        kw["cand_blocks"] = jnp.where(ids == jnp.iinfo(jnp.int32).max, -1, ids).astype(jnp.int32)
    return (q, w, ikeys, page_table, visible), kw


def indexer_bytes_moved(q, w, ikeys, page_table, visible, *, ratio: int, page_size: int, mode: str, k: int, dt,
                cand_blocks=None, make_candidates: bool = False, block_size: int = 1, topk_blocks: int = 0,
                **_unused) -> int:
    """Minimal HBM bytes of one `kernel` call: each live index key read once per row (once per query
    for candidate-masked layers: the candidate sets differ per query), the page-table entries that
    address them, q, w, visible (and cand_blocks) in, the selections out. Scores kept on chip (the
    kernel's own score round trip is not counted: this is the floor the achieved bandwidth is
    measured against)."""
    B, T, nI, dI = q.shape
    S = page_table.shape[1] * page_size // ratio
    per_key = kvc.store_bytes_per_entry("ikey", mode, dI)
    vis = np.clip(np.asarray(visible), 0, S)
    ins = q.size * q.dtype.itemsize + w.size * w.dtype.itemsize + visible.size * 4
    if cand_blocks is None or make_candidates:
        live = vis.max(axis=1).astype(np.int64)  # slots per row
        ins += int(live.sum()) * per_key + int(np.sum(-(-(live * ratio) // page_size))) * 4
    if cand_blocks is not None:
        cb = np.asarray(cand_blocks)
        slots = (cb >= 0).sum(-1).astype(np.int64) * block_size
        ins += int(slots.sum()) * per_key + cb.size * 4 + int(np.sum(-(-(slots * ratio) // page_size))) * 4
    kk = min(k, S)
    kb = min(topk_blocks, -(-S // block_size)) if make_candidates else 0
    return int(ins + B * T * (kk + kb) * 4)


# ----------------------------------------------------------------------- moe (pallas/moe_mxfp4.py)


def moe_bytes_moved(part: str, *, A: int, N: int, D: int, I: int, G: int, out_itemsize: int,
                n_active: float | None = None, x_itemsize: int = 2) -> float:
    """Minimal HBM bytes of one call of `part` ("gate_up" | "down"), the kernel's bytes-moved contract.

    A assignments (sorted rows), N tokens, hidden D, intermediate I, G groups of which `n_active`
    (default: all G, the bound) have rows; out_itemsize: the down output's dtype size; x_itemsize: the
    tokens' (the gate/up input, quantized in-kernel: bf16 in the bf16 flow). Weights at
    stored width (packed e2m1 + E8M0 scales) once per non-empty group; activations once (the gate/up
    call gathers N distinct token rows; repeated reads of a row by the group's tiles hit L2); metadata
    (group expert / start / size, the layer, the rows' token ids and routing weights)."""
    n_active = G if n_active is None else n_active
    meta = 4 * (3 * G + 1)
    if part == "gate_up":
        return n_active * 2 * (I * D // 2 + I * D // 32) + x_itemsize * N * D + 2 * A * I + meta + 8 * A
    if part == "down":
        return n_active * (D * I // 2 + D * I // 32) + 2 * A * I + out_itemsize * A * D + meta
    raise ValueError(f"moe_bytes_moved: part must be one of {MOE_PARTS}, got {part!r}")


def moe_call_geometry(name: str, in_avals, out_avals) -> dict | None:
    """The `moe_bytes_moved` keywords of one of the MoE kernel's pallas_calls from its name and operand
    shapes (what a jaxpr holds: scripts/bench_decode.py counts the calls this way), or None if `name`
    is not one of them. Returns {"part", "A", "N", "D", "I", "G", "out_itemsize"} (and "x_itemsize" for
    gate/up)."""
    part = next((p for p in MOE_PARTS if name.startswith(f"{MOE_NAME}_{p}")), None)
    if part is None:
        return None
    G = in_avals[0].shape[0]
    # the activation operand: the call's one 2-D float input (metadata is 1-D int, weights are uint)
    act = next(a for a in in_avals if len(a.shape) == 2 and jnp.issubdtype(a.dtype, jnp.floating))
    if part == "gate_up":
        N, D = act.shape
        A_pad, I = out_avals[0].shape
        return dict(part=part, A=A_pad - _moe_pad_rows(name), N=N, D=D, I=I, G=G, out_itemsize=0,
                    x_itemsize=np.dtype(act.dtype).itemsize)
    A_pad, I = act.shape
    D = out_avals[0].shape[1]
    return dict(part=part, A=A_pad - _moe_pad_rows(name), N=0, D=D, I=I, G=G,
                out_itemsize=np.dtype(out_avals[0].dtype).itemsize)


def _moe_pad_rows(name: str) -> int:
    """The row padding (block_m) a call's name records (``..._m{block_m}_...``)."""
    return int(re.search(r"_m(\d+)_n", name).group(1))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _moe_inputs(key, tokens: int, E: int, D: int, I: int, k: int):
    """Stored-format experts (random bytes; E8M0 scales 2^-9 .. 2^-4), bf16 tokens, a random top-k of
    E per token (distinct experts) and routing weights — made on the device, one compile."""
    ks = jax.random.split(key, 9)

    def mx(kw, ksc, o, i):
        return Mxfp4(weight=jax.random.bits(kw, (E, o, i // 2), jnp.uint8),
                     scale=lax.bitcast_convert_type(jax.random.randint(ksc, (E, o, i // 32), 118, 124).astype(jnp.uint8),
                                                    quant.E8M0))

    ex = {"w1": mx(ks[0], ks[1], I, D), "w3": mx(ks[2], ks[3], I, D), "w2": mx(ks[4], ks[5], D, I)}
    x = jax.random.normal(ks[6], (tokens, D), jnp.float32).astype(jnp.bfloat16)
    _, idx = lax.top_k(jax.random.uniform(ks[7], (tokens, E)), k)
    w = jax.random.uniform(ks[8], (tokens, k), jnp.float32) + 0.1
    return ex, x, idx.astype(jnp.int32), w


def moe_bench_inputs(tokens: int, *, seed: int = 0, dims: tuple | None = None):
    """(ex, x, idx, w) for `moe_mxfp4.kernel` / `moe.routed_slots` at `tokens` tokens; dims (E, D, I, k), default
    flash's routed experts (384, 5120, 2304, 6: 7.2 GB of stored weights)."""
    if dims is None:
        c = ModelConfig.preset("flash")
        dims = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok)
    E, D, I, k = dims
    return _moe_inputs(jax.random.key(seed, impl="rbg"), tokens, E, D, I, k)


def moe_routed_bytes(ex, x, idx, w, dt=jnp.bfloat16) -> int:
    """`moe_bytes_moved` of both calls for this routing (the distinct experts it selects, host-side)."""
    E, I, D = ex["w1"].weight.shape[0], ex["w1"].weight.shape[1], x.shape[1]
    N, k = idx.shape
    A, G = N * k, min(N * k, E)
    active = len(np.unique(np.asarray(idx)))
    return int(sum(moe_bytes_moved(p, A=A, N=N, D=D, I=I, G=G, out_itemsize=jnp.dtype(dt).itemsize, n_active=active)
                   for p in MOE_PARTS))


# ----------------------------------------------------------------- linear (pallas/quant_linear.py)


def linear_bytes_moved(fmt: str, *, M: int, N: int, K: int, x_itemsize: int, out_itemsize: int, weights: int = 1,
                       weight_block=(32, 32)) -> int:
    """Minimal HBM bytes of one call, the kernel's bytes-moved contract: each of the `weights` weights (2 for
    a gated pair) and its scales at stored width once (fp8: N·K + ⌈N/32⌉·K/32, or per `weight_block` (rows, K):
    DeepSeek-V4's 128 x 128; MXFP4: N·K/2 + N·K/32), the activation in and the output out once (repeated reads
    of an activation chunk by the N tiles hit L2)."""
    return int(weights * _weight_bytes(fmt, N, K, weight_block) + M * K * x_itemsize + M * N * out_itemsize)


def _weight_bytes(fmt: str, N: int, K: int, weight_block=(32, 32)) -> int:
    """One [N, K] weight at stored width with its E8M0 scales (fp8: `weight_block` blocks, 32 x 32 by default;
    MXFP4: packed, 1 x 32)."""
    if fmt == "fp8":
        return N * K + -(-N // weight_block[0]) * (K // weight_block[1])
    if fmt == "mxfp4":
        return N * K // 2 + N * (K // 32)
    raise ValueError(f"linear_bytes_moved: fmt must be one of {LINEAR_FORMATS}, got {fmt!r}")


def linear_call_geometry(name: str, in_avals, out_avals) -> dict | None:
    """The `linear_bytes_moved` keywords of one of the linear kernel's pallas_calls from its name and operand shapes
    (scripts/bench_decode.py counts calls from a jaxpr this way), or None if `name` is not one."""
    if not name.startswith(f"{LINEAR_NAME}_"):
        return None
    fmt, *rest = name[len(LINEAR_NAME) + 1:].split("_")
    M, K = in_avals[1].shape
    N = out_avals[0].shape[1]
    geo = dict(fmt=fmt, M=M, N=N, K=K, x_itemsize=np.dtype(in_avals[1].dtype).itemsize,
               out_itemsize=np.dtype(out_avals[0].dtype).itemsize, weights=2 if "gated" in rest else 1)
    wb = [r for r in rest if r.startswith("w") and "x" in r]  # declared fp8 weight blocks (V4): "w128x128"
    if wb:
        geo["weight_block"] = tuple(int(v) for v in wb[0][1:].split("x"))
    return geo


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _linear_inputs(key, fmt: str, M: int, N: int, K: int):
    """A stored-format weight (random valid codes; E8M0 scales 2^-9 .. 2^-4) and bf16 rows, on device."""
    k1, k2, k3 = jax.random.split(key, 3)
    if fmt == "fp8":
        wb = jax.random.bits(k1, (N, K), jnp.uint8)
        wb = jnp.where((wb & 0x7F) == 0x7F, wb ^ 1, wb)  # 0x7f / 0xff are NaN in e4m3fn
        w = lax.bitcast_convert_type(wb, quant.FP8)
        srows = -(-N // 32)
    else:
        w = jax.random.bits(k1, (N, K // 2), jnp.uint8)
        srows = N
    s = lax.bitcast_convert_type(jax.random.randint(k2, (srows, K // 32), 118, 124).astype(jnp.uint8), quant.E8M0)
    x = jax.random.normal(k3, (M, K), jnp.float32).astype(jnp.bfloat16)
    return x, (Fp8 if fmt == "fp8" else Mxfp4)(weight=w, scale=s)


def linear_bench_inputs(fmt: str, M: int, N: int, K: int, *, seed: int = 0):
    """(x bf16 [M, K], p) for `quant_linear.kernel` / `quant_linear.ref_linear` at a weight of N x K in format `fmt`."""
    return _linear_inputs(jax.random.key(seed, impl="rbg"), fmt, M, N, K)


# ------------------------------------------------- the one-launch fusions' contracts (their cost estimates)


def o_proj_bytes_moved(*, M: int, G: int, R: int, I: int, H: int, hd: int, itemsize: int,
                       splits: int = 1, heads_padded: int | None = None, partials: bool = False) -> int:
    """Minimal HBM bytes of one `pallas/o_proj.py` call (M = B·T rows, G groups of R outputs over I = H·hd/G
    inputs, dt of `itemsize` bytes): wo_a (fp8 [G·R, I] and its E8M0 scales) once, the attention output once
    (the split partials, fp32 acc [splits, M, heads_padded, hd] plus m and l, or o [M, H, hd] in dt; the N-tile
    programs' repeated reads hit L2), the [M, G·R] output once."""
    o = splits * M * heads_padded * (hd + 2) * 4 if partials else M * H * hd * itemsize
    return int(_weight_bytes("fp8", G * R, I) + o + M * G * R * itemsize)


def route_bytes_moved(*, N: int, E: int, kp: int) -> int:
    """Minimal HBM bytes of one `pallas/moe_route.py` call: the fp32 logits [N, E] and bias [E] in, the three
    int32 / fp32 [N, kp] outputs (idx, weights, order) out."""
    return 4 * (N * E + E + 3 * N * kp)


def window_codes_bytes_moved(*, M: int, hd: int, itemsize: int, ring: bool) -> int:
    """Minimal HBM bytes of one `pallas/window_codes.py` call: the kv rows [M, hd] in dt and the bf16 norm
    weight once; per row the fp8 codes (hd), their E8M0 scales (hd/32) and an int32 (its position), counted
    twice with `ring` (the codes also written into the window store in place, the row indices read)."""
    return int(M * hd * itemsize + 2 * hd + M * (hd + hd // 32 + 4) * (2 if ring else 1))
