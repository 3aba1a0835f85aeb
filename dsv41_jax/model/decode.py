"""Incremental decode over the paged cache: one pure step for prefill chunks, decode and verify windows.

`extend_step(params, state, batch, cfg, ccfg, all_logits)` runs B rows × T new tokens against the
cache and returns logits and the updated cache. A prefill chunk, a one-token decode step and a
DSpark verify window of k tokens are the same function with different T. Rows are ragged: row b
holds `n_new[b] ≤ T` real tokens at positions `start[b] ..`; padding tokens are masked and never
written (rows with n_new = 0 point at the scratch slot).

The batch (host-built, small int arrays):
  tokens     int32 [B, T]
  start      int32 [B]      position of tokens[:, 0] (= tokens already in the cache for the request)
  n_new      int32 [B]      real tokens in the row
  slot       int32 [B]      per-request state row (window rings, partial group, Engram history);
                            padded rows use their dp rank's scratch row (`cache.scratch_slot`)
  page_table int32 [B, P]   the request's pages (P = ccfg.max_pages_per_seq)

Every number equals what `forward` computes for the same prefix: same functions, same order; only
where keys come from differs (the cache instead of the in-flight sequence).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import attention as attn_mod
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import compressor, indexer, layer_scan, tiling, weights
from dsv41_jax.model.engram import compressed_ids, hash_rows
from dsv41_jax.model.numerics import act_dtype
from dsv41_jax.model.plan import Pending, StepPlan
from dsv41_jax.model.transformer import (block, embed_streams, final_logits, initial_pre, new_aux, record,
                                         scan_blocks, settle)


def _row_scatter(store: dict, rows, cols, val: dict) -> dict:
    """store[k][rows[b], cols[b, i]] = val[k][b, i] (cols out of range are dropped)."""
    return {k: store[k].at[rows[:, None], cols].set(val[k], mode="drop") for k in store}


def _window_write(st_win, rows, positions, n, codes, window: int, layer: Optional[int] = None) -> dict:
    """Ring update: the chunk's window codes at ``pos mod W`` for its first ``n[b]`` tokens — only the
    last W of them (earlier ones would be overwritten); later tokens (padding, or rejected drafts) are
    dropped. rows int32 [B]; positions int32 [B, T]; n int32 [B]. layer None: st_win is one layer's
    rings [R, W, ...] and codes [B, T, ...]; an int: st_win holds every layer's, [R, L, W, ...] (the
    cache's ``state["window"]``), and codes [nl, B, T, ...] go to layers layer .. layer + nl − 1, in one
    update per array. Row R − 1 is the scratch slot."""
    W = window
    B, T = positions.shape
    i = jnp.arange(T)[None, :]
    write = (i < n[:, None]) & (i >= n[:, None] - W)
    if layer is not None:
        codes = {k: jnp.moveaxis(v, 0, 2) for k, v in codes.items()}  # [B, T, nl, ...]
    if B * T == 1:
        # One token: written in place (`cache.set_row`'s reason); a dropped write goes to the scratch row, which
        # only padded rows read, instead of being dropped.
        scratch = jax.tree_util.tree_leaves(st_win)[0].shape[0] - 1
        row = jnp.where(write[0, 0], rows[0], scratch)
        col = jnp.mod(positions[0, 0], W)
        at = (row, col) if layer is None else (row, layer, col)
        if layer is not None:  # [1, 1, nl, ...] -> [1, nl, 1, ...]
            codes = {k: jnp.swapaxes(v, 1, 2) for k, v in codes.items()}
        return {k: jax.lax.dynamic_update_slice(st_win[k], codes[k].astype(st_win[k].dtype),
                                                at + (0,) * (st_win[k].ndim - len(at))) for k in st_win}
    cols = jnp.where(write, jnp.mod(positions, W), W)  # W = out of range: dropped
    if layer is None:
        return _row_scatter(st_win, rows, cols, codes)
    nl = jax.tree_util.tree_leaves(codes)[0].shape[2]
    lay = layer + jnp.arange(nl, dtype=jnp.int32)
    return {k: st_win[k].at[rows[:, None, None], lay[None, None, :], cols[:, :, None]].set(codes[k], mode="drop")
            for k in st_win}


def attention_cached(step, p, x, plan, st, ctx, batch, positions, valid, cfg, ccfg, dt, pend, k=0):
    """One layer's attention sublayer against the cache: (y [B, T, D], (st', ctx', rec, pend')) — the arguments with
    this layer's writes (new containers) and its aux record. In order: queries and window codes (`StepPlan.q_codes`),
    a KV source's compressed writes (`compressor.store_chunk`), an index source's selection (`indexer.retrieve`),
    the attention (`StepPlan.attend`) and the output projection. k: the layer's index in its layer-scan run (int32;
    0 outside one): the rings in place are layer ``plan.layer_id + k``'s."""
    lid, mode, ps, pt = plan.layer_id, ccfg.kv_cache_dtype, ccfg.page_size, batch["page_table"]
    freqs = attn_mod.layer_freqs(cfg, plan)
    qr, q, win_codes, st, pend = step.q_codes(p, x, positions, freqs, cfg, dt, mode, st, pend,
                                              (batch["slot"], batch["n_new"], k, lid))
    r = plan.compress_ratio
    comp, sel, rec = None, None, {}
    if r > 0:
        if plan.is_kv_source:
            key = str(lid)
            st, buf, saved = compressor.store_chunk(p, x, st, key, batch, positions, valid, freqs, r, cfg, ccfg, dt,
                                                    keep_old=pend.restore is not None)
            if buf is not None:
                pend = dataclasses.replace(pend, partial={**pend.partial, key: buf})
            if saved is not None:
                pend = dataclasses.replace(pend, restore={**pend.restore, key: saved})
        if plan.is_index_source:
            ctx, rec = indexer.retrieve(p["indexer"], qr, x, positions, freqs, plan, ctx,
                                        st["ikeys"][str(plan.key_owner)], pt, page_size=ps, mode=mode, cfg=cfg, dt=dt,
                                        retrieval_block=ccfg.retrieval_block)
        sel = ctx["topk"][plan.index_source]  # [B, T, K]
        comp = st["comp"][str(plan.kv_source)]
    o = step.attend(q, weights.row(p["attn_sink"]).astype(jnp.float32), st["window"], batch["slot"], win_codes,
                    batch["start"], positions, valid, comp, pt, sel, ratio=max(r, 1), page_size=ps,
                    window=cfg.sliding_window, mode=mode, key_lo=batch.get("key_lo"), ring_layer=k, ring_base=lid,
                    merge=not step.attend_partials)  # `attention.sparse_attention` or its kernel
    return attn_mod.output_proj(step, p, o, positions, freqs, cfg, dt), (st, ctx, rec, pend)


