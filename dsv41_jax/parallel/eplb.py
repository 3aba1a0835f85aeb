"""Redundant experts (EPLB): where each routed expert's copies live, from a recorded routing distribution.

SGLang's ``--ep-num-redundant-experts R`` / ``--init-expert-location FILE`` and DeepSeek's EPLB: with
``E`` logical experts per MoE layer spread over ``G`` devices, a few experts receive far more tokens
than the rest, and the device holding them sets the step's time. Giving the hottest experts extra
copies (``E + R`` physical experts, ``(E + R) / G`` per device) and splitting a replicated expert's
tokens evenly over its copies flattens the per-device load. Every copy holds the same weights, so
which copy a token visits does not change its result (the MoE combines per token in ascending
logical expert id).

Host-side numpy, per layer, deterministic (ties go to the lower expert id / device index):

1. **replicate**: start with one copy of each expert; R times, give one more copy to the expert with
   the highest load per copy that has fewer copies than devices (`replicate`);
2. **pack**: sort the physical experts by load per copy, heaviest first, and put each on the least
   loaded device that has a free place and does not hold a copy of the same expert yet (if every
   device with a free place holds one, the least loaded of those) (`pack`).

`plan_placement` does both for every layer; `device_loads` gives the expected tokens per device of a
placement for a routing distribution (what `scripts/eplb_report.py` reports). The distribution file
(`save_distribution` / `load_distribution`, JSON) is what ``--expert-distribution-recorder`` writes and
``--init-expert-location`` reads: ``{"format": "dsv41-expert-distribution/1", "num_experts": E,
"layers": {layer_id: [tokens routed to expert 0, ..., E-1]}}``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Mapping

import numpy as np

__all__ = ["FORMAT", "ExpertLocation", "LayerPlacement", "balance_report", "device_loads", "expand_params",
           "load_distribution", "pack", "plan_placement", "replicate", "save_distribution"]

FORMAT = "dsv41-expert-distribution/1"


@dataclass(frozen=True)
class LayerPlacement:
    """One MoE layer's physical experts: ``physical[d]`` the logical expert ids on device d (each device
    holds ``(E + R) / G`` of them, in placement order); ``copies[e]`` how many copies expert e has."""

    physical: tuple
    copies: tuple

    @property
    def num_devices(self) -> int:
        return len(self.physical)

    @classmethod
    def contiguous(cls, num_experts: int, num_devices: int) -> "LayerPlacement":
        """The plain expert-parallel split as a placement (no copies): expert e on device e // (E / G)."""
        per = num_experts // num_devices
        return cls(physical=tuple(tuple(range(d * per, (d + 1) * per)) for d in range(num_devices)),
                   copies=(1,) * num_experts)

    def owners(self, expert: int) -> tuple:
        """The devices holding a copy of ``expert`` (ascending; one entry per copy)."""
        return tuple(d for d, held in enumerate(self.physical) for e in held if e == expert)


def replicate(load, num_redundant: int, max_copies: int = 0) -> np.ndarray:
    """Copies per expert (int [E], sum E + num_redundant): each extra copy goes to the expert with the
    highest load per copy (ties: the lower expert id) among those with fewer than ``max_copies`` (the
    device count: a second copy on one device balances nothing; 0 = no cap)."""
    load = np.asarray(load, np.float64)
    if load.ndim != 1 or load.size == 0:
        raise ValueError(f"load: expected a non-empty vector of per-expert token counts, got shape {load.shape}")
    if np.any(load < 0):
        raise ValueError("load: token counts must be >= 0")
    if num_redundant < 0:
        raise ValueError(f"num_redundant: must be >= 0, got {num_redundant}")
    if max_copies and num_redundant > load.size * (max_copies - 1):
        raise ValueError(f"{num_redundant} redundant copies do not fit {load.size} experts at <= {max_copies} copies each")
    copies = np.ones(load.size, np.int64)
    for _ in range(num_redundant):
        per_copy = np.where(copies < max_copies, load / copies, -1.0) if max_copies else load / copies
        copies[int(np.argmax(per_copy))] += 1  # argmax: the first (lowest id) of equal maxima
    return copies


def pack(load, copies, num_devices: int) -> LayerPlacement:
    """Place each expert's copies on ``num_devices`` devices, (E + R) / G per device, balancing the load."""
    load = np.asarray(load, np.float64)
    copies = np.asarray(copies, np.int64)
    total = int(copies.sum())
    if num_devices < 1 or total % num_devices:
        raise ValueError(f"{total} physical experts cannot be split evenly over {num_devices} devices")
    per_dev = total // num_devices
    per_copy = load / copies
    items = sorted(((-per_copy[e], e) for e in range(load.size) for _ in range(copies[e])))
    dev_load = np.zeros(num_devices, np.float64)
    held = [[] for _ in range(num_devices)]
    for neg, e in items:
        free = [d for d in range(num_devices) if len(held[d]) < per_dev]
        fresh = [d for d in free if e not in held[d]] or free
        d = min(fresh, key=lambda d: (dev_load[d], d))
        held[d].append(e)
        dev_load[d] -= neg
    return LayerPlacement(physical=tuple(tuple(h) for h in held), copies=tuple(int(c) for c in copies))


