"""The drafter/verifier seam of the runner: `Speculator`, with two implementations.

- `NoSpeculation` (γ = 0): plain launches run the model family's step (`model_step`: `decode.extend`, or
  `v4.decode.extend` for DeepSeek-V4); there are no DSpark launches.
- `MTPSpeculator` (``--speculative-algorithm EAGLE`` / ``NEXTN``, DeepSeek-V4's MTP layer): DSpark's launch
  with the MTP draft (`mtp_speculative`); `V4DSparkSpeculator` (``DSPARK`` on a DeepSeek-V4 checkpoint with a
  DSpark head, Flash-0731 / Pro-0813): the same with V4's DSpark head (`v4_dspark_speculative`).
- `DSparkSpeculator` (``--speculative-algorithm DSPARK``): the cache carries the draft's rings
  (`dspark.with_rings`, placed by the cache's rules on a mesh), plain launches run
  `dspark.extend_seeding` (they also write the rings of every committed token), and a `SpecLaunch`
  runs one jitted verify-then-commit step (`_spec_launch`: draft γ tokens, verify them in one target
  forward on the mesh as the plain step, commit the accepted prefix + bonus, penalty counts and the
  bonus into ``last_token``), compiled once per batch bucket. A launch with constrained rows first
  runs the draft alone (`_propose_launch`) and walks each row's grammar through the drafts on the
  host (`grammar_masks`): those drafts are the step's ``drafts`` input and the masks its ``allowed``.

The seam is typed: `Speculator.launch(params, dev, L)` takes the runner's `messages.DeviceState` and a
`messages.SpecLaunch` and returns the new `DeviceState` and the launch's `messages.LaunchResult`; it
never writes into the runner. A DSpark launch is three steps, each production's: `batch` (the host
inputs), `grammar_masks` (the host-fixed drafts and masks of constrained rows) and `verify` (the
compiled step, whose ``drafts`` input is −1 or a host-fixed draft). Nothing test-only is in here: a
test drafter (tests/) composes the same three steps with drafts of its own. The simulated accept
length (``--speculative-simulate-accept-length``, performance runs only) compiles its own step variant
(`_spec_launch_simulated`, with the forced accept counts as an input) in place of the production one.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model import cache as kvc
from dsv41_jax.parallel import plan as mesh_plan
from dsv41_jax.serving import speculative as spec
from dsv41_jax.serving.messages import DeviceState, LaunchResult, SpecLaunch

__all__ = ["DSparkSpeculator", "MTPSpeculator", "NoSpeculation", "Speculator", "V4DSparkSpeculator"]

log = logging.getLogger("dsv41_jax.engine")


class Speculator(Protocol):
    """What the runner asks of speculative decoding (see the module docstring)."""

    gamma: int  # proposals per speculative step (0: none)

    def seed_state(self, state: dict) -> dict:
        """The cache pytree with whatever per-slot state speculation keeps (DSpark: the rings)."""

    def extend_step(self, all_logits: bool):
        """The jitted step plain launches run: ``fn(params, state, batch) -> (logits, state)``."""

    def launch(self, params, dev: DeviceState, L: SpecLaunch, warm: bool = False) -> tuple:
        """One speculative launch on ``dev``: returns (the new `DeviceState`, its `LaunchResult`)."""

    def jitted(self) -> list:
        """The jitted functions it owns (for `Runner.num_compilations`)."""


class NoSpeculation:
    """γ = 0: plain decoding; plain launches run the model family's step (`model_step.ModelStep`)."""

    gamma = 0

    def __init__(self, model_step):
        self.model_step = model_step

    def seed_state(self, state: dict) -> dict:
        return state

    def extend_step(self, all_logits: bool):
        return self.model_step.extend_step(all_logits)

    def launch(self, params, dev: DeviceState, L: SpecLaunch, warm: bool = False) -> tuple:
        raise RuntimeError("a DSpark launch without --speculative-algorithm DSPARK")

    def jitted(self) -> list:
        return []


