"""Host-side (numpy) weight quantizers: the same formats as `quant`, without device compilation.

Used to make random checkpoints and parameters (tiny init, test checkpoint writer, bf16→fp8
conversion) where compiling one XLA program per tensor shape would dominate. `tests/test_quant_np.py`
checks these are bitwise equal to the `quant` (jnp) versions.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
FP8 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
_E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _pow2_ceil(x):
    """2^ceil(log2(x)) for positive fp32 x, exact: from frexp (x = m·2^e, m in [0.5, 1)), not from
    np.log2, whose fp32 result rounds e.g. log2(2^-5·(1 + 2^-23)) to exactly -5 (ceil then too low)."""
    m, e = np.frexp(np.asarray(x, np.float32))
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def quantize_fp8_block_np(w: np.ndarray, block: int = 32):
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/32), ceil(in/32)]) with pow2 block scales."""
    w = np.asarray(w, np.float32)
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    pad = np.zeros((bo * block, bi * block), np.float32)
    pad[:o, :i] = w
    blocks = pad.reshape(bo, block, bi, block)
    amax = np.maximum(np.abs(blocks).max(axis=(1, 3)), np.float32(E4M3_MAX * 2.0 ** -126))
    s = _pow2_ceil(amax / E4M3_MAX)
    q = np.clip(blocks / s[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q.reshape(bo * block, bi * block)[:o, :i], s.astype(E8M0)


def quantize_fp8_rows_np(w: np.ndarray, block: int = 32):
    """fp32 [rows, d] -> (e4m3 [rows, d], e8m0 [rows, d/32]): per-32 scales along each row."""
    w = np.asarray(w, np.float32)
    r, d = w.shape
    x = w.reshape(r, d // block, block)
    amax = np.maximum(np.abs(x).max(axis=-1), np.float32(E4M3_MAX * 2.0 ** -126))
    s = _pow2_ceil(amax / E4M3_MAX)
    q = np.clip(x / s[..., None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return q.reshape(r, d), s.astype(E8M0)


def round_e2m1_np(x: np.ndarray) -> np.ndarray:
    """Round (already clamped to ±6) values to the e2m1 grid, ties to even (np.round is half-even)."""
    a = np.abs(x)
    r = np.where(a < 2, np.round(a * 2) / 2, np.where(a < 4, np.round(a), np.round(a / 2) * 2))
    return np.copysign(r, x).astype(np.float32)


def pack_fp4_np(v: np.ndarray) -> np.ndarray:
    """Grid values [..., K] -> uint8 [..., K/2], low nibble = even element, bit 3 = sign."""
    v = np.asarray(v, np.float32)
    code = np.searchsorted(_E2M1_GRID, np.abs(v)).astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)


def quantize_mxfp4_np(w: np.ndarray, block: int = 32):
    """fp32 [..., out, in] -> (uint8 [..., out, in/2], e8m0 [..., out, in/32]); pow2 scale amax/6 per 32."""
    w = np.asarray(w, np.float32)
    x = w.reshape(w.shape[:-1] + (w.shape[-1] // block, block))
    amax = np.maximum(np.abs(x).max(axis=-1), np.float32(6 * 2.0 ** -126))
    s = _pow2_ceil(amax / 6.0)
    v = round_e2m1_np(np.clip(x / s[..., None], -6, 6)).reshape(w.shape)
    return pack_fp4_np(v), s.astype(E8M0)
