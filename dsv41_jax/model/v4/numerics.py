"""V4's release numerics: where the release's ``inference/model.py`` quantizes, on the shared quant ops
(docs/design/v4.md "Numerics"; `config_v4.RELEASE_NUMERICS`, each hook a no-op while its block is 0).

* `gemm_input` — every fp8 / MXFP4 GEMM's input fake-quantized to fp8 e4m3 with one power-of-two scale per
  ``act_quant_block`` (128) along K (the release's ``linear`` → ``act_quant(x, 128, "ue8m0")`` → ``fp8_gemm`` /
  ``fp4_gemm``: the same values as `quant.fake_quant_fp8` times the exactly dequantized weight); plain (bf16 /
  fp32) weights take their input as it is, as the release's ``F.linear`` branch.
* `kv_entries` — the window K=V and the attention compressors' entries: the non-RoPE channels fake-quantized to
  fp8 per ``kv_quant_block`` (64), the RoPE channels kept (``act_quant(kv[..., :-rd], 64, ..., inplace=True)``).
* `index_rotated` — the Lightning indexer's queries and its compressor's keys: `quant.hadamard`, then FP4 (e2m1,
  power-of-two scale per ``index_fp4_block`` = 32, `quant.fake_quant_fp4_pow2`; ``rotate_activation`` +
  ``fp4_act_quant(x, 32, inplace=True)``).
* `head_rms` — the ``q_head_norm`` in the release's own arithmetic: in the bf16 flow it is bf16 tensor math
  (``q *= rsqrt(q.square().mean(-1) + eps)``: the squares, the mean, the sum with eps, the rsqrt and the product
  each rounded to bf16); in fp32 the shared RMSNorm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.model import quant
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import is_exact, mean_f32, round_to
from dsv41_jax.model.weights import Fp8, Mxfp4


def gemm_input(x, p, cfg):
    """The input of a GEMM with weight `p`: fp8 fake-quantized per ``act_quant_block`` (fp32) when the weight is
    fp8 / MXFP4 and the block is set, else `x` unchanged."""
    if not cfg.act_quant_block or not isinstance(p, (Fp8, Mxfp4)):
        return x
    return quant.fake_quant_fp8(x, block=cfg.act_quant_block, out_dtype=jnp.float32)


def kv_entries(kv, cfg, dt):
    """KV entries [..., hd] (RoPE'd, in `dt`): channels [0, hd − rd) fp8 fake-quantized per ``kv_quant_block``."""
    b = cfg.kv_quant_block
    if not b:
        return kv
    nope = kv.shape[-1] - cfg.qk_rope_head_dim
    q = quant.fake_quant_fp8(kv[..., :nope], block=b, out_dtype=dt)
    return jnp.concatenate([q, kv[..., nope:].astype(dt)], axis=-1)


def index_rotated(x, cfg, dt):
    """Index queries [.., nI, dI] / keys [.., dI] (RoPE'd): Hadamard-rotated (rounded to `dt`), then FP4 fake-quant
    per ``index_fp4_block``."""
    b = cfg.index_fp4_block
    if not b:
        return x
    return quant.fake_quant_fp4_pow2(quant.hadamard(x, out_dtype=dt), block=b, out_dtype=dt)


def head_rms(q, cfg, dt):
    """q [.., H, hd] · rsqrt(mean(q²) + eps) per head (module doc): bf16 step roundings in the bf16 flow."""
    eps = cfg.rms_norm_eps
    if dt != jnp.bfloat16:
        return rmsnorm(q, jnp.ones((q.shape[-1],), jnp.float32), eps, dt, is_exact(cfg))
    r = lambda a: round_to(a, jnp.bfloat16)  # noqa: E731  (a reduce-precision: XLA never folds it away)
    qf = q.astype(jnp.float32)
    ms = r(mean_f32(r(qf * qf), -1, is_exact(cfg), keepdims=True))
    return (qf * r(jax.lax.rsqrt(r(ms + jnp.float32(eps))))).astype(jnp.bfloat16)
