"""V4's MoE sublayer (docs/design/v4.md, "Hash routing"): the shared gate, experts and shared expert, with
the index source of the routing as the variant.

Layers in ``hash_layer_ids`` take their experts from the checkpoint's table, ``ffn.gate.tid2eid`` [vocab, k]
indexed by the token id (`moe.route` with ``idx``); the other layers route by the top-k of the scores + bias
(`moe.route`). The weights are the gate's sqrt(softplus) scores in both. Routed experts: the reference
(`routed_reference`: every expert on every token, routing weight 0 for the unselected, summed in ascending
expert id in fp32, as `moe`'s reference) or, for MXFP4 experts with the "xla" moe implementation, V4.1's
grouped path (`moe.routed_slots` + `moe.combine_slots`), or with a Pallas moe implementation V4.1's grouped MXFP4
kernel (`pallas.moe_mxfp4`, the registry's ("moe", "kernel")) in place of `moe.routed_slots`. The SwiGLU with its clamps is `moe.swiglu_expert`.
On a mesh with the experts split over ep, either runs per expert shard in V4.1's expert-parallel MoE (`routed`); on
a data-parallel mesh each rank's tokens are dispatched to their experts on all devices (`parallel.moe_dispatch`),
the hash-routed layers' expert ids read from the table on the rank's own token ids before the dispatch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model import moe as moe41
from dsv41_jax.model.numerics import is_exact, mode_name
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


def first_slots(idx):
    """bool [N, k]: whether slot j is the first of row n naming expert idx[n, j] (a hash-table row may repeat one)."""
    first = jnp.ones(idx.shape, bool)
    for j in range(1, idx.shape[1]):
        first = first.at[:, j].set(jnp.all(idx[:, :j] != idx[:, j:j + 1], axis=1))
    return first


def fold_repeats(idx, w):
    """fp32 [N, k]: the routing weights with each repeated expert's weights summed (in slot order, from zero, as the
    reference's scatter-add) into its first slot and 0 in its later ones. What the reference computes once per
    distinct expert, as per-assignment rows: with tokens dispatched to their experts (`parallel.moe_dispatch`) each
    (token, slot) row reaches its expert alone, so `reference_slots` there cannot see a row's other slots; the later
    slot's expert output is then exact zeros (weight 0 before w2), which the combine adds without changing a bit."""
    k = idx.shape[1]
    same = idx[:, :, None] == idx[:, None, :]  # [N, k, k]
    tot = jnp.zeros(w.shape, jnp.float32)
    for j in range(k):
        tot = tot + jnp.where(same[:, :, j], w[:, j:j + 1], 0.0)
    return jnp.where(first_slots(idx), tot, 0.0)


def reference_slots(ex, xf, idx, w, cfg, dt, first_expert=0):
    """`routed_reference` per assignment, for expert parallelism: fp32 [N, k, D] where slot (n, j) holds expert
    idx[n, j]'s output for token n if that expert is among the held ``first_expert .. first_expert + E_l − 1``
    (computed on every token as the reference does, with the reference's summed weight when a hash-table row names
    it twice: there only its first slot holds it), else exact zeros (`moe.routed_slots`' contract). Folded by
    `moe.combine_slots` (ascending expert id, fp32, from zero) it is the reference's sum bit for bit: the
    reference's terms of the unselected experts are exact zeros (weight 0 before w2), which change no fp32 sum."""
    N, D = xf.shape
    k = idx.shape[1]
    E_l = jax.tree_util.tree_leaves(ex["w1"])[0].shape[0]
    loc = idx - first_expert
    loc = jnp.where((loc >= 0) & (loc < E_l), loc, E_l)  # another shard's experts: out of range, dropped
    dense_w = jnp.zeros((N, E_l), jnp.float32).at[jnp.arange(N)[:, None], loc].add(w, mode="drop")
    first = first_slots(idx)  # a repeated id's later slots stay zero (its weight is summed into the first)
    lin = functools.partial(expert, cfg=cfg, dt=dt)

    def body(out, e):
        pe = jax.tree_util.tree_map(lambda t: t[e], ex)
        y = moe41.swiglu_expert(xf, pe["w1"], pe["w3"], pe["w2"], dense_w[:, e], cfg.swiglu_limit, dt, lin)
        mine = first & (idx == first_expert + e)
        return jnp.where(mine[..., None], y.astype(jnp.float32)[:, None], out), None

    out, _ = jax.lax.scan(body, jnp.zeros((N, k, D), jnp.float32), jnp.arange(E_l))
    return out


