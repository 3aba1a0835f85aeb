"""ONE table from logical axes to mesh axes, and every sharding derived from it.

`RULES` maps each logical axis name to a mesh axis ("tp", "ep") or None (replicated). Parameters carry
their logical axes in `params.declare_params`; activations, the cache pytree and the decode step's
batch use the names below. A logical axis missing from the table is an error (never a silent
replication), so adding a tensor with a new axis forces a decision here.

Parameters
  - attention heads over tp: q heads (``wq_b`` rows, ``attn_sink``), the o groups (``wo_a`` rows) and
    ``wo_b``'s input; after ``wo_b`` each tp shard holds a partial sum over its heads, and XLA inserts
    the one all-reduce over tp (fp32 — before the output is rounded, so only the fp32 summation order
    changes; none at all in the exact numerics mode, where the sum is fp64).
  - the shared expert's intermediate over tp (w1/w3 rows, w2 input): same pattern, one all-reduce.
  - the embedding and the head over tp along the vocabulary (embedding rows are gathered locally and
    summed with one all-reduce, `collectives.row_gather`; logits are all-gathered once at the end).
  - routed experts over ep (stacked expert axis; the gate's rows too, "experts_gate"). The MoE runs under `shard_map`
    (`collectives.routed_experts`): expert weights never move, each shard multiplies the assignments
    of its own experts, one all-reduce combines (see there).
  - Engram table rows over every device, ep x tp (`engram_rows`; ~189 GiB for flash, the largest
    tensors, read 24 rows per token: replicating them over ep would cost 189/tp GiB per device), padded
    up to a multiple of the device count (`padded_shape`; padding rows are never addressed); local
    gather + one all-reduce over both axes (`collectives.row_gather`). On a tp-only mesh: over tp.
  - everything else (norms, mHC, q/kv down-projections, compressor, indexer) is small: replicated.
    A dim whose size does not divide by its mesh axis is replicated too (e.g. the fp8 block-scale rows
    of a small weight): correct, only less memory-efficient (listed by `replicated_fallbacks`).

DeepSeek-V4 (`model.v4.params`) uses the same table: its attention is the same one-latent-head MQA (heads,
o groups, shared expert, vocabulary over tp; routed experts and the gate over ep); its extra tensors have the
rows marked "DeepSeek-V4" below, all replicated: the per-layer compressors and indexers are V4.1's replicated
kinds, the ``tid2eid`` hash table is read locally (splitting it like the embedding would put a gather + psum
in every hash-routed layer for 4 B x top-k per vocabulary row).

Cache (`cache_shardings`): **replicated over both axes**. V4.1 attention is MQA with ONE 512-wide latent
head: the window rings, the compressed pools and the index-key pools are read by every query head, so
they cannot follow the heads (there is one), and splitting them along positions or along the latent
dims would put a collective inside every attention/indexer read (an all-reduce of logits or scores
per layer and step). Their total is small next to the weights (~890 B/token beyond the window, SPEC
§9), so each tp/ep shard keeps a full copy and computes the latent K=V itself (``wkv`` is replicated,
so all shards write the same values: no communication). This is also SGLang's MLA layout under TP.
Sharding the cache needs data-parallel attention: `DP_RULES` below.

Activations: the residual streams, norms and everything per token are replicated ("batch", "seq",
"act_embed" -> None; "batch" is also the axis the token-dispatch MoE splits tokens over,
`moe_dispatch`, and "experts" the axes it sends them to: a data-parallel mesh maps "batch" to its
request axis and "experts" to all devices); attention activations are split over tp along heads ("act_heads"); the step's
batch (small int arrays) and its logits are replicated.

Data-parallel attention (a mesh with a "dp" axis > 1, `mesh.make_mesh(dp=D)`): `DP_RULES`, chosen by
`rules_for(mesh)` wherever no table is given. The step's batch rows ("batch") and every rank-blocked
state axis — slot rows ("cache_slots": window rings, partial groups, Engram history, DSpark rings) and
pool pages ("cache_pool": compressed latents, index keys; DeepSeek-V4's per-layer rings, compressor projections, MTP
state and CSA / HCA / index pools name the same two, `_v4_cache_axes`) — split over "dp" (the blocks of
`model.cache.rank_slots` / `rank_pages`: contiguous, rank r's on mesh row r); attention heads, the
shared expert and the vocabulary stay over tp inside a rank; the routed experts and the Engram rows
over ALL devices (("dp", "tp"), dp major); the gate ("experts_gate", small) replicated, since every
rank routes its own tokens. Inside a rank's program (`parallel.dp`: manual over "dp"), constraints use
`RANK_RULES`: the same table without "dp".
"""

