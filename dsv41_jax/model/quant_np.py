"""Host-side (numpy) weight quantizers: the `codec` rules `quant` jits, run with ``xp=numpy``.

Used to make random checkpoints and parameters (tiny init, test checkpoint writer, bf16→fp8
conversion) where compiling one XLA program per tensor shape would dominate, and without importing
jax. `tests/test_quant_np.py` checks the two backends agree bit for bit (XLA flushes fp32 subnormal
inputs, numpy does not).
"""

from __future__ import annotations

import numpy as np

from dsv41_jax.model import codec


def quantize_fp8_block_np(w: np.ndarray, block: int = 32):
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/32), ceil(in/32)]) with pow2 block scales."""
    return codec.fp8_block_codes(w, np, block)


def quantize_fp8_rows_np(w: np.ndarray, block: int = 32):
    """fp32 [rows, d] -> (e4m3 [rows, d], e8m0 [rows, d/32]): per-32 scales along each row."""
    return codec.fp8_row_codes(w, np, block)


def quantize_mxfp4_np(w: np.ndarray, block: int = 32):
    """fp32 [..., out, in] -> (uint8 [..., out, in/2], e8m0 [..., out, in/32]); pow2 scale amax/6 per 32."""
    return codec.mxfp4_codes(w, np, block)
