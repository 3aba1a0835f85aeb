"""The model family's side of the runner: `ModelStep`, chosen once from the config (`for_config`).

The runner (`runner.Runner`) is the same for every checkpoint family: pages, slots, sampling, the launch /
schedule seam, fork copies, prefix-cache snapshots. What differs per family is behind this interface:

* ``init_cache()`` — the zeroed cache pytree. Both families lay it out alike (per-slot ``window`` /
  ``partial`` [/ ``engram_hist``], paged ``comp`` / ``ikeys`` keyed by layer), which is what lets the runner's
  slot-row and page copies (`runner._fork_slot`, the snapshot pool, HiCache) serve both;
* ``reset_slots(state, slots, pad_id)`` — clear slots for requests starting afresh (pure; the runner jits it);
* ``kv_bytes_per_token(mode)`` — the memory plan's per-token / per-request bytes;
* ``extend_step(all_logits)`` — the jitted paged step ``fn(params, state, batch) -> (logits, state)``: logits
  fp32 [B, V] at each row's last new token, or [B, T, V] with ``all_logits`` (prompt logprobs);
* ``prepare(params)`` — what loading does after reading (V4.1: stack layer runs for the scan);
* ``refuse(args, cfg)`` — the flags this family cannot honour, as one EngineError line, before any weight is read.

`V41Step` is DeepSeek-V4.1 (`model.decode`, on a mesh through `parallel.plan`); `V4Step` is DeepSeek-V4
(`model.v4.decode`: CSA / HCA layers with their own compressor state, jnp paths, one device, a tp x ep mesh or
data-parallel attention's [dp, tp] mesh).
"""

from __future__ import annotations

from typing import Protocol

from dsv41_jax.model import cache as kvc
from dsv41_jax.serving.request import EngineError

__all__ = ["ModelStep", "V41Step", "V4Step", "for_config"]


class ModelStep(Protocol):
    """What the runner asks of a model family (module doc)."""

    family: str  # the config's model_family

    def init_cache(self) -> dict: ...

    def reset_slots(self, state: dict, slots, pad_id) -> dict: ...

    def kv_bytes_per_token(self, mode: str) -> dict: ...

    def extend_step(self, all_logits: bool): ...

    def prepare(self, params: dict) -> dict: ...

    def describe(self) -> str: ...


class V41Step:
    """DeepSeek-V4.1: `model.decode.extend` (with a mesh: `parallel.plan.jitted_extend`), `cache.init_cache`."""

    family = "deepseek_v41"

    def __init__(self, cfg, ccfg=None, mesh=None, engram_host_table: bool = False):
        """mesh: None (one device), a `jax.sharding.Mesh` or a `parallel.plan.MeshPlan` (its expert placement)."""
        self.cfg, self.ccfg, self.mesh, self.engram_host_table = cfg, ccfg, mesh, engram_host_table

    @staticmethod
    def refuse(args, cfg) -> None:
        return None

    def init_cache(self) -> dict:
        if self.mesh is None:
            return kvc.init_cache(self.cfg, self.ccfg)
        from dsv41_jax.parallel import rules
        from dsv41_jax.parallel.plan import MeshPlan

        # (the mesh may be a plan: with redundant experts the runner hands the step its `MeshPlan`)
        return rules.init_cache(self.cfg, self.ccfg, MeshPlan.of(self.mesh).mesh)

    @staticmethod
    def reset_slots(state: dict, slots, pad_id) -> dict:
        return kvc.reset_slots(state, slots, pad_id)

    def kv_bytes_per_token(self, mode: str) -> dict:
        return kvc.kv_bytes_per_token(self.cfg, mode)

    def extend_step(self, all_logits: bool):
        from dsv41_jax.parallel import plan as mesh_plan

        return mesh_plan.jitted_extend(self.cfg, self.ccfg, all_logits, self.mesh, self.engram_host_table)

    def prepare(self, params: dict) -> dict:
        from dsv41_jax.model import layer_scan

        return layer_scan.prepare(params, self.cfg)

    def describe(self) -> str:
        return "DeepSeek-V4.1 paged step (model.decode.extend)"


