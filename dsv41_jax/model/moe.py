"""Mixture of experts: sqrtsoftplus gate, top-k, clamped SwiGLU experts, shared expert (docs/design/spec.md §6).

The implementations of the routed experts, chosen by `dispatch.resolve(cfg, "moe")`:

* ``"reference"`` — every routed expert runs on every token, multiplied by a routing weight that is
  exactly 0 for unselected experts (so they add exact zeros and the sum keeps ascending-expert-id
  order). O(E) compute — the ground truth for the grouped path.
* ``"xla"`` — grouped: the N·k (token, expert) assignments are sorted by expert id, only the selected
  experts' MXFP4 weights are gathered (at stored width: packed bytes + E8M0 scales) when fewer than E
  experts can be selected (N·k < E, i.e. decode), else all E are used in place (on CPU in scoped row
  tiles, `tiling`, so the widened copy is one tile, not every expert of every layer); they are dequantized
  to bf16 (exact: e2m1 x 2^k has 2 significant bits) and one `jax.lax.ragged_dot_general` per
  projection multiplies each group of rows by its expert only, with fp32 accumulation (fp64 in the
  exact mode). No token is dropped; experts with no token are groups of size 0.
* ``"pallas"`` / ``"pallas_interpret"`` — `dsv41_jax.pallas.moe_mxfp4`: the same sorted groups, each
  selected expert's packed e2m1 codes and E8M0 scales decoded inside the kernel (read once at decode
  sizes), gate/up → clamped SwiGLU → fp8 quant → down; the same combine. Not in the exact /
  deterministic modes (fp64 sums), not expert-parallel (both refused).

Combine order (docs/design/spec.md §6: "the fp32 sum of routed outputs in ascending expert id"): the reference adds
expert outputs in ascending id in fp32 (the unselected ones add exact zeros, which change nothing).
The xla path puts each token's k expert outputs back in ascending expert id and folds them left to
right in fp32 — the *same* additions in the same order — so the combine is bitwise the reference's;
the two paths differ only inside each expert's GEMMs (fp32 summation order of exact products, below
the bf16 rounding of each GEMM output; none at all in the exact mode).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch, linear, quant, tiling, weights
from dsv41_jax.model.numerics import einsum_exact, is_exact
from dsv41_jax.model.plan import StepPlan


def softplus_torch(x):
    """torch's softplus (beta 1, threshold 20): x for x > 20, else log1p(exp(x))."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def route(p_gate, x, top_k: int, cfg, idx=None):
    """Gate: x [N, D] -> (idx int32 [N, k], weights fp32 [N, k], scores fp32 [N, E]).

    s = sqrt(softplus(x·Wᵀ / gate_temp)) in fp32; the bias ranks but does not weight; ties go to the
    lower expert id; weights = s[idx] / (Σ + 1e-20) · routed_scaling_factor (normalized only when
    norm_topk_prob and k > 1).

    Variant (DeepSeek-V4's hash-routed layers, docs/design/v4.md): `idx` int32 [N, k] given — the experts come
    from a table (``tid2eid[token]``) instead of the top-k, the weights from s as above.
    """
    logits = linear.f32(x, p_gate["weight"], cfg) / cfg.gate_temp
    s = jnp.sqrt(softplus_torch(logits))
    if idx is None:
        bias = weights.row(p_gate["bias"])  # (a run's stack + layer where the router kernel reads it in place)
        _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), top_k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and top_k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * cfg.routed_scaling_factor, s


def _swiglu_act(g, u, weight, limit, dt):
    """a = silu(min(g, limit)) · clamp(u, ±limit) · weight in fp32 -> `dt` (g, u GEMM outputs); weight fp32
    [N], or None for a weight of 1 (the shared expert: the same values, one multiply fewer)."""
    g = g.astype(jnp.float32)
    u = u.astype(jnp.float32)
    u = jnp.clip(u, -limit, limit)
    g = jnp.minimum(g, limit)
    a = jax.nn.silu(g) * u
    return (a if weight is None else a * weight[:, None]).astype(dt)


