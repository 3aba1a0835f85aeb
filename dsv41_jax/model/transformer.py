"""The reference forward pass: tokens [B, T] from position 0 -> fp32 logits [B, T, vocab] (docs/design/spec.md §2–§6).

Plain `jnp`, pure, jittable (``jax.jit(forward, static_argnames=("cfg", "return_aux"))``). Layers are
heterogeneous (which stores a layer writes and reads depends on the config's layer lists), so the
loop over layers is a Python loop unrolled at trace time; each layer's role comes from
`cfg.layer_plan`. Runs of >= 2 layers with the same plan (`layer_scan`) are one `lax.scan` each
(`scan_blocks`) unless ``cfg.layer_scan`` is False (the unrolled loop, the reference).

Per layer L (V4.1's "pre from previous sublayer" ordering, docs/design/spec.md §2):
  Engram (if L is an Engram layer) on the whole n-stream state;
  (aPre, aPost, aC) = mixes_attn(h); h = hc_post(attn(attn_norm(hc_pre(h, pre_prev))), h, aPost, aC);
  (fPre, fPost, fC) = mixes_ffn(h);  h = hc_post(moe(ffn_norm(hc_pre(h, aPre))), h, fPost, fC);
  pre_prev = fPre.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from dsv41_jax.model import attention as attn_mod
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import compressor, indexer, layer_scan, linear, tiling, weights
from dsv41_jax.model.engram import engram, hash_rows
from dsv41_jax.model.mhc import hc_pre
from dsv41_jax.model.moe import moe
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.params import layer_decl
from dsv41_jax.model.plan import DeferredExit, StepPlan
from dsv41_jax.model.weights import Fp8, Stacked


def enter(step, layer_p, sub: str, h, pre_prev, cfg, dt, par=None):
    """Enter sublayer `sub` ("attn" | "ffn") from h (streams [.., n, D] or the previous sublayer's `DeferredExit`):
    (h entering it, (x [.., D] its normed input in `dt`, pre, post, comb fp32 mixes)), by the plan's forms
    (`StepPlan.enter`, or `exit_enter` where `fused_boundary`; on a mesh the exit runs apart, streams pinned
    replicated). The mHC weights may be a run's stacks (`weights.Stacked`)."""
    got = [weights.split(v) for v in (layer_p[f"hc_{sub}_fn"], layer_p[f"hc_{sub}_base"], layer_p[f"hc_{sub}_scale"],
                                      layer_p[f"{sub}_norm"]["weight"])]
    (fn, layer), (base, _), (scale, _), (norm_w, _) = got
    if isinstance(h, DeferredExit) and step.fused_boundary:
        h, entered = step.exit_enter(replicated(h.y, par), h.h, h.post, h.comb, pre_prev, fn, base, scale, cfg, dt,
                                     layer=layer, norm_weight=norm_w)
        return replicated(h, par), entered
    h = settle(step, h, cfg, dt, par)
    return h, step.enter(h, pre_prev, fn, base, scale, cfg, dt, layer=layer, norm_weight=norm_w)


def embed_streams(params, tokens, cfg, dt, par=None):
    """Token embedding copied into the n streams: [B, T] -> [B, T, n, D] in `dt` (on a mesh plan `par`: the
    tp-split rows gathered locally + one all-reduce, `par.embed_gather`)."""
    if par is not None and par.size > 1:
        e = par.embed_gather(params["embed"]["weight"], tokens, dt)
    else:
        e = params["embed"]["weight"][tokens].astype(dt)
    return jnp.broadcast_to(e[..., None, :], e.shape[:-1] + (cfg.hc_mult, e.shape[-1]))


def initial_pre(shape_bt, cfg):
    """pre_prev of the first layer: one-hot [1, 0, …] over the n streams, fp32 [.., n]."""
    return jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=jnp.float32), tuple(shape_bt) + (cfg.hc_mult,))