def _run_layers(step, params, runs, h, pre, st, ctx, batch, positions, valid, tokens, hist, cfg, ccfg, dt, aux, pend,
                par, cols=None):
    """The layers of `runs` ((first, n), `layer_scan.layer_runs`) on h [B, T', n, D] / pre fp32 [B, T', n]: returns
    (h, pre, st, ctx, aux, pend) with the layers' writes (new containers). positions / valid [B, T'] are h's rows';
    tokens int32 [B, T] the chunk's (Engram hashes them); cols int32 [B, T'] (SWA bounded replay's late layers):
    the chunk column of each row of h, or None. A run of n >= 2 is one scan (`transformer.scan_blocks`): its window
    codes come back stacked, or where the plan writes the rings now they are the scan's carry."""
    for i, n in runs:
        plan = cfg.layer_plan(i)
        if n > 1:
            # valid as the attention kernel reads it (int32), made once: converted in the body, a launch per trip
            valid_k = valid.astype(jnp.int32) if step.attend_kernel else valid
            empty = Pending(positions=None, window=(None,) * cfg.num_hidden_layers, partial={}, restore=None)

            def attn_run(p, k, carry, x, plan=plan, st=st):
                y, (st_out, _, _, pend_out) = attention_cached(step, p, x, plan, dict(st, **carry), ctx, batch,
                                                               positions, valid_k, cfg, ccfg, dt, empty, k)
                return y, (pend_out.window[plan.layer_id], {key: st_out[key] for key in carry})

            # the rings ride in the scan's carry where the plan writes them in the step (`StepPlan.ring_now`: no codes
            # come back); else each layer's codes come back stacked, for `commit`
            carry = {"window": st["window"]} if step.ring_now else {}
            h, pre, aux, codes, carry = scan_blocks(step, layer_scan.run_params(params, i, n, cfg), h, pre, carry, plan,
                                                    cfg, dt, aux, i, cfg.num_experts_per_tok, attn_run, par=par)
            codes = tuple(jax.tree_util.tree_map(operator.itemgetter(k), codes) for k in range(n))
            st, pend = dict(st, **carry), dataclasses.replace(pend, window=pend.window[:i] + codes + pend.window[i + n:])
            continue
        lp = layer_scan.layer_params(params, i, cfg)
        rows = None
        if plan.is_engram:
            rows = hash_rows(cfg, i, params["derived"]["engram_token_map"], tokens, history=hist[batch["slot"]])
            if cols is not None:
                rows = jnp.take_along_axis(rows, cols[:, :, None], axis=1)

        attn_fn = functools.partial(attention_cached, step, lp["attn"], plan=plan, st=st, ctx=ctx, batch=batch,
                                    positions=positions, valid=valid, cfg=cfg, ccfg=ccfg, dt=dt, pend=pend)
        h, pre, rec, (st, ctx, arec, pend) = block(step, lp, h, pre, plan, cfg, dt, cfg.num_experts_per_tok, attn_fn,
                                                   rows, par=par)
        aux = record(aux, i, rec, arec)
    return settle(step, h, cfg, dt, par), pre, st, ctx, aux, pend


