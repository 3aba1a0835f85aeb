"""One implementation switch for the ops that have a fast path (docs/design/architecture.md, "Dispatch").

Every op with a seam keeps its plain-``jnp`` reference and may have faster implementations beside it:

* ``"reference"`` — the faithful reference, the oracle every other implementation is tested against;
* ``"xla"`` — the fast ``jnp``/``lax`` path (grouped MoE, stored-width matmuls, bounded retrieval);
* ``"pallas"`` / ``"pallas_interpret"`` — the Pallas kernels in ``dsv41_jax/pallas/`` (natively on
  GPU, or in interpret mode anywhere, for tests);
* ``"auto"`` — the fastest implementation measured for the backend (`GPU_AUTO` on a GPU, else ``"xla"``);
  ``"xla"`` in the exact / deterministic numerics modes, whose fp64 accumulation the kernels lack.

The choice is a *string in the config* (``ModelConfig.impl``), so it is static under ``jit``: changing it
retraces, and a jitted step never mixes implementations by accident. The spec is either one name for
every op (``"xla"``) or a comma-separated list of ``op=name`` items with an optional bare default
(``"xla,moe=reference"``). Each op resolves once per (spec, op, backend) and the choice is logged once.

Pallas kernels are imported lazily by module name (`KERNEL_MODULES`), so ``model/`` never imports
``pallas/`` at import time. A kernel module exposes a function named by `KERNEL_ENTRY`; until a kernel
exists, selecting it is a clear error, never a silent fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax

from dsv41_jax.model.numerics import is_exact, mode_name

log = logging.getLogger(__name__)

# The ops with a seam. attention: softmax over the window ring + selected compressed slots, read from
# the cache's stored codes; indexer: index scoring + candidate blocks + top-k; engram: hash-row gather +
# gate; mhc: mixes, Sinkhorn, hc_pre / hc_post; moe: routed experts; linear: quantized (fp8 / MXFP4)
# matmuls.
OPS = ("attention", "indexer", "engram", "mhc", "moe", "linear")
IMPLS = ("reference", "xla", "pallas", "pallas_interpret")
KERNEL_IMPLS = ("pallas", "pallas_interpret")  # the implementations that run a Pallas kernel
CHOICES = IMPLS + ("auto",)

# op -> module (under dsv41_jax.pallas) holding its kernel (linear: its fp8 / MXFP4 GEMMs).
KERNEL_MODULES: dict = {
    "attention": "sparse_attention",
    "indexer": "indexer_topk",
    "engram": "engram_gather",
    "mhc": "mhc_mix",
    "moe": "moe_mxfp4",
    "linear": "quant_linear",
}
KERNEL_ENTRY = "kernel"


def is_kernel(impl: str) -> bool:
    """Whether the resolved implementation name `impl` runs a Pallas kernel (natively or interpreted)."""
    return impl in KERNEL_IMPLS


class ImplError(ValueError):
    """An implementation spec that cannot be honoured (unknown op / name, or a missing kernel)."""


def parse_impl(spec: str) -> dict:
    """``"xla,moe=reference"`` -> ``{op: choice}`` for every op in `OPS` (choices may be "auto")."""
    if not isinstance(spec, str) or not spec.strip():
        raise ImplError(f"impl: expected a non-empty string, got {spec!r}")
    default = "auto"
    per_op: dict = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise ImplError(f"impl {spec!r}: empty item")
        if "=" in item:
            op, name = (s.strip() for s in item.split("=", 1))
            if op not in OPS:
                raise ImplError(f"impl {spec!r}: unknown op {op!r}; ops: {', '.join(OPS)}")
            if op in per_op:
                raise ImplError(f"impl {spec!r}: op {op!r} given twice")
            per_op[op] = name
        else:
            name = item
            default = name
        if name not in CHOICES:
            raise ImplError(f"impl {spec!r}: unknown implementation {name!r}; choose from {', '.join(CHOICES)}")
    return {op: per_op.get(op, default) for op in OPS}


def kernel_available(op: str) -> bool:
    """Whether a Pallas kernel is registered for `op` (its module is not imported here)."""
    return op in KERNEL_MODULES


# What "auto" picks on a GPU, per op: the kernel where it measured at least as fast as the XLA path on
# the H200 (docs/results/gpu_check_h200/README.md, scripts/bench_kernels.py --quick, jax 0.11.2), XLA where it
# measured slower. indexer: 1.2-19x faster (fused scoring + radix select); attention: 0.97-1.09x with
# the 64-head/16-key tiling that is now its default (0.6-0.8x with the old 32-head default); engram:
# 0.5-1.0x (the XLA fusion already reads each byte once at these sizes).
# mhc: the kernel, although it measured 0.3-0.9x of XLA's *unrolled* Sinkhorn, because that form cannot
# be compiled for a whole model on XLA:GPU (priority fusion's time grows ~quadratically with the
# unrolled iterations: 1,558 s for a 4-layer flash cut), and the loop that replaced it there
# (`mhc.SINKHORN_LOOP_BACKENDS`) costs launches: the 4-layer flash cut at B=1 compiled for an H200 is
# 1,188 launches per step with the loop, 392 with the mHC kernel (421 unrolled), compile 176 s / 238 s
# (docs/benchmarks.md, "Compile time on a GPU"). Kernel vs loop is not timed on a GPU yet.
# moe: the grouped MXFP4 kernel (pallas/moe_mxfp4.py), which reads the selected experts at stored width
# where the xla path dequantizes them to bf16: on the H200 (jax 0.11.2, flash's 384 x (5120, 2304) experts,
# scripts/bench_kernels.py --ops moe --quick) 1.39x / 1.72x / 4.48x the xla path at 1 / 8 / 64 tokens, and
# the 4-layer flash cut's decode step (scripts/bench_decode.py --part a) 3.99 vs 4.63 ms at B=1, 30.0 vs
# 112.4 ms at B=64 (docs/benchmarks.md, "The model on an H200"). Prefill sizes (512+ tokens) are not timed yet.
# linear: xla until timed. The fused fp8 / MXFP4 GEMM kernel (pallas/quant_linear.py) makes each quantized
# matmul one launch (the flash cut's B=1 step compiled for an H200: 30 calls replace 86 kernels,
# docs/benchmarks.md, "Launches per decode step"), but it has not run on a GPU yet: `scripts/gpu_check.sh` times it
# (scripts/bench_kernels.py --ops linear, and the flash cut's decode with "auto,linear=pallas").
GPU_AUTO: dict = {"attention": "pallas", "indexer": "pallas", "engram": "xla", "mhc": "pallas", "moe": "pallas",
                  "linear": "xla"}


def _auto(op: str, backend: str) -> str:
    # Pallas kernels pay off on GPU only; interpret mode is for tests, never chosen automatically.
    if backend == "gpu" and kernel_available(op):
        return GPU_AUTO.get(op, "pallas")
    return "xla"


@functools.lru_cache(maxsize=None)
def _resolve(spec: str, op: str, backend: str, f64: bool = False) -> str:
    choice = parse_impl(spec)[op]
    name = _auto(op, backend) if choice == "auto" else choice
    if f64 and choice == "auto" and name in ("pallas", "pallas_interpret"):
        # The Pallas kernels accumulate in fp32 in their own tile order: the fp64-accumulating modes
        # (exact / deterministic, `numerics.is_exact`) run the jnp path; an explicit Pallas choice is
        # kept and refused at its seam.
        log.info("impl: %s -> xla (spec %r resolves to %s on %s, but the exact / deterministic numerics "
                 "accumulate in fp64, which the kernels do not)", op, spec, name, backend)
        return "xla"
    if name in ("pallas", "pallas_interpret") and not kernel_available(op):
        raise ImplError(f"impl {name!r} for op {op!r}: no Pallas kernel for this op yet (choose 'xla' or "
                        f"'reference', or 'auto')")
    log.info("impl: %s -> %s (spec %r, backend %s)", op, name, spec, backend)
    return name


def resolve(cfg_or_spec, op: str, *, f64: bool = False) -> str:
    """The implementation `op` runs with: one of `IMPLS`. `cfg_or_spec` is a `ModelConfig` or a spec
    string. Resolved at trace time (static); logged once per (spec, op, backend). With a config in the
    exact / deterministic numerics (`numerics.is_exact`), or a spec with ``f64=True``, "auto" never
    resolves to a Pallas kernel."""
    if op not in OPS:
        raise ImplError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    if isinstance(cfg_or_spec, str):
        return _resolve(cfg_or_spec, op, jax.default_backend(), bool(f64))
    return _resolve(cfg_or_spec.impl, op, jax.default_backend(), bool(f64) or is_exact(cfg_or_spec))


def refuse_kernel_in_f64_mode(cfg, op: str, impl: str) -> None:
    """Raise ImplError if `impl` is a Pallas kernel and `cfg` runs the exact / deterministic numerics
    (`numerics.is_exact`): the kernels accumulate in fp32 in their own tile order, so they cannot give
    results independent of batch, chunking and tiling. ("auto" never resolves to one there.)"""
    if impl in ("pallas", "pallas_interpret") and is_exact(cfg):
        raise ImplError(f"{op}: the {mode_name(cfg)} numerics mode accumulates in fp64, which the {impl!r} kernel "
                        f"does not (its sums follow its tiles); use impl '{op}=xla' or 'reference' (or 'auto')")


def kernel(op: str, name: str, entry: str = KERNEL_ENTRY):
    """The Pallas entry point of `op` (imported lazily); `name` is "pallas" or "pallas_interpret".

    `entry`: the function's name in the kernel module, `KERNEL_ENTRY` unless the op has more than
    one seam (mhc: "kernel" enters a sublayer, "sublayer_exit" leaves it)."""
    if name not in ("pallas", "pallas_interpret"):
        raise ImplError(f"kernel(): {name!r} is not a Pallas implementation")
    if not kernel_available(op):
        raise ImplError(f"no Pallas kernel for op {op!r}")
    mod = importlib.import_module(f"dsv41_jax.pallas.{KERNEL_MODULES[op]}")
    return getattr(mod, entry)
