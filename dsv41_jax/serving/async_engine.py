"""asyncio front of the engine, for the server.

`AsyncEngine` runs `Engine.step()` in a background thread. Requests and aborts reach that thread
through a command queue; outputs go back to each request's `asyncio.Queue` with
``loop.call_soon_threadsafe``. ::

    engine = AsyncEngine(EngineArgs(model="tiny"))      # builds, warms up, starts the loop thread
    async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text, end="")               # text deltas ("delta" outputs)
    engine.shutdown()

A request whose consumer stops iterating (client disconnect: the async generator is closed or its
task cancelled) is aborted, which frees its pages. `generate` raises `QueueFullError` at once when
``max_queued_requests`` requests are already waiting (the server answers 503), and `EngineError`
(a ValueError, HTTP 400) for a request the engine refuses. A request the engine had to end itself
(finish reason "error") raises `EngineInternalError` (HTTP 500 / a stream error event) instead of
yielding its last output, so no client mistakes it for a complete answer.

`pause()` holds the loop between steps (SGLang's pause_generation): requests and aborts are still
taken in, so new requests wait and aborted ones free their pages, but no step runs until `resume()`;
``resume(steps=N)`` runs N steps and holds again. Both go through the command queue, so they are
ordered with the requests and aborts sent before them; the returned events say when the loop got
there. This puts the scheduler in a known state (operators: drain-free maintenance; tests: "these
requests run, those wait" without racing the decode loop).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Optional

from dsv41_jax.serving.engine import Engine, EngineError, EngineInternalError, QueueFullError, RequestOutput
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineInternalError", "QueueFullError"]

log = logging.getLogger("dsv41_jax.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in a step, or shutdown)."""


