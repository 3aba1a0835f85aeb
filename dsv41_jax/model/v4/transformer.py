"""The V4 reference forward: tokens [B, T] from position 0 -> fp32 logits [B, T, vocab] (docs/design/v4.md).

Per layer L (kind `config_v4.attention_kinds`[L]; V4's pre-mix ordering, `v4.mhc`):
  x, post, comb = enter(h, "attn");  h = hc_post(attn(x), h, post, comb)
  x, post, comb = enter(h, "ffn");   h = hc_post(moe(x, tokens), h, post, comb)
then x = norm(hc_head(h)), logits = head · x. Plain jnp, jittable with static cfg; layers unrolled.

The numerics modes are V4.1's (`numerics`): "float32" / "exact" with a plain (unquantized) checkpoint is
transformers' `DeepseekV4ForCausalLM` arithmetic (tests/test_v4_transformers.py). Not here: a mesh plan
(V4's mesh rules), Pallas kernels — both refused with NotImplementedError.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import dispatch, linear
from dsv41_jax.model.config_v4 import attention_kinds
from dsv41_jax.model.mhc import hc_post
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.transformer import embed_streams, new_aux, record
from dsv41_jax.model.v4 import mhc as mhc4
from dsv41_jax.model.v4.attention import attention_full
from dsv41_jax.model.v4.moe import moe


def layer_ratio(cfg, kind: str) -> int:
    return {"sliding": 0, "csa": cfg.csa_compress_ratio, "hca": cfg.hca_compress_ratio}[kind]


def refuse_unsupported(cfg, par=None) -> None:
    """NotImplementedError for what the V4 forward does not run: a mesh, an explicit Pallas implementation."""
    if par is not None and par.size > 1:
        raise NotImplementedError("DeepSeek-V4: no mesh rules yet (tp / ep); run it on one device")
    explicit = {op: impl for op, impl in dispatch.parse_impl(cfg.impl).items() if dispatch.is_kernel(impl)}
    if explicit:
        raise NotImplementedError(f"DeepSeek-V4 runs the jnp paths only (no V4 kernel wiring yet); impl asks for "
                                  f"{explicit}")


def final_logits(params, h, cfg, dt):
    """hc_head collapse -> norm -> head -> fp32 logits. Returns (logits [.., vocab], normed x [.., D])."""
    x = mhc4.head_collapse(h, params["hc_head_fn"], params["hc_head_base"], params["hc_head_scale"], cfg, dt)
    x = rmsnorm(x, params["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return linear.f32(x, params["head"]["weight"], cfg), x


def forward(params, tokens, cfg, return_aux: bool = False, par=None):
    """Reference forward of a V4 target model (`transformer.forward`'s contract: logits fp32 [B, T, vocab];
    with `return_aux` also {"topk": {CSA layer: int32 [B, T, k']}, "experts": {layer: int32 [B, T, top_k]},
    "layer_inputs": {layer: streams [B, T, n, D]}, "cand": {}, "hidden": [B, T, D]})."""
    refuse_unsupported(cfg, par)
    dt = act_dtype(cfg)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h = embed_streams(params, tokens, cfg, dt)
    aux = new_aux()
    for i, kind in enumerate(attention_kinds(cfg)):
        lp = params["layers"][i]
        rec = {"layer_inputs": h}
        x, post, comb = mhc4.enter(h, lp, "attn", cfg, dt)
        y, arec = attention_full(lp["attn"], x, positions, kind, layer_ratio(cfg, kind), cfg, dt)
        h = hc_post(y, h, post, comb, dt)
        x, post, comb = mhc4.enter(h, lp, "ffn", cfg, dt)
        y, (rec["experts"], _) = moe(lp["ffn"], x, tokens, i in cfg.hash_layer_ids, cfg, dt)
        h = hc_post(y, h, post, comb, dt)
        aux = record(aux, i, rec, arec)
    logits, x = final_logits(params, h, cfg, dt)
    return (logits, dict(aux, hidden=x)) if return_aux else logits
