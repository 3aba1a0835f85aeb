"""mHC: manifold-constrained hyper-connections (docs/design/spec.md §2).

The residual stream is ``n = hc_mult`` parallel copies h [..., n, D] (bf16 in the reference
dtype flow).  Around every sublayer:

* :func:`hc_mixes` turns h into three fp32 mixings: ``pre`` [.., n] (how the streams are
  summed into the sublayer input), ``post`` [.., n] (how the sublayer output is spread back)
  and ``comb`` [.., n, n] (how the streams are remixed), the last projected onto (nearly)
  doubly-stochastic matrices by :func:`sinkhorn`.
* :func:`hc_pre` collapses the streams, :func:`hc_post` writes the sublayer output back.

All mixing arithmetic is fp32 on (possibly bf16) inputs, with one rounding to ``out_dtype`` at
the end, as the reference does.  The V4.1 "pre from previous sublayer" ordering is the
caller's business (the layer code), not this module's.

The seam the layer code calls, by implementation (`dispatch.resolve(cfg, "mhc")`):
:func:`sublayer_enter` (hc_pre with the previous sublayer's pre + this sublayer's mixes, both from
the same h, so a kernel reads h once; optionally the sublayer's RMSNorm of x_in too), :func:`sublayer_exit`
(hc_post) and :func:`sublayer_exit_enter` (one sublayer's exit and the next one's enter: the kernel keeps
the new streams in registers between the two). "reference" / "xla" run the functions above unchanged;
"pallas" / "pallas_interpret" run `dsv41_jax.pallas.mhc_mix`. A step calls the form its plan chose
(`plan.StepPlan.enter` / `exit` / `exit_enter`: these functions, or the kernels directly).
"""

from __future__ import annotations

import functools
import logging
from typing import Tuple

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import einsum_exact, is_exact, mean_f32, x64_scope

log = logging.getLogger(__name__)

__all__ = ["sinkhorn", "hc_mixes", "sublayer_mixes", "hc_pre", "hc_post", "sublayer_enter", "sublayer_exit",
           "sublayer_exit_enter"]


def sinkhorn(logits: jnp.ndarray, iters: int, eps: float, unroll: bool = False) -> jnp.ndarray:
    """Linear-space Sinkhorn normalisation, docs/design/spec.md §2 (no log domain).

    Args:
      logits: [..., n, n] float32 (cast to fp32 if not).
      iters: static Python int >= 1 (``hc_sinkhorn_iters``, 20 in flash).
      eps: ``hc_eps``, added to the softmax and to every row/column sum.
      unroll: static; unroll the iterations in the trace (the "xla" path) instead of a fori_loop.

    Returns:
      [..., n, n] float32.  ``C = row_softmax(logits) + eps``; ``C /= colsum + eps``; then
      ``iters - 1`` times: ``C /= rowsum + eps``; ``C /= colsum + eps``.  It always ends on a
      column step, so column sums are 1 (up to eps) while row sums are only close to 1.
    """
    iters = int(iters)
    if iters < 1:
        raise ValueError(f"sinkhorn iters must be >= 1, got {iters}")
    # fp64 input (the exact numerics mode) is kept in fp64; anything else computes in fp32.
    ct = jnp.float64 if logits.dtype == jnp.float64 else jnp.float32
    c = jax.nn.softmax(logits.astype(ct), axis=-1) + eps
    # The first pass is "softmax over rows, then normalise columns"; the softmax already made
    # the rows sum to 1, which is why the loop below starts with the row step.
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)  # rows
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)  # columns
        return c

    if unroll:
        # The "xla" mhc path: a static Python loop, so the whole normalisation (a few hundred
        # flops on a 4x4 matrix per token) fuses into one kernel instead of a device-side while
        # loop of iters-1 tiny steps (a launch and a loop-condition sync each on GPU). Same
        # operations in the same order as the loop below.
        for _ in range(iters - 1):
            c = body(0, c)
        return c
    # fori_loop keeps the traced graph small (the model calls this 2x per layer); the
    # arithmetic is identical to an unrolled Python loop.
    return jax.lax.fori_loop(0, iters - 1, body, c)


