"""Pallas kernel of the attention seam: window ring + top-k compressed slots, read from stored codes.

`kernel` takes exactly the arguments of `attention.sparse_attention` (plus `interpret` and optional
tuning knobs) and returns what its "reference"/"xla" implementations return (they are the oracle: the
registry's reference is `attention.sparse_attention`, "reference" by default). Per query token (b, t)
and head block, one online softmax (m, l, acc) runs over up to three key segments, each a loop over
blocks of `block_k` keys:

1. the window ring of row `ring_rows[b]` (W entries; entry s holds the latest position ≡ s mod W
   before `start[b]`), skipped when `ring` is None (the full forward);
2. the chunk's own window keys `new[b, :]` (T entries; `valid`, position ≤ query, > query − W);
3. the selected compressed slots `sel[b, t, :]` (−1 = none), each resolved through the page table to
   its pool row `(page_table[b, slot·ratio // page_size]·page_size + slot·ratio % page_size) // ratio`
   (`indexer.pool_index`), skipped for a window-only layer (`comp` None or top-k 0).

Each key block gathers the rows' *stored codes* (fp8 e4m3 + e8m0 per-32 scales; packed e2m1 + e4m3
per-16 scales; or bf16/fp32 values), dequantizes them in registers to exactly the values
`cache.decode` gives (every decoded value is exact in bf16), and uses the one latent as K and V for all
heads of the block: logits = (q·k)·hd^−0.5 in fp32 (bf16 operands, fp32 accumulation in the bf16
flow; fp32 IEEE dots in the fp32 mode), numerator probabilities rounded to bf16 in the bf16 flow, fp32
denominator, the per-head sink exp(sink − m) in the denominator only, 0 for a query with no valid key.
A block whose keys are all invisible is skipped (`lax.cond`), which is exact: it would add nothing.

Numerics vs. the reference: the reference rounds exp(logit − m_final) to bf16; the online softmax
rounds exp(logit − m_running) and rescales the sum by exp(m_running − m_final) in fp32, so a bf16-flow
output differs by rounding: within 2^-7·Σp|v|/denom + one bf16 ulp of the output; fp32 outputs differ
by fp32 reassociation only (tests/test_pallas_attention.py states and checks the tolerances).

Lowering: Pallas **Triton** (`common.triton_params`). Every key block is a gather — ring rows, new
rows and above all pool rows chosen by the indexer through the page table — and the Triton lowering
turns an integer-array ref index (`ref[rows, :]`, one indexer per load) into a pointer gather, while
Mosaic GPU has no array-indexed gather on Hopper. Page table, selection, positions and lengths come in
as ordinary int32 inputs (no scalar prefetch on GPU). Storage dtypes the Triton lowering might not
convert everywhere (float8_e4m3fn, float8_e8m0fnu) enter as raw uint8 bits (`lax.bitcast_convert_type`
outside the kernel) and are decoded with integer ops + a bitcast by the shared `model.codec`
(`e4m3_decode`, `e8m0_decode`, `e2m1_decode`), so nothing depends on the backend's fp8 conversions.
All in-kernel tensors have power-of-two sizes (head_dim must be a power of two ≥ 32): heads are
zero-padded to ≥ 16 (the minimum `tt.dot` tile) and every segment is padded to a multiple of `block_k` with masked entries whose row
indices are clamped into range (so no load is ever out of bounds).

Grid and registers: grid (head blocks, key splits, T, B), head blocks fastest so the programs that
share a query's latents run side by side and the second head block's reads hit L2. Measured offline
(research/triton_offline_check.py: Triton 3.9 + ptxas for sm_90, no GPU needed) at flash decode shapes,
"auto" storage:
* one [block_h, 512] logits dot makes Triton's mma layout (warps along N) hold the whole query operand
  in every warp: block_h 32 / block_k 32 / 8 warps spilled 1104 B per thread. So q and the
  accumulator are kept in `block_d`-column chunks (64): per-chunk dots, 8 accumulators of [32, 64];
* keeping the decoded [block_k, 512] tile live from the logits to the numerator dots spilled 88 B;
  the numerator re-gathers each chunk (L1 hits) instead: 255 registers, 32 B of stack;
* 64 heads in one block (each latent read once for all heads) spills 360 B at 8 warps and 1168 B at
  16 warps; 16 heads at 4 warps 680 B. bf16 / fp32 storage (no dequantization) needs 182 / 175
  registers and no stack.
Measured natively on an H200 (jax 0.11.2, docs/results/gpu_check_h200/README.md), the register estimate did not
decide it: 64 heads / 16 keys / 8 warps (one read per latent for all heads, despite its spill) was the
fastest of `TUNING_CANDIDATES` at all three timed shapes (B=64 ctx 4K decode 0.37 ms vs 0.50-0.66 ms;
B=1 ctx 64K 0.13 vs 0.14-0.17; B=4 T=64 prefill chunk 0.81 vs 0.96-2.13). So for head_dim >= 256 the
default is block_h 64, block_k 16, block_d 64, 8 warps; below that block_h 32, block_k 64, 4 warps.
`TUNING_CANDIDATES` lists the alternatives worth timing on the GPU (the first is the default).

Split-K: small batches give few programs (decode at batch 1: 2 programs on a 132-SM H200), so the key
blocks of a query may be split over `num_splits` programs that write unnormalized partials
(acc, m, l) merged in XLA (`common.merge_splits`: the flash-decoding merge plus the sink). The default
aims at about two waves of programs with at least 4 key blocks per split; 1 split writes the
normalized output directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dsv41_jax.model import attention, dispatch
from dsv41_jax.model import cache as kvc
from dsv41_jax.model.codec import e2m1_decode, e4m3_decode, e8m0_decode
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas.common import MIN_DOT, expand, is_pow2, log_choice, merge_splits, next_pow2, triton_params

NAME = "sparse_attention"
_MIN_DOT = MIN_DOT
_TARGET_PROGRAMS = 264  # about two waves on a 132-SM H200 (split-K heuristic)
_MIN_BLOCKS_PER_SPLIT = 4

# Knob settings worth timing on a GPU (scripts/bench_kernels.py may sweep them; defaults: see
# `_defaults`).
TUNING_CANDIDATES = (
    dict(block_h=64, block_k=16, block_d=64, num_warps=8),  # the default at flash shapes: one read per latent
    dict(block_h=32, block_k=32, block_d=64, num_warps=8),  # two head blocks (second read from L2)
    dict(block_h=32, block_k=16, block_d=64, num_warps=8),
    dict(block_h=16, block_k=32, block_d=64, num_warps=4),  # 4 head blocks, more programs
)


def _head_dim_ok(hd: int) -> bool:
    return hd >= 32 and is_pow2(hd)


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` runs `cfg`: the fp32 numerics (not exact / deterministic) and a head_dim that is a
    power of two ≥ 32; every ``kv_cache_dtype`` `mode` (its codecs are all read in-kernel)."""
    return not is_exact(cfg) and _head_dim_ok(cfg.head_dim)