from __future__ import annotations

import logging
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dsv41_jax.parallel.mesh import axis_size

log = logging.getLogger(__name__)

RULES = {
    # parameters (names from params.declare_params)
    "vocab": "tp",          # embedding / head rows, Engram token map
    "heads": "tp",          # q heads (wq_b out, attn_sink), o groups (wo_a out)
    "o_in": "tp",           # wo_b input (group-major, follows the heads)
    "mlp": "tp",            # shared expert intermediate
    "experts": "ep",        # routed experts (stacked axis)
    "experts_gate": "ep",   # the gate's rows and biases (one per expert)
    "engram_rows": ("ep", "tp"),  # Engram table rows over EVERY device (padded to a multiple of ep·tp)
    "embed": None,          # hidden size
    "q_lora": None,
    "kv": None,             # the one latent head (head_dim)
    "index": None,          # indexer heads / dims: small
    "hc": None,             # mHC
    "expert_mlp": None,     # routed expert intermediate (experts are split over ep instead)
    # DeepSeek-V4's own tensors (`model.v4.params`; docs/design/v4.md "Mesh"): every CSA / HCA compressor
    # (wkv / wgate rows "kv", its ``ape`` [ratio, w·d] "comp_slot" x "kv") and CSA's Lightning indexer with its
    # compressor ("index", "kv") are replicated as V4.1's are; so is the model-level ``hc_head`` ("hc").
    "comp_slot": None,      # V4 ``ape`` rows (the slots of one compression window)
    "hash_vocab": None,     # V4 ``tid2eid`` [vocab, k] rows: small, read by token id at each hash-routed MoE
    # activations
    "batch": None,
    "seq": None,
    "act_embed": None,
    "act_heads": "tp",
    "act_vocab": None,      # logits: gathered once
    # cache (module docstring: replicated)
    "cache_slots": None,
    "cache_layers": None,
    "cache_ring": None,
    "cache_pool": None,
    "cache_group": None,
    "cache_dim": None,
    "cache_ngram": None,
}

# Data-parallel attention (module doc): requests and their state over "dp", experts and Engram rows over all.
DP_RULES = {**RULES,
            "experts": ("dp", "tp"),
            "experts_gate": None,
            "engram_rows": ("dp", "tp"),
            "batch": "dp",
            "cache_slots": "dp",
            "cache_pool": "dp"}


def _without(table: dict, axis: str) -> dict:
    """`table` with mesh axis `axis` dropped from every entry (what a program manual over `axis` sees)."""
    def drop(ax):
        if isinstance(ax, tuple):
            ax = tuple(a for a in ax if a != axis)
            return None if not ax else (ax[0] if len(ax) == 1 else ax)
        return None if ax == axis else ax

    return {k: drop(v) for k, v in table.items()}


# Inside one dp rank's program (manual over "dp"): the rest of the mesh, as DP_RULES places it.
RANK_RULES = _without(DP_RULES, "dp")


def rules_for(mesh) -> dict:
    """The rules table of `mesh`: `DP_RULES` on a mesh with a "dp" axis > 1, else `RULES`."""
    return DP_RULES if axis_size(mesh, "dp") > 1 else RULES