def _step_setup(state, batch, cfg, restore: bool):
    """(act dtype, tokens / positions int32 [B, T], valid bool [B, T], the cache, an empty `plan.Pending` (restore
    data kept iff `restore`), the Engram history or None): what every cached step starts from."""
    dt = act_dtype(cfg)
    tokens = batch["tokens"].astype(jnp.int32)
    T = tokens.shape[1]
    start, n_new = batch["start"], batch["n_new"]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.arange(T)[None, :] < n_new[:, None]
    pend = Pending(positions=positions, window=(None,) * cfg.num_hidden_layers, partial={},
                   restore={} if restore else None)
    return dt, tokens, positions, valid, state, pend, state.get("engram_hist")


def extend_uncommitted(params, state, batch, cfg, ccfg, all_logits: bool = False, restore: bool = False,
                       par=None, keep_all: bool = False):
    """The forward half of `extend`: (logits, st, pending, aux), nothing per-request committed yet.

    logits fp32 [B, T, V] (`all_logits`) or [B, V] at each row's last real token; st the cache with the chunk's
    completed compressed groups and index keys written; pending the `plan.Pending` `commit` needs to keep any
    prefix of each row (restore data only with `restore`); aux `transformer.new_aux`'s records and "hidden" (the
    final normed x). par: optional mesh plan (`parallel.plan.MeshPlan`). keep_all (`extend`): every token is kept,
    so the plan may write the rings in the step (`StepPlan.ring_now`)."""
    with tiling.on_mesh(par):  # CPU row tiles follow the weights' splits (model.tiling)
        dt, tokens, positions, valid, st, pend, hist = _step_setup(state, batch, cfg, restore)
        B, T = tokens.shape
        step = StepPlan.of(cfg, par, (B, T), ccfg.kv_cache_dtype, keep_all=keep_all and not restore)
        start, n_new = batch["start"], batch["n_new"]
        h = embed_streams(params, tokens, cfg, dt, par)
        pre = initial_pre((B, T), cfg)
        ctx = {"topk": {}, "cand": None}
        h, pre, st, ctx, aux, pend = _run_layers(step, params, layer_scan.layer_runs(cfg), h, pre, st, ctx, batch,
                                                 positions, valid, tokens, hist, cfg, ccfg, dt, new_aux(), pend, par)
        if not all_logits:
            last = jnp.maximum(n_new - 1, 0)
            h = jnp.take_along_axis(h, last[:, None, None, None], axis=1)
            pre = jnp.take_along_axis(pre, last[:, None, None], axis=1)
        logits, x = final_logits(params, h, pre, cfg, dt)
        if not all_logits:
            logits = logits[:, 0]
        if hist is not None:
            pend = dataclasses.replace(pend, engram_ids=compressed_ids(cfg, params["derived"]["engram_token_map"], tokens))
        return logits, st, pend, dict(aux, hidden=x)


