"""RMSNorm (fp32 math on the activation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model.numerics import mean_f32


def rmsnorm(x, weight, eps, dt, exact: bool = False):
    """x [..., d] (bf16/f32), weight [d] bf16 -> [..., d] in `dt`.

    y = x · rsqrt(mean(x²) + eps) · weight, computed in fp32 and rounded once. Note eps = 1e-20 for
    V4.1 (docs/design/spec.md §1): a zero vector stays zero rather than dividing by zero because rsqrt(1e-20)·0 = 0.
    `exact` (the exact numerics mode): the mean is accumulated in fp64 (`numerics.mean_f32`).
    """
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(mean_f32(xf * xf, -1, exact, keepdims=True) + eps)
    return (xf * r * weight.astype(jnp.float32)).astype(dt)
