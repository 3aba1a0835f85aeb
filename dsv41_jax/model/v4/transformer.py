"""The V4 reference forward: tokens [B, T] from position 0 -> fp32 logits [B, T, vocab] (docs/design/v4.md).

Per layer L (kind `config_v4.attention_kinds`[L]; V4's pre-mix ordering, `v4.mhc`):
  x, post, comb = enter(h, "attn");  h = hc_post(attn(x), h, post, comb)
  x, post, comb = enter(h, "ffn");   h = hc_post(moe(x, tokens), h, post, comb)
then x = norm(hc_head(h)), logits = head · x. Plain jnp, jittable with static cfg; layers unrolled.

The numerics modes are V4.1's (`numerics`): "float32" / "exact" with a plain (unquantized) checkpoint is
transformers' `DeepseekV4ForCausalLM` arithmetic (tests/test_v4_transformers.py). Pallas kernels: the moe
op's (`v4.moe.routed`), the mhc op's (`v4.mhc`) and the indexer's (`v4.attention.index_select`; the attention
kernel runs in the paged step, `v4.decode`, as V4.1's: the forward attends with `attention.attend`) and, in the
release numerics, the linear op's (`v4.linear`: the fp8 / MXFP4 GEMMs with V4's blocks); the engram kernel, the
linear kernel outside the release numerics and whatever else does not fit are refused with NotImplementedError
(`kernel_refusal`), and so is this forward on a data-parallel mesh (only the paged step runs there, per rank).

On a tp x ep mesh (``par``, `parallel.plan.MeshPlan`; params placed by `parallel.rules.shard_params`, docs/design/
v4.md "Mesh"): the embedding rows are gathered where they live (`par.embed_gather`), the routed experts run
expert-parallel (`v4.moe.routed`), and every sublayer output and the streams are pinned replicated (as V4.1's
`transformer.replicated`: the norms' and mHC's sums over D then run as unsharded); the rest (heads over tp, the
shared expert, the vocabulary) is partitioned by XLA from the parameter shardings.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import dispatch, linear, tiling
from dsv41_jax.model.config_v4 import attention_kinds
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.transformer import embed_streams, new_aux, record, replicated
from dsv41_jax.model.v4 import mhc as mhc4
from dsv41_jax.model.v4.attention import attention_full
from dsv41_jax.model.v4.attention import kernel_refusal as kernel_refusal_attention
from dsv41_jax.model.v4.linear import kernel_refusal as kernel_refusal_linear
from dsv41_jax.model.v4.moe import kernel_refusal as kernel_refusal_moe
from dsv41_jax.model.v4.moe import moe
from dsv41_jax.model.v4.torch_order import norm_fn


def layer_ratio(cfg, kind: str) -> int:
    return {"sliding": 0, "csa": cfg.csa_compress_ratio, "hca": cfg.hca_compress_ratio}[kind]


def refuse_unsupported(cfg, par=None) -> None:
    """NotImplementedError for what the V4 forward does not run: redundant experts on a mesh, an explicit Pallas
    implementation of an op whose kernel does not fit V4 (`kernel_refusal`: engram's, linear's outside the release
    numerics or on a mesh, and those where V4's experts / numerics / widths do not fit), and on a data-parallel mesh anything but a dp rank's program
    (`par.in_rank`: the paged step as `v4.decode.jitted_extend` runs it; the full-sequence forward and the MTP /
    DSpark draft steps are not run per rank)."""
    if par is not None and par.expert_location is not None:
        raise NotImplementedError("DeepSeek-V4 on a mesh: no redundant experts (no V4 expert placement)")
    if par is not None and par.axis_size("dp") > 1 and not par.in_rank:
        raise NotImplementedError("DeepSeek-V4 on a data-parallel mesh: only the paged step, as one program per dp rank "
                                  "(`v4.decode.jitted_extend`); the forward and the MTP / DSpark draft steps are not "
                                  "run per rank")
    for op, impl in dispatch.parse_impl(cfg.impl).items():
        why = kernel_refusal(cfg, op, impl, par)
        if why is not None:
            raise NotImplementedError(f"DeepSeek-V4: {why}")


def kernel_refusal(cfg, op: str, impl: str, par=None):
    """Why V4 cannot run op `op` with the explicit implementation `impl` (one line naming the op and what does not
    fit), or None: the jnp implementations always run; of the Pallas kernels V4 runs the moe op's (V4.1's grouped
    MXFP4 experts, `v4.moe.kernel_refusal`), the mhc op's (V4.1's mixes / Sinkhorn and exit kernels,
    `v4.mhc.kernel_refusal`), the attention and indexer ops' (V4.1's sparse-attention and index kernels on V4's
    ring, pools and picks as they are, `v4.attention.kernel_refusal`) and, in the release numerics on one device, the
    linear op's (V4.1's quantized-linear kernel with V4's blocks declared, `v4.linear.kernel_refusal`; par: the mesh
    plan); the engram kernel does not fit V4 (docs/design/v4.md, "Kernels")."""
    if not dispatch.is_kernel(impl):
        return None
    if op == "moe":
        return kernel_refusal_moe(cfg, impl)
    if op == "mhc":
        return mhc4.kernel_refusal(cfg, impl)
    if op in ("attention", "indexer"):
        return kernel_refusal_attention(cfg, op, impl)
    if op == "linear":
        return kernel_refusal_linear(cfg, impl, par)
    return {"engram": f"engram={impl}: DeepSeek-V4 has no Engram layers"}[op]


def final_logits(params, h, cfg, dt, head=None):
    """hc_head collapse -> norm -> head -> fp32 logits. Returns (logits [.., vocab], normed x [.., D]).
    head: the params holding ``hc_head_*`` and ``norm`` (default the target's; an MTP layer passes its own) — the
    vocab projection is always the target's ``head``."""
    hp = params if head is None else head
    x = mhc4.head_collapse(h, hp["hc_head_fn"], hp["hc_head_base"], hp["hc_head_scale"], cfg, dt)
    x = norm_fn(cfg)(x, hp["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return linear.f32(x, params["head"]["weight"], cfg, row_axis="vocab"), x


def sublayer_exit(y, h, post, comb, cfg, dt, par=None):
    """`v4.mhc.leave` of a sublayer's output y [.., D] into the streams h [.., n, D], both pinned replicated on a
    mesh (module doc)."""
    return replicated(mhc4.leave(replicated(y, par), h, post, comb, cfg, dt), par)


def layer_forward(lp, h, tokens, positions, kind: str, hashed: bool, cfg, dt, par=None):
    """One V4 layer over a sequence from position 0 (a target layer, or an MTP layer on its own input streams):
    h [B, T, n, D] -> (h' [B, T, n, D], rec {"layer_inputs", "experts"}, attention rec {"topk"} at CSA)."""
    rec = {"layer_inputs": h}
    x, post, comb = mhc4.enter(h, lp, "attn", cfg, dt)
    y, arec = attention_full(lp["attn"], x, positions, kind, layer_ratio(cfg, kind), cfg, dt)
    h = sublayer_exit(y, h, post, comb, cfg, dt, par)
    x, post, comb = mhc4.enter(h, lp, "ffn", cfg, dt)
    y, (rec["experts"], _) = moe(lp["ffn"], x, tokens, hashed, cfg, dt, par)
    return sublayer_exit(y, h, post, comb, cfg, dt, par), rec, arec


def forward(params, tokens, cfg, return_aux: bool = False, par=None):
    """Reference forward of a V4 target model (`transformer.forward`'s contract: logits fp32 [B, T, vocab];
    with `return_aux` also {"topk": {CSA layer: int32 [B, T, k']}, "experts": {layer: int32 [B, T, top_k]},
    "layer_inputs": {layer: streams [B, T, n, D]}, "cand": {}, "hidden": [B, T, D], "streams": the last layer's
    output streams [B, T, n, D], before hc_head (what the MTP layer reads)})."""
    refuse_unsupported(cfg, par)
    dt = act_dtype(cfg)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    with tiling.on_mesh(par):  # the head's CPU row tiles follow its vocabulary split (model.tiling)
        h = embed_streams(params, tokens, cfg, dt, par)
        aux = new_aux()
        for i, kind in enumerate(attention_kinds(cfg)):
            h, rec, arec = layer_forward(params["layers"][i], h, tokens, positions, kind, i in cfg.hash_layer_ids, cfg,
                                         dt, par)
            aux = record(aux, i, rec, arec)
        logits, x = final_logits(params, h, cfg, dt)
    return (logits, dict(aux, hidden=x, streams=h)) if return_aux else logits
