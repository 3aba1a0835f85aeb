"""The device mesh of a sharded run: axes ``("ep", "tp")``, or ``("dp", "tp")`` under data-parallel attention.

`make_mesh(tp, ep)` takes the first ``ep · tp`` devices (all of them when several processes run: every
process must take part), shaped ``[ep, tp]``: the tp groups are consecutive devices, so the per-layer
tp all-reduces stay between neighbours (NVLink peers on a GPU node), and the expert axis spans them.
A combination that cannot work raises `MeshError` naming the reason, before anything is compiled:
too few devices, more expert shards than experts (or a count that does not divide them), attention
heads not divisible by tp, a multi-process run that leaves devices out.

Semantics: the mesh is a product, ``devices = tp · ep``. Attention, the shared expert and the
embedding / head are split over tp and replicated over ep; the routed experts are split over ep and
replicated over tp; the Engram tables are split over all tp · ep devices (see `rules`).

Data-parallel attention (``dp = D > 1``, SGLang's ``--enable-dp-attention --dp-size D``): the mesh is
``[dp, tp]`` with axes ``("dp", "tp")`` over ``D · tp`` devices, each tp group (consecutive devices) one
rank. Requests, their batch rows and their whole state (slot rows, pool pages, snapshot rows) are split
over "dp"; attention heads over tp inside a rank; the routed experts and the Engram rows over ALL
devices ("dp" major, then "tp": SGLang's DP attention + EP), reached by token dispatch
(`moe_dispatch`). There is no separate ep axis: ``ep`` must be 1 or ``D · tp`` (the same thing, said
explicitly); anything else is refused, as are experts that do not split over the ``D · tp`` devices.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

AXES = ("ep", "tp")
DP_AXES = ("dp", "tp")  # data-parallel attention (dp > 1)


class MeshError(ValueError):
    """A mesh shape that cannot run this model on these devices (the message says why)."""


def check_sizes(cfg, tp: int, ep: int, dp: int = 1) -> None:
    """Model-dependent checks of a (tp, ep, dp) request; raises `MeshError`. `cfg` may be None."""
    for name, v in (("tp", tp), ("ep", ep), ("dp", dp)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise MeshError(f"{name}: must be a positive integer, got {v!r}")
    if dp > 1 and ep not in (1, dp * tp):
        raise MeshError(f"ep={ep} with dp={dp}: under data-parallel attention the routed experts are split over "
                        f"all dp x tp = {dp * tp} devices; give ep=1 (or ep={dp * tp})")
    if cfg is None:
        return
    H = cfg.num_attention_heads
    if H % tp:
        raise MeshError(f"tp={tp}: num_attention_heads={H} is not divisible by tp (heads are split over tp)")
    experts = [("n_routed_experts", cfg.n_routed_experts)]
    if cfg.num_nextn_predict_layers and cfg.draft_kind == "dspark":  # (V4's MTP layer has n_routed_experts)
        experts.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts))
    n, what = (ep, f"ep={ep}") if dp == 1 else (dp * tp, f"dp={dp} x tp={tp}")
    for name, E in experts:
        if n > E:
            raise MeshError(f"{what}: more expert shards than experts ({name}={E})")
        if E % n:
            over = "ep (experts are split evenly over ep)" if dp == 1 else f"{n} (experts are split over all devices)"
            raise MeshError(f"{what}: {name}={E} is not divisible by {over}")


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, *, cfg=None, devices: Optional[Sequence] = None):
    """A `jax.sharding.Mesh`: shape [ep, tp] with axis names ``("ep", "tp")``, or with dp > 1 shape
    [dp, tp] with axis names ``("dp", "tp")`` (module doc).

    tp, ep, dp: mesh sizes; cfg: the `ModelConfig`, for the model checks of `check_sizes`; devices: the
    devices to use (default `jax.devices()`, global across processes).
    Raises `MeshError` for a combination that cannot work.
    """
    import jax
    from jax.sharding import Mesh

    check_sizes(cfg, tp, ep, dp)
    shape, axes = ((ep, tp), AXES) if dp == 1 else ((dp, tp), DP_AXES)
    n = shape[0] * shape[1]
    what = f"tp={tp} x ep={ep}" if dp == 1 else f"dp={dp} x tp={tp}"
    devs = list(jax.devices() if devices is None else devices)
    if n > len(devs):
        platform = devs[0].platform if devs else "none"
        hint = (f"; on a CPU, fake {n} host devices with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
                if platform == "cpu" else "")
        raise MeshError(f"{what} needs {n} devices, only {len(devs)} are available ({platform}){hint}")
    if devices is None and jax.process_count() > 1 and n != len(devs):
        raise MeshError(f"{what} = {n} devices, but the {jax.process_count()} processes hold "
                        f"{len(devs)}: a multi-process mesh must use every device")
    mesh = Mesh(np.asarray(devs[:n], dtype=object).reshape(shape), axes)
    log.info("mesh: %s over %d %s devices", " x ".join(f"{a}={k}" for a, k in zip(axes, shape)), n, devs[0].platform)
    return mesh


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis `name` (1 if the mesh is None or lacks the axis)."""
    if mesh is None:
        return 1
    return int(dict(mesh.shape).get(name, 1))


def manual_axes() -> frozenset:
    """Mesh axes the code being traced is already manual over (inside a `shard_map`, e.g. one dp rank's
    program, `parallel.dp`); empty outside any."""
    import jax

    am = jax.sharding.get_abstract_mesh()
    return frozenset() if am.empty else frozenset(am.manual_axes)


def shard_map(f, mesh, in_specs, out_specs, check_vma: bool = True):
    """`jax.shard_map` of `f` over `mesh`, also inside a program already manual over some of its axes
    (`manual_axes`): there it is manual over the remaining axes only, on the context's mesh, and its specs
    must not name the manual ones (nested shard_map; jax >= 0.10). Outside, exactly `jax.shard_map`."""
    import jax

    man = manual_axes()
    if not man:
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    free = frozenset(a for a in mesh.axis_names if a not in man)
    return jax.shard_map(f, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs, out_specs=out_specs,
                         axis_names=free, check_vma=False)
