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
from dsv41_jax.model import compressor, dispatch, indexer, layer_scan, linear, tiling
from dsv41_jax.model.engram import engram, hash_rows
from dsv41_jax.model.mhc import hc_pre, sublayer_enter, sublayer_exit, sublayer_exit_enter
from dsv41_jax.model.mhc import kernel_runs as mhc_kernel_runs
from dsv41_jax.model.moe import moe
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact


def _sub_weights(layer_p, sub: str):
    """Sublayer `sub`'s mHC fn / base / scale and its RMSNorm weight (``attn_norm`` / ``ffn_norm``)."""
    return (layer_p[f"hc_{sub}_fn"], layer_p[f"hc_{sub}_base"], layer_p[f"hc_{sub}_scale"]), \
        layer_p[f"{sub}_norm"]["weight"]


def enter(layer_p, sub: str, h, pre_prev, cfg, dt):
    """Entering sublayer `sub` ("attn" | "ffn") with streams h [.., n, D]: (x = the sublayer's RMSNorm of
    hc_pre(h, pre_prev), in `dt`, and the pre / post / comb mixes of h), through the mhc seam
    (`mhc.sublayer_enter`, which fuses the norm where its kernel runs)."""
    w, norm_w = _sub_weights(layer_p, sub)
    return sublayer_enter(h, pre_prev, *w, cfg, dt, layer=layer_p.get("hc_layer"), norm_weight=norm_w)


def exit_enter(layer_p, sub: str, y, h, post, comb, pre, cfg, dt, par=None):
    """Leave a sublayer (output y, its post / comb / pre) and enter sublayer `sub`: (h', `enter`'s result).
    One mhc seam call (`mhc.sublayer_exit_enter`: one kernel where the mhc kernel runs); on a mesh of more
    than one device the two stay apart, so h' is pinned replicated (`replicated`) before the enter sums over it."""
    y = replicated(y, par)
    if par is not None and par.size > 1:
        h = replicated(sublayer_exit(y, h, post, comb, cfg, dt), par)
        return h, enter(layer_p, sub, h, pre, cfg, dt)
    w, norm_w = _sub_weights(layer_p, sub)
    h, entered = sublayer_exit_enter(y, h, post, comb, pre, *w, cfg, dt, layer=layer_p.get("hc_layer"),
                                     norm_weight=norm_w)
    return replicated(h, par), entered


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


def attention_full(p, x, positions, plan, ctx, cfg, dt):
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
    return attn_mod.output_proj(p, o, positions, freqs, cfg, dt), ctx, rec


def replicated(x, par):
    """On mesh plan `par`, pin activation `x` replicated (`par.replicated`: activations are not split).

    Without it XLA may keep a tp-split output projection's result split along D (a reduce-scatter
    instead of the all-reduce), and the norms' / mHC's fp32 sums over D would then be summed in a
    different order than unsharded. No-op without a plan."""
    return x if par is None else par.replicated(x)


def settle(h, cfg, dt, par=None):
    """The streams as an array: `h` itself, or — `h` a deferred exit (h_in, y, post, comb), what `block` with
    ``defer=True`` hands on — ``sublayer_exit(y, h_in, post, comb)``."""
    if not isinstance(h, tuple):
        return h
    h_in, y, post, comb = h
    return replicated(sublayer_exit(replicated(y, par), h_in, post, comb, cfg, dt), par)


def block(lp, h, pre_prev, plan, cfg, dt, top_k, attn_fn, engram_rows=None, par=None, defer: bool = False):
    """One layer (any attention implementation): returns (h, pre for the next sublayer, rec, out).

    h: the streams [B, T, n, D], or the previous layer's deferred exit (a tuple, see `settle`): its exit then
    runs fused with this layer's attention enter (`exit_enter`: one mHC kernel launch fewer per layer
    boundary), or alone before an Engram layer. defer: return this layer's own ffn exit deferred, as
    ``(h entering the ffn, y, post, comb)``, for the next layer (or `settle`) to apply.

    lp: the layer's params; pre_prev fp32 [B, T, n]; attn_fn(x) -> (y, out) maps the
    normed attention input [B, T, D] to the sublayer output y and whatever else the attention returns
    (`out`, handed back untouched: stores for later layers, cache writes); engram_rows int32 [B, T, R]
    for Engram layers; par: optional mesh plan (`parallel.plan.MeshPlan`: Engram and the routed experts
    run its sharded forms). rec: this layer's aux record {"layer_inputs": h after Engram [B, T, n, D],
    "experts": int32 [B, T, top_k]} (`record`).
    """
    if plan.is_engram:
        h = replicated(engram(lp["engram"], settle(h, cfg, dt, par), engram_rows, cfg, dt, par=par), par)
    # The mixes of each sublayer come from its own input h, its hc_pre uses the previous pre.
    if isinstance(h, tuple):  # the previous layer's ffn exit, fused with this enter
        h_in, y_prev, post_prev, comb_prev = h
        h, (x, a_pre, a_post, a_comb) = exit_enter(lp, "attn", y_prev, h_in, post_prev, comb_prev, pre_prev, cfg, dt,
                                                   par)
    else:
        x, a_pre, a_post, a_comb = enter(lp, "attn", h, pre_prev, cfg, dt)
    rec = {"layer_inputs": h}
    y, out = attn_fn(x)
    h, (x, f_pre, f_post, f_comb) = exit_enter(lp, "ffn", y, h, a_post, a_comb, a_pre, cfg, dt, par)
    y, (eidx, _) = moe(lp["ffn"], x, top_k, cfg, dt, return_routing=True, par=par)
    rec["experts"] = eidx
    h = (h, y, f_post, f_comb) if defer else settle((h, y, f_post, f_comb), cfg, dt, par)
    return h, f_pre, rec, out