def plan_placement(distribution: Mapping[int, "np.ndarray"], num_devices: int, num_redundant: int) -> dict:
    """{layer_id: LayerPlacement} for every layer of a routing distribution ({layer_id: load [E]}).

    Refuses (ValueError, one line) what cannot be placed: ``E + R`` not divisible by the devices, or more
    copies of one expert than devices (R > E · (G − 1) leaves no placement without a device holding two
    copies, which would balance nothing)."""
    out = {}
    for lid, load in sorted(distribution.items()):
        load = np.asarray(load)
        E = load.size
        if (E + num_redundant) % num_devices:
            raise ValueError(f"--ep-num-redundant-experts {num_redundant}: {E} experts + {num_redundant} copies "
                             f"do not divide evenly over {num_devices} devices")
        if num_redundant > E * (num_devices - 1):
            raise ValueError(f"--ep-num-redundant-experts {num_redundant}: more copies than the {num_devices} "
                             f"devices can hold apart ({E} experts)")
        out[int(lid)] = pack(load, replicate(load, num_redundant, max_copies=num_devices), num_devices)
    return out


def device_loads(load, placement: LayerPlacement) -> np.ndarray:
    """Expected tokens per device (fp64 [G]): each expert's load split evenly over its copies."""
    load = np.asarray(load, np.float64)
    per_copy = load / np.asarray(placement.copies, np.float64)
    return np.array([sum(per_copy[e] for e in held) for held in placement.physical], np.float64)


def balance_report(distribution: Mapping[int, "np.ndarray"], location: "ExpertLocation") -> list:
    """[(layer_id, before, after)]: max / mean expected tokens per device of each layer's recorded load with the
    plain contiguous split (`LayerPlacement.contiguous`) and with `location`'s placement (1.0 = balanced; a
    layer with no recorded tokens counts as balanced)."""
    G = location.num_devices
    out = []
    for lid, load in sorted(distribution.items()):
        load = np.asarray(load)
        ratios = []
        for pl in (LayerPlacement.contiguous(load.size, G), location.placement(int(lid))):
            lo = device_loads(load, pl)
            ratios.append(float(lo.max() / lo.mean()) if lo.mean() > 0 else 1.0)
        out.append((int(lid), ratios[0], ratios[1]))
    return out


def save_distribution(path: str, distribution: Mapping[int, "np.ndarray"]) -> None:
    """Write {layer_id: tokens per expert} as the distribution file (module docstring)."""
    layers = {str(int(k)): [int(x) for x in np.asarray(v)] for k, v in sorted(distribution.items())}
    sizes = {len(v) for v in layers.values()}
    if len(sizes) != 1:
        raise ValueError(f"every layer needs the same number of experts, got {sorted(sizes)}")
    with open(path, "w") as f:
        json.dump({"format": FORMAT, "num_experts": sizes.pop(), "layers": layers}, f, indent=1)