def swiglu_expert(x, w1, w3, w2, weight, limit, dt, linear):
    """One SwiGLU expert with clamps. x [N, K]; w1 / w3 / w2 its weights, as ``linear(x, w)`` takes them; weight
    fp32 [N] (routing weight, applied before w2).

    g = w1·x, u = w3·x (outputs rounded to `dt`, widened to fp32); u ∈ [−limit, limit]; g ≤ limit;
    a = silu(g)·u·weight (fp32) → `dt` → w2 (fp8-quantized input) → `dt`.
    """
    a = _swiglu_act(linear(x, w1), linear(x, w3), weight, limit, dt)
    return linear(a, w2)


def _routed_reference(ex, xf, idx, w, cfg, dt):
    """fp32 [N, D]: every expert on every token, summed in ascending expert id (see module doc). ex: the layer's
    experts {w1, w3, w2: `weights.Mxfp4`}, or a run's stacks (`weights.Stacked`: the oracle slices the layer's)."""
    ex = weights.row(ex)
    N, D = xf.shape
    E = ex["w1"].weight.shape[0]
    dense_w = jnp.zeros((N, E), jnp.float32).at[jnp.arange(N)[:, None], idx].set(w)
    lim = cfg.swiglu_limit

    def mx(a, we):
        return linear.mxfp4(a, we, cfg, dt)

    def body(acc, e):
        pe = jax.tree_util.tree_map(lambda t: t[e], ex)
        y = swiglu_expert(xf, pe["w1"], pe["w3"], pe["w2"], dense_w[:, e], lim, dt, mx)
        return acc + y.astype(jnp.float32), None

    # Sequential scan: the fp32 sum runs in ascending expert id, as the spec requires.
    routed, _ = jax.lax.scan(body, jnp.zeros((N, D), jnp.float32), jnp.arange(E))
    return routed


