"""Model-level greedy decoding for DeepSeek-V4, plain and with MTP or DSpark speculation (one request, host loop).

`greedy` is the reference: the prompt as one chunk of `v4.decode.extend`, then one token per step. `greedy_mtp`
drafts γ tokens with the MTP layer (`v4.mtp`) and verifies them in one target step; in the exact mode its output
equals `greedy`'s token for token (tests/test_v4_mtp.py), because every logit the target computes is the
forward's whatever the chunking (`v4.decode`), and a draft token is kept only where it is the target's argmax.

One speculative step, s = tokens in the target cache, y = the last token chosen (not yet cached):
  1. drafts d_1..d_γ: d_1 from the MTP cache's last row (already computed), d_{j+1} = the MTP layer on (its own
     output streams of d_j's row, d_j) at the next position, on a throw-away copy of its cache;
  2. verify: the target on [y, d_1..d_γ] at s..s+γ; k = the longest prefix with argmax(row j) == d_{j+1}; the
     new tokens are d_1..d_k and the bonus argmax(row k);
  3. commit [y, d_1..d_k]: the verify state itself when k = γ, else the same step re-run from the state before
     it with n_new = k + 1 (JAX states are values: the verify step's writes past the accepted prefix are simply
     dropped — the engine-side alternative is an uncommitted / commit split like V4.1's
     `decode.extend_uncommitted` / `decode.commit`, not written for V4);
  4. the MTP layer catches up on the committed rows: (target streams of row p, t_{p+1}) for p = s..s+k, and
     its last row's argmax is the next d_1.
Chunks are padded to γ + 1 tokens so a run compiles three step shapes (prompt, γ + 1, 1).

`greedy_dspark` is the same loop with the DSpark head of Flash-0731 / Pro-0813 (`v4.dspark`): the γ drafts come
from one block proposal on the rings (`v4.dspark.propose`, anchor y at position s), the target steps are
`v4.dspark.extend_seeding` (they write the rings of the tokens they commit), and there is no catch-up pass.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import numpy as np

from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4 import dspark as dspark4
from dsv41_jax.model.v4 import mtp


def _batch(tokens, start: int, n: int, T: int, page_table) -> dict:
    chunk = np.zeros((1, T), np.int32)
    chunk[0, :n] = tokens[:n]
    return {"tokens": chunk, "start": np.array([start], np.int32), "n_new": np.array([n], np.int32),
            "slot": np.zeros((1,), np.int32), "page_table": page_table}


def _setup(prompt, max_new: int, cfg, ccfg):
    if not len(prompt):
        raise ValueError("greedy: the prompt needs at least one token")
    if max_new < 1:
        raise ValueError(f"greedy: max_new_tokens must be >= 1, got {max_new}")
    P = ccfg.max_pages_per_seq
    if len(prompt) + max_new + 1 > P * ccfg.page_size or P + 1 > ccfg.num_pages:
        raise ValueError(f"greedy: {len(prompt)} + {max_new} tokens do not fit one sequence of the cache "
                         f"({P} pages of {ccfg.page_size}, {ccfg.num_pages} pages)")
    return (np.arange(P, dtype=np.int32) + 1)[None, :]


# one jitted target step and one MTP step for every call (compiled once per shape and config)
_STEP = jax.jit(dec4.extend, static_argnames=("cfg", "ccfg", "return_aux", "par"))
_MTP_STEP = jax.jit(mtp.extend, static_argnames=("cfg", "ccfg", "par"))
_SEED_STEP = jax.jit(dspark4.extend_seeding, static_argnames=("cfg", "ccfg", "all_logits", "par"))
_PROPOSE = jax.jit(dspark4.propose, static_argnames=("cfg", "ccfg", "gamma", "par"))


def _accepted(choice, drafts: list, gamma: int, stats: dict) -> int:
    """k: how many of the γ leading drafts the target's greedy choices [γ + 1] confirm (counted into `stats`)."""
    k = 0
    while k < gamma and int(choice[k]) == drafts[k]:
        k += 1
    stats["steps"] += 1
    stats["accepted"] += k
    return k


def greedy(params, prompt, max_new_tokens: int, cfg, ccfg, par=None) -> list:
    """Plain greedy decoding of one prompt (a list of token ids): the `max_new_tokens` tokens chosen. par: a tp x ep
    mesh plan, the params placed by `parallel.rules.shard_params` (`v4.decode`)."""
    pt = _setup(prompt, max_new_tokens, cfg, ccfg)
    step = functools.partial(_STEP, par=par)
    state = dec4.init_state(cfg, ccfg)
    logits, state = step(params, state, _batch(prompt, 0, len(prompt), len(prompt), pt), cfg, ccfg)
    out = [int(np.argmax(np.asarray(logits)[0, len(prompt) - 1]))]
    while len(out) < max_new_tokens:
        pos = len(prompt) + len(out) - 1
        logits, state = step(params, state, _batch(out[-1:], pos, 1, 1, pt), cfg, ccfg)
        out.append(int(np.argmax(np.asarray(logits)[0, 0])))
    return out


