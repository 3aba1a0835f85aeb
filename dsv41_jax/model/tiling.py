"""Scoped row tiles for the "xla" matmuls where XLA widens weights outside the GEMM (CPU).

Why (measured on the flash decode step at batch 1, abstract, CPU; see scripts/bench_decode.py): XLA:CPU
has no fp8 or bf16 GEMM. It converts each low-precision dot operand whole to fp32 in a separate fusion,
and since the conversion of a weight depends on parameters only, its scheduler runs them all at the
start of the program: the compiled step held an fp32 copy of nearly every weight of every layer at once
(31 GB of temporaries, every ``convert(param)`` fusion first in the entry computation). What does not
help, measured on a 6-layer flash-shaped model and on single weights:

* an optimization barrier tying the weight to the activation (XLA:CPU expands barriers before
  scheduling: 29 GB before and after);
* a loop over row tiles (`lax.map` + dynamic slice): XLA:CPU normalizes a dynamic slice or gather of
  bf16 / fp8 / e8m0 data by converting the *whole* operand to f16 / fp32 first, and loop-invariant code
  motion then hoists that conversion out of the loop (a full f32 copy of the 1.3 GB head); bitcasting
  to uint8 first makes the bitcast a hoisted full copy instead.

What works: XLA:CPU neither hoists code out of a conditional branch nor widens a static slice of a
parameter taken inside one. So on such a backend each weight (or each static row tile of a large one)
is multiplied inside ``lax.cond(pred(x), tile, zeros)``: `pred` is computed from the activation, so the
branch, and the widening in it, cannot run before the activation exists; at most one tile's widened
copy (<= `TILE_BYTES`) is alive at a time. `pred` is always true (`_always_true`); the false branch
exists only to satisfy `cond` and is never taken. Tiling along the output rows changes no arithmetic:
every output element is the same K-sum of the same products (the backend's dot may order that sum
differently for another tile width: fp32 last bits, as any change of GEMM shape).

On GPU (and any backend not in `SCOPED_BACKENDS`) nothing of this applies: a conditional costs a
device-to-host sync there, and XLA:GPU fuses operand conversions into the GEMM fusion; matmuls run as
one plain dot per weight. The policy is resolved at trace time from `jax.default_backend()` and logged
once per backend. Whether XLA:GPU materializes widened weights is for the GPU run's memory analysis
to show.

Cost counters: a `cond` counts its costliest branch once, and each tile is its own `cond`, so counts
that follow branches (scripts/bench_decode.py) see every tile once.

On a mesh (`on_mesh`, entered by the model's entry points when they get one) a weight whose rows are
split over devices (its logical row axis names a mesh axis: q heads, o groups, the shared expert's
intermediate, the vocabulary — the plan's rules) is tiled *within each device's rows*: tile i is rows
r0 .. r0 + tn − 1 of every shard at once (`rows` takes that strided slice: a reshape to [k, N/k, ...]
and a slice of the inner axis, local on every device), each tile's output is pinned split over the
mesh axis, and the tiles are reassembled shard-major, so the result is laid out (and split) as the
untiled product. Without that, a contiguous tile of a split weight lies on some devices only, XLA
computes the conditional's result replicated, and moves the (widened) weight tile to every device:
measured on the flash decode step at tp=2 x ep=4, ~2.9 GB of collective-permutes and all-to-alls per
step (scripts/aot_flash.py, README), where the untiled program needs none.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

# Backends whose XLA widens low-precision dot operands whole, outside the GEMM, at this many bytes per
# element.
SCOPED_BACKENDS = {"cpu": 4}
# Largest widened tile: a weight whose widened copy is larger is split into row tiles of at most this.
TILE_BYTES = 128 * 2**20
# Weights whose widened copy is at most this are multiplied plainly even there: hoisting such a copy
# costs little, and a conditional per small matmul would only add compile time (tiny, tests).
MIN_SCOPED_BYTES = 2**20


@functools.lru_cache(maxsize=None)
def _itemsize(backend: str):
    size = SCOPED_BACKENDS.get(backend)
    if size:
        log.info("tiling: backend %s widens dot operands outside the GEMM: each xla matmul's weight is widened "
                 "inside a conditional scoped to its activation, in row tiles of <= %d MiB", backend,
                 TILE_BYTES >> 20)
    else:
        log.info("tiling: backend %s: one plain GEMM per weight (no scoping, no row tiles)", backend)
    return size


def n_tiles(n_rows: int, row_elems: int, align: int = 1, backend: str = None) -> int:
    """Row tiles for a weight of `n_rows` output rows x `row_elems` elements per row (0 = not scoped).

    0 on backends that are not scoped (one plain dot, no conditional) and for weights whose widened
    copy is at most `MIN_SCOPED_BYTES`. Else the smallest divisor d of
    n_rows // align with widened size / d <= TILE_BYTES (align: rows per scale block, e.g. 32 for
    32x32-block fp8, so that a tile holds whole blocks); 1 when n_rows is not a multiple of align.
    """
    size = _itemsize(backend or jax.default_backend())
    widened = n_rows * row_elems * (size or 0)
    if widened <= MIN_SCOPED_BYTES:
        return 0
    if n_rows % align:
        return 1
    need = -(-widened // TILE_BYTES)
    units = n_rows // align
    for d in range(need, units + 1):
        if units % d == 0:
            return d
    return units


class Split(NamedTuple):
    """A weight's rows split over `k` devices along mesh axis (or axes) `axis` of `mesh`."""
    k: int
    mesh: object
    axis: object


