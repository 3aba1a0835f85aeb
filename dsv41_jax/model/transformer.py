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

import jax
import jax.numpy as jnp

from dsv41_jax.model import attention as attn_mod
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import compressor, indexer, layer_scan, linear, tiling
from dsv41_jax.model.engram import engram, hash_rows
from dsv41_jax.model.mhc import hc_pre, sublayer_enter, sublayer_exit
from dsv41_jax.model.moe import moe
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact


def enter(layer_p, sub: str, h, pre_prev, cfg, dt):
    """Entering sublayer `sub` ("attn" | "ffn") with streams h [.., n, D]: (x_in = hc_pre(h, pre_prev) in
    `dt`, and the pre / post / comb mixes of h), through the mhc seam (`mhc.sublayer_enter`)."""
    return sublayer_enter(h, pre_prev, layer_p[f"hc_{sub}_fn"], layer_p[f"hc_{sub}_base"],
                          layer_p[f"hc_{sub}_scale"], cfg, dt)


def embed_streams(params, tokens, cfg, dt, par=None):
    """Token embedding copied into the n streams: [B, T] -> [B, T, n, D] in `dt`.

    par: a mesh plan: rows split over "tp" are gathered locally + one all-reduce (`par.embed_gather`)."""
    if par is not None and par.size > 1:
        e = par.embed_gather(params["embed"]["weight"], tokens, dt)
    else:
        e = params["embed"]["weight"][tokens].astype(dt)
    return jnp.broadcast_to(e[..., None, :], e.shape[:-1] + (cfg.hc_mult, e.shape[-1]))


def initial_pre(shape_bt, cfg):
    """pre_prev of the first layer: one-hot [1, 0, …] over the n streams, fp32 [.., n]."""
    return jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=jnp.float32), tuple(shape_bt) + (cfg.hc_mult,))


