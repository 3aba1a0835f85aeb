"""Latent attention: one 512-wide K=V latent per position, window + selected compressed slots (docs/design/spec.md §3).

The sublayer is split so the full forward (`transformer.py`) and the cached decode path share every
piece of arithmetic:

* `project_q_kv` — q latent, RoPE'd queries and this layer's window K=V (RoPE + fp8 fake-quant);
  `q_codes` — the cached path's queries and window K=V as stored codes (forms chosen by the plan: `plan.StepPlan`);
* `attend` — one softmax over [window keys ∪ selected compressed slots] with the per-head sink;
* `output_proj` — inverse RoPE, grouped wo_a (bf16), wo_b (fp8).

`sparse_attention` is the seam (op "attention" of `dispatch`) of the cached path: queries, the window
ring's and the compressed pool's *stored codes*, the page table, positions and the selection in; the
attention output out (or, for the o_proj kernel to merge, the attention kernel's split partials).
Implementations: "reference" (decode, gather, `attend`: the reference math), "xla" (`attend` with
storage-dtype matmuls) and the Pallas kernels.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dispatch, linear, quant, weights
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import (DETERMINISTIC, EXACT_SUMS, HIGHEST, einsum_exact, is_exact, round_f32,
                                      round_to, x64_scope)
from dsv41_jax.model.rope import apply_rope, rope_freqs


def layer_freqs(cfg, plan):
    """RoPE frequencies of a layer: compress_rope_theta + YaRN if compress_ratio > 0, else rope_theta."""
    rd = cfg.qk_rope_head_dim
    if plan.yarn:
        rs = cfg.rope_scaling
        return rope_freqs(rd, cfg.compress_rope_theta,
                          yarn=(rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings))
    return rope_freqs(rd, cfg.rope_theta)


def project_q_kv(p, x, positions, freqs, cfg, dt):
    """x [B, T, D] normed input, positions int32 [B, T].

    Returns qr [B, T, q_lora] (normed q latent, also the indexer's input), q [B, T, H, hd] (RoPE'd,
    not quantized) and kv_rot [B, T, hd]: the RoPE'd K=V *before* its fp8 fake-quant (per 32, pow2
    scales); the quantized value is what the window ring stores and attention uses, in the same
    forward too — callers apply `window_kv` (or store its codes, which decode to the same values).
    """
    return (*project_q(p, x, positions, freqs, cfg, dt), project_kv(p, x, positions, freqs, cfg, dt))


def project_q(p, x, positions, freqs, cfg, dt, qa=None):
    """`project_q_kv`'s (qr, q). Inside a layer-scan run where the linear kernel runs, ``p["q_norm"]["weight"]``
    may be the run's stack with its layer (`weights.Stacked`). qa: wq_a(x) when the caller has it already
    (`q_codes`)."""
    H, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
    qa = linear.fp8(x, p["wq_a"], cfg, dt) if qa is None else qa
    qr = rmsnorm(qa, weights.row(p["q_norm"]["weight"]), eps, dt, is_exact(cfg))  # the indexer's (dropped if unused)
    # = apply_rope(fp8(qr, wq_b) as [.., H, hd]): one launch where the linear kernel runs
    q = linear.fp8_normed(qa, p["q_norm"]["weight"], eps, p["wq_b"], cfg, dt, row_axis="heads", rope=(positions, freqs, hd),
                          x_normed=qr)
    return qr, q.reshape(q.shape[:-1] + (H, hd))


def project_kv(p, x, positions, freqs, cfg, dt, y=None):
    """`project_q_kv`'s kv_rot [B, T, hd]: kv_norm(wkv(x)), RoPE'd, in `dt` (``p["kv_norm"]["weight"]`` may be a
    run's stack with its layer, `weights.Stacked`); y: wkv(x) if the caller has it."""
    y = linear.fp8(x, p["wkv"], cfg, dt) if y is None else y
    kv = rmsnorm(y, weights.row(p["kv_norm"]["weight"]), cfg.rms_norm_eps, dt, is_exact(cfg))
    return apply_rope(kv, positions, freqs, out_dtype=dt)


def q_codes(p, x, positions, freqs, cfg, dt, mode: str, st, pend, at):
    """The cached step's projections, plain form (`StepPlan.q_codes`): returns (qr, q as `project_q`, this chunk's
    window codes ``cache.encode("win", mode, kv_rot)`` [B, T, ...] (kv_rot as `project_kv`), st, pend with the codes
    left for `decode.commit`). wq_a and wkv are one call (`linear.fp8_dual`); at: (slot, n_new, k, layer id)."""
    qa, kvy = linear.fp8_dual(x, p["wq_a"], p["wkv"], cfg, dt)
    codes = kvc.encode("win", mode, project_kv(p, x, positions, freqs, cfg, dt, y=kvy))
    return (*project_q(p, x, positions, freqs, cfg, dt, qa=qa), codes, st, pend.with_window(at[3], codes))


def q_codes_kernel(kernel, p, x, positions, freqs, cfg, dt, mode: str, st, pend, at):
    """`q_codes` with the window codes made by `kernel` (`pallas/window_codes.py`: kv_norm, RoPE and the fp8 codes
    of wkv's output in one kernel; the plain form's codes, bitwise where the two sum Σx² alike)."""
    qa, kvy = linear.fp8_dual(x, p["wq_a"], p["wkv"], cfg, dt)
    nw, layer = weights.split(p["kv_norm"]["weight"])
    codes = kernel(kvy, nw, positions, freqs, cfg.rms_norm_eps, dt, layer=layer)
    return (*project_q(p, x, positions, freqs, cfg, dt, qa=qa), codes, st, pend.with_window(at[3], codes))


def q_codes_into_ring(kernel, p, x, positions, freqs, cfg, dt, mode: str, st, pend, at):
    """`q_codes_kernel`, the kernel also writing the codes into the rings of ``st["window"]`` in place (row slot,
    layer at[3] + k; `StepPlan.ring_now`): st comes back with the rings written, nothing is left in `pend`."""
    slot, n_new, k, lid = at
    ring = (st["window"], slot[:, None], n_new[:, None], k, lid)
    qa, kvy = linear.fp8_dual(x, p["wq_a"], p["wkv"], cfg, dt)
    nw, layer = weights.split(p["kv_norm"]["weight"])
    codes, rings = kernel(kvy, nw, positions, freqs, cfg.rms_norm_eps, dt, layer=layer, ring=ring)
    return (*project_q(p, x, positions, freqs, cfg, dt, qa=qa), codes, dict(st, window=rings), pend)


def window_kv(kv_rot, dt):
    """The window K=V: fp8 e4m3 fake-quant over all head_dim dims, per 32, pow2 scales."""
    return quant.fake_quant_fp8(kv_rot, block=32, out_dtype=dt)


def attend(q, win_kv, win_mask, comp_kv, comp_mask, sink, dt, fast: bool = False, exact: bool = False):
    """Joint softmax over window keys and selected compressed slots, with the attention sink.

    q [B, T, H, hd]; win_kv [B, Nw, hd] with win_mask bool [B, T, Nw] (keys shared by the T queries of a
    row, e.g. the whole sequence or a ring); comp_kv [B, T, K, hd] gathered per query with comp_mask
    bool [B, T, K]; sink fp32 [H]. Returns [B, T, H, hd] in `dt`.

    Logits are fp32 (q·k)·hd^−0.5. The sink is unscaled, excluded from the max, and adds
    exp(sink − max) to the denominator only. As the reference kernel, the numerator uses probabilities
    rounded to bf16 (in the bf16 flow) and the denominator stays fp32. A row with no valid key gives 0.

    `fast` (the "xla" implementation): in the bf16 flow the two matmuls take their bf16 operands as
    they are with fp32 accumulation (`preferred_element_type`) instead of widening them to fp32 at
    HIGHEST precision — every product of two bf16 values is exact in fp32, so only the summation order
    may differ; in the fp32 mode (q not bf16) it is the reference math.

    `exact` (the exact / deterministic modes, `numerics.is_exact`): both matmuls and the denominator's sums
    accumulate in fp64 and round once to fp32, so the output does not depend on how the keys are laid
    out (a ring of W + T keys in decode, the whole sequence in the forward, masked entries anywhere).
    """
    if exact:
        return _attend_exact(q, win_kv, win_mask, comp_kv, comp_mask, sink, dt, exact)
    hd = q.shape[-1]
    scale = hd ** -0.5
    low = fast and q.dtype == jnp.bfloat16 and win_kv.dtype == jnp.bfloat16 and comp_kv.dtype == jnp.bfloat16

    def mm(eq, a, b):
        if low:
            return jnp.einsum(eq, a.astype(jnp.bfloat16), b, preferred_element_type=jnp.float32)
        return jnp.einsum(eq, a.astype(jnp.float32), b.astype(jnp.float32), precision=HIGHEST)

    lw = mm("bthd,bsd->bths", q, win_kv) * scale
    lw = jnp.where(win_mask[:, :, None, :], lw, -jnp.inf)
    lc = mm("bthd,btkd->bthk", q, comp_kv) * scale
    lc = jnp.where(comp_mask[:, :, None, :], lc, -jnp.inf)
    m = jnp.maximum(jnp.max(lw, axis=-1, initial=-jnp.inf), jnp.max(lc, axis=-1, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    pw = jnp.exp(lw - m)
    pc = jnp.exp(lc - m)
    denom = jnp.sum(pw, axis=-1) + jnp.sum(pc, axis=-1) + jnp.exp(sink[None, None, :] - m[..., 0])
    num_dt = jnp.bfloat16 if dt == jnp.bfloat16 else jnp.float32
    pw = pw.astype(num_dt)
    pc = pc.astype(num_dt)
    num = mm("bths,bsd->bthd", pw, win_kv)
    num = num + mm("bthk,btkd->bthd", pc, comp_kv)
    return (num / denom[..., None]).astype(dt)


def _attend_exact(q, win_kv, win_mask, comp_kv, comp_mask, sink, dt, level=EXACT_SUMS):
    """`attend` in the exact / deterministic modes: the same formula, every sum in fp64 (see `attend`); in
    the bf16 flow (deterministic bf16) the numerator's probabilities are rounded to bf16 as there; at the
    `numerics.DETERMINISTIC` level everything after the logits is evaluated in fp64 and rounded to fp32
    after each op, as `attend` rounds in fp32 (`numerics.round_f32`)."""
    hd = q.shape[-1]
    scale = hd ** -0.5
    lw = einsum_exact("bthd,bsd->bths", q, win_kv) * scale
    lw = jnp.where(win_mask[:, :, None, :], lw, -jnp.inf)
    lc = einsum_exact("bthd,btkd->bthk", q, comp_kv) * scale
    lc = jnp.where(comp_mask[:, :, None, :], lc, -jnp.inf)
    num_dt = jnp.bfloat16 if dt == jnp.bfloat16 else jnp.float32
    if level >= DETERMINISTIC:
        # After the logits, the bf16 flow's fp32 chain op for op, each op evaluated in fp64 and rounded to
        # fp32 where that chain rounds (`numerics.round_f32`): the exps, the two sums and their adds into
        # the denominator, the two numerator matmuls and their add, and the division as XLA compiles the
        # bf16 flow's ``num / denom[..., None]`` (a division by a broadcast): num · fp32(1 / denom), two
        # roundings (numerics module doc). Measured: micro, layer 0, position 17 of the decode tests'
        # prompt, the output's exact value lies 0.04 fp32 ulp above a bf16 midpoint; the reference's
        # num · fp32(1 / denom) lands 1 fp32 ulp above it and rounds up, the quotient evaluated in fp64
        # rounded to the midpoint and then down (ties to even): the first bf16 difference on that prompt.
        r = round_f32
        with x64_scope():
            f64 = jnp.float64
            lw, lc = lw.astype(f64), lc.astype(f64)
            m = jnp.maximum(jnp.max(lw, axis=-1, initial=-jnp.inf), jnp.max(lc, axis=-1, initial=-jnp.inf))
            m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
            pw, pc = r(jnp.exp(r(lw - m))), r(jnp.exp(r(lc - m)))
            denom = r(r(r(jnp.sum(pw, axis=-1)) + r(jnp.sum(pc, axis=-1)))
                      + r(jnp.exp(r(sink[None, None, :].astype(f64) - m[..., 0]))))
            pw, pc = round_to(pw, num_dt), round_to(pc, num_dt)  # the numerator's bf16 probabilities
            num = r(r(jnp.einsum("bths,bsd->bthd", pw, win_kv.astype(f64), precision=HIGHEST))
                    + r(jnp.einsum("bthk,btkd->bthd", pc, comp_kv.astype(f64), precision=HIGHEST)))
            return r(num * r(1.0 / denom)[..., None]).astype(jnp.float32).astype(dt)
    m = jnp.maximum(jnp.max(lw, axis=-1, initial=-jnp.inf), jnp.max(lc, axis=-1, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, 0.0)[..., None]
    pw = jnp.exp(lw - m)
    pc = jnp.exp(lc - m)
    with x64_scope():
        f64 = jnp.float64
        denom = (jnp.sum(pw.astype(f64), axis=-1) + jnp.sum(pc.astype(f64), axis=-1)
                 + jnp.exp(sink[None, None, :] - m[..., 0]).astype(f64))
        pw, pc = pw.astype(num_dt).astype(f64), pc.astype(num_dt).astype(f64)
        num = (jnp.einsum("bths,bsd->bthd", pw, win_kv.astype(f64), precision=HIGHEST)
               + jnp.einsum("bthk,btkd->bthd", pc, comp_kv.astype(f64), precision=HIGHEST))
        return (num / denom[..., None]).astype(jnp.float32).astype(dt)


def window_keys(ring, ring_rows, new, start, positions, valid, window: int, mode: str, dt, key_lo=None,
                ring_layer=None, ring_base: int = 0):
    """Window keys and mask of a chunk: the ring (positions before `start`) + the chunk's own keys.

    ring: the layer's ring codes (first axes [R, W]), every layer's (first axes [R, L, W], the cache's
    ``state["window"]``: layer ring_base + ring_layer, an int or int32 scalar) or None (no earlier positions: the full
    forward); ring_rows int32 [B]; new: codes of the chunk's keys (first axes [B, T]); start int32 [B];
    positions int32 [B, T]; valid bool [B, T]. Returns (keys [B, W+T, hd] or [B, T, hd] in `dt`,
    mask bool [B, T, W+T] or [B, T, T]): key p is visible from query t iff p ≤ t and p > t − W.
    key_lo: optional int32 [B]: keys at positions < key_lo[b] are hidden too (SWA bounded replay: the
    late layers never computed them, their ring entries are stale). None: no such bound (and no op).
    """
    new_kv = kvc.decode("win", mode, new, dt)
    if ring is None:
        keys, key_pos, key_ok = new_kv, positions, valid
    else:
        W = window
        got = kvc.store_get(ring, ring_rows) if ring_layer is None else kvc.store_get_layer(ring, ring_rows,
                                                                                                 ring_base + ring_layer)
        ring_kv = kvc.decode("win", mode, got, dt)  # [B, W, hd]
        s = jnp.arange(W, dtype=jnp.int32)[None, :]
        ring_pos = start[:, None] - 1 - jnp.mod(start[:, None] - 1 - s, W)  # latest position ≡ s (mod W) before start
        keys = jnp.concatenate([ring_kv, new_kv], axis=1)
        key_pos = jnp.concatenate([ring_pos, positions], axis=1)
        key_ok = jnp.concatenate([ring_pos >= 0, valid], axis=1)
    q = positions[:, :, None]
    mask = key_ok[:, None, :] & (key_pos[:, None, :] <= q) & (key_pos[:, None, :] > q - window)
    if key_lo is not None:
        mask = mask & (key_pos[:, None, :] >= key_lo[:, None, None])
    return keys, mask


def sparse_attention(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, *,
                     ratio: int, page_size: int, window: int, mode: str, impl: str = "reference",
                     exact: bool = False, key_lo=None, ring_layer=None, ring_base: int = 0, merge: bool = True):
    """The attention seam: one softmax over [window ∪ selected compressed slots] read from stored codes.

    Inputs (B rows, T queries per row, H heads, hd = head_dim, W = sliding_window):
      q           [B, T, H, hd] `dt` (bf16 or fp32)   RoPE'd queries, not quantized
      sink        fp32 [H]                            attn_sink
      ring        this layer's window ring codes, first axes [R, W] (`cache.empty_store("win", mode,
                  (R, W), hd)`: {"q": fp8 e4m3 [R, W, hd], "s": e8m0 [R, W, hd/32]} in the default
                  mode), entry s of a row holding the latest position ≡ s (mod W) before `start`;
                  None when the chunk starts at 0 with no ring (the full forward); or every layer's
                  rings, first axes [R, L, W] (the cache's ``state["window"]``), with `ring_layer`
      ring_rows   int32 [B]      ring row of each batch row (batch["slot"])
      new         the chunk's own window codes, first axes [B, T] (`cache.encode("win", mode, kv_rot)`)
      start       int32 [B]      position of the chunk's first token
      positions   int32 [B, T]   query positions (= start + t); valid bool [B, T] real tokens (or int32,
                                 nonzero = real: the kernel reads it so, and a layer-scan run converts once)
      comp        the KV source's compressed pool codes, first axis N (`cache.empty_store("comp", mode,
                  (N,), hd)`: {"q": uint8 [N, hd/2] packed e2m1, "s": fp8 e4m3 [N, hd/16]}), or None
                  for a window-only layer
      page_table  int32 [B, P]; slot j of row b is pool row `indexer.pool_index(page_table, j, ratio,
                  page_size)`
      sel         int32 [B, T, K] selected compressed slots (−1 = none), from `indexer.topk`
      key_lo      int32 [B] or None  window keys at positions < key_lo[b] are not visible (SWA bounded
                  replay's late layers: `decode.extend_bounded`); None = no bound
      ring_layer  None (ring is one layer's), or the layer of a stacked ring to read, ring_base + ring_layer:
                  an int, or an int32 scalar (a layer-scan run's index; ring_base, static, its first layer:
                  an add of the two would be an XLA launch per trip); the kernel reads it in place
    Static: ratio, page_size, window, mode (kv_cache_dtype), impl, exact (the exact numerics mode:
    fp64-accumulated sums, `attend`; "reference" and "xla" only), merge (False: the kernel's unmerged split
    partials, a dict (`pallas.sparse_attention.kernel`'s merge), for `output_proj`'s o_proj kernel to merge
    inside itself — the plan's `StepPlan.attend_partials`, where both kernels run; a Pallas `impl` only).
    Returns [B, T, H, hd] in q.dtype (docs/design/spec.md §3: fp32 logits, sink in the denominator only, bf16-rounded
    numerator probabilities in the bf16 flow; a query with no valid key gives 0).
    A Pallas kernel registered for "attention" is called with these arguments (minus `impl`, `exact`, `key_lo`:
    it refuses the fp64 modes and SWA bounded replay's window bound) plus `interpret`.
    """
    if dispatch.is_kernel(impl):  # (the step calls the kernel itself where the plan runs it: `StepPlan.attend`)
        if exact:
            raise dispatch.ImplError(f"attention: the exact / deterministic numerics modes have no {impl!r} "
                                     "implementation (fp64 accumulation is for the jnp paths: use impl "
                                     "'attention=xla' or 'reference')")
        return dispatch.kernel("attention", impl)(
            q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, ratio=ratio,
            page_size=page_size, window=window, mode=mode, ring_layer=ring_layer, ring_base=ring_base,
            interpret=impl == "pallas_interpret", merge=merge, key_lo=key_lo)
    if not merge:
        raise dispatch.ImplError(f"attention: split partials come from the attention kernel, not {impl!r}")
    if impl not in ("reference", "xla"):
        raise dispatch.ImplError(f"attention: unknown implementation {impl!r}")
    return _sparse_attention_jnp(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, ratio,
                                 page_size, window, mode, impl == "xla", exact, key_lo, ring_layer, ring_base)


def _sparse_attention_jnp(q, sink, ring, ring_rows, new, start, positions, valid, comp, page_table, sel, ratio,
                          page_size, window, mode, fast, exact, key_lo, ring_layer, ring_base):
    """`sparse_attention`'s "reference" / "xla" (fast) implementations: the window keys (`window_keys`) and the
    selected compressed slots decoded from their codes, then `attend`."""
    dt = q.dtype
    B, T = positions.shape
    win_kv, win_mask = window_keys(ring, ring_rows, new, start, positions, valid.astype(bool), window, mode, dt,
                                   key_lo, ring_layer, ring_base)
    if comp is None or sel.shape[-1] == 0:
        comp_kv = jnp.zeros((B, T, 0, q.shape[-1]), dt)
        comp_mask = jnp.zeros((B, T, 0), bool)
    else:
        rows = kvc.token_locs(page_table, jnp.maximum(sel, 0) * ratio, page_size) // ratio
        comp_kv = kvc.decode("comp", mode, kvc.store_get(comp, rows), dt)
        comp_mask = sel >= 0
    return attend(q, win_kv, win_mask, comp_kv, comp_mask, sink, dt, fast=fast, exact=exact)


def sink_of(p):
    """The layer's attention sink fp32 [H] (``p["attn_sink"]``, or inside a layer-scan run where the o_proj
    kernel reads it in place the run's stack with the layer, `weights.Stacked`)."""
    return weights.row(p["attn_sink"]).astype(jnp.float32)


def output_proj(step, p, o, positions, freqs, cfg, dt):
    """o [B, T, H, hd] attention output (or the attention kernel's split partials, `StepPlan.attend_partials`) ->
    [B, T, D]: inverse RoPE at the query position, wo_a per group of H/o_groups heads (bf16, exact), wo_b fp8.
    Where `StepPlan.linear_kernel`, the inverse RoPE, wo_a and the partials' merge are one kernel (`pallas/o_proj.py`;
    wo_a and the sink may be a run's stacks, `weights.Stacked`)."""
    G, R = cfg.o_groups, cfg.o_lora_rank
    if step.linear_kernel:
        (sink, _), (w, layer) = weights.split(p["attn_sink"]), weights.split(p["wo_a"])
        y = step.kernels["linear", "o_proj"](o, w, positions, freqs, G, R, dt, sink=sink, layer=layer)
        return linear.fp8(y, p["wo_b"], cfg, dt)
    if isinstance(o, dict):
        raise ValueError("output_proj: split partials need the o_proj kernel (StepPlan.linear_kernel) to merge them")
    B, T = o.shape[:2]
    o = apply_rope(o, positions[..., None], freqs, inverse=True, out_dtype=dt)
    o = o.reshape(B, T, G, cfg.o_group_in)
    y = linear.wo_a(o, p["wo_a"], cfg, dt, row_axis="heads").astype(dt).reshape(B, T, G * R)
    return linear.fp8(y, p["wo_b"], cfg, dt)
