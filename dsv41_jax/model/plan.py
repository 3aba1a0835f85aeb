"""The step resolved once: which form of each operation a forward / cached step runs (docs/design/decode_plan.md).

Several operations of a layer have a fused form beside their plain one — the same values, fewer launches —
that runs only where the right kernels run: the window codes written into the rings in the kernel that
makes them, the attention kernel's split partials merged inside the output projection's kernel, the MoE's
routed sum as the shared expert's w2 epilogue, the mHC exit of one sublayer fused with the next one's
enter. `StepPlan.of(cfg, par, tokens, ...)` decides all of them in this one place, from the config's
implementation spec (`dispatch.resolve`), the numerics mode, the mesh and the step's shape, and logs the
choice once; the model functions read the plan's fields and never re-check which kernels run.

The plan is a frozen, hashable dataclass (a static argument under ``jit``). Two small named pytree types
carry what one operation leaves for a later one:

* `DeferredExit` — a layer's ffn output not yet written back into the streams (``hc_post``): the next
  layer's attention enter applies it fused with itself (`mhc.sublayer_exit_enter`), or `settle` does.
* `Pending` — the cached step's writes kept for `decode.commit`: each layer's window codes (None where the
  step wrote the ring itself, `StepPlan.ring_now`), the partial compressor groups, the codes a speculative
  step overwrote (restore data), the Engram ids.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import jax

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dispatch
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.model.weights import Fp8

log = logging.getLogger(__name__)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["h", "y", "post", "comb"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DeferredExit:
    """A sublayer's exit not applied yet: the streams that entered it h [.., n, D], its output y [.., D] and its
    post fp32 [.., n] / comb fp32 [.., n, n] mixes; the streams after it are ``hc_post(y, h, post, comb)``."""
    h: Any
    y: Any
    post: Any
    comb: Any


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "window", "partial", "restore", "engram_ids"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Pending:
    """What a cached step leaves for `decode.commit` (nothing here is in the cache yet).

    positions int32 [B, T]: the chunk's positions; window: per target layer, the chunk's window codes
    (first axes [B, T]) or None (nothing to write: the step wrote the ring itself, or the layer did not run);
    partial: {KV source: the compressor's group buffers {"kv", "score"} fp32 [B, G, r, hd]}; restore: None,
    or (a speculative step) {KV source: the codes each compressed write overwrote, with where and the last
    position of each group}; engram_ids int32 [B, T] (Engram configs) or None."""
    positions: Any
    window: tuple
    partial: dict
    restore: Optional[dict]
    engram_ids: Any = None

    def with_window(self, layer: int, codes) -> "Pending":
        """This record with layer `layer`'s window codes set (a new record)."""
        window = list(self.window)
        window[layer] = codes
        return dataclasses.replace(self, window=tuple(window))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The forms of one step's operations (see the module doc). Build with `StepPlan.of`.

    attention / mhc / moe / linear: the resolved implementation of each op (`dispatch.resolve`).
    Fused forms (each True only where its kernels run, and then the values are the plain form's):
      window_codes_kernel: kv_norm, RoPE and the window codes in one kernel (`attention.project_q_codes`);
      ring_now: that kernel also writes the codes into the cache's rings (a plain one-token step: nothing
        is left for `commit`; the entry overwritten, position p − W, is invisible to the query at p);
      linear_kernel: the fp8 / MXFP4 GEMMs and their epilogues run `quant_linear` (one device, fp32 numerics);
      attend_partials: the attention kernel hands its unmerged split partials to the o_proj kernel, which
        merges them (`attention.output_proj`);
      router_kernel: the MoE gate's top-k as one kernel (one device);
      combine_in_w2: one token: the routed experts' sum is the shared expert's w2 epilogue (`linear.fp8_combined`);
      mhc_kernel: the mHC enter / exit kernels (`mhc.sublayer_enter` ...);
      fused_boundary: a sublayer's exit and the next one's enter as one call (`mhc.sublayer_exit_enter`); off
        on a mesh of more than one device, where the streams are pinned replicated in between.
    """
    attention: str
    mhc: str
    moe: str
    linear: str
    mesh_size: int
    window_codes_kernel: bool
    ring_now: bool
    linear_kernel: bool
    attend_partials: bool
    router_kernel: bool
    combine_in_w2: bool
    mhc_kernel: bool
    fused_boundary: bool

    @staticmethod
    def of(cfg, par=None, shape: tuple = (0, 0), mode: Optional[str] = None, keep_all: bool = False) -> "StepPlan":
        """The plan of a step of `cfg` on mesh plan `par` (None: one device) over tokens of `shape` (B, T);
        mode: the cache's kv_cache_dtype (None: no cache, the full forward); keep_all: the step keeps every
        token (a plain `decode.extend`), so where the window codes kernel runs at T = 1 it writes the rings
        itself (`ring_now`)."""
        return _build(cfg, 1 if par is None else int(par.size), tuple(int(n) for n in shape), mode, bool(keep_all))

    @functools.lru_cache(maxsize=None)
    def in_place(self, cfg, first: int) -> tuple:
        """Paths (tuples of keys) of the parameters a layer-scan run starting at layer `first` hands its kernels
        whole — the run's stacks with the layer (`transformer.scan_blocks`): a sliced operand of a Pallas call is
        copied per layer by XLA (flash at B=1: 3.9 GB of linear weights per step). Empty where no kernel runs."""
        from dsv41_jax.model.params import layer_decl

        paths = []
        if dispatch.is_kernel(self.linear):  # the GEMMs, and q_norm, which runs in wq_b's kernel (`linear.fp8_normed`)
            paths += _quantized_linears(layer_decl(cfg, first)) + [("attn", "q_norm", "weight")]
        if dispatch.is_kernel(self.attention):  # kv_norm: the window codes kernel (`attention.project_q_codes`)
            paths.append(("attn", "kv_norm", "weight"))
        if self.linear_kernel:  # wo_a's fp8 pair and the sink: the o_proj kernel (`attention.output_proj`)
            paths += [("attn", "wo_a"), ("attn", "attn_sink")]
        if self.router_kernel:  # the gate's bias: the router kernel (`moe.moe`)
            paths.append(("ffn", "gate", "bias"))
        if self.mhc_kernel:  # the mixes' fn / base / scale and the sublayer norms (the kernel's tail runs the norm)
            paths += [(f"hc_{sub}_{leaf}",) for sub in ("attn", "ffn") for leaf in ("fn", "base", "scale")]
            paths += [(f"{sub}_norm", "weight") for sub in ("attn", "ffn")]
        return tuple(paths)


@functools.lru_cache(maxsize=None)
def _build(cfg, mesh_size: int, shape: tuple, mode, keep_all: bool) -> StepPlan:
    impls = {op: dispatch.resolve(cfg, op) for op in ("attention", "mhc", "moe", "linear")}
    # the kernels' refusals: the fp64 modes (all), a mesh (linear), a codec other than fp8 (the window codes)
    lin = dispatch.is_kernel(impls["linear"]) and not is_exact(cfg) and mesh_size == 1
    win = (mode is not None and dispatch.is_kernel(impls["attention"]) and not is_exact(cfg)
           and kvc._codec("win", mode) == "fp8")
    router = dispatch.is_kernel(impls["moe"]) and mesh_size == 1
    plan = StepPlan(attention=impls["attention"], mhc=impls["mhc"], moe=impls["moe"], linear=impls["linear"],
                    mesh_size=mesh_size, window_codes_kernel=win, ring_now=keep_all and win and shape[1] == 1,
                    linear_kernel=lin, attend_partials=lin and dispatch.is_kernel(impls["attention"]),
                    router_kernel=router, combine_in_w2=router and lin and shape[0] * shape[1] == 1,
                    mhc_kernel=dispatch.is_kernel(impls["mhc"]), fused_boundary=mesh_size == 1)
    fused = [f.name for f in dataclasses.fields(plan) if f.type in ("bool", bool) and getattr(plan, f.name)]
    log.info("step plan (%s, %d device(s), %s tokens, kv %s): %s; fused forms: %s", cfg.impl, mesh_size, shape,
             mode, ", ".join(f"{op}={getattr(plan, op)}" for op in ("attention", "mhc", "moe", "linear")),
             ", ".join(fused) or "none")
    return plan


def _quantized_linears(tree, path=()) -> list:
    """Paths of the fp8 GEMM weights (`weights.Fp8`) in a layer's declaration tree, but wo_a (the one with a bf16
    copy, which the o_proj kernel reads: `StepPlan.in_place` adds it with that kernel); the routed experts
    (`weights.Mxfp4`) are read whole by the MoE (`moe.routed_slots`)."""
    if isinstance(tree, Fp8):
        return [path] if tree.bf16 is None else []
    if not isinstance(tree, dict):
        return []
    return [q for k, v in tree.items() for q in _quantized_linears(v, path + (k,))]