# Logical axes whose dims are padded up to a multiple of their mesh axis instead of being replicated.
PAD_AXES = ("engram_rows",)


def _is_decl(x):
    from dsv41_jax.model.params import P

    return isinstance(x, P)


def mesh_axis(logical: Optional[str], mesh, rules=None):
    """The mesh axis of a logical axis: a name, a tuple of names (split over their product, major
    first), or None (replicated; also when every named axis has size 1 here). Unknown names raise."""
    if logical is None:
        return None
    table = rules_for(mesh) if rules is None else rules
    if logical not in table:
        raise KeyError(f"logical axis {logical!r} is not in the sharding rules table (parallel/rules.py RULES)")
    ax = table[logical]
    if ax is None:
        return None
    if isinstance(ax, tuple):
        ax = tuple(a for a in ax if axis_size(mesh, a) > 1)
        return None if not ax else (ax[0] if len(ax) == 1 else ax)
    return None if axis_size(mesh, ax) == 1 else ax


def mesh_axes_size(ax, mesh) -> int:
    """Devices along a `mesh_axis` result (a name, a tuple of names, or None)."""
    if ax is None:
        return 1
    names = ax if isinstance(ax, tuple) else (ax,)
    n = 1
    for a in names:
        n *= axis_size(mesh, a)
    return n


def _names(ax) -> tuple:
    return () if ax is None else (ax if isinstance(ax, tuple) else (ax,))


def padded_shape(axes, shape, mesh, rules=None) -> tuple:
    """`shape` with the dims of `PAD_AXES` rounded up to a multiple of their mesh axis size."""
    out = []
    for ax, d in zip(axes, shape):
        m = mesh_axis(ax, mesh, rules)
        if ax in PAD_AXES and m is not None:
            k = mesh_axes_size(m, mesh)
            d = -(-d // k) * k
        out.append(d)
    return tuple(out)


def spec(axes, shape, mesh, rules=None) -> PartitionSpec:
    """PartitionSpec of a tensor with logical `axes` and (already padded) `shape` on `mesh`.

    A dim that does not divide by its mesh axis is replicated; a mesh axis is used at most once."""
    used, out = set(), []
    for ax, d in zip(axes, shape):
        m = mesh_axis(ax, mesh, rules)
        if m is not None and (used & set(_names(m)) or d % mesh_axes_size(m, mesh)):
            m = None
        used |= set(_names(m))
        out.append(m)
    return PartitionSpec(*out)


def named(mesh, axes, shape, rules=None) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, shape, mesh, rules))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# ------------------------------------------------------------------------------------------ params


def param_shapes(cfg, mesh, rules=None) -> dict:
    """Abstract parameter tree on `mesh` (padded shapes, `ShapeDtypeStruct` with shardings)."""
    from dsv41_jax.model.params import declare_params

    def one(p):
        shape = padded_shape(p.axes, p.shape, mesh, rules)
        return jax.ShapeDtypeStruct(shape, p.dtype, sharding=named(mesh, p.axes, shape, rules))

    return jax.tree_util.tree_map(one, declare_params(cfg), is_leaf=_is_decl)


def param_shardings(cfg, mesh, rules=None) -> dict:
    """`NamedSharding` per parameter (same tree as the params), from the logical axes and `RULES`."""
    return jax.tree_util.tree_map(lambda s: s.sharding, param_shapes(cfg, mesh, rules))


def replicated_fallbacks(cfg, mesh, rules=None) -> list:
    """Names of parameters with a dim whose rule names a mesh axis but which is replicated (does not
    divide). Informational (logged by `shard_params`)."""
    from dsv41_jax.model.params import declare_params, flatten_names

    out = []
    for name, p in flatten_names(declare_params(cfg)).items():
        shape = padded_shape(p.axes, p.shape, mesh, rules)
        sp = spec(p.axes, shape, mesh, rules)
        if any(mesh_axis(a, mesh, rules) is not None and s is None for a, s in zip(p.axes, sp)):
            out.append(name)
    return out