# ----------------------------------------------------------------------------------------------------
# the jitted DSpark launches (module level: shared by every engine, compiled once per shape)
# ----------------------------------------------------------------------------------------------------


def _spec_launch_impl(params, state, slot_tensors, last_token, batch, step_counter, drafts, allowed,
                      accept_override, *, cfg, ccfg, gamma, mesh, step=None):
    """`step` (default DSpark's `speculative.speculative_step`; MTP's `mtp_speculative.speculative_step`) on the
    rows, then the committed tokens into the penalty counts and each row's bonus into ``last_token``."""
    step = spec.speculative_step if step is None else step
    slots, active = jnp.asarray(batch["slot"]), jnp.asarray(batch["active"])
    n_rows = last_token.shape[0]
    t = jax.tree.map(lambda a: a[slots], slot_tensors)
    t = t.replace(valid=t.valid & active)
    toks, n_acc, state = step(params, state, batch, t, step_counter, drafts, cfg=cfg, ccfg=ccfg, gamma=gamma,
                              accept_override=accept_override, allowed=allowed, mesh=mesh)
    rows = jnp.where(active, slots, n_rows)  # out of range: dropped
    V = slot_tensors.output_counts.shape[1]
    cols = jnp.where(toks >= 0, toks, V)  # −1 padding: out of range, dropped
    counts = slot_tensors.output_counts.at[rows[:, None], cols].add(1, mode="drop")
    bonus = jnp.take_along_axis(toks, n_acc[:, None], axis=1)[:, 0]
    last = last_token.at[rows].set(bonus, mode="drop")
    return toks, n_acc, slot_tensors.replace(output_counts=counts), last, state


def _spec_launch(params, state, slot_tensors, last_token, batch, step_counter, drafts, allowed, *, cfg, ccfg,
                 gamma, mesh=None, step=None):
    """One DSpark step for the rows of a `SpecLaunch` (the production step): sampling tensors gathered
    from the rows' slots, `speculative.speculative_step`, then the committed tokens added to the slots'
    penalty counts and each row's bonus token (the next anchor) put in ``last_token[slot]``.

    batch: `DSparkSpeculator.batch`'s {anchor, start, slot, page_table, active} (numpy is
    fine); step_counter int32 [B]: tokens each row has generated (the anchor included); drafts int32
    [B, γ]: −1 (the draft's own proposal) or a draft the host fixed (a constrained row's grammar-walked
    drafts); allowed bool [B, γ+1, V]: the grammar masks of the verify rows (all True elsewhere).
    Returns (tokens int32 [B, γ+1] −1 padded, n_accept int32 [B], slot_tensors, last_token, state)."""
    return _spec_launch_impl(params, state, slot_tensors, last_token, batch, step_counter, drafts, allowed, None,
                             cfg=cfg, ccfg=ccfg, gamma=gamma, mesh=mesh, step=step)


def _spec_launch_simulated(params, state, slot_tensors, last_token, batch, step_counter, drafts, allowed,
                           accept_override, *, cfg, ccfg, gamma, mesh=None):
    """`_spec_launch` with the simulated accept length (performance runs only): accept_override int32 [B]
    is each row's forced accept count (−1: verify)."""
    return _spec_launch_impl(params, state, slot_tensors, last_token, batch, step_counter, drafts, allowed,
                             accept_override, cfg=cfg, ccfg=ccfg, gamma=gamma, mesh=mesh)


