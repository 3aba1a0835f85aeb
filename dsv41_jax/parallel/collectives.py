"""The `shard_map`'d pieces of the sharded model, where the collective pattern matters.

* `routed_experts` — expert-parallel MoE over mesh axis "ep". Tokens (and the routing, computed by
  the gate outside) are replicated over ep, so *dispatch* needs no communication: each expert shard
  keeps the (token, expert) assignments of its own E/ep experts (`moe.routed_slots` with its expert
  offset: sorted by expert, one grouped GEMM per projection over only those rows), and writes each
  assignment's output into its (token, slot) position, exact zeros elsewhere. *Combine* is one
  all-reduce (psum over ep) of those per-slot outputs [N, k, D]: every slot has exactly one non-zero
  contributor, so the sum is exact whatever order the all-reduce adds in, and the fold over a token's
  k slots in ascending expert id then runs locally (`moe.combine_slots`) exactly as unsharded —
  sharded ≡ unsharded bit for bit, in every numerics mode. Expert weights never move (no all-gather);
  the price is k/2 times the bytes of an fp32 [N, D] partial-sum all-reduce (bf16 slots), which is
  small at decode batch sizes. Once tokens are themselves split over devices (data-parallel
  attention) they travel to their experts instead: `moe_dispatch` (`--moe-a2a-backend all_to_all |
  ragged`; this function is its "none").
* `row_gather` / `embed_gather` — a table whose rows are split over devices (Engram tables over
  ep x tp, the token embedding over tp: `rules`): each shard gathers the requested rows it holds
  (zeros for the others) and one psum over those axes assembles them. Exact: one non-zero
  contributor per value (the dequantized Engram rows are e4m3·2^k values, exact in bf16 too).

Every function takes the mesh explicitly and runs inside the caller's `jit`; the model reaches them
through `plan.MeshPlan`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax.model import moe, weights
from dsv41_jax.model.engram import gather_rows
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import axis_size, manual_axes, shard_map


def routed_experts(ex, xf, idx, w, cfg, dt, mesh, axis: str = "ep", slots=None, location=None):
    """fp32 [N, D]: the routed experts' sum for tokens xf [N, D], expert-parallel over mesh `axis`.

    ex: stacked routed experts (leading expert axis split over `axis`); idx int32 [N, k] global expert
    ids; w fp32 [N, k] routing weights (both replicated). slots: the per-shard grouped computation with
    `moe.routed_slots`'s signature (default that xla path; the MoE kernel, `pallas.moe_mxfp4.kernel`, has
    the same). Equals the same computation on one device bitwise (each slot is computed on the one
    shard holding its expert, zeros elsewhere, then summed).

    location: redundant experts, (slot int32 [E, C], copies int32 [E]) of this layer with `ex` holding the
    E + R physical experts (`moe_dispatch.routed_experts_dispatch`): token n's assignment to logical expert
    e is computed by copy n mod copies[e]; the combine stays in ascending logical id.
    """
    slots = slots or moe.routed_slots
    N, D = xf.shape
    if N * idx.shape[1] == 0:
        return jnp.zeros((N, D), jnp.float32)
    ex, layer = weights.split(ex)  # inside a layer scan: the run's stacks [n, E, ...] + the layer
    E = jax.tree_util.tree_leaves(ex["w1"])[0].shape[-3]  # MXFP4 (`weights.Mxfp4`) or plain ({"weight"}) stacks
    n = axis_size(mesh, axis)
    if E % n:
        raise ValueError(f"routed_experts: {E} experts do not split over {axis}={n}")
    lead = () if layer is None else (None,)

    def local(ex_l, xf, idx, w, layer):
        first = jax.lax.axis_index(axis) * jax.tree_util.tree_leaves(ex_l["w1"])[0].shape[-3]
        if layer is not None:
            ex_l = weights.Stacked(ex_l, layer)
        y = slots(ex_l, xf, idx, w, cfg, dt, first_expert=first)  # [N, k, D], zeros elsewhere
        return jax.lax.psum(y, axis)

    ex_specs = jax.tree_util.tree_map(lambda _: P(*lead, axis), ex)
    # check_vma=False: the grouped GEMM may run its weight tiles inside `lax.cond` (`model.tiling`, on
    # CPU), whose never-taken zeros branch is not marked as varying over `axis` like the taken one; the
    # output is replicated by the psum, as out_specs says.
    phys = idx
    if location is not None:  # each assignment to one copy of its expert (tokens are replicated: a global row)
        slot_t, copies_t = location
        es = jnp.clip(idx, 0, slot_t.shape[0] - 1)
        phys = slot_t[es, jnp.arange(N, dtype=jnp.int32)[:, None] % copies_t[es]]
    y = shard_map(local, mesh, in_specs=(ex_specs, P(), P(), P(), P()), out_specs=P(),
                  check_vma=False)(ex, xf, phys, w, layer)
    return moe.combine_slots(y, idx)


def row_axes(table_shape, logical: str, mesh):
    """The mesh axes (a name or tuple, `rules.spec`) that split dim 0 of a table, or None."""
    return rules.spec((logical,) + (None,) * (len(table_shape) - 1), table_shape, mesh)[0]


def row_gather(table, tscale, rows, dt, mesh, axis=None):
    """`engram.gather_rows` on a table whose rows are split over mesh `axis`: local gather + one psum.

    table float8_e4m3fn [N, de] / tscale E8M0 [N, de/32]; rows int32 [..., R]; axis: a mesh axis name
    or tuple of names (default: the rules' split of "engram_rows" for this shape; a table that is not
    split is gathered directly). Returns [..., R·de] in `dt`, bitwise `gather_rows`.

    Inside one dp rank's program (manual over "dp", `parallel.dp`; `axis` then names the table's split
    on the whole mesh, e.g. ("dp", "tp"), and `table` is the rank's block): every rank asks for its own
    tokens' rows, so the ids are all-gathered over the manual axes, each device gathers the rows it
    holds for all of them (zeros for the others), and a psum over the rest + a psum-scatter over the
    manual axes hands each rank its own tokens' rows (still one non-zero contributor per value: exact).
    """
    if axis is None:
        axis = row_axes(table.shape, "engram_rows", mesh)
    if axis is None:
        return gather_rows(table, tscale, rows, dt)
    de = table.shape[-1]
    names = axis if isinstance(axis, tuple) else (axis,)
    man = manual_axes()
    outer = tuple(a for a in names if a in man)  # tokens differ over these: each rank's own
    inner = tuple(a for a in names if a not in man)

    def local(t, s, r):
        nl = t.shape[0]
        if outer:
            r = jax.lax.all_gather(r, outer)  # [ranks, ..., R]
        loc = r - jax.lax.axis_index(names) * nl
        ok = (loc >= 0) & (loc < nl)
        emb = gather_rows(t, s, jnp.clip(loc, 0, nl - 1), dt).reshape(r.shape + (de,))
        emb = jnp.where(ok[..., None], emb, jnp.zeros((), emb.dtype)).reshape(r.shape[:-1] + (r.shape[-1] * de,))
        if inner:
            emb = jax.lax.psum(emb, inner)
        return jax.lax.psum_scatter(emb, outer, scatter_dimension=0) if outer else emb

    sp = None if not inner else (inner[0] if len(inner) == 1 else inner)
    return shard_map(local, mesh, in_specs=(P(sp, None), P(sp, None), P()), out_specs=P())(table, tscale, rows)


def embed_gather(table, ids, dt, mesh, axis=None):
    """table[ids].astype(dt) for a [V, D] table whose rows are split over mesh `axis` (default: the
    rules' split of "vocab"); ids int32 [...] in range. Local gather + one psum (exact: one contributor
    per row)."""
    if axis is None:
        axis = row_axes(table.shape, "vocab", mesh)
    if axis is None:
        return table[ids].astype(dt)

    def local(t, i):
        nl = t.shape[0]
        loc = i - jax.lax.axis_index(axis) * nl
        ok = (loc >= 0) & (loc < nl)
        e = t[jnp.clip(loc, 0, nl - 1)].astype(dt)
        return jax.lax.psum(jnp.where(ok[..., None], e, jnp.zeros((), dt)), axis)

    return shard_map(local, mesh, in_specs=(P(axis, None), P()), out_specs=P())(table, ids)
