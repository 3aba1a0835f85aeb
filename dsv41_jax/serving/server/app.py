"""`build_app`: the ASGI app of an engine -- the FastAPI app with every route family registered on
one `ServerContext`, behind the `Gate` (API key, body limit, HTTP metrics).

Errors are OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``: 400 for invalid
input (the server keeps serving), 401 for a missing / wrong Bearer key, 404 for an unknown model or
route, 413 for a body over ``max_body_bytes``, 503 when the queue is full or the server is draining,
500 when the engine had to end a request itself.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv41_jax.serving.metrics import ServerMetrics
from dsv41_jax.serving.protocol import ENDPOINTS, error_body

from . import admin, chat, completions, tokenize
from .context import ServerConfig, ServerContext
from .gate import Gate

__all__ = ["ENDPOINTS", "ServerConfig", "build_app", "endpoints"]

log = logging.getLogger("dsv41_jax.serve")

_FAMILIES = (chat, completions, tokenize, admin)
# the string ``code`` of the errors the router itself answers (every error body's code is a string or null)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def endpoints(engine: Any = None) -> tuple:
    """(method, path, what it does) of the routes an app of ``engine`` serves (`protocol.ENDPOINTS`;
    pause / continue only for an engine that can pause; all of them for None)."""
    if engine is None or admin.can_pause(engine):
        return ENDPOINTS
    return tuple(e for e in ENDPOINTS if e[1] not in ("/pause_generation", "/continue_generation"))


def build_app(engine: Any, tokenizer: Any, config: ServerConfig, *, grammar: Any = None,
              metrics: Optional[ServerMetrics] = None, on_shutdown: Optional[Callable[[], Any]] = None,
              queue_full_errors: tuple = (), bad_request_errors: tuple = ()):
    """The ASGI app. ``engine``: see `context` (``AsyncEngine``); ``grammar``: a
    :class:`dsv41_jax.serving.constrained.GrammarCompiler` (None: constrained decoding unavailable,
    such requests get a 400); ``queue_full_errors`` / ``bad_request_errors``: further engine
    exception types that mean 503 / 400; ``on_shutdown``: called when the app stops (after the
    in-flight streams are cancelled)."""
    ctx = ServerContext(engine, tokenizer, config, grammar=grammar, metrics=metrics,
                        queue_full_errors=queue_full_errors, bad_request_errors=bad_request_errors)
    state = ctx.state

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
    app.state.metrics = ctx.metrics
    app.state.config = config

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request, exc):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        code = _HTTP_CODES.get(exc.status_code, "server_error" if exc.status_code >= 500 else "invalid_request")
        return JSONResponse(error_body(msg, "invalid_request_error" if exc.status_code < 500 else "server_error",
                                       None, code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _any_exc(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None,
                                       "internal_error"),
                            status_code=500)

    for family in _FAMILIES:
        family.register(app, ctx)
    return Gate(app, config, state, ctx.metrics)
