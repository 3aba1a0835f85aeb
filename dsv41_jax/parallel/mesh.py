"""The device mesh of a sharded run: axes ``("ep", "tp")`` over local or global devices.

`make_mesh(tp, ep)` takes the first ``ep · tp`` devices (all of them when several processes run: every
process must take part), shaped ``[ep, tp]``: the tp groups are consecutive devices, so the per-layer
tp all-reduces stay between neighbours (NVLink peers on a GPU node), and the expert axis spans them.
A combination that cannot work raises `MeshError` naming the reason, before anything is compiled:
too few devices, more expert shards than experts (or a count that does not divide them), attention
heads not divisible by tp, a multi-process run that leaves devices out, or ``dp > 1`` (data-parallel
attention is not implemented: refused, never ignored).

Semantics: the mesh is a product, ``devices = tp · ep``. Attention, the shared expert and the
embedding / head are split over tp and replicated over ep; the routed experts are split over ep and
replicated over tp; the Engram tables are split over all tp · ep devices (see `rules`).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)

AXES = ("ep", "tp")


class MeshError(ValueError):
    """A mesh shape that cannot run this model on these devices (the message says why)."""


def check_sizes(cfg, tp: int, ep: int, dp: int = 1) -> None:
    """Model-dependent checks of a (tp, ep, dp) request; raises `MeshError`. `cfg` may be None."""
    for name, v in (("tp", tp), ("ep", ep), ("dp", dp)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise MeshError(f"{name}: must be a positive integer, got {v!r}")
    if dp != 1:
        raise MeshError(f"dp={dp}: data-parallel attention is not implemented (use dp=1; shard with tp and ep)")
    if cfg is None:
        return
    H = cfg.num_attention_heads
    if H % tp:
        raise MeshError(f"tp={tp}: num_attention_heads={H} is not divisible by tp (heads are split over tp)")
    experts = [("n_routed_experts", cfg.n_routed_experts)]
    if cfg.num_nextn_predict_layers:
        experts.append(("dspark_n_routed_experts", cfg.dspark_n_routed_experts))
    for name, E in experts:
        if ep > E:
            raise MeshError(f"ep={ep}: more expert shards than experts ({name}={E})")
        if E % ep:
            raise MeshError(f"ep={ep}: {name}={E} is not divisible by ep (experts are split evenly over ep)")


def make_mesh(tp: int = 1, ep: int = 1, dp: int = 1, *, cfg=None, devices: Optional[Sequence] = None):
    """A `jax.sharding.Mesh` of shape [ep, tp] with axis names ``("ep", "tp")``.

    tp, ep: mesh sizes; dp: must be 1 (refused otherwise); cfg: the `ModelConfig`, for the model checks
    of `check_sizes`; devices: the devices to use (default `jax.devices()`, global across processes).
    Raises `MeshError` for a combination that cannot work.
    """
    import jax
    from jax.sharding import Mesh

    check_sizes(cfg, tp, ep, dp)
    n = tp * ep
    devs = list(jax.devices() if devices is None else devices)
    if n > len(devs):
        platform = devs[0].platform if devs else "none"
        hint = (f"; on a CPU, fake {n} host devices with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
                if platform == "cpu" else "")
        raise MeshError(f"tp={tp} x ep={ep} needs {n} devices, only {len(devs)} are available ({platform}){hint}")
    if devices is None and jax.process_count() > 1 and n != len(devs):
        raise MeshError(f"tp={tp} x ep={ep} = {n} devices, but the {jax.process_count()} processes hold "
                        f"{len(devs)}: a multi-process mesh must use every device")
    mesh = Mesh(np.asarray(devs[:n], dtype=object).reshape(ep, tp), AXES)
    log.info("mesh: ep=%d x tp=%d over %d %s devices", ep, tp, n, devs[0].platform)
    return mesh


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis `name` (1 if the mesh is None or lacks the axis)."""
    if mesh is None:
        return 1
    return int(dict(mesh.shape).get(name, 1))