def attention_full(step, p, x, positions, plan, ctx, cfg, dt):
    """The attention sublayer over a whole sequence starting at position 0.

    p: the layer's ``attn`` params; x [B, T, D] normed input; ctx: dict of stores written by earlier
    layers ("comp"/"keys"/"topk"/"cand" keyed by layer id). Returns (y [B, T, D], ctx', rec): ctx' is
    `ctx` plus what this layer stores for later ones (a new dict; `ctx` is not modified), rec this
    layer's aux record (`record`: "topk"/"cand" at index / candidate sources, else empty).

    Index selection goes through the same routine as the cached path (`indexer.retrieve`, the
    "indexer" seam), on the key owner's index-key *codes* laid out as a pool with one page per row
    (row b's slot j at pool row b·S + j): decoding the codes gives the fake-quantized keys bit for bit.
    Attention itself is the reference `attend` over the in-flight sequence.
    """
    B, T, _ = x.shape
    W = cfg.sliding_window
    eps = cfg.rms_norm_eps
    freqs = attn_mod.layer_freqs(cfg, plan)
    qr, q, kv_rot = attn_mod.project_q_kv(p, x, positions, freqs, cfg, dt)
    kv = attn_mod.window_kv(kv_rot, dt)
    t = jnp.arange(T)
    win_mask = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W)
    win_mask = jnp.broadcast_to(win_mask, (B, T, T))
    r = plan.compress_ratio
    S = T // r if r else 0
    lid = plan.layer_id
    rec: dict = {}
    if r == 0 or S == 0:  # window-only layer, or a sequence shorter than one group: no compressed slot
        comp = jnp.zeros((B, T, 0, cfg.head_dim), dt)
        comp_mask = jnp.zeros((B, T, 0), bool)
        if r and plan.is_index_source:
            none = jnp.zeros((B, T, 0), jnp.int32)
            ctx, rec = dict(ctx, topk={**ctx["topk"], lid: none}), {"topk": none}
            if plan.is_candidate_source:
                ctx["cand"] = jnp.zeros((B, T, 0), jnp.int32)
                rec["cand"] = jnp.zeros((B, T, 0), bool)
    else:
        if plan.is_kv_source:
            latent = compressor.compress(p["compressor"], x, r, eps, dt, is_exact(cfg))  # [B, S, hd]
            slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) * r, (B, S))
            ctx = dict(ctx, comp={**ctx["comp"], lid: compressor.compressed_kv(latent, slot_pos, freqs, dt)})
            if "wk" in p.get("indexer", {}):
                krot = indexer.index_keys_rot(p["indexer"], latent, slot_pos, freqs, eps, dt, is_exact(cfg))
                codes = kvc.encode("ikey", "auto", krot)  # == index_keys(...) once decoded, bitwise
                ctx["keys"] = {**ctx["keys"], lid: {k: v.reshape((B * S,) + v.shape[2:]) for k, v in codes.items()}}
        if plan.is_index_source:
            page_table = jnp.arange(B, dtype=jnp.int32)[:, None]  # one page of S·r tokens per row
            ctx, rec = indexer.retrieve(p["indexer"], qr, x, positions, freqs, plan, ctx, ctx["keys"][plan.key_owner],
                                        page_table, page_size=S * r, mode="auto", cfg=cfg, dt=dt)
        store = ctx["comp"][plan.kv_source]  # [B, S, hd]
        sel = ctx["topk"][plan.index_source]  # [B, T, K]
        comp = jnp.take_along_axis(store[:, None, :, :], jnp.maximum(sel, 0)[..., None], axis=2)
        comp_mask = sel >= 0
    o = attn_mod.attend(q, kv, win_mask, comp, comp_mask, attn_mod.sink_of(p), dt,
                        exact=is_exact(cfg))
    return attn_mod.output_proj(step, p, o, positions, freqs, cfg, dt), ctx, rec


def replicated(x, par):
    """On mesh plan `par`, pin activation `x` replicated (else XLA may keep a tp-split projection's output split
    along D and the fp32 sums over D would run in another order than unsharded). No-op without a plan."""
    return x if par is None else par.replicated(x)


def settle(step, h, cfg, dt, par=None):
    """The streams as an array: `h` itself, or — `h` a `DeferredExit` — its exit (`StepPlan.exit`)."""
    if not isinstance(h, DeferredExit):
        return h
    return replicated(step.exit(replicated(h.y, par), h.h, h.post, h.comb, cfg, dt), par)