def _propose_launch(params, state, slot_tensors, batch, step_counter, *, cfg, ccfg, gamma):
    """The draft alone for the rows of a `SpecLaunch` (the same draws as `_spec_launch`'s own draft):
    int32 [B, γ]. Used when a row has a constraint: the host checks the drafts against the grammar
    before the verify step (which then gets them as its drafts, and the grammar's masks)."""
    from dsv41_jax.model import dspark

    slots, active = jnp.asarray(batch["slot"]), jnp.asarray(batch["active"])
    t = jax.tree.map(lambda a: a[slots], slot_tensors)
    t = t.replace(valid=t.valid & active)
    draw = spec.sampling_draw(t, step_counter, bool(cfg.deterministic))
    prop = dspark.propose(params, state["dspark"], jnp.asarray(batch["anchor"]), jnp.asarray(batch["start"]), slots,
                          cfg, ccfg, gamma, draw)
    return prop["tokens"]


def _dp_plan(mesh):
    """The `MeshPlan` of a data-parallel mesh ("dp" > 1), else None (the launches run as one program)."""
    par = mesh_plan.MeshPlan.of(mesh)
    return par if par is not None and par.axis_size("dp") > 1 else None


def _per_rank(launch, par, cfg, ccfg, n_extra: int, **kw):
    """``launch(params, state, slot_tensors, last_token, batch, step_counter, *extra, cfg=, ccfg=, mesh=, **kw)``
    (`_spec_launch`, `_propose_rank`) as one program per dp rank (`MeshPlan.rank_step`): the per-slot arrays
    (cache, sampling tensors, ``last_token``; a ``None`` one left out) travel as the rank step's state, every
    batch-leading input (the batch dict, step_counter, the ``n_extra`` extras) as its batch, ids global (the
    rank step translates ``slot`` / ``page_table``). Returns the same signature (less the keywords), to jit."""
    names = ("step",) + tuple(f"extra{i}" for i in range(n_extra))

    def in_rank(params, st, b, *, ccfg, par):
        batch = {k: v for k, v in b.items() if k not in names}
        return launch(params, st["state"], st.get("slot_tensors"), st.get("last_token"), batch,
                      *(b[k] for k in names), cfg=cfg, ccfg=ccfg, mesh=par, **kw)

    step = par.rank_step(in_rank, cfg, ccfg)

    def fn(params, state, slot_tensors, last_token, batch, step_counter, *extra):
        st = {k: v for k, v in (("state", state), ("slot_tensors", slot_tensors), ("last_token", last_token))
              if v is not None}
        return step(params, st, dict(batch, **dict(zip(names, (step_counter,) + extra))))

    return fn


def _propose_rank(params, state, slot_tensors, last_token, batch, step_counter, *, cfg, ccfg, gamma, mesh):
    """`_propose_launch` in `_per_rank`'s signature (``last_token`` unused; the draft runs no mesh op)."""
    return _propose_launch(params, state, slot_tensors, batch, step_counter, cfg=cfg, ccfg=ccfg, gamma=gamma)


@functools.lru_cache(maxsize=None)
def _jitted_propose_launch(cfg, ccfg, gamma: int, mesh=None):
    par = _dp_plan(mesh)
    if par is None:
        return jax.jit(functools.partial(_propose_launch, cfg=cfg, ccfg=ccfg, gamma=gamma))
    fn = _per_rank(_propose_rank, par, cfg, ccfg, 0, gamma=gamma)
    return jax.jit(lambda params, state, slot_tensors, batch, step: fn(params, state, slot_tensors, None, batch, step))


@functools.lru_cache(maxsize=None)
def jitted_spec_launch(cfg, ccfg, gamma: int, mesh=None, simulated: bool = False):
    """`_spec_launch` (or with ``simulated`` `_spec_launch_simulated`) jitted per (cfg, ccfg, γ, mesh), cache /
    tensors / last_token donated; compiles once per batch bucket. On a data-parallel mesh one program per
    dp rank (`_per_rank`)."""
    fn = _spec_launch_simulated if simulated else _spec_launch
    par = _dp_plan(mesh)
    if par is not None:
        return jax.jit(_per_rank(fn, par, cfg, ccfg, 3 if simulated else 2, gamma=gamma), donate_argnums=(1, 2, 3))
    return jax.jit(functools.partial(fn, cfg=cfg, ccfg=ccfg, gamma=gamma, mesh=mesh), donate_argnums=(1, 2, 3))


