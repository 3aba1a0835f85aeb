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

The Pallas kernels are found in one registry (`registry`): each kernel module in ``dsv41_jax/pallas/``
registers its (op, variant) entries with `register` — the kernel, the plain-jnp reference it must equal
and a `supports` predicate (the model configs it runs). An op may have several variants (mhc: "kernel"
enters a sublayer, "sublayer_exit" leaves it); `DEFAULT_VARIANT` is the op's main one. ``model/`` never
imports ``pallas/`` at import time: the registry is filled the first time a kernel implementation is
resolved (`registry` imports the ``dsv41_jax.pallas`` package, whose modules register themselves). A
missing (op, variant) is a clear ImplError, never a silent fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from typing import Callable, Optional

import jax
# Imported now, before anything traces: on jax >= 0.12 importing Pallas registers two config states that are
# part of every trace's cache key (`pallas_grid_context`, `pallas_dynamic_shapes_export`), so importing it in
# the middle of the first step's trace (when `registry` first loads the kernels) would make every jitted
# function traced before it (parameter init, the engine's helpers, a warm-up's precompiled steps) trace,
# lower and compile or load again on its next call. jax 0.10's Pallas adds none; the import is ~0.05 s.
import jax.experimental.pallas  # noqa: F401

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

DEFAULT_VARIANT = "kernel"  # the variant `kernel` returns when none is named


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """One registered Pallas kernel: `op` (one of `OPS`) and its `variant`; `kernel` the callable the model's
    seam calls (its module's docstring gives shapes and dtypes; ``interpret=True`` runs it on CPU);
    `reference` the plain-jnp function of the same contract that it must equal (tests check it against the
    kernel's tolerance); ``supports(cfg, mode="auto") -> bool`` whether the kernel runs model config `cfg`
    with ``kv_cache_dtype`` `mode` (from the refusals the kernel itself raises: numerics mode, head dims,
    codecs)."""

    op: str
    variant: str
    kernel: Callable
    reference: Callable
    supports: Callable


_REGISTRY: dict = {}  # (op, variant) -> KernelEntry, filled by the kernel modules on import
_loaded: list = []  # [True] once `dsv41_jax.pallas` has been imported


def register(op: str, variant: str, *, kernel: Callable, reference: Callable, supports: Callable) -> KernelEntry:
    """Register one Pallas kernel (called by the kernel modules at import). Registering the same
    (op, variant) again with another callable is an error (two kernels cannot answer one seam)."""
    if op not in OPS:
        raise ImplError(f"register: unknown op {op!r}; ops: {', '.join(OPS)}")
    for what, f in (("kernel", kernel), ("reference", reference), ("supports", supports)):
        if not callable(f):
            raise ImplError(f"register({op!r}, {variant!r}): {what} must be callable, got {f!r}")
    entry = KernelEntry(op, variant, kernel, reference, supports)
    old = _REGISTRY.get((op, variant))
    if old is not None and (old.kernel.__module__, old.kernel.__qualname__) != (kernel.__module__, kernel.__qualname__):
        raise ImplError(f"register: ({op!r}, {variant!r}) is registered already (by {old.kernel.__module__})")
    _REGISTRY[(op, variant)] = entry
    return entry


def registry() -> types.MappingProxyType:
    """Every registered kernel, {(op, variant): KernelEntry} (read-only). The first call imports the kernel
    package, whose modules call `register` (lazy: model/ does not import pallas/ at import time)."""
    if not _loaded:
        import dsv41_jax.pallas  # noqa: F401

        _loaded.append(True)
    return types.MappingProxyType(_REGISTRY)


def supports(op: str, variant: str, cfg, mode: str = "auto") -> bool:
    """Whether the registered kernel (op, variant) runs model config `cfg` with ``kv_cache_dtype`` `mode`
    (its `KernelEntry.supports`); False if no such kernel is registered."""
    entry = registry().get((op, variant))
    return entry is not None and bool(entry.supports(cfg, mode))


