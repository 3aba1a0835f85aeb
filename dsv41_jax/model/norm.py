"""RMSNorm (fp32 math on the activation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model.numerics import DETERMINISTIC, mean_f32, x64_scope


def rmsnorm(x, weight, eps, dt, exact: bool = False):
    """x [..., d] (bf16/f32), weight [d] bf16 -> [..., d] in `dt`.

    y = x · rsqrt(mean(x²) + eps) · weight, computed in fp32 and rounded once. Note eps = 1e-20 for
    V4.1 (docs/design/spec.md §1): a zero vector stays zero rather than dividing by zero because rsqrt(1e-20)·0 = 0.
    `exact` (the exact numerics mode): the mean is accumulated in fp64 (`numerics.mean_f32`); at the
    deterministic level (`numerics.DETERMINISTIC`) the whole formula is evaluated in fp64 and rounded once.
    """
    if exact and exact >= DETERMINISTIC:
        # the whole chain in fp64, rounded once: no fusion-dependent fp32 step (numerics module doc)
        with x64_scope():
            xd = x.astype(jnp.float64)
            r = jax.lax.rsqrt(jnp.mean(xd * xd, axis=-1, keepdims=True) + eps)
            return (xd * r * weight.astype(jnp.float64)).astype(jnp.float32).astype(dt)
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(mean_f32(xf * xf, -1, exact, keepdims=True) + eps)
    return (xf * r * weight.astype(jnp.float32)).astype(dt)