def _shard_of(host, idx, shape):
    """The block `idx` (a tuple of slices into the padded `shape`) of host array `host`, whose dims may
    be shorter than `shape` (Engram row padding): rows past the end are ones (a valid value of every float8 kind,
    e8m0 included; padding rows are never addressed)."""
    idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
    if tuple(host.shape) == tuple(shape):
        return host[idx]
    bounds = [sl.indices(d) for sl, d in zip(idx, shape)]
    out = np.ones(tuple(len(range(*b)) for b in bounds), host.dtype)
    src, dst = [], []
    for (b0, b1, st), n in zip(bounds, host.shape):
        if st != 1:
            raise ValueError("place_host: strided shard index")
        hi = min(b1, n)
        src.append(slice(b0, max(b0, hi)))
        dst.append(slice(0, max(0, hi - b0)))
    out[tuple(dst)] = host[tuple(src)]
    return out


def place_host(host, shape, sharding):
    """A host array (numpy) placed on `sharding` as a global array of `shape` (>= host.shape per dim;
    the extra rows are padding, ones): each device receives only ITS block, cut from the host copy by
    `jax.make_array_from_callback` — no device ever holds the whole tensor first (unless its sharding
    replicates it), and no padded host copy is made. Works for a multi-process mesh when every process
    holds the same host values (each process fills its own devices)."""
    host = np.asarray(host)
    shape = tuple(shape)
    if len(shape) != host.ndim or any(h > d for h, d in zip(host.shape, shape)):
        raise ValueError(f"place_host: host array {host.shape} does not fit the placed shape {shape}")
    return jax.make_array_from_callback(shape, sharding, lambda idx: _shard_of(host, idx, shape))


def shard_params(params, cfg, mesh, rules=None, engram_host_table: bool = False) -> dict:
    """Place a parameter tree (host or device arrays, `init_params` / `load_params` layout) on `mesh`.

    Engram tables are padded to a multiple of tp rows (`padded_shape`); every leaf goes to its
    `param_shardings` sharding (built from host copies, so it also works for a multi-process mesh when
    every process holds the same values). engram_host_table: keep the Engram tables on the host
    instead (`host_table.offload_engram`; run the step with ``jitted_extend(..., engram_host_table=True)``).
    """
    abstract = param_shapes(cfg, mesh, rules)
    if cfg.model_family == "deepseek_v4" and not params.get("mtp"):  # a V4 checkpoint without its MTP layer
        abstract = dict(abstract, mtp=[])
    if engram_host_table:
        from dsv41_jax.parallel.host_table import offload_engram

        params = offload_engram(params)
        abstract = dict(abstract, layers=[dict(a, engram=dict(a["engram"], embed=p["engram"]["embed"]))
                                          if "engram" in a else a
                                          for a, p in zip(abstract["layers"], params["layers"])])
    fb = replicated_fallbacks(cfg, mesh, rules)
    if fb:
        log.info("sharding: %d parameter(s) replicated where their rule's mesh axis does not divide them "
                 "(e.g. %s)", len(fb), ", ".join(fb[:3]))

    def place(a, s):
        if isinstance(a, jax.Array) and a.shape == s.shape and a.sharding == s.sharding:
            return a  # already on its sharding (e.g. `plan.load_params(..., mesh)`)
        return place_host(np.asarray(a), s.shape, s.sharding)

    return jax.tree_util.tree_map(place, params, abstract)


def param_bytes_per_device(tree) -> dict:
    """{device: bytes} of the shards of a tree of `jax.Array`s or sharded `ShapeDtypeStruct`s."""
    out: dict = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        sh = leaf.sharding
        shard = sh.shard_shape(leaf.shape)
        nbytes = int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
        for d in sh.device_set:
            out[d] = out.get(d, 0) + nbytes
    return out


