"""Pallas indexer kernel (issue 11, part 2) ≡ the reference indexer, array for array.

Run with the `pallas_impl` fixture: natively on a GPU ("pallas"), in interpret mode elsewhere. Every
comparison is exact equality of int arrays (selections with their −1 layout, candidate block ids):
tolerance 0. Keys and queries are fp4 values (their q·k dots are exact in fp32, whatever the order);
the bf16 flow runs on small integers (every step exact) and on random values, against the reference
run *eagerly* — under `jit` XLA may drop a bf16 rounding inside a fusion (docs/design/fastpath_attention.md),
op by op it cannot. The scoring stage is also checked bit for bit against SPEC's step-by-step
arithmetic in numpy.

Covered: ragged `visible` in one batch (0, 1, fewer than k, one block, several blocks, the full
table, past the table end), contexts below and above one scoring block, a row holding fewer pages,
a verify window of T = 6, batch 1, exact ties (duplicated and all-equal keys), the candidate source
(blocks) and candidate-masked layers (the reference's own candidates, and a mask that leaves only the
newest block, which puts the −1 fillers *before* the picks), kv-cache dtypes "auto" and "fp8_e4m3",
bf16 and fp32 flows, one-chunk and multi-chunk / multi-split tiles.
"""

import functools

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dispatch, indexer
from dsv41_jax.model import codec, quant
from dsv41_jax.pallas import indexer_topk

_STATIC = ("impl", "ratio", "page_size", "mode", "k", "dt", "make", "bs", "kb", "tiles")


def _ref(q, w, codes, pt, vis, cand, *, ratio, page_size, mode, k, dt, make, bs, kb):
    """The reference through the seam, run eagerly: op by op, every bf16 rounding of SPEC happens (under
    `jit`, XLA may fuse a rounding away; measured: the jitted bf16 reference differs from SPEC's
    step-by-step arithmetic on about half the scores of random inputs, the eager one on none)."""
    return indexer.topk(q, w, codes, pt, vis, ratio=ratio, page_size=page_size, mode=mode, k=k, dt=dt,
                        cand_blocks=cand, make_candidates=make, block_size=bs, topk_blocks=kb, impl="reference")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _kern(q, w, codes, pt, vis, cand, *, impl, ratio, page_size, mode, k, dt, make, bs, kb, tiles):
    """The kernel with explicit tiles (slot block, select chunk, target programs): small tiles run every
    multi-step loop on small shapes."""
    return dispatch.kernel("indexer", impl)(
        q, w, codes, pt, vis, ratio=ratio, page_size=page_size, mode=mode, k=k, dt=dt, cand_blocks=cand,
        make_candidates=make, block_size=bs, topk_blocks=kb, interpret=impl == "pallas_interpret",
        slot_block=tiles[0], select_chunk=tiles[1], target_programs=tiles[2])


