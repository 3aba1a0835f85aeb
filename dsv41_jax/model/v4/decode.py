"""V4's paged incremental step: B rows x T new tokens against a per-layer cache (docs/design/v4.md).

The batch is V4.1's (`decode` module doc): tokens int32 [B, T], start [B], n_new [B], slot [B], page_table
[B, P] over `cache.CacheConfig`'s pages (page 0 the null page). The state (`init_state`) is laid out as V4.1's
cache (`cache.init_cache`: per-slot ``window`` / ``partial``, paged ``comp`` / ``ikeys``), so the engine's slot-row
and page copies serve both families; per layer it holds:

* ``window[L]`` [R, W, hd]: the layer's ring of window K=V (position p at p mod W), R = `cache.slot_rows`;
* per CSA / HCA layer (key str(L)): ``comp[L]`` [pages·page_size / r, hd] — its compressed entries, entry w of a
  request at `indexer.pool_index`(page_table, w) — and ``partial[L]["proj"]`` {"kv", "score"} [R, 2r, w·hd] fp32:
  the compressor's per-token projections of the last 2r positions (position p at p mod 2r). That is V4's
  per-layer compressor state: the open window's tokens and, for CSA, the previous window's Ca half, which the next
  entry pools (`v4.compressor.window_slots`); CSA layers also ``ikeys[L]`` / ``partial[L]["iproj"]`` for the
  indexer's own keys. (One layer's state as `comp_state` lays it out, {"pool", "proj"[, "ipool", "iproj"]}, is what
  `layer_step` takes: the MTP layer's cache keeps that form.)

A step writes the chunk's window K=V and projections, closes the windows that end inside the chunk (pooled
from the buffer [last 2r positions, the chunk] as the forward pools them), writes their entries, then attends
over the ring + the chunk's keys and the visible entries (HCA) or the indexer's picks (CSA), through V4.1's
attention and indexer seams on this state as it is (`attention_cached`; their Pallas kernels where
`v4.attention.seam_impl` picks them). Every number is
the forward's (`v4.transformer`) for the same prefix: the same functions on the same values; in the exact
mode (fp64-accumulated sums, independent of how keys are laid out) bit for bit (tests/test_v4_decode.py).
V4 simulates no KV-cache quantization: ``kv_cache_dtype`` "auto" stores the activation dtype; others are refused
(NotImplementedError). `jitted_extend` is the engine's step (`serving.model_step`).

On a tp x ep mesh (``par``; `v4.transformer` module doc) the cache is replicated, as V4.1's (`parallel.rules`:
one latent KV head, so the rings, pools and compressor projections are read whole by every head's shard; every
shard computes them from replicated weights and writes the same values, no communication).

Data-parallel attention (``ccfg.dp`` = D > 1 on a ("dp", "tp") mesh): the state above is V4.1's rank-blocked
layout — every per-slot row (rings, compressor projections) and every pool row (a page's entries) lies in its
rank's block (`cache.rank_slots` / `rank_pages`; a page holds page_size / r whole entries, so page blocks are pool
row blocks) — split over "dp" by `parallel.rules.DP_RULES` (`rules.cache_axes` names V4's leaves). `jitted_extend`
runs the step as one program per rank (`MeshPlan.rank_step`, `parallel.dp`): the rank's rows on its blocks, the
routed experts reached by token dispatch (hash-routed layers too: the table is read on the rank's own token ids).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import tiling
from dsv41_jax.model.attention import sink_of, sparse_attention
from dsv41_jax.model.config_v4 import attention_kinds
from dsv41_jax.model.decode import _window_write
from dsv41_jax.model.indexer import pool_index
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.transformer import embed_streams, new_aux, record
from dsv41_jax.model.v4 import compressor as comp4
from dsv41_jax.model.v4 import mhc as mhc4
from dsv41_jax.model.v4.attention import (hca_picks, index_select, layer_freqs, output_proj, project_kv, project_q,
                                          seam_impl, store_mode)
from dsv41_jax.model.v4.moe import moe
from dsv41_jax.model.v4.torch_order import exact_level
from dsv41_jax.model.v4.transformer import final_logits, layer_ratio, refuse_unsupported, sublayer_exit


def _check(cfg, ccfg) -> None:
    ccfg.validate(cfg)
    if ccfg.kv_cache_dtype != "auto":
        raise NotImplementedError(f"DeepSeek-V4: kv_cache_dtype {ccfg.kv_cache_dtype!r}: V4's cache stores "
                                  "unquantized values ('auto'); its KV quantization is not simulated")


def init_state(cfg, ccfg) -> dict:
    """A zeroed V4 cache for `cfg` / `ccfg` (module doc), in V4.1's top-level layout (`cache.init_cache`):
    ``window`` (per-slot), ``partial`` (per-slot), ``comp`` / ``ikeys`` (paged pools), so the engine's slot-row
    and page copies (fork, prefix-cache snapshots, HiCache) treat both families alike."""
    _check(cfg, ccfg)
    state = {"window": [window_state(cfg, ccfg) for _ in range(cfg.num_hidden_layers)], "partial": {}, "comp": {},
             "ikeys": {}}
    for i, kind in enumerate(attention_kinds(cfg)):
        if kind != "sliding":
            _put_layer(state, str(i), comp_state(kind, cfg, ccfg))
    return state


def _layer_of(state, k: str):
    """Layer `k`'s compressor state ({"pool", "proj"[, "ipool", "iproj"]}, `comp_state`) out of the engine layout."""
    if k not in state["comp"]:
        return None
    st = {"pool": state["comp"][k], "proj": state["partial"][k]["proj"]}
    if k in state["ikeys"]:
        st.update(ipool=state["ikeys"][k], iproj=state["partial"][k]["iproj"])
    return st