class V4Step:
    """DeepSeek-V4 (the original Flash / Pro checkpoints): `model.v4.decode.extend`, on one device, a tp x ep mesh
    (`parallel.rules`: V4's tensors split as V4.1's, the cache replicated) or a data-parallel [dp, tp] mesh (the
    cache in rank blocks over "dp", one program per rank; docs/design/v4.md "Mesh")."""

    family = "deepseek_v4"

    def __init__(self, cfg, ccfg=None, mesh=None, engram_host_table: bool = False):
        self.cfg, self.ccfg, self.mesh = cfg, ccfg, mesh

    @staticmethod
    def refuse(args, cfg) -> None:
        """EngineError, one line, for a flag V4 serving does not honour (docs/design/v4.md)."""
        from dsv41_jax.model.v4.transformer import refuse_unsupported

        no = []
        try:
            refuse_unsupported(cfg.replace(impl=args.impl))
        except NotImplementedError as e:  # the op and what does not fit (`v4.transformer.kernel_refusal`)
            no.append(f"--impl {args.impl!r} ({str(e).removeprefix('DeepSeek-V4: ')})")
        if args.dp_size != 1 and args.speculative_algorithm:
            no.append(f"--speculative-algorithm {args.speculative_algorithm} with --dp-size {args.dp_size} (V4's draft "
                      "steps do not run per dp rank yet: plain decoding or --tp-size / --ep-size)")
        if args.ep_num_redundant_experts:
            no.append("--ep-num-redundant-experts (no V4 expert placement)")
        if args.speculative_algorithm == "DSPARK" and cfg.draft_kind != "dspark":
            no.append("--speculative-algorithm DSPARK (this checkpoint's draft is an MTP layer: "
                      "--speculative-algorithm EAGLE / NEXTN)")
        if args.speculative_simulate_accept_length is not None:
            no.append("--speculative-simulate-accept-length (V4's speculative steps verify every draft)")
        if args.enable_decoder_swa_bounded_replay:
            no.append("--enable-decoder-swa-bounded-replay (a V4.1 prefill shortcut)")
        if args.cache_dtype != "auto":
            no.append(f"--kv-cache-dtype {args.cache_dtype} (V4's KV-cache quantization is not simulated: 'auto')")
        if args.expert_distribution_recorder:
            no.append("--expert-distribution-recorder (its counting step is V4.1's)")
        if no:
            raise EngineError("DeepSeek-V4 checkpoint: not supported with " + "; ".join(no))

    def init_cache(self) -> dict:
        if self.mesh is not None:
            from dsv41_jax.parallel import rules
            from dsv41_jax.parallel.plan import MeshPlan

            return rules.init_cache(self.cfg, self.ccfg, MeshPlan.of(self.mesh).mesh)  # replicated / rank blocks
        from dsv41_jax.model.v4 import decode as dec4

        return dec4.init_state(self.cfg, self.ccfg)

    @staticmethod
    def reset_slots(state: dict, slots, pad_id) -> dict:
        from dsv41_jax.model.v4 import decode as dec4

        return dec4.reset_slots(state, slots)

    def kv_bytes_per_token(self, mode: str) -> dict:
        from dsv41_jax.model.v4 import decode as dec4

        return dec4.kv_bytes_per_token(self.cfg, mode)

    def extend_step(self, all_logits: bool):
        from dsv41_jax.model.v4 import decode as dec4
        from dsv41_jax.parallel.plan import MeshPlan

        return dec4.jitted_extend(self.cfg, self.ccfg, all_logits, MeshPlan.of(self.mesh))

    def prepare(self, params: dict) -> dict:
        return params

    def describe(self) -> str:
        return "DeepSeek-V4 paged step (model.v4.decode.extend: per-layer CSA / HCA compressor state)"


def for_config(cfg):
    """The `ModelStep` class of ``cfg.model_family`` (instantiate with (cfg, ccfg, mesh, engram_host_table))."""
    steps = {c.family: c for c in (V41Step, V4Step)}
    if cfg.model_family not in steps:
        raise EngineError(f"model_family {cfg.model_family!r}: no serving step (known: {sorted(steps)})")
    return steps[cfg.model_family]
