"""The attention sublayer of V4's sliding / CSA / HCA layers over a whole sequence (docs/design/v4.md).

The shared latent-MQA core with V4's variants:

* `project_q`: V4.1's q path (wq_a → weighted RMSNorm → wq_b) plus the ``q_head_norm`` variant — an
  unweighted RMSNorm of each head after wq_b, before RoPE (`v4.numerics.head_rms`); `project_kv`:
  kv_norm(wkv·x), RoPE'd, its non-RoPE channels fp8 in the release numerics (`v4.numerics.kv_entries`).
* compressed entries: every CSA / HCA layer compresses for itself (`v4.compressor.compress`; no KV sources);
  HCA attends every causal entry (w < (t+1) // r, `hca_picks`); CSA attends the top-k entries of its own
  Lightning indexer (`index_select`: its own compressor's keys through V4.1's indexer seam `indexer.topk`).
* `attention.attend` (one softmax over window keys and entries with the per-head sink), then the inverse
  RoPE, the grouped wo_a and wo_b (`output_proj`). The paged step (`v4.decode`) calls V4.1's attention seam
  `attention.sparse_attention` instead, on its ring and pools as they are.

Kernels (`seam_impl`, docs/design/v4.md "Kernels"): both seams take V4's state as it is laid out — values
stored in the activation dtype read with the "float32" / "bfloat16" codecs (`store_mode`), pool rows addressed
by the page table as V4.1's (`indexer.pool_index`), HCA's "every visible entry" as a pick list — so V4.1's
registered kernels run them unchanged (`pallas.sparse_attention`, `pallas.indexer_topk` without its candidate
stage); the jnp path is each seam's "reference" (what V4 has always computed: "xla" names it too).

RoPE: sliding layers ``rope_theta``; CSA / HCA layers ``compress_rope_theta`` with YaRN unless
``rope_scaling.type`` is "default" (`layer_freqs`).
"""

from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import dispatch, indexer
from dsv41_jax.model.attention import attend, sink_of
from dsv41_jax.model.numerics import einsum_exact, HIGHEST, is_exact, mode_name
from dsv41_jax.model.rope import rope_freqs
from dsv41_jax.model.v4.compressor import compress
from dsv41_jax.model.v4.linear import dense, weight
from dsv41_jax.model.v4.numerics import head_rms, index_rotated, kv_entries
from dsv41_jax.model.v4.torch_order import exact_level, norm_fn, rope_fn


def layer_freqs(cfg, kind: str):
    """RoPE frequencies [rd/2] of a layer of `kind` ("sliding" | "csa" | "hca"); the power correctly rounded, as
    torch's, with ``release_order`` "torch_cpu" (`rope.rope_freqs`' ``exact_pow``)."""
    rd = cfg.qk_rope_head_dim
    exact_pow = cfg.release_order == "torch_cpu"
    if kind == "sliding":
        return rope_freqs(rd, cfg.rope_theta, exact_pow=exact_pow)
    rs = cfg.rope_scaling
    yarn = ((rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings)
            if rs.type == "yarn" else None)
    return rope_freqs(rd, cfg.compress_rope_theta, yarn=yarn, exact_pow=exact_pow)


def kernel_refusal(cfg, op: str, impl: str):
    """Why V4 cannot run seam `op` ("attention" | "indexer") with the Pallas kernel `impl` (one line naming the op and
    what does not fit), or None: V4.1's kernels take V4's state as laid out (module doc) except in the fp64 modes,
    with ``release_order`` "torch_cpu" (both sums then follow the release's torch order, `torch_order.exact_level`),
    and at widths the kernels' tiles do not take."""
    if cfg.release_order == "torch_cpu":
        return f"{op}={impl}: release_order 'torch_cpu' runs the release's torch order (research), not a kernel"
    if is_exact(cfg):
        return f"{op}={impl}: the {mode_name(cfg)} numerics mode accumulates in fp64, the kernel in fp32"
    if op == "attention" and not dispatch.supports("attention", "kernel", cfg):
        return f"{op}={impl}: the kernel needs a power-of-two head_dim >= 32, not {cfg.head_dim}"
    dI = cfg.index_head_dim
    if op == "indexer" and (dI < 16 or dI & (dI - 1)):  # (the kernel's candidate stage, V4 has none: not asked)
        return f"{op}={impl}: the kernel needs a power-of-two index_head_dim >= 16, not {dI}"
    return None


