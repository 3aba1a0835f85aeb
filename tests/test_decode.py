"""Incremental decode ≡ full forward; chunked prefill; ragged batches; jit cache; allocator; fp8 KV (issue 3).

On `configs.mini` (tiny's sizes, every mechanism of its layout in 6 layers): decode ≡ forward is a
relation between two paths of one model, so it needs every mechanism, not tiny's 10 layers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs

from dsv41_jax.model import ModelConfig, forward
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model.params import init_params

T = 40  # crosses the window (8), ratio-2 groups, candidate blocks (2 slots) and index_topk (4)
CCFG = kvc.CacheConfig(page_size=8, num_pages=24, max_slots=4, max_pages_per_seq=6)
# Compile time dominates this file (mini model, ~6-13 s per (config, B, T) on a small CPU), so the tests
# share a few compiled steps: the full forward at [1, T]; a one-token step with aux; a [1, TC] chunk step
# into which prefill chunks of any size <= TC (and one-token steps) go as ragged rows (n_new <= TC); a
# [2, TC] step for the ragged batch. Chunk boundaries, not the step's padded width, are what the
# chunked-prefill property is about.
TC = 16
FWD = jax.jit(forward, static_argnames=("cfg", "return_aux"))


@functools.lru_cache(maxsize=None)
def _step_aux(cfg, ccfg):
    """extend with all logits and the aux decisions (the incremental test's one-token steps)."""
    return jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, ccfg, all_logits=True, return_aux=True))


def _fresh(cfg, params, ccfg=CCFG):
    st = kvc.init_cache(cfg, ccfg)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    st = kvc.reset_slots(st, np.arange(ccfg.max_slots + 1), pad)
    return st, kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)


def _feed(params, st, alloc, cfg, ccfg, tokens, chunks, start=0):
    """Write `tokens` (positions start..) for request "r" in slot 0 in chunks of the given sizes, each one
    [1, TC] all-logits step (`decode.jitted_extend(cfg, ccfg, True)`). Returns (fp32 logits [n, V], state)."""
    assert sum(chunks) == len(tokens) and max(chunks) <= TC
    outs, pos = [], start
    for n in chunks:
        alloc.ensure("r", pos + n)
        b = dec.make_batch([{"tokens": list(tokens[pos - start: pos - start + n]), "start": pos, "slot": 0,
                             "page_table": alloc.pages("r")}], TC, 1, ccfg)
        lg, st = dec.decode_step(params, st, b, cfg, ccfg, all_logits=True)
        outs.append(np.asarray(lg)[0, :n])
        pos += n
    return np.concatenate(outs), st


