"""V4's weights on the shared matmul kinds (docs/design/v4.md, "fp8 128 x 128 blocks").

A dense V4 weight is either plain — ``{"weight": [N, K]}`` in bf16 or fp32 (transformers' ``save_pretrained``
writes fp32) — or fp8 e4m3 with one e8m0 scale per ``weight_block_size`` block (``{"weight", "scale"}``, the
release's 128 x 128). Both are multiplied as `numerics.linear_f32` (fp32 HIGHEST, fp64-accumulated in the
exact modes): the fp8 weight dequantized exactly (`quant.dequantize_fp8_block` with the config's block), the
activation fp8 fake-quantized per ``act_quant_block`` in the release numerics (`v4.numerics.gemm_input`; that is
the release's blockwise fp8 GEMM up to the fp32 summation order), else as it is. Routed experts stored as MXFP4:
in the release numerics the same rule on the exactly dequantized weight; otherwise V4.1's `model.linear.mxfp4`
(the same experts format, V4.1's 32-wide activation blocks).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import linear as linear41
from dsv41_jax.model import quant
from dsv41_jax.model.numerics import is_exact, linear_f32
from dsv41_jax.model.v4.numerics import gemm_input
from dsv41_jax.model.weights import Fp8, Mxfp4


def weight(p, cfg):
    """The dense weight [N, K] as a float array: plain as stored, fp8 blocks dequantized to fp32 (exact)."""
    if not isinstance(p, Fp8):
        return p["weight"]
    bs = cfg.weight_block_size
    if len(bs) != 2 or bs[0] != bs[1]:
        raise NotImplementedError(f"fp8 weight blocks {tuple(bs)}: only square blocks are implemented")
    return quant.dequantize_fp8_block(p.weight, p.scale, out_dtype=jnp.float32, block=int(bs[0]))


def dense(x, p, cfg, dt):
    """x [..., K] -> [..., N] in `dt`: an fp32 matmul on the weight of `weight` (fp64 sums in the exact modes)."""
    return linear_f32(gemm_input(x, p, cfg), weight(p, cfg), is_exact(cfg)).astype(dt)


def dense_f32(x, p, cfg):
    """`dense` without the rounding to `dt`: fp32 [..., N] (the compressor's and the gate's scores)."""
    return linear_f32(gemm_input(x, p, cfg), weight(p, cfg), is_exact(cfg))


def is_mxfp4(p) -> bool:
    """Whether a (stacked or one expert's) weight is packed MXFP4 (uint8 codes + e8m0 scales)."""
    return isinstance(p, Mxfp4)


def expert(x, p, cfg, dt):
    """One routed expert's projection: MXFP4 through V4.1's `linear.mxfp4` (in the release numerics: its activation
    blocks, on the exactly dequantized weight), else `dense`."""
    if is_mxfp4(p) and cfg.act_quant_block:
        w = quant.dequantize_mxfp4(p.weight, p.scale, out_dtype=jnp.float32)
        return linear_f32(gemm_input(x, p, cfg), w, is_exact(cfg)).astype(dt)
    if is_mxfp4(p):
        return linear41.mxfp4(x, p, cfg, dt)
    return dense(x, p, cfg, dt)
