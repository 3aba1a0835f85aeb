"""V4's mHC ordering (docs/design/v4.md, "mHC, pre-mix and hc_head").

V4.1 collapses a sublayer's input with the *previous* sublayer's pre (lagged, `mhc.sublayer_enter`); V4 with
the pre of the sublayer's own mixes (``mhc_variant`` "pre_mix"): (pre, post, comb) = `mhc.hc_mixes`(h),
x = norm(`mhc.hc_pre`(h, pre)), and the exit is V4.1's (`mhc.sublayer_exit`). The model output is collapsed
by ``hc_head`` (`head_collapse`): pre = sigmoid(rms-scaled (h_flat · fnᵀ) · scale + base) + hc_eps [n],
x = Σ_i pre_i · h_i — `hc_mixes`' pre row with its own fn [n, n·D], base [n] and one scale.

The mixes run the plain-jnp reference (`mhc.hc_mixes`, Sinkhorn as a loop) unless the config names a Pallas mhc
implementation explicitly (``mhc=pallas`` / ``pallas_interpret``; "auto" keeps the jnp path: the kernel is not timed
for V4): then the mixes, Sinkhorn included, are V4.1's enter kernel's (`mhc.sublayer_enter`, the registry's
("mhc", "kernel")), whose fused collapse is V4.1's lagged one — V4 gives it a zero pre_prev and collapses with the
pre it returns (`mhc.hc_pre`, jnp) — and the exit is V4.1's exit kernel (`mhc.sublayer_exit`, ("mhc",
"sublayer_exit"): `mhc.hc_post` as one kernel). With ``release_order`` "torch_cpu" (research) the mixes,
collapses, exit and norms are `torch_order`'s: the release's order under torch on CPU (no kernel:
`kernel_refusal`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import dispatch
from dsv41_jax.model import mhc as mhc41
from dsv41_jax.model.mhc import hc_mixes, hc_post, hc_pre
from dsv41_jax.model.numerics import HIGHEST, einsum_exact, is_exact, mean_f32, mode_name
from dsv41_jax.model.v4 import torch_order


def kernel_refusal(cfg, impl: str):
    """Why V4's mHC cannot run the mhc kernel `impl` with `cfg` (one line naming the op and what does not fit), or
    None (module doc: V4.1's enter kernel for the mixes, its exit kernel for hc_post)."""
    if cfg.release_order == "torch_cpu":
        return f"mhc={impl}: release_order 'torch_cpu' runs the release's torch order (research), not a kernel"
    if is_exact(cfg):
        return f"mhc={impl}: the {mode_name(cfg)} numerics mode accumulates in fp64, the kernel in fp32"
    if not dispatch.supports("mhc", "kernel", cfg):
        return f"mhc={impl}: the kernel's tiles need a power-of-two hc_mult, not {cfg.hc_mult}"
    return None


def _kernel_impl(cfg):
    """The explicit Pallas mhc implementation, or None (the jnp path; "auto" included: module doc)."""
    impl = dispatch.parse_impl(cfg.impl)["mhc"]
    if not dispatch.is_kernel(impl):
        return None
    why = kernel_refusal(cfg, impl)
    if why is not None:
        raise NotImplementedError(f"DeepSeek-V4: {why}")
    return impl


def mixes(h, lp, sub: str, cfg, dt):
    """Sublayer `sub`'s mixes of the streams h [.., n, D]: (pre [.., n], post [.., n], comb [.., n, n]) fp32, by
    implementation (module doc)."""
    w = (lp[f"hc_{sub}_fn"], lp[f"hc_{sub}_base"], lp[f"hc_{sub}_scale"])
    if _kernel_impl(cfg) is not None:  # the kernel's mixes; its lagged collapse (of a zero pre_prev) unused
        return mhc41.sublayer_enter(h, jnp.zeros(h.shape[:-1], jnp.float32), *w, cfg, dt)[1:]
    mix = (torch_order.hc_mixes if cfg.release_order == "torch_cpu" else
           functools.partial(hc_mixes, exact=is_exact(cfg)))
    return mix(h, *w, norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, sinkhorn_iters=cfg.hc_sinkhorn_iters)


def enter(h, lp, sub: str, cfg, dt):
    """Enter sublayer `sub` ("attn" | "ffn") of layer params `lp` from the streams h [.., n, D]: returns
    (x [.., D] in `dt`: the sublayer's RMSNorm of hc_pre(h, its own pre), post fp32 [.., n], comb [.., n, n])."""
    pre, post, comb = mixes(h, lp, sub, cfg, dt)
    collapse = torch_order.hc_pre if cfg.release_order == "torch_cpu" else hc_pre
    x = torch_order.norm_fn(cfg)(collapse(h, pre, dt), lp[f"{sub}_norm"]["weight"], cfg.rms_norm_eps, dt,
                                 is_exact(cfg))
    return x, post, comb


def leave(y, h, post, comb, cfg, dt):
    """Write sublayer output y [.., D] back into the streams h [.., n, D] (`mhc.hc_post`; its kernel with an explicit
    Pallas mhc implementation; `torch_order.hc_post` with ``release_order`` "torch_cpu") -> [.., n, D] in `dt`."""
    if _kernel_impl(cfg) is not None:
        return mhc41.sublayer_exit(y, h, post, comb, cfg, dt)  # V4.1's exit kernel
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
