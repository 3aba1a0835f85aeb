"""V4's mHC ordering (docs/design/v4.md, "mHC, pre-mix and hc_head").

V4.1 collapses a sublayer's input with the *previous* sublayer's pre (lagged, `mhc.sublayer_enter`); V4 with
the pre of the sublayer's own mixes (``mhc_variant`` "pre_mix"): (pre, post, comb) = `mhc.hc_mixes`(h),
x = norm(`mhc.hc_pre`(h, pre)), and the exit is V4.1's (`mhc.sublayer_exit`). The model output is collapsed
by ``hc_head`` (`head_collapse`): pre = sigmoid(rms-scaled (h_flat · fnᵀ) · scale + base) + hc_eps [n],
x = Σ_i pre_i · h_i — `hc_mixes`' pre row with its own fn [n, n·D], base [n] and one scale.

The mixes run the plain-jnp reference (`mhc.hc_mixes`, Sinkhorn as a loop): V4.1's Pallas enter kernel fuses
the lagged collapse and does not apply; an explicit ``mhc=pallas`` is refused (`enter`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model.mhc import hc_mixes, hc_pre
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import HIGHEST, einsum_exact, is_exact, mean_f32


def _check_impl(cfg):
    if dispatch.is_kernel(dispatch.parse_impl(cfg.impl)["mhc"]):
        raise NotImplementedError("DeepSeek-V4's pre-mix mHC has no Pallas kernel (V4.1's fuses the lagged "
                                  "collapse); use 'mhc=xla' / 'reference' / 'auto'")


def enter(h, lp, sub: str, cfg, dt):
    """Enter sublayer `sub` ("attn" | "ffn") of layer params `lp` from the streams h [.., n, D]: returns
    (x [.., D] in `dt`: the sublayer's RMSNorm of hc_pre(h, its own pre), post fp32 [.., n], comb [.., n, n])."""
    _check_impl(cfg)
    pre, post, comb = hc_mixes(h, lp[f"hc_{sub}_fn"], lp[f"hc_{sub}_base"], lp[f"hc_{sub}_scale"],
                               norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                               exact=is_exact(cfg))
    x = rmsnorm(hc_pre(h, pre, dt), lp[f"{sub}_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return x, post, comb


def head_collapse(h, fn, base, scale, cfg, dt):
    """The model-level ``hc_head``: streams h [.., n, D] -> [.., D] in `dt` (module doc). fn fp32 [n, n·D],
    base [n], scale [1]."""
    n, d = h.shape[-2:]
    x = h.reshape(h.shape[:-2] + (n * d,)).astype(jnp.float32)
    r = jax.lax.rsqrt(mean_f32(x * x, -1, is_exact(cfg), keepdims=True) + cfg.rms_norm_eps)
    if is_exact(cfg):
        m = einsum_exact("...k,mk->...m", x, fn.astype(jnp.float32))
    else:
        m = jnp.einsum("...k,mk->...m", x, fn.astype(jnp.float32), precision=HIGHEST)
    pre = jax.nn.sigmoid(m * r * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + cfg.hc_eps
    return hc_pre(h, pre, dt)
