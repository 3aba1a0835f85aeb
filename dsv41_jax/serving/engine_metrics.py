"""The engine's counters, owned by one object (`EngineMetrics`).

The scheduler (preemptions, forks, prompt tokens computed / reused, replays), the output processor
(generated tokens, finished requests, DSpark accepts) and the engine (steps, launches, aborts,
failures) all count into the one `EngineMetrics` the engine makes and hands them; `Engine.stats()`
reads a snapshot of it and the server's Prometheus metrics mirror that (`serving/metrics.py`).
Counters are named up front: adding to an unknown name is an error, not a new counter.
"""

from __future__ import annotations

import threading

from jax import monitoring

from dsv41_jax.serving.request import PREEMPTION_REASONS

__all__ = ["COUNTERS", "CacheLoads", "EngineMetrics"]

COUNTERS = ("num_preemptions", "replayed_tokens", "requests_failed", "prompt_tokens", "generation_tokens",
            "requests_finished", "requests_aborted", "shared_prompt_tokens", "computed_prompt_tokens", "num_forks",
            "steps", "launches", "spec_verify_steps", "spec_accepted_tokens", "spec_draft_tokens",
            "cached_prompt_tokens", "handovers_exported", "handover_bytes_exported", "handovers_imported",
            "handover_bytes_imported", "imported_prompt_tokens")


class EngineMetrics:
    """Cumulative counters (`COUNTERS`) and preemptions per reason (`PREEMPTION_REASONS`).

    ``metrics["name"]`` reads a counter; `add` and `preempted` are the only writers."""

    def __init__(self):
        self._counts = dict.fromkeys(COUNTERS, 0)
        self.preemptions = dict.fromkeys(PREEMPTION_REASONS, 0)

    def add(self, name: str, n: int = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"EngineMetrics: no counter {name!r} (known: {', '.join(COUNTERS)})")
        self._counts[name] += n

    def preempted(self, reason: str) -> None:
        """One preemption for ``reason`` (counted in total and per reason)."""
        if reason not in self.preemptions:
            raise KeyError(f"EngineMetrics: unknown preemption reason {reason!r}")
        self.preemptions[reason] += 1
        self._counts["num_preemptions"] += 1

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict:
        """A copy of the counters (for `Engine.stats`)."""
        return dict(self._counts)


class CacheLoads:
    """Counts, while active, the executables JAX loads from the persistent compilation cache instead of
    compiling them (its ``/jax/compilation_cache/cache_hits`` monitoring event; thread-safe, since the
    warm-up compiles in threads). A context manager: the listener is removed on exit."""

    EVENT = "/jax/compilation_cache/cache_hits"

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, **kwargs) -> None:
        if event == self.EVENT:
            with self._lock:
                self.count += 1

    def __enter__(self) -> "CacheLoads":
        monitoring.register_event_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_listener(self)