def seam_impl(cfg, op: str) -> str:
    """The implementation V4 runs seam `op` ("attention" | "indexer") with: the Pallas kernel the config names (refused
    with `kernel_refusal`'s line where it does not fit) or "auto" resolves to (on a GPU, `dispatch.GPU_AUTO`) where it
    fits; else "reference", the jnp core ("xla" names the same for V4)."""
    impl = dispatch.resolve(cfg, op)
    if dispatch.is_kernel(impl):
        why = kernel_refusal(cfg, op, impl)
        if why is None:
            return impl
        if dispatch.parse_impl(cfg.impl)[op] != "auto":
            raise NotImplementedError(f"DeepSeek-V4: {why}")
    return "reference"


def store_mode(dt) -> str:
    """The ``kv_cache_dtype`` whose codec reads V4's stored values (the activation dtype, no quantization) as they
    are, for the seams' `mode` argument."""
    return "bfloat16" if dt == jnp.bfloat16 else "float32"


def head_norm(q, cfg, dt):
    """The ``q_head_norm`` variant: q [.., H, hd] · rsqrt(mean(q²) + eps) per head (`v4.numerics.head_rms`: the
    shared `norm.rmsnorm` with weight 1 in fp32, the release's bf16 tensor arithmetic in the bf16 flow)."""
    if not cfg.q_head_norm:
        return q
    return head_rms(q, cfg, dt)


def project_q(p, x, positions, freqs, cfg, dt):
    """x [B, T, D] -> (qr [B, T, q_lora] the normed q latent (the indexer's input), q [B, T, H, hd] RoPE'd)."""
    eps = cfg.rms_norm_eps
    qr = norm_fn(cfg)(dense(x, p["wq_a"], cfg, dt), p["q_norm"]["weight"], eps, dt, is_exact(cfg))
    q = dense(qr, p["wq_b"], cfg, dt)
    q = head_norm(q.reshape(q.shape[:-1] + (cfg.num_attention_heads, cfg.head_dim)), cfg, dt)
    return qr, rope_fn(cfg)(q, positions[..., None], freqs, out_dtype=dt)


