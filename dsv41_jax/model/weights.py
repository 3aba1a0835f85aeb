"""Typed parameter nodes: a quantized weight and a layer-scan run's stack, as registered pytree dataclasses.

The parameter tree (`params.declare_params`) is nested dicts named as the checkpoint is, except where a node
has a format a function must know: there it is one of these types, so no function infers what it got from
which keys a dict has.

* `Fp8` — an fp8 linear: e4m3 codes [N, K] and E8M0 32×32 block scales [⌈N/32⌉, ⌈K/32⌉] (docs/design/spec.md
  §6); `bf16` is wo_a's load-time dequantized copy [N, K] (not in the checkpoint; None elsewhere).
* `Mxfp4` — stacked MXFP4 routed experts: packed e2m1 codes uint8 [E, N, K/2] (low nibble = even element)
  and E8M0 per-32 scales [E, N, K/32] (one projection, w1 / w3 / w2, of every expert).
* `Stacked` — inside a layer-scan run (`transformer.scan_blocks`), a parameter the kernels read in place:
  the run's stack (leading axis n) and the layer the scan body is at. A kernel takes (weights, layer) as they
  are (a slice of a Pallas operand would be copied by XLA); a jnp path takes `row` (the layer's slice).

The field names are the checkpoint's (``wq_a.weight``, ``wq_a.scale``): `params.flatten_names` and the
checkpoint readers name the leaves from them. Fields flatten in the order the dicts they replace had (sorted
keys), so a compiled step's parameter order is what it was.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dsv41_jax.model.codec import E8M0, FP8


def _restore(a, dtype):
    """`a` bitcast back to `dtype` when a layer stack stores it as uint8 bits (`layer_scan.storage_dtype`)."""
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype == jnp.uint8 else a


@functools.partial(jax.tree_util.register_dataclass, data_fields=["bf16", "scale", "weight"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Fp8:
    """An fp8 linear: weight float8_e4m3fn [N, K], scale E8M0 [⌈N/32⌉, ⌈K/32⌉] (or, in a layer stack, [n, ...]
    of their uint8 bits), bf16: wo_a's load-time dequantized copy [N, K] or None."""
    weight: Any
    scale: Any
    bf16: Any = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["scale", "weight"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Mxfp4:
    """MXFP4 expert weights: weight uint8 [E, N, K/2] (two e2m1 codes a byte), scale E8M0 [E, N, K/32] (uint8
    bits in a layer stack, which also leads with the run's axis n)."""
    weight: Any
    scale: Any


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Stacked:
    """A layer-scan run's stack of one parameter and the layer the body reads: weights is an array [n, ...]
    (in its declared dtype), an `Fp8` of stacks (uint8 bits) or a dict of `Mxfp4` stacks; layer int32 []."""
    weights: Any
    layer: Any

    def row(self):
        """The layer's own parameter (a dynamic slice of each stack, fused into its consumer by XLA), in its
        declared dtypes."""
        return _row(self.weights, self.layer)


def _row(w, k):
    if isinstance(w, Fp8):
        weight, scale = w.weight[k], w.scale[k]
        scale = _restore(scale, E8M0)
        return Fp8(_restore(weight, FP8), scale)
    if isinstance(w, Mxfp4):
        return Mxfp4(w.weight[k], _restore(w.scale[k], E8M0))
    if isinstance(w, dict):  # the routed experts {w1, w3, w2}
        return {n: _row(m, k) for n, m in w.items()}
    return w[k]


def split(p):
    """(what a kernel reads, the layer or None): a `Stacked` parameter's (weights, layer), else (p, None)."""
    return (p.weights, p.layer) if isinstance(p, Stacked) else (p, None)


def row(p):
    """The layer's own parameter: `Stacked.row` of a stacked one, else `p` itself."""
    return p.row() if isinstance(p, Stacked) else p