def hc_mixes(
    h: jnp.ndarray,
    fn: jnp.ndarray,
    base: jnp.ndarray,
    scale: jnp.ndarray,
    *,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    unroll: bool = False,
    exact: bool = False,
) -> Tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Compute the pre / post / comb mixings of one sublayer from its input streams.

    Args:
      h: [..., n, D] bf16 or float32, the residual streams.
      fn: [(2+n)*n, n*D] float32, ``hc_<s>_fn``.
      base: [(2+n)*n] float32, ``hc_<s>_base``.
      scale: [3] float32, ``hc_<s>_scale`` (for pre, post, comb).
      norm_eps: ``rms_norm_eps`` (1e-20 in flash) inside the joint rsqrt.
      hc_eps: added to ``pre`` and used as every Sinkhorn eps.
      sinkhorn_iters: static Python int, ``hc_sinkhorn_iters``.
      unroll: static; Sinkhorn unrolled (see :func:`sinkhorn`), the "xla" path.
      exact: static; the mix matmul accumulates in fp64 (the exact numerics mode).

    Returns:
      pre  [..., n]    float32, ``sigmoid(m_pre*scale[0] + base_pre) + hc_eps``;
      post [..., n]    float32, ``2*sigmoid(m_post*scale[1] + base_post)``, in (0, 2);
      comb [..., n, n] float32, ``sinkhorn(m_comb*scale[2] + base_comb)``, C[i, j] mixes
        stream i into stream j (see :func:`hc_post`).
      Here m = fp32(h_flat @ fn.T) * rsqrt(mean(h_flat**2) + norm_eps), h_flat [..., n*D]
      stream-major (index c*D + d), laid out [pre 0:n | post n:2n | comb 2n:], the comb part
      row-major: C[i, j] = m[2n + n*i + j].
    """
    n, d = h.shape[-2], h.shape[-1]
    mix = (2 + n) * n
    if fn.shape != (mix, n * d):
        raise ValueError(f"hc fn has shape {fn.shape}, expected {(mix, n * d)} for h {h.shape}")
    if base.shape != (mix,):
        raise ValueError(f"hc base has shape {base.shape}, expected {(mix,)}")
    if scale.shape != (3,):
        raise ValueError(f"hc scale has shape {scale.shape}, expected (3,)")
    lead = h.shape[:-2]

    # Stream-major flatten (c*D + d) is exactly a row-major reshape of [..., n, D].
    x = h.reshape(*lead, n * d).astype(jnp.float32)
    # One RMS over all n*D values jointly (not per stream); it is applied to the 24 mix
    # values after the matmul rather than to x, which is the same up to rounding and is how
    # the reference orders it.
    r = jax.lax.rsqrt(mean_f32(x * x, -1, exact, keepdims=True) + norm_eps)
    # An fp32 matmul: HIGHEST stops TPU/GPU defaults from dropping to bf16 / TF32 passes.
    if exact:
        m = einsum_exact("...k,mk->...m", x, fn.astype(jnp.float32))
    else:
        m = jnp.einsum(
            "...k,mk->...m",
            x,
            fn.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
    m = m * r  # [..., (2+n)*n]

    scale = scale.astype(jnp.float32)
    base = base.astype(jnp.float32)
    if exact:
        # m * scale + base in fp64: the fp32 product is exact there, so whether LLVM contracts it
        # into an FMA (XLA:CPU does in some loops of a fusion and not in others, depending on the
        # batch shape) no longer changes the result; pre / post are rounded to fp32 once before
        # the sigmoid. Sinkhorn's 4-element row/column sums are reassociated differently once XLA
        # fuses the unrolled form (1-2 fp32 ulps apart from the fori_loop): the exact mode runs it
        # in fp64 on the fp64 logits and rounds once, so every implementation and batch shape gives
        # the same fp32 result.
        with x64_scope():
            m64 = m.astype(jnp.float64)
            s64, b64 = scale.astype(jnp.float64), base.astype(jnp.float64)
            pre_l = (m64[..., :n] * s64[0] + b64[:n]).astype(jnp.float32)
            post_l = (m64[..., n: 2 * n] * s64[1] + b64[n: 2 * n]).astype(jnp.float32)
            comb_l = (m64[..., 2 * n:] * s64[2] + b64[2 * n:]).reshape(*lead, n, n)
            comb = sinkhorn(comb_l, sinkhorn_iters, hc_eps, unroll=unroll).astype(jnp.float32)
        return jax.nn.sigmoid(pre_l) + hc_eps, 2.0 * jax.nn.sigmoid(post_l), comb
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (m[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*lead, n, n)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps, unroll=unroll)
    return pre, post, comb


def sublayer_mixes(h, fn, base, scale, cfg):
    """:func:`hc_mixes` with the config's constants, by implementation (`dispatch.resolve(cfg, "mhc")`).

    "reference": today's code (Sinkhorn as a fori_loop). "xla": Sinkhorn unrolled so the mixing fuses
    into one kernel per sublayer (except on `SINKHORN_LOOP_BACKENDS`, where it stays the loop: see
    there); same operations, but XLA reassociates the fused 4-element sums, so
    comb differs by 1-2 fp32 ulps (tested: <= 1e-6 absolute on values <= 1; identical in the exact
    mode, where Sinkhorn runs in fp64). The mix matmul ([.., n·D] x [24, n·D], fp32 on the
    bf16 stream) and hc_pre / hc_post (static-order elementwise sums over n that XLA already fuses
    into one pass over h) have no cheaper XLA formulation, so both implementations share them.
    In the exact mode the mix matmul accumulates in fp64.
    """
    return _mixes(h, fn, base, scale, cfg, dispatch.resolve(cfg, "mhc"))


# Backends where the "xla" path keeps Sinkhorn as a loop. Measured on XLA:CPU (research/bench_compile.py,
# docs/results/bench_compile_cpu.json; tiny fp32 forward, 12 tokens): unrolled, the 19 iterations x 2 sublayers
# x 10 layers fuse into chains that XLA duplicates per consumer — 138K optimized HLO lines, 27.2 CPU-s
# to compile, 28.4 ms a run; as the fori_loop 50K lines, 18.5 CPU-s, 16.2 ms. A CPU runs the loop's
# tiny steps without a launch or a sync each, so there the fusion costs more than it saves.
# On XLA:GPU (sm_90, compiled on a CPU machine for a compile-only H200: scripts/aot_flash.py
# --gpu-target; research/gpu_compile_probe.py) the unrolled form is worse: priority fusion's time
# grows ~quadratically with the unrolled iterations — one tiny `hc_mixes` compiles in 2.0 / 7.5 / 25 /
# 88 s at 3 / 6 / 10 / 20 iterations, against 1.1 s as the loop — so a model with two mHC entries per
# layer never finished compiling (the tiny forward on an H200 was killed after ~190 s). The GPU runs the
# loop (iters-1 small steps per sublayer) or the Pallas mhc kernel (`mhc=pallas`), which runs the whole
# Sinkhorn in registers.
SINKHORN_LOOP_BACKENDS = ("cpu", "gpu")


@functools.lru_cache(maxsize=None)
def sinkhorn_unrolled_on(backend: str) -> bool:
    """Whether the "xla" mhc path unrolls Sinkhorn on ``backend`` (logged once per backend)."""
    unroll = backend not in SINKHORN_LOOP_BACKENDS
    log.info("mhc xla path on %s: Sinkhorn %s", backend,
             "unrolled (fuses into one kernel per sublayer)" if unroll else "as a fori_loop (cheaper to compile)")
    return unroll


def _mixes(h, fn, base, scale, cfg, impl):
    if impl not in ("reference", "xla"):
        raise dispatch.ImplError(f"mhc: no mixes-only {impl!r} implementation (the Pallas kernel fuses the "
                                 f"mixes with hc_pre: call sublayer_enter)")
    unroll = impl == "xla" and sinkhorn_unrolled_on(jax.default_backend())
    return hc_mixes(h, fn, base, scale, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                    sinkhorn_iters=cfg.hc_sinkhorn_iters, unroll=unroll, exact=is_exact(cfg))


def hc_pre(h: jnp.ndarray, pre: jnp.ndarray, out_dtype=None) -> jnp.ndarray:
    """Collapse the streams into one sublayer input.

    Args:
      h: [..., n, D] bf16 or float32.
      pre: [..., n] float32 weights (from :func:`hc_mixes`, or one-hot for the first layer).
      out_dtype: result dtype; default ``h.dtype``.

    Returns:
      [..., D] out_dtype: ``sum_i pre_i * h_i`` computed in fp32 and rounded once.
    """
    out_dtype = h.dtype if out_dtype is None else jnp.dtype(out_dtype)
    hf = h.astype(jnp.float32)
    pf = pre.astype(jnp.float32)
    n = h.shape[-2]
    # Explicit, static left-to-right accumulation over the (tiny) stream axis: fixes the
    # summation order on every backend (a reduce may be reassociated) and still fuses into one
    # elementwise kernel.
    acc = pf[..., 0, None] * hf[..., 0, :]
    for i in range(1, n):
        acc = acc + pf[..., i, None] * hf[..., i, :]
    return acc.astype(out_dtype)


def hc_post(
    y: jnp.ndarray,
    h: jnp.ndarray,
    post: jnp.ndarray,
    comb: jnp.ndarray,
    out_dtype=None,
) -> jnp.ndarray:
    """Write a sublayer output back into the streams.

    Args:
      y: [..., D] bf16 or float32, the sublayer output.
      h: [..., n, D] bf16 or float32, the sublayer's input streams (the residual).
      post: [..., n] float32.
      comb: [..., n, n] float32, C[i, j] = weight of input stream i in output stream j.
      out_dtype: result dtype; default ``h.dtype``.

    Returns:
      [..., n, D] out_dtype: ``out_j = post_j * y + sum_i C[i, j] * h_i`` in fp32, rounded
      once.
    """
    out_dtype = h.dtype if out_dtype is None else jnp.dtype(out_dtype)
    yf = y.astype(jnp.float32)
    hf = h.astype(jnp.float32)
    pf = post.astype(jnp.float32)
    cf = comb.astype(jnp.float32)
    n = h.shape[-2]
    # Residual mix first (sequential over i, static order as in hc_pre), then the branch term
    # is added: the reference's `post*y + sum_i(...)`.  Elementwise, not a K=n matmul, so it
    # is exact fp32 on every backend and fuses.
    res = cf[..., 0, :, None] * hf[..., 0, None, :]  # [..., n_j, D]
    for i in range(1, n):
        res = res + cf[..., i, :, None] * hf[..., i, None, :]
    out = pf[..., :, None] * yf[..., None, :] + res
    return out.astype(out_dtype)


def sublayer_enter(h, pre_prev, fn, base, scale, cfg, dt, layer=None, norm_weight=None):
    """Everything a sublayer needs from the streams before it runs, by implementation.

    Args:
      h: [..., n, D] bf16 or fp32, the streams entering the sublayer.
      pre_prev: [..., n] fp32, the *previous* sublayer's pre (V4.1 ordering; one-hot at the start).
      fn, base, scale: this sublayer's ``hc_<s>_fn`` [(2+n)·n, n·D], ``hc_<s>_base``, ``hc_<s>_scale``
        (fp32).
      cfg: `ModelConfig` (eps constants, the implementation switch); dt: dtype of x_in.
      layer: None, or — inside a layer-scan run where the kernel runs — the layer (int32 scalar) of
        fn / base / scale (and norm_weight) given as the run's stacks [n, ...]: the kernel reads that layer's
        rows in place (XLA would copy a sliced operand of a Pallas call per layer); the jnp paths slice it here.
      norm_weight: None, or the sublayer's RMSNorm weight [D] (``attn_norm`` / ``ffn_norm``): x_in comes back
        normed (``norm.rmsnorm``), which the kernel fuses into its tail (two XLA launches fewer per sublayer).

    Returns:
      (x_in [..., D] dt = ``hc_pre(h, pre_prev, dt)`` (normed with norm_weight), pre [..., n], post [..., n],
      comb [..., n, n]) with the mixes of :func:`sublayer_mixes` (fp32). "reference" / "xla": exactly those
      calls (bitwise today's numbers); Pallas: one fused pass over h (`dsv41_jax.pallas.mhc_mix`).
    """
    impl = dispatch.resolve(cfg, "mhc")
    if dispatch.is_kernel(impl):
        return dispatch.kernel("mhc", impl)(h, pre_prev, fn, base, scale, cfg, dt, interpret=impl == "pallas_interpret",
                                            layer=layer, norm_weight=norm_weight)
    if layer is not None:
        fn, base, scale = fn[layer], base[layer], scale[layer]
        norm_weight = None if norm_weight is None else norm_weight[layer]
    x_in = hc_pre(h, pre_prev, dt)
    if norm_weight is not None:
        x_in = rmsnorm(x_in, norm_weight, cfg.rms_norm_eps, dt, is_exact(cfg))
    return (x_in, *_mixes(h, fn, base, scale, cfg, impl))


def sublayer_exit(y, h, post, comb, cfg, dt):
    """Write the sublayer output back into the streams, by implementation: ``hc_post(y, h, post, comb,
    dt)`` ("reference" / "xla", unchanged) or its Pallas kernel.

    y: [..., D]; h: [..., n, D] (the streams that entered the sublayer); post: fp32 [..., n];
    comb: fp32 [..., n, n]. Returns [..., n, D] in `dt`.
    """
    impl = dispatch.resolve(cfg, "mhc")
    if dispatch.is_kernel(impl):
        return dispatch.kernel("mhc", impl, "sublayer_exit")(y, h, post, comb, cfg, dt,
                                                            interpret=impl == "pallas_interpret")
    if impl not in ("reference", "xla"):
        raise dispatch.ImplError(f"mhc: no {impl!r} implementation")
    return hc_post(y, h, post, comb, dt)


def sublayer_exit_enter(y, h, post, comb, pre_prev, fn, base, scale, cfg, dt, layer=None, norm_weight=None):
    """Leave one sublayer and enter the next: (h', (x_in, pre, post, comb)) with
    ``h' = sublayer_exit(y, h, post, comb, cfg, dt)`` and the rest ``sublayer_enter(h', pre_prev, fn, base,
    scale, cfg, dt, layer, norm_weight)`` — pre_prev being the exiting sublayer's pre. "reference" / "xla":
    exactly those two calls; Pallas: one kernel pass (`mhc_mix.exit_enter`: each chunk of h' is written
    once and used from registers, one launch fewer)."""
    impl = dispatch.resolve(cfg, "mhc")
    if dispatch.is_kernel(impl):
        return dispatch.kernel("mhc", impl, "sublayer_exit_enter")(
            y, h, post, comb, pre_prev, fn, base, scale, cfg, dt, interpret=impl == "pallas_interpret", layer=layer,
            norm_weight=norm_weight)
    h = sublayer_exit(y, h, post, comb, cfg, dt)
    return h, sublayer_enter(h, pre_prev, fn, base, scale, cfg, dt, layer=layer, norm_weight=norm_weight)
