"""V4's MoE sublayer (docs/design/v4.md, "Hash routing"): the shared gate, experts and shared expert, with
the index source of the routing as the variant.

Layers in ``hash_layer_ids`` take their experts from the checkpoint's table, ``ffn.gate.tid2eid`` [vocab, k]
indexed by the token id (`moe.route` with ``idx``); the other layers route by the top-k of the scores + bias
(`moe.route`). The weights are the gate's sqrt(softplus) scores in both. Routed experts: the reference
(`routed_reference`: every expert on every token, routing weight 0 for the unselected, summed in ascending
expert id in fp32, as `moe`'s reference) or, for MXFP4 experts with the "xla" moe implementation, V4.1's
grouped path (`moe.routed_slots` + `moe.combine_slots`). The SwiGLU with its clamps is `moe.swiglu_expert`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model import moe as moe41
from dsv41_jax.model.v4.linear import dense, expert, is_mxfp4


def routed_reference(ex, xf, idx, w, cfg, dt):
    """fp32 [N, D]: every expert on every token, weighted (0 where unselected), summed in ascending expert id.
    ex: stacked experts {"w1", "w3", "w2"} (plain [E, out, in] or MXFP4)."""
    N, D = xf.shape
    E = jax.tree_util.tree_leaves(ex["w1"])[0].shape[0]
    # .add, not .set: a hash table row may name one expert twice (its weight then counts twice, as in
    # transformers' gather of the scores)
    dense_w = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], idx].add(w)
    lin = functools.partial(expert, cfg=cfg, dt=dt)

    def body(acc, e):
        pe = jax.tree_util.tree_map(lambda t: t[e], ex)
        y = moe41.swiglu_expert(xf, pe["w1"], pe["w3"], pe["w2"], dense_w[:, e], cfg.swiglu_limit, dt, lin)
        return acc + y.astype(jnp.float32), None

    routed, _ = jax.lax.scan(body, jnp.zeros((N, D), jnp.float32), jnp.arange(E))
    return routed


def routed(ex, xf, idx, w, cfg, dt):
    """fp32 [N, D]: the routed experts' sum by the moe implementation ("reference"; "xla": V4.1's grouped
    path for MXFP4 experts, the reference for plain ones and in the release numerics, whose activation blocks V4.1's
    grouped GEMM does not take). Pallas: refused (no V4 kernel wiring yet)."""
    impl = dispatch.resolve(cfg, "moe")
    if dispatch.is_kernel(impl):
        raise NotImplementedError(f"DeepSeek-V4: moe={impl!r} has no V4 wiring yet; use 'moe=xla' or 'reference'")
    if impl == "xla" and is_mxfp4(ex["w1"]) and xf.shape[0] and not cfg.act_quant_block:  # V4.1's 32-wide blocks
        return moe41.combine_slots(moe41.routed_slots(ex, xf, idx, w, cfg, dt), idx)
    return routed_reference(ex, xf, idx, w, cfg, dt)


def shared_expert(sh, xf, cfg, dt):
    """The shared expert: `moe.swiglu_expert` with weight 1 on V4's dense weights -> [N, D] in `dt`."""
    lin = functools.partial(dense, cfg=cfg, dt=dt)
    return moe41.swiglu_expert(xf, sh["w1"], sh["w3"], sh["w2"], None, cfg.swiglu_limit, dt, lin)


def moe(p, x, token_ids, hashed: bool, cfg, dt):
    """x [..., D] (the normed ffn input), token_ids int32 [...] (the tokens at those positions: the hash
    table's index) -> (y [..., D] in `dt`, (idx int32 [..., k], w fp32 [..., k]))."""
    shape = x.shape
    k = cfg.num_experts_per_tok
    xf = x.reshape(-1, shape[-1])
    idx = p["gate"]["tid2eid"][token_ids.reshape(-1)].astype(jnp.int32) if hashed else None
    idx, w, _ = moe41.route(p["gate"], xf, k, cfg, idx=idx)
    y = routed(p["experts"], xf, idx, w, cfg, dt) + shared_expert(p["shared_experts"], xf, cfg, dt).astype(jnp.float32)
    return y.astype(dt).reshape(shape), (idx.reshape(shape[:-1] + (k,)), w.reshape(shape[:-1] + (k,)))