class DSparkSpeculator:
    """DSpark (see the module docstring). cfg, ccfg, mesh: the runner's; gamma: proposals per step;
    simulate_accept_length: None, or L in 1..γ+1 (performance runs only); seed: its stream of floor /
    ceil draws around a fractional L."""

    def __init__(self, cfg, ccfg, gamma: int, mesh=None, simulate_accept_length: Optional[float] = None,
                 seed: int = 0):
        self.cfg, self.ccfg, self.gamma, self.mesh = cfg, ccfg, int(gamma), mesh
        self.simulate_accept_length = simulate_accept_length
        self._sim_rng = np.random.default_rng(seed)
        self._step = jitted_spec_launch(cfg, ccfg, self.gamma, mesh, simulate_accept_length is not None)
        self._propose = _jitted_propose_launch(cfg, ccfg, self.gamma, mesh)
        self._allow_all: dict = {}

    def with_rings(self, state: dict) -> dict:
        """The cache plus the draft's zeroed rings (V4.1's `dspark.with_rings`)."""
        from dsv41_jax.model import dspark

        return dspark.with_rings(state, self.cfg, self.ccfg)

    def seed_state(self, state: dict) -> dict:
        state = self.with_rings(state)
        if self.mesh is not None:  # the draft's rings by the cache's rules
            from dsv41_jax.parallel import rules

            mesh = mesh_plan.MeshPlan.of(self.mesh).mesh  # (a mesh, or a plan with redundant experts)
            state = dict(state, dspark=rules.place_state({"dspark": state["dspark"]}, mesh)["dspark"])
        return state

    def extend_step(self, all_logits: bool):
        return spec.jitted_extend_seeding(self.cfg, self.ccfg, all_logits, self.mesh)

    def jitted(self) -> list:
        return [self._step, self._propose]

    def batch(self, L: SpecLaunch) -> tuple:
        """The verify step's host inputs for the rows of L: ({anchor, start, slot, page_table, active}
        padded to L.B rows, scratch slot for padding), step_counter int32 [B]. With dp ranks the rows are
        rank-major and padded per rank (`dp_layout.pad_row`: n = 0, inactive; the rest: each row's rank's
        scratch slot and null page)."""
        B = L.B
        anchor = np.zeros((B,), np.int32)
        start = np.zeros((B,), np.int32)
        slot = kvc.padding_slots(self.ccfg, B)
        pt = kvc.padding_pages(self.ccfg, B)
        active = np.zeros((B,), bool)
        step = np.zeros((B,), np.int32)
        for b, r in enumerate(L.rows):
            slot[b] = r.slot
            pt[b, :len(r.pages)] = r.pages
            if r.n:  # (a padding row stays inactive)
                anchor[b], start[b], active[b], step[b] = r.tokens[0], r.start, True, r.step
        return {"anchor": anchor, "start": start, "slot": slot, "page_table": pt, "active": active}, step

    def accept_override(self, n_rows: int, B: int) -> np.ndarray:
        """int32 [B]: with a simulated accept length L the forced accept count of each row (L − 1
        drafts: floor or ceil of a fractional L, drawn so the mean is L − 1)."""
        out = np.full((B,), -1, np.int32)
        L = self.simulate_accept_length
        if L is not None and n_rows:
            base, frac = int(np.floor(L - 1)), (L - 1) - np.floor(L - 1)
            up = self._sim_rng.random(n_rows) < frac
            out[:n_rows] = np.minimum(base + up.astype(np.int32), self.gamma)
        return out

    def grammar_masks(self, params, dev: DeviceState, L: SpecLaunch, batch: dict, step, drafts: np.ndarray):
        """The verify rows' masks bool [B, γ+1, V]. Constrained rows of L (their `Row.grammar`, walked on a
        clone): draft on the device, read the drafts, walk the grammar through them; the row's
        drafts become those drafts (the verify step then checks exactly what the grammar saw) and its masks
        row j = what the grammar allows after d_0..d_{j−1}, up to the first draft it rejects (later rows:
        all True; the rejected draft has probability 0 under the masked target, so it and everything after
        it is rejected). All True (one device array per B) when no row has a grammar."""
        rows = [(b, r) for b, r in enumerate(L.rows) if r.grammar is not None]
        g, V = self.gamma, self.cfg.vocab_size
        if not rows:
            allowed = self._allow_all.get(L.B)
            if allowed is None:
                allowed = self._allow_all[L.B] = jax.device_put(np.ones((L.B, g + 1, V), bool))
            return allowed
        d = np.asarray(self._propose(params, dev.state, dev.slot_tensors, batch, step))
        m = np.ones((L.B, g + 1, V), bool)
        for b, r in rows:
            c = r.grammar.clone()  # (the schedule's own copy stays as it was given)
            for j in range(g + 1):
                a = c.allowed_mask()
                if a is not None:
                    a = np.asarray(a, bool).reshape(-1)
                    m[b, j, :] = False
                    m[b, j, : min(V, a.shape[0])] = a[:V]
                if j == g:
                    break
                tok = int(drafts[b, j]) if drafts[b, j] >= 0 else int(d[b, j])
                drafts[b, j] = tok
                if not m[b, j, tok]:
                    break  # the grammar rejects d_j: verification stops there
                c.accept(tok)
                if c.is_done():
                    break  # the request ends with d_j
        return m

    def verify(self, params, dev: DeviceState, L: SpecLaunch, batch: dict, step, drafts: np.ndarray,
               allowed) -> tuple:
        """Enqueue the verify-then-commit step (`_spec_launch`; with a simulated accept length its variant)
        for L's rows: drafts int32 [B, γ] (−1: the draft's own proposal), allowed its masks. Returns (the new
        `DeviceState`, `LaunchResult` with tokens [B, γ+1] and n_accept [B], device arrays)."""
        args = (params, dev.state, dev.slot_tensors, dev.last_token, batch, step, drafts, allowed)
        if self.simulate_accept_length is not None:
            args += (self.accept_override(len(L.rows), L.B),)
        toks, n_acc, tensors, last, state = self._step(*args)
        return DeviceState(state, tensors, last), LaunchResult(tokens=toks, n_accept=n_acc)

    def launch(self, params, dev: DeviceState, L: SpecLaunch, warm: bool = False) -> tuple:
        """One DSpark step for the rows of L (row b: anchor ``tokens[0]`` at ``start``, slot, pages covering
        start + γ + 1 tokens) on ``dev``: `batch`, `grammar_masks` (rows with a grammar get their drafts
        checked first: a draft-only launch and a host round trip), `verify`. ``warm``: the warm-up's launch
        (also compiles the draft-only step). Returns (the new `DeviceState`, its `LaunchResult`)."""
        batch, step = self.batch(L)
        drafts = np.full((L.B, self.gamma), -1, np.int32)  # always passed: one compiled variant
        if warm:
            jax.block_until_ready(self._propose(params, dev.state, dev.slot_tensors, batch, step))
        allowed = self.grammar_masks(params, dev, L, batch, step, drafts)
        return self.verify(params, dev, L, batch, step, drafts, allowed)


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V4's drafts: the MTP layer (--speculative-algorithm EAGLE / NEXTN) and the DSpark head of Flash-0731 /
# Pro-0813 (--speculative-algorithm DSPARK), each a module with `propose` / `speculative_step` /
# `jitted_extend_seeding` and its per-slot state (`mtp_speculative`, `v4_dspark_speculative`)
# ----------------------------------------------------------------------------------------------------