def commit(st, pending, batch, n_commit, cfg):
    """Make the first ``n_commit[b] <= n_new[b]`` (int32 [B]) tokens of each row cache state; forget the rest.

    Writes those tokens' window codes left in `pending` (ring slot pos mod W), the partial group after start +
    n_commit and the Engram history ending there; with restore data, puts back the codes under every compressed
    group ending at or after start + n_commit. n_commit = n_new gives what the plain step writes."""
    start, slot = batch["start"], batch["slot"]
    end = start + n_commit
    out = dict(st)
    # the layers with codes (all; none where the step wrote the rings; a prefix in SWA bounded replay) are
    # consecutive: one update per array
    have = [i for i, c in enumerate(pending.window) if c is not None]
    if have:
        stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *pending.window[have[0]: have[-1] + 1])
        out["window"] = _window_write(st["window"], slot, pending.positions, n_commit, stacked, cfg.sliding_window,
                                      layer=have[0])
    out["partial"] = dict(st["partial"])
    for key, buf in pending.partial.items():
        r = buf["kv"].shape[2]
        out["partial"][key] = compressor.partial_after(st["partial"][key], buf, start, end, slot, r)
    if pending.restore:
        out["comp"], out["ikeys"] = _put_back(st, pending.restore, end)
    hist = st.get("engram_hist")
    if hist is not None:
        ext = jnp.concatenate([hist[slot], pending.engram_ids], axis=1)  # [B, M−1+T]
        m1 = hist.shape[1]
        take = n_commit[:, None] + jnp.arange(m1)[None, :]
        out["engram_hist"] = kvc.set_row(hist, slot, jnp.take_along_axis(ext, take, axis=1))
    return out


def _put_back(st, restore, end):
    """(comp, ikeys) stores of `st` with the codes of every compressed group that ends at or after `end` (int32
    [B]) put back as they were before the chunk (a speculative step's rejected groups; `Pending.restore`)."""
    comp, ikeys = dict(st["comp"]), dict(st["ikeys"])
    for key, sv in restore.items():
        oob = jax.tree_util.tree_leaves(st["comp"][key])[0].shape[0]
        back = jnp.where(sv["last"] >= end[:, None], sv["dest"], oob)  # incomplete groups are oob already
        comp[key] = kvc.store_set(st["comp"][key], back, sv["comp"])
        if "ikeys" in sv:
            ikeys[key] = kvc.store_set(st["ikeys"][key], back, sv["ikeys"])
    return comp, ikeys


def extend(params, state, batch, cfg, ccfg, all_logits: bool = False, return_aux: bool = False, par=None):
    """Pure step: (params, cache, batch) -> (logits fp32 [B, T, V] (`all_logits`) or [B, V] at each row's last real
    token, cache), every real token committed; state keys it does not own pass through."""
    logits, st, pend, aux = extend_uncommitted(params, state, batch, cfg, ccfg, all_logits, par=par, keep_all=True)
    new_state = commit(st, pend, batch, batch["n_new"], cfg)
    if return_aux:
        return logits, new_state, aux
    return logits, new_state


# ----------------------------------------------------------------------------------------------------
# SWA bounded replay (--enable-decoder-swa-bounded-replay, as SGLang's): late layers run only the tail
# ----------------------------------------------------------------------------------------------------


def last_store_layer(cfg) -> int:
    """S: the last target layer that writes a cache store (a KV source's compressed latents / index
    keys / partial groups, or the candidate source's blocks, which later index sources read); -1 if none.

    After S a layer's only state that outlives a step is its own window ring, and each token's
    computation there reads only its own row of the residual stream, the stored pools and its window:
    that is what lets SWA bounded replay run layers S+1.. on a few tokens. (An index source after S
    re-scores stored keys per query token: it stays exact on any subset of the tokens.)
    """
    ids = list(cfg.kv_source_layer_ids)
    if cfg.candidate_source_layer_id is not None:
        ids.append(cfg.candidate_source_layer_id)
    return max(ids) if ids else -1


def split_runs(cfg) -> tuple:
    """(early, late): `layer_scan.layer_runs` split after `last_store_layer` (S is a source, so it is a
    run of one and no run straddles it)."""
    S = last_store_layer(cfg)
    runs = layer_scan.layer_runs(cfg)
    return tuple(r for r in runs if r[0] <= S), tuple(r for r in runs if r[0] > S)


