"""The model on a mesh: `MeshPlan`, what `parallel/` hands to the model, and the mesh entry points.

Direction: ``parallel/`` sits above ``model/`` (docs/design/architecture.md): it imports the model,
never the other way. The model's mesh-aware code takes a ``par`` argument — a `MeshPlan`, or None on
one device — and calls only its methods (row splits for tiling, replicated activations, the
`shard_map`'d gathers and the expert-parallel MoE, the step's shardings, parameter placement). So the
model runs on a mesh without knowing the rules table or the collectives, and a different parallel
scheme plugs in as another object with the same methods.

Entry points for callers holding a `jax.sharding.Mesh`: `MeshPlan.of(mesh)` (None stays None),
`jitted_extend` (the jitted decode step with its shardings) and `load_params` (a checkpoint straight
onto the mesh, Engram tables optionally on the host). On a data-parallel mesh ("dp" > 1) a step runs as one
program per rank: `MeshPlan.rank_step` (`parallel.dp`), which `model.decode.jitted_extend` calls; a caller
jitting another step (DSpark seeding, proposal, verify) wraps it the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import jax

from dsv41_jax.model import checkpoint
from dsv41_jax.model import decode as dec
from dsv41_jax.model import weights
from dsv41_jax.model.params import flatten_names
from dsv41_jax.parallel import collectives, dp, eplb, moe_dispatch, rules
from dsv41_jax.parallel.host_table import offload_engram


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A mesh with the rules and collectives the model needs on it (hashable: a static jit argument).

    moe_a2a_backend: how the routed experts meet their tokens (`--moe-a2a-backend`, `moe_dispatch.BACKENDS`):
    "none" (default) — tokens replicated over the expert axis, one psum (`collectives.routed_experts`);
    "all_to_all" / "ragged" — each device dispatches its own tokens to the experts' devices and combines
    locally (`moe_dispatch.routed_experts_dispatch`), tokens split over the rules' "batch" axis (the
    request axis under data-parallel attention; none today: replicated tokens are then split over the
    expert axis inside the collective) and experts over the rules' "experts" axes.
    moe_a2a_capacity: the dense buffer's rows per destination and round (None: `moe_dispatch.capacity_for`).
    On a data-parallel mesh ("dp" > 1, `parallel.dp`) the tokens differ per rank, so "none" is refused and
    "all_to_all" is the default.
    in_rank: the plan as one dp rank's program sees it (`in_rank_plan`, inside `parallel.dp.rank_step`):
    constraints and row splits without "dp" (`rules.RANK_RULES`); the collectives still span all devices.
    """

    mesh: jax.sharding.Mesh
    moe_a2a_backend: str = "none"
    moe_a2a_capacity: Optional[int] = None
    in_rank: bool = False
    expert_location: Optional[eplb.ExpertLocation] = None

    def __post_init__(self):
        moe_dispatch.check_backend(self.moe_a2a_backend)
        loc = self.expert_location
        if loc is not None:
            G = self.expert_devices
            if G < 2:
                raise ValueError(f"--ep-num-redundant-experts {loc.num_redundant}: the routed experts are not split "
                                 "over devices on this mesh (no expert parallelism): there is nothing to balance")
            if loc.num_devices != G:
                raise ValueError(f"--ep-num-redundant-experts {loc.num_redundant}: the placement is for "
                                 f"{loc.num_devices} devices, the experts are split over {G}")
            _log_location(loc)
        if self.axis_size("dp") > 1 and self.moe_a2a_backend == "none":
            raise ValueError("--moe-a2a-backend none: data-parallel attention splits the tokens over dp ranks, "
                             "so they must be dispatched to their experts; use all_to_all (or ragged on GPU)")

    @classmethod
    def of(cls, mesh, moe_a2a_backend: Optional[str] = None) -> Optional["MeshPlan"]:
        """`mesh` as a plan (backend `moe_a2a_backend`, default "none", "all_to_all" on a dp mesh); None (one
        device) stays None, a plan is returned as is (with the backend replaced when one is given)."""
        if mesh is None:
            return None
        if isinstance(mesh, MeshPlan):
            return mesh if moe_a2a_backend is None else dataclasses.replace(mesh, moe_a2a_backend=moe_a2a_backend)
        return cls(mesh, moe_a2a_backend or ("all_to_all" if dict(mesh.shape).get("dp", 1) > 1 else "none"))

    def in_rank_plan(self) -> "MeshPlan":
        """This plan as one dp rank's program uses it (`parallel.dp.rank_step`)."""
        return dataclasses.replace(self, in_rank=True)

    @property
    def rules(self) -> dict:
        """The rules table of the code being traced: the mesh's (`rules.rules_for`), or a rank's."""
        return rules.RANK_RULES if self.in_rank else rules.rules_for(self.mesh)

    @property
    def expert_parallel(self) -> bool:
        """Whether the routed experts are split over devices (ep > 1, or any data-parallel mesh)."""
        return rules.mesh_axis("experts", self.mesh) is not None

    @property
    def expert_devices(self) -> int:
        """The devices the routed experts are split over (1: not split)."""
        if self.moe_a2a_backend == "none":
            return self.axis_size("ep")
        return rules.mesh_axes_size(rules.mesh_axis("experts", self.mesh), self.mesh)

    def expert_tables(self, ex, layer_id: Optional[int]):
        """(slot int32 [E, C], copies int32 [E]) of MoE layer `layer_id` under redundant experts
        (`eplb.ExpertLocation.tables`; inside a layer scan, `layer_id` is the run's first layer and the
        traced offset of a `weights.Stacked`), or None: no redundancy here (no location, or a layer it does not place: the draft's)."""
        loc = self.expert_location
        if loc is None or layer_id is None or loc.placement(layer_id) is None:
            return None
        slot, copies = _tables(loc)
        _, k = weights.split(ex)  # a layer-scan run's stack: the traced offset of its layer
        if k is None:
            return jax.numpy.asarray(slot[layer_id]), jax.numpy.asarray(copies[layer_id])
        return jax.numpy.asarray(slot)[layer_id + k], jax.numpy.asarray(copies)[layer_id + k]

    @property
    def size(self) -> int:
        return self.mesh.size

    def axis_size(self, name: str) -> int:
        """Devices along mesh axis `name` (1 when the mesh has no such axis)."""
        return dict(self.mesh.shape).get(name, 1)

    def row_split(self, logical: Optional[str], n_rows: int, align: int = 1):
        """(k, mesh axes) when a weight's `n_rows` rows of logical axis `logical` split over k > 1
        devices in whole `align` blocks, else None (`model.tiling.row_split`)."""
        if logical is None:
            return None
        ax = rules.mesh_axis(logical, self.mesh, self.rules)
        k = rules.mesh_axes_size(ax, self.mesh)
        if k == 1 or n_rows % (k * align):
            return None
        return k, ax

    def replicated(self, x):
        """Pin per-token activation `x` [B, T, ..., D] replicated (`rules`: activations are not split)."""
        return rules.constrain(x, ("batch", "seq") + (None,) * (x.ndim - 3) + ("act_embed",), self.mesh, self.rules)

    def embed_gather(self, table, ids, dt):
        """table[ids] in `dt` with the rows split over "vocab" (`collectives.embed_gather`)."""
        return collectives.embed_gather(table, ids, dt, self.mesh)

    def engram_gather(self, table, tscale, rows, dt):
        """`engram.gather_rows` on a row-split table (`collectives.row_gather`; in a rank's program `table` is
        the rank's block of rows, split as the whole table is on the mesh)."""
        axis = None
        if self.in_rank:
            axis = collectives.row_axes((table.shape[0] * self.axis_size("dp"),) + table.shape[1:], "engram_rows",
                                        self.mesh)
        return collectives.row_gather(table, tscale, rows, dt, self.mesh, axis)

    def routed_experts(self, ex, xf, idx, w, cfg, dt, slots=None, layer_id: Optional[int] = None):
        """The routed experts expert-parallel: over "ep" with a psum (`collectives.routed_experts`, backend
        "none"), or with the tokens dispatched to their experts (`moe_dispatch`); slots: the per-device
        grouped computation, default the xla path; layer_id: the MoE layer (its redundant-expert placement,
        `expert_tables`; None: none)."""
        location = self.expert_tables(ex, layer_id)
        if self.moe_a2a_backend == "none":
            return collectives.routed_experts(ex, xf, idx, w, cfg, dt, self.mesh, slots=slots, location=location)
        expert_axes = rules.mesh_axis("experts", self.mesh)
        if expert_axes is None:
            raise ValueError(f"--moe-a2a-backend {self.moe_a2a_backend}: the routed experts are not split over "
                             "this mesh (no expert axis > 1): nothing to dispatch to")
        return moe_dispatch.routed_experts_dispatch(
            ex, xf, idx, w, cfg, dt, self.mesh, backend=self.moe_a2a_backend,
            token_axes=rules.mesh_axis("batch", self.mesh), expert_axes=expert_axes,
            capacity=self.moe_a2a_capacity, slots=slots, location=location)

    def rank_step(self, fn, cfg, ccfg, engram_host_table: bool = False):
        """``fn(params, state, batch, ccfg=, par=)`` as the step on this mesh: one program per dp rank on a
        data-parallel mesh (`parallel.dp.rank_step`), else ``fn`` with ccfg and this plan bound."""
        ps = None
        if self.axis_size("dp") > 1 and cfg.model_family == "deepseek_v4":
            # jit takes V4's params as placed; each rank's blocks follow the rules (no MTP layer: `dp.rank_step`)
            ps = rules.param_shardings(cfg, self.mesh)
        elif self.axis_size("dp") > 1:
            ps = self.step_shardings(cfg, ccfg, False, engram_host_table)[0][0]
        return dp.rank_step(fn, self, ccfg, ps)

    def step_shardings(self, cfg, ccfg, all_logits: bool, engram_host_table: bool = False):
        """((params, state, batch), (logits, state)) shardings of the decode step (`rules.step_shardings`)."""
        return rules.step_shardings(cfg, ccfg, self.mesh, all_logits, engram_host_table=engram_host_table)

    def param_placement(self, cfg) -> dict:
        """{checkpoint name: (padded shape, sharding)} of every parameter (`rules.param_shapes`)."""
        return {n: (a.shape, a.sharding) for n, a in flatten_names(rules.param_shapes(cfg, self.mesh)).items()}

    @staticmethod
    def place_host(a, shape, sharding):
        """A host array onto `sharding` as a global array of `shape` (`rules.place_host`)."""
        return rules.place_host(a, shape, sharding)


@functools.lru_cache(maxsize=8)
def _tables(loc: eplb.ExpertLocation):
    return loc.tables()


@functools.lru_cache(maxsize=8)
def _log_location(loc: eplb.ExpertLocation) -> None:
    logging.getLogger(__name__).info("%s", loc.describe())


def jitted_extend(cfg, ccfg, all_logits: bool = False, mesh=None, engram_host_table: bool = False,
                  late_tail: Optional[int] = None):
    """`model.decode.jitted_extend` for a `jax.sharding.Mesh` (or None): the step with its shardings."""
    return dec.jitted_extend(cfg, ccfg, all_logits, MeshPlan.of(mesh), engram_host_table, late_tail=late_tail)


def load_params(path: str, cfg=None, mesh=None, *, engram_host_table: bool = False, **kw) -> dict:
    """`model.checkpoint.load_params` with every leaf placed straight onto its sharding on `mesh`
    (`MeshPlan.param_placement`; None: the default device). engram_host_table: the Engram tables stay
    on the host as `host_table.HostTable`s (never copied to a device)."""
    params = checkpoint.load_params(path, cfg, MeshPlan.of(mesh), host_engram=engram_host_table, **kw)
    return offload_engram(params) if engram_host_table else params
