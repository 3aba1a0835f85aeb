"""The dtype policy (docs/design/spec.md §1 "Numerics"), the numerics modes and the plain-matmul kinds.

Three static activation modes, chosen by ``ModelConfig.act_dtype`` (a ``cfg.replace(act_dtype=...)`` away),
and one orthogonal switch, ``ModelConfig.deterministic`` (the deterministic mode, below):

* ``"bfloat16"`` (default) — the reference dtype flow: every activation between ops is rounded to bf16.
* ``"float32"`` — those roundings are skipped (activations fp32); matmuls accumulate in fp32. Two
  computations that differ only in summation order agree to ~1e-6, but a 1-ulp fp32 difference can
  still flip an fp8 activation code or a top-k choice.
* ``"exact"`` — for equivalence tests (xla vs reference, decode vs forward, sharded vs not): fp32
  activations as in "float32", and every fp32-kind matmul accumulates in **fp64** before one rounding
  to fp32. fp32 x fp32 products are exact in fp64 (24 + 24 < 53 bits) and the fp8/MXFP4 GEMM products
  have <= 8 significant bits, so the fp64 sum is exact or within 2^-53 relative: the fp32 result no
  longer depends on summation order, blocking or batch shape (in practice: it could differ only when
  the fp64 sum lands within ~K·2^-53 of an fp32 rounding boundary). fp64 needs x64 types: they are
  enabled for the fp64 matmul only (`x64_scope`, also inside ``jit``), so nothing global changes and the
  rest of the program stays 32-bit. The reductions that are not matmuls and run over a model width
  (RMSNorm means, the Engram gate's dot products and means, the compressor's pooling softmax and sum,
  attention's softmax denominator) accumulate in fp64 too (`sum_f32`, `mean_f32`): XLA's CPU backend
  orders an fp32 row sum by the number of rows (a 64-wide mean over [1, 18] rows and over [8, 128]
  rows differ in the last bit), so fp32 there would tie the result to the batch shape. Sums over a
  handful of terms (the 4 mHC streams, Sinkhorn's 4×4, the top-k routing weights) stay fp32.
  XLA:CPU also always lets LLVM contract a·b + c into an FMA, and whether it does depends on how
  the ops were fused, which depends on the shapes: the steps where that moved results measurably
  (mHC's mix affine before Sinkhorn and the sigmoids, the Engram gate's h + g·value) run in fp64,
  where the product is exact. The same holds for the Newton step of XLA's fp32 rsqrt: the
  Engram gate's rsqrts are fp64, rounded once (`rsqrt_f32`; before, a dp rank's logprobs parted from one
  device's by 1-3 fp32 ulp). What remains (elementwise FMAs elsewhere) is at the last-ulp level:
  the tiny forward over an [8, 128] padded batch and over one [1, 18] row agree within 5e-7 in the
  logits with every fp8 code and top-k choice equal (tests/test_eval_server.py checks 75 sequences
  against the paged engine: 1e-5 per token).

The deterministic mode (``ModelConfig.deterministic``; the server's ``--enable-deterministic-inference``)
is the exact mode's accumulation with the activation dtype left as it is: with ``act_dtype="bfloat16"``
every activation is rounded to bf16 exactly where the bf16 mode rounds it (the reference dtype flow the
checkpoint was trained for: the same fp8 activation codes, expert and index choices as the bf16 mode to
rounding level), and every sum whose order could depend on the batch, the prefill chunk, the mesh, a
row tiling or a verify window's shape is made order-independent. ``exact`` is this switch with fp32
activations (``act_dtype="exact"`` implies it; ``float32`` + deterministic is the exact mode). Per op,
on every backend (``is_exact`` is the one predicate the ops ask):

* matmuls (`linear_bf16`, `linear_f32`, the fp8 / MXFP4 GEMMs of `model.linear` at every M, wo_a, the
  grouped MoE GEMMs, attention's q·k and p·v, the indexer's q·k, mHC's mix projection) — fp64
  accumulation, one rounding to fp32, then to the activation dtype where the bf16 mode rounds. In the
  bf16 flow the products are of bf16 / e4m3 / e2m1 values (<= 16 significant bits), so the fp64 sum is
  exact or within 2^-53 relative: the order of the sum (XLA's choice per shape, a tp all-reduce of
  fp64 partials, a row tile) does not show in the result. The row tiling of `model.tiling` is off.
* reductions over a model width (RMSNorm's mean, the Engram gate's dot and means, the compressor's
  pooling softmax and sum, attention's softmax denominator, the indexer's sum over heads) — fp64
  accumulation (`sum_f32`, `mean_f32`, `softmax_f32`), one rounding.
* elementwise chains whose fp32 evaluation XLA:CPU varies with the fusion it lands in (and so with the
  batch shape: measured, a micro forward at batch 1 and at batch 6 parted at layer 1's compressor, one
  fp32 ulp that the next bf16 rounding made 4 bf16 ulps and a later top-k choice): RMSNorm, the
  compressor's pooling softmax and sum, attention's softmax after the logits, the index scores' step
  roundings (`norm.rmsnorm`, `compressor.pool_groups`, `attention._attend_exact`, `indexer.raw_scores`)
  — the bf16 flow's fp32 chain op for op, each op evaluated in fp64 and rounded to fp32 where that chain
  rounds, and to bf16 where it rounds to bf16 (`round_f32`, `round_to`: reduce-precision ops, which XLA
  never folds away as it may fold a convert chain). So a + − × ÷ is the IEEE fp32 op bit for bit, a sum
  is the exact sum rounded once, an exp / rsqrt is correctly rounded, and a division by a broadcast is
  written as XLA compiles the bf16 flow's (x · fp32(1 / y): attention's output, the pooling softmax).
  The sampler's exps are fp64 rounded once (`exp_f32`). The exact mode keeps its fp32 versions (and its
  recorded goldens); `is_exact` returns which level runs.
  Faithfulness, measured against ``impl="reference"`` in bf16 (tests/test_deterministic.py, micro, the
  decode tests' prompts, keys 11-18): the first expert / index-slot flip comes at 27, 40, 40, 40, 11, 40,
  40, 40 (40 = never), as for the bf16 mode as served. Where this mode still parts from the reference
  it is by what no order-independent evaluation can reproduce: (1) the reference's fp32 sums in the
  order XLA gives them inside the whole forward (key 11, position 20, Engram's wkv: an output whose exact
  sum lies 4 fp32 ulps from a bf16 midpoint rounds the other way there; the same reference GEMM jitted
  alone rounds as this mode does); (2) XLA's excess precision — in the jitted reference a bf16 rounding
  between two fp32 steps is dropped in some fusions (docs/design/fastpath_attention.md): key 11's flip
  at 27 is layer 1's index score of slot 9, which the reference, keeping the head weights unrounded
  inside its fusion, scores 0.30078 (a tie with slot 6, which wins on the lower id) where the spec's
  step roundings — this mode, and the reference run standalone — give 0.30273, 1 bf16 ulp above;
  (3) XLA's fp32 exp / rsqrt / logistic approximations (measured on CPU: 10 / 18 / 37 % of results 1 ulp
  off the correctly rounded ones) and mHC's fp32 Sinkhorn, which a per-op fp32 emulation does not
  reproduce (30 % of entries differ after one iteration, with XLA's own exps; XLA:CPU hands it whole to a
  library fusion, "ynn_fusion" in the optimized HLO, with its own exp and reduction order): mHC's mixes
  stay fp64, rounded once (key 13: the first bf16 difference, position 9, is a layer 0 hc_post; no
  decision flips on it). Before the per-op roundings this mode flipped at 19 on key 11: layer 0's
  attention output at position 17, whose exact value lies 0.04 fp32 ulp above a bf16 midpoint, was rounded
  fp64 -> fp32 (onto the midpoint) -> bf16 (down, ties to even), where the reference's num · fp32(1 /
  denom) lands 1 fp32 ulp above and rounds up.
* fixed-order reductions: the routed-expert combine (ascending expert id, left-to-right fp32 fold,
  `moe.combine_slots`; bitwise across ep shards, `parallel.collectives`), hc_pre / hc_post (static
  left-to-right over the n streams), the top-k weight normalisation over k terms.
* selections (expert top-k, index top-k, candidate blocks) are order-free: ties go to the lower id.
* the sampler (`serving.sampling`): each row's log-softmax normaliser over the vocabulary is summed in
  fp64 (``deterministic=True``, static), so a logprob does not depend on how many rows share the step.
* Pallas kernels accumulate in fp32 in their own tile order: in this mode "auto" resolves to "xla"
  (`dispatch.resolve`, logged once) and an explicit Pallas choice is refused (ImplError /
  NotImplementedError at the seam; the engine refuses it at start-up).

Cost (docs/benchmarks.md, "Deterministic inference: cost"): 18-31 % of decode throughput on an idle
2-core CPU for tiny (with the per-op fp32 roundings); 7-25 % on an H200 for tiny (fp64 GEMMs, and no
Pallas attention / indexer; measured before the per-op roundings, which add elementwise ops only).

Quantization (fp8/fp4 fake-quant, fp8 GEMM inputs) is part of the model and is applied in every mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST

MODES = ("bfloat16", "float32", "exact")


def act_dtype(cfg):
    """Activation dtype: jnp.bfloat16 (reference flow) or jnp.float32 ("float32" and "exact" modes)."""
    return jnp.bfloat16 if cfg.act_dtype == "bfloat16" else jnp.float32


# The levels `is_exact` returns (falsy = the fp32 sums of the bfloat16 / float32 modes).
EXACT_SUMS = 1  # the exact mode: fp64-accumulated sums
DETERMINISTIC = 2  # the deterministic mode: fp64 sums and fp64 exps (`exp_f32`)


def is_exact(cfg) -> int:
    """How `cfg` accumulates its order-sensitive sums (module docstring): 0 (fp32, the bfloat16 and float32
    modes), `EXACT_SUMS` (fp64, the exact mode) or `DETERMINISTIC` (fp64 sums and exps, ``cfg.deterministic``
    with any activation dtype). Truthy = fp64 sums; the ops take it as their ``exact`` argument."""
    if getattr(cfg, "deterministic", False):
        return DETERMINISTIC
    return EXACT_SUMS if cfg.act_dtype == "exact" else 0


def is_deterministic(cfg) -> bool:
    """Whether `cfg` runs the deterministic mode (``cfg.deterministic``): results independent of batch,
    chunking, mesh and tiling bit for bit (the exact mode alone is so only to the last fp32 ulp)."""
    return is_exact(cfg) == DETERMINISTIC


def mode_name(cfg) -> str:
    """The numerics mode in words for logs: "bfloat16", "bfloat16+deterministic", "float32", "exact"."""
    if cfg.act_dtype != "exact" and getattr(cfg, "deterministic", False):
        return "exact" if cfg.act_dtype == "float32" else f"{cfg.act_dtype}+deterministic"
    return cfg.act_dtype


def x64_scope():
    """Context manager enabling 64-bit types for the ops traced inside it only (works under ``jit``)."""
    fn = getattr(jax, "enable_x64", None)
    if fn is not None:
        return fn(True)
    from jax.experimental import enable_x64  # pragma: no cover - old JAX only
    return enable_x64(True)


def sum_f32(x, axis, exact: bool = False, keepdims: bool = False):
    """Sum of fp32 values over ``axis``; with ``exact`` accumulated in fp64 and rounded once to fp32
    (order- and shape-independent, see the module docstring)."""
    if not exact:
        return jnp.sum(x, axis=axis, keepdims=keepdims)
    with x64_scope():
        return jnp.sum(x.astype(jnp.float64), axis=axis, keepdims=keepdims).astype(jnp.float32)


def mean_f32(x, axis, exact: bool = False, keepdims: bool = False):
    """Mean of fp32 values over ``axis`` (one int); with ``exact`` the sum and the division are fp64,
    rounded once to fp32."""
    if not exact:
        return jnp.mean(x, axis=axis, keepdims=keepdims)
    with x64_scope():
        s = jnp.sum(x.astype(jnp.float64), axis=axis, keepdims=keepdims)
        return (s / x.shape[axis]).astype(jnp.float32)


def exp_f32(x, exact: int = 0):
    """``jnp.exp`` of fp32 values; at the `DETERMINISTIC` level evaluated in fp64 and rounded once to fp32
    (the exact mode keeps the fp32 exp its recorded goldens were made with). Why: XLA:CPU
    evaluates an fp32 exp fused with the subtraction before it (softmax's ``exp(x - max)``) by a code path
    that depends on the shape (measured: 27 of 2560 values 1 ulp apart between a [1, ...] and a [6, ...]
    batch of the same rows), which the bf16 roundings after it turn into different activations; the
    fp64 result rounds to the same fp32 whatever path computed it (unless it lies within an fp64 ulp of
    an fp32 rounding boundary).

    The rounding is a `round_f32` (reduce-precision), not only the convert: a caller summing the result in
    fp64 (`sum_f32`) makes an f64 -> f32 -> f64 convert chain, which XLA:CPU may drop inside a library
    fusion (measured: the sampler's normaliser ``sum_f32(exp_f32(x))`` over a [16, V] batch on one device
    went to a "ynn_fusion" that summed the unrounded fp64 exps, while the [2, V] per-device batch of a dp
    mesh summed the rounded ones: 1 fp32 ulp apart in one row's log-softmax)."""
    if not exact or exact < DETERMINISTIC:
        return jnp.exp(x)
    with x64_scope():
        return round_f32(jnp.exp(x.astype(jnp.float64))).astype(jnp.float32)


def rsqrt_f32(x, exact: int = 0):
    """``jax.lax.rsqrt`` of fp32 values `x` (any shape) -> fp32; with ``exact`` (either level) evaluated in fp64
    and rounded once to fp32 (`round_f32`): correctly rounded in practice, whatever fusion or batch shape it
    lands in. Why: XLA:CPU's fp32 rsqrt is a hardware estimate (``rsqrtss``) refined by a Newton step in fp32,
    and LLVM contracts that step's a·b + c into an FMA or not depending on the fusion it lands in (the
    module doc's FMA contraction): measured (-O0, AMD EPYC), the Engram gate over a [16, 1, 4] batch (one
    device) and over the same rows in [2, 1, 4] batches (a dp rank) parted by 1 ulp in 47 of 4096 outputs,
    and the estimate plus an FMA-contracted step, emulated in C, reproduces the [16]-row outputs bit for bit.
    In fp64 the contraction moves only fp64 ulps, which the rounding to fp32 removes (unless the value lies
    within a few fp64 ulps of an fp32 rounding boundary)."""
    if not exact:
        return jax.lax.rsqrt(x)
    with x64_scope():
        return round_f32(jax.lax.rsqrt(x.astype(jnp.float64))).astype(jnp.float32)


def round_f32(x):
    """fp64 `x` rounded to fp32 values (kept in fp64): inside the deterministic mode's fp64 evaluations, the
    fp32 rounding of every intermediate that the bf16 flow computes in fp32. A + − × ÷ or √ of fp32 values
    evaluated in fp64 and so rounded is the IEEE fp32 operation bit for bit (53 >= 2·24 + 2: the double
    rounding is innocuous), and no FMA contraction reaches across the rounding; so a chain written this
    way is the reference's fp32 chain op for op, whatever fusion or shape it lands in. Transcendentals
    (exp, rsqrt) so evaluated are correctly rounded, where XLA's fp32 versions are approximations
    (measured on CPU: exp 10 %, rsqrt 18 % of fp32 results 1 ulp off).

    A ``reduce_precision``, not a convert pair: with its default ``--xla_allow_excess_precision`` XLA
    removes chains of converts (``simplify-fp-conversions``: f64 -> f32 -> f64 becomes nothing) in some
    fusions and not in others (measured: a micro forward at batch 4 kept the fp64 value where batch 1
    rounded it), while a reduce-precision is kept. Unlike a convert it flushes values below fp32's normal
    range (2^-126) to ±0."""
    return round_to(x, jnp.float32)


def round_to(x, dtype):
    """`x` rounded to the values of the float `dtype` (ties to even) in its own dtype; see `round_f32`."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def softmax_f32(x, axis, exact: int = 0):
    """``jax.nn.softmax`` over ``axis``; with ``exact`` its denominator is summed in fp64 (`sum_f32`), at
    the `DETERMINISTIC` level its exp is fp64 too (`exp_f32`)."""
    if not exact:
        return jax.nn.softmax(x, axis=axis)
    e = exp_f32(x - jnp.max(x, axis=axis, keepdims=True), exact)
    return e / sum_f32(e, axis, True, keepdims=True)


def dot_exact(x, w, dimension_numbers):
    """``lax.dot_general`` of fp32-valued operands accumulated in fp64, rounded once to fp32."""
    with x64_scope():
        y = jax.lax.dot_general(x.astype(jnp.float64), w.astype(jnp.float64), dimension_numbers,
                                precision=HIGHEST, preferred_element_type=jnp.float64)
        return y.astype(jnp.float32)


def einsum_exact(spec, a, b):
    """``jnp.einsum`` of two operands with fp64 accumulation, rounded once to fp32 (exact mode)."""
    with x64_scope():
        y = jnp.einsum(spec, a.astype(jnp.float64), b.astype(jnp.float64), precision=HIGHEST,
                       preferred_element_type=jnp.float64)
        return y.astype(jnp.float32)


def _nk(x):
    return (((x.ndim - 1,), (1,)), ((), ()))


def linear_bf16(x, w, dt, exact: bool = False):
    """A "plain bf16 matmul" of docs/design/spec.md §1 (wo_a, ratio-1 compressor, indexer wk / weights_proj).

    x [..., K], w [N, K] bf16 -> [..., N] in `dt`; fp32 accumulation. In fp32 mode the input is not
    rounded to bf16 first; with `exact` (exact / deterministic mode) the accumulation is fp64 (the input
    still rounded to bf16 first when `dt` is bf16, as the bf16 flow does).
    """
    if exact:
        xi = x if dt == jnp.float32 else x.astype(jnp.bfloat16)
        return dot_exact(xi, w, _nk(x)).astype(dt)
    if dt == jnp.float32:
        return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y.astype(dt)


def linear_f32(x, w, exact: bool = False):
    """An "fp32 matmul on bf16-valued weights" (ratio-2 compressor, MoE gate, head, ...): fp32 out.

    x [..., K], w [N, K] -> fp32 [..., N]; HIGHEST precision (no TF32 / bf16 passes); fp64
    accumulation with `exact`.
    """
    if exact:
        return dot_exact(x, w, _nk(x))
    return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
