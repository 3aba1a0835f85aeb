"""Training the DSpark draft (the 3 stages ``params["mtp"]``) on a frozen target (scripts/train_nano_dspark.py).

Distillation from the target's greedy outputs, teacher-forced over whole training rows (`data.pack`
rows: tokens / targets / mask):

1. The frozen target runs the row once (`transformer.forward(..., return_aux=True)`): its greedy
   token after every position (argmax of the teacher-forced logits) and the states entering
   dspark_target_layer_ids (``layer_inputs``), from which the draft's per-stage ring codes are built
   exactly as serving writes them (`dspark.target_features`, `dspark.ring_codes`).
2. Every anchor position t of a row is one batch element of `dspark.propose` itself (the draft
   math exists once): its ring row holds, at entry i, the codes of the latest position ≡ i (mod W)
   <= s = t − 1 (what serving's ring holds after committing 0..t−1, `anchor_rings`), the anchor is
   the row's token at t (start = t), and the Markov chain is teacher-forced: a `draw` callback returns
   the label of each block slot, so prev_{k+1} = label_k.
3. Labels: block slot k of the anchor at t predicts the target's greedy token at position t + k + 1
   given the true prefix, argmax(logits[t + k]). Weights: the anchor must be a token serving would
   anchor on — a generated token that is not the last one, i.e. t and t − 1 both inside the
   completion mask (the first completion token comes from the prefill, which only seeds the rings) —
   and slot k counts while position t + k + 1 is still a completion token (mask[t + k]).
4. Loss: cross entropy of the draft logits (after the Markov term) against the labels, plus
   ``conf_weight`` × the binary cross entropy of the confidence head's raw c_k against "the draft's
   argmax equals the label" (its input stop-gradient-ed: that loss trains the head alone).

The rings are built in the "float32" ring codec (`cache.encode("win", "float32")`): the same fp8
fake-quantized values as the serving fp8 codes, held unpacked, with the straight-through derivative
of `quant.fake_quant_fp8`, so each stage's wkv / kv_norm and main_proj / main_norm get a gradient
(the fp8 codes' cast would round the cotangent itself to e4m3).

Trainable: the ``mtp`` leaves only (stage weights, Markov head, confidence head, main_proj /
main_norm) as fp32 masters (`trainer.to_master`), minus the frozen kinds `trainer` freezes (scales, the
gates' balancing biases, the bf16 ``wo_a`` copy). The target, the shared embedding and LM head are
frozen (the target pass runs outside the gradient).

Metrics (teacher-forced): ``loss``, ``draft_loss``, ``conf_loss``, ``agree_k`` (top-1 agreement of
block slot k with its label), ``accept_len`` (the expected accept length of greedy verification:
1 + the number of leading slots that all agree, per anchor — exact for greedy serving along the
target's own greedy text, since while the draft agrees its Markov inputs are its own draws),
``accept_len_max`` (the ceiling the completions' lengths allow), ``conf_acc`` and ``anchor_coverage``
(the fraction of the rows' serving anchors inside the `n_anchors` window).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import dspark
from dsv41_jax.model.numerics import act_dtype
from dsv41_jax.model.transformer import forward
from dsv41_jax.training import trainer

RING_MODE = "float32"  # the ring codec training uses (see the module docstring)

Anchors = Union[None, int, Sequence[Optional[int]]]


# ----------------------------------------------------------------------------------- parameters


def is_trainable(names: tuple) -> bool:
    """Whether the leaf at `names` is a trained draft master: under ``mtp``, not a frozen kind."""
    return names[0] == "mtp" and names[-1] not in trainer._FROZEN_KEYS


def split(params: dict) -> tuple[dict, dict]:
    """(trainable draft leaves {path string: array}, the whole tree) — `trainer.split`'s format, so
    `trainer.merge` puts them back."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = trainer._path_names(path)
        if is_trainable(names):
            flat[".".join(names)] = leaf
    return flat, params


