"""Token-dispatch expert parallelism: the routed experts with tokens split over devices (`--moe-a2a-backend`).

`collectives.routed_experts` (backend ``"none"``) keeps tokens replicated over the expert axis and
combines with one psum of [N, k, D] slot outputs. Once tokens are split over devices (data-parallel
attention: each rank holds only its requests' rows), the tokens must travel to their experts instead.
`routed_experts_dispatch` does that, per MoE layer, inside one `shard_map`:

1. Each device takes its own tokens: the rows of xf [N, D] (and idx int32 [N, k], w fp32 [N, k]) it
   holds along ``token_axes`` (the request axis, e.g. ``"dp"``; none today), further split over the
   expert axes the tokens are replicated on (so with tokens over "dp" and experts over ("dp", "tp"),
   each device of a tp group takes its share of the rank's rows; rows padded locally to a multiple).
2. Each (token, slot) assignment goes to the device holding its expert: experts are split evenly over
   ``expert_axes`` (all devices, or today's "ep"), device d holding ids d·E_l .. (d+1)·E_l − 1.
3. The receiving device runs the grouped computation (`moe.routed_slots`, the xla path, or the MXFP4
   kernel passed as ``slots=``, the same signature) on the rows it received, one row per assignment,
   each with its local expert id and routing weight; empty buffer rows carry the id E_l (no expert
   held: exact zeros, never multiplied).
4. The outputs travel back to the sending device, into their (token, slot) positions, and each token's
   k slots are folded in ascending expert id there (`moe.combine_slots`).

Why bitwise one device: every (token, slot) output is computed by exactly one device, by the same
per-row computation as on one device (the grouped GEMM's rows are independent: per-row fp8 quant
blocks, and in the exact / deterministic modes an fp64 sum per output that no batch composition or
group layout changes), and the combine is the unsharded combine on the same values. Nothing is summed
across devices, so the order in which rows arrive does not show.

Backends (`BACKENDS`):

* ``"all_to_all"`` — dense `jax.lax.all_to_all` with a fixed per-destination buffer of C assignment
  rows per round: [n_e, C, D] activations + [n_e, C] local ids + [n_e, C] weights out, [n_e, C, D]
  outputs back. An assignment's place in the buffer is its rank among the local assignments bound for
  the same device; round r carries ranks r·C .. (r+1)·C − 1. C = the worst case (every local
  assignment to one device, one round) up to `MIN_CAPACITY` rows, else twice the balanced load (a
  prefill chunk: one round when routing is balanced within 2x, more rounds — as many as the most
  loaded destination of any device needs, agreed by a pmax — when it is skewed). No assignment is ever
  dropped. Runs everywhere (XLA:CPU included).
* ``"ragged"`` — `jax.lax.ragged_all_to_all`: the local assignments sorted by destination, exactly
  their rows sent (the counts matrix is all-gathered first, n_e² int32), received into a worst-case
  buffer of n_e · (local assignments) rows, computed, and sent back the same way. GPU/TPU only:
  XLA:CPU cannot run the op (refused here on a CPU mesh, before tracing it).
* ``"none"`` — today's replicated tokens + psum (`collectives.routed_experts`); `MeshPlan`'s default.

`moe_collective_bytes` gives each backend's collective bytes per device and step as a function of
shapes only (for the sizing of `scripts/aot_flash.py`).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsv41_jax.model import moe, weights
from dsv41_jax.model.numerics import act_dtype
from dsv41_jax.parallel.mesh import axis_size, manual_axes, shard_map

BACKENDS = ("none", "all_to_all", "ragged")
# Local (token, slot) assignments up to which the dense buffer per destination is the worst case (all of them:
# one round, whatever the routing): decode sizes. Above it, C = 2x the balanced load (at least this many
# rows), and skewed routing takes more rounds.
MIN_CAPACITY = 256
# Platforms whose XLA cannot run ragged_all_to_all ("HLO opcode ragged-all-to-all is not supported by XLA:CPU").
RAGGED_UNSUPPORTED = ("cpu",)


def check_backend(name: str) -> str:
    """`name` if it is a known `--moe-a2a-backend`, else ValueError with the choices."""
    if name not in BACKENDS:
        raise ValueError(f"--moe-a2a-backend {name!r}: unknown backend; expected one of {', '.join(BACKENDS)}")
    return name


def axes_tuple(ax) -> tuple:
    """A mesh-axis spec (None, a name or a tuple of names) as a tuple of names."""
    if ax is None:
        return ()
    return tuple(ax) if isinstance(ax, (tuple, list)) else (ax,)


def _size(mesh, axes: tuple) -> int:
    return math.prod(axis_size(mesh, a) for a in axes)


def _spec(axes: tuple):
    """A PartitionSpec entry for `axes`: None, a name, or a tuple (split over their product, major first)."""
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def capacity_for(assignments: int, n_dest: int, capacity: Optional[int] = None) -> int:
    """Rows per destination per round of the dense buffer for `assignments` local (token, slot) pairs
    over `n_dest` devices (module doc); an explicit `capacity` is clipped to [1, assignments]."""
    if capacity is not None:
        if capacity < 1:
            raise ValueError(f"moe dispatch: capacity must be >= 1, got {capacity}")
        return max(1, min(int(capacity), assignments))
    if assignments <= MIN_CAPACITY:
        return max(assignments, 1)
    return min(assignments, max(MIN_CAPACITY, 2 * -(-assignments // n_dest)))


def _rank_in_group(key, n_keys: int):
    """(rank int32 [A], counts int32 [n_keys]): each element's rank among the elements with the same key (in
    index order), and each key's count; key int32 [A] in [0, n_keys)."""
    A = key.shape[0]
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.zeros((n_keys,), jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(A, dtype=jnp.int32) - starts[key[order]]
    return jnp.zeros((A,), jnp.int32).at[order].set(ranked), counts


def _excl_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _a2a(x, axes):
    """Dense all-to-all over `axes`: x [n_e, ...], row d sent to device d; returns [n_e, ...], row s from s."""
    return jax.lax.all_to_all(x, axes, 0, 0, tiled=True)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
    """`jax.lax.ragged_all_to_all` over `axes` (module-level so that a CPU test can stand in the op's
    documented semantics for it, to check the offsets bookkeeping)."""
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axes)


