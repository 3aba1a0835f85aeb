"""Engram: n-gram hash memory added to the residual streams before a layer's attention (docs/design/spec.md §5).

Host-side tables (token normalization map, multipliers, primes, row offsets) live in
`engram_tables`; this module is the on-device part: hash rows → fp8 table gather → wkv → gate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from dsv41_jax.model import dispatch, engram_tables, linear, quant
from dsv41_jax.model.numerics import is_exact, mean_f32, rsqrt_f32, sum_f32, x64_scope


@functools.lru_cache(maxsize=32)
def layer_tables(cfg, layer_id: int):
    """(multipliers int64 [max_ngram], primes [[order][head]], offsets int64 [(max_ngram−1)·heads])."""
    primes = engram_tables.engram_primes(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size,
                                         cfg.engram_n_heads, cfg.engram_vocab_size)[layer_id]
    mult = engram_tables.engram_multipliers(layer_id, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size)
    offsets = engram_tables.engram_row_offsets(primes)
    return mult, primes, offsets


def compressed_ids(cfg, token_map, tokens):
    """Token ids [B, T] -> Engram compressed ids (ids outside the map hash as the pad, docs/design/spec.md §5)."""
    V = token_map.shape[0]
    pad_id = token_map[cfg.engram_pad_token_id]
    ok = (tokens >= 0) & (tokens < V)
    return jnp.where(ok, token_map[jnp.clip(tokens, 0, V - 1)], pad_id)


def hash_rows(cfg, layer_id, token_map, tokens, history=None):
    """Table rows [B, T, (max_ngram−1)·n_heads] int32 for tokens [B, T].

    history: optional int32 [B, max_ngram−1] compressed ids before this chunk (most recent last).
    """
    mult, primes, offsets = layer_tables(cfg, layer_id)
    pad_id = token_map[cfg.engram_pad_token_id]
    ids = compressed_ids(cfg, token_map, tokens)
    return engram_tables.engram_hash_rows(ids, mult, primes, offsets, pad_id, history=history)


def gather_rows(table, tscale, rows, dt):
    """The reference gather: hashed rows -> dequantized, concatenated Engram embedding.

    table: float8_e4m3fn [N, de]; tscale: E8M0 [N, de/32]; rows: int32 [..., R] (indices into N).
    Returns [..., R·de] in `dt`: row r's de values e4m3 × 2^(e−127) per 32 (fp32, exact), rows
    concatenated in order, rounded once to `dt`.
    """
    de = table.shape[-1]
    lead, R = rows.shape[:-1], rows.shape[-1]
    emb = table[rows].astype(jnp.float32)  # [..., R, de]
    sc = quant.e8m0_to_f32(tscale[rows])  # [..., R, de/32]
    emb = (emb.reshape(*lead, R, de // 32, 32) * sc[..., None]).reshape(*lead, R * de)
    return emb.astype(dt)


def gate(h, kv, q_weight, k_weight, eps, dt, exact: bool = False):
    """The reference gate (docs/design/spec.md §5): h_c + g_c · value per stream, in fp32, rounded once.

    h: [..., n, D]; kv: [..., n·D + D] (the wkv output: n keys, then the shared value);
    q_weight, k_weight: bf16 [n, D]; eps: ``rms_norm_eps``. Returns [..., n, D] in `dt`.
    With `exact` (the exact / deterministic modes) the rsqrts are fp64 rounded once (`numerics.rsqrt_f32`):
    XLA's fp32 one depends on the batch shape.
    """
    n, D = h.shape[-2], h.shape[-1]
    keys = kv[..., : n * D].reshape(*kv.shape[:-1], n, D).astype(jnp.float32)
    value = kv[..., n * D:].astype(jnp.float32)
    w = q_weight.astype(jnp.float32) * k_weight.astype(jnp.float32)  # [n, D]
    hf = h.astype(jnp.float32)
    d = sum_f32(hf * w * keys, -1, exact)
    d = d * rsqrt_f32(mean_f32(hf * hf, -1, exact) + eps, exact)
    d = d * rsqrt_f32(mean_f32(keys * keys, -1, exact) + eps, exact)
    d = d * D ** -0.5
    g = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(d), 1e-6)), d))
    if exact:  # h + g·value in fp64 (the product is exact): no FMA contraction can change it
        with x64_scope():
            out = hf.astype(jnp.float64) + g[..., None].astype(jnp.float64) * value[..., None, :].astype(jnp.float64)
            return out.astype(jnp.float32).astype(dt)
    return (hf + g[..., None] * value[..., None, :]).astype(dt)


def engram(p, h, rows, cfg, dt, par=None):
    """Apply Engram to the n-stream state.

    p: the layer's ``engram`` params; h [B, T, n, D]; rows int32 [B, T, 24]. Returns h' [B, T, n, D] in `dt`:
    h_c ← h_c + g_c · value with g_c = sigmoid(signed sqrt of the normalized ⟨h_c, w_c ⊙ key_c⟩).

    Implementations (`dispatch.resolve(cfg, "engram")`): "reference" and "xla" are the same code
    (`gather_rows` -> wkv -> `gate`), because it already is the fast XLA formulation: only the 24 hashed
    rows per token are gathered, at stored width (fp8 codes + E8M0 scales, ~0.26 KB per row), and
    dequantized after the gather in one fusion; the 384M-row table is never touched otherwise. The heavy
    part, the wkv GEMM (6144 -> n·D + D), goes through the "linear" seam, which has its own xla path;
    the gate is a few elementwise ops and one reduction per stream. "pallas" / "pallas_interpret":
    `dsv41_jax.pallas.engram_gather.kernel` (gather + dequantize + concatenate in one kernel, the wkv
    still through the "linear" seam, then one gate kernel).

    par: a mesh plan (`parallel.plan.MeshPlan`; the table rows split over its devices): the gather runs
    as `par.engram_gather` (a local gather + one all-reduce, bitwise `gather_rows`).
    A `parallel.host_table.HostTable` in place of ``p["embed"]`` gathers on the host instead (bitwise).
    """
    if hasattr(p["embed"], "host_gather"):  # `parallel.host_table.HostTable`: rows gathered on the host
        kv = linear.fp8(p["embed"].gather(rows, dt), p["wkv"], cfg, dt)
        return gate(h, kv, p["q_weight"], p["k_weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    impl = dispatch.resolve(cfg, "engram")
    sharded = par is not None and par.size > 1
    if sharded and dispatch.is_kernel(impl):
        raise dispatch.ImplError("engram: the Pallas gather kernel does not run on a row-split table; use impl "
                                 "'xla' for engram on a mesh")
    if dispatch.is_kernel(impl):
        dispatch.refuse_kernel_in_f64_mode(cfg, "engram", impl)
        return dispatch.kernel("engram", impl)(p, h, rows, cfg, dt, interpret=impl == "pallas_interpret")
    if impl not in ("reference", "xla"):
        raise dispatch.ImplError(f"engram: no {impl!r} implementation")
    if sharded:
        emb = par.engram_gather(p["embed"]["weight"], p["embed"]["scale"], rows, dt)
    else:
        emb = gather_rows(p["embed"]["weight"], p["embed"]["scale"], rows, dt)
    kv = linear.fp8(emb, p["wkv"], cfg, dt)
    return gate(h, kv, p["q_weight"], p["k_weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