def _v4_module(kind: str):
    if kind == "mtp":
        from dsv41_jax.serving import mtp_speculative as mod
    else:
        from dsv41_jax.serving import v4_dspark_speculative as mod
    return mod


def _v4_propose_launch(params, state, slot_tensors, batch, step_counter, *, cfg, ccfg, gamma, kind, mesh=None):
    """`_propose_launch` for a V4 draft: the drafts alone (the same draws as its step's own), int32 [B, γ]."""
    slots, active = jnp.asarray(batch["slot"]), jnp.asarray(batch["active"])
    t = jax.tree.map(lambda a: a[slots], slot_tensors)
    t = t.replace(valid=t.valid & active)
    draw = spec.sampling_draw(t, step_counter, bool(cfg.deterministic))
    # both drafts run on one device or a tp x ep mesh (`mtp_speculative`, `v4_dspark_speculative` module docs)
    return _v4_module(kind).propose(params, state, batch, draw, cfg=cfg, ccfg=ccfg, gamma=gamma,
                                    par=mesh_plan.MeshPlan.of(mesh))[0]


@functools.lru_cache(maxsize=None)
def _jitted_v4(cfg, ccfg, gamma: int, kind: str, mesh=None):
    """(the V4 draft's verify-then-commit launch, cache / tensors / last_token donated; the draft-only launch), on
    `mesh` (None: one device; a tp x ep mesh: `mtp_speculative`, `v4_dspark_speculative` module docs)."""
    step = jax.jit(functools.partial(_spec_launch, cfg=cfg, ccfg=ccfg, gamma=gamma, mesh=mesh,
                                     step=_v4_module(kind).speculative_step), donate_argnums=(1, 2, 3))
    return step, jax.jit(functools.partial(_v4_propose_launch, cfg=cfg, ccfg=ccfg, gamma=gamma, kind=kind, mesh=mesh))


