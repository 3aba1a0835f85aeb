"""What the Pallas kernels here share: the lowering choice, its compiler parameters, and the helpers more
than one kernel uses (in-kernel numerics built on `model.codec`, operand flattening, the split-K merge).
No kernel module imports another kernel module's private names: what two of them need lives here.

Lowering: the kernels in this package are written for Pallas' **Triton** lowering
(``jax.experimental.pallas.triton``). Since JAX 0.10 Mosaic GPU is the default Pallas GPU lowering;
passing a Triton ``CompilerParams`` selects the Triton one (checked in jax/_src/pallas/pallas_call.py
of 0.10.2: ``isinstance(compiler_params, triton_core.CompilerParams)`` picks the Triton backend).
Why Triton: the attention, indexer and Engram kernels read rows *through a page table or hash rows*,
i.e. gathers; Triton lowers integer-array indexers on refs to pointer gathers, while Mosaic GPU rejects
them on Hopper (its only gather is Blackwell's TMA gather). Interpret mode (``interpret=True``) runs the
same kernel body on CPU, so one test checks both. Each kernel module says why the lowering fits it.

JAX versions (the pin admits 0.10-0.12; CI tests both ends): 0.10.2 and 0.12.0.1 both keep the Triton
lowering, so one kernel body serves every admitted JAX. Since 0.11 it is deprecated and warns on each
lowering; `triton_params` silences that one warning (the choice is logged once instead, with the JAX
version), so logs stay readable. 0.12 also validates static ref slices against the ref's shape at trace
time, masked or not: a tile wider than its array (a power-of-two block over 24 rows) indexes with
clamped index arrays instead (`mhc_mix._rows_in_bounds`); and its Triton lowering no longer assumes
sm_90 without a GPU (`offline.target_device`).
"""

from __future__ import annotations

import logging
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from dsv41_jax.model import codec

log = logging.getLogger(__name__)
_logged: set = set()


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Triton ``CompilerParams`` for `pl.pallas_call` (selects the Triton lowering on GPU)."""
    from jax.experimental.pallas import triton as pltriton

    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecat.*")
    warnings.filterwarnings("ignore", message=".*deprecat.*[Tt]riton.*")
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def log_choice(kernel: str, interpret: bool, **detail) -> None:
    """Log once per (kernel, interpret) which lowering runs it and with what."""
    key = (kernel, bool(interpret))
    if key in _logged:
        return
    _logged.add(key)
    mode = "interpret (CPU/HLO)" if interpret else f"triton on {jax.default_backend()}"
    mode += f" (jax {jax.__version__})"
    log.info("pallas kernel %s: %s %s", kernel, mode, " ".join(f"{k}={v}" for k, v in detail.items()))


def is_pow2(n: int) -> bool:
    """Whether n is a power of two (≥ 1): Triton block shapes must be."""
    return n >= 1 and not n & (n - 1)


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block shapes must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


MIN_DOT = 16  # the smallest tt.dot tile edge (M, N, K)


# ------------------------------------------------------------------------------- in-kernel numerics


def expand(s, block: int):
    """Per-block values [n, G] -> per-element [n, G·block] (broadcast + reshape: no gather; lowers in Triton)."""
    n, g = s.shape
    return jnp.broadcast_to(s[:, :, None], (n, g, block)).reshape(n, g * block)


def fake_quant_fp8(a, block: int = 32):
    """The spec's (§6) activation quant of fp32 a [m, n] (n % block == 0), per `block` along n (32: V4.1's; V4's
    release numerics: 128), multiplied back: fp32 [m, n], bitwise `quant.fake_quant_fp8` with that block
    (`codec.fp8_act_codes`, the one definition, in-kernel)."""
    m, n = a.shape
    y, e = codec.fp8_act_codes(a, jnp, block)
    return y.reshape(m, n) * expand(codec.exp2_int(e, jnp), block)  # exact: e4m3 value × 2^e


def dot_nt(x, w):
    """x [m, k] · w [n, k]ᵀ -> fp32 [m, n] (bf16 operands: exact products, fp32 accumulation)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


# ------------------------------------------------------------------------------- operands


def flat(a, pairs: bool = False, kernel: str = "pallas"):
    """A weight / scale stack [E, R, C] (or a run's [n, E, R, C], or one weight [R, C]) as [rows, C] uint8
    bits, or with ``pairs`` as [rows, C/2] uint16 (byte pairs: a bitcast, no copy).

    Why pairs for the packed weights: the Pallas Triton lowering addresses an operand with int32 element
    offsets unless the operand is over 2^32 bytes; one layer's packed w1 of flash is 2.26e9 one-byte
    elements, so experts past the 2^31st byte wrapped (an illegal address, or another expert's weights:
    seen on an H200). As uint16 an operand of at most 2^32 bytes has at most 2^31 elements. `kernel`
    names the caller in a refusal."""
    if a.dtype != jnp.uint8:
        a = lax.bitcast_convert_type(a, jnp.uint8)
    a = a.reshape(-1, a.shape[-1])
    if pairs:
        a = lax.bitcast_convert_type(a.reshape(a.shape[0], a.shape[1] // 2, 2), jnp.uint16)
    check_offsets(a, kernel)
    return a


def check_offsets(a, kernel: str = "pallas") -> None:
    """Refuse an operand whose element offsets would wrap in the Triton lowering (int32 offsets for
    operands up to 2^32 bytes): an element offset past 2^31 - 1 in at most 2^32 bytes."""
    n, nbytes = math.prod(a.shape), math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
    if nbytes <= 2**32 and n - 1 > 2**31 - 1:
        raise NotImplementedError(f"{kernel}: an operand of {n} {jnp.dtype(a.dtype).name} elements ({nbytes} "
                                  "bytes) would be addressed with wrapping int32 offsets by the Triton lowering")


# ------------------------------------------------------------------------------- split-K attention


def merge_splits(acc, m, l, sink):
    """Partials acc fp32 [S, B, T, Hp, hd], m / l fp32 [S, B, T, Hp] -> normalized [B, T, Hp, hd] fp32
    (the attention kernel's split-K merge, with the sink; `pallas.o_proj` merges the same way)."""
    mt = jnp.max(m, axis=0)
    mt = jnp.where(mt == -jnp.inf, 0.0, mt)
    w = jnp.exp(m - mt[None])  # empty split: exp(−inf) = 0
    num = jnp.sum(acc * w[..., None], axis=0)
    denom = jnp.sum(l * w, axis=0) + jnp.exp(sink[None, None, :] - mt)
    return num / denom[..., None]
