"""The MTP draft of the original DeepSeek-V4 Flash / Pro (``draft_kind`` "mtp"; docs/design/v4.md "MTP").

V4.1's draft is DSpark (`model.dspark`: a block proposal from target features); the original V4 releases ship one
MTP layer ``mtp.0`` instead (``num_nextn_predict_layers`` 1), DeepSeek-V3's multi-token prediction on V4's layer:

  row p (at position p) reads the target's last-layer output streams h_p [n, D] (before ``hc_head``) and the
  token t_{p+1};  e = enorm(embed(t_{p+1})),  x = e_proj(e) (broadcast over the n streams) + h_proj(hnorm(h_p)),
  x' = one V4 layer on x (its own attention kind from ``compress_ratios[L]``, its own window cache, learned
  routing),  logits = head(norm(hc_head_mtp(x'))) — its own ``hc_head_*`` and ``norm``, the target's embedding
  and vocab projection. The logits at row p propose t_{p+2}.

The layer itself is V4's (`v4.transformer.layer_forward` / `v4.decode.layer_step`), and so is the head collapse
(`v4.transformer.final_logits` with ``head=``); this module adds only the input mixing and the draft's cache.
Chained proposals (more than one draft token per step) feed the layer's own output streams back as h, as SGLang's
EAGLE does for DeepSeek's MTP. `v4.speculative` drafts with it and verifies with `v4.decode.extend`.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import tiling
from dsv41_jax.model.config_v4 import draft_kinds
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.transformer import embed_streams, new_aux, record
from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4.linear import dense
from dsv41_jax.model.v4.torch_order import norm_fn
from dsv41_jax.model.v4.transformer import final_logits, layer_forward, refuse_unsupported


def require(params, cfg) -> None:
    """ValueError / NotImplementedError unless `params` hold exactly one MTP layer of an MTP config."""
    if cfg.draft_kind != "mtp":
        raise NotImplementedError(f"DeepSeek-V4 draft_kind {cfg.draft_kind!r}: this checkpoint's draft is the DSpark "
                                  "head of Flash-0731 / Pro-0813 (`v4.dspark`), not an MTP layer")
    if not params.get("mtp"):
        raise ValueError("MTP: these parameters have no MTP layer (num_nextn_predict_layers = 0, or a checkpoint "
                         "without mtp.* tensors)")
    if len(params["mtp"]) != 1:
        raise NotImplementedError(f"MTP: {len(params['mtp'])} MTP layers; the released V4 checkpoints have one, "
                                  "and only one is implemented")


def draft_input(params, p, h, next_tokens, cfg, dt, par=None):
    """The MTP layer's input streams [B, T, n, D] in `dt`: e_proj(enorm(embed(next_tokens))) [.., None, :] +
    h_proj(hnorm(h)); h [B, T, n, D] the target's output streams, next_tokens int32 [B, T]. par: a mesh plan
    (the embedding's rows split over tp: `transformer.embed_streams`' gather, one stream of it)."""
    ex = is_exact(cfg)
    e = embed_streams(params, next_tokens, cfg, dt, par)[..., 0, :]
    e = norm_fn(cfg)(e, p["enorm"]["weight"], cfg.rms_norm_eps, dt, ex)
    s = norm_fn(cfg)(h.astype(dt), p["hnorm"]["weight"], cfg.rms_norm_eps, dt, ex)
    return (dense(e, p["e_proj"], cfg, dt)[..., None, :] + dense(s, p["h_proj"], cfg, dt)).astype(dt)


def forward(params, h, next_tokens, cfg, return_aux: bool = False, par=None):
    """Reference MTP pass over a sequence from position 0: h [B, T, n, D] the target's output streams (its
    forward's aux "streams"), next_tokens int32 [B, T] (t_{p+1} at row p). Returns logits fp32 [B, T, vocab]
    (row p proposes t_{p+2}) and with `return_aux` {"experts", "topk", "layer_inputs"} of the layer (key 0),
    "streams" (its output streams [B, T, n, D]). par: a tp x ep mesh plan (`v4.transformer` module doc)."""
    refuse_unsupported(cfg, par)
    require(params, cfg)
    dt = act_dtype(cfg)
    next_tokens = jnp.asarray(next_tokens, jnp.int32)
    B, T = next_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    p = params["mtp"][0]
    with tiling.on_mesh(par):
        x = draft_input(params, p, h, next_tokens, cfg, dt, par)
        x, rec, arec = layer_forward(p, x, next_tokens, positions, draft_kinds(cfg)[0], False, cfg, dt, par)
        logits, _ = final_logits(params, x, cfg, dt, head=p)
    return (logits, dict(record(new_aux(), 0, rec, arec), streams=x)) if return_aux else logits


def init_state(cfg, ccfg) -> dict:
    """The MTP layer's zeroed cache, shaped like one `v4.decode.init_state` layer: {"window": [ring],
    "comp": {"0": compressor state} (a CSA / HCA draft layer only)}."""
    dec4._check(cfg, ccfg)
    kind = draft_kinds(cfg)[0]
    return {"window": [dec4.window_state(cfg, ccfg)],
            "comp": {} if kind == "sliding" else {"0": dec4.comp_state(kind, cfg, ccfg)}}


def extend(params, state, h, batch, cfg, ccfg, head: bool = True, par=None):
    """The MTP layer on its cache: batch as `v4.decode.extend`'s with ``tokens`` the next tokens (t_{p+1} at
    position p), h [B, T, n, D] the streams of those rows (the target's, or the layer's own when chaining).
    Returns (logits fp32 [B, T, vocab], state', output streams [B, T, n, D]); head=False: logits None (a
    catch-up pass whose proposals nobody reads). Jittable with static cfg / ccfg / head / par (a tp x ep mesh plan:
    its cache replicated, as the target's, `v4.decode`)."""
    refuse_unsupported(cfg, par)
    require(params, cfg)
    dec4._check(cfg, ccfg)
    dt = act_dtype(cfg)
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    T = tokens.shape[1]
    positions = batch["start"][:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.arange(T)[None, :] < batch["n_new"][:, None]
    p = params["mtp"][0]
    with tiling.on_mesh(par):
        x = draft_input(params, p, h, tokens, cfg, dt, par)
        x, win, comp, _ = dec4.layer_step(p, x, tokens, state["window"][0], state["comp"].get("0"), batch, positions,
                                          valid, draft_kinds(cfg)[0], False, cfg, ccfg, dt, par)
        logits = final_logits(params, x, cfg, dt, head=p)[0] if head else None
    return logits, {"window": [win], "comp": {} if comp is None else {"0": comp}}, x