def scan_blocks(stacked, h, pre, plan, cfg, dt, aux, first, top_k, attn_fn, xs=None, par=None, carry=None):
    """A run of plan-identical layers (`layer_scan.layer_runs`) as one ``lax.scan`` of `block`.

    stacked: the run's layer params with a leading axis n, in storage dtypes (`layer_scan.run_params`); h [B, T, n_hc, D]
    and pre fp32 [B, T, n_hc] enter the run's first layer (`first`); plan: the run's first layer's plan
    (the run's layers differ only in layer_id, which no consumer's body reads); xs: per-layer inputs
    with a leading axis n (or None). attn_fn(p, x, xs_row, k) -> (y, out) is the attention sublayer of one
    layer (p its ``attn`` params, k int32 its index within the run); `out` is a pytree of per-layer arrays. Returns (h, pre, aux', outs):
    aux' is `aux` with each layer's ``layer_inputs`` / ``experts`` under its own layer id (a new dict),
    `outs` the layers' `out` stacked over the run (leading axis n). carry: None, or a pytree the layers thread
    through (attn_fn(p, x, xs_row, k, carry) -> (y, (out, carry')): the cache's window rings, which each layer
    writes in place); then returns (h, pre, aux', outs, the last carry)."""
    like = layer_scan.layer_decl(cfg, first)
    # The routed experts are not sliced per layer: the body gathers only the selected (layer, expert)
    # rows out of the run's stacks (`moe.layer_slice`); a dynamic slice would copy all of a layer's
    # experts every step (flash: 6.4 GB per layer).
    experts = stacked["ffn"]["experts"]
    rest = dict(stacked, ffn={k: v for k, v in stacked["ffn"].items() if k != "experts"})
    like = dict(like, ffn={k: v for k, v in like["ffn"].items() if k != "experts"})
    n = jax.tree_util.tree_leaves(experts)[0].shape[0]
    # The same for the fp8 / MXFP4 linears when they run the Pallas kernel: a kernel's operand cannot be
    # fused with the scan's dynamic slice, so XLA would copy each weight per layer (flash at B=1: 420
    # weight copies, 3.9 GB per step, in the H200-target compile); the kernel reads the layer's rows out
    # of the run's stacks instead (`linear.layer_weight`). The xla path keeps the slice, which fuses.
    in_place = linear.stacked_paths(rest) if linear.impl_of(cfg) in ("pallas", "pallas_interpret") else []
    if in_place:  # q_norm runs in wq_b's kernel (`linear.fp8_normed`)
        in_place.append(("attn", "q_norm"))
    if dispatch.resolve(cfg, "attention") in ("pallas", "pallas_interpret"):  # kv_norm: `attention.window_codes`
        in_place.append(("attn", "kv_norm"))
    if linear.kernel_runs(cfg):  # wo_a's fp8 pair and the sink: the o_proj kernel (`attention.output_proj`)
        in_place += [("attn", "wo_a"), ("attn", "attn_sink")]
    if dispatch.resolve(cfg, "moe") in ("pallas", "pallas_interpret") and (par is None or par.size == 1):
        in_place.append(("ffn", "gate", "bias"))  # the router kernel's (`moe.moe`)
    # and the mHC mixes' fn / base / scale and the sublayer norms' weights when the mhc kernel runs
    # (`mhc.sublayer_enter`'s layer)
    if mhc_kernel_runs(cfg):
        in_place += [(f"hc_{sub}_{leaf}",) for sub in ("attn", "ffn") for leaf in ("fn", "base", "scale")]
        in_place += [(f"{sub}_norm", "weight") for sub in ("attn", "ffn")]  # its tail runs the norms
    stacks = {path: layer_scan.get_path(rest, path) for path in in_place}
    # a norm's whole stack back to its declared dtype (bf16 is stored as uint16: `layer_scan.storage_dtype`); the
    # linears' dicts stay in storage dtypes (`linear.layer_weight`)
    stacks = {path: layer_scan.load_row(st, layer_scan.get_path(like, path))
              if not isinstance(st, dict) or set(st) == {"weight"} else st for path, st in stacks.items()}
    for path in (("attn", "attn_sink"), ("ffn", "gate", "bias")):  # vector params read in place: {"weight": stack,
        if path in stacks:                                             # "layer"} (`attention.sink_of`, `moe.route`)
            stacks[path] = {"weight": stacks[path]}
    for path in in_place:  # not scanned over: the body gets them whole
        rest = layer_scan.set_path(rest, path, None)
        like = layer_scan.set_path(like, path, None)

    def body(carry, inp):
        # k, the layer within the run, rides in the carry: taken from a scanned arange it would be a
        # dynamic slice that XLA:GPU rematerializes as one small launch per consumer (the routed experts
        # and each stacked linear read it)
        h, pre, k, extra = carry
        lp, row = inp
        lp = layer_scan.load_row(lp, like)  # storage dtypes -> the declared ones (bitcasts)
        lp = dict(lp, ffn=dict(lp["ffn"], experts=dict(experts, layer=k)))
        for path, st in stacks.items():
            lp = layer_scan.set_path(lp, path, dict(st, layer=k) if isinstance(st, dict) else st)
        if mhc_kernel_runs(cfg):
            lp = dict(lp, hc_layer=k)
        fn = ((lambda x: attn_fn(lp["attn"], x, row, k)) if extra is None else
              (lambda x: attn_fn(lp["attn"], x, row, k, extra)))
        h, pre, rec, out = block(lp, h, pre, plan, cfg, dt, top_k, fn, None, par=par, defer=defer)
        if extra is not None:
            out, extra = out
        return (h, pre, k + 1, extra), (rec, out)

    # a deferred exit in (`block`) stays deferred through the run (one fixed carry); streams in stay streams

    defer = isinstance(h, tuple)
    (h, pre, _, carry), (recs, outs) = jax.lax.scan(body, (h, pre, jnp.int32(0), carry), (rest, xs), length=n)
    for k in range(n):
        aux = record(aux, first + k, jax.tree_util.tree_map(lambda a, k=k: a[k], recs))
    return (h, pre, aux, outs) if carry is None else (h, pre, aux, outs, carry)