def _schedule(c, n=T):
    """Chunks of c tokens covering n (the last one shorter)."""
    return [c] * (n // c) + ([n % c] if n % c else [])


@pytest.fixture(scope="module")
def seq():
    return np.asarray(jax.random.randint(jax.random.key(11), (T,), 3, 300), np.int32)


@pytest.fixture(scope="module")
def full32(mini_params, mini_cfg32, seq):
    logits, aux = FWD(mini_params, jnp.asarray(seq)[None], mini_cfg32, return_aux=True)
    return np.asarray(logits[0]), jax.tree_util.tree_map(np.asarray, aux)


def test_incremental_equals_full(mini_params, mini_cfg32, seq, full32):
    """prefill(4) + 36 one-token steps: logits ≤ 1e-4 and identical top-k / candidate / expert choices."""
    cfg = mini_cfg32
    full, faux = full32
    st, alloc = _fresh(cfg, mini_params)
    P0 = 4
    lg, st = _feed(mini_params, st, alloc, cfg, CCFG, seq[:P0], [P0])
    assert np.abs(lg - full[:P0]).max() <= 1e-4
    step = _step_aux(cfg, CCFG)
    for t in range(P0, T):
        alloc.ensure("r", t + 1)
        b = dec.make_batch([{"tokens": [int(seq[t])], "start": t, "slot": 0, "page_table": alloc.pages("r")}],
                           1, 1, CCFG)
        lg, st, aux = step(mini_params, st, b)
        d = np.abs(np.asarray(lg)[0, 0] - full[t]).max()
        assert d <= 1e-4, f"position {t}: max |Δ| = {d}"
        for lid, sel in aux["topk"].items():
            got = np.asarray(sel)[0, 0]
            want = faux["topk"][lid][0, t]
            got_set = sorted(got[got >= 0].tolist())
            want_set = sorted(want[want >= 0].tolist())
            assert got_set == want_set, f"layer {lid} position {t}: top-k {got_set} vs {want_set}"
        c = cfg.candidate_source_layer_id
        np.testing.assert_array_equal(np.asarray(aux["cand"][c])[0, 0, : faux["cand"][c].shape[-1]],
                                      faux["cand"][c][0, t])
        for lid, e in aux["experts"].items():
            assert np.asarray(e)[0, 0].tolist() == faux["experts"][lid][0, t].tolist()


@pytest.fixture(scope="module")
def widest_chunks(mini_params, mini_cfg32, seq):
    """The sequence prefilled in the widest chunks the step takes (16, 16, 8): logits, cache, pages."""
    st, alloc = _fresh(mini_cfg32, mini_params)
    lg, st = _feed(mini_params, st, alloc, mini_cfg32, CCFG, seq, _schedule(TC))
    return lg, jax.tree_util.tree_map(np.asarray, st), alloc.pages("r")


# chunks of 1, and chunks that split ratio-2 groups (odd sizes) at every alignment; an irregular mix
@pytest.mark.parametrize("chunks", [_schedule(1), _schedule(3), _schedule(7), [2, 16, 5, 1, 9, 7]],
                         ids=["1", "3", "7", "mixed"])
def test_chunked_prefill_equals_one_shot(mini_params, mini_cfg32, seq, full32, widest_chunks, chunks):
    """Any chunking gives the same logits as the full forward (≤ 1e-4) and the same cache as the widest
    chunks: every store's codes identical (window rings, pools, partial groups, Engram history)."""
    cfg = mini_cfg32
    lg1, st1, pages1 = widest_chunks
    np.testing.assert_allclose(lg1, full32[0], atol=1e-4, rtol=0)
    st2, a2 = _fresh(cfg, mini_params)
    lg2, st2 = _feed(mini_params, st2, a2, cfg, CCFG, seq, chunks)
    np.testing.assert_allclose(lg2, lg1, atol=1e-4, rtol=0)
    assert pages1 == a2.pages("r")
    flat1 = jax.tree_util.tree_leaves_with_path(st1)
    flat2 = dict(jax.tree_util.tree_leaves_with_path(st2))
    for path, x in flat1:
        y = np.asarray(flat2[path])
        if x.dtype == np.float32:
            np.testing.assert_allclose(y, x, atol=1e-5, err_msg=str(path))
        else:
            np.testing.assert_array_equal(y.view(np.uint8) if x.dtype.itemsize == 1 else y,
                                          x.view(np.uint8) if x.dtype.itemsize == 1 else x, err_msg=str(path))


def test_verify_window_equals_single_steps(mini_params, mini_cfg32, seq, full32):
    """A multi-token step (DSpark verify window of k tokens) ≡ k one-token steps (≡ the full forward)."""
    cfg = mini_cfg32
    st, alloc = _fresh(cfg, mini_params)
    _, st = _feed(mini_params, st, alloc, cfg, CCFG, seq[:21], [16, 5])
    lg, st = _feed(mini_params, st, alloc, cfg, CCFG, seq[21:27], [6], start=21)
    np.testing.assert_allclose(lg, full32[0][21:27], atol=1e-4, rtol=0)


def test_ragged_batch_with_joins_and_leaves(mini_params, mini_cfg32):
    """Requests of different lengths in one [2, TC] batch: prefill chunks and one-token decode rows mixed in
    one step; one finishes, its pages are freed and a new one takes its slot and pages (a 7-page pool).
    Every request's logits equal the full forward of its own tokens alone (≤ 1e-4), so its greedy tokens
    are those it generates alone."""
    cfg = mini_cfg32
    rng = np.random.default_rng(3)
    prompts = {n: rng.integers(3, 300, size=L).tolist() for n, L in (("a", 5), ("b", 17), ("c", 11))}
    steps = {"a": 6, "b": 12, "c": 9}
    st, _ = _fresh(cfg, mini_params)
    # a pool of 7 usable pages (b needs 4, c 3: c gets a's freed pages), ids inside CCFG's pool
    alloc = kvc.PageAllocator(num_pages=8, page_size=CCFG.page_size, max_pages_per_seq=4)
    step = dec.jitted_extend(cfg, CCFG, False)
    live = {"a": 0, "b": 1}
    pos, out, logs, pending = {}, {n: [] for n in prompts}, {n: [] for n in prompts}, ["c"]
    pad = int(np.asarray(mini_params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    feed = {n: list(prompts[n]) for n in live}
    pos.update({n: 0 for n in live})
    mixed = False
    while live:
        rows, names = [], []
        for n, s in live.items():
            chunk = feed[n][:TC]
            alloc.ensure(n, pos[n] + len(chunk))
            rows.append({"tokens": chunk, "start": pos[n], "slot": s, "page_table": alloc.pages(n)})
            names.append(n)
        mixed |= len({len(r["tokens"]) == 1 for r in rows}) == 2
        lg, st = step(mini_params, st, dec.make_batch(rows, TC, 2, CCFG))
        lg = np.asarray(lg)
        for i, n in enumerate(names):
            k = len(rows[i]["tokens"])
            pos[n] += k
            feed[n] = feed[n][k:]
            if not feed[n]:  # the row's last real token was the prompt's end or the last generated token
                tok = int(np.argmax(lg[i]))
                out[n].append(tok)
                logs[n].append(lg[i])
                feed[n] = [tok]
        alloc.check_invariants()
        for n in list(live):
            if len(out[n]) == steps[n]:
                s = live.pop(n)
                alloc.free(n)
                if pending:
                    m = pending.pop(0)
                    st = kvc.reset_slots(st, [s], pad)
                    live[m], pos[m], feed[m] = s, 0, list(prompts[m])
    assert mixed, "no step mixed a prefill chunk with a decode row"
    assert alloc.free_pages == alloc.capacity
    for n in prompts:
        toks = prompts[n] + out[n][:-1]
        assert len(toks) <= T
        full = np.asarray(FWD(mini_params, jnp.asarray(toks + [3] * (T - len(toks)))[None], cfg,
                              return_aux=True)[0][0])  # causal: the padding changes no earlier position
        want = full[len(prompts[n]) - 1: len(toks)]
        np.testing.assert_allclose(np.stack(logs[n]), want, atol=1e-4, rtol=0, err_msg=n)
        assert out[n] == np.argmax(want, axis=-1).tolist(), n


def test_generate_ragged_equals_alone():
    """Exact mode (fp64-accumulated matmuls, model/numerics.py): XLA's accumulation order depends on
    the batch shape, and so does the "xla" linear / MoE formulation (K-blockwise GEMM for <= 8 rows,
    selected-expert gather while tokens·k < E), so in the bf16 flow a bf16 rounding — and in the fp32
    mode a 1e-7 difference — can flip a discrete choice between batch sizes. Measured in fp32 mode with
    impl "xla": prompt [100]*9 alone vs in the batch, logits agree to 9.5e-7 for 4 generated tokens,
    then an internal decision flips (logits move by 0.54 while the output top-2 margin is 0.063).
    One cache config and one-token prefill chunks for all calls, so the batch size is the only shape that
    differs ([4, 1] vs [1, 1]: two compiles; exact-mode steps are the slowest to compile, so on
    `configs.micro`: every attention mechanism once, in 3 layers)."""
    cfg = configs.micro().replace(act_dtype="exact")
    params = init_params(cfg, jax.random.key(0))
    prompts = [[5, 6, 7], list(range(10, 31)), [100] * 9]
    ccfg = kvc.CacheConfig(page_size=16, num_pages=9, max_slots=4, max_pages_per_seq=2)
    together = dec.generate(params, cfg, prompts, 6, ccfg=ccfg, chunk_size=1)
    for p, t in zip(prompts, together):
        assert dec.generate(params, cfg, [p], 6, ccfg=ccfg, chunk_size=1) == [t]


def test_jit_cache_does_not_grow(mini_params, mini_cfg32):
    """Steps at every position and chunk size reuse one compiled [1, TC] step."""
    cfg = mini_cfg32
    st, alloc = _fresh(cfg, mini_params)
    fn = dec.jitted_extend(cfg, CCFG, True)
    lg, st = _feed(mini_params, st, alloc, cfg, CCFG, [3, 4, 5], [3])
    size = fn._cache_size()
    assert size >= 1
    tok, pos = int(np.argmax(lg[-1])), 3
    for _ in range(40):
        lg, st = _feed(mini_params, st, alloc, cfg, CCFG, [tok], [1], start=pos)
        tok, pos = int(np.argmax(lg[-1])), pos + 1
    assert fn._cache_size() == size


def test_page_allocator():
    a = kvc.PageAllocator(num_pages=5, page_size=4, max_pages_per_seq=3)
    assert a.capacity == 4
    a.ensure("x", 8)  # 2 pages
    a.ensure("y", 4)  # 1 page
    a.check_invariants()
    assert not set(a.pages("x")) & set(a.pages("y")) and 0 not in a.pages("x") + a.pages("y")
    with pytest.raises(kvc.CacheFullError, match="more pages"):
        a.ensure("z", 8)  # needs 2, 1 free: all-or-nothing
    assert a.free_pages == 1 and not a.has("z")
    with pytest.raises(kvc.CacheFullError, match="max_pages_per_seq"):
        a.ensure("x", 13)
    assert a.free(("x")) == 2 and a.free("y") == 1
    assert a.free_pages == a.capacity
    a.check_invariants()
    t = a.table_array(["x", None])
    assert t.shape == (2, 3) and (t == 0).all()


def test_memory_plan_flash():
    cfg = ModelConfig.preset("flash")
    b = kvc.kv_bytes_per_token(cfg)
    # 3 ratio-2 sources + 1 ratio-1 source, fp4 latents (256 B + 32 B of e4m3 scales per 512) and fp4 index
    # keys (64 B + 4 B of e8m0 scales per 128): (288/2·3 + 288) + (68/2·3 + 68) = 720 + 170 = 890 B/token.
    assert b["compressed_latents"] == 720 and b["index_keys"] == 170 and b["per_token"] == 890
    assert b["window_per_request"] == 40 * 128 * (512 + 16)
    plan = kvc.plan_memory(cfg, 40 * 2 ** 30, page_size=256, max_slots=64)
    assert plan["num_pages"] * 256 * 890 <= 40 * 2 ** 30 - plan["window_bytes"]
    assert plan["pool_tokens"] > 40_000_000
    with pytest.raises(kvc.CacheFullError):
        kvc.plan_memory(cfg, 1000, max_slots=1)


@pytest.mark.parametrize("mode", ["bfloat16", "float32"])
def test_kv_cache_debug_modes_lossless(mini_params, mini_cfg32, seq, full32, mode):
    """bf16 / fp32 storage hold the fake-quantized values themselves: same logits as the packed default."""
    cfg = mini_cfg32
    ccfg = CCFG.replace(kv_cache_dtype=mode)
    st, alloc = _fresh(cfg, mini_params, ccfg)
    got, _ = _feed(mini_params, st, alloc, cfg, ccfg, seq, [16, 8, 16])
    assert np.abs(got - full32[0]).max() <= 1e-4


def test_fp8_kv_mode_tolerance(mini_params, mini_cfg32, seq, full32):
    """fp8 storage of every store. The window is fp8 already (exact); compressed latents and index keys are
    re-quantized from their fp4 values, which costs at most one e4m3 rounding (half an ulp, ≤ 16 × the
    block's pow2 scale). Stated tolerance at the logits, with random tiny weights (where any perturbation
    can flip a top-k or expert choice and is then amplified): correlation ≥ 0.9 with the fp32-storage
    logits and mean |Δ| ≤ 0.3 · std(logits)."""
    x = jax.random.normal(jax.random.key(5), (64, 64)) * 2
    for kind in ("comp", "ikey"):
        ref = np.asarray(kvc.fake_quant(kind, x, jnp.float32))
        got = np.asarray(kvc.decode(kind, "fp8_e4m3", kvc.encode(kind, "fp8_e4m3", x), jnp.float32))
        amax = np.abs(ref).reshape(64, 2, 32).max(-1, keepdims=True)
        err = np.abs(got - ref).reshape(64, 2, 32) / np.exp2(np.ceil(np.log2(amax / 448)))
        assert err.max() <= 16, kind  # half an e4m3 ulp in its top binade [256, 448) is 16 (in scale units)
    cfg = mini_cfg32
    ccfg = CCFG.replace(kv_cache_dtype="fp8_e4m3")
    st, alloc = _fresh(cfg, mini_params, ccfg)
    got, _ = _feed(mini_params, st, alloc, cfg, ccfg, seq, _schedule(TC))
    ref = full32[0]
    assert np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] >= 0.9
    assert np.abs(got - ref).mean() <= 0.3 * ref.std()


@pytest.mark.parametrize("n", [1, 0])
def test_one_token_row_writes_equal_the_scatter(n):
    """At B = T = 1 the ring write and the per-request row updates are dynamic-update-slices (one launch per
    array on a GPU instead of a scatter's select + update): equal to the scatter form on every row, except
    that a dropped write (n = 0) lands in the scratch row (the last) instead of nowhere."""
    rng = np.random.default_rng(5)
    R, W, hd = 4, 8, 64
    ring = kvc.encode("win", "auto", jnp.asarray(rng.standard_normal((R, W, hd)), jnp.float32))
    codes = kvc.encode("win", "auto", jnp.asarray(rng.standard_normal((1, 1, hd)), jnp.float32))
    rows, positions, nn = jnp.array([1], jnp.int32), jnp.array([[13]], jnp.int32), jnp.array([n], jnp.int32)
    got = dec._window_write(ring, rows, positions, nn, codes, W)
    cols = jnp.where(nn[:, None] > 0, positions % W, W)
    want = dec._row_scatter(ring, rows, cols, codes)  # the scatter (B·T > 1's form)
    for k in ring:
        g, w = np.asarray(got[k]).view(np.uint8), np.asarray(want[k]).view(np.uint8)
        np.testing.assert_array_equal(g[:R - 1], w[:R - 1])
        c = np.asarray(codes[k]).view(np.uint8)[0, 0]
        np.testing.assert_array_equal(g[1 if n else R - 1, 13 % W], c)  # dropped: the scratch row took it
    hist = jnp.asarray(rng.integers(0, 99, (R, 3)), jnp.int32)
    new = jnp.asarray(rng.integers(0, 99, (1, 3)), jnp.int32)
    np.testing.assert_array_equal(kvc.set_row(hist, rows, new), hist.at[rows].set(new))


@pytest.mark.parametrize("B, T", [(1, 1), (2, 3)])
def test_stacked_ring_write_equals_per_layer_writes(B, T):
    """Every layer's rings in one store [R, L, W] (`cache.init_cache`): layers 1..2's codes written in one
    update (`_window_write(layer=1)`: a dynamic-update-slice at one token, a scatter otherwise) equal each
    layer's own write into its [R, W] rings; layers 0 and 3 untouched. Row 2 of the (2, 3) case is padding."""
    rng = np.random.default_rng(6)
    R, L, W, hd = 4, 4, 8, 64
    enc = lambda shape: kvc.encode("win", "auto", jnp.asarray(rng.standard_normal(shape), jnp.float32))  # noqa: E731
    ring = enc((R, L, W, hd))
    codes = [enc((B, T, hd)) for _ in range(2)]
    rows = jnp.array([2, 0][:B], jnp.int32)
    positions = jnp.array([[11], [3]][:B], jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
    n = jnp.array([T, 0][:B], jnp.int32)
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *codes)
    got = dec._window_write(ring, rows, positions, n, stacked, W, layer=1)
    for k in ring:
        g = np.asarray(got[k]).view(np.uint8)
        for layer in range(L):
            one = {kk: v[:, layer] for kk, v in ring.items()}
            want = one if layer in (0, 3) else dec._window_write(one, rows, positions, n, codes[layer - 1], W)
            np.testing.assert_array_equal(g[:R - 1, layer], np.asarray(want[k]).view(np.uint8)[:R - 1])
        for t in range(T):  # batch row 0 (ring row 2) wrote token t of layer 1 at 11 + t mod W
            np.testing.assert_array_equal(g[2, 1, (11 + t) % W], np.asarray(codes[0][k]).view(np.uint8)[0, t])