def block(step, lp, h, pre_prev, plan, cfg, dt, top_k, attn_fn, engram_rows=None, par=None):
    """One layer: (its ffn exit as a `DeferredExit`, left for the next enter to fuse, pre for the next sublayer, rec,
    out). h: streams [B, T, n, D] or the previous layer's `DeferredExit`; pre_prev fp32 [B, T, n]; plan: the
    layer's `LayerPlan`; attn_fn(x [B, T, D]) -> (y, out), `out` handed back untouched; engram_rows int32 [B, T, R]
    (Engram layers); par: optional mesh plan. rec: {"layer_inputs": h after Engram, "experts": int32 [B, T, k]}."""
    if plan.is_engram:
        h = replicated(engram(lp["engram"], settle(step, h, cfg, dt, par), engram_rows, cfg, dt, par=par), par)
    h, (x, a_pre, a_post, a_comb) = enter(step, lp, "attn", h, pre_prev, cfg, dt, par)
    rec = {"layer_inputs": h}
    y, out = attn_fn(x)
    h, (x, f_pre, f_post, f_comb) = enter(step, lp, "ffn", DeferredExit(h, y, a_post, a_comb), a_pre, cfg, dt, par)
    y, (rec["experts"], _) = moe(lp["ffn"], x, top_k, cfg, dt, return_routing=True, par=par, step=step,
                               layer_id=plan.layer_id)
    return DeferredExit(h, y, f_post, f_comb), f_pre, rec, out


def scan_blocks(step, stacked, h, pre, carry, plan, cfg, dt, aux, first, top_k, attn_fn, par=None):
    """A run of plan-identical layers as one ``lax.scan`` of `block`: (h, pre, aux', outs, carry').

    stacked: the run's params with a leading axis n in storage dtypes (`layer_scan.run_params`); h / pre enter
    the layer `first` (h streams or a `DeferredExit`: the carry keeps its form); carry: what the attention threads
    through the layers (a pytree; the forward's: None); plan: the first layer's.
    attn_fn(p, k, carry, x) -> (y, (out, carry')): one layer's attention (k int32 its index in the run); outs: the
    `out`s stacked on axis 0. The weights the kernels read in place (`StepPlan.in_place`) and the routed experts
    are handed over whole with the layer (`weights.Stacked`): XLA copies a sliced Pallas operand per layer."""
    like = layer_decl(cfg, first)
    n = jax.tree_util.tree_leaves(stacked["ffn"]["experts"])[0].shape[0]
    whole = step.in_place(cfg, first) + (("ffn", "experts"),)
    # a vector's stack back to its declared dtype (`layer_scan.storage_dtype`); a quantized one stays in its bits
    stacks = {path: functools.reduce(operator.getitem, path, stacked) for path in whole}
    stacks = {path: st if isinstance(st, (Fp8, dict)) else
              layer_scan.load_row(st, functools.reduce(operator.getitem, path, like)) for path, st in stacks.items()}
    rest = stacked
    for path in whole:  # not scanned over: the body gets them whole
        rest = layer_scan.set_path(rest, path, None)
        like = layer_scan.set_path(like, path, None)
    streams_in = not isinstance(h, DeferredExit)

    def body(c, lp):
        # k rides in the carry: a scanned arange would be a dynamic slice, one small launch per consumer on GPU
        h, pre, k, extra = c
        lp = layer_scan.load_row(lp, like)  # storage dtypes -> the declared ones (bitcasts)
        for path, st in stacks.items():
            lp = layer_scan.set_path(lp, path, Stacked(st, k))
        h, pre, rec, (out, extra) = block(step, lp, h, pre, plan, cfg, dt, top_k,
                                          functools.partial(attn_fn, lp["attn"], k, extra), None, par=par)
        if streams_in:  # streams in, streams out: the carry keeps one form
            h = settle(step, h, cfg, dt, par)
        return (h, pre, k + 1, extra), (rec, out)

    (h, pre, _, carry), (recs, outs) = jax.lax.scan(body, (h, pre, jnp.int32(0), carry), rest, length=n)
    for k in range(n):
        aux = record(aux, first + k, jax.tree_util.tree_map(operator.itemgetter(k), recs))
    return h, pre, aux, outs, carry


