"""Redundant experts (EPLB) and the expert distribution recorder, the serving side (issue 46 item 7).

The model side is `parallel.eplb` (placement, `ExpertLocation`, `expand_params`) and the mesh plan's
``expert_location``; this module is what the runner builds from the flags:

- `plan_location`: ``--ep-num-redundant-experts R --init-expert-location FILE`` -> the `ExpertLocation`
  of the mesh (R extra copies of each MoE layer's hottest experts, placed from the recorded
  distribution), or a one-line `EngineError` for what cannot be placed (a malformed file, a file whose
  layers / expert counts are not the model's, E + R not dividing the expert devices, R too large, no
  expert parallelism). Logs what was chosen: R, the file, per layer the expected max / mean tokens per
  device before (the plain contiguous split) and after.
- `jitted_extend_recording`: the decode step with one more output, the routed (token, expert)
  assignments of the launch's real tokens per MoE layer (int32 [D, L, E], D the dp ranks, 1 without
  DP). Only ``--expert-distribution-recorder`` runs it: with the flag off the runner runs the plain
  step, whose program is untouched.
- `ExpertRecorder`: accumulates those counts on the host (int64; device arrays are read a few dozen
  launches late, so recording never waits for the device) and writes the distribution file
  (`eplb.save_distribution`'s format, what ``--init-expert-location`` reads). SGLang's equivalents:
  ``--expert-distribution-recorder-mode stat`` and the ``/start_expert_distribution_record``,
  ``/stop_expert_distribution_record``, ``/dump_expert_distribution_record`` endpoints.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import decode as dec
from dsv41_jax.parallel import eplb
from dsv41_jax.serving.request import EngineError

__all__ = ["ExpertRecorder", "expert_counts", "jitted_extend_recording", "plan_location"]

log = logging.getLogger("dsv41_jax.engine")

_FOLD_AT = 64  # pending device count arrays before the older half is read into the host totals


def plan_location(args, cfg, par) -> Optional[eplb.ExpertLocation]:
    """The `ExpertLocation` ``--ep-num-redundant-experts`` / ``--init-expert-location`` ask for on the mesh plan
    `par` (None: no copies asked). EngineError (one line) for what cannot be placed; logs the choice."""
    R = args.ep_num_redundant_experts
    if not R:
        return None
    G = par.expert_devices if par is not None else 1
    if G < 2:
        raise EngineError(f"--ep-num-redundant-experts {R}: the routed experts are not split over devices on this "
                          "mesh (no expert parallelism): there is nothing to balance")
    path = args.init_expert_location
    try:
        dist = eplb.load_distribution(path)
    except ValueError as e:
        raise EngineError(str(e)) from None
    E, L = cfg.n_routed_experts, cfg.num_hidden_layers
    have = len(next(iter(dist.values())))
    if have != E:
        raise EngineError(f"--init-expert-location {path!r}: {have} experts per layer, the model has {E} routed experts")
    try:
        loc = eplb.ExpertLocation.from_distribution(dist, G, R, L)
    except ValueError as e:
        msg = str(e) if "--init-expert-location" in str(e) else f"{e} (--init-expert-location {path!r})"
        raise EngineError(msg) from None
    # (the plan logs `loc.describe()` itself)
    log.info("redundant experts: R=%d copies placed from %s; expected max/mean tokens per device, contiguous split -> "
             "placed, per layer: %s", R, path, ", ".join(f"{lid}: {b:.2f}->{a:.2f}"
                                                         for lid, b, a in eplb.balance_report(dist, loc)))
    return loc


def expert_counts(experts: dict, n_new, num_experts: int):
    """int32 [1, L, E]: per MoE layer 0..L-1 (``experts`` {layer: int32 [B, T, k]}, the step's aux), how many of
    the launch's real tokens (column < ``n_new[b]``) were routed to each expert."""
    L = len(experts)
    B, T, k = experts[0].shape
    real = (jnp.arange(T)[None, :] < n_new[:, None]).astype(jnp.int32)  # [B, T]
    w = jnp.broadcast_to(real[..., None], (B, T, k)).reshape(-1)
    rows = [jnp.zeros((num_experts,), jnp.int32).at[experts[lid].reshape(-1)].add(w) for lid in range(L)]
    return jnp.stack(rows)[None]


def _extend_recording(params, state, batch, *, cfg, ccfg, all_logits, par):
    """`decode.extend` plus `expert_counts` of its routing: (logits, state, counts int32 [1, L, E])."""
    logits, st, aux = dec.extend(params, state, batch, cfg, ccfg, all_logits, return_aux=True, par=par)
    return logits, st, expert_counts(aux["experts"], batch["n_new"], cfg.n_routed_experts)


@functools.lru_cache(maxsize=None)
def jitted_extend_recording(cfg, ccfg, all_logits: bool, par=None, engram_host_table: bool = False):
    """`_extend_recording` jitted as `decode.jitted_extend` jits `extend` (cache donated; on a mesh the step's
    shardings, one program per dp rank on a dp mesh, whose counts come out stacked over the ranks: [D, L, E])."""
    fn = functools.partial(_extend_recording, cfg=cfg, all_logits=bool(all_logits))
    if par is None:
        return jax.jit(functools.partial(fn, ccfg=ccfg, par=None), donate_argnums=(1,))
    from jax.sharding import NamedSharding, PartitionSpec

    ins, (lg, cache) = par.step_shardings(cfg, ccfg, all_logits, engram_host_table)
    counts = NamedSharding(par.mesh, PartitionSpec("dp" if par.axis_size("dp") > 1 else None))
    step = par.rank_step(fn, cfg, ccfg, engram_host_table)
    return jax.jit(step, in_shardings=ins, out_shardings=(lg, cache, counts), donate_argnums=(1,))


class ExpertRecorder:
    """Routed-expert counts of the launches the engine runs, per MoE layer, summed on the host.

    num_layers / num_experts: the model's; path: where `dump` writes by default. Records from creation
    (`start` clears and records again, `stop` keeps the counts and records nothing more)."""

    def __init__(self, num_layers: int, num_experts: int, path: str):
        self.path = path
        self.recording = True
        self._totals = np.zeros((num_layers, num_experts), np.int64)
        self._pending: list = []  # device int32 [D, L, E] per launch, not read yet

    def add(self, counts) -> None:
        """One launch's counts (`jitted_extend_recording`'s third output; a device array)."""
        if not self.recording:
            return
        self._pending.append(counts)
        if len(self._pending) >= _FOLD_AT:  # the older half is long computed: reading it does not wait
            self._fold(_FOLD_AT // 2)

    def _fold(self, n: Optional[int] = None) -> None:
        n = len(self._pending) if n is None else n
        for c in self._pending[:n]:
            self._totals += np.asarray(c).astype(np.int64).sum(axis=0)
        del self._pending[:n]

    def start(self) -> None:
        """Clear the counts and record from now on."""
        self._pending.clear()
        self._totals[:] = 0
        self.recording = True

    def stop(self) -> None:
        """Record nothing more (the counts so far are kept for `dump`)."""
        self._fold()
        self.recording = False

    def distribution(self) -> dict:
        """{layer id: int64 [E] assignments per expert} recorded so far."""
        self._fold()
        return {lid: self._totals[lid].copy() for lid in range(self._totals.shape[0])}

    def dump(self, path: Optional[str] = None) -> dict:
        """Write the distribution file (`eplb.save_distribution`; through a temporary file, so an existing one is
        never left half written) to ``path`` (default: the recorder's). Returns {"path", "num_layers",
        "num_experts", "assignments"}."""
        path = path or self.path
        dist = self.distribution()
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            eplb.save_distribution(tmp, dist)
            os.replace(tmp, path)
        except OSError as e:
            raise EngineError(f"expert distribution: cannot write {path!r}: {e.strerror or e}") from None
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        total = int(self._totals.sum())
        log.info("expert distribution: %d (token, expert) assignments over %d MoE layers written to %s", total,
                 self._totals.shape[0], path)
        return {"path": os.path.abspath(path), "num_layers": int(self._totals.shape[0]),
                "num_experts": int(self._totals.shape[1]), "assignments": total}
