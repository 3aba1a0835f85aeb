"""Pallas kernel: the MoE router's top-k, from the gate's logits to the experts and weights, in one launch.

What `moe.route` computes after the gate matmul (the reference, `ref_route`, is `moe.route` itself):

    s   = sqrt(softplus(logits / gate_temp))          # fp32, torch's softplus (x > 20: x)
    idx = top_k(s + bias, k)                          # descending; ties to the lower expert id
    w   = s[idx] / (Σ s[idx] + 1e-20) · routed_scaling_factor   (normalized when norm_topk_prob and k > 1)

On XLA:GPU that is three launches per MoE layer (the scores, the sort that top_k becomes, and the slot
metadata the MoE kernel's one-token path computes from the result); here one program per 16 tokens holds
their rows of E scores (padded to a power of two with −inf) and selects k times: the max, the first lane
that holds it (the lower id on ties, as top_k), its weight by a masked lane sum (exact), then that lane
set to −inf. The weights are summed left to right in selection order, as the reference's k-element sum
(XLA may order a reduction differently on a GPU: within fp32 reassociation there).

Lowering: Pallas Triton (`common.triton_params`); whole-array refs, token rows clamped on load and masked
on store; no register slicing (each selected id / weight goes to its output lane by a masked write).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import dispatch
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common, costs

NAME = "moe_route"
TOKEN_BLOCK = 16


def ref_route(logits, bias, top_k: int, cfg):
    """The oracle: `moe.route`'s selection from the gate's raw logits fp32 [N, E] (its matmul done):
    (idx int32 [N, k], weights fp32 [N, k])."""
    from dsv41_jax.model.moe import softplus_torch

    s = jnp.sqrt(softplus_torch(logits / cfg.gate_temp))
    _, idx = lax.top_k(s + bias.astype(jnp.float32), top_k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` routes `cfg`: the fp32 numerics (the moe op's kernels), top-k of at most every expert."""
    return not is_exact(cfg) and 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts


def _kernel(lay_ref, lg_ref, b_ref, idx_ref, w_ref, ord_ref, *, c):
    bm, E, Ep, k, kp, N = c["bm"], c["E"], c["Ep"], c["k"], c["kp"], c["N"]
    r0 = pl.program_id(0) * bm
    rows = jnp.minimum(r0 + lax.iota(jnp.int32, bm), N - 1)
    lane = lax.iota(jnp.int32, Ep)
    real = lane < E
    col = jnp.minimum(lane, E - 1)
    x = lg_ref[rows[:, None], col[None, :]] / c["temp"]
    # moe.softplus_torch: x for x > 20, else log1p(exp(min(x, 20)))
    s = jnp.sqrt(jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0)))))
    v = jnp.where(real[None, :], s + b_ref[lay_ref[0] * E + col].astype(jnp.float32)[None, :], -jnp.inf)
    out_lane = lax.iota(jnp.int32, kp)
    ids = jnp.zeros((bm, kp), jnp.int32)
    ws = jnp.zeros((bm, kp), jnp.float32)
    total = None
    picks = []
    for r in range(k):
        m = jnp.max(v, axis=1)
        pick = jnp.min(jnp.where(v == m[:, None], lane[None, :], Ep), axis=1)  # the first lane holding the max
        hit = lane[None, :] == pick[:, None]
        wr = jnp.sum(jnp.where(hit, s, 0.0), axis=1)  # exact: one nonzero term
        ids = jnp.where(out_lane[None, :] == r, pick[:, None], ids)
        ws = jnp.where(out_lane[None, :] == r, wr[:, None], ws)
        total = wr if total is None else total + wr
        v = jnp.where(hit, -jnp.inf, v)
        picks.append(pick)
    # the slots in ascending expert id (the combine's order, `moe.combine_slots`): slot r's rank is the number of
    # smaller ids among the k (distinct), position q takes the slot ranked q
    ranks = [sum((picks[j] < picks[r]).astype(jnp.int32) for j in range(k)) for r in range(k)]
    order = jnp.zeros((bm, kp), jnp.int32)
    for q in range(k):
        slot_q = sum(jnp.where(ranks[r] == q, r, 0) for r in range(k))
        order = jnp.where(out_lane[None, :] == q, slot_q[:, None], order)
    if c["normalize"]:
        ws = ws / (total[:, None] + 1e-20)
    ws = ws * c["scale"]
    live = (r0 + lax.iota(jnp.int32, bm) < N)[:, None]
    pltriton.store(idx_ref.at[pl.ds(r0, bm), :], ids, mask=live)
    pltriton.store(w_ref.at[pl.ds(r0, bm), :], ws, mask=live)
    pltriton.store(ord_ref.at[pl.ds(r0, bm), :], order, mask=live)


def kernel(logits, bias, top_k: int, cfg, *, layer=None, interpret: bool = False):
    """`ref_route` in one launch: logits fp32 [N, E] (the gate matmul's output), bias [E] -> (idx int32 [N, kp],
    weights fp32 [N, kp], order int32 [N, kp]) with kp = k rounded up to a power of two (≥ 2): the first k lanes
    are the selection, and `order` the slots in ascending expert id (`moe.combine_slots`' order: the
    `argsort` of idx's first k lanes); the lanes past k hold 0 (a block is stored whole: a narrower output would need a masked
    store with repeated indices, and a slice of the kernel's output before another kernel would be a copy).
    With `layer` (int32 scalar), bias is a layer-scan run's stack [n, E] read at that layer (in place)."""
    N, E = logits.shape
    k = int(top_k)
    if bias.shape != ((E,) if layer is None else (bias.shape[0], E)):
        raise ValueError(f"moe_route: bias {bias.shape} for {E} experts" + ("" if layer is None else " (stacked)"))
    if not 1 <= k <= E:
        raise ValueError(f"moe_route: top_k {k} of {E} experts")
    bm, Ep, kp = TOKEN_BLOCK, common.next_pow2(E), max(2, common.next_pow2(k))
    if N == 0:
        return jnp.zeros((0, kp), jnp.int32), jnp.zeros((0, kp), jnp.float32), jnp.zeros((0, kp), jnp.int32)
    common.log_choice(NAME, interpret, token_block=bm, experts=E, top_k=k)
    c = dict(bm=bm, E=E, Ep=Ep, k=k, kp=kp, N=N, temp=float(cfg.gate_temp), scale=float(cfg.routed_scaling_factor),
             normalize=bool(cfg.norm_topk_prob and k > 1))

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, nd=a.ndim: (0,) * nd)

    outs = [jax.ShapeDtypeStruct((N, kp), jnp.int32), jax.ShapeDtypeStruct((N, kp), jnp.float32),
            jax.ShapeDtypeStruct((N, kp), jnp.int32)]
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    ins = [lay, logits.astype(jnp.float32), bias.astype(jnp.float32).reshape(-1)]
    return tuple(pl.pallas_call(
        functools.partial(_kernel, c=c), grid=(pl.cdiv(N, bm),), in_specs=[whole(a) for a in ins],
        out_specs=[whole(o) for o in outs], out_shape=outs, interpret=interpret,
        compiler_params=common.triton_params(num_warps=8, num_stages=1), name=NAME,  # 8: no spill of [16, 512] tiles
        cost_estimate=pl.CostEstimate(flops=(4 + 3 * k) * N * E, transcendentals=3 * N * E,
                                      bytes_accessed=costs.route_bytes_moved(N=N, E=E, kp=kp)))(*ins))


dispatch.register("moe", "route", kernel=kernel, reference=ref_route, supports=supports)
