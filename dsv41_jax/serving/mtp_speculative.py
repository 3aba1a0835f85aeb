"""MTP speculation in the engine for DeepSeek-V4 (``--speculative-algorithm EAGLE`` / ``NEXTN``; docs/design/v4.md).

The original V4 Flash / Pro checkpoints ship one MTP layer (`model.v4.mtp`); SGLang runs it as EAGLE with top-1
chains (``--speculative-num-steps γ --speculative-eagle-topk 1 --speculative-num-draft-tokens γ+1``). Here it sits
behind the runner's speculation seam exactly as DSpark does (`speculator.MTPSpeculator`: the scheduler's
`SpecLaunch` rows, grammar-checked drafts, the same verifiers `sampling.greedy_verify` / `spec_verify`).

Per-slot state (``state["mtp"]``, a per-slot row like the DSpark rings: forked and snapshotted with the slot):
``window`` [R, W, hd] the MTP layer's window ring (the released MTP layer is a sliding one) and ``h`` [R, n, D] the
target's output streams at the request's last cached position. MTP row p reads (h_p, t_{p+1}) at position p, so it
*lags* the target by one: with the target cache holding t_0..t_{s−1}, the ring holds rows 0..s−2 and ``h`` is
h_{s−1}; row s−1 waits for t_s (the sampled anchor, or the next prefill chunk's first token).

* plain launches (`extend_seeding`): the target step, then the MTP rows the chunk completes — the lagged row
  start − 1 on (``h``, the chunk's first token) and rows start .. start + n − 2 on the chunk's own streams and
  next tokens; ``h`` ← the chunk's last streams;
* a speculative launch (`speculative_step`, anchor y at position s): the lagged row s − 1 on (``h``, y) proposes
  d_1 (committed to the ring: y is committed whatever the verifier says); d_2..d_γ chain the layer's own output
  streams on a throw-away copy of the ring; the target verifies [y, d_1..d_γ]; the accepted prefix is committed
  by running the target step again from the state before it with n_new = k + 1 (V4 has no uncommitted / commit
  split: one extra target pass per speculative step, the price of exactness), then the MTP catches up on rows
  s .. s + k − 1 (target streams, d_1..d_k) and ``h`` ← h_{s+k}.
Greedy with MTP gives exactly the tokens of greedy without in the exact mode (tests/test_v4_engine.py).

On a tp x ep mesh (``par`` / ``mesh``) every model call runs on it as the plain step does (`v4.decode`: params by
the rules, the cache and this per-slot state replicated) and the state a launch returns is held to those
shardings (`parallel.rules.constrain_state`), so every launch sees the same layout (tests/test_v4_mesh.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.model import cache as kvc
from dsv41_jax.model.dspark import greedy_draw
from dsv41_jax.model.numerics import act_dtype
from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4 import mtp
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.plan import MeshPlan
from dsv41_jax.serving import sampling
from dsv41_jax.serving.speculative import force_drafts, sampling_draw, verify_drafts

__all__ = ["with_mtp_state", "extend_seeding", "speculative_step", "propose", "jitted_extend_seeding"]


def with_mtp_state(state: dict, cfg, ccfg, mesh=None) -> dict:
    """The cache with the MTP layer's per-slot state (module doc), zeroed (on `mesh`: placed by the cache's rules)."""
    R, dt = kvc.slot_rows(ccfg), act_dtype(cfg)
    m = {"window": dec4.window_state(cfg, ccfg), "h": jnp.zeros((R, cfg.hc_mult, cfg.hidden_size), dt)}
    if mesh is not None:
        m = rules.place_state({"mtp": m}, MeshPlan.of(mesh).mesh)["mtp"]
    return dict(state, mtp=m)


def held(state: dict, par) -> dict:
    """A launch's new state held to the cache's shardings on the mesh (module doc); as it is without one."""
    return state if par is None else rules.constrain_state(state, par.mesh)


def _target(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "mtp"}


def _layer(ring) -> dict:
    return {"window": [ring], "comp": {}}  # `mtp.init_state`'s layout for a sliding MTP layer


def _rows(toks, start, n, slot, pt) -> dict:
    return {"tokens": toks, "start": start, "n_new": n.astype(jnp.int32), "slot": slot, "page_table": pt}


def _set_h(h_all, slot, rows_h, keep):
    """h_all[slot[b]] ← rows_h[b] where keep[b] (others dropped)."""
    return h_all.at[jnp.where(keep, slot, h_all.shape[0])].set(rows_h.astype(h_all.dtype), mode="drop")


def extend_seeding(params, state, batch, *, cfg, ccfg, all_logits: bool = False, par=None):
    """A plain launch with MTP on: `v4.decode.extend_logits`' result, and the MTP rows it completes (module doc).
    par: a tp x ep mesh plan (module doc)."""
    tokens, start, n, slot, pt = (jnp.asarray(batch[k]) for k in ("tokens", "start", "n_new", "slot", "page_table"))
    _, tstate, aux = dec4.extend(params, _target(state), batch, cfg, ccfg, return_aux=True, head=False, par=par)
    h = aux["streams"]  # [B, T, n, D]
    logits = dec4.head_logits(params, h, n, cfg, all_logits, par)
    m = state["mtp"]
    lagged = start > 0  # row start − 1 is due (on the saved h and this chunk's first token)
    h_in = jnp.where(lagged[:, None, None, None], jnp.concatenate([m["h"][slot][:, None], h[:, :-1]], axis=1), h)
    toks = jnp.where(lagged[:, None], tokens, jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1))
    n_m = jnp.where(lagged, n, jnp.maximum(n - 1, 0))
    _, ms, _ = mtp.extend(params, _layer(m["window"]), h_in, _rows(toks, jnp.where(lagged, start - 1, 0), n_m, slot,
                                                                        pt), cfg, ccfg, head=False, par=par)
    last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None, None], axis=1)[:, 0]
    return logits, held(dict(tstate, mtp={"window": ms["window"][0], "h": _set_h(m["h"], slot, last, n > 0)}), par)


def propose(params, state, batch, draw, *, cfg, ccfg, gamma: int, par=None):
    """The MTP drafts of a speculative launch: (d int32 [B, γ], q fp32 [B, γ, V] the distributions they were drawn
    from, the MTP layer's state with the lagged row s − 1 written)."""
    anchor, start, slot, active, pt = (jnp.asarray(batch[k]) for k in ("anchor", "start", "slot", "active",
                                                                         "page_table"))
    m = state["mtp"]
    one = jnp.ones_like(start)
    lg, ms, x = mtp.extend(params, _layer(m["window"]), m["h"][slot][:, None],
                           _rows(anchor[:, None], start - 1, jnp.where(active & (start > 0), one, 0), slot, pt), cfg,
                           ccfg, par=par)
    d, q = draw(0, lg[:, 0])
    ds, qs, tmp = [d], [q], ms
    for j in range(1, gamma):  # chained on a throw-away copy of the ring
        lg, tmp, x = mtp.extend(params, tmp, x, _rows(d[:, None], start - 1 + j, jnp.where(active, one, 0), slot, pt),
                                cfg, ccfg, par=par)
        d, q = draw(j, lg[:, 0])
        ds.append(d)
        qs.append(q)
    return jnp.stack(ds, axis=1), jnp.stack(qs, axis=1), ms


def speculative_step(params, state, batch, tensors=None, step_counter=None, forced_draft=None, *, cfg, ccfg,
                     gamma: int, accept_override=None, allowed=None, mesh=None):
    """One MTP step for B rows: `speculative.speculative_step`'s contract (batch {anchor, start, slot, page_table,
    active}; returns (tokens int32 [B, γ+1] −1 padded, n_accept int32 [B], state')), the module doc's steps.
    mesh: a tp x ep mesh (module doc). accept_override (the simulated accept length) is DSpark's only (refused at
    start-up)."""
    if accept_override is not None:
        raise NotImplementedError("MTP speculation: no simulated accept length")
    par = MeshPlan.of(mesh)
    anchor, start, slot, active = (jnp.asarray(batch[k]) for k in ("anchor", "start", "slot", "active"))
    det = bool(cfg.deterministic)  # as DSpark's step: the sampler's fp64 sums in the deterministic mode
    draw = greedy_draw if tensors is None else sampling_draw(tensors, step_counter, det)
    d, q, ms = propose(params, state, batch, draw, cfg=cfg, ccfg=ccfg, gamma=gamma, par=par)
    d, q = force_drafts(d, q, forced_draft, cfg.vocab_size)
    vb = _rows(jnp.concatenate([anchor[:, None].astype(jnp.int32), d], axis=1), start,
               jnp.where(active, gamma + 1, 0), slot, jnp.asarray(batch["page_table"]))
    target = _target(state)
    logits, _ = dec4.extend(params, target, vb, cfg, ccfg, par=par)  # verify (its state dropped)
    n_acc, toks, _ = verify_drafts(d, q, logits, allowed, tensors, step_counter, det)
    n_acc = jnp.where(active, n_acc, 0).astype(jnp.int32)
    toks = jnp.where(active[:, None], toks, -1)
    # commit [y, d_1..d_k]: the same step from the state before it, k + 1 tokens
    _, tstate, aux = dec4.extend(params, target, dict(vb, n_new=jnp.where(active, n_acc + 1, 0).astype(jnp.int32)),
                                 cfg, ccfg, return_aux=True, head=False, par=par)
    h = aux["streams"]  # [B, γ+1, n, D]
    _, ms, _ = mtp.extend(params, ms, h[:, :gamma], _rows(d, start, jnp.where(active, n_acc, 0), slot, vb["page_table"]),
                          cfg, ccfg, head=False, par=par)
    last = jnp.take_along_axis(h, n_acc[:, None, None, None], axis=1)[:, 0]
    m = state["mtp"]
    return toks, n_acc, held(dict(tstate, mtp={"window": ms["window"][0], "h": _set_h(m["h"], slot, last, active)}),
                              par)


def jitted_extend_seeding(cfg, ccfg, all_logits: bool = False, mesh=None):
    """`extend_seeding` jitted (cache donated), once per (cfg, ccfg, all_logits, mesh)."""
    return jitted_seeding(extend_seeding, cfg, ccfg, all_logits, mesh)


def jitted_seeding(seeding, cfg, ccfg, all_logits: bool, mesh):
    """A V4 draft's target step that also writes the draft's state (`seeding`: this module's `extend_seeding` or
    `v4_dspark_speculative`'s) jitted with the cache donated, once per (seeding, cfg, ccfg, all_logits, mesh)."""
    return _jitted_seeding(seeding, cfg, ccfg, bool(all_logits), mesh)


@functools.lru_cache(maxsize=None)
def _jitted_seeding(seeding, cfg, ccfg, all_logits, mesh):
    fn = functools.partial(seeding, cfg=cfg, ccfg=ccfg, all_logits=all_logits, par=MeshPlan.of(mesh))
    return jax.jit(fn, donate_argnums=(1,))