def attention_full(p, x, positions, plan, ctx, cfg, dt, aux):
    """The attention sublayer over a whole sequence starting at position 0.

    p: the layer's ``attn`` params; x [B, T, D] normed input; ctx: dict of stores written by earlier
    layers ("comp"/"keys"/"topk"/"cand" keyed by layer id). Returns y [B, T, D].

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
    if r == 0 or S == 0:  # window-only layer, or a sequence shorter than one group: no compressed slot
        comp = jnp.zeros((B, T, 0, cfg.head_dim), dt)
        comp_mask = jnp.zeros((B, T, 0), bool)
        if r and plan.is_index_source:
            ctx["topk"][plan.layer_id] = aux["topk"][plan.layer_id] = jnp.zeros((B, T, 0), jnp.int32)
            if plan.is_candidate_source:
                ctx["cand"] = jnp.zeros((B, T, 0), jnp.int32)
                aux["cand"][plan.layer_id] = jnp.zeros((B, T, 0), bool)
    else:
        if plan.is_kv_source:
            latent = compressor.compress(p["compressor"], x, r, eps, dt, is_exact(cfg))  # [B, S, hd]
            slot_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) * r, (B, S))
            if "wk" in p.get("indexer", {}):
                krot = indexer.index_keys_rot(p["indexer"], latent, slot_pos, freqs, eps, dt, is_exact(cfg))
                codes = kvc.encode("ikey", "auto", krot)  # == index_keys(...) once decoded, bitwise
                ctx["keys"][plan.layer_id] = {k: v.reshape((B * S,) + v.shape[2:]) for k, v in codes.items()}
            ctx["comp"][plan.layer_id] = compressor.compressed_kv(latent, slot_pos, freqs, dt)
        if plan.is_index_source:
            page_table = jnp.arange(B, dtype=jnp.int32)[:, None]  # one page of S·r tokens per row
            indexer.retrieve(p["indexer"], qr, x, positions, freqs, plan, ctx, aux, ctx["keys"][plan.key_owner],
                             page_table, page_size=S * r, mode="auto", cfg=cfg, dt=dt)
        store = ctx["comp"][plan.kv_source]  # [B, S, hd]
        sel = ctx["topk"][plan.index_source]  # [B, T, K]
        comp = jnp.take_along_axis(store[:, None, :, :], jnp.maximum(sel, 0)[..., None], axis=2)
        comp_mask = sel >= 0
    o = attn_mod.attend(q, kv, win_mask, comp, comp_mask, p["attn_sink"].astype(jnp.float32), dt,
                        exact=is_exact(cfg))
    return attn_mod.output_proj(p, o, positions, freqs, cfg, dt)


def replicated(x, par):
    """On mesh plan `par`, pin activation `x` replicated (`par.replicated`: activations are not split).

    Without it XLA may keep a tp-split output projection's result split along D (a reduce-scatter
    instead of the all-reduce), and the norms' / mHC's fp32 sums over D would then be summed in a
    different order than unsharded. No-op without a plan."""
    return x if par is None else par.replicated(x)


def block(lp, h, pre_prev, plan, cfg, dt, aux, top_k, attn_fn, engram_rows=None, par=None):
    """One layer (any attention implementation): returns (h, pre for the next sublayer).

    lp: the layer's params; h [B, T, n, D]; pre_prev fp32 [B, T, n]; attn_fn(x) -> y maps the normed
    attention input [B, T, D] to the sublayer output; engram_rows int32 [B, T, R] for Engram layers;
    par: optional mesh plan (`parallel.plan.MeshPlan`: Engram and the routed experts run its sharded forms).
    """
    if plan.is_engram:
        h = replicated(engram(lp["engram"], h, engram_rows, cfg, dt, par=par), par)
    aux["layer_inputs"][plan.layer_id] = h
    # The mixes of each sublayer come from its own input h, its hc_pre uses the previous pre.
    x, a_pre, a_post, a_comb = enter(lp, "attn", h, pre_prev, cfg, dt)
    x = rmsnorm(x, lp["attn_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    h = replicated(sublayer_exit(replicated(attn_fn(x), par), h, a_post, a_comb, cfg, dt), par)
    x, f_pre, f_post, f_comb = enter(lp, "ffn", h, a_pre, cfg, dt)
    x = rmsnorm(x, lp["ffn_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    y, (eidx, _) = moe(lp["ffn"], x, top_k, cfg, dt, return_routing=True, par=par)
    aux["experts"][plan.layer_id] = eidx
    h = replicated(sublayer_exit(replicated(y, par), h, f_post, f_comb, cfg, dt), par)
    return h, f_pre


def scan_blocks(stacked, h, pre, plan, cfg, dt, aux, first, top_k, attn_fn, xs=None, par=None):
    """A run of plan-identical layers (`layer_scan.layer_runs`) as one ``lax.scan`` of `block`.

    stacked: the run's layer params with a leading axis n, in storage dtypes (`layer_scan.run_params`); h [B, T, n_hc, D]
    and pre fp32 [B, T, n_hc] enter the run's first layer (`first`); plan: the run's first layer's plan
    (the run's layers differ only in layer_id, which no consumer's body reads); xs: per-layer inputs
    with a leading axis n (or None). attn_fn(p, x, xs_row, out) -> y is the attention sublayer of one
    layer (p its ``attn`` params) and may put per-layer arrays in the dict `out`. Writes each layer's
    ``layer_inputs`` / ``experts`` to `aux` under its own layer id. Returns (h, pre, outs): `outs` is
    `out` stacked over the run (leading axis n)."""
    like = layer_scan.layer_decl(cfg, first)
    # The routed experts are not sliced per layer: the body gathers only the selected (layer, expert)
    # rows out of the run's stacks (`moe.layer_slice`); a dynamic slice would copy all of a layer's
    # experts every step (flash: 6.4 GB per layer).
    experts = stacked["ffn"]["experts"]
    rest = dict(stacked, ffn={k: v for k, v in stacked["ffn"].items() if k != "experts"})
    like = dict(like, ffn={k: v for k, v in like["ffn"].items() if k != "experts"})
    n = jax.tree_util.tree_leaves(experts)[0].shape[0]

    def body(carry, inp):
        h, pre = carry
        lp, row, k = inp
        lp = layer_scan.load_row(lp, like)  # storage dtypes -> the declared ones (bitcasts)
        lp = dict(lp, ffn=dict(lp["ffn"], experts=dict(experts, layer=k)))
        local, out = new_aux(), {}
        h, pre = block(lp, h, pre, plan, cfg, dt, local, top_k, lambda x: attn_fn(lp["attn"], x, row, out),
                       None, par=par)
        lid = plan.layer_id
        return (h, pre), (local["layer_inputs"][lid], local["experts"][lid], out)

    (h, pre), (inputs, eidx, outs) = jax.lax.scan(body, (h, pre), (rest, xs, jnp.arange(n, dtype=jnp.int32)))
    for k in range(n):
        aux["layer_inputs"][first + k] = inputs[k]
        aux["experts"][first + k] = eidx[k]
    return h, pre, outs


def final_logits(params, h, pre, cfg, dt):
    """x = hc_pre(h, last ffn pre) → norm → head → fp32 logits. Returns (logits, normed x)."""
    x = rmsnorm(hc_pre(h, pre, dt), params["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return linear.f32(x, params["head"]["weight"], cfg, row_axis="vocab"), x


def new_aux():
    return {"topk": {}, "cand": {}, "experts": {}, "layer_inputs": {}}


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
    """
    with tiling.on_mesh(par):  # CPU row tiles follow the weights' splits (model.tiling)
        dt = act_dtype(cfg)
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        h = embed_streams(params, tokens, cfg, dt, par)
        pre = initial_pre((B, T), cfg)
        ctx = {"comp": {}, "keys": {}, "topk": {}, "cand": None}
        aux = new_aux()
        for i, n in layer_scan.layer_runs(cfg):
            plan = cfg.layer_plan(i)
            if n > 1:  # consumers / window-only layers: one body for the run, reading only shared stores
                def attn_run(p, x, _row, _out, plan=plan):
                    return attention_full(p, x, positions, plan, ctx, cfg, dt, new_aux())

                h, pre, _ = scan_blocks(layer_scan.run_params(params, i, n, cfg), h, pre, plan, cfg, dt, aux, i,
                                        cfg.num_experts_per_tok, attn_run, par=par)
                continue
            lp = layer_scan.layer_params(params, i, cfg)
            rows = (hash_rows(cfg, i, params["derived"]["engram_token_map"], tokens) if plan.is_engram else None)

            def attn_fn(x, lp=lp, plan=plan):
                return attention_full(lp["attn"], x, positions, plan, ctx, cfg, dt, aux)

            h, pre = block(lp, h, pre, plan, cfg, dt, aux, cfg.num_experts_per_tok, attn_fn, rows, par=par)
        logits, x = final_logits(params, h, pre, cfg, dt)
        if return_aux:
            aux["hidden"] = x
            return logits, aux
        return logits