_MESH = contextvars.ContextVar("dsv41_tiling_mesh", default=None)
_ACTIVE = contextvars.ContextVar("dsv41_tiling_split", default=None)  # the Split of the tile being traced


@contextlib.contextmanager
def on_mesh(par):
    """Trace the enclosed model code for mesh plan `par` (None: no-op): row tiles follow the weights'
    row splits (`par.row_split`, from `parallel.plan.MeshPlan`)."""
    tok = _MESH.set(par)
    try:
        yield
    finally:
        _MESH.reset(tok)


def mesh_plan():
    """The mesh plan the enclosed model code is being traced for (`on_mesh`), or None."""
    return _MESH.get()


def row_split(logical: Optional[str], n_rows: int, align: int = 1) -> Optional[Split]:
    """The `Split` of a weight with `n_rows` rows of logical axis `logical` on the current mesh plan
    (`on_mesh`), or None: no plan, rows not split by its rules, or rows that do not split into whole
    `align` blocks."""
    par = _MESH.get()
    if par is None or logical is None:
        return None
    split = par.row_split(logical, n_rows, align)
    return None if split is None else Split(split[0], par.mesh, split[1])


def plan(n_rows: int, row_elems: int, align: int = 1, logical: Optional[str] = None, backend: str = None):
    """(tiles, split) for `over_rows`: `n_tiles` of one device's rows when the rows are split
    (`row_split`), else of the whole weight."""
    split = row_split(logical, n_rows, align)
    k = split.k if split else 1
    return n_tiles(n_rows // k, row_elems, align, backend), split


def _pin(y, split: Split):
    """y [..., k·w] pinned split over the mesh axis along its last dim."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.lax.with_sharding_constraint(
        y, NamedSharding(split.mesh, PartitionSpec(*(None,) * (y.ndim - 1), split.axis)))


def _always_true(x):
    """A bool scalar that is always true but depends on `x` through an op XLA does not fold: the number
    of set bits of x's first element is at most its bit width. (Indexed, not ``x.reshape(-1)[0]``: a
    reshape of an activation split over devices gathers all of it first.)"""
    v = x[(0,) * x.ndim]
    bits = v.dtype.itemsize * 8
    u = jax.lax.bitcast_convert_type(v, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[v.dtype.itemsize])
    return jax.lax.population_count(u) <= bits


def scoped(x, fn):
    """fn() (a pytree of arrays) computed inside a conditional that runs after `x` exists (module doc)."""
    if x.size == 0:
        return fn()
    out = jax.eval_shape(fn)
    return jax.lax.cond(_always_true(x), fn,
                        lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out))


def over_rows(x, n_rows: int, nt: int, body, split: Optional[Split] = None):
    """body(r0, tn) -> [..., w] over row tiles r0 .. r0 + tn − 1 of a weight, concatenated: [..., nt·w].

    `nt` from `n_tiles`: 0 = body(0, n_rows) as is; else `nt` static tiles (r0, tn Python ints), each
    `scoped` on the activation `x`. Tiles are in row order.

    `split` (from `plan` / `row_split`): the weight's rows are split over `split.k` devices and `nt`
    counts tiles per device: body(r0, tn) then sees rows r0 .. r0 + tn − 1 *of every shard* through
    `rows` (k·tn rows, shard-major) and returns [..., k·w]; the tiles are reassembled shard-major into
    the untiled layout, split over the mesh axis (module doc).
    """
    if nt == 0:
        return body(0, n_rows)
    if split is None:
        tn = n_rows // nt
        ys = [scoped(x, functools.partial(body, i * tn, tn)) for i in range(nt)]
        return ys[0] if nt == 1 else jnp.concatenate(ys, axis=-1)
    k = split.k
    tn = n_rows // k // nt

    def tile(r0):
        tok = _ACTIVE.set(split)
        try:
            return _pin(body(r0, tn), split)
        finally:
            _ACTIVE.reset(tok)

    ys = [scoped(x, functools.partial(tile, i * tn)) for i in range(nt)]
    if nt == 1:
        return _pin(ys[0], split)
    ys = [y.reshape(y.shape[:-1] + (k, y.shape[-1] // k)) for y in ys]
    y = jnp.concatenate(ys, axis=-1)
    return _pin(y.reshape(y.shape[:-2] + (-1,)), split)


def rows(a, r0: int, tn: int, axis: int = 0):
    """a[..., r0 : r0 + tn, ...] along `axis` (a static slice of a stored weight, at stored width).

    Inside a split tile (`over_rows` with a `Split`): rows r0 .. r0 + tn − 1 of each of the k equal
    shards of that axis, concatenated shard-major (k·tn rows; local on every device)."""
    split = _ACTIVE.get()
    if split is None:
        if r0 == 0 and tn == a.shape[axis]:
            return a
        return jax.lax.slice_in_dim(a, r0, r0 + tn, axis=axis)
    k, n = split.k, a.shape[axis]
    if n % k:
        raise ValueError(f"tiling.rows: axis {axis} of {a.shape} does not split into {k} shards")
    if tn == n // k:
        return a
    a3 = a.reshape(a.shape[:axis] + (k, n // k) + a.shape[axis + 1:])
    t = jax.lax.slice_in_dim(a3, r0, r0 + tn, axis=axis + 1)
    return t.reshape(a.shape[:axis] + (k * tn,) + a.shape[axis + 1:])
