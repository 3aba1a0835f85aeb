"""The seam between the engine's host side and its device side: `RunnerProtocol`.

The scheduler and the engine see the runner only through this protocol, so a model-free runner
(the mocks of tests/test_scheduler.py and tests/test_prefix_cache.py) drives them exactly as the
device runner (`runner.Runner`) does. What the scheduler may use: the page allocator (a
`SharedPageAllocator`), the prefix cache's controller (`prefix_cache.PrefixCache`, or None when the
cache is off), the number of slots and the scratch slot. What the engine adds: the limits it validates requests against, and
the three calls (`dispatch` a plan, `warmup`, `num_compilations`).

`dispatch` gets a plan in the scheduler's order (`Op`: launches, DSpark launches, fork copies and
the prefix cache's save / restore / spill / load ops), the slots to reset and the samples whose
sampling rows to write; it fills each launch's result fields (device or host arrays) and returns
at once (the overlap schedule reads them later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union, runtime_checkable

if TYPE_CHECKING:
    from dsv41_jax.serving.prefix_cache import LoadOp, PrefixCache, RestoreOp, SaveOp, SpillOp
    from dsv41_jax.serving.request import Seq
    from dsv41_jax.serving.runner import SharedPageAllocator
    from dsv41_jax.serving.scheduler import ForkOp, Launch, SpecLaunch

    Op = Union[Launch, SpecLaunch, ForkOp, SaveOp, RestoreOp, SpillOp, LoadOp]

__all__ = ["RUNNER_MEMBERS", "RunnerProtocol"]


@runtime_checkable
class RunnerProtocol(Protocol):
    """What the scheduler and the engine may use of a runner (see the module docstring)."""

    allocator: "SharedPageAllocator"  # pages: the scheduler asks it for room; launches read its tables
    prefix_cache: "Optional[PrefixCache]"  # the radix prefix cache (tree, snapshot rows, host tier), or None
    max_slots: int  # request slots (rows of the per-slot cache state)
    scratch: int  # the extra slot padding rows point at (== max_slots)
    context_length: int  # tokens per request (prompt + output), from the memory plan
    vocab_size: int
    max_logprobs: int  # top logprobs computed per sampled token
    spec_gamma: int  # DSpark proposals per speculative step (0: no speculation)
    launches: int  # device launches so far (the engine's "launches" counter adds the difference)

    def dispatch(self, ops: "Sequence[Op]", resets: "list[int]", admitted: "list[Seq]",
                 eos_token_ids: "tuple[int, ...]") -> None:
        """Enqueue one plan (see the module docstring)."""

    def warmup(self, batch_buckets: "list[int]", token_buckets: "list[int]") -> int:
        """Compile every shape serving will run; returns how many shapes."""

    def num_compilations(self) -> int:
        """Compiled variants held (the tests check that serving adds none)."""


RUNNER_MEMBERS = ("allocator", "prefix_cache", "max_slots", "scratch", "context_length", "vocab_size", "max_logprobs", "spec_gamma",
                  "launches", "dispatch", "warmup", "num_compilations")