def project_kv(p, x, positions, freqs, cfg, dt):
    """The window K=V [B, T, hd]: kv_norm(wkv·x), RoPE'd, as stored (`v4.numerics.kv_entries`)."""
    kv = norm_fn(cfg)(dense(x, p["wkv"], cfg, dt), p["kv_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))
    return kv_entries(rope_fn(cfg)(kv, positions, freqs, out_dtype=dt), cfg, dt)


def index_query(p, qr, x, positions, freqs, cfg, dt):
    """CSA's Lightning-indexer query: qr [B, T, q_lora], x [B, T, D] -> (q [B, T, nI, dI] RoPE'd (rotated and FP4 in
    the release numerics, `v4.numerics.index_rotated`, as the keys), w [B, T, nI] in `dt`: weights_proj·x ·
    (dI·nI)^−½, the projection rounded to `dt`, then the scaled product, as the release)."""
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    q = dense(qr, p["wq_b"], cfg, dt)
    q = rope_fn(cfg)(q.reshape(q.shape[:-1] + (nI, dI)), positions[..., None], freqs, out_dtype=dt)
    q = index_rotated(q, cfg, dt)
    w = dense(x, p["weights_proj"], cfg, dt).astype(jnp.float32) * jnp.float32((dI ** -0.5) * (nI ** -0.5))
    return q, w.astype(dt)


def index_select(p, qr, x, positions, freqs, pool, page_table, page_size: int, ratio: int, cfg, dt):
    """CSA's Lightning indexer: the top-`index_topk` entries of each query over the layer's own index keys.

    p: the layer's ``indexer`` params (``wq_b`` [nI·dI, q_lora], ``weights_proj`` [nI, D]); qr [B, T, q_lora];
    x [B, T, D]; pool [N, dI] its compressor's keys in `dt`, entry w of row b at `indexer.pool_index`(page_table,
    w, ratio, page_size) (the paged step's pool, or the forward's keys [B, S, dI] flattened with one page per row).
    score(t, w) = Σ_h w_h · ReLU(q_h · k_w) (`index_query`; `indexer.raw_scores`' roundings); entries
    w ≥ (t+1) // ratio are −inf. Through V4.1's indexer seam (`indexer.topk`, no candidate stage) by `seam_impl`.
    Returns int32 [B, T, min(k, S)], ascending, −1 for picks at −inf (`indexer.select_topk`'s layout)."""
    q, w = index_query(p, qr, x, positions, freqs, cfg, dt)
    sel, _ = indexer.topk(q, w, {"v": pool}, page_table, (positions + 1) // ratio, ratio=ratio, page_size=page_size,
                          mode=store_mode(dt), k=cfg.index_topk, dt=dt, impl=seam_impl(cfg, "indexer"),
                          exact=exact_level(cfg))
    return sel


def hca_picks(positions, S: int, ratio: int):
    """HCA's compressed entries as a pick list: int32 [B, T, S], entry w where w < (t+1) // ratio, else −1 (the
    layout of the indexer's picks, so both kinds read their entries alike)."""
    w = jnp.arange(S, dtype=jnp.int32)
    return jnp.where(w < ((positions + 1) // ratio)[..., None], w, -1)


def compressed_view(entries, positions, ratio: int, sel=None):
    """What a query attends of the layer's compressed entries [B, S, hd]: (comp [B, T, K, hd], mask [B, T, K]) —
    CSA: the picks `sel` [B, T, K] (−1 = none); HCA (`sel` None): every entry w < (t+1) // ratio (`hca_picks`)."""
    if sel is None:
        sel = hca_picks(positions, entries.shape[1], ratio)
    comp = jnp.take_along_axis(entries[:, None], jnp.maximum(sel, 0)[..., None], axis=2)
    return comp, sel >= 0


def output_proj(p, o, positions, freqs, cfg, dt):
    """o [B, T, H, hd] -> [B, T, D]: inverse RoPE at the query position, wo_a per group (o_groups groups of
    H/o_groups heads -> o_lora_rank each), wo_b."""
    B, T = o.shape[:2]
    G, R = cfg.o_groups, cfg.o_lora_rank
    o = rope_fn(cfg)(o, positions[..., None], freqs, inverse=True, out_dtype=dt).reshape(B, T, G, -1)
    wa = weight(p["wo_a"], cfg).reshape(G, R, -1)
    if is_exact(cfg):
        y = einsum_exact("btgi,gri->btgr", o, wa)
    else:
        y = jnp.einsum("btgi,gri->btgr", o.astype(jnp.float32), wa.astype(jnp.float32), precision=HIGHEST)
    return dense(y.astype(dt).reshape(B, T, G * R), p["wo_b"], cfg, dt)


def attention_full(p, x, positions, kind: str, ratio: int, cfg, dt):
    """The attention sublayer of one layer over a sequence starting at position 0.

    p: the layer's ``attn`` params; x [B, T, D] its normed input; kind "sliding" | "csa" | "hca" with its
    compress `ratio`. Returns (y [B, T, D] in `dt`, rec): rec {"topk": int32 [B, T, k']} at CSA layers (the
    indexer's picks), else {}."""
    B, T, _ = x.shape
    W = cfg.sliding_window
    freqs = layer_freqs(cfg, kind)
    qr, q = project_q(p, x, positions, freqs, cfg, dt)
    kv = project_kv(p, x, positions, freqs, cfg, dt)
    t = jnp.arange(T)
    win_mask = jnp.broadcast_to((t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - W), (B, T, T))
    S = T // ratio if ratio else 0
    rec: dict = {}
    if kind == "sliding" or S == 0:
        comp = jnp.zeros((B, T, 0, cfg.head_dim), dt)
        comp_mask = jnp.zeros((B, T, 0), bool)
        if kind == "csa":
            rec["topk"] = jnp.zeros((B, T, 0), jnp.int32)
    else:
        entries = compress(p["compressor"], x, ratio, kind == "csa", freqs, cfg, dt)  # [B, S, hd]
        sel = None
        if kind == "csa":
            keys = compress(p["indexer"]["compressor"], x, ratio, True, freqs, cfg, dt, index=True)  # [B, S, dI]
            rows = jnp.arange(B, dtype=jnp.int32)[:, None]  # one page of S·r tokens per row: row b's key w at b·S + w
            rec["topk"] = sel = index_select(p["indexer"], qr, x, positions, freqs, keys.reshape(B * S, -1), rows,
                                             S * ratio, ratio, cfg, dt)
        comp, comp_mask = compressed_view(entries, positions, ratio, sel)
    o = attend(q, kv, win_mask, comp, comp_mask, sink_of(p), dt, exact=exact_level(cfg))
    return output_proj(p, o, positions, freqs, cfg, dt), rec