def greedy_mtp(params, prompt, max_new_tokens: int, cfg, ccfg, gamma: int = 2,
               propose: Optional[Callable] = None, par=None) -> tuple:
    """Greedy decoding of one prompt with MTP speculation (module doc). gamma: draft tokens per step (>= 1).
    propose(tokens so far, mtp drafts [γ]) -> the γ tokens to verify (default: the MTP drafts; tests pass an
    oracle to exercise full and partial acceptance); par: as `greedy`'s. Returns (the `max_new_tokens` tokens, {"steps": target
    verify steps, "accepted": draft tokens kept})."""
    mtp.require(params, cfg)
    if gamma < 1:
        raise ValueError(f"greedy_mtp: gamma must be >= 1, got {gamma}")
    pt = _setup(prompt, max_new_tokens + gamma, cfg, ccfg)
    step, mstep = functools.partial(_STEP, par=par), functools.partial(_MTP_STEP, par=par)
    G = gamma + 1
    state, mstate = dec4.init_state(cfg, ccfg), mtp.init_state(cfg, ccfg)
    n0 = len(prompt)
    logits, state, aux = step(params, state, _batch(prompt, 0, n0, n0, pt), cfg, ccfg, return_aux=True)
    out = [int(np.argmax(np.asarray(logits)[0, n0 - 1]))]
    # the MTP layer over the prompt: row p reads (h_p, t_{p+1}), the last row's t_{p+1} being the token just chosen
    mlog, mstate, mh = mstep(params, mstate, aux["streams"], _batch(list(prompt[1:]) + out, 0, n0, n0, pt), cfg, ccfg)
    d1, dh = int(np.argmax(np.asarray(mlog)[0, n0 - 1])), mh[:, n0 - 1:n0]
    stats = {"steps": 0, "accepted": 0}
    while len(out) < max_new_tokens:
        s = n0 + len(out) - 1  # tokens in the target cache; out[-1] goes at position s
        drafts, tmp, h, d = [d1], mstate, dh, d1
        for j in range(1, gamma):  # row s + j - 1 reads d_j; on a throw-away copy of the MTP cache
            lg, tmp, h = mstep(params, tmp, h, _batch([d], s + j - 1, 1, 1, pt), cfg, ccfg)
            d = int(np.argmax(np.asarray(lg)[0, 0]))
            drafts.append(d)
        if propose is not None:
            drafts = [int(t) for t in propose(list(out), list(drafts))]
        vlog, vstate, vaux = step(params, state, _batch([out[-1]] + drafts, s, G, G, pt), cfg, ccfg, return_aux=True)
        choice = np.argmax(np.asarray(vlog)[0], axis=-1)
        k = _accepted(choice, drafts, gamma, stats)
        committed = [out[-1]] + drafts[:k]
        new = drafts[:k] + [int(choice[k])]
        if k < gamma:
            _, vstate, vaux = step(params, state, _batch(committed, s, k + 1, G, pt), cfg, ccfg, return_aux=True)
        state = vstate
        out.extend(new)
        mlog, mstate, mh = mstep(params, mstate, vaux["streams"], _batch(new, s, k + 1, G, pt), cfg, ccfg)
        d1, dh = int(np.argmax(np.asarray(mlog)[0, k])), mh[:, k:k + 1]
    return out[:max_new_tokens], stats


def greedy_dspark(params, prompt, max_new_tokens: int, cfg, ccfg, gamma: Optional[int] = None,
                  propose: Optional[Callable] = None, par=None) -> tuple:
    """Greedy decoding of one prompt with DSpark speculation (module doc). gamma: drafts per step, 1..dspark_block_size
    (default the block size). propose(tokens so far, DSpark drafts [γ]) -> the γ tokens to verify (default the
    drafts; tests pass an oracle); par: as `greedy`'s. Returns (the `max_new_tokens` tokens, {"steps", "accepted"})
    as `greedy_mtp`."""
    dspark4.require(params, cfg)
    gamma = cfg.dspark_block_size if gamma is None else int(gamma)
    if not 1 <= gamma <= cfg.dspark_block_size:
        raise ValueError(f"greedy_dspark: gamma must be in 1..dspark_block_size={cfg.dspark_block_size}, got {gamma}")
    pt = _setup(prompt, max_new_tokens + gamma, cfg, ccfg)
    G, n0 = gamma + 1, len(prompt)
    zero = np.zeros((1,), np.int32)
    seed, prop_fn = functools.partial(_SEED_STEP, par=par), functools.partial(_PROPOSE, par=par)
    state = dspark4.with_rings(dec4.init_state(cfg, ccfg), cfg, ccfg)
    logits, state = seed(params, state, _batch(prompt, 0, n0, n0, pt), cfg, ccfg)
    out = [int(np.argmax(np.asarray(logits)[0]))]
    stats = {"steps": 0, "accepted": 0}
    while len(out) < max_new_tokens:
        s = n0 + len(out) - 1  # tokens in the target cache (and its rings); out[-1] goes at position s
        prop = prop_fn(params, state["dspark"], np.array([out[-1]], np.int32), np.array([s], np.int32), zero, cfg,
                        ccfg, gamma=gamma)
        drafts = [int(t) for t in np.asarray(prop["tokens"])[0]]
        if propose is not None:
            drafts = [int(t) for t in propose(list(out), list(drafts))]
        vlog, vstate = seed(params, state, _batch([out[-1]] + drafts, s, G, G, pt), cfg, ccfg, all_logits=True)
        choice = np.argmax(np.asarray(vlog)[0], axis=-1)
        k = _accepted(choice, drafts, gamma, stats)
        if k < gamma:  # commit [y, d_1..d_k] only: the step re-run from the state before it
            _, vstate = seed(params, state, _batch([out[-1]] + drafts[:k], s, k + 1, G, pt), cfg, ccfg,
                             all_logits=True)
        state = vstate
        out.extend(drafts[:k] + [int(choice[k])])
    return out[:max_new_tokens], stats
