"""The OpenAI-compatible HTTP server (FastAPI on uvicorn): an ASGI app factory.

:func:`build_app` wires an engine (``AsyncEngine``: ``generate`` / ``abort`` / ``stats``), the
tokenizer, the chat layer (:mod:`chat`, :mod:`effort`, :mod:`reasoning`, :mod:`tools`), constrained
decoding (:mod:`constrained`) and metrics (:mod:`metrics`) into these endpoints:

* ``POST /v1/chat/completions`` — V4.1 chat encoding, the ``deepseek-v41`` reasoning parser into
  ``reasoning_content``, the ``deepseekv41`` DSML tool-call parser into ``tool_calls``;
  ``response_format`` / ``tool_choice`` required-or-named enforced by llguidance masks; SSE
  streaming with ``stream_options.include_usage`` and a final ``data: [DONE]``;
* ``POST /v1/completions`` — raw prompts (strings or token ids, one or several), ``echo``;
* ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's spelling; lm-eval's
  ``tokenizer_backend=remote``);
* ``GET /v1/models``, ``GET /health`` (no API key), ``GET /metrics`` (``enable_metrics``; otherwise a 404 saying how to turn it on).

Errors are OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
input (the server keeps serving), 401 for a missing / wrong Bearer key, 404 for an unknown model or
route, 413 for a body over ``max_body_bytes``, 503 when the queue is full or the server is draining.
A client that disconnects (streaming or not) gets its request aborted in the engine, so its KV pages
return to the pool.

Text: one detokenizer per choice, `output.TextStream` (incremental, never a broken UTF-8 sequence). With
our engine (``engine.detokenizes``) it runs in the engine's output processor, told which ids to leave
out (``drop_token_ids``), and the server uses the engine's text deltas; with another engine (one that
yields token ids only) the server runs the same `TextStream` on the ids itself. While tools are given or the request thinks, special tokens are kept (SPEC
§10: otherwise ``｜DSML｜`` / ``</think>`` vanish and the parsers cannot see the markup) and every
special token other than ``<think>``, ``</think>`` and ``｜DSML｜`` is dropped; the stop token that
ended a choice is never text. Stop strings are matched on that text (the engine also stops on them).
Usage counts every generated token; ``reasoning_tokens`` those before ``</think>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41_jax.chat_format.encoding import EncodedChat, encode_chat_request
from dsv41_jax.chat_format.effort import ChatError, ServerDefaults
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import (
    APIError,
    ChatRequest,
    check_context,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    usage_dict,
)
from .reasoning import ChatOutputParser
from .engine import EngineInternalError, QueueFullError  # QueueFullError: the server's own limit too (503)
from .sampling import SamplingParamsError

__all__ = ["ServerConfig", "build_app", "QueueFullError", "EngineOutput", "ChoiceUpdate"]

log = logging.getLogger("dsv41_jax.serve")

# the special tokens that carry structure for the parsers; every other special token is dropped
# from generated text when the request decodes with special tokens kept
_STRUCTURAL_SPECIALS = ("<think>", "</think>", "｜DSML｜")


@dataclass
class ServerConfig:
    """Everything the app needs besides the engine and the tokenizer."""

    model_name: str = "tiny"
    model_aliases: Sequence[str] = ()
    api_key: Optional[str] = None
    context_length: int = 4096
    vocab_size: Optional[int] = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_queued_requests: Optional[int] = None  # waiting requests beyond the running batch; None: no limit
    max_running_requests: Optional[int] = None
    reasoning_parser: Optional[str] = "deepseek-v41"  # None: everything is content
    tool_call_parser: Optional[str] = "deepseekv41"  # None: no tool parsing
    server_defaults: ServerDefaults = field(default_factory=ServerDefaults)
    wording: Any = None
    enable_metrics: bool = False
    render_response_format: bool = False
    max_n: int = 128
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "dsv41_jax"


# --------------------------------------------------------------------------- engine adaptation


@dataclass
class ChoiceUpdate:
    """One choice's progress in one engine output: new tokens, their logprobs, maybe the end."""

    index: int
    token_ids: list
    text: Optional[str] = None  # the engine's text delta (None: the server detokenizes)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    logprobs: Optional[list] = None  # per new token: float
    top_logprobs: Optional[list] = None  # per new token: list[(token_id, logprob)]
    cached_tokens: Optional[int] = None


@dataclass
class EngineOutput:
    choices: list
    finished: bool = False
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    # per prompt token: None (the first) or (logprob, [(token_id, logprob), ...]); see RequestOutput
    prompt_logprobs: Optional[list] = None