def tail_columns(start, n_new, tail_lo, tail: int):
    """Which chunk tokens the late layers run, per row: the tokens at positions >= tail_lo[b], at most the
    last `tail` of them.

    start, n_new, tail_lo int32 [B]; tail static. Returns (cols int32 [B, tail] chunk columns, clipped
    into the chunk; count int32 [B] real ones, 0..tail). Row b's late tokens are columns
    cols[b, :count[b]] = off[b] .. n_new[b] − 1 (contiguous, ending at the row's last real token).
    """
    off = jnp.clip(tail_lo - start, 0, n_new)
    off = jnp.maximum(off, n_new - tail)  # more than `tail` tokens at or after tail_lo: the last `tail`
    count = n_new - off
    cols = off[:, None] + jnp.arange(tail, dtype=jnp.int32)[None, :]
    return cols, count


def _gather_cols(x, cols):
    """x [B, T, ...] -> [B, T', ...]: x[b, cols[b, i]] (cols already inside 0..T−1)."""
    idx = cols.reshape(cols.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def extend_bounded(params, state, batch, cfg, ccfg, late_tail: int, par=None, return_aux: bool = False):
    """SWA bounded replay's step: layers 0..S (`last_store_layer`) run the whole chunk as `extend` does;
    layers S+1.. run only each row's tail — its tokens at positions >= ``batch["tail_lo"][b]``, at most
    the last ``min(T, late_tail)`` of them — as a static [B, min(T, late_tail)] sub-batch.

    batch: `extend`'s batch plus ``tail_lo`` int32 [B]: the first position the late layers compute for
    the request (the runner: max(0, prompt length − sliding_window), so the late layers cover exactly
    the prompt tokens whose window KV decode reads; a decode row's token is always at or after it).
    late_tail: static, normally cfg.sliding_window (with it, the tokens a chunk computes at a late layer
    are always the last ones of the request computed so far there: the rows of the ring the next chunk
    can see were all written).

    Not numerically equal to `extend` once a prompt is longer than the window: a late-layer tail token
    attends (window part) only to late-layer keys that were computed — positions >= tail_lo — and the
    ring entries below tail_lo (never written for this request) are masked (`attention.window_keys`
    key_lo). The compressed part is exact: the stores come from layers <= S, which ran every token.
    With every token at or after tail_lo and the chunk no longer than late_tail, it computes what
    `extend` computes (tests/test_bounded_replay.py checks the logits are equal).

    Returns (logits fp32 [B, V] at each row's last real token — 0 for a row with no late token, whose
    last token the late layers skipped —, new cache). Window rings of the late layers are written for
    the tail tokens only; everything else is written as `extend` writes it.
    """
    with tiling.on_mesh(par):
        dt, tokens, positions, valid, st, pend, hist = _step_setup(state, batch, cfg, False)
        B, T = tokens.shape
        start, n_new = batch["start"], batch["n_new"]
        h = embed_streams(params, tokens, cfg, dt, par)
        pre = initial_pre((B, T), cfg)
        ctx = {"topk": {}, "cand": None}
        early, late = split_runs(cfg)
        mode = ccfg.kv_cache_dtype
        h, pre, st, ctx, aux, pend = _run_layers(StepPlan.of(cfg, par, (B, T), mode), params, early, h, pre, st, ctx,
                                                 batch, positions, valid, tokens, hist, cfg, ccfg, dt, new_aux(), pend,
                                                 par)
        # the late sub-batch: each row's tail tokens, gathered to [B, tail]
        tail = min(T, late_tail)
        cols, count = tail_columns(start, n_new, batch["tail_lo"], tail)
        colc = jnp.minimum(cols, T - 1)  # padding columns (i >= count) read a real column, masked by sub_valid
        sub_pos = start[:, None] + cols
        sub_valid = jnp.arange(tail)[None, :] < count[:, None]
        h, pre = _gather_cols(h, colc), _gather_cols(pre, colc)
        ctx = {"topk": {k: _gather_cols(v, colc) for k, v in ctx["topk"].items()},
               "cand": None if ctx["cand"] is None else _gather_cols(ctx["cand"], colc)}
        # `start` stays the chunk's: the ring holds positions < start (window_keys places its entries by it)
        sub_batch = dict(batch, n_new=count, key_lo=batch["tail_lo"])
        late_pend = Pending(positions=sub_pos, window=(None,) * cfg.num_hidden_layers, partial={}, restore=None)
        h, pre, st, ctx, aux, late_pend = _run_layers(StepPlan.of(cfg, par, (B, tail), mode), params, late, h, pre, st,
                                                      ctx, sub_batch, sub_pos, sub_valid, tokens, hist, cfg, ccfg, dt,
                                                      aux, late_pend, par, cols=colc)
        last = jnp.maximum(count - 1, 0)
        h = jnp.take_along_axis(h, last[:, None, None, None], axis=1)
        pre = jnp.take_along_axis(pre, last[:, None, None], axis=1)
        logits, _ = final_logits(params, h, pre, cfg, dt)
        logits = jnp.where(count[:, None] > 0, logits[:, 0], 0.0)
        if hist is not None:
            pend = dataclasses.replace(pend, engram_ids=compressed_ids(cfg, params["derived"]["engram_token_map"], tokens))
        new_state = commit(st, pend, batch, n_new, cfg)
        if late:  # the late layers (the last ones, contiguous): their rings for the tail tokens, in one update
            lo, hi = late[0][0], late[-1][0] + late[-1][1]
            stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *late_pend.window[lo:hi])
            new_state["window"] = _window_write(new_state["window"], batch["slot"], sub_pos, count, stacked,
                                                cfg.sliding_window, layer=lo)
        if return_aux:
            return logits, new_state, dict(aux, late_tokens=count, late_cols=cols)
        return logits, new_state


