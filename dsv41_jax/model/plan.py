"""The step resolved once: which form of each operation a forward / cached step runs (docs/design/decode_plan.md).

Several operations of a layer have a fused form beside their plain one — the same values, fewer launches —
that runs only where the right kernels run. `StepPlan.of(cfg, par, tokens, ...)` decides all of them in this
one place, from the config's implementation spec (`dispatch.resolve`), the numerics mode, the mesh and the
step's shape, logs the choice once, and holds each chosen form as a callable (the mHC boundary, the queries and
window codes with or without the in-place ring write, the attention) plus the kernels of the ops that run one:
the model functions call the plan's forms and read its fields, and never re-check which kernels run.

The plan is a frozen, hashable dataclass (a static value under ``jit``; the callables are not compared). Two small named pytree types
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
from typing import Any, Callable, Optional

import jax

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dispatch
from dsv41_jax.model.numerics import is_exact

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
    """The forms of one step's operations (module doc; docs/design/decode_plan.md has the table). Build with `of`.

    attention / mhc / moe / linear: each op's resolved implementation (`dispatch.resolve`); mesh_size: devices.
    attend_kernel: the attention runs its kernel (which reads `valid` as int32). The other bools say where a fused
    form runs; the callables are the forms chosen (not compared: they follow from the
    rest): enter / exit / exit_enter the mHC boundary (`mhc.sublayer_*` or their kernels), q_codes the queries and
    window codes (`attention.q_codes`, `q_codes_kernel`, `q_codes_into_ring`), attend the attention
    (`attention.sparse_attention` or its kernel), kernels {(op, variant): the registered kernel with ``interpret``
    bound} of the ops that run one."""
    attention: str
    mhc: str
    moe: str
    linear: str
    mesh_size: int
    attend_kernel: bool
    window_codes_kernel: bool
    ring_now: bool
    linear_kernel: bool
    attend_partials: bool
    router_kernel: bool
    combine_in_w2: bool
    mhc_kernel: bool
    fused_boundary: bool
    enter: Callable = dataclasses.field(compare=False, repr=False)
    exit: Callable = dataclasses.field(compare=False, repr=False)
    exit_enter: Callable = dataclasses.field(compare=False, repr=False)
    q_codes: Callable = dataclasses.field(compare=False, repr=False)
    attend: Callable = dataclasses.field(compare=False, repr=False)
    kernels: dict = dataclasses.field(compare=False, repr=False)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(cfg, par=None, shape: tuple = (0, 0), mode: Optional[str] = None, keep_all: bool = False) -> "StepPlan":
        """The plan of a step of `cfg` on mesh plan `par` (None: one device) over tokens of `shape` (B, T); mode: the
        cache's kv_cache_dtype (None: no cache, the full forward); keep_all: the step keeps every token. Built (and
        logged) once per distinct call. Refused here, once (ImplError): an explicit kernel the fp64 numerics modes
        cannot run (moe, linear; attention in a cached step), and the linear kernels on a mesh."""
        from dsv41_jax.model import attention, mhc

        mesh_size, shape = 1 if par is None else int(par.size), tuple(int(n) for n in shape)
        impls = {op: dispatch.resolve(cfg, op) for op in ("attention", "mhc", "moe", "linear")}
        if is_exact(cfg):  # the fp64 modes: an explicit kernel choice is refused here, once (mhc: by its kernel)
            dispatch.refuse_kernel_in_f64_mode(cfg, "moe", impls["moe"])
            dispatch.refuse_kernel_in_f64_mode(cfg, "linear", impls["linear"])
            if mode is not None:  # a cached step (the forward's attention is `attention.attend`)
                dispatch.refuse_kernel_in_f64_mode(cfg, "attention", impls["attention"])
        on = {op: dispatch.is_kernel(impl) for op, impl in impls.items()}
        if on["linear"] and mesh_size > 1:  # the weights are split there: a Pallas call would gather them everywhere
            raise dispatch.ImplError(f"linear={impls['linear']}: the quant_linear kernels run on one device, not on a "
                                     f"mesh of {mesh_size}; use 'linear=xla' (or 'auto')")
        kernels = {key: functools.partial(entry.kernel, interpret=impls[key[0]] == "pallas_interpret")
                   for key, entry in dispatch.registry().items() if on.get(key[0])}
        # the kernels' refusals: a mesh (the router), a codec other than fp8 (the window codes)
        lin = on["linear"]
        win = mode is not None and on["attention"] and kvc._codec("win", mode) == "fp8"
        ring_now = bool(keep_all) and win and shape[1] == 1
        router = on["moe"] and mesh_size == 1
        boundary = ((kernels["mhc", v] for v in ("kernel", "sublayer_exit", "sublayer_exit_enter")) if on["mhc"] else
                    (mhc.sublayer_enter, mhc.sublayer_exit, mhc.sublayer_exit_enter))
        q_codes = (functools.partial(attention.q_codes_into_ring if ring_now else attention.q_codes_kernel,
                                     kernels["attention", "window_codes"]) if win else attention.q_codes)
        attend = (kernels["attention", "kernel"] if on["attention"] else
                  functools.partial(attention.sparse_attention, impl=impls["attention"], exact=is_exact(cfg)))
        plan = StepPlan(*impls.values(), mesh_size, on["attention"], win, ring_now, lin, lin and on["attention"], router,
                        router and lin and shape[0] * shape[1] == 1, on["mhc"], mesh_size == 1, *boundary, q_codes,
                        attend, kernels)
        log.info("step plan (%s, %d device(s), %s tokens, kv %s): %s", cfg.impl, mesh_size, shape, mode, plan)
        return plan

    @functools.lru_cache(maxsize=None)
    def in_place(self, cfg, first: int) -> tuple:
        """Paths of the parameters a layer-scan run starting at `first` hands its kernels whole (as
        `weights.Stacked`): XLA copies a sliced Pallas operand per layer. Empty where no kernel runs."""
        from dsv41_jax.model.params import fp8_gemm_paths, layer_decl

        paths = []
        if self.linear_kernel:  # the GEMMs, and q_norm (wq_b's kernel)
            paths += fp8_gemm_paths(layer_decl(cfg, first)) + [("attn", "q_norm", "weight")]
        if self.attend_kernel:  # kv_norm: the window codes kernel
            paths.append(("attn", "kv_norm", "weight"))
        if self.linear_kernel:  # wo_a's fp8 pair and the sink: the o_proj kernel
            paths += [("attn", "wo_a"), ("attn", "attn_sink")]
        if self.router_kernel:  # the gate's bias: the router kernel
            paths.append(("ffn", "gate", "bias"))
        if self.mhc_kernel:  # the mixes' fn / base / scale and the sublayer norms
            paths += [(f"hc_{sub}_{leaf}",) for sub in ("attn", "ffn") for leaf in ("fn", "base", "scale")]
            paths += [(f"{sub}_norm", "weight") for sub in ("attn", "ffn")]
        return tuple(paths)