def _get(o: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(o, Mapping):
            if n in o:
                return o[n]
        elif hasattr(o, n):
            return getattr(o, n)
    return default


def _norm_top(x: Any) -> Optional[list]:
    """Top logprobs of one token as [(id, logprob)]: from a dict {id: lp}, pairs or two arrays."""
    if x is None:
        return None
    if isinstance(x, Mapping):
        return [(int(k), float(_get(v, "logprob", default=v) if not isinstance(v, (int, float)) else v))
                for k, v in x.items()]
    out = []
    for item in x:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            out.append((int(item[0]), float(item[1])))
        else:
            tid = _get(item, "token_id", "id")
            lp = _get(item, "logprob")
            if tid is not None and lp is not None:
                out.append((int(tid), float(lp)))
    return out


def normalize_output(out: Any) -> EngineOutput:
    """Turn whatever the engine yields into :class:`EngineOutput` (delta token ids per choice).

    Accepts vLLM-style objects (``.outputs`` of per-choice ``index`` / ``token_ids`` / ``text`` /
    ``finish_reason`` / ``logprobs``), a single per-choice object, or dicts of the same names.
    """
    if isinstance(out, EngineOutput):
        return out
    raw = _get(out, "outputs", "choices")
    items = list(raw) if raw is not None else [out]
    choices = []
    for k, o in enumerate(items):
        idx = _get(o, "index", "choice_index", default=k)
        ids = _get(o, "new_token_ids", "delta_token_ids", "token_ids", default=[]) or []
        ids = [int(t) for t in ids]
        text = _get(o, "text_delta", "delta_text", "new_text", "text")
        lps = _get(o, "new_logprobs", "logprobs")
        tops = _get(o, "new_top_logprobs", "top_logprobs")
        logprobs = top_logprobs = None
        if lps is not None:
            logprobs, top_logprobs = [], []
            for j, lp in enumerate(lps):
                if isinstance(lp, (int, float)):
                    logprobs.append(float(lp))
                    top_logprobs.append(_norm_top(tops[j]) if tops is not None and j < len(tops) else None)
                elif isinstance(lp, Mapping) and ids and j < len(ids):  # vLLM: {token_id: Logprob}
                    v = lp.get(ids[j])
                    logprobs.append(float(_get(v, "logprob", default=v)) if v is not None else float("nan"))
                    top_logprobs.append(_norm_top({t: x for t, x in lp.items()}))
                else:
                    logprobs.append(float(_get(lp, "logprob", default=float("nan"))))
                    top_logprobs.append(_norm_top(_get(lp, "top_logprobs", "top")))
        choices.append(ChoiceUpdate(int(idx), ids, text, _get(o, "finish_reason"), _get(o, "stop_reason"),
                                    logprobs, top_logprobs))
    finished = bool(_get(out, "finished", default=False))
    return EngineOutput(choices, finished, _get(out, "num_prompt_tokens", "prompt_tokens"),
                        _get(out, "num_cached_tokens", "cached_tokens"), _get(out, "prompt_logprobs"))


# ----------------------------------------------------------------------------- per-choice state


def _byte_decoder() -> dict:
    """GPT-2's byte <-> unicode table, reversed (ByteLevel BPE token text -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _TokenText:
    """Exact bytes / display strings of single tokens (for logprobs)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, bytes] = {}
        self._special = frozenset(getattr(tokenizer, "special_token_ids", ()) or ())
        self._bytelevel = False
        try:
            dec = json.loads(tokenizer.hf.to_str()).get("decoder") or {}
            kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders") or []]
            self._bytelevel = "ByteLevel" in kinds
        except Exception:
            pass
        self._bmap = _byte_decoder() if self._bytelevel else {}

    def bytes(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = b""
            try:
                piece = self.tok.id_to_token(tid)
                if piece is not None and self._bytelevel and tid not in self._special and \
                        all(ch in self._bmap for ch in piece):
                    b = bytes(self._bmap[ch] for ch in piece)
                else:
                    b = self.tok.decode([tid], skip_special_tokens=False).encode("utf-8")
            except Exception:
                b = b""
            self._cache[tid] = b
        return b

    def text(self, tid: int) -> str:
        return self.bytes(tid).decode("utf-8", errors="replace")


class _Choice:
    """Server-side state of one choice: detokenizer, stop strings, parsers, counters."""

    def __init__(self, index: int, tokenizer: Any, prompt_ids: Sequence[int], sp: Any, *, keep_special: bool,
                 drop_ids: frozenset, parser: Optional[ChatOutputParser], think_close_id: Optional[int],
                 thinking: bool, engine_text: bool = False):
        from .output import TextStream

        self.index = index
        # engine_text: the engine detokenizes (the same TextStream, with these drop ids) and its text
        # deltas are used as they are; else this one runs on the token ids
        self.engine_text = engine_text
        self.detok = TextStream(tokenizer, prompt_ids, skip_special_tokens=not keep_special, stop=sp.stop,
                                include_stop_str_in_output=sp.include_stop_str_in_output, min_tokens=sp.min_tokens,
                                drop_ids=drop_ids)
        self.drop_ids = drop_ids
        self.parser = parser
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.top_logprobs: list = []
        self.prompt_logprobs: Optional[list] = None  # echo + logprobs (completions)
        self.finish_reason: Optional[str] = None
        self.stop_reason: Any = None
        self.think_close_id = think_close_id
        self.thinking = thinking
        self.reasoning_tokens = 0
        self._reasoning_open = thinking and parser is not None and parser.in_reasoning
        self.text = ""  # the full detokenized text (after stop handling)
        self.done = False
        self.reasoning_acc = ""  # parsed parts so far (chat)
        self.content_acc = ""

    def add(self, upd: ChoiceUpdate) -> str:
        """Feed new tokens; returns the new text (stop strings applied)."""
        if self.done:
            return ""
        ids = upd.token_ids
        self.token_ids.extend(ids)
        if upd.logprobs is not None:
            self.logprobs.extend(upd.logprobs)
            tops = upd.top_logprobs or [None] * len(upd.logprobs)
            self.top_logprobs.extend(tops)
        if upd.finish_reason is not None and isinstance(upd.stop_reason, int) and ids and ids[-1] == upd.stop_reason:
            ids = ids[:-1]  # the stop token (EOS) that ended the choice is not text
        if self._reasoning_open:
            for t in ids:
                if t == self.think_close_id:
                    self._reasoning_open = False
                    break
                self.reasoning_tokens += 1
        if self.engine_text:  # the engine's TextStream already applied stops and drop ids
            text = upd.text or ""
            if upd.finish_reason is not None:
                self.finish_reason, self.stop_reason, self.done = upd.finish_reason, upd.stop_reason, True
            self.text += text
            return text
        text = self.detok.add(ids)
        if self.detok.stopped and upd.finish_reason is None:
            upd.finish_reason = "stop"
            upd.stop_reason = self.detok.stop_str
        if upd.finish_reason is not None:
            text += self.detok.finish()
            self.finish_reason = upd.finish_reason
            if self.detok.stopped:
                self.finish_reason = "stop"
                self.stop_reason = self.detok.stop_str
            else:
                self.stop_reason = upd.stop_reason
            self.done = True
        self.text += text
        return text

    @property
    def stopped_here(self) -> bool:
        """A stop string matched by the server's own detokenizer (the engine must be told to stop)."""
        return not self.engine_text and self.detok.stopped

    def reasoning_progress(self) -> None:
        # an implicit close (a DSML block inside reasoning) ends reasoning at the parser's word
        if self._reasoning_open and self.parser is not None and not self.parser.in_reasoning:
            self._reasoning_open = False


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


_DONE = b"data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------ app


class _State:
    def __init__(self):
        self.inflight = 0
        self.draining = False
        self.active: dict[str, asyncio.Task] = {}


def build_app(engine: Any, tokenizer: Any, config: ServerConfig, *, grammar: Any = None,
              metrics: Optional[ServerMetrics] = None, on_shutdown: Optional[Callable[[], Any]] = None,
              queue_full_errors: tuple = (), bad_request_errors: tuple = ()):
    """The ASGI app. ``engine`` needs ``generate(prompt_ids, sampling_params, request_id,
    constraint=None)`` (an async iterator), ``abort(request_id)`` and optionally ``stats()``;
    ``grammar`` is a :class:`dsv41_jax.serving.constrained.GrammarCompiler` (None: constrained
    decoding unavailable, such requests get a 400). ``queue_full_errors``: the engine's exception
    types that mean "queue full" (-> 503); ``bad_request_errors``: those that refuse a request's
    input (-> 400)."""

    cfg = config
    state = _State()
    if metrics is None and cfg.enable_metrics:
        stats_fn = getattr(engine, "stats", None)
        metrics = ServerMetrics(_stats_dict(stats_fn) if stats_fn else None, model_name=cfg.model_name)
    names = {cfg.model_name, *cfg.model_aliases}
    token_text = _TokenText(tokenizer)
    queue_errors = tuple(queue_full_errors) + (QueueFullError,)
    input_errors = tuple(bad_request_errors) + (SamplingParamsError,)
    vocab = cfg.vocab_size or getattr(tokenizer, "vocab_size", None)
    special_ids = frozenset(getattr(tokenizer, "special_token_ids", ()) or ())
    structural = {tokenizer.token_to_id(s) for s in _STRUCTURAL_SPECIALS} - {None}
    drop_when_kept = frozenset(special_ids - structural)
    think_close_id = tokenizer.token_to_id("</think>")

    @asynccontextmanager
    async def lifespan(app):
        yield
        state.draining = True
        for task in list(state.active.values()):
            task.cancel()
        if on_shutdown is not None:
            r = on_shutdown()
            if asyncio.iscoroutine(r):
                await r

    app = FastAPI(title="dsv41_jax OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server_state = state
    app.state.metrics = metrics
    app.state.config = cfg

    def err(e: APIError, endpoint: str = "") -> JSONResponse:
        if metrics is not None:
            metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request, exc):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(msg, "invalid_request_error" if exc.status_code < 500 else "server_error",
                                       None, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _any_exc(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, 500),
                            status_code=500)

    # ------------------------------------------------------------------ simple endpoints

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(error_body("server is shutting down", "service_unavailable_error", None, 503),
                                status_code=503)
        if getattr(engine, "is_running", True) is False:
            return JSONResponse(error_body("the engine loop is not running", "service_unavailable_error", None,
                                           503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        data = [{"id": cfg.model_name, "object": "model", "created": cfg.created, "owned_by": cfg.owned_by,
                 "root": cfg.model_name, "max_model_len": cfg.context_length}]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        if model_id not in names:
            return err(_model_not_found(model_id))
        return JSONResponse({"id": cfg.model_name, "object": "model", "created": cfg.created,
                             "owned_by": cfg.owned_by, "root": cfg.model_name, "max_model_len": cfg.context_length})

    if cfg.enable_metrics and metrics is not None:
        @app.get("/metrics")
        async def metrics_endpoint():
            # engine.stats() waits for the current engine step: off the event loop
            return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)
    else:
        @app.get("/metrics")
        async def metrics_off():  # a 404 that says why, instead of "no route"
            return err(APIError(404, "metrics are off on this server: start it without --disable-metrics "
                                     "(python -m dsv41_jax.serve serves /metrics by default)",
                                type="invalid_request_error", code="metrics_disabled"))

    if callable(getattr(engine, "pause", None)) and callable(getattr(engine, "resume", None)):
        # SGLang's names. Requests keep arriving (and waiting) while paused; aborts still free pages.
        @app.post("/pause_generation")
        async def pause_generation():
            """Hold the engine between steps; answers once no step runs (or 504 after 60 s)."""
            if not await asyncio.to_thread(engine.pause().wait, 60.0):
                return err(APIError(504, "the engine loop did not take the pause within 60 s", code="timeout"))
            return JSONResponse({"paused": True})

        @app.post("/continue_generation")
        async def continue_generation(request: Request):
            """Run freely again; with a JSON body {"steps": N}: run N engine steps, hold again, and answer
            when they are done (fewer steps if the engine runs out of work)."""
            raw = await request.body()
            try:
                steps = parse_json_body(raw).get("steps") if raw.strip() else None
                if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
                    raise APIError.bad_request("steps must be a non-negative integer", "steps")
            except APIError as e:
                return err(e)
            if not await asyncio.to_thread(engine.resume(steps).wait, 60.0):
                return err(APIError(504, "the engine did not finish the steps within 60 s", code="timeout"))
            return JSONResponse({"paused": steps is not None})

    # ------------------------------------------------------------------ helpers

    def check_model(model: Optional[str]) -> None:
        if model is not None and model not in names:
            raise _model_not_found(model)

    def admit(n_requests: int = 1) -> None:
        if state.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if cfg.max_queued_requests is None:
            return
        running_cap = cfg.max_running_requests or 0
        nq = getattr(engine, "num_queued", None)
        queued = None
        if callable(nq):  # cheap and lock-free (stats() waits for the engine step)
            for _ in range(3):
                try:
                    queued = nq()
                    break
                except RuntimeError:  # the engine thread changed its queue while we counted
                    continue
        else:
            queued = _first_num(_safe_stats(engine), ("num_queue_reqs", "queued", "waiting", "num_waiting"))
        if queued is None:  # estimate: everything beyond the running batch waits
            queued = max(0, state.inflight - running_cap)
        if queued >= cfg.max_queued_requests:  # no room for one more (as the engine's own check)
            raise APIError(503, f"the request queue is full ({cfg.max_queued_requests} waiting); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        return parse_json_body(raw)

    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    engine_text = bool(getattr(engine, "detokenizes", False))

    async def run_generation(prompt_ids: list, sp: Any, rid: str, constraint: Any,
                             drop_ids: frozenset = frozenset()) -> AsyncIterator[EngineOutput]:
        kwargs = {}
        if constraint is not None:
            kwargs["constraint"] = constraint
        if engine_text and drop_ids:
            kwargs["drop_token_ids"] = sorted(drop_ids)
        try:
            gen = engine.generate(prompt_ids, sp, rid, **kwargs)
            if asyncio.iscoroutine(gen):
                gen = await gen
            async for out in gen:
                yield normalize_output(out)
        except queue_errors as e:
            raise APIError(503, f"the request queue is full; retry later ({e})", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except input_errors as e:
            raise APIError.bad_request(str(e), getattr(e, "field", None)) from None
        except EngineInternalError as e:  # the engine ended the request: an error, not a short answer
            raise APIError(500, str(e), code="internal_error") from None

    async def abort(rid: str) -> None:
        try:
            r = engine.abort(rid)
            if asyncio.iscoroutine(r):
                await r
        except Exception:  # already finished / unknown id
            log.debug("abort(%s) failed", rid, exc_info=True)

    async def merged(streams: list) -> AsyncIterator[tuple[int, EngineOutput]]:
        """Interleave several engine streams (one per prompt) as (stream index, output)."""
        if len(streams) == 1:
            async for o in streams[0]:
                yield 0, o
            return
        q: asyncio.Queue = asyncio.Queue()
        sentinel = object()

        async def pump(k, s):
            try:
                async for o in s:
                    await q.put((k, o))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await q.put((k, e))
            finally:
                await q.put((k, sentinel))

        tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
        live = len(tasks)
        try:
            while live:
                k, o = await q.get()
                if o is sentinel:
                    live -= 1
                    continue
                if isinstance(o, BaseException):
                    raise o
                yield k, o
        finally:
            for t in tasks:
                t.cancel()

    async def watch_disconnect(request: Request) -> None:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                return

    async def guarded(request: Request, coro_fn, rids: list):
        """Run a non-streaming request; abort it in the engine if the client goes away."""
        task = asyncio.create_task(coro_fn())
        watcher = asyncio.create_task(watch_disconnect(request))
        key = rids[0]
        state.active[key] = task
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001
                pass
            for rid in rids:
                await abort(rid)
            if metrics is not None:
                metrics.aborted()
            log.info("client disconnected; aborted %s", ", ".join(rids))
            return Response(status_code=499)
        except asyncio.CancelledError:
            for rid in rids:
                await abort(rid)
            raise
        finally:
            watcher.cancel()
            state.active.pop(key, None)

    def logprobs_chat(ch: _Choice, start: int, end: int, top: int) -> list:
        out = []
        for j in range(start, min(end, len(ch.logprobs))):
            tid = ch.token_ids[j]
            b = token_text.bytes(tid)
            item = {"token": b.decode("utf-8", errors="replace"), "logprob": _lp(ch.logprobs[j]), "bytes": list(b),
                    "top_logprobs": []}
            tops = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
            for t, lp in (tops or [])[:top]:
                tb = token_text.bytes(t)
                item["top_logprobs"].append({"token": tb.decode("utf-8", errors="replace"), "logprob": _lp(lp),
                                             "bytes": list(tb)})
            out.append(item)
        return out

    def logprobs_completion(ch: _Choice, start: int, end: int, top: int, offset0: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        off = offset0
        for j in range(start, min(end, len(ch.logprobs))):
            tid = ch.token_ids[j]
            s = token_text.text(tid)
            toks.append(s)
            lps.append(_lp(ch.logprobs[j]))
            t = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
            tops.append({token_text.text(a): _lp(b) for a, b in (t or [])[:top]} if top else None)
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops if top else None, "text_offset": offs}

    def _top_dict(pairs: list, tid: int, lp: float) -> dict:
        """{token text: logprob} of the top-k plus the token itself (as vLLM); a text shared by
        several ids keeps its highest logprob."""
        d: dict = {}
        for a, b in list(pairs) + [(tid, lp)]:
            key, v = token_text.text(a), _lp(b)
            if key not in d or v > d[key]:
                d[key] = v
        return d

    def logprobs_echo(ch: _Choice, prompt_ids: list, top: int, echo_len: int) -> dict:
        """Completions ``echo`` + ``logprobs``: the prompt's tokens (the first with a null logprob
        and null top_logprobs, as OpenAI / vLLM) and then the generated ones; text offsets are the
        cumulative lengths of the token strings from the start of the echoed prompt (the generated
        ones from ``echo_len``, the echoed text's length)."""
        plp = ch.prompt_logprobs or [None] * len(prompt_ids)
        toks, lps, tops, offs = [], [], [], []
        off = 0
        for i, tid in enumerate(prompt_ids):
            s = token_text.text(tid)
            toks.append(s)
            offs.append(off)
            off += len(s)
            e = plp[i] if i < len(plp) else None
            if i == 0 or e is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(_lp(e[0]))
                tops.append(_top_dict(e[1][:top], tid, e[0]))
        # the generated text starts after the echoed prompt; where the prompt's token strings are
        # longer than its decoded text (partial UTF-8 pieces), offsets stay monotone
        off = max(echo_len, off)
        for j in range(min(len(ch.token_ids), len(ch.logprobs))):
            tid = ch.token_ids[j]
            s = token_text.text(tid)
            toks.append(s)
            offs.append(off)
            off += len(s)
            lps.append(_lp(ch.logprobs[j]))
            t = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
            tops.append(_top_dict((t or [])[:top], tid, ch.logprobs[j]))
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    # ------------------------------------------------------------------ tokenizer endpoints

    def _tok_ids(text: str, add_special: bool) -> list:
        ids = list(tokenizer.encode(text))
        bos = getattr(tokenizer, "bos_token_id", None)
        if add_special and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def prepare_tokenize(body: dict) -> dict:
        check_model(body.get("model"))
        if ("prompt" in body) == ("messages" in body):
            raise APIError.bad_request("give exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt")
        add_special = body.get("add_special_tokens")
        if add_special is not None and not isinstance(add_special, bool):
            raise APIError.bad_request("add_special_tokens must be a boolean", "add_special_tokens")
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise APIError.bad_request("prompt must be a string", "prompt")
            ids = _tok_ids(body["prompt"], bool(add_special))  # vLLM's default for prompts: True; ours: no BOS
        else:  # the chat's prompt exactly as /v1/chat/completions encodes it (it carries its own BOS)
            chat_body = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs")}
            try:
                enc = encode_chat_request(chat_body, wording=cfg.wording, server_defaults=cfg.server_defaults,
                                          render_response_format=cfg.render_response_format)
            except ChatError as e:
                raise APIError.from_chat_error(e) from None
            ids = _tok_ids(enc.prompt, bool(add_special))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": cfg.context_length, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
        return out

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM / SGLang ``/tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (encoded as the
        chat endpoint does), ``add_special_tokens`` (default false: the BOS is not added to a prompt;
        chat prompts already start with it) -> ``{"tokens": [int], "count", "max_model_len"}``."""
        try:
            body = await read_body(request)
            return JSONResponse(await asyncio.to_thread(prepare_tokenize, body))
        except APIError as e:
            return err(e)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """``{"tokens": [int]}`` -> ``{"prompt": str}`` (special tokens kept, as vLLM)."""
        try:
            body = await read_body(request)
            check_model(body.get("model"))
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise APIError.bad_request("tokens must be a list of integers", "tokens")
            if vocab is not None and any(not (0 <= t < vocab) for t in toks):
                raise APIError.bad_request(f"tokens must be in [0, {vocab})", "tokens")
            return JSONResponse({"prompt": tokenizer.decode(toks, skip_special_tokens=False)})
        except APIError as e:
            return err(e)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What lm-eval's ``tokenizer_backend=remote`` / ``auto`` reads (vLLM's spelling)."""
        def name(tid):
            return tokenizer.id_to_token(tid) if tid is not None else None
        bos = getattr(tokenizer, "bos_token_id", None)
        eos = getattr(tokenizer, "eos_token_id", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.context_length,
                             "max_model_len": cfg.context_length, "vocab_size": vocab,
                             "bos_token": name(bos), "bos_token_id": bos, "eos_token": name(eos), "eos_token_id": eos,
                             "pad_token": name(pad), "pad_token_id": pad, "add_bos_token": False,
                             "chat_template": "deepseek-v41", "chat_template_name": "deepseek-v41"})

    # ------------------------------------------------------------------ chat completions

    def prepare_chat(body: dict) -> tuple[ChatRequest, EncodedChat, list, Any, Any]:
        req = parse_chat_request(body, vocab_size=vocab, max_n=cfg.max_n)
        check_model(req.model)
        try:
            enc = encode_chat_request(body, wording=cfg.wording, server_defaults=cfg.server_defaults,
                                      render_response_format=cfg.render_response_format)
        except ChatError as e:
            raise APIError.from_chat_error(e) from None
        prompt_ids = tokenizer.encode(enc.prompt)
        sp = check_context(len(prompt_ids), req.sampling, cfg.context_length, explicit=req.max_tokens_explicit,
                           param=req.max_tokens_param)
        # special tokens stay in the text while tools are given (SPEC §10: else ｜DSML｜ vanishes and
        # the markup can neither be parsed nor stripped) and while thinking (</think> splits reasoning)
        keep_special = bool(enc.tools) or bool(enc.thinking)
        forced_tools = bool(enc.tools) and (enc.tool_choice == "required" or isinstance(enc.tool_choice, Mapping))
        if forced_tools and not cfg.tool_call_parser:
            raise APIError.bad_request("tool_choice 'required' or a named function needs the server's tool-call "
                                       "parser (--tool-call-parser deepseekv41)", "tool_choice")
        constraint = None
        try:
            if grammar is not None:
                constraint = grammar.for_request(body, tools=enc.tools, tool_choice=enc.tool_choice,
                                                 thinking=enc.thinking, thinking_budget=req.thinking_budget)
            elif _wants_constraint(body, enc) or (enc.thinking and req.thinking_budget is not None):
                raise APIError.bad_request("constrained decoding is unavailable on this server", "response_format")
        except ChatError as e:
            raise APIError.from_chat_error(e) from None
        if constraint is not None and constraint.spec is not None and sp.min_tokens:
            raise APIError.bad_request("min_tokens cannot be combined with a response_format / tool_choice "
                                       "constraint", "min_tokens")
        sp = sp.replace(skip_special_tokens=not keep_special)
        return req, enc, prompt_ids, sp, constraint

    def make_choices(req_sp, enc: EncodedChat, prompt_ids, keep_special: bool, separate_reasoning: bool) -> list:
        out = []
        for i in range(req_sp.n):
            parser = ChatOutputParser(enc.thinking, enc.tools, enc.tool_choice,
                                      reasoning_parser=bool(cfg.reasoning_parser) and separate_reasoning,
                                      tool_parser=bool(cfg.tool_call_parser))
            out.append(_Choice(i, tokenizer, prompt_ids, req_sp, keep_special=keep_special,
                               drop_ids=drop_when_kept if keep_special else frozenset(), parser=parser,
                               think_close_id=think_close_id, thinking=enc.thinking, engine_text=engine_text))
        return out

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        try:
            body = await read_body(request)
            # encoding, tokenization and grammar compilation are CPU work: off the event loop
            req, enc, prompt_ids, sp, constraint = await asyncio.to_thread(prepare_chat, body)
            admit()
        except APIError as e:
            return err(e)
        rid = new_id("chatcmpl")
        created = int(time.time())
        keep_special = not sp.skip_special_tokens
        choices = make_choices(sp, enc, prompt_ids, keep_special, req.separate_reasoning)
        timer = metrics.timer() if metrics is not None else None
        if timer is not None:
            timer.arrival = arrival
        for w in enc.warnings:
            log.info("%s: %s", rid, w)
        model_name = req.model or cfg.model_name

        def base(chunk_choices, usage=None, obj="chat.completion.chunk"):
            d = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": chunk_choices}
            if obj.endswith("chunk") and req.stream_options.include_usage:
                d["usage"] = usage
            return d

        cached: dict = {}  # prompt tokens served from the prefix cache (engine outputs' cached_tokens)

        def usage():
            comp = sum(len(c.token_ids) for c in choices)
            reas = sum(c.reasoning_tokens for c in choices)
            return usage_dict(len(prompt_ids), comp, reas, cached_tokens=cached.get(0))

        def finish_metrics():
            if metrics is not None:
                metrics.finished([c.parser.finish_reason(c.finish_reason or "stop") for c in choices],
                                 len(prompt_ids), sum(c.reasoning_tokens for c in choices))
                timer.finish()

        async def produce() -> AsyncIterator[tuple[_Choice, Any, int, int]]:
            """Yields (choice, OutputDelta, token start, token end) for every engine update."""
            state.inflight += 1
            try:
                async for out in run_generation(prompt_ids, sp, rid, constraint, choices[0].drop_ids):
                    if out.cached_tokens is not None:
                        cached[0] = out.cached_tokens
                    for upd in out.choices:
                        if not (0 <= upd.index < len(choices)):
                            continue
                        ch = choices[upd.index]
                        if ch.done:
                            continue
                        start = len(ch.token_ids)
                        if timer is not None:
                            timer.tokens(len(upd.token_ids))
                        text = ch.add(upd)
                        yield ch, _parse_step(ch, text), start, len(ch.token_ids)
                    if all(c.done for c in choices):
                        break
                    if out.finished:
                        break
            finally:
                state.inflight -= 1
            for ch in choices:  # the engine stream ended without finishing these (aborted)
                if not ch.done:
                    n0 = len(ch.token_ids)
                    text = ch.add(ChoiceUpdate(ch.index, [], finish_reason="abort"))
                    yield ch, _parse_step(ch, text), n0, n0
            if any(c.stopped_here for c in choices):
                await abort(rid)  # a server-side stop string: make sure the engine stops too

        if not req.stream:
            async def collect():
                try:
                    async for _ in produce():
                        pass
                except APIError as e:
                    return err(e)
                finish_metrics()
                out_choices = []
                for c in choices:
                    p = c.parser
                    content = c.content_acc
                    msg: dict[str, Any] = {"role": "assistant",
                                           "content": content if (content or not p.tool_calls) else None}
                    separated = bool(enc.thinking and cfg.reasoning_parser and req.separate_reasoning)
                    msg["reasoning_content"] = (c.reasoning_acc or None) if separated else None
                    if p.tool_calls:
                        msg["tool_calls"] = [{"id": tc["id"], "type": "function", "function": tc["function"]}
                                             for tc in p.tool_calls]
                    ch_d: dict[str, Any] = {
                        "index": c.index, "message": msg,
                        "logprobs": ({"content": logprobs_chat(c, 0, len(c.token_ids), req.top_logprobs),
                                      "refusal": None} if req.logprobs else None),
                        "finish_reason": p.finish_reason(c.finish_reason or "stop")}
                    if c.stop_reason is not None:
                        ch_d["matched_stop"] = c.stop_reason
                    out_choices.append(ch_d)
                d = base(out_choices, obj="chat.completion")
                d["usage"] = usage()
                return JSONResponse(d)

            return await guarded(request, collect, [rid])

        # ---- streaming
        async def stream() -> AsyncIterator[bytes]:
            state.active[rid] = asyncio.current_task()
            finished_ok = False
            try:
                for c in choices:
                    yield _sse(base([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], usage=None))
                async for ch, delta, start, end in produce():
                    items = []
                    lp = ({"content": logprobs_chat(ch, start, end, req.top_logprobs), "refusal": None}
                          if req.logprobs and end > start else None)
                    if delta:
                        d: dict[str, Any] = {}
                        if delta.reasoning:
                            d["reasoning_content"] = delta.reasoning
                        if delta.content:
                            d["content"] = delta.content
                        if delta.tool_calls:
                            d["tool_calls"] = delta.tool_calls
                        items.append({"index": ch.index, "delta": d, "logprobs": lp, "finish_reason": None})
                        lp = None
                    elif lp is not None:
                        items.append({"index": ch.index, "delta": {}, "logprobs": lp, "finish_reason": None})
                    if ch.done:
                        fin: dict[str, Any] = {"index": ch.index, "delta": {}, "logprobs": None,
                                               "finish_reason": ch.parser.finish_reason(ch.finish_reason or "stop")}
                        if ch.stop_reason is not None:
                            fin["matched_stop"] = ch.stop_reason
                        items.append(fin)
                    for it in items:
                        cu = usage() if req.stream_options.continuous_usage_stats else None
                        yield _sse(base([it], usage=cu))
                finish_metrics()
                if req.stream_options.include_usage:
                    yield _sse(base([], usage=usage()))
                finished_ok = True
                yield _DONE
            except APIError as e:
                yield _sse(e.body())
                yield _DONE
                finished_ok = True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.exception("%s: generation failed", rid)
                yield _sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error", None, 500))
                yield _DONE
                finished_ok = True
            finally:
                state.active.pop(rid, None)
                if not finished_ok:
                    await abort(rid)
                    if metrics is not None:
                        metrics.aborted()
                    log.info("%s: stream closed early; aborted", rid)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ completions

    def prepare_completion(body: dict):
        req = parse_completion_request(body, vocab_size=vocab, max_n=cfg.max_n)
        check_model(req.model)
        add_special = body.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            raise APIError.bad_request("add_special_tokens must be a boolean", "add_special_tokens")
        # string prompts: no BOS unless add_special_tokens (token-id prompts are taken as sent)
        prompts_ids = [_tok_ids(p, add_special) if isinstance(p, str) else list(p) for p in req.prompts]
        sps = [check_context(len(ids), req.sampling, cfg.context_length, explicit=req.max_tokens_explicit,
                             param="max_tokens") for ids in prompts_ids]
        constraints = []
        for _ in prompts_ids:
            c = None
            if grammar is not None:
                c = grammar.for_request(body)
            elif body.get("response_format") not in (None, {"type": "text"}) or body.get("regex"):
                raise APIError.bad_request("constrained decoding is unavailable on this server", "response_format")
            constraints.append(c)
        if constraints[0] is not None and req.sampling.min_tokens:
            raise APIError.bad_request("min_tokens cannot be combined with a constraint", "min_tokens")
        return req, prompts_ids, sps, constraints

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        try:
            body = await read_body(request)
            req, prompts_ids, sps, constraints = await asyncio.to_thread(prepare_completion, body)
            admit(len(prompts_ids))
        except ChatError as e:
            return err(APIError.from_chat_error(e))
        except APIError as e:
            return err(e)
        rid = new_id("cmpl")
        created = int(time.time())
        n = req.sampling.n
        model_name = req.model or cfg.model_name
        rids = [rid if len(prompts_ids) == 1 else f"{rid}-{k}" for k in range(len(prompts_ids))]
        choices: list[_Choice] = []
        for k, ids in enumerate(prompts_ids):
            for j in range(n):
                choices.append(_Choice(k * n + j, tokenizer, ids, sps[k], keep_special=not sps[k].skip_special_tokens,
                                       drop_ids=frozenset(), parser=None, think_close_id=None, thinking=False,
                                       engine_text=engine_text))
        timer = metrics.timer() if metrics is not None else None
        if timer is not None:
            timer.arrival = arrival
        echo_text = [(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)) if req.echo else ""
                     for p in req.prompts]

        def base(chunk_choices, usage=None, obj="text_completion"):
            d = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": chunk_choices}
            if req.stream and req.stream_options.include_usage:
                d["usage"] = usage
            return d

        cached: dict = {}  # per prompt: tokens served from the prefix cache

        def usage():
            return usage_dict(sum(len(p) for p in prompts_ids), sum(len(c.token_ids) for c in choices),
                              cached_tokens=sum(cached.values()) if cached else None)

        def finish_metrics():
            if metrics is not None:
                metrics.finished([c.finish_reason for c in choices], sum(len(p) for p in prompts_ids))
                timer.finish()

        async def produce():
            streams = [run_generation(ids, sps[k], rids[k], constraints[k]) for k, ids in enumerate(prompts_ids)]
            state.inflight += len(streams)
            try:
                async for k, out in merged(streams):
                    if out.cached_tokens is not None:
                        cached[k] = out.cached_tokens
                    for upd in out.choices:
                        if not (0 <= upd.index < n):
                            continue
                        ch = choices[k * n + upd.index]
                        if out.prompt_logprobs is not None:
                            ch.prompt_logprobs = out.prompt_logprobs
                        if ch.done:
                            continue
                        start = len(ch.token_ids)
                        if timer is not None:
                            timer.tokens(len(upd.token_ids))
                        text = ch.add(upd)
                        yield ch, text, start, len(ch.token_ids)
                        if ch.done and ch.stopped_here and all(c.done for c in choices[k * n:(k + 1) * n]):
                            await abort(rids[k])
                    if all(c.done for c in choices):
                        break
            finally:
                state.inflight -= len(streams)
            for ch in choices:  # streams that ended without finishing these (aborted)
                if not ch.done:
                    n0 = len(ch.token_ids)
                    text = ch.add(ChoiceUpdate(ch.index % n, [], finish_reason="abort"))
                    yield ch, text, n0, n0

        if not req.stream:
            async def collect():
                try:
                    async for _ in produce():
                        pass
                except APIError as e:
                    return err(e)
                finish_metrics()
                out = []
                for c in choices:
                    k = c.index // n
                    text = echo_text[k] + c.text
                    if req.logprobs is None:
                        lp = None
                    elif req.echo:
                        if c.prompt_logprobs is None and c.finish_reason not in ("abort", "error"):
                            return err(APIError(500, "the engine returned no prompt logprobs", code="internal_error"))
                        lp = logprobs_echo(c, prompts_ids[k], req.logprobs, len(echo_text[k]))
                    else:
                        lp = logprobs_completion(c, 0, len(c.token_ids), req.logprobs, len(echo_text[k]))
                    out.append({"index": c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason or "abort",
                                **({"matched_stop": c.stop_reason} if c.stop_reason is not None else {})})
                d = base(out)
                d["usage"] = usage()
                return JSONResponse(d)

            return await guarded(request, collect, rids)

        async def stream():
            finished_ok = False
            state.active[rid] = asyncio.current_task()
            try:
                if req.echo:
                    for c in choices:
                        k = c.index // n
                        if echo_text[k]:
                            yield _sse(base([{"index": c.index, "text": echo_text[k], "logprobs": None,
                                              "finish_reason": None}]))
                async for ch, text, start, end in produce():
                    lp = (logprobs_completion(ch, start, end, req.logprobs or 0, len(ch.text) - len(text))
                          if req.logprobs is not None and end > start else None)
                    if text or lp is not None:
                        yield _sse(base([{"index": ch.index, "text": text, "logprobs": lp, "finish_reason": None}]))
                    if ch.done:
                        fin = {"index": ch.index, "text": "", "logprobs": None, "finish_reason": ch.finish_reason}
                        if ch.stop_reason is not None:
                            fin["matched_stop"] = ch.stop_reason
                        yield _sse(base([fin]))
                finish_metrics()
                if req.stream_options.include_usage:
                    yield _sse(base([], usage=usage()))
                finished_ok = True
                yield _DONE
            except APIError as e:
                yield _sse(e.body())
                yield _DONE
                finished_ok = True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.exception("%s: generation failed", rid)
                yield _sse(error_body(f"generation failed: {type(e).__name__}: {e}", "server_error", None, 500))
                yield _DONE
                finished_ok = True
            finally:
                state.active.pop(rid, None)
                if not finished_ok:
                    for r in rids:
                        await abort(r)
                    if metrics is not None:
                        metrics.aborted()
                    log.info("%s: stream closed early; aborted", rid)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return _Gate(app, cfg, state, metrics)


# ------------------------------------------------------------------------------------- helpers


def _parse_step(ch: "_Choice", text: str):
    """Run the chat output parser on new text (and finish it when the choice is done)."""
    from .reasoning import OutputDelta

    delta = OutputDelta()
    if text:
        d = ch.parser.feed(text)
        delta.reasoning, delta.content, delta.tool_calls = d.reasoning, d.content, list(d.tool_calls)
    ch.reasoning_progress()
    if ch.done:
        d = ch.parser.finish()
        delta.reasoning += d.reasoning
        delta.content += d.content
        delta.tool_calls += d.tool_calls
    ch.reasoning_acc += delta.reasoning
    ch.content_acc += delta.content
    return delta


def _lp(x: float) -> float:
    x = float(x)
    if x != x:  # NaN: not JSON
        return -9999.0
    return max(x, -9999.0)


def _model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", type="invalid_request_error", param="model",
                    code="model_not_found")


def _wants_constraint(body: Mapping, enc: EncodedChat) -> bool:
    rf = body.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") in ("json_object", "json_schema"):
        return True
    return bool(enc.tools) and (enc.tool_choice == "required" or isinstance(enc.tool_choice, Mapping))


def _stats_dict(stats_fn: Callable) -> Callable[[], Mapping]:
    def f():
        s = stats_fn()
        if hasattr(s, "__dataclass_fields__"):
            import dataclasses
            return dataclasses.asdict(s)
        if isinstance(s, Mapping):
            return s
        return getattr(s, "__dict__", {}) or {}
    return f


def _safe_stats(engine: Any) -> Mapping:
    fn = getattr(engine, "stats", None)
    if fn is None:
        return {}
    try:
        return _stats_dict(fn)()
    except Exception:
        return {}


def _first_num(d: Mapping, keys: Iterable[str]) -> Optional[float]:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


class _Gate:
    """Pure ASGI wrapper: API key (every path but /health), body size limit (413), HTTP metrics."""

    def __init__(self, app: Any, cfg: ServerConfig, state: _State, metrics: Optional[ServerMetrics]):
        self.app = app
        self.cfg = cfg
        self.state = state
        self.metrics = metrics
        # expose the FastAPI app's attributes (state, routes) for callers
        self.fastapi = app

    def __getattr__(self, name):
        return getattr(self.app, name)

    async def _send_error(self, send, status: int, body: dict, headers: Sequence = ()) -> None:
        data = json.dumps(body).encode("utf-8")
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in headers]
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status_box = [0]

        async def send_wrapped(msg):
            if msg["type"] == "http.response.start":
                status_box[0] = msg["status"]
            await send(msg)

        try:
            if self.cfg.api_key and path != "/health":
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                token = auth[7:].strip() if auth[:7].lower() == "bearer " else None
                if token is None:
                    token = headers.get(b"x-api-key", b"").decode("latin-1") or None
                if token != self.cfg.api_key:
                    if self.metrics is not None:
                        self.metrics.rejected(401)
                    status_box[0] = 401
                    msg = ("Missing API key: send 'Authorization: Bearer <key>'" if token is None else
                           "Incorrect API key provided")
                    return await self._send_error(send, 401, error_body(msg, "invalid_request_error", None,
                                                                        "invalid_api_key"),
                                                  [("www-authenticate", "Bearer")])
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                limit = self.cfg.max_body_bytes
                headers = dict(scope.get("headers") or [])
                cl = headers.get(b"content-length")
                too_big = error_body(f"request body exceeds the limit of {limit} bytes", "invalid_request_error",
                                     None, "request_too_large")
                if cl is not None:
                    try:
                        n = int(cl)
                    except ValueError:
                        n = -1
                    if n > limit:
                        if self.metrics is not None:
                            self.metrics.rejected(413)
                        status_box[0] = 413
                        return await self._send_error(send, 413, too_big, [("connection", "close")])
                # read the body up to the limit, then replay it
                chunks, total = [], 0
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    body = msg.get("body", b"")
                    total += len(body)
                    if total > limit:
                        if self.metrics is not None:
                            self.metrics.rejected(413)
                        status_box[0] = 413
                        return await self._send_error(send, 413, too_big, [("connection", "close")])
                    chunks.append(body)
                    if not msg.get("more_body", False):
                        break
                data = b"".join(chunks)
                replayed = [False]

                async def receive_replay():
                    if not replayed[0]:
                        replayed[0] = True
                        return {"type": "http.request", "body": data, "more_body": False}
                    return await receive()

                return await self.app(scope, receive_replay, send_wrapped)
            return await self.app(scope, receive, send_wrapped)
        finally:
            if self.metrics is not None and status_box[0]:
                ep = path if path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                      "/metrics") else "other"
                self.metrics.http(ep, status_box[0])
