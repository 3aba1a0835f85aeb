"""The ASGI gate in front of the app: the API key (every path but ``/health``; 401), the body size
limit (413, read before the app sees the body) and the HTTP request counter of ``/metrics``."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from dsv41_jax.serving.metrics import ServerMetrics
from dsv41_jax.serving.protocol import error_body

from .context import ServerConfig, ServerState

__all__ = ["Gate"]

# the paths counted by name in the HTTP metrics (others count as "other")
_COUNTED = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class Gate:
    """Pure ASGI wrapper: API key (every path but /health), body size limit (413), HTTP metrics."""

    def __init__(self, app: Any, cfg: ServerConfig, state: ServerState, metrics: Optional[ServerMetrics]):
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
                ep = path if path in _COUNTED else "other"
                self.metrics.http(ep, status_box[0])
