"""The operational endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (no API
key), ``GET /metrics`` (Prometheus; a 404 saying how to turn it on when off), and SGLang's
``POST /pause_generation`` / ``POST /continue_generation`` for an engine that can pause, and SGLang's
``POST /start_expert_distribution_record`` / ``stop_...`` / ``dump_...`` (``--expert-distribution-recorder``;
400 without it)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dsv41_jax.serving.metrics import CONTENT_TYPE_LATEST
from dsv41_jax.serving.protocol import APIError, error_body, parse_json_body

from .context import ServerContext, model_not_found

__all__ = ["can_pause", "register"]



def can_pause(engine) -> bool:
    return callable(getattr(engine, "pause", None)) and callable(getattr(engine, "resume", None))


def _expert_distribution(ctx: ServerContext, engine, action: str):
    """The handler of ``POST /{action}_expert_distribution_record`` (SGLang's names): the engine's recorder
    (`AsyncEngine.expert_distribution`), off the event loop (it waits for the current step); 400 saying how to
    turn it on when the server runs without --expert-distribution-recorder."""

    async def handler():
        if not callable(getattr(engine, "expert_distribution", None)):
            return ctx.err(APIError.bad_request("this engine has no expert distribution recorder"))
        try:
            return JSONResponse(await asyncio.to_thread(engine.expert_distribution, action))
        except ValueError as e:  # EngineError: the recorder is off, or the file cannot be written
            return ctx.err(APIError(400, str(e), type="invalid_request_error", code="expert_distribution"))

    handler.__name__ = f"{action}_expert_distribution_record"
    return handler


def register(app: FastAPI, ctx: ServerContext) -> None:
    cfg, state, engine, metrics = ctx.cfg, ctx.state, ctx.engine, ctx.metrics

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": cfg.created, "owned_by": cfg.owned_by,
                "root": cfg.model_name, "max_model_len": cfg.context_length}

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse(error_body("server is shutting down", "service_unavailable_error", None,
                                           "shutting_down"),
                                status_code=503)
        if getattr(engine, "is_running", True) is False:
            return JSONResponse(error_body("the engine loop is not running", "service_unavailable_error", None,
                                           "engine_not_running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        if model_id not in ctx.names:
            return ctx.err(model_not_found(model_id))
        return JSONResponse(model_card())

    if cfg.enable_metrics and metrics is not None:
        @app.get("/metrics")
        async def metrics_endpoint():
            # engine.stats() waits for the current engine step: off the event loop
            return Response(await asyncio.to_thread(metrics.render), media_type=CONTENT_TYPE_LATEST)
    else:
        @app.get("/metrics")
        async def metrics_off():  # a 404 that says why, instead of "no route"
            return ctx.err(APIError(404, "metrics are off on this server: start it without --disable-metrics "
                                         "(python -m dsv41_jax.serve serves /metrics by default)",
                                    type="invalid_request_error", code="metrics_disabled"))

    for action in ("start", "stop", "dump"):
        app.post(f"/{action}_expert_distribution_record")(_expert_distribution(ctx, engine, action))

    if not can_pause(engine):
        return

    # SGLang's names. Requests keep arriving (and waiting) while paused; aborts still free pages.
    @app.post("/pause_generation")
    async def pause_generation():
        """Hold the engine between steps; answers once no step runs (or 504 after 60 s)."""
        if not await asyncio.to_thread(engine.pause().wait, 60.0):
            return ctx.err(APIError(504, "the engine loop did not take the pause within 60 s", code="timeout"))
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
            return ctx.err(e)
        if not await asyncio.to_thread(engine.resume(steps).wait, 60.0):
            return ctx.err(APIError(504, "the engine did not finish the steps within 60 s", code="timeout"))
        return JSONResponse({"paused": steps is not None})
