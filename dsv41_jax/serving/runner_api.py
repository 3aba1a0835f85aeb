"""The seam between the engine's host side and its device side: `RunnerProtocol`.

The scheduler and the engine see the runner only through this protocol, so a model-free runner
(tests/mock_runner.py's `MockRunner`, tests/test_prefix_cache.py's `CheckingRunner`) drives them
exactly as the device runner (`runner.Runner`) does. What the scheduler may use: the page allocator (a
`SharedPageAllocator`), the prefix cache's controller (`prefix_cache.PrefixCache`, or None when the
cache is off), the number of slots and the scratch slot. What the engine adds: the limits it validates
requests against, and the three calls (`execute` a schedule, `warmup`, `num_compilations`).

The seam is two messages (`messages`): `execute` takes one iteration's `messages.Schedule` — a frozen
value holding, in run order, launches of rows (`Launch`, DSpark `SpecLaunch`: slots, positions, token
ids, page tables as ints and tuples), fork copies, the prefix cache's save / restore / spill / load ops
and handover imports, plus the slots to reset and the sampling rows of admitted samples — and never
changes it; it returns a frozen `messages.StepResult` (per launch: sampled tokens, logprobs, DSpark
accept lengths; device arrays it may still be computing) at once, which the engine hands to the output
processor (the overlap schedule reads it one iteration later). No `request.Seq` crosses the seam: the
scheduler keeps which sample each row belongs to (`scheduler.Planned`).

With data-parallel attention the runner also has ``allocators`` / ``prefix_caches`` (one per dp rank) and
``ccfg.dp``; each rank's scheduler sees a `dp_controller.RankView` (its allocator, cache and ``slots``,
the global ids of its slot block), which the scheduler reads in place of ``range(max_slots)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from dsv41_jax.serving.messages import Schedule, StepResult
    from dsv41_jax.serving.prefix_cache import PrefixCache
    from dsv41_jax.serving.runner import SharedPageAllocator

__all__ = ["RUNNER_MEMBERS", "RunnerProtocol"]


@runtime_checkable
class RunnerProtocol(Protocol):
    """What the scheduler and the engine may use of a runner (see the module docstring)."""

    allocator: "SharedPageAllocator"  # pages: the scheduler asks it for room; launches read its tables
    prefix_cache: "Optional[PrefixCache]"  # the radix prefix cache (tree, snapshot rows, host tier), or None
    max_slots: int  # request slots (rows of the per-slot cache state)
    scratch: int  # the extra slot padding rows point at (== max_slots; with dp ranks: rank 0's, `cache.scratch_slot`)
    context_length: int  # tokens per request (prompt + output), from the memory plan
    vocab_size: int
    max_logprobs: int  # top logprobs computed per sampled token
    spec_gamma: int  # DSpark proposals per speculative step (0: no speculation)
    launches: int  # device launches so far (the engine's "launches" counter adds the difference)

    def execute(self, schedule: "Schedule") -> "StepResult":
        """Enqueue one schedule; returns its result at once (see the module docstring)."""

    def warmup(self, batch_buckets: "list[int]", token_buckets: "list[int]") -> int:
        """Compile every shape serving will run; returns how many shapes."""

    def num_compilations(self) -> int:
        """Compiled variants held (the tests check that serving adds none)."""


RUNNER_MEMBERS = ("allocator", "prefix_cache", "max_slots", "scratch", "context_length", "vocab_size", "max_logprobs", "spec_gamma",
                  "launches", "execute", "warmup", "num_compilations")
