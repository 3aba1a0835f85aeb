"""The "linear" seam: quantized (fp8 / MXFP4) matmuls and the fp32-kind matmuls, by implementation.

Every such matmul goes through here with the config, so `ModelConfig.impl` (op ``"linear"``,
`dispatch.resolve`) and the numerics mode (`numerics.is_exact`) are honoured in one place. (A "plain bf16
matmul", docs/design/spec.md §1, is one formulation for every implementation: callers use
`numerics.linear_bf16` directly.)

* ``"reference"`` — today's arithmetic, byte for byte: `quant.fp8_linear` / `quant.mxfp4_linear`
  (both operands dequantized exactly to fp32, one fp32 HIGHEST dot, one rounding) and the
  `numerics.linear_bf16` / `linear_f32` kinds.
* ``"xla"`` — the same numbers (up to fp32 summation order) with the weight entering the matmul at
  stored width or as exact bf16, never as an fp32 copy:

  - small M (rows <= `BLOCK_M_MAX`, i.e. decode): the docs/design/spec.md §6 GEMM itself. The activation is fp8
    quantized per 32 along K (`quant.act_quant_fp8`), and the e4m3 codes of activation and weight go
    into one batched dot over the K-blocks, P[b, m, n] = sum_{k in block b} xq[m, k]·wq[n, k] (fp32
    accumulation: each product has <= 8 significant bits), then y = sum_b P[b]·s_x[m, b]·s_w[n, b].
    The weight is read once at 1 byte (MXFP4 nibbles are widened to e4m3 codes first: every e2m1
    value is an e4m3 value). The partial-sum temporary is K/32·M·N fp32 = M/8 of the fp8 weight's
    bytes, which is why this path is limited to small M.
  - large M (prefill): both operands dequantized to **bf16** — exact, since e4m3 and e2m1 codes times a
    power of two have 4 resp. 2 significant bits — and one bf16 dot with fp32 accumulation; XLA fuses
    the dequantization into the operand producer (on GPU into the GEMM fusion). The products are
    exact in fp32, so this equals the reference up to fp32 summation order.
  - fp32-kind matmuls on bf16 weights (head, MoE gate): the weight enters the dot as bf16, not as an
    fp32 copy — a bf16 x bf16 dot in the bf16 flow (the activation is bf16-valued there), a mixed
    fp32 x bf16 dot otherwise; widening is exact, so the products are the reference's.

* ``"pallas"`` / ``"pallas_interpret"`` — the fp8 and MXFP4 GEMMs as one fused kernel each
  (`pallas/quant_linear.py`: the activation quant, the weight decode and the GEMM in one launch; the
  same products, fp32 sums in its tile order); the bf16 / fp32 kinds keep the xla path. Each quantized
  matmul reads the step plan of its config on the current mesh (``StepPlan.of(cfg, tiling.mesh_plan())``):
  the kernel runs where `StepPlan.linear_kernel`, from the plan's `kernels` (one device only: the plan refuses
  it on a mesh); inside a layer-scan run it reads the run's stacked weights in place (`plan.StepPlan.in_place`:
  a `weights.Stacked` weight). Where the plan holds a step's other fused forms, their callers call the kernel
  with its epilogues directly (`moe.moe`: the shared expert's gated w1 / w3 and w2 with the routed sum).
* In the exact and deterministic modes (`numerics.is_exact`) every path accumulates in fp64
  (`numerics.dot_exact`) and rounds once to fp32 (then to `dt`, bf16 in the deterministic bf16 flow), so
  the reference and the xla formulation agree (bit for bit in practice) however they sum.

Shapes: x [..., K] with K % 32 == 0; weights `weights.Fp8` [N, K] (MXFP4: `weights.Mxfp4`, packed [N, K/2]), or
inside a layer-scan run a `weights.Stacked` of them; outputs [..., N].

``row_axis`` (fp8, f32, wo_a): the logical axis of the weight's rows ("heads", "mlp", "vocab"; None
for rows that are never split). It changes no arithmetic: on a mesh, where the rows are split over
devices, it lets the CPU row tiles follow the split (`tiling`, module doc).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from dsv41_jax.model import codec, dispatch, quant, tiling, weights
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.plan import StepPlan
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.model.numerics import HIGHEST, dot_exact, is_exact, linear_bf16, linear_f32, x64_scope

# Rows (tokens) up to which the xla fp8/MXFP4 linears use the K-blockwise fp8 GEMM (weight read at
# stored width, a K/32·M·N fp32 partial-sum temporary); above it the exact-bf16 dequant GEMM.
BLOCK_M_MAX = 8


def _rows(x):
    return math.prod(x.shape[:-1])


def fp4_codes_to_e4m3(packed):
    """MXFP4 bytes uint8 [..., K/2] (low nibble = even element) -> float8_e4m3fn [..., K] (exact).

    Bit arithmetic (`codec.e2m1_to_e4m3`), not a table lookup, so it fuses with whatever consumes it
    (a gather from a LUT does not fuse on every backend and would materialize an fp32/int32 copy of
    the weight).
    """
    return codec.bitcast(codec.e2m1_to_e4m3(codec.unpack_nibbles(packed, jnp), jnp), quant.FP8, jnp)


def _block_gemm(xq, sx, wq, sw_rows, dt, exact):
    """The K-blockwise fp8 GEMM (docs/design/spec.md §6) on a quantized activation.

    xq e4m3 [M, K] and sx fp32 [M, K/32] (`quant.act_quant_fp8` of the input, flattened to M rows);
    wq e4m3 [N, K]; sw_rows fp32 [N, K/32]. Returns fp32 [M, N]."""
    N, K = wq.shape
    kb = K // 32
    xq = xq.reshape(-1, kb, 32)
    w3 = wq.reshape(N, kb, 32)
    dn = (((2,), (2,)), ((1,), (1,)))  # contract the 32 in-block elements, batch over K-blocks
    if exact:
        with x64_scope():
            p = jax.lax.dot_general(xq, w3, dn, preferred_element_type=jnp.float64)  # [kb, M, N]
            y = jnp.sum(p * sx.T.astype(jnp.float64)[:, :, None] * sw_rows.T.astype(jnp.float64)[:, None, :], axis=0)
            return y.astype(jnp.float32)
    p = jax.lax.dot_general(xq, w3, dn, preferred_element_type=jnp.float32)  # [kb, M, N]
    return jnp.sum(p * sx.T[:, :, None] * sw_rows.T[:, None, :], axis=0)


def _quantized_gemm(x, n_rows, k, align, small_tile, large_tile, dt, exact, row_axis=None):
    """Shared driver of the xla fp8 / MXFP4 GEMMs: x [..., K] -> [..., N] in `dt` (fp32 in exact mode).

    small M (<= `BLOCK_M_MAX` rows): the activation is fp8-quantized once and
    ``small_tile(r0, tn) -> (wq e4m3 [tn, K], sw_rows fp32 [tn, K/32])`` yields each row tile of the
    weight for `_block_gemm`; large M: ``large_tile(r0, tn, wdt) -> w [tn, K]`` (dequantized, exact in
    `wdt`) for one dot against the fake-quantized activation. Row tiles: `tiling` (one tile except
    where the backend widens dot operands outside the GEMM; never in the exact mode; following the
    rows' split over devices on a mesh, `row_axis`)."""
    lead = x.shape[:-1]
    nt, split = (0, None) if exact else tiling.plan(n_rows, k, align, row_axis)
    if _rows(x) <= BLOCK_M_MAX:
        xq, sx = quant.act_quant_fp8(x)  # e4m3 [..., K], fp32 [..., K/32]
        xq, sx = xq.reshape(-1, k), sx.reshape(-1, k // 32)
        y = tiling.over_rows(sx, n_rows, nt, lambda r0, tn: _block_gemm(xq, sx, *small_tile(r0, tn), dt, exact),
                             split)
        return y.reshape(*lead, n_rows).astype(dt)
    wdt = jnp.float32 if exact else jnp.bfloat16
    xd = quant.fake_quant_fp8(x, out_dtype=wdt)
    return tiling.over_rows(xd, n_rows, nt, lambda r0, tn: _bf16_gemm(xd, large_tile(r0, tn, wdt), dt, exact),
                            split)


def _bf16_gemm(xd, wd, dt, exact):
    """x [..., K], w [N, K], both exactly representable in bf16 -> [..., N] in dt (fp32 accumulation)."""
    dn = (((xd.ndim - 1,), (1,)), ((), ()))
    if exact:
        return dot_exact(xd.astype(jnp.float32), wd.astype(jnp.float32), dn).astype(dt)
    y = jax.lax.dot_general(xd.astype(jnp.bfloat16), wd.astype(jnp.bfloat16), dn,
                            preferred_element_type=jnp.float32)
    return y.astype(dt)


def _fp8_row_scales(scale, n):
    """Block scales E8M0 [ceil(N/32), K/32] -> fp32 per-row [N, K/32]."""
    return jnp.repeat(quant.e8m0_to_f32(scale), 32, axis=0)[:n]


def fp8(x, p, cfg, dt, row_axis=None):
    """GEMM with a 32x32-block fp8 weight and fp8-quantized input (docs/design/spec.md §6).

    x [..., K] float; p a `weights.Fp8` (float8_e4m3fn [N, K], E8M0 [ceil(N/32), K/32]), or inside a layer-scan
    run where the kernel runs the run's stack of it (`weights.Stacked`).
    Returns [..., N] in `dt` (fp32 in the fp32 / exact modes).
    """
    step = StepPlan.of(cfg, tiling.mesh_plan())
    if step.linear_kernel:
        return step.kernels["linear", "kernel"](x, p, "fp8", dt, cfg)
    return _fp8_jnp(x, p, cfg, dt, step.linear, row_axis)


def _fp8_jnp(x, p, cfg, dt, impl, row_axis):
    """`fp8` on the jnp paths: "reference" (`quant.fp8_linear`, or fp64-accumulated in the exact modes) or the
    xla K-blockwise / bf16-dequant GEMMs (`_quantized_gemm`)."""
    exact = is_exact(cfg)
    p = weights.row(p)
    w, s = p.weight, p.scale
    if impl == "reference":
        if not exact:
            return quant.fp8_linear(x, w, s, out_dtype=dt)
        xd = quant.fake_quant_fp8(x, out_dtype=jnp.float32)
        y = dot_exact(xd, quant.dequantize_fp8_block(w, s, jnp.float32), (((x.ndim - 1,), (1,)), ((), ())))
        return y.astype(dt)
    N, K = w.shape

    def small(r0, tn):  # row tiles are whole 32-row scale blocks (align=32) unless untiled
        wt = tiling.rows(w, r0, tn)
        st = s if wt.shape[0] == N else tiling.rows(s, r0 // 32, tn // 32)
        return wt, _fp8_row_scales(st, wt.shape[0])

    def large(r0, tn, wdt):
        wt = tiling.rows(w, r0, tn)
        st = s if wt.shape[0] == N else tiling.rows(s, r0 // 32, tn // 32)
        return quant.dequantize_fp8_block(wt, st, wdt)

    return _quantized_gemm(x, N, K, 32, small, large, dt, exact, row_axis)


def fp8_dual(x, p1, p2, cfg, dt):
    """``(fp8(x, p1), fp8(x, p2))``: two fp8 GEMMs of one input (a layer's wq_a and wkv). Where the linear kernel
    runs and both output widths are multiples of 64, one launch (`quant_linear.kernel_dual`: the same values);
    else the two calls."""
    step = StepPlan.of(cfg, tiling.mesh_plan())
    n1, n2 = (weights.split(p)[0].weight.shape[-2] for p in (p1, p2))
    if step.linear_kernel and n1 % 64 == 0 and n2 % 64 == 0:
        return step.kernels["linear", "kernel_dual"](x, p1, p2, "fp8", dt, cfg)
    return fp8(x, p1, cfg, dt), fp8(x, p2, cfg, dt)


def fp8_normed(x, pn, eps, p, cfg, dt, row_axis=None, rope=None, x_normed=None):
    """``fp8(norm.rmsnorm(x, pn, eps, dt), p)``: an fp8 GEMM of an RMSNormed input (the q latent's q_norm before
    wq_b; pn the norm weight [K], or a run's stack of it, `weights.Stacked`, with p stacked too), optionally RoPE'd: ``rope=(positions int32 [...], freqs, head_dim)`` returns the
    output [..., N] as ``rope.apply_rope`` of its [..., N / head_dim, head_dim] view at positions[..., None].
    Where the linear kernel runs, the norm and the RoPE run in the kernel (`quant_linear.kernel`'s norm and
    rope: three XLA launches fewer; its Σx² in the kernel's order); else exactly those calls (x_normed: that
    norm of x when the caller has it, not made twice)."""
    step = StepPlan.of(cfg, tiling.mesh_plan())
    if step.linear_kernel:
        nw, layer = weights.split(pn)
        if (layer is None) != (weights.split(p)[1] is None):
            raise ValueError("linear.fp8_normed: the norm weight and the linear weight must both be a run's stacks "
                             "(weights.Stacked) or both one layer's")
        return step.kernels["linear", "kernel"](x, p, "fp8", dt, cfg, norm=(nw, eps), rope=rope)
    return _fp8_normed_jnp(x, pn, eps, p, cfg, dt, row_axis, rope, x_normed)


def _fp8_normed_jnp(x, pn, eps, p, cfg, dt, row_axis, rope, x_normed):
    """`fp8_normed` as its plain calls: `norm.rmsnorm` (or x_normed), `fp8`, then `rope.apply_rope` if asked."""
    y = fp8(rmsnorm(x, weights.row(pn), eps, dt, is_exact(cfg)) if x_normed is None else x_normed, p, cfg, dt,
            row_axis)
    if rope is None:
        return y
    positions, freqs, hd = rope
    yh = y.reshape(y.shape[:-1] + (y.shape[-1] // hd, hd))
    return apply_rope(yh, positions[..., None], freqs, out_dtype=dt).reshape(y.shape)


def mxfp4(x, p, cfg, dt):
    """GEMM with an MXFP4 weight and fp8-quantized input (docs/design/spec.md §6).

    x [..., K] float; p a `weights.Mxfp4` (uint8 [N, K/2], E8M0 [N, K/32]). Returns [..., N] in `dt`.
    """
    exact = is_exact(cfg)
    step = StepPlan.of(cfg, tiling.mesh_plan())
    if step.linear_kernel:
        return step.kernels["linear", "kernel"](x, p, "mxfp4", dt, cfg)
    impl = step.linear
    p = weights.row(p)
    w, s = p.weight, p.scale
    if impl == "reference":
        if not exact:
            return quant.mxfp4_linear(x, w, s, out_dtype=dt)
        xd = quant.fake_quant_fp8(x, out_dtype=jnp.float32)
        y = dot_exact(xd, quant.dequantize_mxfp4(w, s, jnp.float32), (((x.ndim - 1,), (1,)), ((), ())))
        return y.astype(dt)
    N, K = w.shape[0], 2 * w.shape[1]

    def small(r0, tn):
        return fp4_codes_to_e4m3(tiling.rows(w, r0, tn)), quant.e8m0_to_f32(tiling.rows(s, r0, tn))

    def large(r0, tn, wdt):
        return quant.dequantize_mxfp4(tiling.rows(w, r0, tn), tiling.rows(s, r0, tn), wdt)

    return _quantized_gemm(x, N, K, 1, small, large, dt, exact)


def f32(x, w, cfg, row_axis=None):
    """An "fp32 matmul on bf16-valued weights" (MoE gate, head, ...): x [..., K], w [N, K] -> fp32 [..., N].

    "xla": the weight enters the dot at its stored dtype (bf16 for the head and gate) with fp32
    accumulation — against the bf16 activation in the bf16 flow, else against the fp32 activation (a
    mixed dot) — the same products (widening bf16 is exact), so the 1.3 GB head is not copied to
    2.6 GB of fp32 per step."""
    if is_exact(cfg):
        return linear_f32(x, w, exact=True)
    if dispatch.resolve(cfg, "linear") == "reference":
        return linear_f32(x, w)
    dn = (((x.ndim - 1,), (1,)), ((), ()))
    N, K = w.shape
    nt, split = tiling.plan(N, K, 1, row_axis)
    # bf16 flow: the activation is bf16-valued, so a bf16 x bf16 dot with fp32 accumulation has the same (exact)
    # products and needs no widened copy of either operand on any backend; else the fp32 activation, HIGHEST.
    bf16 = x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
    xf, precision = (x, None) if bf16 else (x.astype(jnp.float32), HIGHEST)
    return tiling.over_rows(xf, N, nt, lambda r0, tn: jax.lax.dot_general(
        xf, tiling.rows(w, r0, tn), dn, precision=precision, preferred_element_type=jnp.float32), split)


def wo_a(o, p, cfg, dt, row_axis=None):
    """The grouped wo_a projection (docs/design/spec.md §3): o [B, T, G, I] -> [B, T, G, R] in `dt`.

    p: the ``wo_a`` `weights.Fp8` (e4m3 [G·R, I], its scale, bf16 [G·R, I]): bf16 is the load-time
    dequantized copy (docs/design/spec.md §3; `params.fp8_linear_bf16_decl`, built by `init_params` / `load_params`),
    which "xla" multiplies as it is (without it, None, e.g. a hand-built weight, "xla" dequantizes per call).
    "reference" is today's code: it dequantizes the fp8 pair on every call. The weight is exactly
    bf16-representable, so every path computes the same products.
    """
    G, R = cfg.o_groups, cfg.o_lora_rank
    exact = is_exact(cfg)
    if exact:
        w = quant.dequantize_fp8_block(p.weight, p.scale, out_dtype=jnp.float32).reshape(G, R, -1)
        with x64_scope():
            y = jnp.einsum("btgi,gri->btgr", o.astype(jnp.float64), w.astype(jnp.float64), precision=HIGHEST,
                           preferred_element_type=jnp.float64)
            return y.astype(jnp.float32).astype(dt)
    wdt = jnp.float32 if dt == jnp.float32 else jnp.bfloat16

    def groups(o_t, w):  # o_t [B, T, g, I], w [g·R, I] -> [B, T, g, R]
        w = w.reshape(o_t.shape[2], R, -1)
        if dt == jnp.float32:
            return jnp.einsum("btgi,gri->btgr", o_t, w.astype(jnp.float32), precision=HIGHEST)
        y = jnp.einsum("btgi,gri->btgr", o_t.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
        return y.astype(dt)

    if dispatch.resolve(cfg, "linear") == "reference":
        return groups(o, quant.dequantize_fp8_block(p.weight, p.scale, out_dtype=wdt))
    # xla: the load-time bf16 copy when present; on backends that widen outside the GEMM, scoped row
    # tiles of whole groups (`tiling`), each tile's weight dequantized inside its scope.
    B, T = o.shape[:2]
    I = o.shape[-1]
    tg, split = tiling.plan(G, R * I, 1, row_axis)
    if not (R % 32 == 0 or p.bf16 is not None):
        tg = min(1, tg)

    def tile(g0, ng):
        o_t = tiling.rows(o, g0, ng, axis=2)  # [B, T, k·ng, I] inside a split tile (`tiling.rows`)
        if p.bf16 is not None:
            w = tiling.rows(p.bf16, g0 * R, ng * R)
        else:  # R % 32 == 0 here (else at most one tile), so a group is whole 32-row scale blocks
            w = quant.dequantize_fp8_block(tiling.rows(p.weight, g0 * R, ng * R),
                                           tiling.rows(p.scale, g0 * R // 32, ng * R // 32), out_dtype=wdt)
        return groups(o_t, w).reshape(B, T, o_t.shape[2] * R)

    return tiling.over_rows(o, G, tg, tile, split).reshape(B, T, G, R)