def is_kernel(impl: str) -> bool:
    """Whether the resolved implementation name `impl` runs a Pallas kernel (natively or interpreted)."""
    return impl in KERNEL_IMPLS


class ImplError(ValueError):
    """An implementation spec that cannot be honoured (unknown op / name, or a missing kernel)."""


@functools.lru_cache(maxsize=None)
def parse_impl(spec: str) -> types.MappingProxyType:
    """``"xla,moe=reference"`` -> ``{op: choice}`` (read-only) for every op in `OPS` (choices may be "auto"). Parsed
    once per spec (the config checks its spec when it is made: the step finds it parsed)."""
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
    return types.MappingProxyType({op: per_op.get(op, default) for op in OPS})


def kernel_available(op: str) -> bool:
    """Whether a Pallas kernel (its default variant) is registered for `op`."""
    return (op, DEFAULT_VARIANT) in registry()


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
def resolve(cfg_or_spec, op: str, *, f64: bool = False, backend: Optional[str] = None) -> str:
    """The implementation `op` runs with: one of `IMPLS`. `cfg_or_spec` is a `ModelConfig` or a spec string; backend:
    None for JAX's default. Resolved once per argument set (static under jit) and logged. With a config in the
    exact / deterministic numerics (`numerics.is_exact`), or ``f64=True``, "auto" never resolves to a Pallas kernel
    (the kernels accumulate in fp32 in their own tile order; an explicit Pallas choice is kept and refused at its
    seam)."""
    if op not in OPS:
        raise ImplError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    spec, f64 = ((cfg_or_spec, f64) if isinstance(cfg_or_spec, str) else
                 (cfg_or_spec.impl, f64 or is_exact(cfg_or_spec)))
    backend = backend or jax.default_backend()
    choice = parse_impl(spec)[op]
    name = choice if choice != "auto" else "xla" if f64 else _auto(op, backend)
    if is_kernel(name) and (op, DEFAULT_VARIANT) not in registry():  # `kernel_available`
        raise ImplError(f"impl {name!r} for op {op!r}: no Pallas kernel for this op yet (choose 'xla' or "
                        f"'reference', or 'auto')")
    log.info("impl: %s -> %s (spec %r, backend %s, fp64 numerics %s)", op, name, spec, backend, f64)
    return name


def refuse_kernel_in_f64_mode(cfg, op: str, impl: str) -> None:
    """Raise ImplError if `impl` is a Pallas kernel and `cfg` runs the exact / deterministic numerics
    (`numerics.is_exact`): the kernels accumulate in fp32 in their own tile order, so they cannot give
    results independent of batch, chunking and tiling. ("auto" never resolves to one there.)"""
    if is_kernel(impl) and is_exact(cfg):
        raise ImplError(f"{op}: the {mode_name(cfg)} numerics mode accumulates in fp64, which the {impl!r} kernel "
                        f"does not (its sums follow its tiles); use impl '{op}=xla' or 'reference' (or 'auto')")


def kernel(op: str, name: str, variant: str = DEFAULT_VARIANT):
    """The registered Pallas kernel (op, variant) (`registry`); `name` is "pallas" or "pallas_interpret"
    (the caller passes ``interpret=name == "pallas_interpret"``). `variant`: `DEFAULT_VARIANT` unless the
    op has more than one seam (mhc: "kernel" enters a sublayer, "sublayer_exit" leaves it)."""
    if not is_kernel(name):
        raise ImplError(f"kernel(): {name!r} is not a Pallas implementation")
    entry = registry().get((op, variant))
    if entry is None:
        have = sorted(v for o, v in registry() if o == op)
        raise ImplError(f"no Pallas kernel {variant!r} for op {op!r}" + (f" (registered: {', '.join(have)})" if have
                                                                         else ""))
    return entry.kernel
