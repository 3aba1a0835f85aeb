"""Pallas kernels for Engram (docs/design/spec.md §5): the hashed-row gather and the gate.

What is fused, per kernel:

* `gather` — for a block of tokens and one of the R = 24 row slots: read the slot's table row index,
  gather the row's fp8 e4m3 codes straight from the (huge, never copied) table, multiply by its
  per-32 E8M0 scales (2^(e−127), decoded by bit arithmetic), round once to the activation dtype and
  write the row into its place of the concatenated embedding ``emb [M, R·de]``. The reference
  materializes the gathered codes, the gathered scales and the fp32 product (three passes); here the
  only HBM traffic is the codes read once and ``emb`` written once. Values are bitwise the
  reference's (one exact fp32 product, one rounding).
* wkv stays an XLA matmul behind the "linear" seam (`linear.fp8`: it re-quantizes its input per 32
  anyway and has its own fast path; a gather -> GEMM fusion would have to re-implement it).
* `gate` — per token block and stream c: one pass over D accumulating ⟨h_c, w_c ⊙ key_c⟩, Σh_c² and
  Σkey_c² (w = q_weight ⊙ k_weight formed in-kernel from the bf16 weights), the signed-sqrt sigmoid
  gate, then a second pass writing ``h_c + g_c · value`` rounded once. The reference materializes
  keys, value and w in fp32 and reduces three times; this reads h and kv once per pass (the second
  pass mostly hits L2) and writes h' once.

Scales: the E8M0 scale *bytes* of the 24 rows are gathered by XLA outside the kernel (R·de/32 = 192
bytes a token, 3% of the codes) and bitcast to uint8 there: Triton has no E8M0 type, and bitcasting
the whole scale table to uint8 would make XLA copy it (a bitcast-convert is a real fusion when its
consumer is a custom call; checked on CPU). The fp8 codes are loaded as float8_e4m3fn in-kernel
(Triton converts e4m3 -> f32 on sm_89+; `_is_float8_e4m3fn_cast_supported` in triton/lowering.py).

Lowering: Triton (`common.triton_params`), because the gather reads table rows through an integer
array index (``codes_ref[idx]``): the Triton lowering turns it into a pointer gather (64-bit offsets
when the table exceeds 4 GiB), while Mosaic GPU rejects int-array indexers on Hopper. All refs are
whole arrays; the token axis is blocked by hand with masked loads/stores (``pl.ds`` + mask), so a
token count that is not a multiple of the block is handled without padding copies (the Triton
lowering does not mask partial BlockSpec blocks). Masked-off tokens gather table row 0 (valid) and
are never stored. Block shapes are powers of two: the token block, de/32 (must be a power of two)
and 32; the gate's D chunk is the largest power of two dividing D (≤ 256).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import dispatch, linear
from dsv41_jax.model import engram as engram_ref
from dsv41_jax.model.codec import e8m0_decode
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common

__all__ = ["kernel", "gather", "gate"]

GATHER_TOKEN_BLOCK = 32  # tokens per gather program (one row slot each): 32 × de bytes of codes
GATE_TOKEN_BLOCK = 16  # tokens per gate program (one stream each)
GATE_MAX_CHUNK = 256  # D chunk of the gate loops: 3 fp32 [16, 256] tiles live at once


def _token_block(m: int, cap: int) -> int:
    return min(cap, common.next_pow2(m))


def _pow2_chunk(d: int, cap: int) -> int:
    """Largest power of two dividing `d`, at most `cap` (a Triton block along a D that may not be
    a power of two itself, e.g. 5120 = 5 · 1024)."""
    c = 1
    while c * 2 <= cap and d % (c * 2) == 0:
        c *= 2
    return c


# ------------------------------------------------------------------------------------------ gather

def _gather_kernel(rows_ref, codes_ref, sc_ref, out_ref, *, m: int, bt: int):
    # rows_ref int32 [M, R]; codes_ref e4m3 [N, G, 32]; sc_ref uint8 [M, R, G]; out_ref [M, R, G, 32].
    i, r = pl.program_id(0), pl.program_id(1)
    t0 = i * bt
    tmask = t0 + jnp.arange(bt) < m
    idx = pltriton.load(rows_ref.at[pl.ds(t0, bt), r], mask=tmask, other=0)  # [bt]
    codes = codes_ref[idx].astype(jnp.float32)  # [bt, G, 32]: one pointer gather of whole rows
    sc = pltriton.load(sc_ref.at[pl.ds(t0, bt), r, :], mask=tmask[:, None], other=127)  # [bt, G]
    val = codes * e8m0_decode(sc, jnp)[:, :, None]  # exact (power-of-two scale)
    pltriton.store(out_ref.at[pl.ds(t0, bt), r, :, :], val.astype(out_ref.dtype), mask=tmask[:, None, None])


@functools.partial(jax.jit, static_argnames=("dt", "interpret"))
def gather(table, tscale, rows, *, dt, interpret: bool = False):
    """Fused gather + dequantize + concatenate (same contract as `engram.gather_rows`).

    table: float8_e4m3fn [N, de]; tscale: E8M0 [N, de/32]; rows: int32 [..., R] in [0, N).
    Returns [..., R·de] in `dt`, bitwise equal to the reference.
    """
    n_rows, de = table.shape
    if not _row_width_ok(de):
        raise ValueError(f"engram gather kernel: de/32 must be a power of two (Triton block), got de={de}")
    lead, R = rows.shape[:-1], rows.shape[-1]
    G = de // 32
    flat = rows.reshape(-1, R).astype(jnp.int32)
    m = flat.shape[0]
    if m == 0:
        return jnp.zeros((*lead, R * de), dt)
    bt = _token_block(m, GATHER_TOKEN_BLOCK)
    # Only the 24 rows' scale bytes (tiny) are gathered by XLA; the codes stay in the table.
    sc = jax.lax.bitcast_convert_type(tscale[flat], jnp.uint8)  # [M, R, G]
    common.log_choice("engram_gather", interpret, token_block=bt, rows=R, de=de)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, m=m, bt=bt),
        grid=(pl.cdiv(m, bt), R),
        out_shape=jax.ShapeDtypeStruct((m, R, G, 32), dt),
        compiler_params=common.triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="engram_gather",
    )(flat, table.reshape(n_rows, G, 32), sc)
    return out.reshape(*lead, R * de)


# -------------------------------------------------------------------------------------------- gate

def _gate_kernel(h_ref, kv_ref, qw_ref, kw_ref, out_ref, *, m: int, n: int, d: int, bt: int, bd: int,
                 eps: float):
    # h_ref [M, n, D]; kv_ref [M, (n+1)·D]; qw_ref / kw_ref bf16 [n, D]; out_ref [M, n, D].
    i, c = pl.program_id(0), pl.program_id(1)
    t0 = i * bt
    tmask = (t0 + jnp.arange(bt) < m)[:, None]
    nck = d // bd

    def load_h(k):
        return pltriton.load(h_ref.at[pl.ds(t0, bt), c, pl.ds(k * bd, bd)], mask=tmask, other=0).astype(jnp.float32)

    def stats(k, carry):
        dot, sh, sk = carry
        hc = load_h(k)
        key = pltriton.load(kv_ref.at[pl.ds(t0, bt), pl.ds(c * d + k * bd, bd)], mask=tmask,
                            other=0).astype(jnp.float32)
        w = qw_ref[c, pl.ds(k * bd, bd)].astype(jnp.float32) * kw_ref[c, pl.ds(k * bd, bd)].astype(jnp.float32)
        return (dot + jnp.sum(hc * w[None, :] * key, axis=1), sh + jnp.sum(hc * hc, axis=1),
                sk + jnp.sum(key * key, axis=1))

    z = jnp.zeros((bt,), jnp.float32)
    dot, sh, sk = jax.lax.fori_loop(0, nck, stats, (z, z, z))
    dd = dot * jax.lax.rsqrt(sh / d + eps) * jax.lax.rsqrt(sk / d + eps)
    dd = dd * d ** -0.5
    mag = jnp.sqrt(jnp.maximum(jnp.abs(dd), 1e-6))
    # copysign by the sign bit (keeps -0.0 -> negative, as jnp.copysign; no copysign lowering in Triton)
    neg = jax.lax.bitcast_convert_type(dd, jnp.int32) < 0
    g = jax.nn.sigmoid(jnp.where(neg, -mag, mag))[:, None]

    def write(k, carry):
        hc = load_h(k)
        v = pltriton.load(kv_ref.at[pl.ds(t0, bt), pl.ds(n * d + k * bd, bd)], mask=tmask,
                          other=0).astype(jnp.float32)
        pltriton.store(out_ref.at[pl.ds(t0, bt), c, pl.ds(k * bd, bd)], (hc + g * v).astype(out_ref.dtype),
                       mask=tmask)
        return carry

    jax.lax.fori_loop(0, nck, write, 0)


@functools.partial(jax.jit, static_argnames=("eps", "dt", "interpret"))
def gate(h, kv, q_weight, k_weight, *, eps: float, dt, interpret: bool = False):
    """Fused Engram gate (same contract as `engram.gate`).

    h: [..., n, D]; kv: [..., n·D + D] (keys then value); q_weight, k_weight: [n, D] (bf16);
    eps: ``rms_norm_eps``. Returns [..., n, D] in `dt`. Differs from the reference only in the fp32
    summation order of the three length-D reductions (chunked by the D block).
    """
    n, d = h.shape[-2], h.shape[-1]
    lead = h.shape[:-2]
    if kv.shape[-1] != (n + 1) * d:
        raise ValueError(f"engram gate: kv width {kv.shape[-1]}, expected {(n + 1) * d}")
    hf = h.reshape(-1, n, d)
    m = hf.shape[0]
    if m == 0:
        return jnp.zeros(h.shape, dt)
    bt = _token_block(m, GATE_TOKEN_BLOCK)
    bd = _pow2_chunk(d, GATE_MAX_CHUNK)
    common.log_choice("engram_gate", interpret, token_block=bt, d_chunk=bd)
    out = pl.pallas_call(
        functools.partial(_gate_kernel, m=m, n=n, d=d, bt=bt, bd=bd, eps=float(eps)),
        grid=(pl.cdiv(m, bt), n),
        out_shape=jax.ShapeDtypeStruct((m, n, d), dt),
        compiler_params=common.triton_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="engram_gate",
    )(hf, kv.reshape(m, (n + 1) * d), q_weight, k_weight)
    return out.reshape(*lead, n, d)


# ------------------------------------------------------------------------------------------- entry

def _row_width_ok(de: int) -> bool:
    return de % 32 == 0 and common.is_pow2(de // 32)


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` runs `cfg`: the fp32 numerics and table rows of a power-of-two number of 32-blocks."""
    return not is_exact(cfg) and _row_width_ok(cfg.engram_head_dim)


def ref_engram(p, h, rows, cfg, dt):
    """The oracle: `engram.engram` on its jnp path (impl "xla")."""
    return engram_ref.engram(p, h, rows, cfg.replace(impl="xla"), dt)


def kernel(p, h, rows, cfg, dt, *, interpret: bool = False):
    """The "engram" op on Pallas (`dispatch.kernel("engram", ...)`): same contract as `engram.engram`.

    p: the layer's ``engram`` params; h [B, T, n, D]; rows int32 [B, T, R]. Returns [B, T, n, D] in `dt`.
    """
    emb = gather(p["embed"]["weight"], p["embed"]["scale"], rows, dt=jnp.dtype(dt), interpret=interpret)
    kv = linear.fp8(emb, p["wkv"], cfg, dt)
    return gate(h, kv, p["q_weight"], p["k_weight"], eps=float(cfg.rms_norm_eps), dt=jnp.dtype(dt),
                interpret=interpret)


dispatch.register("engram", "kernel", kernel=kernel, reference=ref_engram, supports=supports)
