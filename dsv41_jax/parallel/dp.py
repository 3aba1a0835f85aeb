"""Data-parallel attention: a step run as one program per dp rank (`rank_step`).

On a mesh with a "dp" axis of size D (`mesh.make_mesh(dp=D)`), a launch's batch is rank-major (rows
``[r·B/D, (r+1)·B/D)`` are rank r's) and every rank-blocked state axis (slot rows, pool pages) is split
over "dp" in the blocks of `model.cache.rank_slots` / `rank_pages` (`rules.DP_RULES`). The batch's ids
are GLOBAL (docs: the DP contract), so the same schedule runs on one device as it is.

`rank_step` wraps a step ``fn(params, state, batch, ccfg=, par=)`` (`decode.extend`, `dspark.extend_seeding`,
a DSpark proposal or verify step given its inputs as batch keys: every batch leaf leads with the batch
rows, every state leaf with its slot / page axis) in a `jax.shard_map` manual over
"dp" only (tp stays automatic inside a rank): each rank's program receives its B/D rows, its block of
every state array and the parameters as they are placed (its block of the routed experts and the
Engram rows, everything else whole), translates the batch's slot and page ids to its block
(`to_local`: minus the block's start), and runs ``fn`` unchanged for the rank's own cache layout
(`local_ccfg`: S_r slots + its scratch row, P_r pages with its null page first — exactly a one-rank
cache) and the rank's plan (`MeshPlan.in_rank`: constraints without "dp", the MoE dispatching tokens
to the experts on all devices, `moe_dispatch`, and the Engram rows gathered across ranks,
`collectives.row_gather`). Every output leaf leads with the batch or a state block and is reassembled
over "dp". With D = 1 it is ``fn`` with the given ccfg and plan.

Why bitwise one device: a rank's rows read and write only its own blocks, whose local contents are
those of the global arrays at the translated ids; every per-row computation is the one-device one, and
the cross-rank pieces (MoE, Engram) are exact by construction (one contributor per value, the combine
in ascending expert id on the token's own device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax.parallel import moe_dispatch

AXIS = "dp"


def local_ccfg(ccfg):
    """One rank's `CacheConfig`: its S_r = max_slots / D slots and P_r = num_pages / D pages, dp = 1
    (its scratch row S_r and null page 0 are the rank's own, `cache.scratch_slot` / `rank_pages`)."""
    return ccfg.replace(max_slots=ccfg.max_slots // ccfg.dp, num_pages=ccfg.num_pages // ccfg.dp, dp=1)


def to_local(batch: dict, ccfg) -> dict:
    """The batch's global slot and page ids as ids into this rank's blocks (inside the rank's program).

    slot int32 [B_r] -> minus the block start r·(S_r + 1); page_table int32 [B_r, P] -> minus r·P_r (each
    when the batch has it; other keys pass through).
    An id outside the rank's block (never in a valid schedule: `decode.pack_rows` refuses them) becomes
    the rank's scratch row / null page, so no rank ever writes another's block."""
    r = jax.lax.axis_index(AXIS)
    s_r = ccfg.max_slots // ccfg.dp
    p_r = ccfg.num_pages // ccfg.dp
    out = dict(batch)
    if "slot" in batch:
        slot = batch["slot"] - r * (s_r + 1)
        out["slot"] = jnp.where((slot >= 0) & (slot <= s_r), slot, s_r).astype(jnp.int32)
    if "page_table" in batch:
        pt = batch["page_table"] - r * p_r
        out["page_table"] = jnp.where((pt >= 0) & (pt < p_r), pt, 0).astype(jnp.int32)
    return out


def rank_spec(spec) -> P:
    """The part of a parameter's PartitionSpec over "dp" (what a rank's program is handed: its block
    along a dim split over ("dp", ...), the whole dim elsewhere). "dp" must be a dim's major axis."""
    out = []
    for entry in spec:
        names = moe_dispatch.axes_tuple(entry)
        if AXIS in names[1:]:
            raise ValueError(f"parallel.dp: {spec}: '{AXIS}' must be the major axis of a split dim")
        out.append(AXIS if names[:1] == (AXIS,) else None)
    return P(*out)


def _as_given(specs, params):
    """`specs` cut to the lists the params hold: a list of layers the params lack (a DeepSeek-V4 checkpoint without
    its MTP layer loads with ``mtp`` = []) has no specs either; every other node as the rules declare it."""
    if isinstance(params, dict):
        return {k: _as_given(specs[k], v) for k, v in params.items()}
    if isinstance(params, list):
        return [_as_given(s, v) for s, v in zip(specs, params)]
    return specs


def rank_step(fn, plan, ccfg, param_shardings):
    """``fn(params, state, batch, ccfg=, par=)`` as one program per dp rank (module doc), for `plan`
    (a `MeshPlan`) and the global `ccfg`; param_shardings: the params' `NamedSharding`s as the step
    receives them (`rules.step_shardings`). Returns ``(params, state, batch) -> fn's outputs``, to be
    jitted by the caller. With no "dp" axis (> 1): ``fn`` with ccfg and plan bound."""
    D = plan.axis_size(AXIS)
    if D == 1:
        return lambda params, state, batch: fn(params, state, batch, ccfg=ccfg, par=plan)
    if ccfg.dp != D:
        raise ValueError(f"data-parallel attention: the cache is laid out for dp={ccfg.dp} ranks, the mesh has "
                         f"dp={D} (CacheConfig.dp must be the mesh's dp size)")
    if param_shardings is None:
        raise NotImplementedError("data-parallel attention with host Engram tables (--engram-host-table)")
    lc = local_ccfg(ccfg)
    inner = plan.in_rank_plan()
    p_specs = jax.tree_util.tree_map(lambda s: rank_spec(s.spec), param_shardings)

    def body(params, state, batch):
        return fn(params, state, to_local(batch, ccfg), ccfg=lc, par=inner)

    def step(params, state, batch):
        # check_vma=False: the model's CPU weight tiles run under `lax.cond` (see `collectives.routed_experts`)
        return jax.shard_map(body, mesh=plan.mesh, in_specs=(_as_given(p_specs, params), P(AXIS), P(AXIS)),
                             out_specs=P(AXIS), axis_names=frozenset({AXIS}), check_vma=False)(params, state, batch)

    return step