def _put_layer(state, k: str, st) -> None:
    """Write a layer's compressor state (`comp_state`'s layout) into the engine layout (in place: a fresh dict)."""
    state["comp"][k] = st["pool"]
    state["partial"][k] = {"proj": st["proj"]}
    if "ipool" in st:
        state["ikeys"][k] = st["ipool"]
        state["partial"][k]["iproj"] = st["iproj"]


def reset_slots(state: dict, slots) -> dict:
    """Clear slots' per-request rows (the compressor projections; `cache.reset_slots`'s job for V4). Not needed
    for correctness — a step reads only positions the request itself wrote, or masks them — but a reset slot then
    holds nothing of its previous owner. The window rings are masked by position, as V4.1's."""
    slots = jnp.asarray(slots, jnp.int32)
    zero = lambda a: a.at[slots].set(0.0)  # noqa: E731
    return dict(state, partial={k: jax.tree.map(zero, v) for k, v in state["partial"].items()})


def kv_bytes_per_token(cfg, kv_cache_dtype: str = "auto") -> dict:
    """`cache.kv_bytes_per_token` for V4: every CSA / HCA layer's pool (1/r entries of head_dim per token) and each
    CSA layer's index keys (1/r of index_head_dim), stored in the activation dtype; the window rings and the
    per-slot compressor projections (fp32, 2r positions) per request; with MTP speculation its per-slot state."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError(f"DeepSeek-V4: kv_cache_dtype {kv_cache_dtype!r}: only 'auto'")
    item = jnp.dtype(act_dtype(cfg)).itemsize
    comp = ikeys = 0.0
    partial = 0
    for i, kind in enumerate(attention_kinds(cfg)):
        if kind == "sliding":
            continue
        r, w = layer_ratio(cfg, kind), 2 if kind == "csa" else 1
        comp += item * cfg.head_dim / r
        partial += 2 * (2 * r) * w * cfg.head_dim * 4
        if kind == "csa":
            ikeys += item * cfg.index_head_dim / r
            partial += 2 * (2 * r) * w * cfg.index_head_dim * 4
    win = cfg.sliding_window * cfg.head_dim * item
    # the draft's per-slot state (named as V4.1's DSpark rings): the MTP layer's window ring + the last target streams,
    # or one window ring per DSpark stage (`v4.dspark`)
    per_stage = win + (cfg.hc_mult * cfg.hidden_size * item if cfg.draft_kind == "mtp" else 0)
    draft = cfg.num_nextn_predict_layers * per_stage
    return {"compressed_latents": comp, "index_keys": ikeys, "per_token": comp + ikeys,
            "window_per_request": cfg.num_hidden_layers * win + partial, "dspark_window_per_request": draft}


def window_state(cfg, ccfg):
    """A zeroed window ring [R, W, hd] in the activation dtype."""
    return jnp.zeros((kvc.slot_rows(ccfg), cfg.sliding_window, cfg.head_dim), act_dtype(cfg))


def comp_state(kind: str, cfg, ccfg) -> dict:
    """A zeroed compressor state of a CSA / HCA layer (module doc)."""
    R, dt, tokens = kvc.slot_rows(ccfg), act_dtype(cfg), ccfg.num_pages * ccfg.page_size
    hd, dI = cfg.head_dim, cfg.index_head_dim
    r, w = layer_ratio(cfg, kind), 2 if kind == "csa" else 1

    def proj(d):
        return {"kv": jnp.zeros((R, 2 * r, w * d), jnp.float32), "score": jnp.zeros((R, 2 * r, w * d), jnp.float32)}

    st = {"pool": jnp.zeros((tokens // r, hd), dt), "proj": proj(hd)}
    if kind == "csa":
        st.update(ipool=jnp.zeros((tokens // r, dI), dt), iproj=proj(dI))
    return st


def _compress_chunk(p, x, proj, pool, batch, positions, r, overlap, freqs, page_size, cfg, dt, index=False):
    """Close the windows that end in this chunk: (pool', proj'; `index`: an indexer's keys, quantized as such by
    `v4.compressor.pool`).

    The chunk's projections join the last 2r cached ones (a buffer from position start − 2r); window j closes
    here iff start ≤ (j+1)·r − 1 < start + n_new; its entry goes to pool row `pool_index`(page_table, j)."""
    start, n, slot, pt = batch["start"], batch["n_new"], batch["slot"], batch["page_table"]
    T = positions.shape[1]
    kv, score = comp4.project(p, x, cfg)
    ring_idx = jnp.mod(start[:, None] - 2 * r + jnp.arange(2 * r), 2 * r)  # buffer order: positions start-2r ..
    buf = [jnp.concatenate([jnp.take_along_axis(proj[k][slot], ring_idx[..., None], axis=1), new], axis=1)
           for k, new in (("kv", kv), ("score", score))]
    windows = start[:, None] // r + jnp.arange(T // r + 1, dtype=jnp.int32)  # [B, M] candidates
    last = (windows + 1) * r - 1
    closes = (last < (start + n)[:, None]) & (last >= start[:, None])
    entries = comp4.pool(p, *comp4.window_slots(*buf, p["ape"], r, overlap, windows, base=start - 2 * r), windows, r,
                         freqs, cfg, dt, index=index)
    rows = jnp.where(closes, pool_index(pt, windows, r, page_size), pool.shape[0])  # out of range: dropped
    pool = pool.at[rows].set(entries.astype(pool.dtype), mode="drop")
    proj = {k: _window_write({"v": proj[k]}, slot, positions, n, {"v": v}, 2 * r)["v"]
            for k, v in (("kv", kv), ("score", score))}
    return pool, proj


def attention_cached(p, x, st_win, st_comp, batch, positions, valid, kind, cfg, ccfg, dt):
    """One layer's attention sublayer on the cache: (y [B, T, D], window ring', compressor state', rec).

    The attention is V4.1's seam `attention.sparse_attention` on V4's state as it is (`v4.attention` module doc): the
    ring [R, W, hd] and the chunk's K=V as window codes, the layer's pool as the compressed codes (entry w of a row
    at `pool_index`), the picks — CSA's indexer's (`v4.attention.index_select`), HCA's every visible entry
    (`hca_picks`) — as `sel`; its kernel where `seam_impl` picks one."""
    r = layer_ratio(cfg, kind)
    freqs = layer_freqs(cfg, kind)
    qr, q = project_q(p, x, positions, freqs, cfg, dt)
    kv = project_kv(p, x, positions, freqs, cfg, dt)
    slot, start, n, pt = batch["slot"], batch["start"], batch["n_new"], batch["page_table"]
    ps = ccfg.page_size
    rec: dict = {}
    B, T = positions.shape
    pool, sel = None, jnp.zeros((B, T, 0), jnp.int32)
    if kind != "sliding":
        pool, proj = _compress_chunk(p["compressor"], x, st_comp["proj"], st_comp["pool"], batch, positions, r,
                                     kind == "csa", freqs, ps, cfg, dt)
        st_comp = dict(st_comp, pool=pool, proj=proj)
        if kind == "csa":
            ipool, iproj = _compress_chunk(p["indexer"]["compressor"], x, st_comp["iproj"], st_comp["ipool"], batch,
                                           positions, r, True, freqs, ps, cfg, dt, index=True)
            st_comp = dict(st_comp, ipool=ipool, iproj=iproj)
            rec["topk"] = sel = index_select(p["indexer"], qr, x, positions, freqs, ipool, pt, ps, r, cfg, dt)
        else:
            sel = hca_picks(positions, pt.shape[1] * ps // r, r)
    o = sparse_attention(q, sink_of(p), {"v": st_win}, slot, {"v": kv}, start, positions, valid,
                         None if pool is None else {"v": pool}, pt, sel, ratio=max(r, 1), page_size=ps,
                         window=cfg.sliding_window, mode=store_mode(dt), impl=seam_impl(cfg, "attention"),
                         exact=exact_level(cfg))
    st_win = _window_write({"v": st_win}, slot, positions, n, {"v": kv}, cfg.sliding_window)["v"]
    return output_proj(p, o, positions, freqs, cfg, dt), st_win, st_comp, rec


def extend(params, state, batch, cfg, ccfg, return_aux: bool = False, head: bool = True, par=None):
    """Run the batch's new tokens through every layer against the cache. Returns (logits fp32 [B, T, vocab],
    state') and with `return_aux` the forward's aux ({"topk", "experts", "layer_inputs"} per layer, "hidden",
    "streams": the last layer's output streams [B, T, n, D]) and "moe_inputs" {layer: [B, T, D]} (the MoE's input,
    the ffn sublayer's normed collapse, which the routed experts' GEMM fp8-quantizes: where a kernel's rounding
    difference can flip an fp8 code, tests/test_v4_kernels.py) too. head=False (with `return_aux`): logits None and
    aux "hidden" None — the caller runs `final_logits` on the rows it needs.
    Jittable with static cfg / ccfg / return_aux / par (a tp x ep mesh plan, module doc); tokens past n_new[b] are
    padding (masked, never written)."""
    refuse_unsupported(cfg, par)
    _check(cfg, ccfg)
    dt = act_dtype(cfg)
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    B, T = tokens.shape
    positions = batch["start"][:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.arange(T)[None, :] < batch["n_new"][:, None]
    state = {"window": list(state["window"]), "partial": dict(state["partial"]), "comp": dict(state["comp"]),
             "ikeys": dict(state["ikeys"])}
    with tiling.on_mesh(par):
        h = embed_streams(params, tokens, cfg, dt, par)
        aux = dict(new_aux(), moe_inputs={})
        for i, kind in enumerate(attention_kinds(cfg)):
            h, state["window"][i], st, rec = layer_step(params["layers"][i], h, tokens, state["window"][i],
                                                        _layer_of(state, str(i)), batch, positions, valid, kind,
                                                        i in cfg.hash_layer_ids, cfg, ccfg, dt, par)
            if st is not None:
                _put_layer(state, str(i), st)
            aux = record(aux, i, *rec)
        logits, x = final_logits(params, h, cfg, dt) if head else (None, None)
    return (logits, state, dict(aux, hidden=x, streams=h)) if return_aux else (logits, state)


def layer_step(lp, h, tokens, win, comp, batch, positions, valid, kind: str, hashed: bool, cfg, ccfg, dt, par=None):
    """One V4 layer on the cache (a target layer, or an MTP layer on its own input streams; `v4.transformer.
    layer_forward` for a sequence from 0): h [B, T, n, D] -> (h', window ring', compressor state' (None at a
    sliding layer), (rec {"layer_inputs", "moe_inputs", "experts"}, attention rec {"topk"} at CSA))."""
    rec = {"layer_inputs": h}
    x, post, comb = mhc4.enter(h, lp, "attn", cfg, dt)
    y, win, comp, arec = attention_cached(lp["attn"], x, win, comp, batch, positions, valid, kind, cfg, ccfg, dt)
    h = sublayer_exit(y, h, post, comb, cfg, dt, par)
    x, post, comb = mhc4.enter(h, lp, "ffn", cfg, dt)
    rec["moe_inputs"] = x
    y, (rec["experts"], _) = moe(lp["ffn"], x, tokens, hashed, cfg, dt, par)
    return sublayer_exit(y, h, post, comb, cfg, dt, par), win, comp, (rec, arec)


def head_logits(params, streams, n_new, cfg, all_logits: bool = False, par=None):
    """The vocab logits of a step's output streams [B, T, n, D] (`extend`'s aux "streams"): fp32 [B, T, vocab] with
    `all_logits`, else [B, vocab] at each row's last new token (position n_new[b] − 1; 0 for a padding row), the
    head run on those rows only."""
    if not all_logits:
        last = jnp.maximum(jnp.asarray(n_new) - 1, 0)
        streams = jnp.take_along_axis(streams, last[:, None, None, None], axis=1)  # [B, 1, n, D]
    with tiling.on_mesh(par):
        logits, _ = final_logits(params, streams, cfg, act_dtype(cfg))
    return logits if all_logits else logits[:, 0]


def extend_logits(params, state, batch, cfg, ccfg, all_logits: bool = False, par=None):
    """`extend` as the engine's step runs it (`decode.extend`'s contract): (logits, state') with logits
    `head_logits`' (all positions with `all_logits`, else each row's last new token)."""
    _, state, aux = extend(params, state, batch, cfg, ccfg, return_aux=True, head=False, par=par)
    return head_logits(params, aux["streams"], batch["n_new"], cfg, all_logits, par), state


@functools.lru_cache(maxsize=None)
def jitted_extend(cfg, ccfg, all_logits: bool = False, par=None):
    """`extend_logits` jitted for (cfg, ccfg, all_logits[, par]) with the cache donated; compiles once per (B, T).
    With a mesh plan `par` the step's in / out shardings are `par.step_shardings` (params as `parallel.rules.
    shard_params` places them; the cache replicated on a tp x ep mesh, in rank blocks over "dp" on a data-parallel
    one, where the step is one program per rank: `par.rank_step`)."""
    if par is None:
        return jax.jit(functools.partial(extend_logits, cfg=cfg, ccfg=ccfg, all_logits=bool(all_logits)),
                       donate_argnums=(1,))
    ins, outs = par.step_shardings(cfg, ccfg, bool(all_logits))
    fn = par.rank_step(functools.partial(extend_logits, cfg=cfg, all_logits=bool(all_logits)), cfg, ccfg)
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=(1,))
