"""The dtype policy (SPEC §1 "Numerics") and the plain-matmul kinds.

`act_dtype(cfg)` is bf16 in the reference dtype flow: every activation between ops is rounded to
bf16. In the full-fp32 mode (``cfg.act_dtype == "float32"``) those roundings are skipped, so two
computations that differ only in summation order agree to ~1e-6 and discrete choices (top-k) do not
flip on rounding noise. Quantization (fp8/fp4 fake-quant, fp8 GEMM inputs) is part of the model and is
applied in both modes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def act_dtype(cfg):
    """Activation dtype: jnp.bfloat16 (reference) or jnp.float32 (equivalence mode)."""
    return jnp.float32 if cfg.act_dtype == "float32" else jnp.bfloat16


def round_act(x, dt):
    """Round a fp32 intermediate to the activation dtype (bf16 in the reference flow)."""
    return x.astype(dt)


def linear_bf16(x, w, dt):
    """A "plain bf16 matmul" of SPEC §1 (wo_a, ratio-1 compressor, indexer wk / weights_proj).

    x [..., K], w [N, K] bf16 -> [..., N] in `dt`; fp32 accumulation. In fp32 mode the input is not
    rounded to bf16 first.
    """
    if dt == jnp.float32:
        return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    return y.astype(dt)


def linear_f32(x, w):
    """An "fp32 matmul on bf16-valued weights" (ratio-2 compressor, MoE gate, head, ...): fp32 out."""
    return jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)
