"""The engine's seams as messages: what the scheduler hands the runner, and what comes back.

One scheduler iteration is one `Schedule`: a frozen value the runner executes and never changes; the
runner answers with a frozen `StepResult`, which the scheduler and the output processor consume (as
vLLM v1's ``SchedulerOutput`` / ``ModelRunnerOutput``). Neither holds a request object (`request.Seq`):
only ints, tuples of ints, read-only numpy arrays, sampling parameters (values), and — for a
constrained DSpark row — a snapshot (clone) of the row's grammar, which the runner clones again to
walk through the drafts (neither the sample's grammar nor the schedule's snapshot changes). Device
arrays in a result are JAX arrays (immutable, possibly still being computed: the overlap schedule reads
them one iteration later).

The ops of a schedule, in the order the runner runs them (`Schedule.ops`):

- `Launch`: one [B, T] extend step over `Row`s (prefill chunks, decode rows, replayed tokens);
- `SpecLaunch`: one DSpark [B, γ+1] verify step (each row: an anchor and γ drafts);
- `ForkOp`: an n > 1 sibling gets its source's slot rows and partial page;
- the prefix cache's `SaveOp` / `RestoreOp` and HiCache's `SpillOp` / `LoadOp`;
- `ImportOp`: a state prefilled by another engine (`handover`) written into a slot and its pages.

A schedule also carries the slots to reset and the sampling rows (`SamplingRow`) of the samples it
admitted. ``rank`` is the data-parallel rank that planned it (0 on a single engine); a data-parallel
step (issue 46, `dp_controller.merge`) merges the ranks' schedules into one whose launches hold every
rank's rows, rank-major, each rank padded with its own padding rows (n = 0), with rank −1.

The speculator's seam is typed too: `speculator.Speculator.launch` takes the runner's `DeviceState`
(cache pytree, per-slot sampling tensors, ``last_token``) and a `SpecLaunch`, and returns the new
`DeviceState` and the launch's `LaunchResult`; it never writes into the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

__all__ = ["DeviceState", "ForkOp", "ImportOp", "Launch", "LaunchResult", "LoadOp", "Op", "RestoreOp", "Row",
           "SamplingRow", "SaveOp", "Schedule", "SpecLaunch", "SpillOp", "StepResult"]


def _readonly(a):
    """A numpy array made read-only (a message's arrays cannot be changed in place); others as they are."""
    if isinstance(a, np.ndarray):
        a.flags.writeable = False
    return a


# ----------------------------------------------------------------------------------------------------
# Launch rows
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One row of a launch: sample ``index`` of request ``req_id`` in slot ``slot`` writes ``n`` tokens at
    positions ``start ..``.

    tokens: the host tokens (empty for a decode row whose token is still on the device: ``from_prev``,
    the runner takes it from ``last_token[slot]``); a DSpark row's is ``(anchor,)`` with n = γ + 1.
    sample: the row's last position samples the sample's next token (``step``: tokens it has generated,
    the sampler's stream index); replay: a resumed sample's generated token written again, not sampled.
    pages: the sample's page table (covers start + n tokens). prompt_len: its prompt's length.
    logprobs: top logprobs the sampled token asks for (0: none). plp_targets: for a prefill chunk of a
    prompt-logprobs sample, the prompt token after each position (n of them), else None.
    allowed: a sampled row's constraint mask bool [V] this step (None: unconstrained); grammar: a DSpark
    row's constraint, a snapshot (clone) the runner clones to walk (None: unconstrained)."""

    req_id: str
    index: int
    slot: int
    start: int
    n: int
    tokens: tuple
    from_prev: bool
    sample: bool
    step: int
    pages: tuple
    prompt_len: int
    replay: bool = False
    logprobs: int = 0
    plp_targets: Optional[tuple] = None
    allowed: Optional[np.ndarray] = None
    grammar: Any = None

    def __post_init__(self):
        _readonly(self.allowed)

    @property
    def key(self) -> tuple:
        """(request id, sample index): the sample's key (as `request.Seq.key`)."""
        return (self.req_id, self.index)


@dataclass(frozen=True)
class Launch:
    """One [B, T] extend step: ``rows`` padded to B rows of T tokens (the compiled buckets)."""

    rows: tuple
    B: int
    T: int

    spec = False

    @property
    def want_top(self) -> bool:
        """Whether a sampled row asks for top logprobs (the result then carries them)."""
        return any(r.sample and r.logprobs > 0 for r in self.rows)

    @property
    def want_plp(self) -> bool:
        """Whether a row scores its prompt (the all-logits variant of the step runs)."""
        return any(r.plp_targets is not None for r in self.rows)


@dataclass(frozen=True)
class SpecLaunch:
    """One DSpark step for B rows (row: anchor ``tokens[0]`` at ``start``, n = γ + 1, pages covering
    start + γ + 1 tokens)."""

    rows: tuple
    B: int
    gamma: int

    spec = True

    @property
    def T(self) -> int:
        return self.gamma + 1


# ----------------------------------------------------------------------------------------------------
# Copies and transfers
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForkOp:
    """Copy slot ``src_slot``'s rows to ``dst_slot`` and page ``src_page`` to ``dst_page`` (0, 0: none)."""

    src_slot: int
    dst_slot: int
    src_page: int
    dst_page: int


@dataclass(frozen=True)
class ImportOp:
    """Write a prefilled request's state (`handover.PrefilledState`) into slot ``slot`` and pool pages
    ``pages`` (prefill/decode disaggregation; runs before the schedule's launches, like a restore)."""

    slot: int
    pages: tuple
    state: Any


@dataclass(frozen=True)
class SaveOp:
    """Copy slot ``slot``'s rows into snapshot row ``row``. A released sample's save runs before the
    schedule's slot resets (its slot may have a new owner); an ``in_order`` one (a prompt-end
    snapshot) runs at its place among the ops, right after the launch that wrote position k−1."""

    slot: int
    row: int
    in_order: bool = False


@dataclass(frozen=True)
class RestoreOp:
    """Copy snapshot row ``row`` into slot ``slot``, and pool page ``src_page`` to ``dst_page``
    (0, 0: none — the prefix ends on a page boundary)."""

    row: int
    slot: int
    src_page: int
    dst_page: int


@dataclass(frozen=True)
class SpillOp:
    """HiCache: copy ``pages`` (pool pages) and snapshot row ``row`` of entry ``key`` to host memory
    (run first of all: the pages and the row may be reused by the same schedule)."""

    key: tuple
    pages: tuple
    row: int


@dataclass(frozen=True)
class LoadOp:
    """HiCache: write host entry ``key``'s pages into pool pages ``dst_pages`` and its snapshot into
    slot ``slot`` (a hit on the host tier; in order, like a `RestoreOp`)."""

    key: tuple
    dst_pages: tuple
    slot: int


Op = Union[Launch, SpecLaunch, ForkOp, ImportOp, SaveOp, RestoreOp, SpillOp, LoadOp]


# ----------------------------------------------------------------------------------------------------
# The schedule and the result
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingRow:
    """An admitted sample's sampling row: its parameters (`sampling.SamplingParams`, a value), its prompt
    (the prompt mask of the penalties) and the tokens it already generated (a resumed sample's counts)."""

    slot: int
    params: Any
    prompt_ids: tuple
    output_ids: tuple


@dataclass(frozen=True)
class Schedule:
    """One iteration of one rank: ``ops`` in run order, the slots to reset (before the ops, after the
    saves of released samples) and the sampling rows to write; ``eos_token_ids`` for those rows."""

    ops: tuple
    resets: tuple = ()
    sampling: tuple = ()
    eos_token_ids: tuple = ()
    rank: int = 0

    @property
    def launches(self) -> tuple:
        """The launches (`Launch`, `SpecLaunch`) among the ops, in order: `StepResult.launches` follows them."""
        return tuple(op for op in self.ops if isinstance(op, (Launch, SpecLaunch)))

    def __bool__(self) -> bool:
        return bool(self.ops)


@dataclass(frozen=True)
class LaunchResult:
    """What one launch gave (device or host arrays; None: not computed).

    Plain launch: ``tokens`` int32 [B] (rows that sample), ``lp`` fp32 [B], ``top_ids`` int32 [B, K] /
    ``top_vals`` fp32 [B, K] (meaningful when the launch `want_top`), ``plp`` the prompt logprobs
    (lp fp32 [B, T], top ids int32 [B, T, K], top logprobs fp32 [B, T, K]) when it scored prompts.
    DSpark launch: ``tokens`` int32 [B, γ+1] (the committed tokens, −1 padded), ``n_accept`` int32 [B]."""

    tokens: Any = None
    lp: Any = None
    top_ids: Any = None
    top_vals: Any = None
    n_accept: Any = None
    plp: Any = None

    def __post_init__(self):
        for name in ("tokens", "lp", "top_ids", "top_vals", "n_accept"):
            _readonly(getattr(self, name))
        if self.plp is not None:
            object.__setattr__(self, "plp", tuple(_readonly(a) for a in self.plp))


@dataclass(frozen=True)
class StepResult:
    """The runner's answer to a `Schedule`: one `LaunchResult` per launch, in `Schedule.launches` order."""

    launches: tuple = ()


@dataclass(frozen=True)
class DeviceState:
    """The runner's per-slot device state, as the speculator takes and returns it: the cache pytree
    (``state``, with the DSpark rings), the per-slot sampling tensors (`sampling.SamplingTensors`) and
    ``last_token`` int32 [`cache.slot_rows`] (each slot's newest sampled token; max_slots + 1 without dp)."""

    state: Any
    slot_tensors: Any
    last_token: Any