# ------------------------------------------------------------------------------------------ cache


def cache_axes(state) -> dict:
    """Logical axes of every leaf of a cache pytree (`cache.init_cache` layout, or DeepSeek-V4's), by its position."""
    if isinstance(state["window"], list) or "mtp" in state:
        return _v4_cache_axes(state)

    def store(tree, lead):
        return {k: lead + ("cache_dim",) * (v.ndim - len(lead)) for k, v in tree.items()}

    out = {"window": store(state["window"], ("cache_slots", "cache_layers", "cache_ring")),
           "comp": {k: store(s, ("cache_pool",)) for k, s in state["comp"].items()},
           "ikeys": {k: store(s, ("cache_pool",)) for k, s in state["ikeys"].items()},
           "partial": {k: {n: ("cache_slots", "cache_group", "cache_dim") for n in s}
                       for k, s in state["partial"].items()}}
    if "engram_hist" in state:
        out["engram_hist"] = ("cache_slots", "cache_ngram")
    if "dspark" in state:  # the DSpark draft's rings: one window store per stage, laid out as "window"
        out["dspark"] = _dspark_axes(state["dspark"])
    return out


def _lead(tree, ax):
    """Every leaf's axes: `ax` then "cache_dim" for the rest of its dims."""
    return jax.tree_util.tree_map(lambda v: ax + ("cache_dim",) * (v.ndim - len(ax)), tree)


def _dspark_axes(rings) -> list:
    """The DSpark rings' axes, one window store per stage (V4.1's: a dict of stores; V4's: one ring [R, W, hd])."""
    return [_lead(s, ("cache_slots", "cache_ring")) for s in rings]


def _v4_cache_axes(state) -> dict:
    """`cache_axes` of DeepSeek-V4's cache (`model.v4.decode.init_state`): per layer a window ring [R, W, hd], and
    per CSA / HCA layer its pools [rows, d] ("comp", "ikeys") and its compressor projections of the last 2r
    positions [R, 2r, w·d] ("partial"); with MTP speculation the draft's per-slot rows ("mtp": its ring, the
    target's last streams; `serving.mtp_speculative`), or with the DSpark head's its rings ("dspark", one window
    ring per stage; `model.v4.dspark`)."""
    out = {"window": _lead(state["window"], ("cache_slots", "cache_ring")),
           "comp": _lead(state["comp"], ("cache_pool",)), "ikeys": _lead(state["ikeys"], ("cache_pool",)),
           "partial": _lead(state["partial"], ("cache_slots", "cache_ring"))}
    if "mtp" in state:
        out["mtp"] = _lead(state["mtp"], ("cache_slots",))
    if "dspark" in state:
        out["dspark"] = _dspark_axes(state["dspark"])
    return out


def state_shardings(state, mesh, rules=None):
    """`NamedSharding` per leaf of a cache pytree as it is (`cache_axes`: the cache, the DSpark
    rings when present), or of a tree of its per-slot rows with the same keys (the prefix cache's
    snapshot pool: a row axis where the cache has its slot axis, split by the same rule)."""
    axes = cache_axes_of_rows(state)
    return jax.tree_util.tree_map(lambda a, ax: named(mesh, ax, a.shape, rules), state, axes,
                                  is_leaf=lambda x: hasattr(x, "shape"))


def cache_axes_of_rows(state) -> dict:
    """`cache_axes` for a full cache pytree or for a subset of its keys (e.g. only its per-slot rows)."""
    full = {"window": {}, "comp": {}, "ikeys": {}, "partial": {}}
    full.update(state)
    axes = cache_axes(full)
    return {k: axes[k] for k in state}