def jitted_extend(cfg, ccfg, all_logits: bool = False, par=None, engram_host_table: bool = False,
                  late_tail: Optional[int] = None):
    """`extend` jitted for (cfg, ccfg, all_logits[, par]), with the cache donated. Compiles once per (B, T).

    With a mesh plan `par` (callers holding a mesh: `parallel.plan.jitted_extend`), the step's in/out
    shardings come from `par.step_shardings` (params as `parallel.rules.shard_params` places them, the
    cache as `rules.init_cache` does, batch and logits replicated).
    engram_host_table: the params hold host Engram tables (`parallel.host_table`).
    One jitted function per distinct setting, however the arguments are spelled (an lru_cache on this
    signature would key ``(cfg, ccfg, True)`` and ``(cfg, ccfg, True, None)`` apart: two compiles).
    late_tail: None = `extend` (the reference path); an int = SWA bounded replay (`extend_bounded`: the
    batch carries ``tail_lo``; last-token logits only, no mesh plan).
    """
    if late_tail is not None:
        if all_logits or par is not None:
            raise NotImplementedError("SWA bounded replay (late_tail): last-token logits only, unsharded (its "
                                      "late layers skip tokens, so there are no logits for them)")
        if late_tail < 1:
            raise ValueError(f"late_tail = {late_tail}: must be >= 1")
        return _jitted_bounded(cfg, ccfg, int(late_tail))
    return _jitted_extend(cfg, ccfg, bool(all_logits), par, bool(engram_host_table))


@functools.lru_cache(maxsize=None)
def _jitted_bounded(cfg, ccfg, late_tail):
    return jax.jit(functools.partial(extend_bounded, cfg=cfg, ccfg=ccfg, late_tail=late_tail), donate_argnums=(1,))


@functools.lru_cache(maxsize=None)
def _jitted_extend(cfg, ccfg, all_logits, par, engram_host_table):
    if par is None:
        return jax.jit(functools.partial(extend, cfg=cfg, ccfg=ccfg, all_logits=all_logits), donate_argnums=(1,))
    ins, outs = par.step_shardings(cfg, ccfg, all_logits, engram_host_table)
    # on a data-parallel mesh, one program per dp rank (`parallel.dp`); else `extend` with ccfg and par bound
    fn = par.rank_step(functools.partial(extend, cfg=cfg, all_logits=all_logits), cfg, ccfg, engram_host_table)
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=(1,))


def decode_step(params, state, batch, cfg, ccfg, all_logits: bool = False, par=None):
    """`(params, state, batch) -> (logits, state)`: the jitted pure step (state donated)."""
    return jitted_extend(cfg, ccfg, all_logits, par)(params, state, batch)


