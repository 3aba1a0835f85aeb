"""Opt-in host placement of the Engram tables (``engram_host_table=True``, env ``DSV41_ENGRAM_HOST_TABLE=1``).

The two Engram tables of V4.1 Flash hold ~203 GB of fp8 rows + scales, of which a step reads 24 rows
(~6 KB) per token and layer. With the host table there is ONE host copy (numpy; not per device, not
per process-local shard), the step's hashed rows go to the host (`jax.pure_callback`), are gathered
and dequantized there exactly as `engram.gather_rows` does on device (e4m3 x 2^(e-127), one rounding
to the activation dtype: the products are exact, so the result is bitwise the device gather's), and
the [.., 24·256] embedding comes back to the device. No table bytes on any device and no all-reduce;
the price is a host round trip per Engram layer per step.

`HostTable` is a pytree node with no array children: it sits where ``engram.embed`` was in the params
tree, so the jitted step sees no table argument (device memory freed) and `engram.engram` calls
``p["embed"].gather(rows, dt)`` instead of the device gather.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.model import codec

ENV = "DSV41_ENGRAM_HOST_TABLE"


def host_table_requested(flag=None) -> bool:
    """The flag if given, else env ``DSV41_ENGRAM_HOST_TABLE`` (1/true/yes/on) — a bad value raises."""
    if flag is not None:
        return bool(flag)
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={v!r}: expected 1/0 (true/false, yes/no, on/off)")


class HostTable:
    """One Engram table on the host: codes float8_e4m3fn [N, de] and E8M0 scales [N, de/32] (numpy)."""

    def __init__(self, weight, scale):
        self.weight = np.asarray(weight)
        self.scale = np.asarray(scale)
        if self.weight.dtype != ml_dtypes.float8_e4m3fn:
            raise TypeError(f"HostTable: weight must be float8_e4m3fn, got {self.weight.dtype}")
        self.shape = self.weight.shape

    @classmethod
    def abstract(cls, weight_shape, scale_shape) -> "HostTable":
        """A table of the given shapes that allocates nothing (zero-stride views of one element), for
        abstract lowering (`scripts/aot_flash.py`); it gathers zeros."""
        w = np.broadcast_to(np.zeros((), ml_dtypes.float8_e4m3fn), tuple(weight_shape))
        sc = np.broadcast_to(np.full((), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu), tuple(scale_shape))
        return cls(w, sc)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def host_gather(self, rows: np.ndarray, dt) -> np.ndarray:
        """`engram.gather_rows` in numpy: rows int [..., R] -> [..., R·de] in `dt`."""
        rows = np.asarray(rows)
        de = self.weight.shape[-1]
        emb = codec.e4m3_to_f32_np(self.weight[rows])
        sc = codec.e8m0_to_f32_np(self.scale[rows])  # 2^(e-127), exact; byte 255 NaN (codec's rule)
        emb = emb.reshape(rows.shape + (de // 32, 32)) * sc[..., None]
        emb = emb.reshape(rows.shape[:-1] + (rows.shape[-1] * de,))
        return emb.astype(jnp.dtype(dt))

    def gather(self, rows, dt):
        """Traced: the host gather of `rows` (int32 [..., R]) as a `jax.pure_callback`; [..., R·de] in `dt`."""
        de = self.weight.shape[-1]
        out = jax.ShapeDtypeStruct(rows.shape[:-1] + (rows.shape[-1] * de,), jnp.dtype(dt))
        return jax.pure_callback(lambda r: self.host_gather(r, dt), out, rows, vmap_method="sequential")

    # identity semantics: the jit cache keys on the tree structure, which holds this object
    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


jax.tree_util.register_pytree_node(HostTable, lambda t: ((), t), lambda t, _: t)


def offload_engram(params) -> dict:
    """A params tree whose Engram tables (``layers[L].engram.embed``) are `HostTable`s (host copies);
    everything else is shared with `params`. Device copies are dropped with the old tree."""
    out = dict(params)
    layers = []
    for lp in params["layers"]:
        if "engram" in lp and not isinstance(lp["engram"]["embed"], HostTable):
            e = lp["engram"]["embed"]
            lp = dict(lp)
            lp["engram"] = dict(lp["engram"])
            lp["engram"]["embed"] = HostTable(np.asarray(e["weight"]), np.asarray(e["scale"]))
        layers.append(lp)
    out["layers"] = layers
    return out
