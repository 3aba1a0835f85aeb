"""V4's weights on the shared matmul kinds (docs/design/v4.md, "fp8 128 x 128 blocks").

A dense V4 weight is either plain — ``{"weight": [N, K]}`` in bf16 or fp32 (transformers' ``save_pretrained``
writes fp32) — or fp8 e4m3 with one e8m0 scale per ``weight_block_size`` block (``{"weight", "scale"}``, the
release's 128 x 128). Both are multiplied as `numerics.linear_f32` (fp32 HIGHEST, fp64-accumulated in the
exact modes): the fp8 weight dequantized exactly (`quant.dequantize_fp8_block` with the config's block), the
activation fp8 fake-quantized per ``act_quant_block`` in the release numerics (`v4.numerics.gemm_input`; that is
the release's blockwise fp8 GEMM up to the fp32 summation order), else as it is. Routed experts stored as MXFP4:
in the release numerics the same rule on the exactly dequantized weight; otherwise V4.1's `model.linear.mxfp4`
(the same experts format, V4.1's 32-wide activation blocks).

The linear op's Pallas kernel (`pallas.quant_linear`, the registry's ("linear", "kernel")) runs these GEMMs where
its arithmetic is V4's: in the release numerics only, with the config's blocks declared to it (activation fp8 per
``act_quant_block``, fp8 weight scales per ``weight_block_size``; MXFP4 experts per 1 x 32) — fp8 activation codes
times fp8 / e2m1 weight codes, per-block power-of-two scales, exact products summed in fp32 per K chunk: the jnp
path's products, in another fp32 summation order (docs/design/v4.md "Kernels"). Without ``act_quant_block`` V4
multiplies the *unquantized* activation, which the kernel never does: refused (`kernel_refusal`), as are the exact
/ deterministic modes, ``release_order`` "torch_cpu", plain checkpoints, blocks the kernel's tiles do not take and a
mesh (the kernel runs on one device). Plain weights keep the jnp path (the release's ``F.linear`` branch).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import dispatch, quant, tiling
from dsv41_jax.model import linear as linear41
from dsv41_jax.model.numerics import is_exact, linear_f32, mode_name
from dsv41_jax.model.v4.numerics import gemm_input
from dsv41_jax.model.weights import Fp8, Mxfp4


def kernel_refusal(cfg, impl: str, par=None):
    """Why V4's fp8 / MXFP4 GEMMs cannot run the linear kernel `impl` with `cfg` (on mesh plan `par`, default the one
    being traced for): one line naming the op and what does not fit, or None (module doc; the registered
    ("linear", "kernel")'s `supports` says the same)."""
    bs = tuple(cfg.weight_block_size)
    if cfg.release_order == "torch_cpu":
        return f"linear={impl}: release_order 'torch_cpu' runs the release's torch order (research), not a kernel"
    if is_exact(cfg):
        return f"linear={impl}: the {mode_name(cfg)} numerics mode accumulates in fp64, the kernel in fp32"
    if not cfg.act_quant_block:
        return (f"linear={impl}: V4.1's quantized-linear kernel fake-quantizes its input to fp8, V4 only in the release "
                f"numerics (act_quant_block); here V4's dense weights are " +
                (f"fp8 in {bs[0]}x{bs[1]} blocks" if bs else "plain") + " times the unquantized activation (fp32 matmul)")
    if not bs:
        return f"linear={impl}: this checkpoint's dense weights are plain (no fp8 GEMM for the kernel)"
    if not dispatch.supports("linear", "kernel", cfg):
        return (f"linear={impl}: the kernel takes power-of-two blocks >= 32, not activation {cfg.act_quant_block} / "
                f"weight {'x'.join(map(str, bs))}")
    par = tiling.mesh_plan() if par is None else par
    if par is not None and int(par.size) > 1:  # the weights are split there: a Pallas call would gather them
        return f"linear={impl}: the quant_linear kernel runs on one device, not on a mesh of {int(par.size)}"
    return None


def kernel_impl(cfg):
    """The Pallas implementation V4's fp8 / MXFP4 GEMMs run with, or None for the jnp path: an explicit kernel that
    does not fit is refused (NotImplementedError, `kernel_refusal`'s line); "auto" only picks one that fits."""
    impl = dispatch.resolve(cfg, "linear")
    if not dispatch.is_kernel(impl):
        return None
    why = kernel_refusal(cfg, impl)
    if why is None:
        return impl
    if dispatch.parse_impl(cfg.impl)["linear"] == "auto":
        return None
    raise NotImplementedError(f"DeepSeek-V4: {why}")


def _kernel(x, p, fmt: str, cfg, dt, impl: str):
    """The linear kernel on V4's blocks (module doc): fp8 [N, K] in ``weight_block_size`` blocks or MXFP4."""
    blocks = dict(act_block=int(cfg.act_quant_block))
    if fmt == "fp8":
        blocks["weight_block"] = tuple(int(b) for b in cfg.weight_block_size)
    return dispatch.kernel("linear", impl)(x, p, fmt, dt, cfg, interpret=impl == "pallas_interpret", **blocks)


def weight(p, cfg):
    """The dense weight [N, K] as a float array: plain as stored, fp8 blocks dequantized to fp32 (exact)."""
    if not isinstance(p, Fp8):
        return p["weight"]
    bs = cfg.weight_block_size
    if len(bs) != 2 or bs[0] != bs[1]:
        raise NotImplementedError(f"fp8 weight blocks {tuple(bs)}: only square blocks are implemented")
    return quant.dequantize_fp8_block(p.weight, p.scale, out_dtype=jnp.float32, block=int(bs[0]))


def dense(x, p, cfg, dt):
    """x [..., K] -> [..., N] in `dt`: an fp32 matmul on the weight of `weight` (fp64 sums in the exact modes); an fp8
    weight with a Pallas linear implementation: the kernel (module doc)."""
    impl = kernel_impl(cfg) if isinstance(p, Fp8) else None
    if impl is not None:
        return _kernel(x, p, "fp8", cfg, dt, impl)
    return linear_f32(gemm_input(x, p, cfg), weight(p, cfg), is_exact(cfg)).astype(dt)


def dense_f32(x, p, cfg):
    """`dense` without the rounding to `dt`: fp32 [..., N] (the compressor's and the gate's scores)."""
    impl = kernel_impl(cfg) if isinstance(p, Fp8) else None
    if impl is not None:
        return _kernel(x, p, "fp8", cfg, jnp.float32, impl)
    return linear_f32(gemm_input(x, p, cfg), weight(p, cfg), is_exact(cfg))


def is_mxfp4(p) -> bool:
    """Whether a (stacked or one expert's) weight is packed MXFP4 (uint8 codes + e8m0 scales)."""
    return isinstance(p, Mxfp4)


def expert(x, p, cfg, dt):
    """One routed expert's projection: MXFP4 through V4.1's `linear.mxfp4` (in the release numerics: its activation
    blocks, on the exactly dequantized weight, or the linear kernel with those blocks), else `dense`."""
    if is_mxfp4(p) and cfg.act_quant_block:
        impl = kernel_impl(cfg)
        if impl is not None:
            return _kernel(x, p, "mxfp4", cfg, dt, impl)
        w = quant.dequantize_mxfp4(p.weight, p.scale, out_dtype=jnp.float32)
        return linear_f32(gemm_input(x, p, cfg), w, is_exact(cfg)).astype(dt)
    if is_mxfp4(p):
        return linear41.mxfp4(x, p, cfg, dt)
    return dense(x, p, cfg, dt)
