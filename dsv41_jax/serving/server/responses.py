"""The generation endpoints' common part: one engine run per request, its choices, and the two ways
out -- a JSON body, or a server-sent-event stream -- with the error and disconnect handling both share.

* `Choice` accumulates one choice from the engine's delta outputs: token ids, logprobs, the text and
  each token's text offset (both from the engine's detokenizer: the server never decodes generated
  ids itself), the finish;
* `GenerationRun` drives a request's engine streams (one per prompt; ``n`` choices each) and yields
  every choice update; it counts usage and reports to the metrics;
* `json_response` runs a non-streaming request, aborting it in the engine if the client goes away
  (then HTTP 499); `sse_response` frames a stream (``data: {...}\\n\\n`` chunks, then
  ``data: [DONE]``): an error after the headers are sent becomes an error event, a client that
  disconnects gets its requests aborted, so their KV pages return to the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsv41_jax.serving.protocol import APIError, error_body, usage_dict

from .context import ServerContext, merged

__all__ = ["Choice", "DONE", "Envelope", "GenerationRun", "json_response", "logprob", "sse", "sse_response"]

log = logging.getLogger("dsv41_jax.serve")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def logprob(x: float) -> float:
    """A logprob as JSON takes it: -inf and NaN (not JSON) become -9999.0."""
    x = float(x)
    if x != x:
        return -9999.0
    return max(x, -9999.0)


class Envelope:
    """The fields around the choices of one request's response and of each of its stream chunks."""

    def __init__(self, rid: str, model: str, chunk_object: str, include_usage: bool):
        self.rid, self.model, self.chunk_object, self.include_usage = rid, model, chunk_object, include_usage
        self.created = int(time.time())

    def body(self, obj: str, items: list, **extra: Any) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": items,
                **extra}

    def chunk(self, items: list, usage: Any = None) -> dict:
        """A stream chunk; it carries ``usage`` (null but in the last) with ``include_usage``."""
        return self.body(self.chunk_object, items, **({"usage": usage} if self.include_usage else {}))


class Choice:
    """One choice of a request, accumulated from the engine's delta outputs (`CompletionOutput`)."""

    def __init__(self, index: int):
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.top_logprobs: list = []  # per token: [(token_id, logprob), ...] or None
        self.text_offsets: list[int] = []  # per token: where its text starts in `text`
        self.text = ""
        self.prompt_logprobs: Optional[list] = None  # echo + logprobs (completions)
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.done = False

    def add(self, c: Any) -> str:
        """Take one delta output; returns its new text."""
        ids = list(c.token_ids)
        self.token_ids.extend(ids)
        if c.logprobs is not None:
            self.logprobs.extend(c.logprobs)
            self.top_logprobs.extend(c.top_logprobs or [None] * len(c.logprobs))
        offs = list(c.text_offsets) if c.text_offsets is not None else []
        self.text_offsets.extend(offs[:len(ids)] + [len(self.text)] * (len(ids) - len(offs)))
        text = c.text or ""
        self.text += text
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.done = c.finish_reason, c.stop_reason, True
        return text

    def end(self, reason: str = "abort") -> None:
        """The engine stream ended without finishing this choice (aborted)."""
        self.finish_reason, self.done = reason, True


