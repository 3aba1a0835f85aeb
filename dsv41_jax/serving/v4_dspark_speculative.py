"""DSpark speculation in the engine for DeepSeek-V4-Flash-0731 / Pro-0813 (``--speculative-algorithm DSPARK`` on a V4
checkpoint with a DSpark head; docs/design/v4.md).

The head is `model.v4.dspark` (V4.1's block proposal on V4's layers); it sits behind the runner's speculation seam as
V4.1's DSpark and V4's MTP do (`speculator.V4DSparkSpeculator`: the scheduler's `SpecLaunch` rows, grammar-checked
drafts, the verifiers `sampling.greedy_verify` / `spec_verify`). Per-slot state: ``state["dspark"]``, one window ring
per stage (`v4.dspark.with_rings`), forked and snapshotted with the slot as V4.1's rings.

* plain launches (`extend_seeding`): `v4.dspark.extend_seeding` — the target step, and the rings of every token it
  commits (prefill chunks included);
* a speculative launch (`speculative_step`, anchor y at position s, the cache and rings holding positions < s): one
  block proposal d_0..d_{γ−1} from the rings; the target verifies [y, d_0..d_{γ−1}] (its state dropped); the
  accepted prefix is committed by running `extend_seeding` from the state before it with n_new = k + 1 (V4 has no
  uncommitted / commit split: one extra target pass per speculative step, as MTP's), which writes its rings too.
Greedy with DSpark gives exactly the tokens of greedy without in the exact mode (tests/test_v4_dspark.py).

On a tp x ep mesh (``par`` / ``mesh``) every model call runs on it as MTP's do (`mtp_speculative` module doc: params
by the rules, the cache and the rings replicated, a launch's new state held to those shardings by
`parallel.rules.constrain_state`); tests/test_v4_dspark.py checks it against one device bit for bit.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from dsv41_jax.model.dspark import greedy_draw
from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4 import dspark as dspark4
from dsv41_jax.parallel.plan import MeshPlan
from dsv41_jax.serving.mtp_speculative import held, jitted_seeding
from dsv41_jax.serving.speculative import force_drafts, sampling_draw, verify_drafts

__all__ = ["extend_seeding", "speculative_step", "propose", "jitted_extend_seeding"]


def extend_seeding(params, state, batch, *, cfg, ccfg, all_logits: bool = False, par=None):
    """A plain launch with DSpark on: `v4.dspark.extend_seeding` (logits as `v4.decode.extend_logits`'). par: a tp x ep
    mesh plan (module doc)."""
    logits, st = dspark4.extend_seeding(params, state, batch, cfg, ccfg, all_logits, par)
    return logits, held(st, par)


def propose(params, state, batch, draw, *, cfg, ccfg, gamma: int, par=None):
    """The block proposal of a speculative launch: (d int32 [B, γ], q fp32 [B, γ, V] the distributions they were
    drawn from)."""
    prop = dspark4.propose(params, state["dspark"], jnp.asarray(batch["anchor"]), jnp.asarray(batch["start"]),
                           jnp.asarray(batch["slot"]), cfg, ccfg, gamma, draw, par)
    return prop["tokens"], prop["probs"]


def speculative_step(params, state, batch, tensors=None, step_counter=None, forced_draft=None, *, cfg, ccfg,
                     gamma: int, accept_override=None, allowed=None, mesh=None):
    """One DSpark step for B rows of a V4 model: `speculative.speculative_step`'s contract (batch {anchor, start, slot,
    page_table, active}; returns (tokens int32 [B, γ+1] −1 padded, n_accept int32 [B], state')), the module doc's
    steps. mesh: a tp x ep mesh (module doc). accept_override (the simulated accept length) is refused at start-up
    (`model_step.V4Step`)."""
    if accept_override is not None:
        raise NotImplementedError("DeepSeek-V4 DSpark speculation: no simulated accept length")
    par = MeshPlan.of(mesh)
    anchor, start, slot, active = (jnp.asarray(batch[k]) for k in ("anchor", "start", "slot", "active"))
    det = bool(cfg.deterministic)  # as V4.1's step: the sampler's fp64 sums in the deterministic mode
    draw = greedy_draw if tensors is None else sampling_draw(tensors, step_counter, det)
    d, q = propose(params, state, batch, draw, cfg=cfg, ccfg=ccfg, gamma=gamma, par=par)
    d, q = force_drafts(d, q, forced_draft, cfg.vocab_size)
    vb = {"tokens": jnp.concatenate([anchor[:, None].astype(jnp.int32), d], axis=1), "start": start,
          "n_new": jnp.where(active, gamma + 1, 0).astype(jnp.int32), "slot": slot,
          "page_table": jnp.asarray(batch["page_table"])}
    logits, _ = dec4.extend(params, state, vb, cfg, ccfg, par=par)  # verify (its state dropped)
    n_acc, toks, _ = verify_drafts(d, q, logits, allowed, tensors, step_counter, det)
    n_acc = jnp.where(active, n_acc, 0).astype(jnp.int32)
    toks = jnp.where(active[:, None], toks, -1)
    # commit [y, d_0..d_{k−1}] and their rings: the same step from the state before it, k + 1 tokens
    _, new_state = dspark4.extend_seeding(params, state, dict(vb, n_new=jnp.where(active, n_acc + 1, 0)), cfg, ccfg,
                                          par=par)
    return toks, n_acc, held(new_state, par)


def jitted_extend_seeding(cfg, ccfg, all_logits: bool = False, mesh=None):
    """`extend_seeding` jitted (cache donated), once per (cfg, ccfg, all_logits, mesh)."""
    return jitted_seeding(extend_seeding, cfg, ccfg, all_logits, mesh)
