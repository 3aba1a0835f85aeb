"""RMSNorm (fp32 math on the activation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rmsnorm(x, weight, eps, dt):
    """x [..., d] (bf16/f32), weight [d] bf16 -> [..., d] in `dt`.

    y = x · rsqrt(mean(x²) + eps) · weight, computed in fp32 and rounded once. Note eps = 1e-20 for
    V4.1 (SPEC §1): a zero vector stays zero rather than dividing by zero because rsqrt(1e-20)·0 = 0.
    """
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r * weight.astype(jnp.float32)).astype(dt)
