"""RMSNorm (fp32 math on the activation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.numerics import DETERMINISTIC, mean_f32, round_f32, x64_scope


def rmsnorm(x, weight, eps, dt, exact: bool = False):
    """x [..., d] (bf16/f32), weight [d] bf16 -> [..., d] in `dt`.

    y = x · rsqrt(mean(x²) + eps) · weight, computed in fp32 and rounded once. Note eps = 1e-20 for
    V4.1 (docs/design/spec.md §1): a zero vector stays zero rather than dividing by zero because rsqrt(1e-20)·0 = 0.
    `exact` (the exact numerics mode): the mean is accumulated in fp64 (`numerics.mean_f32`); at the
    deterministic level (`numerics.DETERMINISTIC`) every op of the formula is evaluated in fp64 and rounded to
    fp32 as the fp32 formula rounds (`numerics.round_f32`), then to `dt`.
    """
    if exact and exact >= DETERMINISTIC:
        # the fp32 chain below op for op, each op evaluated in fp64 and rounded to fp32 (`round_f32`): the
        # same roundings as the bf16 flow, none of them fusion-dependent (numerics module doc)
        r = round_f32
        with x64_scope():
            xd = x.astype(jnp.float64)
            ms = r(r(jnp.sum(r(xd * xd), axis=-1, keepdims=True)) / x.shape[-1])
            rs = r(jax.lax.rsqrt(r(ms + float(np.float32(eps)))))  # eps as the fp32 chain adds it
            return r(r(xd * rs) * weight.astype(jnp.float64)).astype(jnp.float32).astype(dt)
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(mean_f32(xf * xf, -1, exact, keepdims=True) + eps)
    return (xf * r * weight.astype(jnp.float32)).astype(dt)