def _dense_slots(run, x, e_glob, dest, wf, tok, axes, n_e, E_l, C):
    """Per-assignment outputs [A, D] through dense all-to-alls with C rows per destination and round."""
    A = dest.shape[0]
    D = x.shape[1]
    rank, counts = _rank_in_group(dest, n_e + 1)
    local = e_glob - dest * E_l

    def one_round(r):
        lo = r * C
        sel = (dest < n_e) & (rank >= lo) & (rank < lo + C)
        d = jnp.where(sel, dest, n_e)  # out of range: dropped by the scatters (sent in another round)
        p = jnp.where(sel, rank - lo, 0)
        send_x = jnp.zeros((n_e, C, D), x.dtype).at[d, p].set(x[tok], mode="drop")
        send_e = jnp.full((n_e, C), E_l, jnp.int32).at[d, p].set(local, mode="drop")
        send_w = jnp.zeros((n_e, C), jnp.float32).at[d, p].set(wf, mode="drop")
        got = run(_a2a(send_x, axes).reshape(n_e * C, D), _a2a(send_e, axes).reshape(-1),
                  _a2a(send_w, axes).reshape(-1))
        back = _a2a(got.reshape(n_e, C, D), axes)  # [n_e, C, D]: row (d, c) = my assignment sent to d at c
        return sel, back[jnp.minimum(d, n_e - 1), p]

    sel, got = one_round(0)
    y = jnp.where(sel[:, None], got, jnp.zeros((), got.dtype))
    if C >= A:  # the worst case fits: one round, whatever the routing
        return y
    rounds = jax.lax.pmax((jnp.max(counts[:n_e]) + C - 1) // C, axes)  # every device runs the same collectives

    def body(r, y):
        sel, got = one_round(r)
        return jnp.where(sel[:, None], got, y)

    return jax.lax.fori_loop(1, rounds, body, y)


def _ragged_slots(run, x, e_glob, dest, wf, tok, axes, n_e, E_l):
    """Per-assignment outputs [A, D] through `ragged_all_to_all`: exactly the assignments' rows travel."""
    A = dest.shape[0]
    D = x.shape[1]
    order = jnp.argsort(dest, stable=True).astype(jnp.int32)  # by destination; unsent (n_e) last
    counts = jnp.zeros((n_e + 1,), jnp.int32).at[dest].add(1)[:n_e]
    M = jax.lax.all_gather(counts, axes)  # [n_e, n_e]: M[s, d] = rows s sends d
    me = jax.lax.axis_index(axes)
    send_off = _excl_cumsum(counts)
    out_off = _excl_cumsum(M, 0)[me]  # where my rows land on each receiver: after lower senders' rows
    recv_sz = M[:, me]
    R = n_e * A  # worst case: every device sends me all its assignments
    local = (e_glob - dest * E_l)[order]
    recv_x = ragged_all_to_all(x[tok[order]], jnp.zeros((R, D), x.dtype), send_off, counts, out_off, recv_sz, axes)
    recv_e = ragged_all_to_all(local, jnp.full((R,), E_l, jnp.int32), send_off, counts, out_off, recv_sz, axes)
    recv_w = ragged_all_to_all(wf[order], jnp.zeros((R,), jnp.float32), send_off, counts, out_off, recv_sz, axes)
    got = run(recv_x, recv_e, recv_w)  # [R, D]
    # back: sender s's rows sit at Σ recv_sz[:s] here and go to its sorted buffer at Σ_{d<me} M[s, d]
    back = ragged_all_to_all(got, jnp.zeros((A, D), got.dtype), _excl_cumsum(recv_sz), recv_sz,
                             _excl_cumsum(M, 1)[:, me], counts, axes)
    return jnp.zeros((A, D), got.dtype).at[order].set(back)  # unsent rows: the zeros never overwritten


def routed_experts_dispatch(ex, xf, idx, w, cfg, dt, mesh, *, backend: str = "all_to_all", token_axes=None,
                            expert_axes=("ep",), capacity: Optional[int] = None, slots=None, valid=None,
                            location=None, return_load: bool = False):
    """fp32 [N, D]: the routed experts' sum for tokens xf [N, D], the tokens dispatched to their experts.

    ex: the stacked routed experts (or a run's stacks, `weights.Stacked`), the expert axis
    split over `expert_axes` (a name or tuple: today "ep"; all devices under DP attention); xf [N, D]
    in `dt`, idx int32 [N, k] global expert ids, w fp32 [N, k]: split over `token_axes` (None:
    replicated); valid bool [N] or None: rows marked False (padding) are not dispatched and give
    zeros. backend: "all_to_all" | "ragged" (module doc); capacity: the dense buffer's rows per
    destination and round (default `capacity_for`). slots: the per-device grouped computation with
    `moe.routed_slots`'s signature (default that xla path; the MXFP4 kernel has the same). N need not
    divide the devices (rows are padded, then dropped). Equals `moe._routed_grouped` on one device,
    bitwise in the exact and deterministic modes. Raises ValueError for an unknown backend, experts
    not dividing `expert_axes`, or "ragged" on a platform that cannot run it.

    location: redundant experts (`parallel.eplb`): (slot int32 [E, C], copies int32 [E]) of this layer
    (`eplb.ExpertLocation.tables`, the layer's row; may be traced), with `ex` holding the E + R physical
    experts in placement order. Assignment (row r of device d's q rows, logical expert e) goes to copy
    (d·q + r) mod copies[e] — deterministic, and a replicated expert's tokens spread over its copies —
    and the combine stays in ascending LOGICAL id (idx), so the result is the same bits as without copies.

    return_load: also return int32 [n_e], the (token, slot) rows each expert device received from the
    dispatch (summed over all senders: what sets the grouped GEMM's work per device; `scripts/eplb_report.py`).

    Inside a program already manual over some of these axes (one dp rank's, `parallel.dp`): xf / idx / w
    are the rank's own tokens, `ex` the rank's block of experts, and only the other axes are split here.
    """
    check_backend(backend)
    if backend == "none":
        raise ValueError("routed_experts_dispatch: backend 'none' is collectives.routed_experts (no dispatch)")
    slots = slots or moe.routed_slots
    token_axes, expert_axes = axes_tuple(token_axes), axes_tuple(expert_axes)
    for a in token_axes + expert_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"moe dispatch: mesh axis {a!r} is not in this mesh {tuple(mesh.axis_names)}")
    platform = mesh.devices.flat[0].platform
    if backend == "ragged" and platform in RAGGED_UNSUPPORTED:
        raise ValueError(f"--moe-a2a-backend ragged: XLA:{platform.upper()} cannot run ragged_all_to_all "
                         "(GPU/TPU only); use all_to_all here")
    N, D = xf.shape
    k = idx.shape[1]
    if N * k == 0:
        return jnp.zeros((N, D), jnp.float32)
    ex, layer = weights.split(ex)
    man = manual_axes()
    # physical experts; MXFP4 (`weights.Mxfp4`) or plain ({"weight"}: DeepSeek-V4's bf16 experts) stacks
    E = jax.tree_util.tree_leaves(ex["w1"])[0].shape[-3] * _size(mesh, tuple(a for a in expert_axes if a in man))
    n_e = _size(mesh, expert_axes)
    if E % n_e:
        raise ValueError(f"moe dispatch: {E} routed experts do not split evenly over {'x'.join(expert_axes)}={n_e}")
    E_l = E // n_e
    if location is None:
        slot_t = copies_t = None
        E_log = E
    else:
        slot_t, copies_t = location
        E_log = slot_t.shape[0]
    n_t = _size(mesh, tuple(a for a in token_axes if a not in man))  # (manual ones: already the rank's rows)
    sub = tuple(a for a in expert_axes if a not in token_axes and axis_size(mesh, a) > 1)
    m = _size(mesh, sub)
    # rows padded so that every device of a token shard gets whole rows (pad rows: not valid, dropped after)
    Np = -(-N // (n_t * m)) * n_t * m
    v = jnp.ones((N,), bool) if valid is None else valid.astype(bool)
    if Np != N:
        xf = jnp.pad(xf, ((0, Np - N), (0, 0)))
        idx = jnp.pad(idx, ((0, Np - N), (0, 0)))
        w = jnp.pad(w, ((0, Np - N), (0, 0)))
        v = jnp.pad(v, (0, Np - N))
    q = Np // (n_t * m)  # rows per device
    A = q * k
    C = capacity_for(A, n_e, capacity)

    def local(ex_l, x, i, ww, vv, layer, slot_t, copies_t):
        if layer is not None:
            ex_l = weights.Stacked(ex_l, layer)
        if m > 1:  # tokens replicated over `sub`: each device takes its share
            s = jax.lax.axis_index(sub)
            x, i, ww, vv = (jax.lax.dynamic_slice_in_dim(t, s * q, q, 0) for t in (x, i, ww, vv))
        e_glob = i.reshape(A)
        ok = jnp.repeat(vv, k) & (e_glob >= 0) & (e_glob < E_log)
        tok = jnp.arange(A, dtype=jnp.int32) // k
        if slot_t is not None:  # the logical expert's copy for this row: physical id (module doc of eplb)
            es = jnp.clip(e_glob, 0, E_log - 1)
            row = jax.lax.axis_index(expert_axes) * q + tok
            e_glob = slot_t[es, row % copies_t[es]]
        dest = jnp.where(ok, e_glob // E_l, n_e).astype(jnp.int32)

        def run(rx, re, rw):  # the received rows through the grouped experts: [R, D]
            return slots(ex_l, rx, re[:, None], rw[:, None], cfg, dt, first_expert=0)[:, 0]

        if backend == "all_to_all":
            y = _dense_slots(run, x, e_glob, dest, ww.reshape(A), tok, expert_axes, n_e, E_l, C)
        else:
            y = _ragged_slots(run, x, e_glob, dest, ww.reshape(A), tok, expert_axes, n_e, E_l)
        out = moe.combine_slots(y.reshape(q, k, D), i)  # [q, D] fp32, ascending expert id
        out = jax.lax.all_gather(out, sub, tiled=True) if m > 1 else out
        sent = jnp.zeros((n_e + 1,), jnp.int32).at[dest].add(1)[:n_e]
        return out, jax.lax.psum(sent, all_axes)  # every sending device's rows counted once

    lead = () if layer is None else (None,)
    ex_specs = jax.tree_util.tree_map(lambda _: P(*lead, _spec(tuple(a for a in expert_axes if a not in man))), ex)
    tok_spec = P(_spec(tuple(a for a in token_axes if a not in man)))
    # check_vma=False as in `collectives.routed_experts` (the CPU weight tiles' `lax.cond`).
    all_axes = tuple(dict.fromkeys(a for a in token_axes + expert_axes if a not in man))
    out, load = shard_map(local, mesh, in_specs=(ex_specs, tok_spec, tok_spec, tok_spec, tok_spec, P(), P(), P()),
                          out_specs=(tok_spec, P()), check_vma=False)(ex, xf, idx, w, v, layer, slot_t, copies_t)
    return (out[:N], load) if return_load else out[:N]


def moe_collective_bytes(cfg, tokens_per_device: int, devices: int, backend: str,
                         capacity: Optional[int] = None) -> dict:
    """Collective bytes per device of one decode/prefill step's routed experts, from shapes only.

    tokens_per_device: the rows each device dispatches (its share of the step's tokens); devices: the
    expert devices (tokens split over all of them, experts too). Counts what each device's collectives
    move out (= what it receives, on average), per MoE layer, times `cfg.num_hidden_layers` (every
    layer has routed experts; the DSpark draft's are not counted):

    * "none": today's psum of the slot outputs [N, k, D] of the whole batch N = tokens_per_device ·
      devices, replicated on every device (the all-reduce's operand; a ring moves ~2x it).
    * "all_to_all": per round the [devices, C, D] activations + int32 ids + fp32 weights out and the
      [devices, C, D] outputs back, padding included; C = `capacity_for`, and the worst case's rounds
      (every assignment to one device): ceil(tokens·k / C).
    * "ragged": exactly tokens·k rows each way (activations + ids + weights, outputs back) plus the
      all-gathered counts (devices² int32).

    Activations and outputs are in the activation dtype (`numerics.act_dtype`). Returns {"dispatch",
    "combine", "total", "per_layer", "rounds"} in bytes (rounds: dense rounds, 1 otherwise).
    """
    check_backend(backend)
    D, k, L = cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_hidden_layers
    b = jnp.dtype(act_dtype(cfg)).itemsize
    A = tokens_per_device * k
    rounds = 1
    if backend == "none":
        dispatch, combine = 0, tokens_per_device * devices * k * D * b
    elif backend == "all_to_all":
        C = capacity_for(A, devices, capacity)
        rounds = -(-A // C)
        dispatch = rounds * devices * C * (D * b + 4 + 4)
        combine = rounds * devices * C * D * b
    else:
        dispatch = A * (D * b + 4 + 4) + devices * devices * 4
        combine = A * D * b
    per_layer = dispatch + combine
    return {"dispatch": dispatch * L, "combine": combine * L, "total": per_layer * L, "per_layer": per_layer,
            "rounds": rounds}
