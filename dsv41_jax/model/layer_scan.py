"""Runs of layers that share a plan, traced once as a `lax.scan` (docs/design/layer_scan.md).

`forward` and `decode.extend_uncommitted` loop over layers in Python, so XLA sees one copy of the
layer's computation per layer: compile time grows with the layer count (flash: 40 layers). Layers
whose `cfg.layer_plan(i)` agree in everything but ``layer_id`` — the *consumers* between two KV /
index sources, and runs of plain window-only layers — have identical parameter shapes and identical
reads (the run's KV source's compressed pool and its index source's top-k, both produced before the
run starts; each layer's own window ring). A run of n >= 2 such layers is one ``lax.scan`` of length
n over the run's parameters stacked on a leading axis (and, in the cached step, the rows of each
layer's window ring this batch reads): the body is traced and compiled once per run.

Which layers form runs (`layer_runs`): maximal stretches of consecutive target layers with equal
plans (``layer_id`` aside) that are not KV / index / candidate sources and not Engram layers (each
Engram layer has its own table size and hash, so it never shares a body). Flash: 18 runs over 40
layers. tiny: none (every tiny layer is a source, an Engram layer or a different consumer).

The switch: `ModelConfig.layer_scan` (default True). False = the unrolled Python loop, the
reference the scan is tested against (tests/test_layer_scan.py): one run per layer, nothing stacked; which one
runs is logged once.

Parameter layout. The canonical tree (checkpoint, conversion, `init_params`, sharding rules) keeps one
dict per layer in ``params["layers"]``. A scan needs a run's weights on one leading axis:

* `stack_layers(params, cfg)` makes the *stacked* layout once, at load: for each run of n >= 2 starting
  at layer f, ``params["layer_stacks"][str(f)]`` holds the run's layer tree with a leading n axis and
  ``params["layers"][f..f+n-1]`` become None. `unstack_layers` is its exact inverse. The same function
  stacks any tree in the canonical layout: arrays, `jax.ShapeDtypeStruct`s (the abstract bench) and
  `NamedSharding`s (the leading axis replicated: `parallel.rules.step_shardings` on a mesh).
* Given canonical params, the scan stacks the run under jit (`run_params`): one copy of the run's
  weights per call (logged once with its size). Harmless for tiny models and tests; for a real model
  it doubles the weight traffic of the step and needs the copy as temporaries (flash: 208 GiB over 30 layers), so
  the engine stacks at load (`prepare`).
* Either layout runs either way: with the switch off, a layer of params stacked for it on is read as a slice
  of its stack (`layer_params`).
* Stacked leaves are stored with narrow floats as same-width unsigned integers (`storage_dtype`: the
  scan's dynamic slice of a bf16 / fp8 / e8m0 stack is widened whole by XLA:CPU); bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.params import P, layer_decl

log = logging.getLogger(__name__)

STACKS = "layer_stacks"


def _plan_key(plan):
    return dataclasses.replace(plan, layer_id=-1)


def _scannable(plan) -> bool:
    """A layer that writes no store (no compressor, indexer, candidates) and has no Engram."""
    return not (plan.is_kv_source or plan.is_index_source or plan.is_candidate_source or plan.is_engram
                or plan.is_dspark)


@functools.lru_cache(maxsize=64)
def layer_runs(cfg) -> tuple:
    """The runs ((first, n), ...) the forward / cached step execute and `stack_layers` stacks, covering
    0..num_hidden_layers-1 in order: maximal runs of consecutive target layers that can share one scan body
    (sources and Engram layers are runs of one); with ``cfg.layer_scan`` False one run per layer (nothing is
    stacked). Made once per config (a server's `prepare` at load) and logged then."""
    L = cfg.num_hidden_layers
    if not cfg.layer_scan:
        log.info("layer scan: off (ModelConfig.layer_scan=False): %d layers unrolled", L)
        return tuple((i, 1) for i in range(L))
    runs = []
    i = 0
    while i < L:
        p = cfg.layer_plan(i)
        n = 1
        if _scannable(p):
            while i + n < L and _plan_key(cfg.layer_plan(i + n)) == _plan_key(p):
                n += 1
        runs.append((i, n))
        i += n
    _check_shapes(cfg, runs)
    log.info("layer scan: on: %d layers traced as %d bodies (runs (first, n): %s)", L, len(runs), runs)
    return tuple(runs)


def _check_shapes(cfg, runs) -> None:
    """Layers of a run must declare identical parameter trees (shapes, dtypes): the scan needs it."""
    for f, n in runs:
        if n < 2:
            continue
        ref = jax.tree_util.tree_map(lambda p: (p.shape, p.dtype), layer_decl(cfg, f))
        for i in range(f + 1, f + n):
            got = jax.tree_util.tree_map(lambda p: (p.shape, p.dtype), layer_decl(cfg, i))
            if got != ref:  # a plan-identical layer with other shapes: the plan misses a distinction
                raise AssertionError(f"layer_scan: layers {f} and {i} share a plan but not their parameter shapes")


def has_runs(cfg) -> bool:
    """Whether the step scans anything (switch on and some run of >= 2 layers)."""
    return any(n > 1 for _, n in layer_runs(cfg))


# ------------------------------------------------------------------------------------- layouts


def _stack_sharding(sh):
    """The sharding of a stacked leaf: the layers' split, the new leading (layer) axis replicated."""
    if isinstance(sh, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))
    return sh