# ------------------------------------------------------------------------------ storage as raw bits


def _raw_codes(st: dict, codec: str) -> list:
    """Storage arrays of one store as the kernel reads them, flattened to [rows, width].

    fp8: [e4m3 bits uint8 [.., hd], e8m0 bits uint8 [.., hd/32]]; fp4_e4m3: [packed e2m1 uint8
    [.., hd/2], e4m3 scale bits uint8 [.., hd/16]]; bf16 / f32: [values [.., hd]].
    """
    def flat(a):
        return a.reshape(-1, a.shape[-1])

    def bits(a):
        return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)

    if codec == "fp8":
        return [flat(bits(st["q"])), flat(bits(st["s"]))]
    if codec == "fp4_e4m3":
        return [flat(st["q"]), flat(bits(st["s"]))]
    if codec in ("bf16", "f32"):
        return [flat(st["v"])]
    raise NotImplementedError(f"sparse_attention kernel: storage codec {codec!r}")


def _load_rows(codec: str, refs, rows, col: int, dc: int, dt):
    """Gather columns [col, col + dc) of pool rows `rows` int32 [BK] of one store and dequantize:
    [BK, dc] in `dt`, exactly `cache.decode`'s values (`col`, `dc` multiples of the scale block)."""
    bk = rows.shape[0]
    if codec == "fp8":
        v = e4m3_decode(refs[0][rows, pl.ds(col, dc)].astype(jnp.int32), jnp)
        v = v * expand(e8m0_decode(refs[1][rows, pl.ds(col // 32, dc // 32)].astype(jnp.int32), jnp), 32)
    elif codec == "fp4_e4m3":
        packed = refs[0][rows, pl.ds(col // 2, dc // 2)].astype(jnp.int32)  # low nibble = even element
        codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(bk, dc)
        scale = e4m3_decode(refs[1][rows, pl.ds(col // 16, dc // 16)].astype(jnp.int32), jnp)
        v = e2m1_decode(codes, jnp) * expand(scale, 16)
    else:
        v = refs[0][rows, pl.ds(col, dc)].astype(jnp.float32)
    return v.astype(dt)


# ------------------------------------------------------------------------------------------ kernel


def _kernel(*refs, c):
    """One program: query (b, t), head block h, key split s. `c` holds the static layout (see `kernel`)."""
    it = iter(refs)
    q_ref = next(it)
    sink_ref = next(it) if c["num_splits"] == 1 else None  # with splits the merge (XLA) adds the sink
    rr_ref, start_ref, pos_ref, valid_ref = (next(it) for _ in range(4))
    pt_ref = next(it) if c["has_comp"] else None
    sel_ref = next(it) if c["has_comp"] else None
    lay_ref = next(it) if c["n_ring"] else None  # the ring's layer (int32 [1])
    ring_refs = [next(it) for _ in range(c["n_ring"])]
    new_refs = [next(it) for _ in range(c["n_new"])]
    comp_refs = [next(it) for _ in range(c["n_comp"])]
    out_refs = list(it)

    s_id, t, b = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    W, T, BK, hd = c["window"], c["T"], c["block_k"], c["hd"]
    dt, num_dt = c["dt"], c["num_dt"]
    prec = lax.Precision.HIGHEST  # fp32 operands: IEEE dots; bf16 operands: exact products, fp32 sums

    dc = c["dc"]
    nc = hd // dc
    # The query and the accumulator live in head_dim chunks of dc columns: one logits dot over all
    # 512 columns would make Triton hold the whole [block_h, 512] query operand in registers in every
    # warp; per-chunk dots keep each operand small (see the module docstring).
    qs = [q_ref[:, pl.ds(j * dc, dc)] for j in range(nc)]  # [Hb, dc] in dt
    pos_t = pos_ref[b * T + t]
    start_b = start_ref[b]
    lane = lax.iota(jnp.int32, BK)

    def update(carry, load, vis):
        """One key block: load(j) gathers + dequantizes column chunk j of the block's latents."""
        m, l, accs = carry
        logits = None
        for j, qj in enumerate(qs):
            part = lax.dot_general(qj, load(j), (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)
            logits = part if logits is None else logits + part
        logits = jnp.where(vis[None, :], logits * c["scale"], -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no visible key yet: exp(−inf − 0) = 0
        corr = jnp.exp(m - m_safe)
        p = jnp.exp(logits - m_safe[:, None])
        l = l * corr + jnp.sum(p, axis=1)
        pn = p.astype(num_dt)
        # The chunks are gathered again for the numerator (L1 hits) rather than kept live across the
        # softmax: holding the whole [block_k, 512] tile in two dot-operand layouts costs registers.
        accs = tuple(a * corr[:, None] + lax.dot_general(pn, load(j), (((1,), (0,)), ((), ())), precision=prec,
                                                          preferred_element_type=jnp.float32)
                     for j, a in enumerate(accs))
        return m_new, l, accs

    def segment(carry, lo, hi, rows_vis, codec, src_refs):
        """Key blocks [lo, hi) of one segment; rows_vis(i) -> (rows [BK], visible [BK])."""
        def body(i, carry):
            rows, vis = rows_vis(i)
            any_vis = jnp.max(vis.astype(jnp.int32)) > 0

            def take(cr):
                return update(cr, lambda j: _load_rows(codec, src_refs, rows, j * dc, dc, dt), vis)

            return lax.cond(any_vis, take, lambda cr: cr, carry)

        return lax.fori_loop(lo, hi, body, carry)

    def ring_rows_vis(i):
        sidx = i * BK + lane
        sc = jnp.minimum(sidx, W - 1)
        # Latest position ≡ s (mod W) before start; start − 1 − s + W ≥ 0, so rem is a floor mod here.
        rpos = start_b - 1 - lax.rem(start_b - 1 - sc + W, W)
        vis = (sidx < W) & (rpos >= 0) & (rpos <= pos_t) & (rpos > pos_t - W)
        rr = jnp.clip(rr_ref[b], 0, c["ring_rows_max"])
        return (rr * c["ring_layers"] + lay_ref[0] + c["ring_base"]) * W + sc, vis

    def new_rows_vis(i):
        u = i * BK + lane
        # positions / valid are [B·T], unpadded: the block's lanes past T read token T − 1's and are invalid
        # (padding them to whole blocks was an XLA launch per layer, and per trip in a layer-scan run)
        tok = b * T + jnp.minimum(u, T - 1)
        kpos = pos_ref[tok]
        ok = (u < T) & (valid_ref[tok] != 0)
        vis = ok & (kpos <= pos_t) & (kpos > pos_t - W)
        return b * T + jnp.minimum(u, T - 1), vis

    def comp_rows_vis(i):
        slot = sel_ref[b, t, pl.ds(i * BK, BK)]
        tok = jnp.maximum(slot, 0) * c["ratio"]
        pidx = jnp.minimum(lax.div(tok, c["page_size"]), c["pages_max"])  # token_locs clamps the page index
        page = pt_ref[b, pidx]
        row = lax.div(page * c["page_size"] + lax.rem(tok, c["page_size"]), c["ratio"])
        return jnp.clip(row, 0, c["comp_rows_max"]), slot >= 0

    hb = qs[0].shape[0]
    carry = (jnp.full((hb,), -jnp.inf, jnp.float32), jnp.zeros((hb,), jnp.float32),
             tuple(jnp.zeros((hb, dc), jnp.float32) for _ in range(nc)))
    nb, ns = c["n_blocks"], c["num_splits"]
    lo = lax.div(s_id * nb, ns)
    hi = lax.div((s_id + 1) * nb, ns)
    off = 0
    for n_seg, fn, codec, src in ((c["nb_ring"], ring_rows_vis, c["win_codec"], ring_refs),
                                  (c["nb_new"], new_rows_vis, c["win_codec"], new_refs),
                                  (c["nb_comp"], comp_rows_vis, c["comp_codec"], comp_refs)):
        if n_seg == 0:
            continue
        a = jnp.clip(lo - off, 0, n_seg)
        z = jnp.clip(hi - off, 0, n_seg)
        carry = segment(carry, a, z, fn, codec, src)
        off += n_seg
    m, l, accs = carry

    if ns == 1:
        (o_ref,) = out_refs
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        denom = l + jnp.exp(sink_ref[...] - m_safe)
        for j, a in enumerate(accs):
            o_ref[:, pl.ds(j * dc, dc)] = (a / denom[:, None]).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        for j, a in enumerate(accs):
            acc_ref[:, pl.ds(j * dc, dc)] = a
        m_ref[...] = m
        l_ref[...] = l


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _plan(q, ring, sel, comp, window: int, block_h, block_k, block_d, num_splits, num_warps, num_stages) -> dict:
    """The static layout of one call: padded heads, block sizes, segment block counts, splits, warps.
    Knobs left None get the shape defaults of the module docstring."""
    B, T, H, hd = q.shape
    has_comp = comp is not None and sel.shape[-1] > 0
    K = sel.shape[-1] if has_comp else 0
    W = int(window)
    hp = max(_MIN_DOT, next_pow2(H))
    if block_h is None:
        block_h = min(hp, 64 if hd >= 256 else 32)
    if block_k is None:
        block_k = 16 if hd >= 256 else 64
        block_k = max(_MIN_DOT, min(block_k, next_pow2(max(W if ring is not None else 0, T, K))))
    if num_warps is None:
        num_warps = 8 if hd >= 256 else 4
    if block_d is None:
        block_d = min(hd, 64)
    if block_d < 32 or block_d & (block_d - 1) or hd % block_d:
        raise ValueError(f"sparse_attention: block_d={block_d} must be a power of two >= 32 dividing head_dim {hd}")
    for name, v in (("block_h", block_h), ("block_k", block_k)):
        if v < _MIN_DOT or v & (v - 1):
            raise ValueError(f"sparse_attention: {name}={v} must be a power of two >= {_MIN_DOT}")
    hp = max(hp, block_h)
    nb_ring = _round_up(W, block_k) // block_k if ring is not None else 0
    nb_new = _round_up(T, block_k) // block_k
    nb_comp = _round_up(K, block_k) // block_k
    n_blocks = nb_ring + nb_new + nb_comp
    n_hblk = hp // block_h
    if num_splits is None:
        num_splits = max(1, min(-(-n_blocks // _MIN_BLOCKS_PER_SPLIT), -(-_TARGET_PROGRAMS // (B * T * n_hblk))))
    return dict(hp=hp, block_h=block_h, block_k=block_k, block_d=block_d, num_warps=num_warps, num_stages=num_stages,
                num_splits=int(max(1, min(num_splits, n_blocks))), has_comp=has_comp, K=K, nb_ring=nb_ring,
                nb_new=nb_new, nb_comp=nb_comp, n_blocks=n_blocks, n_hblk=n_hblk)


def effective_knobs(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, *, window: int,
                    block_h=None, block_k=None, block_d=None, num_splits=None, num_warps=None, num_stages: int = 2,
                    **_) -> dict:
    """The knobs `kernel` runs with for these arguments (block_h, block_k, num_splits, num_warps,
    num_stages), defaults resolved — for benchmarks and the offline compile check."""
    p = _plan(q, ring, sel, comp, window, block_h, block_k, block_d, num_splits, num_warps, num_stages)
    return {k: p[k] for k in ("block_h", "block_k", "block_d", "num_splits", "num_warps", "num_stages")}


def kernel(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, *, ratio: int,
           page_size: int, window: int, mode: str, ring_layer=None, ring_base: int = 0, interpret: bool = False,
           block_h: int | None = None, block_k: int | None = None, block_d: int | None = None,
           num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2, merge: bool = True,
           key_lo=None):
    """Sparse retrieval attention from stored codes (the "attention" seam; arguments as
    `attention.sparse_attention`, whose docstring gives every shape and dtype).

    q [B, T, H, hd] bf16 | fp32; sink fp32 [H]; ring: the layer's ring codes (first axes [R, W]), every
    layer's (first axes [R, L, W]: layer ring_base + ring_layer, an int or int32 scalar, read in place) or
    None; ring_rows int32 [B]; new: the chunk's window codes (first axes [B, T]); start int32 [B];
    positions int32 [B, T]; valid bool [B, T]; comp: pool codes (first axis N) or None; page_table
    int32 [B, P]; sel int32 [B, T, K] (−1 = none). Static: ratio, page_size, window, mode.
    Returns [B, T, H, hd] in q.dtype.

    Knobs (static; defaults from the shapes, see the module docstring): block_h heads per program
    (power of two ≥ 16; heads are zero-padded), block_k keys per block, block_d head_dim columns
    per dot (power of two ≥ 32 dividing head_dim), num_splits key splits
    (≥ 2 adds an XLA merge), num_warps / num_stages for Triton. `interpret` runs the same body
    through the HLO interpreter (CPU tests). merge=False: with ≥ 2 splits return the unmerged partials
    {"acc": fp32 [S, B, T, hp, hd], "m", "l": fp32 [S, B, T, hp]} (heads padded to hp) for a consumer that
    merges them itself (`pallas.o_proj`, with the sink); with one split the output as usual. key_lo: must be None
    (SWA bounded replay's window bound has no kernel).
    """
    if key_lo is not None:
        impl = "pallas_interpret" if interpret else "pallas"
        raise NotImplementedError(f"attention: the window lower bound of SWA bounded replay (key_lo) has no {impl!r} "
                                  f"kernel; run the attention op with impl 'xla' or 'reference'")
    dt = q.dtype
    if dt not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"sparse_attention kernel: q must be bf16 or fp32, got {dt}")
    B, T, H, hd = q.shape
    if not _head_dim_ok(hd):
        raise NotImplementedError(f"sparse_attention kernel: head_dim {hd} must be a power of two >= 32")
    W = int(window)
    win_codec = kvc._codec("win", mode)
    comp_codec = kvc._codec("comp", mode)
    p = _plan(q, ring, sel, comp, W, block_h, block_k, block_d, num_splits, num_warps, num_stages)
    hp, bh, bk, nw, ns = p["hp"], p["block_h"], p["block_k"], p["num_warps"], p["num_splits"]
    has_comp, K, n_hblk = p["has_comp"], p["K"], p["n_hblk"]
    kp = p["nb_comp"] * bk

    # Inputs: heads zero-padded (their outputs are dropped), K padded to whole key blocks (the kernel clamps
    # its reads of the chunk's T tokens).
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, hp - H), (0, 0)))
    sinkp = jnp.pad(sink.astype(jnp.float32), (0, hp - H))
    pos_f = positions.astype(jnp.int32).reshape(B * T)
    valid_f = valid.astype(jnp.int32).reshape(B * T)
    rr = ring_rows.astype(jnp.int32)
    st = start.astype(jnp.int32)
    # The sink enters only where the kernel uses it (one split: it normalizes in-kernel). With splits the
    # merge adds it, in XLA, where a layer-scan run's slice of it fuses; as a kernel operand that slice
    # would be a copy outside the step's command buffer.
    ins = [qp] + ([sinkp] if p["num_splits"] == 1 else []) + [rr, st, pos_f, valid_f]
    if has_comp:
        sel_p = jnp.pad(sel.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - K)), constant_values=-1)
        ins += [page_table.astype(jnp.int32), sel_p]
    ring_in, n_layers = [], 1
    if isinstance(ring_layer, int):  # a static layer is one static index (no operand to add at run time)
        ring_layer, ring_base = ring_layer + ring_base, 0
    if ring is not None:
        lead = jax.tree_util.tree_leaves(ring)[0].shape[:-1]
        if len(lead) != (2 if ring_layer is None else 3) or lead[-1] != W:
            raise ValueError(f"sparse_attention kernel: ring codes lead with {lead}; expected (R, W={W})"
                             + ("" if ring_layer is None else f" or, with ring_layer, (R, L, W={W})"))
        n_layers = 1 if ring_layer is None else lead[1]
        # the layer is an operand (a layer-scan run's index; else a constant): every layer's rings stay one array
        ins.append(jnp.reshape(jnp.asarray(0 if ring_layer is None else ring_layer, jnp.int32), (1,)))
        ring_in = _raw_codes(ring, win_codec)
    new_in = _raw_codes(new, win_codec)
    comp_in = _raw_codes(comp, comp_codec) if has_comp else []
    ins += ring_in + new_in + comp_in

    c = dict(window=W, T=T, block_k=bk, dc=p["block_d"], hd=hd, dt=dt, num_dt=jnp.bfloat16 if dt == jnp.bfloat16 else jnp.float32,
             scale=hd ** -0.5, has_comp=has_comp, n_ring=len(ring_in), n_new=len(new_in), n_comp=len(comp_in),
             win_codec=win_codec, comp_codec=comp_codec, ratio=int(ratio), page_size=int(page_size),
             pages_max=page_table.shape[1] - 1, comp_rows_max=(comp_in[0].shape[0] - 1) if has_comp else 0,
             ring_rows_max=(jax.tree_util.tree_leaves(ring)[0].shape[0] - 1) if ring is not None else 0,
             ring_layers=n_layers, ring_base=int(ring_base),
             nb_ring=p["nb_ring"], nb_new=p["nb_new"], nb_comp=p["nb_comp"], n_blocks=p["n_blocks"], num_splits=ns)

    def whole(a):
        nd = a.ndim
        return pl.BlockSpec(a.shape, lambda h, s, t, b, nd=nd: (0,) * nd)

    in_specs = [pl.BlockSpec((None, None, bh, hd), lambda h, s, t, b: (b, t, h, 0))]
    if ns == 1:
        in_specs.append(pl.BlockSpec((bh,), lambda h, s, t, b: (h,)))
    in_specs += [whole(a) for a in ins[len(in_specs):]]
    grid = (n_hblk, ns, T, B)
    if ns == 1:
        out_shape = [jax.ShapeDtypeStruct((B, T, hp, hd), dt)]
        out_specs = [pl.BlockSpec((None, None, bh, hd), lambda h, s, t, b: (b, t, h, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((ns, B, T, hp, hd), jnp.float32),
                     jax.ShapeDtypeStruct((ns, B, T, hp), jnp.float32),
                     jax.ShapeDtypeStruct((ns, B, T, hp), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, bh, hd), lambda h, s, t, b: (s, b, t, h, 0)),
                     pl.BlockSpec((None, None, None, bh), lambda h, s, t, b: (s, b, t, h)),
                     pl.BlockSpec((None, None, None, bh), lambda h, s, t, b: (s, b, t, h))]
    log_choice(NAME, interpret, block_h=bh, block_k=bk, block_d=p["block_d"], num_splits=ns, num_warps=nw, mode=mode)
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=triton_params(num_warps=nw, num_stages=num_stages),
        name=f"sparse_attention_h{bh}_k{bk}_d{p['block_d']}_s{ns}")(*ins)
    if ns == 1:
        out = outs[0]
    elif not merge:
        return {"acc": outs[0], "m": outs[1], "l": outs[2]}
    else:
        out = merge_splits(*outs, sinkp).astype(dt)
    return out[:, :, :H]


# the reference: the seam itself, whose default implementation is "reference" (same arguments)
dispatch.register("attention", "kernel", kernel=kernel, reference=attention.sparse_attention, supports=supports)