def pack_rows(rows: Sequence[dict], T: int, B: Optional[int], ccfg) -> dict:
    """Host helper: rows of {tokens, start, slot, page_table[, n_new]} -> the step's batch dict as numpy
    arrays, padded to B rows of T tokens: tokens int32 [B, T], start / n_new / slot int32 [B],
    page_table int32 [B, max_pages_per_seq].

    ``n_new`` defaults to ``len(tokens)``; a row may give more (its first token supplied on the device,
    as the engine does for a token it sampled but has not read back). Padded rows get n_new = 0 and their
    rank's scratch slot (`cache.scratch_slot`); padded tokens are 0 (masked); unused page-table entries
    point at the rank's null page. With ``ccfg.dp`` = D > 1 the batch is rank-major (B divides by D; rows
    ``[r·B/D, (r+1)·B/D)`` are rank r's, and their slots and pages must lie in rank r's blocks:
    `cache.rank_slots`, `cache.rank_pages`; ids stay global). The engine's runner calls this per launch
    (numpy in: jit transfers it, cheaper than `jax.device_put` on the host); `make_batch` puts it on the
    device.
    """
    B = B or len(rows)
    if len(rows) > B:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {B}")
    D = ccfg.dp
    if B % D:
        raise ValueError(f"a batch of {B} rows does not split into dp={D} equal rank blocks")
    per = B // D
    tokens = np.zeros((B, T), np.int32)
    start = np.zeros((B,), np.int32)
    n_new = np.zeros((B,), np.int32)
    slot = kvc.padding_slots(ccfg, B)
    pt = kvc.padding_pages(ccfg, B)
    for b, r in enumerate(rows):
        t = r["tokens"]
        n = r.get("n_new", len(t))
        if len(t) > n or n > T:
            raise ValueError(f"row {b}: {len(t)} tokens, n_new={n}: need len(tokens) <= n_new <= T={T}")
        if len(r["page_table"]) > ccfg.max_pages_per_seq:
            raise ValueError(f"row {b}: {len(r['page_table'])} pages exceed max_pages_per_seq={ccfg.max_pages_per_seq}")
        _check_rank_ids(b, b // per, r, ccfg)
        if len(t):
            tokens[b, : len(t)] = t
        start[b] = r["start"]
        n_new[b] = n
        slot[b] = r["slot"]
        pt[b, : len(r["page_table"])] = r["page_table"]
    return {"tokens": tokens, "start": start, "n_new": n_new, "slot": slot, "page_table": pt}


def _check_rank_ids(b: int, rank: int, row: dict, ccfg) -> None:
    """Row b's slot and pages lie in its dp rank's blocks (ValueError naming them otherwise)."""
    slots = kvc.rank_slots(ccfg, rank)
    s = row["slot"]
    if not (s in slots or s == kvc.scratch_slot(ccfg, rank)):
        where = f"rank {rank}'s " if ccfg.dp > 1 else ""
        raise ValueError(f"row {b}: slot {s} is outside {where}slots {slots.start}..{slots.stop - 1} "
                         f"(scratch {kvc.scratch_slot(ccfg, rank)})")
    pages = kvc.rank_pages(ccfg, rank)
    if ccfg.dp > 1 and len(row["page_table"]) and not all(p in pages for p in row["page_table"]):
        raise ValueError(f"row {b}: page table {list(row['page_table'])} leaves rank {rank}'s pages "
                         f"{pages.start}..{pages.stop - 1}")


def make_batch(rows: Sequence[dict], T: int, B: Optional[int], ccfg) -> dict:
    """`pack_rows`, put on the device (the batch dict `extend` / the decode step take)."""
    # device_put, not jnp.asarray: in JAX 0.10 the latter stages a jitted identity per shape/dtype
    return jax.device_put(pack_rows(rows, T, B, ccfg))


def prefill(params, state, cfg, ccfg, allocator, rid, slot: int, tokens: Sequence[int], start: int = 0,
            chunk_size: int = 64, all_logits: bool = False, par=None):
    """Write `tokens` (positions start..) for request `rid` into the cache in chunks of `chunk_size`.

    Returns (logits, state): logits of the last token [V] (or of every token [n, V] with all_logits).
    """
    outs = []
    pos = start
    tokens = list(tokens)
    for c0 in range(0, len(tokens), chunk_size):
        chunk = tokens[c0: c0 + chunk_size]
        allocator.ensure(rid, pos + len(chunk))
        batch = make_batch([{"tokens": chunk, "start": pos, "slot": slot, "page_table": allocator.pages(rid)}],
                           chunk_size, 1, ccfg)
        logits, state = decode_step(params, state, batch, cfg, ccfg, all_logits, par)
        outs.append(logits[0, : len(chunk)] if all_logits else logits[0])
        pos += len(chunk)
    if all_logits:
        return jnp.concatenate(outs, axis=0), state
    return outs[-1], state


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def generate(params, cfg, prompts: Sequence[Sequence[int]], max_new_tokens: int, return_logits: bool = False,
             *, ccfg=None, chunk_size: int = 32, eos_token_id: Optional[int] = None):
    """Greedy generation over the decode path, all prompts as one ragged batch.

    params: parameter pytree, or a model path / "tiny" (loaded via `load_params`; cfg may then be None).
    prompts: lists of
    token ids (any lengths ≥ 1). Returns a list of generated token lists (and, with `return_logits`,
    a list of fp32 [n_generated, V] arrays of the logits each token was chosen from).
    """
    if ccfg is not None and ccfg.dp > 1:
        raise ValueError(f"generate: a one-rank helper; ccfg.dp={ccfg.dp} needs a rank-major schedule (the engine's)")
    if isinstance(params, str):  # a model path (HF or converted Orbax directory) or "tiny"
        from dsv41_jax.model.checkpoint import load_params, load_model

        if cfg is None:
            cfg, params = load_model(params)
        else:
            params = load_params(params, cfg)
    n = len(prompts)
    if n == 0:
        return ([], []) if return_logits else []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    longest = max(len(p) for p in prompts) + max_new_tokens
    B = 1
    while B < n:
        B *= 2
    if ccfg is None:
        # Sizes rounded up to powers of two so that calls of similar size reuse the compiled steps.
        ps = 16
        per_seq = 1
        while per_seq * ps < longest:
            per_seq *= 2
        ccfg = kvc.CacheConfig(page_size=ps, num_pages=B * per_seq + 1, max_slots=B, max_pages_per_seq=per_seq)
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    state = kvc.init_cache(cfg, ccfg)
    if "engram_hist" in state:
        pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
        state = kvc.reset_slots(state, np.arange(kvc.slot_rows(ccfg)), pad)
    # Prefill: all prompts together, chunk by chunk (rows whose prompt ended carry n_new = 0).
    lens = [len(p) for p in prompts]
    last_logits = [None] * n
    pos = [0] * n
    while any(pos[i] < lens[i] for i in range(n)):
        rows = []
        for i in range(n):
            chunk = list(prompts[i][pos[i]: pos[i] + chunk_size])
            alloc.ensure(i, pos[i] + len(chunk))
            rows.append({"tokens": chunk, "start": pos[i], "slot": i if chunk else kvc.scratch_slot(ccfg),
                         "page_table": alloc.pages(i)})
        batch = make_batch(rows, chunk_size, B, ccfg)
        logits, state = decode_step(params, state, batch, cfg, ccfg)
        logits = np.asarray(logits)
        for i in range(n):
            if pos[i] < lens[i]:
                pos[i] += len(rows[i]["tokens"])
                if pos[i] == lens[i]:
                    last_logits[i] = logits[i]
    outs = [[] for _ in range(n)]
    out_logits = [[] for _ in range(n)]
    done = [False] * n
    for step in range(max_new_tokens):
        rows = []
        for i in range(n):
            lg = last_logits[i]
            if not done[i]:
                tok = int(np.argmax(lg))
                outs[i].append(tok)
                out_logits[i].append(lg)
                if (eos_token_id is not None and tok == eos_token_id) or len(outs[i]) >= max_new_tokens:
                    done[i] = True
            if done[i]:
                rows.append({"tokens": [], "start": 0, "slot": kvc.scratch_slot(ccfg), "page_table": []})
            else:
                alloc.ensure(i, pos[i] + 1)
                rows.append({"tokens": [outs[i][-1]], "start": pos[i], "slot": i, "page_table": alloc.pages(i)})
        if all(done):
            break
        batch = make_batch(rows, 1, B, ccfg)
        logits, state = decode_step(params, state, batch, cfg, ccfg)
        logits = np.asarray(logits)
        for i in range(n):
            if not done[i]:
                pos[i] += 1
                last_logits[i] = logits[i]
    if return_logits:
        return outs, [np.stack(x) if x else np.zeros((0, cfg.vocab_size), np.float32) for x in out_logits]
    return outs