class AsyncEngine:
    """Thread-backed asyncio wrapper of `Engine`."""

    def __init__(self, engine_or_args=None, *, max_queued_requests: Optional[int] = None, start: bool = True,
                 **engine_kw):
        if isinstance(engine_or_args, Engine):
            self.engine = engine_or_args
        else:
            self.engine = Engine(engine_or_args, **engine_kw)
        self.max_queued_requests = (max_queued_requests if max_queued_requests is not None
                                    else self.engine.args.max_queued_requests)
        self._cmds: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict = {}
        self._n_pending_adds = 0
        self._budget: Optional[int] = None  # steps left before holding (None: run freely, 0: paused)
        self._budget_done: list = []  # events of resume(steps=N) calls, set when the budget is spent
        self._stop = False
        self._dead: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self.start_time = time.time()
        if start:
            self.start()

    # ------------------------------------------------------------------------------------ loop
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv41-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()  # (a multi-process leader: its followers stop)
        if getattr(self.engine.runner, "expert_recorder", None) is not None:  # --expert-distribution-recorder
            try:
                self.expert_distribution("dump")
            except EngineError as e:  # (logged: shutdown goes on)
                log.error("%s", e)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _deliver(self, rid, item) -> None:
        st = self._streams.get(rid)
        if st is None:
            return
        loop, q = st
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            self._streams.pop(rid, None)

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop:
                while True:
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(cmd)
                if self._budget and not eng.has_unfinished():
                    self._spend_budget(all_of_it=True)  # resume(steps=N) with nothing left to run
                if eng.has_unfinished() and self._budget != 0:
                    with self._lock:
                        outs = eng.step()
                    for o in outs:
                        self._deliver(o.request_id, EngineInternalError(o.error) if o.error else o)
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                    if self._budget is not None:
                        self._spend_budget()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 (report to every waiting request)
            log.exception("engine loop died")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop died: {e!r}"))
            self._streams.clear()

    def _spend_budget(self, all_of_it: bool = False) -> None:
        self._budget = 0 if all_of_it else self._budget - 1
        if self._budget == 0:
            for ev in self._budget_done:
                ev.set()
            self._budget_done.clear()

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt_ids, params, constraint, drop_ids, handover_kw = cmd
            try:
                with self._lock:
                    self.engine.add_request(rid, prompt_ids, params, constraint=constraint, output_kind="delta",
                                            drop_token_ids=drop_ids, **handover_kw)
            except Exception as e:  # noqa: BLE001 (the request's own error)
                self._deliver(rid, e)
                self._streams.pop(rid, None)
            finally:
                # only now: until the engine holds it, the request counts as pending (never as neither,
                # which would let `num_queued` undercount and one request too many past the limit)
                self._n_pending_adds -= 1
        elif kind == "abort":
            with self._lock:
                self.engine.abort_request(cmd[1])
        elif kind == "pause":
            self._budget = 0
            cmd[1].set()
        elif kind == "resume":
            _, steps, ev = cmd
            self._budget = steps
            if steps is None:
                ev.set()
            else:
                self._budget_done.append(ev)
                if steps == 0:
                    self._spend_budget(all_of_it=True)

    # ------------------------------------------------------------------------------------ API
    def num_queued(self) -> int:
        """Samples waiting for admission plus requests not yet handed to the loop (lock-free: a
        deque's length is read atomically)."""
        return len(self.engine.scheduler.waiting) + max(self._n_pending_adds, 0)

    async def generate(self, prompt_ids, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, constraint=None,
                       drop_token_ids=(), handover: bool = False, prefilled=None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: each `RequestOutput` holds the new text / tokens / logprobs
        of the samples that advanced (``outputs[i].index`` tells which); the last has
        ``finished=True`` and the finish reasons. drop_token_ids: ids left out of the text.
        handover / prefilled: prefill/decode disaggregation (`Engine.add_request`)."""
        if self._dead is not None or self._thread is None:
            raise EngineDeadError("the engine loop is not running")
        if self.max_queued_requests is not None and self.num_queued() >= self.max_queued_requests:
            raise QueueFullError(f"{self.num_queued()} requests are waiting (max_queued_requests="
                                 f"{self.max_queued_requests})")
        if isinstance(prompt_ids, str):
            prompt_ids = self.engine.tokenizer.encode(prompt_ids)
        params = sampling_params or SamplingParams()
        params.validate(max_logprobs=self.engine.max_logprobs, vocab_size=self.engine.vocab_size)
        rid = request_id or f"req-{id(object())}-{time.monotonic_ns()}"
        if rid in self._streams:
            raise EngineError(f"request_id {rid!r} is already in use")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (loop, q)
        self._n_pending_adds += 1
        handover_kw = {"handover": True} if handover else {"prefilled": prefilled} if prefilled is not None else {}
        self._cmds.put(("add", rid, list(prompt_ids), params, constraint, tuple(drop_token_ids), handover_kw))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(rid, None)
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe; its pages are freed by the loop thread)."""
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def pause(self) -> threading.Event:
        """Hold the loop between steps (see the module docstring). Returns an event set once the loop
        has taken the pause: from then on no step runs until `resume`."""
        ev = threading.Event()
        self._cmds.put(("pause", ev))
        self._wake.set()
        return ev

    def resume(self, steps: Optional[int] = None) -> threading.Event:
        """Run freely again (steps=None), or run `steps` more steps and hold again (fewer if the engine
        runs out of work). Returns an event set when the loop runs freely / when those steps are done."""
        if steps is not None and steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        ev = threading.Event()
        self._cmds.put(("resume", steps, ev))
        self._wake.set()
        return ev

    def expert_distribution(self, action: str) -> dict:
        """The expert distribution recorder (`Engine.start_expert_distribution_record` / ``stop_...`` /
        ``dump_...``; action "start", "stop" or "dump"), between engine steps. EngineError when it is off."""
        if action not in ("start", "stop", "dump"):
            raise ValueError(f"expert_distribution: unknown action {action!r}")
        with self._lock:
            return getattr(self.engine, f"{action}_expert_distribution_record")()

    @property
    def paused(self) -> bool:
        return self._budget is not None

    def stats(self) -> dict:
        """Engine metrics (see `Engine.stats`) plus uptime and queue limit."""
        with self._lock:
            s = self.engine.stats()
        s["num_queue_reqs"] = self.num_queued()
        s["max_queued_requests"] = self.max_queued_requests
        s["uptime_s"] = time.time() - self.start_time
        s["engine_alive"] = self.is_running
        s["paused"] = self.paused
        return s

    @property
    def tokenizer(self):
        return self.engine.tokenizer