def constrain_state(state, mesh, rules=None):
    """``state`` (a cache pytree, DSpark rings included) held to its shardings inside a jitted step, so a
    step that has no out_shardings of its own returns the cache laid out as `init_cache` made it."""
    if mesh is None:
        return state
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, state, state_shardings(state, mesh, rules))


def place_state(state, mesh, rules=None):
    """``state`` (or its per-slot rows) moved onto its shardings (`state_shardings`)."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def zero_cache(cfg, ccfg) -> dict:
    """The model family's zeroed cache: `cache.init_cache`, or DeepSeek-V4's `v4.decode.init_state`."""
    if cfg.model_family == "deepseek_v4":
        from dsv41_jax.model.v4 import decode as dec4

        return dec4.init_state(cfg, ccfg)
    from dsv41_jax.model import cache as kvc

    return kvc.init_cache(cfg, ccfg)


def cache_shardings(cfg, ccfg, mesh, rules=None) -> dict:
    """`NamedSharding` per cache leaf (same tree as `zero_cache(cfg, ccfg)`)."""
    shapes = jax.eval_shape(lambda: zero_cache(cfg, ccfg))
    axes = cache_axes(shapes)
    return jax.tree_util.tree_map(lambda s, a: named(mesh, a, s.shape, rules), shapes, axes,
                                  is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def init_cache(cfg, ccfg, mesh, rules=None) -> dict:
    """`zero_cache` allocated directly on its shardings (jitted with out_shardings)."""
    return jax.jit(lambda: zero_cache(cfg, ccfg), out_shardings=cache_shardings(cfg, ccfg, mesh, rules))()


# ------------------------------------------------------------------------------------------ step

BATCH_AXES = {"tokens": ("batch", "seq"), "start": ("batch",), "n_new": ("batch",), "slot": ("batch",),
              "page_table": ("batch", None)}


def batch_shardings(mesh, rules=None) -> dict:
    """Shardings of the decode step's batch dict (`decode.make_batch`)."""
    return {k: NamedSharding(mesh, PartitionSpec(*(mesh_axis(a, mesh, rules) for a in ax)))
            for k, ax in BATCH_AXES.items()}


def logits_sharding(mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(mesh_axis("batch", mesh, rules), None,
                                             mesh_axis("act_vocab", mesh, rules)))


def step_shardings(cfg, ccfg, mesh, all_logits: bool = False, rules=None, engram_host_table: bool = False):
    """(in_shardings, out_shardings) of `decode.extend` (DeepSeek-V4: `v4.decode.extend_logits`) on `mesh`:
    ((params, cache, batch), (logits, cache)).

    The params are expected in the layout `layer_scan.prepare` gives (stacked runs when the config
    scans any: the new leading axis replicated, each layer's split kept), as the engine holds them.

    With `engram_host_table`, and for DeepSeek-V4 (whose checkpoints may come without the MTP layer its config
    declares), the params entry is None (= as placed: the tree holds `HostTable` nodes, whose identity is part of
    its structure, and `shard_params` put every array on its rule)."""
    cache = cache_shardings(cfg, ccfg, mesh, rules)
    lg = logits_sharding(mesh, rules)
    if not all_logits:
        lg = NamedSharding(mesh, PartitionSpec(*lg.spec[:1], *lg.spec[2:]))
    ps = None  # DeepSeek-V4: as placed by `shard_params` (a V4 checkpoint may lack its MTP layer)
    if cfg.model_family != "deepseek_v4" and not engram_host_table:
        from dsv41_jax.model import layer_scan

        # the layout the step is given: runs of plan-identical layers stacked at load (`layer_scan.prepare`)
        ps = layer_scan.prepare(param_shardings(cfg, mesh, rules), cfg)
    return (ps, cache, batch_shardings(mesh, rules)), (lg, cache)


def constrain(x, axes, mesh, rules=None):
    """`with_sharding_constraint` of activation `x` to its logical `axes` (no-op without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, axes, x.shape, rules))