_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),  # lhs [A, K] · rhs [G, N, K] over K
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _grouped_mxfp4(xs, wp, ws, gexp, sizes, dt, exact, layer=None):
    """Grouped MXFP4 GEMM with fp8-quantized input: rows of xs [A, K] (sorted by group) times their
    group's weight. wp uint8 [E, N, K/2] and ws E8M0 [E, N, K/32]: the layer's whole expert stack;
    gexp int32 [G]: the expert of each group (None: the groups are all E experts in order);
    sizes int32 [G] (sum = A). Returns [A, N] in `dt` (fp64-accumulated in the exact / deterministic modes).

    Only the groups' experts are read (a gather at stored width); on backends that widen dot operands
    outside the GEMM, in scoped row tiles of the experts' output rows (`tiling`). layer: with wp / ws
    a run's stacks [n, E, ...] (`weights.Stacked`), the layer to read (the gather takes (layer, expert)
    pairs: no copy of the layer's experts)."""
    E, N, Kh = wp.shape[-3:]
    K = 2 * Kh
    G = E if gexp is None else gexp.shape[0]
    cdt = jnp.float32 if exact else jnp.bfloat16  # both exact: e4m3·2^k and e2m1·2^k fit bf16
    xd = quant.fake_quant_fp8(xs, out_dtype=cdt)

    def pick(t, r0, tn):  # [G, tn, ·] rows r0.. of the groups' experts, one gather at stored width
        if layer is not None:
            t = tiling.rows(t, r0, tn, axis=2)
            # (a stacked scale stays uint8: `quant.e8m0_to_f32` decodes the raw exponent bytes as they are)
            return t[layer] if gexp is None else t[layer, gexp]
        if gexp is None:
            return tiling.rows(t, r0, tn, axis=1)
        return jnp.take(tiling.rows(t, r0, tn, axis=1), gexp, axis=0)

    def tile(r0, tn):
        # Widened through e4m3 by bit arithmetic (`linear.fp4_codes_to_e4m3`), so the dequantization
        # fuses into one pass producing the bf16 operand (no LUT gather, no fp32 copy).
        v = linear.fp4_codes_to_e4m3(pick(wp, r0, tn)).astype(jnp.float32).reshape(G, tn, K // 32, 32)
        wd = (v * quant.e8m0_to_f32(pick(ws, r0, tn))[..., None]).reshape(G, tn, K).astype(cdt)
        if exact:
            # ragged_dot is decomposed when lowered, outside any x64 scope, so it cannot accumulate in
            # fp64: the exact mode (tests only) multiplies each row by its group's weight explicitly.
            row_group = jnp.repeat(jnp.arange(G, dtype=jnp.int32), sizes, total_repeat_length=xs.shape[0])
            return einsum_exact("ak,ank->an", xd, jnp.take(wd, row_group, axis=0)).astype(dt)
        y = jax.lax.ragged_dot_general(xd, wd, sizes, _RAGGED_DN, preferred_element_type=jnp.float32)
        return y.astype(dt)

    return tiling.over_rows(xd, N, 0 if exact else tiling.n_tiles(N, G * K), tile)


def sort_assignments(idx, E: int, first_expert=0):
    """The N·k (token, expert) assignments of idx int32 [N, k] grouped by expert, for the experts
    ``first_expert .. first_expert + E − 1`` held (`routed_slots`).

    Returns (order, held, gexp, sizes): order int32 [A] (A = N·k) the flat assignment ids sorted by
    expert id, stable (assignment a is token a // k, slot a % k); held bool [A] whether the sorted
    assignment's expert is held (non-held ones sort last and belong to no group); gexp int32 [G] the
    expert (local id) of each group, or None when the groups are all E experts in id order; sizes
    int32 [G] the rows of each group (Σ = held assignments; the sorted rows of group g start at
    Σ sizes[:g]). G = min(A, E) (static): at most A distinct experts can be selected; with G < E the
    groups are the distinct selected experts ascending and unused trailing groups are empty (size 0,
    expert 0).
    """
    N, k = idx.shape
    A = N * k
    local = idx.reshape(A) - first_expert
    mine = (local >= 0) & (local < E)
    flat_e = jnp.where(mine, local, E)  # non-held assignments: key E, after every group
    order = jnp.argsort(flat_e, stable=True).astype(jnp.int32)  # assignments sorted by expert id
    se = flat_e[order]
    held = se < E
    G = min(A, E)
    if G < E:
        new = jnp.concatenate([jnp.ones((1,), bool), se[1:] != se[:-1]]) & held
        gid = jnp.cumsum(new.astype(jnp.int32)) - 1
        gid = jnp.where(held, gid, G)  # non-held assignments: out of range, dropped
        gexp = jnp.zeros((G,), jnp.int32).at[gid].set(se, mode="drop")
        sizes = jnp.zeros((G,), jnp.int32).at[gid].add(1, mode="drop")
    else:
        gexp = None  # every expert is a group, in id order
        sizes = jnp.zeros((E,), jnp.int32).at[se].add(1, mode="drop")
    return order, held, gexp, sizes


def unsort_slots(y_sorted, order, held, N: int, k: int):
    """Sorted per-assignment outputs y_sorted [A, D] back to slots [N, k, D]; the non-held
    assignments' rows (never computed) become exact zeros."""
    y_sorted = jnp.where(held[:, None], y_sorted, jnp.zeros((), y_sorted.dtype))
    return jnp.zeros(y_sorted.shape, y_sorted.dtype).at[order].set(y_sorted).reshape(N, k, -1)


def routed_slots(ex, xf, idx, w, cfg, dt, first_expert=0):
    """Per-assignment outputs of the grouped routed experts: [N, k, D] in `dt` (fp32 in exact mode).

    ex: stacked experts {w1, w3, w2: `weights.Mxfp4`} holding the E_l experts ``first_expert .. first_expert +
    E_l − 1`` (or a run's stacks, `weights.Stacked`: only the selected (layer, expert) rows are gathered, where a
    dynamic slice would copy the layer's every expert per step; all E unsharded; one expert shard's slice under expert parallelism, `first_expert` may be traced);
    xf [N, D]; idx int32 [N, k] global expert ids; w fp32 [N, k] routing weights. Slot (n, j) holds
    expert idx[n, j]'s output for token n, or exact zeros when that expert is not among `ex`.
    Only the assignments of the held experts are multiplied (see the module doc).
    """
    ex, layer = weights.split(ex)
    N, D = xf.shape
    k = idx.shape[1]
    E = ex["w1"].weight.shape[-3]
    order, held, gexp, sizes = sort_assignments(idx, E, first_expert)
    xs = jnp.take(xf, order // k, axis=0)  # [A, D] token rows, sorted by expert
    ws = jnp.take(w.reshape(N * k), order)
    exact = is_exact(cfg)

    def proj(a, name):
        return _grouped_mxfp4(a, ex[name].weight, ex[name].scale, gexp, sizes, dt, exact, layer)

    act = _swiglu_act(proj(xs, "w1"), proj(xs, "w3"), ws, cfg.swiglu_limit, dt)
    return unsort_slots(proj(act, "w2"), order, held, N, k)  # [A, D] in dt -> [N, k, D]


def _distinct_argsort(idx):
    """``argsort(idx, axis=1, stable=True)`` for rows of distinct ids (a token's top-k experts), without a sort:
    slot i's rank is the number of smaller ids in its row, and position r takes the slot ranked r. Integer
    arithmetic in one small fusion, where XLA:GPU's sort is a launch plus a copy of its operand (sorts run in
    place); the same permutation as the sort for distinct ids."""
    k = idx.shape[1]
    rank = jnp.sum(idx[:, None, :] < idx[:, :, None], axis=-1)  # [N, k]: rank of slot i
    pos = jnp.arange(k, dtype=jnp.int32)
    return jnp.sum(jnp.where(rank[:, :, None] == pos, pos[None, :, None], 0), axis=1).astype(jnp.int32)


def combine_slots(y, idx, distinct: bool = False, order=None):
    """fp32 [N, D]: each token's k slot outputs y [N, k, D] in ascending expert id, folded left to right
    in fp32 — the reference's additions in the reference's order. distinct: idx's rows hold distinct ids
    (top-k), so the order comes from `_distinct_argsort` (no sort launch; the same order); order: that
    order already made (int32 [N, k]: the router kernel's)."""
    k = idx.shape[1]
    if order is not None:
        perm = order
    else:
        perm = _distinct_argsort(idx) if distinct else jnp.argsort(idx, axis=1, stable=True)
    y = jnp.take_along_axis(y, perm[..., None], axis=1).astype(jnp.float32)
    acc = jnp.zeros(y.shape[:1] + y.shape[2:], jnp.float32) + y[:, 0]
    for j in range(1, k):
        acc = acc + y[:, j]
    return acc


def _routed_grouped(ex, xf, idx, w, cfg, dt):
    """fp32 [N, D]: the routed experts over only the selected (token, expert) pairs (see module doc)."""
    N, D = xf.shape
    if N * idx.shape[1] == 0:
        return jnp.zeros((N, D), jnp.float32)
    return combine_slots(routed_slots(ex, xf, idx, w, cfg, dt), idx)


def moe(p, x, top_k: int, cfg, dt, *, return_routing=False, par=None, step=None, layer_id=None):
    """x [..., D] (normed ffn input) -> [..., D] in `dt` (and the routing, idx int32 / weights fp32 [..., k], if asked).

    The gate (the router kernel where `StepPlan.router_kernel`, else `route`), the routed experts by the plan's moe
    implementation (module doc; expert-parallel on an "ep" mesh: `par.routed_experts`), the shared expert's w1 / w3
    + SwiGLU (one launch of the linear kernel where `StepPlan.linear_kernel`), then its w2: at one token
    (`StepPlan.combine_in_w2`) with the routed experts' sum as the w2 kernel's epilogue, else that sum added in fp32
    after w2. step: the step's `plan.StepPlan` (None: made
    for x's tokens); layer_id: the layer (a scan run's first), for the mesh plan's expert placement."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    step = StepPlan.of(cfg, par, (1, xf.shape[0])) if step is None else step
    fused, sh, padded, order = step.combine_in_w2, p["shared_experts"], None, None
    if step.router_kernel:  # top-k, weights and the combine's order in one kernel, padded to [N, kp]
        bias, layer = weights.split(p["gate"]["bias"])
        idx_p, w_p, order_p = step.kernels["moe", "route"](linear.f32(xf, p["gate"]["weight"], cfg), bias, top_k, cfg,
                                                           layer=layer)
        padded, idx, w, order = (idx_p, w_p), idx_p[:, :top_k], w_p[:, :top_k], order_p  # order: [N, kp]
    else:
        idx, w, _ = route(p["gate"], xf, top_k, cfg)
    if fused:  # the experts' raw slots, for w2's kernel to sum
        routed = step.kernels["moe", "kernel"](p["experts"], xf, idx, w, cfg, dt, padded=padded, raw=True)
    else:
        routed = _routed(p["experts"], xf, idx, w, cfg, dt, par, step.moe, padded, order, layer_id)
    act = functools.partial(_swiglu_act, weight=None, limit=cfg.swiglu_limit, dt=dt)
    if step.linear_kernel:  # w1 / w3 and the SwiGLU in one launch (the kernel's gated epilogue: the same arithmetic)
        a = step.kernels["linear", "kernel"](xf, sh["w1"], "fp8", dt, cfg, p_up=sh["w3"], act=act)
    else:  # w1 / w3 rows: "mlp" (tp-split on a mesh)
        a = act(linear.fp8(xf, sh["w1"], cfg, dt, "mlp"), linear.fp8(xf, sh["w3"], cfg, dt, "mlp"))
    if fused:
        out = step.kernels["linear", "kernel"](a, sh["w2"], "fp8", dt, cfg, combine=(routed, order, top_k))
    else:
        out = (routed + linear.fp8(a, sh["w2"], cfg, dt).astype(jnp.float32)).astype(dt)
    out = out.reshape(shape)
    if return_routing:
        return out, (idx.reshape(shape[:-1] + (top_k,)), w.reshape(shape[:-1] + (top_k,)))
    return out


def _experts_kernel(impl):
    """The routed experts' kernel (per-assignment slots, `moe_mxfp4.kernel`), or None for the jnp impls."""
    if not dispatch.is_kernel(impl):
        return None
    return functools.partial(dispatch.kernel("moe", impl), interpret=impl == "pallas_interpret")


def _routed(ex, xf, idx, w, cfg, dt, par, impl, padded, order, layer_id=None):
    """fp32 [N, D]: the routed experts' outputs summed per token in ascending expert id, by implementation:
    expert-parallel on an "ep" mesh (`par.routed_experts`, the kernel per expert shard where it runs), the kernel
    (its slots combined; top-k ids are distinct, so the combine's order needs no sort), the grouped xla path or
    the reference. order: None, or the router kernel's padded order int32 [N, kp]."""
    order = None if order is None else order[:, :idx.shape[1]]
    kernel = _experts_kernel(impl)
    if par is not None and par.expert_parallel:
        if impl == "reference":
            raise dispatch.ImplError("moe: the reference implementation runs every expert on every token and "
                                     "cannot run expert-parallel; use impl 'xla' (or 'auto') for moe on an ep mesh")
        return par.routed_experts(ex, xf, idx, w, cfg, dt, slots=kernel, layer_id=layer_id)
    if kernel is not None:
        return combine_slots(kernel(ex, xf, idx, w, cfg, dt, padded=padded), idx, distinct=True, order=order)
    return (_routed_reference if impl == "reference" else _routed_grouped)(ex, xf, idx, w, cfg, dt)