def storage_dtype(dtype):
    """The dtype a stacked leaf is stored in: floats narrower than 32 bits (bf16, fp8, e8m0) as the
    unsigned integer of their width, bit for bit; others as they are.

    Why: a scan slices its layer out of the stack with a dynamic slice, and XLA:CPU cannot dynamic-slice
    bf16 / fp8 / e8m0 data: it converts the *whole* stacked operand to f32 first, and hoists that out of
    the loop (measured: 65.7 GB of temporaries on the flash decode step, mostly the experts' e8m0
    scales widened). Integers are sliced as they are; the body bitcasts its slice back (`load_row`)."""
    d = jnp.dtype(dtype)
    if jnp.issubdtype(d, jnp.floating) and d.itemsize < 4:
        return jnp.dtype({1: jnp.uint8, 2: jnp.uint16}[d.itemsize])
    return d


def _stack_leaves(*xs):
    """Stack one non-array leaf of each layer of a run along a new leading axis, by leaf kind."""
    x0 = xs[0]
    if isinstance(x0, jax.sharding.NamedSharding):
        return _stack_sharding(x0)
    if isinstance(x0, jax.ShapeDtypeStruct):
        sh = x0.sharding
        return jax.ShapeDtypeStruct((len(xs),) + tuple(x0.shape), storage_dtype(x0.dtype),
                                    sharding=_stack_sharding(sh) if isinstance(sh, jax.sharding.NamedSharding) else None)
    if isinstance(x0, P):
        return dataclasses.replace(x0, shape=(len(xs),) + tuple(x0.shape), axes=(None,) + tuple(x0.axes),
                                   dtype=storage_dtype(x0.dtype))
    return np.stack(xs).view(storage_dtype(xs[0].dtype))


def _stack_traced(*a):
    y = jnp.stack(a)
    sd = storage_dtype(y.dtype)
    return y if sd == y.dtype else jax.lax.bitcast_convert_type(y, sd)


def load_row(row, like):
    """A layer's params inside a scan body: `row` (one row of a stack, storage dtypes) bitcast back to
    the dtypes of `like` (a tree of arrays / ShapeDtypeStructs / declarations with the real dtypes)."""
    leaves, tree = jax.tree_util.tree_flatten(row)
    return tree.unflatten([a if a.dtype == jnp.dtype(d.dtype) else jax.lax.bitcast_convert_type(a, d.dtype)
                           for a, d in zip(leaves, tree.flatten_up_to(like))])


def _is_leaf(x):
    return isinstance(x, (P, jax.sharding.NamedSharding, jax.ShapeDtypeStruct))


def stack_tree(trees, traced: bool = False):
    """One tree with a leading axis from equal-structure trees: device arrays (stacked by one jitted
    call per tree, each leaf keeping its layers' sharding, the new axis replicated), host arrays,
    `jax.ShapeDtypeStruct`s, `NamedSharding`s and `params.P` declarations; ``traced=True``: values
    inside a jitted function (plain `jnp.stack`)."""
    if traced:
        return jax.tree_util.tree_map(_stack_traced, *trees)
    leaves = jax.tree_util.tree_leaves(trees[0], is_leaf=_is_leaf)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        out = jax.tree_util.tree_map(lambda a: _stack_sharding(a.sharding), trees[0])
        return jax.jit(lambda ts: jax.tree_util.tree_map(_stack_traced, *ts), out_shardings=out)(trees)
    return jax.tree_util.tree_map(_stack_leaves, *trees, is_leaf=_is_leaf)