def load_distribution(path: str) -> dict:
    """{layer_id: int64 [E]} from a distribution file; ValueError naming what is wrong with it."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--init-expert-location {path!r}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"--init-expert-location {path!r}: not an expert distribution (format {FORMAT!r})")
    E = d.get("num_experts")
    out = {}
    for k, v in (d.get("layers") or {}).items():
        a = np.asarray(v)
        if a.shape != (E,) or not np.issubdtype(a.dtype, np.integer) or np.any(a < 0):
            raise ValueError(f"--init-expert-location {path!r}: layer {k}: expected {E} non-negative token counts")
        out[int(k)] = a.astype(np.int64)
    if not out:
        raise ValueError(f"--init-expert-location {path!r}: no layers")
    return out


@dataclass(frozen=True)
class ExpertLocation:
    """Where every MoE layer's physical experts live: the static, hashable part of a `MeshPlan`
    (``MeshPlan.expert_location``) that the routed experts' dispatch reads.

    layers: ((layer_id, LayerPlacement), ...) ascending, one per MoE layer of the model (the DSpark
    draft's layers have none: they keep their E experts in the plain split). num_redundant: R. With a
    location, each layer's routed-expert weights are stored as E + R physical experts in placement order
    (device 0's, then device 1's, ...: `physical_ids`; `expand_params` makes them from the logical E) and
    a (token, logical expert) assignment goes to copy ``row mod copies[e]`` of its expert (`tables`).
    """

    layers: tuple
    num_redundant: int

    @classmethod
    def from_distribution(cls, distribution: Mapping[int, "np.ndarray"], num_devices: int, num_redundant: int,
                          num_layers: int) -> "ExpertLocation":
        """`plan_placement` of a recorded distribution for layers 0 .. num_layers − 1 (ValueError, one line,
        when the file misses one of them or holds others)."""
        have = sorted(int(k) for k in distribution)
        if have != list(range(num_layers)):
            raise ValueError(f"--init-expert-location: the distribution holds layers {have[:4]}{'...' if len(have) > 4 else ''}"
                             f", the model has MoE layers 0..{num_layers - 1}")
        plan = plan_placement(distribution, num_devices, num_redundant)
        return cls(layers=tuple(sorted(plan.items())), num_redundant=int(num_redundant))

    @classmethod
    def uniform(cls, num_experts: int, num_devices: int, num_redundant: int, num_layers: int) -> "ExpertLocation":
        """The placement of an all-equal load (no recorded distribution): copies to the lowest ids."""
        return cls.from_distribution({i: np.ones(num_experts, np.int64) for i in range(num_layers)}, num_devices,
                                     num_redundant, num_layers)

    @property
    def num_devices(self) -> int:
        return self.layers[0][1].num_devices

    @property
    def num_physical(self) -> int:
        return sum(len(h) for h in self.layers[0][1].physical)

    def placement(self, layer_id: int) -> "LayerPlacement | None":
        for lid, p in self.layers:
            if lid == layer_id:
                return p
        return None

    def physical_ids(self, layer_id: int) -> np.ndarray:
        """int32 [E + R]: the logical expert of each physical expert of the layer (device-major order)."""
        return np.array([e for held in self.placement(layer_id).physical for e in held], np.int32)

    def tables(self):
        """(slot int32 [L, E, C], copies int32 [L, E]) over the layers 0 .. L − 1: slot[l, e, c] the physical
        index of copy c of expert e (ascending device; entries c >= copies[l, e] repeat copy 0)."""
        L = len(self.layers)
        E = len(self.layers[0][1].copies)
        C = max(max(p.copies) for _, p in self.layers)
        slot = np.zeros((L, E, C), np.int32)
        copies = np.zeros((L, E), np.int32)
        for lid, _ in self.layers:
            ids = self.physical_ids(lid)
            for e in range(E):
                at = np.flatnonzero(ids == e)
                slot[lid, e, :] = at[0]
                slot[lid, e, :at.size] = at
                copies[lid, e] = at.size
        return slot, copies

    def describe(self) -> str:
        """One line for the start-up log."""
        most = max(max(p.copies) for _, p in self.layers)
        return (f"redundant experts (EPLB): R={self.num_redundant}, {self.num_physical} physical experts over "
                f"{self.num_devices} devices ({self.num_physical // self.num_devices} each), {len(self.layers)} "
                f"MoE layers, at most {most} copies of one expert")


def _named(a):
    """`a`'s sharding if it is a NamedSharding (kept on the expanded array), else None."""
    import jax

    sh = getattr(a, "sharding", None)
    return sh if isinstance(sh, jax.sharding.NamedSharding) else None


@functools.lru_cache(maxsize=None)
def _taker(stacked: bool, sharding):
    """The jitted gather of `expand_params`, the physical ids an ARGUMENT (not a constant closed over), one wrapper
    per (layout, output sharding): every layer's leaf of one shape reuses one compiled program (a closure per leaf
    and layer compiled each anew: ~20 small compiles per engine start with copies)."""
    import jax
    import jax.numpy as jnp

    def f(a, ids):
        if stacked:  # [n, E, ...] by ids [n, E + R] along axis 1
            return jnp.take_along_axis(a, ids.reshape(ids.shape + (1,) * (a.ndim - 2)), axis=1)
        return jnp.take(a, ids, axis=0)

    return jax.jit(f, out_shardings=sharding)


def expand_params(params: dict, location: ExpertLocation) -> dict:
    """`params` with every MoE layer's routed experts [E, ...] stored as the E + R physical experts of
    `location` (``[logical][physical_ids]``: the copies are the same bytes), on the logical stack's sharding.
    Takes the per-layer layout (``params["layers"][i]``) and the layer-scan stacks (`layer_scan.STACKS`,
    [n, E, ...] per run)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import layer_scan

    layers = list(params["layers"])
    for i, lp in enumerate(layers):
        if lp is None or location.placement(i) is None:
            continue
        ids = jnp.asarray(location.physical_ids(i))
        ex = jax.tree_util.tree_map(lambda a: _taker(False, _named(a))(a, ids), lp["ffn"]["experts"])
        layers[i] = dict(lp, ffn=dict(lp["ffn"], experts=ex))
    out = dict(params, layers=layers)
    stacks = params.get(layer_scan.STACKS)
    if stacks:
        new = {}
        for first, st in stacks.items():
            n = jax.tree_util.tree_leaves(st["ffn"]["experts"])[0].shape[0]
            ids = jnp.asarray(np.stack([location.physical_ids(int(first) + j) for j in range(n)]))  # [n, E + R]

            def take2(a, ids=ids):
                return _taker(True, _named(a))(a, ids)

            new[first] = dict(st, ffn=dict(st["ffn"], experts=jax.tree_util.tree_map(take2, st["ffn"]["experts"])))
        out[layer_scan.STACKS] = new
    return out
