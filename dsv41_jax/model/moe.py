"""Mixture of experts: sqrtsoftplus gate, top-k, clamped SwiGLU experts, shared expert (SPEC §6).

This is the reference: every routed expert runs on every token, multiplied by a routing weight that
is exactly 0 for unselected experts (so they add exact zeros and the sum keeps ascending-expert-id
order). It is O(E) compute — fine for tiny configs and as the ground truth for grouped kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import quant
from dsv41_jax.model.numerics import linear_f32


def softplus_torch(x):
    """torch's softplus (beta 1, threshold 20): x for x > 20, else log1p(exp(x))."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def route(p_gate, x, top_k: int, cfg):
    """Gate: x [N, D] -> (idx int32 [N, k], weights fp32 [N, k], scores fp32 [N, E]).

    s = sqrt(softplus(x·Wᵀ / gate_temp)) in fp32; the bias ranks but does not weight; ties go to the
    lower expert id; weights = s[idx] / (Σ + 1e-20) · routed_scaling_factor (normalized only when
    norm_topk_prob and k > 1).
    """
    logits = linear_f32(x, p_gate["weight"]) / cfg.gate_temp
    s = jnp.sqrt(softplus_torch(logits))
    _, idx = jax.lax.top_k(s + p_gate["bias"].astype(jnp.float32), top_k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor, s


def swiglu_expert(x, w1, w3, w2, weight, limit, dt, linear):
    """One SwiGLU expert with clamps. x [N, K]; weight fp32 [N] (routing weight, applied before w2).

    g = w1·x, u = w3·x (outputs rounded to `dt`, widened to fp32); u ∈ [−limit, limit]; g ≤ limit;
    a = silu(g)·u·weight (fp32) → `dt` → w2 (fp8-quantized input) → `dt`.
    """
    g = linear(x, *w1).astype(jnp.float32)
    u = linear(x, *w3).astype(jnp.float32)
    u = jnp.clip(u, -limit, limit)
    g = jnp.minimum(g, limit)
    a = (jax.nn.silu(g) * u * weight[:, None]).astype(dt)
    return linear(a, *w2)


def moe(p, x, top_k: int, cfg, dt, *, return_routing=False):
    """x [..., D] (normed ffn input) -> [..., D] in `dt` (and the routing, if asked)."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    idx, w, _ = route(p["gate"], xf, top_k, cfg)
    E = p["gate"]["weight"].shape[0]
    N = xf.shape[0]
    dense_w = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], idx].set(w)
    ex = p["experts"]
    lim = cfg.swiglu_limit

    def mx(a, wt, sc):
        return quant.mxfp4_linear(a, wt, sc, out_dtype=dt)

    def body(acc, e):
        pe = jax.tree_util.tree_map(lambda t: t[e], ex)
        y = swiglu_expert(xf, (pe["w1"]["weight"], pe["w1"]["scale"]), (pe["w3"]["weight"], pe["w3"]["scale"]),
                          (pe["w2"]["weight"], pe["w2"]["scale"]), dense_w[:, e], lim, dt, mx)
        return acc + y.astype(jnp.float32), None

    # Sequential scan: the fp32 sum runs in ascending expert id, as the spec requires.
    routed, _ = jax.lax.scan(body, jnp.zeros((N, shape[-1]), jnp.float32), jnp.arange(E))
    sh = p["shared_experts"]

    def fp8(a, wt, sc):
        return quant.fp8_linear(a, wt, sc, out_dtype=dt)

    shared = swiglu_expert(xf, (sh["w1"]["weight"], sh["w1"]["scale"]), (sh["w3"]["weight"], sh["w3"]["scale"]),
                           (sh["w2"]["weight"], sh["w2"]["scale"]), jnp.ones((N,), jnp.float32), lim, dt, fp8)
    out = (routed + shared.astype(jnp.float32)).astype(dt).reshape(shape)
    if return_routing:
        return out, (idx.reshape(shape[:-1] + (top_k,)), w.reshape(shape[:-1] + (top_k,)))
    return out