# ----------------------------------------------------------------------------------- anchors, rings, labels


def anchor_positions(mask, n_anchors: Optional[int] = None):
    """Anchor positions int32 [B, A] and their weights float32 [B, A] for rows with completion mask
    float32 [B, T] (`data.pack`: mask[t] = 1 iff token t + 1 is a completion token).

    A serving anchor is a generated token that is not the row's last one: t with mask[t − 1] and
    mask[t] both 1 (weight 1, else 0). n_anchors None: every position 0..T−1 (A = T); else the A
    positions from the row's first serving anchor on (clipped to T − 1, weight 0 past the row).
    """
    mask = jnp.asarray(mask, jnp.float32)
    B, T = mask.shape
    prev = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), mask[:, :-1]], axis=1)
    serving = mask * prev  # [B, T]
    if n_anchors is None:
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), serving
    A = int(n_anchors)
    first = jnp.argmax(serving > 0, axis=1).astype(jnp.int32)  # 0 for a row without any (weights 0 then)
    raw = first[:, None] + jnp.arange(A, dtype=jnp.int32)[None, :]
    pos = jnp.minimum(raw, T - 1)
    w = jnp.take_along_axis(serving, pos, axis=1) * (raw <= T - 1)
    return pos, w


def anchor_rings(codes: dict, anchor_pos, window: int) -> dict:
    """A ring store with one row per anchor: codes {name: [B, T, ...]} (a stage's `ring_codes` of the
    whole rows), anchor_pos int32 [B, A] -> {name: [B·A, W, ...]} whose row (b, a), entry i holds
    position s − ((s − i) mod W) of row b, s = anchor_pos − 1: the latest position ≡ i (mod W) <= s,
    as serving's ring after committing 0..s (entries < 0 are masked by the draft's attention; the
    gather clamps them to position 0)."""
    B, A = anchor_pos.shape
    s = (anchor_pos - 1)[..., None]
    ring_pos = s - jnp.mod(s - jnp.arange(window, dtype=jnp.int32), window)  # [B, A, W]
    idx = jnp.maximum(ring_pos, 0).reshape(B, A * window)

    def one(c):
        g = jnp.take_along_axis(c, idx.reshape((B, A * window) + (1,) * (c.ndim - 2)), axis=1)
        return g.reshape((B * A, window) + c.shape[2:])

    return {k: one(v) for k, v in codes.items()}


def block_labels(greedy, mask, anchor_pos, anchor_w, block: int):
    """Labels int32 [B, A, G] (slot k: greedy[t + k], the target's greedy token at position t + k + 1)
    and slot weights float32 [B, A, G] (anchor weight × mask[t + k], 0 past the row)."""
    T = greedy.shape[1]
    idx = anchor_pos[..., None] + jnp.arange(block, dtype=jnp.int32)  # [B, A, G]
    B, A, G = idx.shape
    flat = jnp.minimum(idx, T - 1).reshape(B, A * G)
    labels = jnp.take_along_axis(greedy, flat, axis=1).reshape(B, A, G).astype(jnp.int32)
    m = jnp.take_along_axis(jnp.asarray(mask, jnp.float32), flat, axis=1).reshape(B, A, G)
    return labels, anchor_w[..., None] * m * (idx <= T - 1)


# ----------------------------------------------------------------------------------- forward


def target_pass(params, tokens, cfg) -> dict:
    """The frozen target over whole rows: {"greedy" int32 [B, T] (argmax of the logits at each
    position), "layer_inputs" {layer id: [B, T, n, D]} for dspark_target_layer_ids}, gradient-free."""
    logits, aux = forward(params, tokens, cfg, return_aux=True)
    feats = {lid: aux["layer_inputs"][lid] for lid in cfg.dspark_target_layer_ids}
    return jax.lax.stop_gradient({"greedy": jnp.argmax(logits, axis=-1).astype(jnp.int32), "layer_inputs": feats})


