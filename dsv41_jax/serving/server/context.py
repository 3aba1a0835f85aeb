"""What every route of one app shares: the engine, the tokenizer, the configuration, the metrics,
and the request plumbing around them (model check, admission, engine calls, errors).

`ServerContext` is built once by `app.build_app`; a route module's ``register(app, ctx)`` closes
over it. The engine is anything with ``generate(prompt_ids, sampling_params, request_id,
constraint=None, drop_token_ids=())`` (an async iterator of `request.RequestOutput` deltas whose
text the engine's detokenizer made), ``abort(request_id)`` and optionally ``stats()``,
``num_queued()``, ``is_running``, ``pause()`` / ``resume()`` -- `AsyncEngine`, or a model-free
double in the handler tests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from dsv41_jax.chat_format.effort import ServerDefaults
from dsv41_jax.chat_format.registry import ChatFormat
from dsv41_jax.serving.metrics import ServerMetrics
from dsv41_jax.serving.protocol import APIError, parse_json_body
from dsv41_jax.serving.request import EngineError, EngineInternalError, QueueFullError, RequestOutput
from dsv41_jax.serving.sampling import SamplingParamsError

__all__ = ["ServerConfig", "ServerContext", "ServerState"]

log = logging.getLogger("dsv41_jax.serve")


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
    # the model's chat encoding, wording and thinking / effort defaults (`ChatFormat.for_model`); default: V4.1's
    chat_format: ChatFormat = field(default_factory=lambda: ChatFormat(server_defaults=ServerDefaults()))
    enable_metrics: bool = False
    render_response_format: bool = False
    max_n: int = 128
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "dsv41_jax"


class ServerState:
    """Mutable app state: requests in the engine, draining on shutdown, the tasks to cancel then."""

    def __init__(self):
        self.inflight = 0
        self.draining = False
        self.active: dict[str, asyncio.Task] = {}


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


def _first_num(d: Mapping, keys: Iterable[str]) -> Optional[float]:
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


class ServerContext:
    """The engine, tokenizer, config and metrics of one app, and the helpers every route uses.

    queue_full_errors / bad_request_errors: further engine exception types that mean "queue full"
    (503) / "the request's input is refused" (400), beside `QueueFullError`, `EngineError` and
    `SamplingParamsError`; `EngineInternalError` (the engine ended a request itself) is a 500."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: ServerConfig, *, grammar: Any = None,
                 metrics: Optional[ServerMetrics] = None, queue_full_errors: tuple = (),
                 bad_request_errors: tuple = ()):
        self.engine, self.tokenizer, self.cfg, self.grammar = engine, tokenizer, cfg, grammar
        if metrics is None and cfg.enable_metrics:
            stats_fn = getattr(engine, "stats", None)
            metrics = ServerMetrics(_stats_dict(stats_fn) if stats_fn else None, model_name=cfg.model_name)
        self.metrics = metrics
        self.state = ServerState()
        self.names = {cfg.model_name, *cfg.model_aliases}
        self.vocab = cfg.vocab_size or getattr(tokenizer, "vocab_size", None)
        self.queue_errors = tuple(queue_full_errors) + (QueueFullError,)
        self.input_errors = tuple(bad_request_errors) + (EngineError, SamplingParamsError)

    # ------------------------------------------------------------------------------ requests
    def err(self, e: APIError) -> JSONResponse:
        """The OpenAI error response of `e` (counted in the metrics)."""
        if self.metrics is not None:
            self.metrics.rejected(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.names:
            raise model_not_found(model)

    async def read_body(self, request: Request) -> dict:
        return parse_json_body(await request.body())

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def encode(self, text: str, add_special: bool) -> list:
        """A prompt string's ids: no special tokens added, unless ``add_special`` (then the BOS)."""
        ids = list(self.tokenizer.encode(text))
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if add_special and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def admit(self, n_requests: int = 1) -> None:
        """503 while draining or when the engine's queue is at ``max_queued_requests``."""
        cfg = self.cfg
        if self.state.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if cfg.max_queued_requests is None:
            return
        queued = None
        nq = getattr(self.engine, "num_queued", None)
        if callable(nq):  # cheap and lock-free (stats() waits for the engine step)
            for _ in range(3):
                try:
                    queued = nq()
                    break
                except RuntimeError:  # the engine thread changed its queue while we counted
                    continue
        else:
            queued = _first_num(self.safe_stats(), ("num_queue_reqs", "queued", "waiting", "num_waiting"))
        if queued is None:  # estimate: everything beyond the running batch waits
            queued = max(0, self.state.inflight - (cfg.max_running_requests or 0))
        if queued >= cfg.max_queued_requests:  # no room for one more (as the engine's own check)
            raise APIError(503, f"the request queue is full ({cfg.max_queued_requests} waiting); retry later",
                           code="queue_full", headers={"Retry-After": "1"})

    def safe_stats(self) -> Mapping:
        fn = getattr(self.engine, "stats", None)
        if fn is None:
            return {}
        try:
            return _stats_dict(fn)()
        except Exception:
            return {}

    # ------------------------------------------------------------------------------ the engine
    async def generate(self, prompt_ids: list, sp: Any, rid: str, constraint: Any = None,
                       drop_ids: frozenset = frozenset()) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt, its errors as `APIError`s."""
        kwargs: dict = {}
        if constraint is not None:
            kwargs["constraint"] = constraint
        if drop_ids:
            kwargs["drop_token_ids"] = sorted(drop_ids)
        try:
            gen = self.engine.generate(prompt_ids, sp, rid, **kwargs)
            if asyncio.iscoroutine(gen):
                gen = await gen
            async for out in gen:
                yield out
        except self.queue_errors as e:
            raise APIError(503, f"the request queue is full; retry later ({e})", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except self.input_errors as e:
            raise APIError.bad_request(str(e), getattr(e, "field", None)) from None
        except EngineInternalError as e:  # the engine ended the request: an error, not a short answer
            raise APIError(500, str(e), code="internal_error") from None

    async def abort(self, rid: str) -> None:
        try:
            r = self.engine.abort(rid)
            if asyncio.iscoroutine(r):
                await r
        except Exception:  # already finished / unknown id
            log.debug("abort(%s) failed", rid, exc_info=True)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", type="invalid_request_error", param="model",
                    code="model_not_found")


async def merged(streams: list) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async streams (one per prompt) as (stream index, item)."""
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