def final_logits(params, h, pre, cfg, dt):
    """x = hc_pre(h, last ffn pre) → norm → head → fp32 logits. Returns (logits, normed x)."""
    x = rmsnorm(hc_pre(h, pre, dt), params["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return linear.f32(x, params["head"]["weight"], cfg, row_axis="vocab"), x


def new_aux():
    """The empty aux record: {"topk", "cand", "experts", "layer_inputs"}, each {layer id: array}."""
    return {"topk": {}, "cand": {}, "experts": {}, "layer_inputs": {}}


def record(aux, lid, *recs):
    """`aux` with layer `lid`'s records ({kind: array}) added (a new dict)."""
    out = dict(aux)
    for rec in recs:
        for kind, v in rec.items():
            out[kind] = {**out[kind], lid: v}
    return out


def forward(params, tokens, cfg, return_aux: bool = False, par=None):
    """Reference forward of the target model.

    params: the parameter pytree (`init_params` / `load_params`), canonical or stacked layout
    (`layer_scan.stack_layers`); tokens: int32 [B, T], positions
    0..T−1; cfg: `ModelConfig` (static). Returns fp32 logits [B, T, vocab_size], and with
    `return_aux` also a dict of the discrete decisions and states: ``topk`` {layer: int32 [B, T, k]},
    ``cand`` {layer: bool [B, T, S]}, ``experts`` {layer: int32 [B, T, top_k]}, ``layer_inputs``
    {layer: [B, T, n, D] state entering the layer after its Engram}, ``hidden`` [B, T, D] (final
    normed hidden state).

    par: optional mesh plan (`parallel.plan.MeshPlan.of(mesh)`; params placed on the mesh by
    `parallel.rules.shard_params`). Call under ``jax.jit`` (static cfg, par): MoE and the row-split
    tables run the plan's `shard_map` forms, the rest is partitioned by XLA from the parameter shardings.

    A DeepSeek-V4 config (``model_family`` "deepseek_v4") runs V4's forward (`v4.transformer.forward`).
    """
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4 import transformer as v4  # lazy: it builds on this module's pieces

        return v4.forward(params, tokens, cfg, return_aux, par)
    with tiling.on_mesh(par):  # CPU row tiles follow the weights' splits (model.tiling)
        dt = act_dtype(cfg)
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h = embed_streams(params, tokens, cfg, dt, par)
        pre = initial_pre((B, T), cfg)
        ctx = {"comp": {}, "keys": {}, "topk": {}, "cand": None}
        aux = new_aux()
        step = StepPlan.of(cfg, par, (B, T))
        for i, n in layer_scan.layer_runs(cfg):
            plan = cfg.layer_plan(i)
            if n > 1:  # consumers / window-only layers: one body for the run, reading only shared stores
                def attn_run(p, _k, carry, x, plan=plan, ctx=ctx):
                    return attention_full(step, p, x, positions, plan, ctx, cfg, dt)[0], (None, carry)

                h, pre, aux, _, _ = scan_blocks(step, layer_scan.run_params(params, i, n, cfg), h, pre, None, plan, cfg,
                                                dt, aux, i, cfg.num_experts_per_tok, attn_run, par=par)
                continue
            lp = layer_scan.layer_params(params, i, cfg)
            rows = (hash_rows(cfg, i, params["derived"]["engram_token_map"], tokens) if plan.is_engram else None)

            def attn_fn(x, lp=lp, plan=plan, ctx=ctx):
                y, ctx_out, rec = attention_full(step, lp["attn"], x, positions, plan, ctx, cfg, dt)
                return y, (ctx_out, rec)

            h, pre, rec, (ctx, arec) = block(step, lp, h, pre, plan, cfg, dt, cfg.num_experts_per_tok, attn_fn, rows,
                                             par=par)
            aux = record(aux, i, rec, arec)
        logits, x = final_logits(params, settle(step, h, cfg, dt, par), pre, cfg, dt)
        if return_aux:
            return logits, dict(aux, hidden=x)
        return logits