class GenerationRun:
    """One request's generation: an engine stream per prompt, ``n`` choices per prompt (choice
    ``k * n + j`` is sample j of prompt k), usage and metrics.

    make_choice(index) -> a `Choice` (chat's adds its parsers); drop_ids: token ids the engine leaves
    out of the text; arrival: the request's arrival (`time.perf_counter`), for the latency metrics."""

    def __init__(self, ctx: ServerContext, rid: str, prompts_ids: list, sps: list, constraints: list, n: int, *,
                 make_choice: Callable[[int], Choice] = Choice, drop_ids: frozenset = frozenset(),
                 arrival: Optional[float] = None):
        self.ctx, self.rid, self.prompts_ids, self.sps, self.constraints, self.n = ctx, rid, prompts_ids, sps, \
            constraints, n
        self.rids = [rid if len(prompts_ids) == 1 else f"{rid}-{k}" for k in range(len(prompts_ids))]
        self.choices = [make_choice(k * n + j) for k in range(len(prompts_ids)) for j in range(n)]
        self.drop_ids = drop_ids
        self.cached: dict = {}  # per prompt: tokens served from the prefix cache
        self.timer = ctx.metrics.timer() if ctx.metrics is not None else None
        if self.timer is not None and arrival is not None:
            self.timer.arrival = arrival

    async def updates(self) -> AsyncIterator[tuple[Choice, str, int, int]]:
        """(choice, new text, first new token, end) for every engine update of a choice; choices the
        engine streams leave unfinished end with "abort"."""
        ctx, n, choices = self.ctx, self.n, self.choices
        streams = [ctx.generate(ids, self.sps[k], self.rids[k], self.constraints[k], self.drop_ids)
                   for k, ids in enumerate(self.prompts_ids)]
        ctx.state.inflight += len(streams)
        try:
            async for k, out in merged(streams):
                if out.num_cached_tokens is not None:
                    self.cached[k] = out.num_cached_tokens
                for c in out.outputs:
                    if not (0 <= c.index < n):
                        continue
                    ch = choices[k * n + c.index]
                    if out.prompt_logprobs is not None:
                        ch.prompt_logprobs = out.prompt_logprobs
                    if ch.done:
                        continue
                    start = len(ch.token_ids)
                    if self.timer is not None:
                        self.timer.tokens(len(c.token_ids))
                    text = ch.add(c)
                    yield ch, text, start, len(ch.token_ids)
                if all(c.done for c in choices):
                    break
        finally:
            ctx.state.inflight -= len(streams)
        for ch in choices:
            if not ch.done:
                ch.end("abort")
                yield ch, "", len(ch.token_ids), len(ch.token_ids)

    def usage(self, reasoning_tokens: Optional[int] = None) -> dict:
        return usage_dict(sum(len(p) for p in self.prompts_ids), sum(len(c.token_ids) for c in self.choices),
                          reasoning_tokens, cached_tokens=sum(self.cached.values()) if self.cached else None)

    def finished(self, finish_reasons: list, reasoning_tokens: int = 0) -> None:
        """Report the finished request to the metrics."""
        m = self.ctx.metrics
        if m is not None:
            m.finished(finish_reasons, sum(len(p) for p in self.prompts_ids), reasoning_tokens)
            self.timer.finish()


async def _watch_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


async def json_response(ctx: ServerContext, request: Request, run: GenerationRun,
                        build: Callable[[], dict]) -> Response:
    """A non-streaming answer: drain ``run``, then ``build()`` the body (an `APIError` from either
    is the response). A client that goes away meanwhile gets its requests aborted (HTTP 499)."""

    async def collect():
        try:
            async for _ in run.updates():
                pass
            return JSONResponse(build())
        except APIError as e:
            return ctx.err(e)

    task = asyncio.create_task(collect())
    watcher = asyncio.create_task(_watch_disconnect(request))
    key = run.rids[0]
    ctx.state.active[key] = task
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001
            pass
        for rid in run.rids:
            await ctx.abort(rid)
        if ctx.metrics is not None:
            ctx.metrics.aborted()
        log.info("client disconnected; aborted %s", ", ".join(run.rids))
        return Response(status_code=499)
    except asyncio.CancelledError:
        for rid in run.rids:
            await ctx.abort(rid)
        raise
    finally:
        watcher.cancel()
        ctx.state.active.pop(key, None)


def sse_response(ctx: ServerContext, run: GenerationRun, events: AsyncIterator[bytes]) -> StreamingResponse:
    """A streaming answer: the ``events`` (SSE chunks) then ``data: [DONE]``. An `APIError` or any
    other failure once streaming has begun is sent as an error event (then ``[DONE]``); a stream the
    client closes early aborts the run's requests in the engine."""

    async def body() -> AsyncIterator[bytes]:
        finished_ok = False
        ctx.state.active[run.rid] = asyncio.current_task()
        try:
            async for chunk in events:
                yield chunk
            finished_ok = True
            yield DONE
        except APIError as e:
            yield sse(e.body())
            yield DONE
            finished_ok = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("%s: generation failed", run.rid)
            yield sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error", None,
                                 "internal_error"))
            yield DONE
            finished_ok = True
        finally:
            ctx.state.active.pop(run.rid, None)
            if not finished_ok:
                for r in run.rids:
                    await ctx.abort(r)
                if ctx.metrics is not None:
                    ctx.metrics.aborted()
                log.info("%s: stream closed early; aborted", run.rid)

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