def teacher_forced_draft(params, layer_inputs: dict, tokens, anchor_pos, labels, cfg, *,
                         detach_confidence: bool = True) -> dict:
    """The draft's block for every anchor at once, teacher-forced, through `dspark.propose`.

    params: the whole tree (its ``mtp`` stages, embedding, head); layer_inputs: `target_pass`'s;
    tokens int32 [B, T] (the rows); anchor_pos int32 [B, A]; labels int32 [B, A, G] (the tokens the
    Markov chain is forced to: prev_0 = the anchor, prev_{k+1} = labels[..., k]), G = dspark_block_size.
    Returns {"logits" fp32 [B, A, G, V] (after the Markov term), "confidence" fp32 [B, A, G] (raw)} —
    for anchor (b, a) exactly what `propose` returns for anchor tokens[b, t] at start t (t =
    anchor_pos[b, a]) from a ring holding positions 0..t−1 of row b, with a draw returning the labels.
    """
    dt = act_dtype(cfg)
    tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    A, G = anchor_pos.shape[1], cfg.dspark_block_size
    N = B * A
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    main_x = dspark.target_features(params, layer_inputs, cfg, dt)
    codes = dspark.ring_codes(params, main_x, positions, cfg, RING_MODE, dt)
    rings = [anchor_rings(c, anchor_pos, cfg.sliding_window) for c in codes]
    ccfg = kvc.CacheConfig(max_slots=N, kv_cache_dtype=RING_MODE)  # propose reads only the ring codec
    forced = labels.reshape(N, G)

    def draw(k, logits):
        return forced[:, k], jax.nn.one_hot(forced[:, k], logits.shape[-1], dtype=jnp.float32)

    out = dspark.propose(params, rings, jnp.take_along_axis(tokens, anchor_pos, axis=1).reshape(N),
                         anchor_pos.reshape(N), jnp.arange(N, dtype=jnp.int32), cfg, ccfg, G, draw,
                         detach_confidence=detach_confidence)
    return {"logits": out["logits"].reshape(B, A, G, -1), "confidence": out["confidence"].reshape(B, A, G)}


# ----------------------------------------------------------------------------------- loss, steps


def _parts(batch) -> tuple:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def _anchor_list(n_anchors: Anchors, n: int) -> tuple:
    if n_anchors is None or isinstance(n_anchors, int):
        return (n_anchors,) * n
    out = tuple(n_anchors)
    if len(out) != n:
        raise ValueError(f"n_anchors: {len(out)} values for {n} row batches")
    return out


