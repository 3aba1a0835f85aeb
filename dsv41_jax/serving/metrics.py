"""Prometheus metrics of the OpenAI server (``GET /metrics``, on by default; ``--disable-metrics`` turns it off).

Names follow SGLang's (``sglang:num_running_reqs`` …) under our own ``dsv41:`` prefix:

==========================================  =========  =================================================
``dsv41:num_running_reqs``                  gauge      requests in the running batch (engine)
``dsv41:num_queue_reqs``                    gauge      requests waiting for admission (engine)
``dsv41:num_used_tokens``                   gauge      KV tokens in use (engine, when it reports them)
``dsv41:token_usage``                       gauge      KV pool usage, 0..1 (engine)
``dsv41:gen_throughput``                    gauge      generation tokens/s (engine; else the server's
                                                       own estimate over the last ``window`` seconds)
``dsv41:cache_hit_rate``                    gauge      prefix-cache hit rate, 0..1 (engine)
``dsv41:prompt_tokens_total``               counter    prompt tokens of finished requests
``dsv41:generation_tokens_total``           counter    generated tokens
``dsv41:reasoning_tokens_total``            counter    generated tokens inside reasoning
``dsv41:num_requests_total``                counter    finished choices, label ``finish_reason``
``dsv41:num_aborted_requests_total``        counter    requests aborted (client gone, shutdown)
``dsv41:num_rejected_requests_total``       counter    refused requests, label ``code`` (HTTP status)
``dsv41:num_preemptions_total``             counter    samples preempted under KV-pool pressure, label
                                                       ``reason`` (engine: "decode_pages" /
                                                       "prefill_pages"; see `engine.PREEMPTION_REASONS`)
``dsv41:spec_verify_steps_total``           counter    DSpark row-steps (one per row of a verify launch)
``dsv41:spec_accepted_tokens_total``        counter    drafts accepted by verification
``dsv41:spec_draft_tokens_total``           counter    drafts proposed (γ per row-step)
``dsv41:spec_accept_length``                gauge      mean tokens committed per row-step (1 + accepted;
                                                       SGLang's "accept length"), since start
``dsv41:spec_accept_rate``                  gauge      accepted / proposed drafts, since start
``dsv41:spec_accept_length_per_step``       histogram  tokens committed per row-step (1..γ+1)
``dsv41:time_to_first_token_seconds``       histogram  arrival -> first generated token
``dsv41:inter_token_latency_seconds``       histogram  time between consecutive output tokens
``dsv41:time_per_output_token_seconds``     histogram  (e2e - ttft) / (tokens - 1) per request
``dsv41:e2e_request_latency_seconds``       histogram  arrival -> last token
``dsv41:http_requests_total``               counter    labels ``endpoint``, ``status``
==========================================  =========  =================================================

With data-parallel attention (``--dp-size D > 1``; the engine's stats carry ``dp_ranks``) the four
load gauges ``num_running_reqs``, ``num_queue_reqs``, ``num_used_tokens`` and ``token_usage`` carry a
``dp_rank`` label, one series per rank (``sum(dsv41:num_running_reqs)`` is the engine's total; the
rank's token_usage is of its own KV pool); with one rank they have no label, as before.

Each :class:`ServerMetrics` has its own ``CollectorRegistry`` (several servers in one process, as in
tests, do not clash). Engine gauges are refreshed from ``engine.stats()`` at scrape time; the engine's
cumulative counts (preemptions, DSpark steps / accepts and the accept-length histogram) are mirrored
into the counters / histogram by adding what is new since the last scrape. The ``spec_*`` series
exist only when the engine reports them (``--speculative-algorithm DSPARK``).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST", "RequestTimer"]

PREFIX = "dsv41:"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0,
                30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
SPEC_ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6)  # tokens committed per DSpark row-step: 1..γ+1, γ <= 5
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

# keys of engine.stats() tried for each gauge (first present wins)
_STAT_KEYS: Mapping[str, tuple[str, ...]] = {
    "num_running_reqs": ("num_running_reqs", "running", "num_running", "running_requests"),
    "num_queue_reqs": ("num_queue_reqs", "queued", "waiting", "num_waiting", "queued_requests", "queue_len"),
    "num_used_tokens": ("num_used_tokens", "used_tokens", "kv_used_tokens"),
    "token_usage": ("token_usage", "kv_usage", "pool_usage", "cache_usage"),
    "gen_throughput": ("gen_throughput", "generation_throughput", "decode_throughput", "throughput"),
    "cache_hit_rate": ("cache_hit_rate", "prefix_cache_hit_rate", "hit_rate"),
}


def _stat(stats: Mapping[str, Any], name: str) -> float | None:
    for k in _STAT_KEYS[name]:
        v = stats.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


class RequestTimer:
    """Per-request latency bookkeeping: call :meth:`tokens` whenever output tokens arrive."""

    __slots__ = ("metrics", "arrival", "first", "last", "n_tokens")

    def __init__(self, metrics: "ServerMetrics | None", arrival: float | None = None):
        self.metrics = metrics
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first: float | None = None
        self.last: float | None = None
        self.n_tokens = 0

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self.first is None:
            self.first = now
            if m is not None:
                m.ttft.observe(now - self.arrival)
        elif m is not None:
            # n tokens arrived together (e.g. DSpark): spread the gap over them
            gap = (now - self.last) / n
            for _ in range(n):
                m.itl.observe(gap)
        self.last = now
        self.n_tokens += n
        if m is not None:
            m.note_tokens(n, now)

    def finish(self) -> None:
        m = self.metrics
        if m is None:
            return
        end = self.last if self.last is not None else time.perf_counter()
        m.e2e.observe(end - self.arrival)
        if self.first is not None and self.n_tokens > 1:
            m.tpot.observe((end - self.first) / (self.n_tokens - 1))


class ServerMetrics:
    """The server's Prometheus metrics (own registry). ``stats_fn`` returns ``engine.stats()``."""

    def __init__(self, stats_fn: Callable[[], Mapping[str, Any]] | None = None, *, model_name: str = "",
                 window: float = 10.0):
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats_fn = stats_fn
        r = self.registry
        self.num_running = Gauge(PREFIX + "num_running_reqs", "Requests in the running batch", registry=r)
        self.num_queue = Gauge(PREFIX + "num_queue_reqs", "Requests waiting in the queue", registry=r)
        self.num_used_tokens = Gauge(PREFIX + "num_used_tokens", "KV cache tokens in use", registry=r)
        self.token_usage = Gauge(PREFIX + "token_usage", "KV pool usage (0..1)", registry=r)
        self.gen_throughput = Gauge(PREFIX + "gen_throughput", "Generation throughput (tokens/s)", registry=r)
        self.cache_hit_rate = Gauge(PREFIX + "cache_hit_rate", "Prefix cache hit rate (0..1)", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", registry=r)
        self.reasoning_tokens = Counter(PREFIX + "reasoning_tokens", "Generated reasoning tokens", registry=r)
        self.num_requests = Counter(PREFIX + "num_requests", "Finished requests", ["finish_reason"], registry=r)
        self.num_aborted = Counter(PREFIX + "num_aborted_requests", "Aborted requests", registry=r)
        self.num_rejected = Counter(PREFIX + "num_rejected_requests", "Rejected requests", ["code"], registry=r)
        self.num_preemptions = Counter(PREFIX + "num_preemptions", "Samples preempted (KV pool pressure)",
                                       ["reason"], registry=r)
        self._preemptions_seen: dict = {}  # reason -> the engine's count already added to the counter
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (s)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Inter-token latency (s)",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token (s)",
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency (s)",
                             buckets=E2E_BUCKETS, registry=r)
        self.info = Gauge(PREFIX + "model_info", "Served model", ["model"], registry=r)
        self._r = r
        self._spec = None  # DSpark series, made on the first scrape whose stats have them
        self._per_rank = False  # the load gauges carry dp_rank (made on the first scrape with dp_ranks)
        self._spec_seen: dict = {}
        if model_name:
            self.info.labels(model=model_name).set(1)
        self._window = window
        self._recent: collections.deque = collections.deque()  # (time, n tokens)
        self._lock = threading.Lock()

    # -- updates from the request handlers
    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def note_tokens(self, n: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.generation_tokens.inc(n)
        with self._lock:
            self._recent.append((now, n))
            cut = now - self._window
            while self._recent and self._recent[0][0] < cut:
                self._recent.popleft()

    def finished(self, finish_reasons, prompt_tokens: int, reasoning_tokens: int = 0) -> None:
        """A request finished: one count per choice (``finish_reasons``: a reason or a list)."""
        if finish_reasons is None or isinstance(finish_reasons, str):
            finish_reasons = [finish_reasons]
        for r in finish_reasons:
            self.num_requests.labels(finish_reason=str(r or "unknown")).inc()
        self.prompt_tokens.inc(max(0, int(prompt_tokens)))
        if reasoning_tokens:
            self.reasoning_tokens.inc(int(reasoning_tokens))

    def aborted(self) -> None:
        self.num_aborted.inc()

    def rejected(self, code: int) -> None:
        self.num_rejected.labels(code=str(int(code))).inc()

    def http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(int(status))).inc()

    def own_throughput(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            total = sum(n for _, n in self._recent)
        return total / self._window

    # -- scrape
    def refresh(self) -> None:
        stats: Mapping[str, Any] = {}
        if self.stats_fn is not None:
            try:
                stats = self.stats_fn() or {}
            except Exception:  # a metrics scrape must never fail the server
                stats = {}
        if not isinstance(stats, Mapping):
            stats = getattr(stats, "__dict__", {}) or {}
        ranks = stats.get("dp_ranks")
        if isinstance(ranks, (list, tuple)) and ranks:
            self._set_per_rank(ranks)
        for name, gauge in (("num_running_reqs", self.num_running), ("num_queue_reqs", self.num_queue),
                            ("num_used_tokens", self.num_used_tokens), ("token_usage", self.token_usage),
                            ("cache_hit_rate", self.cache_hit_rate)):
            if self._per_rank and name != "cache_hit_rate":
                continue
            v = _stat(stats, name)
            if v is not None:
                gauge.set(v)
        v = _stat(stats, "gen_throughput")
        self.gen_throughput.set(v if v is not None else self.own_throughput())
        self._mirror_preemptions(stats.get("preemptions_by_reason"))
        self._mirror_spec(stats)

    _RANK_GAUGES = (("num_running", "num_running_reqs"), ("num_queue", "num_queue_reqs"),
                    ("num_used_tokens", "num_used_tokens"), ("token_usage", "token_usage"))

    def _set_per_rank(self, ranks) -> None:
        """The load gauges per dp rank (``ranks``: the engine's ``dp_ranks``, one dict per rank); on the first
        call the unlabelled gauges are replaced by ones with a ``dp_rank`` label (same names)."""
        if not self._per_rank:
            for attr, _ in self._RANK_GAUGES:
                old = getattr(self, attr)
                self._r.unregister(old)
                setattr(self, attr, Gauge(old._name, old._documentation + " (per data-parallel rank)", ["dp_rank"],
                                          registry=self._r))
            self._per_rank = True
        for rs in ranks:
            for attr, key in self._RANK_GAUGES:
                v = rs.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    getattr(self, attr).labels(dp_rank=str(rs.get("dp_rank", 0))).set(float(v))

    def _mirror_spec(self, stats: Mapping[str, Any]) -> None:
        """DSpark counters / gauges / histogram from the engine's cumulative figures."""
        hist = stats.get("spec_accept_hist")
        if not isinstance(hist, (list, tuple)):
            return
        r = self._r
        if self._spec is None:
            self._spec = {
                "spec_verify_steps": Counter(PREFIX + "spec_verify_steps", "DSpark row-steps (verified blocks)",
                                             registry=r),
                "spec_accepted_tokens": Counter(PREFIX + "spec_accepted_tokens", "DSpark drafts accepted",
                                                registry=r),
                "spec_draft_tokens": Counter(PREFIX + "spec_draft_tokens", "DSpark drafts proposed", registry=r),
                "accept_length": Gauge(PREFIX + "spec_accept_length",
                                       "Mean tokens committed per DSpark row-step (1 + accepted drafts)", registry=r),
                "accept_rate": Gauge(PREFIX + "spec_accept_rate", "DSpark accepted / proposed drafts", registry=r),
                "hist": Histogram(PREFIX + "spec_accept_length_per_step",
                                  "Tokens committed per DSpark row-step (1 + accepted drafts)",
                                  buckets=SPEC_ACCEPT_BUCKETS, registry=r),
            }
        sp = self._spec
        for key in ("spec_verify_steps", "spec_accepted_tokens", "spec_draft_tokens"):
            n = stats.get(key)
            seen = self._spec_seen.get(key, 0)
            if isinstance(n, (int, float)) and n > seen:
                sp[key].inc(n - seen)
                self._spec_seen[key] = n
        for key, g in (("spec_accept_length", "accept_length"), ("spec_accept_rate", "accept_rate")):
            v = stats.get(key)
            if isinstance(v, (int, float)):
                sp[g].set(float(v))
        seen = self._spec_seen.setdefault("hist", [0] * len(hist))
        seen += [0] * (len(hist) - len(seen))
        for n_acc, count in enumerate(hist):
            for _ in range(max(0, int(count) - seen[n_acc])):
                sp["hist"].observe(n_acc + 1)
            seen[n_acc] = max(seen[n_acc], int(count))

    def _mirror_preemptions(self, counts: Any) -> None:
        """The engine counts preemptions per reason (cumulative); a Prometheus counter only grows,
        so add what is new since the last scrape (every reason the engine knows is exported, 0 too)."""
        if not isinstance(counts, Mapping):
            return
        for reason, n in counts.items():
            seen = self._preemptions_seen.get(reason, 0)
            child = self.num_preemptions.labels(reason=str(reason))
            if isinstance(n, (int, float)) and n > seen:
                child.inc(n - seen)
                self._preemptions_seen[reason] = n

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)