def set_path(tree, path, value):
    """A copy of nested dict `tree` with `path` set to `value` (the dicts on the path copied)."""
    if not path:
        return value
    return dict(tree, **{path[0]: set_path(tree[path[0]], path[1:], value)})


def is_stacked(params) -> bool:
    return STACKS in params


def stack_layers(params: dict, cfg) -> dict:
    """The stacked layout (module doc) of a canonical tree: each run of n >= 2 (`layer_runs`) on a
    leading axis under ``params["layer_stacks"][str(first)]``, its entries in ``params["layers"]``
    None. Works for parameter arrays (host or device, sharded or not), abstract trees and sharding
    trees. A tree without runs is returned as it is (tiny). Not jitted: meant for load time."""
    if is_stacked(params):
        return params
    runs = [(f, n) for f, n in layer_runs(cfg) if n > 1]
    if not runs:
        return params
    layers = list(params["layers"])
    stacks = {}
    for f, n in runs:
        stacks[str(f)] = stack_tree(layers[f: f + n])
        for i in range(f, f + n):
            layers[i] = None
    return dict(params, layers=layers, **{STACKS: stacks})


def unstack_layers(params: dict, cfg) -> dict:
    """Inverse of `stack_layers` (bit for bit): the canonical layout, each stacked layer a row of its
    stack in its declared dtypes."""
    if not is_stacked(params):
        return params
    layers = list(params["layers"])
    for f, tree in params[STACKS].items():
        n = jax.tree_util.tree_leaves(tree)[0].shape[0]
        like = layer_decl(cfg, int(f))
        rows = jax.jit(lambda t: [load_row(jax.tree_util.tree_map(lambda a, k=k: a[k], t), like)
                                  for k in range(n)])(tree)
        layers[int(f): int(f) + n] = rows
    out = {k: v for k, v in params.items() if k != STACKS}
    out["layers"] = layers
    return out


def layer_params(params: dict, i: int, cfg) -> dict:
    """Layer i's parameter tree in either layout (a row of its stack, in its declared dtypes, when
    stacked)."""
    lp = params["layers"][i]
    if lp is not None:
        return lp
    for f, tree in params.get(STACKS, {}).items():
        n = jax.tree_util.tree_leaves(tree)[0].shape[0]
        if int(f) <= i < int(f) + n:
            return load_row(jax.tree_util.tree_map(lambda a: a[i - int(f)], tree), layer_decl(cfg, i))
    raise KeyError(f"layer {i}: no parameters (neither params['layers'][{i}] nor a stack holding it)")


def run_params(params: dict, first: int, n: int, cfg) -> dict:
    """The parameters of run (first, n) with a leading n axis in storage dtypes (`storage_dtype`; the
    scan body restores each row with `load_row`): the load-time stack if there is one, else stacked
    here (under jit: a copy of the run's weights on every call; logged once)."""
    st = params.get(STACKS, {}).get(str(first))
    if st is not None:
        if jax.tree_util.tree_leaves(st)[0].shape[0] != n:
            raise ValueError(f"params stacked for another layer plan: the stack at layer {first} has "
                             f"{jax.tree_util.tree_leaves(st)[0].shape[0]} layers, this config's run has {n}")
        return st
    trees = [layer_params(params, i, cfg) for i in range(first, first + n)]
    _log_copy(first, n, sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                            for x in jax.tree_util.tree_leaves(trees)))
    return stack_tree(trees, traced=True)


@functools.lru_cache(maxsize=256)
def _log_copy(first: int, n: int, nbytes: int) -> None:
    log.info("layer scan: stacking layers %d-%d inside the step (%.1f MiB copied per call; "
             "layer_scan.stack_layers at load avoids it)", first, first + n - 1, nbytes / 2**20)


def prepare(params: dict, cfg) -> dict:
    """What a server does at load: the stacked layout when the step scans (`has_runs`), else params
    unchanged."""
    return stack_layers(params, cfg) if has_runs(cfg) else params