def loss_and_metrics(train: dict, params: dict, batch, targets, cfg, n_anchors: Anchors = None,
                     conf_weight: float = 0.1):
    """Distillation loss of the draft (module docstring) over one or several row batches.

    train: the draft's trainable leaves (`split`); params: the whole tree; batch: a `data.pack` batch
    or a tuple of them (row buckets); targets: `target_pass` of each; n_anchors: None (every
    position), an int, or one per row batch (`anchor_positions`). Returns (loss, metrics)."""
    full = trainer.merge(train, params)
    parts = _parts(batch)
    G = cfg.dspark_block_size
    tot = {"nll": 0.0, "bce": 0.0, "w": 0.0, "agree": jnp.zeros((G,)), "wk": jnp.zeros((G,)), "acc_len": 0.0,
           "acc_max": 0.0, "anchors": 0.0, "conf_hit": 0.0, "serving": 0.0}
    for b, tgt, A in zip(parts, targets, _anchor_list(n_anchors, len(parts))):
        pos, aw = anchor_positions(b["mask"], A)
        labels, w = block_labels(tgt["greedy"], b["mask"], pos, aw, G)
        out = teacher_forced_draft(full, tgt["layer_inputs"], b["tokens"], pos, labels, cfg)
        logp = jax.nn.log_softmax(out["logits"], axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        agree = (jnp.argmax(out["logits"], axis=-1) == labels).astype(jnp.float32)
        bce = optax.sigmoid_binary_cross_entropy(out["confidence"], agree)
        valid = (w > 0).astype(jnp.float32)
        tot["nll"] += (nll * w).sum()
        tot["bce"] += (bce * w).sum()
        tot["w"] += w.sum()
        tot["agree"] += (agree * w).sum(axis=(0, 1))
        tot["wk"] += w.sum(axis=(0, 1))
        tot["acc_len"] += ((1.0 + jnp.cumprod(agree * valid, axis=-1).sum(-1)) * aw).sum()
        tot["acc_max"] += ((1.0 + jnp.cumprod(valid, axis=-1).sum(-1)) * aw).sum()
        tot["anchors"] += aw.sum()
        tot["conf_hit"] += (((out["confidence"] > 0).astype(jnp.float32) == agree) * w).sum()
        tot["serving"] += anchor_positions(b["mask"], None)[1].sum()
    n = jnp.maximum(tot["w"], 1.0)
    na = jnp.maximum(tot["anchors"], 1.0)
    draft_loss, conf_loss = tot["nll"] / n, tot["bce"] / n
    loss = draft_loss + conf_weight * conf_loss
    m = {"loss": loss, "draft_loss": draft_loss, "conf_loss": conf_loss, "accept_len": tot["acc_len"] / na,
         "accept_len_max": tot["acc_max"] / na, "conf_acc": tot["conf_hit"] / n,
         "anchor_coverage": tot["anchors"] / jnp.maximum(tot["serving"], 1.0)}
    agree_k = tot["agree"] / jnp.maximum(tot["wk"], 1.0)
    for k in range(G):
        m[f"agree_{k}"] = agree_k[k]
    return loss, m


def make_train_step(cfg, opt: optax.GradientTransformation, n_anchors: Anchors = None,
                    conf_weight: float = 0.1) -> Callable:
    """jit((train, opt_state, params, batch) -> (train, opt_state, metrics)): one optimizer step of the
    draft's leaves (`split`); `params` is the whole master tree (the frozen target, embedding and head,
    and the draft's frozen leaves). `cfg` is the model config (run as `trainer.train_config`)."""
    tcfg = trainer.train_config(cfg)

    @jax.jit
    def step(train, opt_state, params, batch):
        targets = [target_pass(params, b["tokens"], tcfg) for b in _parts(batch)]
        (_, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
            train, params, batch, targets, tcfg, n_anchors, conf_weight)
        updates, opt_state = opt.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))
        return train, opt_state, metrics

    return step


def make_eval_step(cfg, n_anchors: Anchors = None, conf_weight: float = 0.1) -> Callable:
    """jit((train, params, batch) -> metrics), as the train step measures them, without the update."""
    tcfg = trainer.train_config(cfg)

    @jax.jit
    def ev(train, params, batch):
        targets = [target_pass(params, b["tokens"], tcfg) for b in _parts(batch)]
        return loss_and_metrics(train, params, batch, targets, tcfg, n_anchors, conf_weight)[1]

    return ev


# ----------------------------------------------------------------------------------- export


def to_release_params(train: dict, params: dict, template: dict) -> dict:
    """The target with the trained draft, in the release format: `template` (the checkpoint-format
    target the draft was trained on) with its ``mtp`` stages replaced by the trained masters,
    quantized by `trainer.to_release_params` (fp8 32×32 blocks, MXFP4 experts, bf16 / fp32 as the
    template declares). Every other leaf is the template's own, code for code (re-quantizing the
    target's dequantized masters gives the same values, but not always the same fp8 scale)."""
    sub = trainer.to_release_params(train, {"mtp": params["mtp"]}, {"mtp": template["mtp"]}, trained_mtp=True)
    return {**template, "mtp": sub["mtp"]}
