"""What every Pallas kernel here shares: the lowering choice, its compiler parameters, the test impl.

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
import warnings

import jax

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


def test_impl() -> str:
    """The Pallas implementation tests run: native ``"pallas"`` where a GPU is present, else
    ``"pallas_interpret"`` (the same kernel body through the HLO interpreter)."""
    return "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block shapes must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
