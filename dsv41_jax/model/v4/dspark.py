"""The DSpark head of DeepSeek-V4-Flash-0731 / Pro-0813 (``draft_kind`` "dspark"; docs/design/v4.md "MTP and the
DSpark head").

V4.1's block proposal (`model.dspark`: rings of target features, one bidirectional pass over [anchor, noise × (G−1)],
the Markov fix-up and the confidence head, shared through `dspark.block_attend` / `dspark.markov_block`) on V4's
layers. Parameters: ``params["mtp"][s]``, s < num_nextn_predict_layers (3 in the releases), `v4.params.dspark_decl`.
What is V4's:

* features: main_x = main_norm(main_proj(concat_L mean_streams(out_L))), out_L the **output** streams of target layer
  L ∈ dspark_target_layer_ids (the release: 40, 41, 42 of 43) — its `Transformer.forward` appends ``h.mean(dim=2)``
  after ``h = layer(h, ...)`` (V4.1's reads the state entering L); main_proj is a dense V4 weight (fp8 128×128).
* rings (`write_rings`): per stage, for every committed position p, the stage's window K=V of main_x at p —
  `v4.attention.project_kv` (its wkv, kv_norm, RoPE at rope_theta without YaRN: the stages are ratio-0 layers) —
  at slot p mod W in the activation dtype, as V4's window rings (`v4.decode`); under ``state["dspark"]``.
* stages (`propose`): V4 layers — pre-mix mHC (`v4.mhc.enter`), the attention's q with V4's per-head norm
  (`v4.attention.project_q`) over [the ring's positions <= s ∪ every block row], V4's grouped output projection;
  MoE with learned routing over the target's experts (`v4.moe.moe`, the stages are not hash-routed).
* head: the last stage's own ``hc_head_*`` collapse x (un-normed: the confidence head's input), base logits =
  head(norm(x)) with the target's vocab projection; Markov tables ``markov_w1`` (embedding) / ``markov_w2``.

`extend_seeding` is `v4.decode.extend` that also writes the rings of every token it commits; verification is the
caller's (`v4.speculative.greedy_dspark`).

On a tp x ep mesh (``par``, `parallel.plan.MeshPlan`; docs/design/v4.md "Mesh") it runs as the target and the MTP
layer do (`v4.transformer` module doc): the stages' params placed by `parallel.rules.shard_params` (``mtp.*``), the
block's embedding gathered where its rows live, the stages' MoE expert-parallel (`v4.moe.moe`), every sublayer exit
pinned replicated (`v4.transformer.sublayer_exit`), the rings replicated as the target's window rings.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from dsv41_jax.model import dspark, linear, tiling
from dsv41_jax.model.attention import sink_of
from dsv41_jax.model.decode import _window_write
from dsv41_jax.model.norm import rmsnorm
from dsv41_jax.model.numerics import act_dtype, is_exact
from dsv41_jax.model.transformer import embed_streams
from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4 import mhc as mhc4
from dsv41_jax.model.v4.attention import layer_freqs, output_proj, project_kv, project_q
from dsv41_jax.model.v4.linear import dense
from dsv41_jax.model.v4.moe import moe
from dsv41_jax.model.v4.transformer import refuse_unsupported, sublayer_exit


def require(params, cfg) -> None:
    """NotImplementedError / ValueError unless `params` hold the DSpark stages of a ``draft_kind`` "dspark" config."""
    if cfg.draft_kind != "dspark":
        raise NotImplementedError(f"DeepSeek-V4 draft_kind {cfg.draft_kind!r}: this checkpoint's draft is an MTP "
                                  "layer (`v4.mtp`), not a DSpark head")
    S = cfg.num_nextn_predict_layers
    if not params.get("mtp"):
        raise ValueError("DSpark: these parameters have no DSpark stages (a checkpoint without mtp.* tensors)")
    if len(params["mtp"]) != S:
        raise ValueError(f"DSpark: {len(params['mtp'])} stages in the parameters, the config has {S}")


def init_rings(cfg, ccfg) -> list:
    """Zeroed draft rings: one window ring [R, W, hd] (activation dtype) per stage."""
    dec4._check(cfg, ccfg)
    return [dec4.window_state(cfg, ccfg) for _ in range(cfg.num_nextn_predict_layers)]


def with_rings(state: dict, cfg, ccfg) -> dict:
    """The V4 cache pytree plus ``"dspark"`` rings. Rings need no per-request reset: a proposal reads only positions
    <= s of its own request, all written when they were committed."""
    return {**state, "dspark": init_rings(cfg, ccfg)}


def layer_outputs(aux: dict, cfg) -> dict:
    """{target layer id: its output streams [B, T, n, D]} for dspark_target_layer_ids, from a forward's / step's aux
    (the output of layer L is the input of L + 1; the last layer's is aux "streams")."""
    L = cfg.num_hidden_layers
    return {lid: aux["streams"] if lid == L - 1 else aux["layer_inputs"][lid + 1]
            for lid in cfg.dspark_target_layer_ids}


def target_features(params, outputs: dict, cfg, dt):
    """main_x [B, T, D] in `dt` from `layer_outputs` (module doc)."""
    p0 = params["mtp"][0]
    x = dense(dspark.stream_means([outputs[lid] for lid in cfg.dspark_target_layer_ids], dt), p0["main_proj"], cfg, dt)
    return rmsnorm(x, p0["main_norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg))


def write_rings(params, rings: list, outputs: dict, slot, positions, n_commit, cfg) -> list:
    """Rings after committing the first n_commit[b] tokens of each row at positions int32 [B, T] (slot int32 [B]);
    outputs: `layer_outputs` of the target step that ran those tokens."""
    dt = act_dtype(cfg)
    main_x = target_features(params, outputs, cfg, dt)
    freqs = layer_freqs(cfg, "sliding")
    return [_window_write({"v": r}, slot, positions, n_commit,
                          {"v": project_kv(sp["attn"], main_x, positions, freqs, cfg, dt)}, cfg.sliding_window)["v"]
            for r, sp in zip(rings, params["mtp"])]


def extend_seeding(params, state, batch, cfg, ccfg, all_logits: bool = False, par=None):
    """`v4.decode.extend_logits` on a cache with DSpark rings (`with_rings`): the same logits and target cache, and
    the rings of every token the batch commits written (prompt chunks and verify steps alike).
    Returns (logits — `v4.decode.head_logits`', state). par: a tp x ep mesh plan (module doc)."""
    _, st, aux = dec4.extend(params, state, batch, cfg, ccfg, return_aux=True, head=False, par=par)
    T = aux["streams"].shape[1]
    positions = batch["start"][:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    with tiling.on_mesh(par):
        st["dspark"] = write_rings(params, state["dspark"], layer_outputs(aux, cfg), batch["slot"], positions,
                                   batch["n_new"], cfg)
    return dec4.head_logits(params, aux["streams"], batch["n_new"], cfg, all_logits, par), st


def _draft_attention(p, x, ring, slot, start, positions, freqs, cfg, dt):
    """A stage's attention: x [B, K, D] the normed block at positions [B, K] over its ring's committed positions and
    the whole block (`dspark.block_attend`); the block's own K=V is never cached. Returns [B, K, D] in `dt`."""
    _, q = project_q(p, x, positions, freqs, cfg, dt)
    blk = project_kv(p, x, positions, freqs, cfg, dt)
    o = dspark.block_attend(q, ring[slot], blk, start, sink_of(p), cfg, dt)
    return output_proj(p, o, positions, freqs, cfg, dt)


def propose(params, rings: list, anchor, start, slot, cfg, ccfg, gamma: Optional[int] = None,
            draw: Callable = dspark.greedy_draw, par=None) -> dict:
    """One DSpark block proposal on V4's layers: `dspark.propose`'s contract (anchor int32 [B] at position start[b] =
    s + 1, the number of tokens in the cache; slot int32 [B]; gamma static in 1..dspark_block_size; draw(k, logits)
    -> (token, q)). Returns {"tokens" [B, γ], "probs" / "logits" fp32 [B, γ, V], "confidence" fp32 [B, γ] (raw)}.
    par: a tp x ep mesh plan (module doc)."""
    refuse_unsupported(cfg, par)
    require(params, cfg)
    dec4._check(cfg, ccfg)
    G = cfg.dspark_block_size
    gamma = G if gamma is None else int(gamma)
    if not 1 <= gamma <= G:
        raise ValueError(f"gamma: {gamma} must be in 1..dspark_block_size={G}")
    dt = act_dtype(cfg)
    anchor = jnp.asarray(anchor, jnp.int32)
    B = anchor.shape[0]
    ids = jnp.concatenate([anchor[:, None], jnp.full((B, G - 1), cfg.dspark_noise_token_id, jnp.int32)], axis=1)
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(G, dtype=jnp.int32)[None, :]
    freqs = layer_freqs(cfg, "sliding")
    with tiling.on_mesh(par):
        h = embed_streams(params, ids, cfg, dt, par)
        for sp, ring in zip(params["mtp"], rings):  # V4 layers (pre-mix mHC), the attention over ring + block
            x, post, comb = mhc4.enter(h, sp, "attn", cfg, dt)
            y = _draft_attention(sp["attn"], x, ring, slot, start, positions, freqs, cfg, dt)
            h = sublayer_exit(y, h, post, comb, cfg, dt, par)
            x, post, comb = mhc4.enter(h, sp, "ffn", cfg, dt)
            h = sublayer_exit(moe(sp["ffn"], x, ids, False, cfg, dt, par)[0], h, post, comb, cfg, dt, par)
        last = params["mtp"][-1]
        x = mhc4.head_collapse(h, last["hc_head_fn"], last["hc_head_base"], last["hc_head_scale"], cfg, dt)  # un-normed
        base = linear.f32(rmsnorm(x, last["norm"]["weight"], cfg.rms_norm_eps, dt, is_exact(cfg)),
                          params["head"]["weight"], cfg, row_axis="vocab")
        mk = last["markov_head"]
        return dspark.markov_block(base, x, anchor, mk["markov_w1"]["weight"], mk["markov_w2"]["weight"],
                                   last["confidence_head"]["proj"]["weight"], gamma, draw, cfg, dt)