def final_logits(params, h, pre, cfg, dt):
    """x = hc_pre(h, last ffn pre) → norm → head → fp32 logits. Returns (logits, normed x)."""
    x = rmsnorm(hc_pre(h, pre, dt), params["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return linear.f32(x, params["head"]["weight"], cfg, row_axis="vocab"), x


def new_aux():
    """The empty aux record of a forward / step: {"topk", "cand", "experts", "layer_inputs"}, each
    {layer id: array}."""
    return {"topk": {}, "cand": {}, "experts": {}, "layer_inputs": {}}


def record(aux, lid, *recs):
    """`aux` with layer `lid`'s records added (each rec {kind: array}, kinds as in `new_aux`): a new
    dict, `aux` itself is not modified (the forward and the step are traced as pure functions)."""
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
                def attn_run(p, x, _row, _k, plan=plan, ctx=ctx):
                    y, ctx_out, rec = attention_full(p, x, positions, plan, ctx, cfg, dt)
                    if ctx_out is not ctx or rec:
                        raise RuntimeError(f"layer {plan.layer_id}: a scanned run's layers must not store anything")
                    return y, {}

                h, pre, aux, _ = scan_blocks(layer_scan.run_params(params, i, n, cfg), h, pre, plan, cfg, dt, aux,
                                             i, cfg.num_experts_per_tok, attn_run, par=par)
                continue
            lp = layer_scan.layer_params(params, i, cfg)
            rows = (hash_rows(cfg, i, params["derived"]["engram_token_map"], tokens) if plan.is_engram else None)

            def attn_fn(x, lp=lp, plan=plan, ctx=ctx):
                y, ctx_out, rec = attention_full(lp["attn"], x, positions, plan, ctx, cfg, dt)
                return y, (ctx_out, rec)

            h, pre, rec, (ctx, arec) = block(lp, h, pre, plan, cfg, dt, cfg.num_experts_per_tok, attn_fn, rows,
                                             par=par, defer=True)
            aux = record(aux, i, rec, arec)
        logits, x = final_logits(params, settle(h, cfg, dt, par), pre, cfg, dt)
        if return_aux:
            return logits, dict(aux, hidden=x)
        return logits