class MTPSpeculator(DSparkSpeculator):
    """MTP speculation for DeepSeek-V4 (`mtp_speculative` module doc): DSpark's launch, grammar walk and verify
    with the MTP layer's draft and per-slot state. One device or a tp x ep mesh; no simulated accept length."""

    kind = "mtp"

    def __init__(self, cfg, ccfg, gamma: int, seed: int = 0, mesh=None):
        self.cfg, self.ccfg, self.gamma, self.mesh = cfg, ccfg, int(gamma), mesh
        self.simulate_accept_length = None
        self._sim_rng = np.random.default_rng(seed)
        self._step, self._propose = _jitted_v4(cfg, ccfg, self.gamma, self.kind, mesh)
        self._allow_all: dict = {}

    def seed_state(self, state: dict) -> dict:
        from dsv41_jax.serving import mtp_speculative as mtp_spec

        return mtp_spec.with_mtp_state(state, self.cfg, self.ccfg, self.mesh)

    def extend_step(self, all_logits: bool):
        from dsv41_jax.serving import mtp_speculative as mtp_spec

        return mtp_spec.jitted_extend_seeding(self.cfg, self.ccfg, all_logits, self.mesh)


class V4DSparkSpeculator(MTPSpeculator):
    """DSpark speculation for DeepSeek-V4-Flash-0731 / Pro-0813 (`v4_dspark_speculative` module doc): the same launch
    with the V4 DSpark head's block proposal and rings. One device or a tp x ep mesh (the rings placed by the cache's
    rules: replicated); no simulated accept length."""

    kind = "dspark"

    seed_state = DSparkSpeculator.seed_state  # V4's rings, placed as V4.1's on a mesh

    def with_rings(self, state: dict) -> dict:
        from dsv41_jax.model.v4 import dspark as dspark4

        return dspark4.with_rings(state, self.cfg, self.ccfg)

    def extend_step(self, all_logits: bool):
        from dsv41_jax.serving import v4_dspark_speculative as v4ds

        return v4ds.jitted_extend_seeding(self.cfg, self.ccfg, all_logits, self.mesh)
