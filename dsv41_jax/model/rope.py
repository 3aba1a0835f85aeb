"""Rotary position embedding (docs/design/spec.md §3, RoPE bullet).

Two pieces:

* :func:`rope_freqs` builds the per-pair frequencies once, on the host, in numpy fp32
  (they are config constants, so they never need to be traced).
* :func:`apply_rope` rotates the **last** ``rd = 2 * len(freqs)`` dims of a vector, pairs
  interleaved as (2i, 2i+1), by the angle ``fp32(pos) * f_i``; the rotation is computed in
  fp32 and rounded once to the output dtype (bf16 in the reference dtype flow).

Which base / YaRN setting a layer uses is the caller's business: layers with
compress_ratio > 0 use ``compress_rope_theta`` with YaRN for everything in them, ratio-0
layers use ``rope_theta`` without YaRN (``yarn=None``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

__all__ = ["yarn_correction_range", "rope_freqs", "apply_rope"]


def yarn_correction_range(
    rope_dim: int, base: float, beta_fast: float, beta_slow: float, original_max_position_embeddings: int
) -> Tuple[int, int]:
    """YaRN ramp end points ``(low, high)`` (Python ints), per docs/design/spec.md §3.

    ``corr(r) = rd * ln(orig / (2*pi*r)) / (2 * ln(base))`` is the (fractional) pair index
    whose wavelength completes ``r`` turns over the original context;
    ``low = max(floor(corr(beta_fast)), 0)``, ``high = min(ceil(corr(beta_slow)), rd - 1)``.
    Computed in Python double, as the reference does.  Note ``high`` is clamped to ``rd - 1``
    (not ``rd/2 - 1``), exactly as the reference; the ramp clamp makes the difference moot.
    """
    rd = int(rope_dim)
    orig = float(original_max_position_embeddings)

    def corr(rotations: float) -> float:
        return rd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rd - 1)
    return int(low), int(high)


def rope_freqs(
    rope_dim: int,
    base: float,
    yarn: Optional[Sequence[float]] = None,
    exact_pow: bool = False,
) -> np.ndarray:
    """Per-pair rotary frequencies.

    Args:
      rope_dim: rd, the number of rotated dims (even, > 0).
      base: the RoPE theta (``rope_theta`` or ``compress_rope_theta``).
      yarn: ``None`` (plain RoPE) or a 4-sequence ``(factor, beta_fast, beta_slow,
        original_max_position_embeddings)`` selecting SPEC's YaRN correction (no mscale).
      exact_pow: base^e correctly rounded (fp64, rounded once) instead of numpy's fp32 power — torch's CPU
        ``base ** tensor`` (DeepSeek-V4's release_order "torch_cpu": 6 of the 32 compress-theta frequencies differ).

    Returns:
      np.ndarray float32 [rope_dim // 2]: f_i = base^(-2i/rd), YaRN-corrected if asked.
    """
    rd = int(rope_dim)
    if rd <= 0 or rd % 2:
        raise ValueError(f"rope_dim must be a positive even integer, got {rope_dim}")
    f32 = np.float32
    # base^(-2i/rd) written as 1 / base^((2i)/rd) with every step in fp32: this is the
    # reference's exact expression (`1.0 / (base ** (arange(0, rd, 2, f32) / rd))`); the
    # algebraically equal `base ** (-e)` differs from it in the last ulp for many i.
    exponent = np.arange(0, rd, 2, dtype=f32) / f32(rd)
    power = (np.float64(f32(base)) ** exponent.astype(np.float64)).astype(f32) if exact_pow else f32(base) ** exponent
    freqs = (f32(1.0) / power).astype(f32)
    if yarn is None:
        return freqs

    if len(yarn) != 4:
        raise ValueError(
            "yarn must be (factor, beta_fast, beta_slow, original_max_position_embeddings), "
            f"got {yarn!r}"
        )
    factor, beta_fast, beta_slow, orig = yarn
    low, high = yarn_correction_range(rd, base, beta_fast, beta_slow, orig)
    # ramp_i = clamp((i - low) / max(high - low, 1e-3), 0, 1) in fp32: 0 for the fast
    # (high-frequency) pairs i <= low, which keep f_i; 1 for the slow pairs i >= high, which
    # are interpolated (f_i / factor).
    ramp = (np.arange(rd // 2, dtype=f32) - f32(low)) / f32(max(high - low, 1e-3))
    ramp = np.clip(ramp, f32(0.0), f32(1.0)).astype(f32)
    # f_i <- f_i/factor * ramp_i + f_i * (1 - ramp_i).  The reference spells the weight as
    # `smooth = 1 - ramp` and computes `f/factor * (1 - smooth) + f * smooth`; we use that
    # exact fp32 expression so the result is bit-identical to it (1 - (1 - ramp) can differ
    # from ramp by an ulp for ramp < 0.5).
    smooth = (f32(1.0) - ramp).astype(f32)
    freqs = (freqs / f32(factor) * (f32(1.0) - smooth) + freqs * smooth).astype(f32)
    return freqs


def apply_rope(
    x: jnp.ndarray,
    positions: jnp.ndarray,
    freqs,
    inverse: bool = False,
    out_dtype=None,
) -> jnp.ndarray:
    """Rotate the last ``rd = 2 * len(freqs)`` dims of ``x`` (interleaved pairs).

    Args:
      x: [..., hd] any float dtype (bf16 in the model), hd >= rd.
      positions: int32 (any int) array broadcastable to ``x.shape[:-1]``; the token position
        of each vector (e.g. [T, 1] for x [T, H, hd]).
      freqs: [rd // 2] float32 (numpy or jax), from :func:`rope_freqs`.  Its length is static.
      inverse: if True, rotate by the conjugate (angle -theta), undoing a forward rotation.
      out_dtype: result dtype; default ``x.dtype``.

    Returns:
      [..., hd] out_dtype.  Dims ``[0, hd - rd)`` are x cast to out_dtype; for pair i of the
      rotated tail, with theta = fp32(pos) * f_i, (a, b) -> (a cos - b sin, a sin + b cos)
      (forward) or (a cos + b sin, -a sin + b cos) (inverse), in fp32, rounded once.
    """
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    half = int(np.shape(freqs)[-1])
    rd = 2 * half
    hd = x.shape[-1]
    if rd > hd:
        raise ValueError(f"rope dims {rd} exceed the vector width {hd}")
    if rd == 0:
        return x.astype(out_dtype)

    freqs = jnp.asarray(freqs, dtype=jnp.float32)
    # Angle = fp32(pos) * f_i: the position is converted to fp32 first and multiplied in
    # fp32, as the reference's outer(t, freqs) does (large positions lose low bits there too).
    lead = x.shape[:-1]
    pos = jnp.broadcast_to(jnp.asarray(positions), lead).astype(jnp.float32)
    angle = pos[..., None] * freqs  # [..., rd/2]
    cos = jnp.cos(angle)
    sin = jnp.sin(angle)
    if inverse:
        # Conjugate rotation = rotation by -theta; negating sin is exact, so this matches
        # multiplying by conj(e^{i theta}) bit for bit.
        sin = -sin

    tail = x[..., hd - rd :].astype(jnp.float32).reshape(*lead, half, 2)
    a = tail[..., 0]  # "real" part of pair i: dim 2i of the tail
    b = tail[..., 1]  # "imag" part: dim 2i + 1
    # Complex product (a + ib)(c + is) in fp32, same term order as complex64 multiply.
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rot = jnp.stack([ra, rb], axis=-1).reshape(*lead, rd)
    rot = rot.astype(out_dtype)
    if rd == hd:
        return rot
    # The non-rotated head passes straight through (only a dtype cast).
    return jnp.concatenate([x[..., : hd - rd].astype(out_dtype), rot], axis=-1)