def kernel_refusal(cfg, impl: str):
    """Why V4's routed experts cannot run the moe kernel `impl` (V4.1's grouped MXFP4 kernel, registered as
    ("moe", "kernel")) with config `cfg`: one line naming the op and what does not fit, or None when it runs. The
    kernel takes `moe.routed_slots`' contract, which V4's "xla" path already calls for MXFP4 experts in the fp32 /
    bf16 flows; it does not take plain experts, the release numerics (their activation blocks and GEMM arithmetic are
    the release's, `v4.linear.expert`), the exact / deterministic modes (fp64 sums) or expert dims its tiles do not
    divide (its registered `supports`)."""
    if cfg.expert_dtype != "fp4":
        return f"moe={impl}: the kernel reads MXFP4 experts; this checkpoint's routed experts are {cfg.expert_dtype}"
    if cfg.act_quant_block:
        return (f"moe={impl}: the release numerics (act_quant_block={cfg.act_quant_block}) run the release's "
                f"blockwise fp8 GEMM on dequantized experts, not V4.1's kernel arithmetic")
    if is_exact(cfg):
        return f"moe={impl}: the {mode_name(cfg)} numerics mode accumulates in fp64, the kernel in fp32"
    if not dispatch.supports("moe", "kernel", cfg):
        return (f"moe={impl}: the kernel's tiles do not divide the expert dims hidden_size={cfg.hidden_size} x "
                f"moe_intermediate_size={cfg.moe_intermediate_size}")
    return None


def _kernel_slots(cfg, impl: str):
    """The moe kernel with `routed_slots`' signature (interpreted for "pallas_interpret"), after its refusals."""
    why = kernel_refusal(cfg, impl)
    if why is not None:
        raise NotImplementedError(f"DeepSeek-V4: {why}")
    return functools.partial(dispatch.kernel("moe", impl), interpret=impl == "pallas_interpret")


def routed(ex, xf, idx, w, cfg, dt, par=None):
    """fp32 [N, D]: the routed experts' sum by the moe implementation ("reference"; "xla": V4.1's grouped
    path for MXFP4 experts, the reference for plain ones and in the release numerics, whose activation blocks V4.1's
    grouped GEMM does not take; "pallas" / "pallas_interpret": V4.1's grouped MXFP4 kernel in place of the xla
    path's `moe.routed_slots`, the same combine — refused with its reason where it does not fit, `kernel_refusal`).
    par: a mesh plan whose experts are split (ep > 1): the same per-assignment computation on each expert shard, one
    psum (`par.routed_experts`: V4.1's expert-parallel MoE; the reference as `reference_slots`), bitwise the
    unsharded sum."""
    impl = dispatch.resolve(cfg, "moe")
    if dispatch.is_kernel(impl) and dispatch.parse_impl(cfg.impl)["moe"] == "auto" and kernel_refusal(cfg, impl):
        impl = "xla"  # "auto" picks among what runs; an explicit kernel that does not fit is refused below
    kernel = _kernel_slots(cfg, impl) if dispatch.is_kernel(impl) else None
    grouped = impl == "xla" and is_mxfp4(ex["w1"]) and xf.shape[0] and not cfg.act_quant_block  # V4.1's 32-wide blocks
    slots = kernel if kernel is not None else moe41.routed_slots if grouped else None
    if par is not None and par.expert_parallel:
        if slots is None and par.moe_a2a_backend != "none":  # the reference per dispatched (token, slot) row
            w = fold_repeats(idx, w)
        return par.routed_experts(ex, xf, idx, w, cfg, dt, slots=slots or reference_slots)
    if slots is not None:  # (a hash-table row may repeat an expert: the combine sorts, no `distinct` shortcut)
        return moe41.combine_slots(slots(ex, xf, idx, w, cfg, dt), idx)
    return routed_reference(ex, xf, idx, w, cfg, dt)


def shared_expert(sh, xf, cfg, dt):
    """The shared expert: `moe.swiglu_expert` with weight 1 on V4's dense weights -> [N, D] in `dt`."""
    lin = functools.partial(dense, cfg=cfg, dt=dt)
    return moe41.swiglu_expert(xf, sh["w1"], sh["w3"], sh["w2"], None, cfg.swiglu_limit, dt, lin)


def moe(p, x, token_ids, hashed: bool, cfg, dt, par=None):
    """x [..., D] (the normed ffn input), token_ids int32 [...] (the tokens at those positions: the hash
    table's index) -> (y [..., D] in `dt`, (idx int32 [..., k], w fp32 [..., k])). par: a mesh plan (`routed`)."""
    shape = x.shape
    k = cfg.num_experts_per_tok
    xf = x.reshape(-1, shape[-1])
    idx = p["gate"]["tid2eid"][token_ids.reshape(-1)].astype(jnp.int32) if hashed else None
    idx, w, _ = moe41.route(p["gate"], xf, k, cfg, idx=idx)
    y = routed(p["experts"], xf, idx, w, cfg, dt, par)
    y = y + shared_expert(p["shared_experts"], xf, cfg, dt).astype(jnp.float32)
    return y.astype(dt).reshape(shape), (idx.reshape(shape[:-1] + (k,)), w.reshape(shape[:-1] + (k,)))
