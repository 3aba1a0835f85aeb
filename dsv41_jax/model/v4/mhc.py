"""V4's mHC ordering (docs/design/v4.md, "mHC, pre-mix and hc_head").

V4.1 collapses a sublayer's input with the *previous* sublayer's pre (lagged, `mhc.sublayer_enter`); V4 with
the pre of the sublayer's own mixes (``mhc_variant`` "pre_mix"): (pre, post, comb) = `mhc.hc_mixes`(h),
x = norm(`mhc.hc_pre`(h, pre)), and the exit is V4.1's (`mhc.sublayer_exit`). The model output is collapsed
by ``hc_head`` (`head_collapse`): pre = sigmoid(rms-scaled (h_flat · fnᵀ) · scale + base) + hc_eps [n],
x = Σ_i pre_i · h_i — `hc_mixes`' pre row with its own fn [n, n·D], base [n] and one scale.

The mixes run the plain-jnp reference (`mhc.hc_mixes`, Sinkhorn as a loop): V4.1's Pallas enter kernel fuses
the lagged collapse and does not apply; an explicit ``mhc=pallas`` is refused (`enter`). With
``release_order`` "torch_cpu" (research) the mixes, collapses, exit and norms are `torch_order`'s: the release's
order under torch on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model.mhc import hc_mixes, hc_post, hc_pre
from dsv41_jax.model.numerics import HIGHEST, einsum_exact, is_exact, mean_f32
from dsv41_jax.model.v4 import torch_order


def _check_impl(cfg):
    if dispatch.is_kernel(dispatch.parse_impl(cfg.impl)["mhc"]):
        raise NotImplementedError("DeepSeek-V4's pre-mix mHC has no Pallas kernel (V4.1's fuses the lagged "
                                  "collapse); use 'mhc=xla' / 'reference' / 'auto'")


def enter(h, lp, sub: str, cfg, dt):
    """Enter sublayer `sub` ("attn" | "ffn") of layer params `lp` from the streams h [.., n, D]: returns
    (x [.., D] in `dt`: the sublayer's RMSNorm of hc_pre(h, its own pre), post fp32 [.., n], comb [.., n, n])."""
    _check_impl(cfg)
    mix = (torch_order.hc_mixes if cfg.release_order == "torch_cpu" else
           functools.partial(hc_mixes, exact=is_exact(cfg)))
    pre, post, comb = mix(h, lp[f"hc_{sub}_fn"], lp[f"hc_{sub}_base"], lp[f"hc_{sub}_scale"],
                          norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)
    collapse = torch_order.hc_pre if cfg.release_order == "torch_cpu" else hc_pre
    x = torch_order.norm_fn(cfg)(collapse(h, pre, dt), lp[f"{sub}_norm"]["weight"], cfg.rms_norm_eps, dt,
                                 is_exact(cfg))
    return x, post, comb


def leave(y, h, post, comb, cfg, dt):
    """Write sublayer output y [.., D] back into the streams h [.., n, D] (`mhc.hc_post`; `torch_order.hc_post`
    with ``release_order`` "torch_cpu") -> [.., n, D] in `dt`."""
    return (torch_order.hc_post if cfg.release_order == "torch_cpu" else hc_post)(y, h, post, comb, dt)


def head_collapse(h, fn, base, scale, cfg, dt):
    """The model-level ``hc_head``: streams h [.., n, D] -> [.., D] in `dt` (module doc). fn fp32 [n, n·D],
    base [n], scale [1]. With ``release_order`` "torch_cpu": `torch_order.head_collapse`."""
    if cfg.release_order == "torch_cpu":
        return torch_order.head_collapse(h, fn, base, scale, cfg, dt)
    n, d = h.shape[-2:]
    x = h.reshape(h.shape[:-2] + (n * d,)).astype(jnp.float32)
    r = jax.lax.rsqrt(mean_f32(x * x, -1, is_exact(cfg), keepdims=True) + cfg.rms_norm_eps)
    if is_exact(cfg):
        m = einsum_exact("...k,mk->...m", x, fn.astype(jnp.float32))
    else:
        m = jnp.einsum("...k,mk->...m", x, fn.astype(jnp.float32), precision=HIGHEST)
    pre = jax.nn.sigmoid(m * r * scale.astype(jnp.float32)[0] + base.astype(jnp.float32)) + cfg.hc_eps
    return hc_pre(h, pre, dt)