def _case(mode, exact, ratio, seed):
    """A 3-row batch with a T = 6 verify window: (q, w, codes, page table, visible, S)."""
    rng = np.random.default_rng(seed)
    B, T, nI, dI, ps, P = 3, 6, 4, 32, 16, 6
    S = P * ps // ratio  # 96 or 48 slots: several 16-slot scoring blocks, one 64-slot block or two
    n_pages = 3 * P + 1
    n_rows = n_pages * ps // ratio
    if exact:  # values in {-1, 0, 1}: every score is a small integer, exact in bf16
        v = rng.integers(-1, 2, size=(n_rows, dI)) * (rng.random((n_rows, dI)) < 0.3)
    else:
        v = rng.standard_normal((n_rows, dI))
    v = v.astype(np.float32)
    v[rng.choice(n_rows, n_rows // 6, replace=False)] = 0.0  # zero scores
    dup = rng.choice(n_rows, n_rows // 4, replace=False)
    v[dup] = v[rng.choice(n_rows, len(dup))]  # equal keys in different slots: exact ties
    codes = kvc.encode("ikey", mode, jnp.asarray(v))
    pt = rng.permutation(np.arange(1, n_pages))[: B * P].reshape(B, P).astype(np.int32)
    pt[2, 3:] = 0  # row 2 holds 3 pages; the rest of its table points at the null page
    if exact:
        q = rng.integers(-1, 2, size=(B, T, nI, dI)).astype(np.float32)
        w = rng.choice([-2.0, -1.0, 1.0, 2.0], size=(B, T, nI)).astype(np.float32)
    else:
        q = np.asarray(quant.fake_quant_fp4_pow2(jnp.asarray(rng.standard_normal((B, T, nI, dI)), jnp.float32), 32))
        w = rng.standard_normal((B, T, nI)).astype(np.float32)
    held = 3 * ps // ratio  # slots row 2 holds
    vis = np.array([[0, 1, 3, 5, 9, 15],  # nothing / fewer than k visible, all inside the first block
                    [S - 5, S - 4, S - 3, S - 2, S - 1, S + 2],  # the full table; S + 2: a padding query
                    [held - 5, held - 4, held - 3, held - 2, held - 1, held]], np.int32)
    return q, w, codes, jnp.asarray(pt), jnp.asarray(vis), S


CASES = [  # (kv cache dtype, flow, exact inputs, ratio, tiles)
    ("auto", "bfloat16", True, 2, (16, 16, 2)),
    ("fp8_e4m3", "float32", False, 1, (16, 16, 2)),
    ("auto", "bfloat16", False, 1, (64, 512, 1024)),  # the default tiles: one scoring block (64 slots) or two
]


@pytest.mark.parametrize("mode, dtype, exact, ratio, tiles", CASES)
def test_kernel_equals_reference(pallas_impl, mode, dtype, exact, ratio, tiles):
    """Selections and candidate blocks identical to the reference, −1 layout included."""
    dt = jnp.dtype(dtype)
    q, w, codes, pt, vis, S = _case(mode, exact, ratio, seed=7 + ratio)
    q, w = jnp.asarray(q, dt), jnp.asarray(w, dt)
    k, bs, kb = 8, 2, 3
    common = dict(ratio=ratio, page_size=16, mode=mode, k=k, dt=dt, bs=bs, kb=kb)

    def both(cand, make):
        ref = _ref(q, w, codes, pt, vis, cand, make=make, **common)
        got = _kern(q, w, codes, pt, vis, cand, impl=pallas_impl, make=make, tiles=tiles, **common)
        return [None if a is None else np.asarray(a) for a in (*ref, *got)]

    # The candidate source: every visible slot scored, plus candidate blocks.
    ref_sel, ref_cand, sel, cand = both(None, True)
    np.testing.assert_array_equal(sel, ref_sel)
    np.testing.assert_array_equal(cand, ref_cand)
    # The cases are what they claim: empty and short selections (−1 padding), full ones, full candidates.
    assert (ref_sel[0, 0] == -1).all() and (ref_sel[0, 2] >= 0).sum() == 3 and (ref_sel[1] >= 0).all()
    assert (ref_cand[1] >= 0).all() and (ref_cand[0, 1] == [0, -1, -1]).all()

    # A layer masked to the candidate source's blocks.
    ref_sel2, none_ref, sel2, none = both(jnp.asarray(ref_cand), False)
    assert none is None and none_ref is None
    np.testing.assert_array_equal(sel2, ref_sel2)
    assert not np.array_equal(ref_sel2, ref_sel)

    # A mask that leaves only the newest block: the −inf fillers (−1) are the lowest slots, so they
    # come first in the reference's ascending layout.
    newest = np.maximum(np.asarray(vis) - 1, 0) // bs
    only = np.full(newest.shape + (kb,), -1, np.int32)
    only[..., 0] = np.where(np.asarray(vis) > 0, np.minimum(newest, -(-S // bs) - 1), -1)
    ref_sel3, _, sel3, _ = both(jnp.asarray(only), False)
    np.testing.assert_array_equal(sel3, ref_sel3)
    assert (ref_sel3[1, 0, :-bs] == -1).all() and (ref_sel3[1, 0, -bs:] >= 0).any()


def test_seam_batch1_all_ties(pallas_impl):
    """Through the seam (`indexer.topk(impl=...)`), batch 1: all scores equal, so the k lowest visible
    slots win; fewer visible slots than k leave −1 at the end; the candidate blocks tie the same way."""
    dI, ps = 32, 4
    v = np.zeros((16, dI), np.float32)
    v[:, 0] = 1.0
    mode = "fp8_e4m3"
    codes = kvc.encode("ikey", mode, jnp.asarray(v))
    pt = jnp.asarray([[3, 1, 2, 0]], jnp.int32)
    q = jnp.zeros((1, 2, 1, dI), jnp.float32).at[..., 0].set(1.0)
    w = jnp.ones((1, 2, 1), jnp.float32)
    vis = jnp.asarray([[11, 2]], jnp.int32)
    kw = dict(ratio=1, page_size=ps, mode=mode, k=4, dt=jnp.float32, make_candidates=True, block_size=2,
              topk_blocks=2)
    sel, cand = jax.jit(functools.partial(indexer.topk, impl=pallas_impl, **kw))(q, w, codes, pt, vis)
    assert np.asarray(sel).tolist() == [[[0, 1, 2, 3], [0, 1, -1, -1]]]
    assert np.asarray(cand).tolist() == [[[0, 5], [0, -1]]]  # block 5 holds the newest slot (forced)
    ref_sel, ref_cand = indexer.topk(q, w, codes, pt, vis, impl="reference", **kw)
    np.testing.assert_array_equal(np.asarray(sel), np.asarray(ref_sel))
    np.testing.assert_array_equal(np.asarray(cand), np.asarray(ref_cand))


@pytest.mark.parametrize("mode, T", [("auto", 6), ("fp8_e4m3", 1)])
def test_scores_round_like_spec(pallas_impl, mode, T):
    """The scoring stage's bf16 scores equal docs/design/spec.md §4's step-by-step arithmetic bit for bit, on random
    (inexact) values: bf16 after the q·k dot, after the weight product, after the head sum.

    The oracle is numpy (float64 sums, which are exact here, then the roundings), not the jitted
    reference, whose bf16 roundings XLA may drop inside a fusion. The selection tests cannot see a
    missing rounding step (it rarely moves a top-k boundary); this one does. T = 1 is the decode
    path (the query held in registers across the row's blocks)."""
    bf16 = ml_dtypes.bfloat16
    q, w, codes, pt, vis, S = _case(mode, False, 2, seed=3)
    q, w = jnp.asarray(q[:, -T:], jnp.bfloat16), jnp.asarray(w[:, -T:] * 3.3, jnp.bfloat16)  # w off the pow2 grid
    vis = vis[:, -T:]
    run = jax.jit(functools.partial(indexer_topk.dense_scores, ratio=2, page_size=16, mode=mode, dt=jnp.bfloat16,
                                    interpret=pallas_impl == "pallas_interpret", slot_block=16, target_programs=2))
    got = np.asarray(run(q, w, codes, pt, vis).astype(jnp.float32))
    jj = np.broadcast_to(np.arange(S, dtype=np.int32), (3, S))
    rows = indexer.pool_index(pt, jnp.asarray(jj), 2, 16)
    keys = np.asarray(kvc.decode("ikey", mode, kvc.store_get(codes, rows), jnp.float32), np.float64)
    qf, wf = np.asarray(q, np.float64), np.asarray(w, np.float64)
    rnd = lambda x: x.astype(np.float32).astype(bf16).astype(np.float64)  # noqa: E731
    qk = rnd(np.einsum("bthd,bsd->bths", qf, keys))
    want = rnd(rnd(wf[..., None] * np.maximum(qk, 0.0)).sum(axis=2)).astype(np.float32)
    live = jj[:, None, :] < np.asarray(vis)[..., None]
    assert live.sum() > 50 * T
    np.testing.assert_array_equal(np.where(live, got, 0.0), np.where(live, want, 0.0))
    if T > 1:
        assert np.isneginf(got[1, 0, S - 5:]).all()  # past `visible` inside the live blocks: −inf


@pytest.mark.parametrize("mode", ["auto", "fp8_e4m3"])
def test_kernel_key_decode_is_the_codec(mode):
    """The kernel gets the index-key codes as raw bytes (`_codes`) and decodes them with the shared
    `model.codec` (as `_Geo`'s loads do); that decode equals the reference `cache.decode`, bit for bit."""
    x = jax.random.normal(jax.random.key(6), (4, 5, 64), jnp.float32) * 2.0
    st = kvc.encode("ikey", mode, x)
    kind, (q, s) = indexer_topk._codes(st, mode)
    q, s = q.astype(jnp.int32), s.astype(jnp.int32)
    scale = jnp.repeat(codec.e8m0_decode(s, jnp), 32, axis=-1)
    v = codec.e2m1_decode(codec.unpack_nibbles(q, jnp), jnp) if kind == "fp4" else codec.e4m3_decode(q, jnp)
    want = kvc.decode("ikey", mode, st, jnp.float32)
    np.testing.assert_array_equal(np.asarray(v * scale).view(np.uint32), np.asarray(want).view(np.uint32))
