"""The DSpark speculative step: propose, verify over γ+1 tokens, commit the accepted prefix (docs/design/spec.md §7).

`speculative_step(params, state, batch, tensors, step_counter) -> (tokens [B, γ+1], n_accept [B], state)`
is pure and jitted once per (cfg, ccfg, γ, batch size, greedy-or-sampled) — the accept lengths are
values, never shapes, so steps with different accept lengths reuse one compiled program.

Per active row (anchor a at position start = s + 1, the cache holding positions 0..s):
1. `dspark.propose` drafts d_0..d_{γ−1} from the row's DSpark rings (q = the distribution each d_k
   was drawn from: the request's penalties — counting the drafts before it —, min_tokens,
   temperature and top-k / top-p / min-p, through `sampling.processed_probs`; its own random stream,
   ``step_keys(..., salt=DRAFT_SALT)``);
2. the target runs [a, d_0..d_{γ−1}] at start..start+γ as one chunk (`decode.extend_uncommitted`, with
   restore data): logits [B, γ+1, V];
3. `sampling.greedy_verify` (no `tensors`: every row greedy, no penalties) or `sampling.spec_verify`
   (mixed greedy / chain speculative sampling with the same processing applied to p): n_accept and
   the committed tokens [d_0..d_{n−1}, bonus], −1 padded;
4. `decode.commit` keeps the first n_accept + 1 chunk tokens (a, d_0..d_{n−1}) of the target cache,
   and `dspark.write_rings` writes their draft KV. The bonus is the next step's anchor.

The host side (the runner) must, per active row: allocate pages for start + γ + 1 tokens before the
step (the verify chunk's compressed groups are written to the row's own pages, read by the chunk's
queries, and put back if rejected; two rows must never share a page) and `PageAllocator.truncate` to
start + n_accept + 1 after it; add the committed tokens to the sampling counts
(`sampling.update_counts(tensors, tokens)`); advance step_counter by n_accept + 1.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from dsv41_jax.model import decode, dspark
from dsv41_jax.parallel.plan import MeshPlan
from dsv41_jax.serving import sampling

DRAFT_SALT = 0x44535041  # "DSPA": the draft's random stream, apart from the verifier's


def sampling_draw(tensors, step_counter, deterministic: bool = False):
    """A `dspark.propose` draw for the request's sampling parameters (``deterministic``: the sampler's
    fp64 sums, `sampling` module doc).

    Slot k is the request's token step_counter + k: q_k = `processed_probs` with the penalty counts
    including d_0..d_{k−1} (as `target_verify_logits` counts them for p), greedy rows take its argmax,
    others draw from it with ``step_keys(tensors, step_counter + k, salt=DRAFT_SALT)``.
    """
    t = {"cur": tensors}
    step_counter = jnp.asarray(step_counter, jnp.int32)

    def draw(k, logits):
        cur = t["cur"]
        q = sampling.processed_probs(logits, cur, step_counter + k, deterministic=deterministic)
        keys = sampling.step_keys(cur, step_counter + k, salt=DRAFT_SALT)
        drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
        greedy = cur.temperature < sampling.SAMPLING_EPS
        tok = jnp.where(greedy, jnp.argmax(q, axis=-1).astype(jnp.int32), drawn)
        t["cur"] = sampling.update_counts(cur, tok)
        return tok, q

    return draw


def force_drafts(d, q, forced_draft, vocab_size: int):
    """Drafts d int32 [B, γ] / their distributions q [B, γ, V] with the host-fixed ones of ``forced_draft`` (None,
    or int32 [B, γ], −1 keeping the draft's own) put in: q one-hot there."""
    if forced_draft is None:
        return d, q
    forced = jnp.asarray(forced_draft, jnp.int32)
    keep = forced < 0  # −1: keep the draft's own proposal
    q = jnp.where(keep[..., None], q, jax.nn.one_hot(forced, vocab_size, dtype=jnp.float32))
    return jnp.where(keep, d, forced), q


def verify_drafts(d, q, logits, allowed, tensors, step_counter, det: bool):
    """(n_accept int32 [B], tokens int32 [B, γ+1], the masked logits) of drafts d / q against the verify logits
    [B, γ+1, V]: masked by ``allowed`` (None: all), then `sampling.greedy_verify` (``tensors`` None) or
    `sampling.spec_verify`."""
    if allowed is not None:
        logits = jnp.where(jnp.asarray(allowed, bool), logits, -jnp.inf)
    if tensors is None:
        return (*sampling.greedy_verify(d, logits), logits)
    return (*sampling.spec_verify(d, q, logits, tensors, step_counter, deterministic=det), logits)


def speculative_step(params, state, batch, tensors=None, step_counter=None, forced_draft=None, *, cfg, ccfg,
                     gamma: Optional[int] = None, accept_override=None, allowed=None, mesh=None):
    """One DSpark step for B rows (see the module docstring).

    state: the cache pytree with ``"dspark"`` rings (`dspark.with_rings`); batch: {anchor int32 [B] (the
    request's last generated token, not yet in the cache), start int32 [B] (its position: tokens in the
    cache), slot int32 [B], page_table int32 [B, P] (covering start + γ + 1 tokens), active bool [B]}
    (`speculator.DSparkSpeculator.batch`).
    tensors: `sampling.SamplingTensors` of the B rows and step_counter int32 [B] (tokens each request
    has generated, the anchor included), or None for all-greedy rows without penalties.
    forced_draft: int32 [B, γ] or None — drafts the host fixed, replacing the draft's proposals where
    >= 0 (q one-hot there; −1 keeps the draft's own); the draft still runs. The engine passes a
    constrained row's grammar-walked drafts here (`speculator.DSparkSpeculator.grammar_masks`).
    accept_override: int32 [B] or None — the simulated-accept-length knob (performance runs only):
    where >= 0, the row commits min(override, γ) drafts *unverified* plus the target's argmax after
    them as the bonus, whatever the verifier decided (−1: verify as usual). The cache stays
    consistent with the committed tokens; the text is meaningless.
    allowed: bool [B, γ+1, V] or None — constrained decoding: verify row j's logits are masked to the
    tokens the request's grammar allows after d_0..d_{j−1} (the host walked the grammar through the
    drafts; rows after the first draft it rejects are all True and never reached: that draft has
    probability 0 under the masked target, so verification rejects it and the bonus is drawn from the
    masked distribution — lossless for greedy and sampled rows).
    mesh: a `jax.sharding.Mesh` or a `MeshPlan` (None: one device): the verify forward runs as
    `decode.extend` on the mesh (MoE, row-split tables); the draft's small stages run on their parameters'
    shardings as the compiler splits them; the new state is held to the cache's shardings
    (`rules.constrain_state`) — except inside one dp rank's program (``mesh.in_rank``, `MeshPlan.rank_step`:
    its state is the rank's block, reassembled over "dp" by the rank step).
    Returns (tokens int32 [B, γ+1]: the n_accept + 1 committed tokens then −1; n_accept int32 [B];
    the new state). Inactive rows: tokens −1, n_accept 0, nothing written.
    """
    gamma = cfg.dspark_block_size if gamma is None else int(gamma)
    anchor, start, slot, active = batch["anchor"], batch["start"], batch["slot"], batch["active"]
    det = bool(cfg.deterministic)  # the sampler's fp64 sums (--enable-deterministic-inference)
    draw = dspark.greedy_draw if tensors is None else sampling_draw(tensors, step_counter, det)
    prop = dspark.propose(params, state["dspark"], anchor, start, slot, cfg, ccfg, gamma, draw)
    d, q = prop["tokens"], prop["probs"]
    d, q = force_drafts(d, q, forced_draft, cfg.vocab_size)
    vb = {"tokens": jnp.concatenate([anchor[:, None].astype(jnp.int32), d], axis=1), "start": start,
          "n_new": jnp.where(active, gamma + 1, 0).astype(jnp.int32), "slot": slot,
          "page_table": batch["page_table"]}
    par = MeshPlan.of(mesh)
    logits, st, pend, aux = decode.extend_uncommitted(params, state, vb, cfg, ccfg, all_logits=True, restore=True,
                                                      par=par)
    n_acc, toks, logits = verify_drafts(d, q, logits, allowed, tensors, step_counter, det)
    if accept_override is not None:
        ov = jnp.asarray(accept_override, jnp.int32)
        n_f = jnp.clip(ov, 0, gamma)
        bonus = jnp.argmax(jnp.take_along_axis(logits, n_f[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)
        j = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
        d_pad = jnp.concatenate([d, jnp.zeros_like(d[:, :1])], axis=1)
        toks_f = jnp.where(j < n_f[:, None], d_pad, jnp.where(j == n_f[:, None], bonus[:, None], -1))
        forced_acc = ov >= 0
        n_acc = jnp.where(forced_acc, n_f, n_acc)
        toks = jnp.where(forced_acc[:, None], toks_f, toks)
    n_acc = jnp.where(active, n_acc, 0).astype(jnp.int32)
    toks = jnp.where(active[:, None], toks, -1)
    n_commit = jnp.where(active, n_acc + 1, 0).astype(jnp.int32)
    new_state = decode.commit(st, pend, vb, n_commit, cfg)
    new_state["dspark"] = dspark.write_rings(params, state["dspark"], aux["layer_inputs"], slot, pend.positions,
                                             n_commit, cfg, ccfg)
    if par is not None and not par.in_rank:
        from dsv41_jax.parallel import rules

        new_state = rules.constrain_state(new_state, par.mesh)
    return toks, n_acc, new_state


def jitted_extend_seeding(cfg, ccfg, all_logits: bool = False, mesh=None):
    """`dspark.extend_seeding` jitted (cache donated): prefill chunks and plain steps with DSpark on.
    On a mesh the new state is held to the cache's shardings (`rules.constrain_state`); on a data-parallel
    mesh the step runs as one program per dp rank (`MeshPlan.rank_step`, as `decode.jitted_extend`)."""
    return _jitted_extend_seeding(cfg, ccfg, bool(all_logits), mesh)


@functools.lru_cache(maxsize=None)
def _jitted_extend_seeding(cfg, ccfg, all_logits, mesh):
    par = MeshPlan.of(mesh)
    seeding = functools.partial(dspark.extend_seeding, cfg=cfg, all_logits=all_logits)
    if par is not None and par.axis_size("dp") > 1:
        return jax.jit(par.rank_step(seeding, cfg, ccfg), donate_argnums=(1,))
    fn = functools.partial(seeding, ccfg=ccfg, par=par)
    if mesh is not None:
        from dsv41_jax.parallel import rules

        inner = fn

        def fn(params, state, batch):
            logits, st = inner(params, state, batch)
            return logits, rules.constrain_state(st, par.mesh)
    return jax.jit(fn, donate_argnums=(1,))
