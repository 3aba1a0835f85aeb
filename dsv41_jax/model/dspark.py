"""DSpark, V4.1's bundled speculative draft (docs/design/spec.md §7): target features, draft rings, block proposal.

The draft is `num_nextn_predict_layers` stages ``params["mtp"][s]``, each a full block (mHC, window-only
attention at rope_theta, its own MoE with dspark_n_routed_experts experts, top
dspark_num_experts_per_tok, one shared expert; no Engram / compressor / indexer), sharing the
target's embedding and LM head. Pieces, all pure:

* `target_features` — main_x [B, T, D]: the bf16 mean over the n streams of the state entering each
  of dspark_target_layer_ids (after its Engram), concatenated, ``mtp.0.main_proj`` (fp8),
  ``mtp.0.main_norm``.
* `ring_codes` / `write_rings` — each stage's window ring holds, for every committed target position
  p, fp8-fake-quant(RoPE_p(kv_norm(wkv_stage(main_x_p)))) at slot p mod sliding_window. The rings live
  in the cache pytree under ``state["dspark"]`` (`init_rings`, `with_rings`): a list over stages of
  window stores [slot_rows, W, head_dim] (`cache.slot_rows`; same codec as the target's window rings).
* `propose` — one bidirectional pass over the block [anchor, noise × (block_size − 1)] at positions
  s+1..s+block_size (s = last committed position), attending to the committed positions
  max(0, s − W + 1)..s of the stage's ring plus every block row; then the Markov fix-up, sequential
  over the block (prev_0 = anchor; logits_k += markov_head(markov_embed(prev_k)); draw d_k;
  prev_{k+1} = d_k) and the confidence head c_k = proj([x_k ; m_k]) (raw, fp32).
* `extend_seeding` — the target's `decode.extend` plus the rings written for every token it
  committed (prompt prefill: "a pass from position 0 only seeds the rings and proposes nothing").

Verification and the commit of the accepted prefix are `dsv41_jax.serving.speculative`'s (it needs the
sampler); docs/design/dspark.md describes the whole step.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from dsv41_jax.model import attention as attn_mod
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode, linear
from dsv41_jax.model.mhc import hc_pre
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.rope import apply_rope
from dsv41_jax.model.plan import StepPlan
from dsv41_jax.model.transformer import block, embed_streams, initial_pre, settle


def _require(cfg):
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("DSpark: this config has no DSpark stages (num_nextn_predict_layers = 0)")


def init_rings(cfg, ccfg) -> list:
    """Zeroed draft rings: one window store per stage, codes of [slot_rows, W, head_dim] (`cache.slot_rows`:
    every dp rank's slots and scratch row, as the target's rings)."""
    _require(cfg)
    rows = kvc.slot_rows(ccfg)
    return [kvc.empty_store("win", ccfg.kv_cache_dtype, (rows, cfg.sliding_window), cfg.head_dim)
            for _ in range(cfg.num_nextn_predict_layers)]


def with_rings(state: dict, cfg, ccfg) -> dict:
    """The cache pytree plus ``"dspark"`` rings (`init_rings`). Rings need no per-request reset: a
    proposal reads only positions <= s of its own request, all written when they were committed."""
    return {**state, "dspark": init_rings(cfg, ccfg)}


def stream_means(states: list, dt):
    """The target features' input: each state [B, T, n, D] averaged over its n streams in fp32 and rounded once to
    `dt`, concatenated in list order -> [B, T, len(states)·D] (V4.1's and V4's DSpark heads alike)."""
    return jnp.concatenate([jnp.mean(h.astype(jnp.float32), axis=-2).astype(dt) for h in states], axis=-1)


def target_features(params, layer_inputs: dict, cfg, dt):
    """main_x [B, T, D] in `dt` from {layer id: state entering it [B, T, n, D]} (docs/design/spec.md §7).

    The mean over streams is taken in fp32 and rounded once to `dt` (the "bf16 mean" of the bf16
    flow); concatenated in dspark_target_layer_ids order (3·D) → main_proj (fp8 GEMM) → main_norm.
    """
    _require(cfg)
    p0 = params["mtp"][0]
    x = linear.fp8(stream_means([layer_inputs[lid] for lid in cfg.dspark_target_layer_ids], dt), p0["main_proj"],
                   cfg, dt)
    return rmsnorm(x, p0["main_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))


def _stage_plan(cfg, s):
    return cfg.layer_plan(cfg.num_hidden_layers + s)


def ring_codes(params, main_x, positions, cfg, mode: str, dt) -> list:
    """Per stage: window codes of [B, T, hd] for main_x [B, T, D] at positions int32 [B, T]:
    kv_norm(wkv_stage(main_x)) → RoPE at rope_theta (no YaRN) → fp8 codes (`cache.encode("win")`)."""
    out = []
    for s, sp in enumerate(params["mtp"]):
        p = sp["attn"]
        freqs = attn_mod.layer_freqs(cfg, _stage_plan(cfg, s))
        kv = rmsnorm(linear.fp8(main_x, p["wkv"], cfg, dt), p["kv_norm"]["weight"], cfg.rms_norm_eps, dt,
                     is_exact(cfg))
        kv = apply_rope(kv, positions, freqs, out_dtype=dt)
        out.append(kvc.encode("win", mode, kv))
    return out


def write_rings(params, rings: list, layer_inputs: dict, slot, positions, n_commit, cfg, ccfg) -> list:
    """Rings after committing the first n_commit[b] tokens of each row (positions int32 [B, T], slot
    int32 [B]); layer_inputs as `target_features` takes them (the target's aux of the same step)."""
    dt = act_dtype(cfg)
    main_x = target_features(params, layer_inputs, cfg, dt)
    codes = ring_codes(params, main_x, positions, cfg, ccfg.kv_cache_dtype, dt)
    return [decode._window_write(r, slot, positions, n_commit, c, cfg.sliding_window)
            for r, c in zip(rings, codes)]


def extend_seeding(params, state, batch, cfg, ccfg, all_logits: bool = False, par=None):
    """`decode.extend` for a cache with DSpark rings: the same logits and target cache, and every
    committed token's draft KV written (prefill chunks, and plain steps while DSpark is on).
    par: as `decode.extend` (the target's MoE and row-split tables on the mesh plan).
    Returns (logits, state)."""
    logits, st, pend, aux = decode.extend_uncommitted(params, state, batch, cfg, ccfg, all_logits, par=par)
    new_state = decode.commit(st, pend, batch, batch["n_new"], cfg)
    new_state["dspark"] = write_rings(params, state["dspark"], aux["layer_inputs"], batch["slot"],
                                      pend.positions, batch["n_new"], cfg, ccfg)
    return logits, new_state


def _draft_attention(step, p, x, ring, slot, start, positions, plan, cfg, ccfg, dt):
    """A stage's attention over [its ring's committed positions ∪ the whole block].

    x [B, K, D] normed block input at positions int32 [B, K] (= start + k); ring: the stage's ring
    codes; slot, start int32 [B] (start = s + 1). The block rows' K=V is a window K (kv_norm, RoPE,
    fp8 fake-quant) and is never cached; ring entry i holds the latest position ≡ i (mod W) <= s, shown
    iff >= 0. Every row sees every block row (bidirectional). Returns [B, K, D] in `dt`.
    """
    freqs = attn_mod.layer_freqs(cfg, plan)
    _, q, kv_rot = attn_mod.project_q_kv(p, x, positions, freqs, cfg, dt)
    blk = attn_mod.window_kv(kv_rot, dt)
    ring_kv = kvc.decode("win", ccfg.kv_cache_dtype, kvc.store_get(ring, slot), dt)  # [B, W, hd]
    o = block_attend(q, ring_kv, blk, start, attn_mod.sink_of(p), cfg, dt)
    return attn_mod.output_proj(step, p, o, positions, freqs, cfg, dt)


def block_attend(q, ring_kv, blk, start, sink, cfg, dt):
    """The draft block's attention core (V4.1's and V4's DSpark heads): q [B, K, H, hd] over the keys [ring_kv
    [B, W, hd] (entry i: the latest committed position ≡ i (mod W) <= s = start − 1, shown iff >= 0) ; blk [B, K,
    hd] (the block's own K=V, every row seen by every row)], one softmax with the per-head sink. Returns [B, K, H,
    hd] in `dt`."""
    B, K = blk.shape[:2]
    W = ring_kv.shape[1]
    s = (start - 1)[:, None]
    ring_pos = s - jnp.mod(s - jnp.arange(W, dtype=jnp.int32)[None, :], W)
    keys = jnp.concatenate([ring_kv, blk], axis=1)
    ok = jnp.concatenate([ring_pos >= 0, jnp.ones((B, K), bool)], axis=1)
    mask = jnp.broadcast_to(ok[:, None, :], (B, K, W + K))
    hd = q.shape[-1]
    return attn_mod.attend(q, keys, mask, jnp.zeros((B, K, 0, hd), dt), jnp.zeros((B, K, 0), bool), sink, dt,
                           exact=is_exact(cfg))


def greedy_draw(k, logits):
    """The default `draw`: argmax (ties to the lower id), q one-hot. logits fp32 [B, V]."""
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, jax.nn.one_hot(tok, logits.shape[-1], dtype=jnp.float32)


def propose(params, rings: list, anchor, start, slot, cfg, ccfg, gamma: Optional[int] = None,
            draw: Callable = greedy_draw, *, detach_confidence: bool = False, par=None) -> dict:
    """One DSpark block proposal (docs/design/spec.md §7).

    anchor int32 [B]: the token the target just produced, at position start[b] (= s + 1, the number of
    tokens in the cache); slot int32 [B]: the request's ring row. gamma (static, 1..dspark_block_size,
    default the block size): how many proposals are returned — the pass always runs the whole block
    the draft was trained with, and the first gamma slots are kept.
    draw(k, logits fp32 [B, V]) -> (token int32 [B], q fp32 [B, V]) samples slot k at the request's
    parameters and returns the distribution it sampled from (`greedy_draw` by default).

    detach_confidence (training only, `training.dspark_train`): the confidence head's input
    [x_k ; m_k] is `stop_gradient`-ed, so a loss on c_k trains the head alone and not the stages or
    the Markov embedding; the values computed are the same.

    par: a mesh plan for the stages' MoE and the embedding (as `decode.extend`'s; None: the draft's
    weights as the compiler splits them). Inside one dp rank's program (`parallel.dp`) it is required:
    the rank holds only its block of the draft's experts.

    Returns {"tokens" int32 [B, γ] (d_k proposes the token at position s + k + 2), "probs" q fp32
    [B, γ, V], "logits" fp32 [B, γ, V] (after the Markov term), "confidence" fp32 [B, γ] (raw)}.
    """
    _require(cfg)
    G = cfg.dspark_block_size
    gamma = G if gamma is None else int(gamma)
    if not 1 <= gamma <= G:
        raise ValueError(f"gamma: {gamma} must be in 1..dspark_block_size={G}")
    dt = act_dtype(cfg)
    anchor = anchor.astype(jnp.int32)
    B = anchor.shape[0]
    ids = jnp.concatenate([anchor[:, None], jnp.full((B, G - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = start[:, None].astype(jnp.int32) + jnp.arange(G, dtype=jnp.int32)[None, :]
    h = embed_streams(params, ids, cfg, dt, par)
    pre = initial_pre((B, G), cfg)
    step = StepPlan.of(cfg, par, (B, G))
    for s, sp in enumerate(params["mtp"]):
        plan = _stage_plan(cfg, s)

        def attn_fn(x, sp=sp, ring=rings[s], plan=plan):
            return _draft_attention(step, sp["attn"], x, ring, slot, start, positions, plan, cfg, ccfg, dt), None

        h, pre, _, _ = block(step, sp, h, pre, plan, cfg, dt, cfg.dspark_num_experts_per_tok, attn_fn, par=par)
        h = settle(step, h, cfg, dt, par)
    last = params["mtp"][-1]
    x = hc_pre(h, pre, dt)  # [B, G, D], un-normed (the confidence head's input)
    base = linear.f32(rmsnorm(x, last["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg)), params["head"]["weight"], cfg,
                      row_axis="vocab")
    mk = last["markov_head"]
    return markov_block(base, x, anchor, mk["embed"]["weight"], mk["head"]["weight"],
                        last["confidence_head"]["proj"]["weight"], gamma, draw, cfg, dt,
                        detach_confidence=detach_confidence)


def markov_block(base, x, anchor, markov_embed, markov_head, confidence_proj, gamma: int, draw: Callable, cfg, dt,
                 detach_confidence: bool = False) -> dict:
    """The Markov fix-up and the confidence head over a block (V4.1's and V4's DSpark heads), sequential over its
    first `gamma` slots: prev_0 = anchor; m_k = markov_embed[prev_k] [B, R] in `dt`; logits_k = base[:, k] +
    m_k · markov_headᵀ (fp32); d_k = draw(k, logits_k); c_k = confidence_proj · [x_k ; m_k] (raw, fp32);
    prev_{k+1} = d_k. base fp32 [B, G, V] (the block's vocab logits), x [B, G, D] (the un-normed collapse the
    logits came from), anchor int32 [B]; markov_embed / markov_head [V, R], confidence_proj [1, D + R].
    Returns `propose`'s dict."""
    prev = anchor
    toks, probs, logits, conf = [], [], [], []
    for k in range(gamma):
        m = markov_embed[prev].astype(dt)  # [B, R]
        lg = base[:, k] + linear.f32(m, markov_head, cfg)
        tok, q = draw(k, lg)
        xm = jnp.concatenate([x[:, k], m], axis=-1)
        if detach_confidence:
            xm = jax.lax.stop_gradient(xm)
        c = linear.f32(xm, confidence_proj, cfg)
        toks.append(tok.astype(jnp.int32))
        probs.append(q)
        logits.append(lg)
        conf.append(c[:, 0])
        prev = tok.astype(jnp.int32)
    return {"tokens": jnp.stack(toks, 1), "probs": jnp.stack(probs, 1), "logits": jnp.stack(logits, 1),
            "confidence": jnp.stack(conf, 1)}
