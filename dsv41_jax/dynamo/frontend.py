"""``python -m dsv41_jax.dynamo.frontend``: Dynamo's frontend with our chat layer as its chat processor.

Dynamo's HTTP frontend, discovery, router (``--router-mode kv|round-robin|random``), migration and
metrics run as in ``python -m dynamo.frontend`` (every flag of it is accepted here); only the chat
pre/post-processing is ours. Dynamo lets a frontend plug in a *chat engine factory* (the same hook
its ``--dyn-chat-processor sglang|vllm`` use): for each model a worker registers, the factory gets
the model card and a *routed engine* (Dynamo's router in front of the workers) and returns the
engine that answers ``/v1/chat/completions``. Ours is our own server app (`serving.server.build_app`)
over `RoutedEngine`, an engine adapter whose ``generate(prompt_ids, sampling_params, ...)`` sends
the token ids through Dynamo's router and yields what the worker streams back: token ids and the
text our engine's detokenizer made of them (the server never decodes generated ids). So the chat
encoding (docs/design/spec.md §10, the checkpoint's wording), ``reasoning_content``, the DSML ``tool_calls``, stop
strings, usage and the 400s are computed by the very code of ``python -m dsv41_jax.serve``, and the
KV router sees the prompt's token ids (it needs them to match a worker's cached blocks).

Why not Dynamo's own chat path: its native DeepSeek-V4.1 formatter renders the tools section in
the released checkpoint's prose, while models with their own wording (nano, tiny: `chat.Wording`)
are prompted differently by our server; its reasoning / tool-call parsers are its own too. With
this frontend the answers are ours by construction (tests/test_dynamo.py compares them).

Per request (`ChatProcessor.generator`): the OpenAI body is handed to the app as a streaming request
(``stream: true``, usage included) in this process (ASGI, no socket); each SSE event becomes one
chunk for Dynamo, which streams them to the client or folds them into one response. A 4xx / 5xx
from the app is raised as Dynamo's ``InvalidArgument`` / ``Unknown`` (the client gets that status
and the message); an error event mid-stream is passed on as an error event. A client that goes away
stops the request's Dynamo context; the processor watches it and disconnects the app's request, the
app aborts it, `RoutedEngine.abort` stops the routed stream and Dynamo cancels the request on the
worker, which aborts it in the engine and frees its pages.

Not carried over Dynamo (refused with a 400 saying so): constrained decoding (``response_format``,
``tool_choice`` required / named: the grammar runs beside the engine), ``logprobs``,
prompt logprobs and ``n`` > 1. ``/v1/completions`` goes through Dynamo's own token path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any, AsyncIterator, Optional

log = logging.getLogger("dsv41_jax.dynamo.frontend")

__all__ = ["ChatProcessor", "RoutedEngine", "build_parser", "main"]

_FINISH_BACK = {"cancelled": "abort", "eos": "stop"}


class RoutedEngine:
    """The engine interface `serving.server.build_app` needs, over Dynamo's routed engine: token ids go
    to a worker chosen by Dynamo's router; the worker's engine detokenizes (its one detokenizer, told
    the ids to leave out of the text) and streams token ids with their text back, as
    `request.RequestOutput` deltas here."""

    def __init__(self, routed, model_name: str, eos_token_ids=()):
        self.routed = routed
        self.model_name = model_name
        self.eos_token_ids = list(eos_token_ids)
        self._contexts: dict = {}

    @staticmethod
    def _refuse(sp, constraint) -> Optional[str]:
        if constraint is not None:
            return ("constrained decoding (response_format json_object / json_schema / regex, tool_choice required "
                    "or named) is not available through the Dynamo frontend; use python -m dsv41_jax.serve")
        if sp.n != 1:
            return "n > 1 is not available through the Dynamo frontend"
        if sp.logprobs is not None or sp.prompt_logprobs is not None:
            return "logprobs are not available through the Dynamo frontend"
        return None

    def request(self, prompt_ids, sp, drop_token_ids=()) -> dict:
        """The Dynamo token request: Dynamo's fields (for its router, metrics, a stock worker), and in
        ``extra_args.dsv41`` our whole `SamplingParams` and the ids to leave out of the text (what our
        worker uses; it then sends the text along)."""
        return {
            "model": self.model_name,
            "token_ids": [int(t) for t in prompt_ids],
            "stop_conditions": {"max_tokens": sp.max_tokens, "stop": list(sp.stop), "min_tokens": sp.min_tokens,
                                "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos},
            "sampling_options": {"n": sp.n, "temperature": sp.temperature, "top_p": sp.top_p,
                                 "top_k": max(sp.top_k, 0), "min_p": sp.min_p, "seed": sp.seed,
                                 "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
                                 "repetition_penalty": sp.repetition_penalty},
            "output_options": {"skip_special_tokens": sp.skip_special_tokens},
            "eos_token_ids": self.eos_token_ids,
            "annotations": [],
            "extra_args": {"dsv41": {"sampling": dataclasses.asdict(sp),
                                     "drop_token_ids": [int(t) for t in drop_token_ids]}},
        }

    async def generate(self, prompt_ids, sp, request_id: str, constraint=None, drop_token_ids=()):
        from dynamo._core import Context

        from dsv41_jax.serving.request import CompletionOutput, EngineError, EngineInternalError, RequestOutput

        why = self._refuse(sp, constraint)
        if why:
            raise EngineError(why)
        ctx = Context(id=request_id)
        self._contexts[request_id] = ctx
        done = False
        try:
            stream = await self.routed.generate(self.request(prompt_ids, sp, drop_token_ids), context=ctx)
            async for resp in _routed_errors(stream):
                if resp.is_error():
                    raise EngineInternalError("; ".join(resp.comments() or []) or "the worker failed")
                data = resp.data()
                if data is None:
                    continue
                if not isinstance(data, dict) or "token_ids" not in data or data.get("text") is None:
                    raise EngineInternalError(f"unexpected worker response (not a dsv41_jax worker?): "
                                              f"{str(data)[:200]}")
                fin = data.get("finish_reason")
                if fin == "error":
                    raise EngineInternalError("the worker ended the request with an error")
                fin = _FINISH_BACK.get(fin, fin)
                usage = data.get("completion_usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                c = CompletionOutput(data.get("index") or 0, data["text"], list(data["token_ids"]), fin,
                                     data.get("stop_reason"))
                out = RequestOutput(request_id, None, list(prompt_ids), [c], fin is not None)
                out.num_cached_tokens = cached
                yield out
                if fin is not None:
                    done = True
                    return
            # the stream ended without a finish reason: the worker is gone (or dropped it), not an answer
            raise EngineInternalError("the worker's stream ended before the request finished (worker lost?)")
        finally:
            self._contexts.pop(request_id, None)
            if not done:  # abandoned (client gone, app aborted) or failed: stop it on the worker too
                ctx.stop_generating()

    def abort(self, request_id: str) -> None:
        ctx = self._contexts.get(request_id)
        if ctx is not None:
            ctx.stop_generating()


async def _routed_errors(stream):
    """The routed stream, with Dynamo's failures (no worker, a worker lost mid-stream: raised as
    ValueError / RuntimeError by its bindings) as `EngineInternalError` (HTTP 500 / a stream error event)."""
    from dsv41_jax.serving.request import EngineInternalError

    it = stream.__aiter__()
    while True:
        try:
            resp = await it.__anext__()
        except StopAsyncIteration:
            return
        except (ValueError, RuntimeError) as e:
            raise EngineInternalError(f"the worker failed: {e}") from None
        yield resp


async def _asgi_post(app, path: str, body: dict, disconnected: asyncio.Event):
    """POST ``body`` to the ASGI ``app`` in this process. Yields ("start", status) then ("body", bytes)
    items as the app sends them; the app sees a client disconnect once ``disconnected`` is set."""
    raw = json.dumps(body).encode()
    q: asyncio.Queue = asyncio.Queue()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        await q.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("dynamo-frontend", 0),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    done = object()

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await q.put(done)

    task = asyncio.create_task(run())
    try:
        while True:
            msg = await q.get()
            if msg is done:
                break
            if msg["type"] == "http.response.start":
                yield "start", msg["status"]
            elif msg["type"] == "http.response.body" and msg.get("body"):
                yield "body", msg["body"]
        await task  # re-raise an exception of the app
    finally:
        if not task.done():
            disconnected.set()
            try:
                await asyncio.wait_for(task, 30)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                task.cancel()


class ChatProcessor:
    """Dynamo's chat engine for one model: each request goes through our app (see the module doc)."""

    def __init__(self, app):
        self.app = app

    async def generator(self, request: dict, context: Any = None) -> AsyncIterator[dict]:
        from dynamo.llm.exceptions import InvalidArgument, Unknown

        body = dict(request)
        body.pop("nvext", None)
        # Dynamo hands the request on with chat_template_kwargs renamed (and its thinking switch spelled
        # out: thinking / enable_thinking / thinking_mode / reasoning_effort, from the request's own
        # fields, which our resolution reads the same way)
        if "chat_template_args" in body:
            ctk = body.pop("chat_template_args")
            body.setdefault("chat_template_kwargs", ctk)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        disconnected = asyncio.Event()
        watch = None
        if context is not None:  # the client went away (or Dynamo stopped the request): the app sees a disconnect
            async def _watch():
                await context.async_killed_or_stopped()
                log.info("request %s: stopped by Dynamo (client gone?): disconnecting it", context.id())
                disconnected.set()

            watch = asyncio.ensure_future(_watch())
        status, buf, err = None, b"", b""
        try:
            async for kind, val in _asgi_post(self.app, "/v1/chat/completions", body, disconnected):
                if kind == "start":
                    status = val
                    continue
                if status != 200:
                    err += val
                    continue
                buf += val
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            continue
                        obj = json.loads(payload)
                        if "error" in obj:
                            msg = (obj["error"] or {}).get("message") or "error"
                            yield {"_dynamo_annotated": True, "event": "error", "comment": [msg]}
                            return
                        yield obj
        finally:
            disconnected.set()
            if watch is not None:
                watch.cancel()
        if status is not None and status != 200:
            try:
                msg = json.loads(err)["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = err.decode(errors="replace")[:500]
            if 400 <= status < 500:
                raise InvalidArgument(msg)
            raise Unknown(f"HTTP {status}: {msg}")


class ChatEngineFactory:
    """Builds a `ChatProcessor` for each model a worker registers (Dynamo calls
    ``chat_engine_factory(instance_id, model_card, routed_engine)``)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args

    async def chat_engine_factory(self, instance_id, mdc, routed_engine):
        from dynamo.llm import PythonAsyncEngine

        from dsv41_jax.serve import resolve_parser
        from dsv41_jax.chat_format.effort import parse_tier_table
        from dsv41_jax.chat_format.registry import ChatFormat
        from dsv41_jax.serving.engine import EngineError
        from dsv41_jax.serving.server import ServerConfig, build_app
        from dsv41_jax.serving.tokenizer import load_tokenizer

        if not mdc.model_type().supports_chat():
            raise RuntimeError(f"model type {mdc.model_type()} has no chat surface")
        local_dir = mdc.local_dir()
        card = json.loads(mdc.to_json_str())
        tokenizer = load_tokenizer(local_dir)
        tiers = parse_tier_table(self.args.reasoning_effort_tiers) if self.args.reasoning_effort_tiers else None
        chat_format = ChatFormat.for_model(local_dir, tiers=tiers)  # the checkpoint's family picks the encoding
        name = mdc.name()
        ctx_len = card.get("context_length") or (card.get("runtime_config") or {}).get("context_length") or 4096
        cfg = ServerConfig(
            model_name=name, context_length=int(ctx_len), vocab_size=tokenizer.vocab_size,
            reasoning_parser=resolve_parser(self.args.reasoning_parser, "reasoning", tokenizer),
            tool_call_parser=resolve_parser(self.args.tool_call_parser, "tool", tokenizer),
            chat_format=chat_format, enable_metrics=False,
            render_response_format=self.args.render_response_format, max_n=1)
        engine = RoutedEngine(routed_engine, name, tokenizer.eos_token_ids)
        app = build_app(engine, tokenizer, cfg, grammar=None, bad_request_errors=(EngineError,))
        log.info("chat processor for %r (%s): %s, reasoning parser %s, tool-call "
                 "parser %s, context_length %d", name, local_dir, chat_format.describe(),
                 cfg.reasoning_parser or "none", cfg.tool_call_parser or "none", cfg.context_length)
        return PythonAsyncEngine(ChatProcessor(app).generator, asyncio.get_running_loop())


def build_parser() -> argparse.ArgumentParser:
    from dynamo.frontend.frontend_args import FrontendArgGroup

    from dsv41_jax.serve import REASONING_PARSERS, TOOL_CALL_PARSERS

    p = argparse.ArgumentParser(
        prog="python -m dsv41_jax.dynamo.frontend",
        description="NVIDIA Dynamo's frontend (HTTP, discovery, KV-aware router) with DeepSeek-V4.1 chat "
                    "encoding, reasoning and DSML tool-call parsing from dsv41_jax. Workers: python -m dsv41_jax.dynamo")
    FrontendArgGroup().add_arguments(p)
    g = p.add_argument_group("dsv41 chat")
    g.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="as python -m dsv41_jax.serve --reasoning-parser")
    g.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="as python -m dsv41_jax.serve --tool-call-parser")
    g.add_argument("--reasoning-effort-tiers", default=None,
                   help="as python -m dsv41_jax.serve --reasoning-effort-tiers")
    g.add_argument("--render-response-format", action="store_true",
                   help="as python -m dsv41_jax.serve --render-response-format")
    return p


async def _amain(args) -> None:
    from dynamo.common.configuration.groups.router_args import build_router_config
    from dynamo.frontend.frontend_args import FrontendConfig
    from dynamo.llm import EngineType, EntrypointArgs, make_engine, run_input
    from dynamo.runtime import DistributedRuntime
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    config = FrontendConfig.from_cli_args(args)
    config.validate()
    if config.chat_processor != "dynamo":
        raise SystemExit("error: --dyn-chat-processor: this frontend's chat processor is dsv41_jax's")
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, config.discovery_backend, config.request_plane,
                                 event_plane=config.event_plane, response_plane=config.response_plane)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    kwargs: dict = {"http_host": config.http_host, "http_port": config.http_port,
                    "kv_cache_block_size": config.kv_cache_block_size, "router_config": build_router_config(config),
                    "migration_limit": config.migration_limit,
                    "chat_engine_factory": ChatEngineFactory(args).chat_engine_factory}
    if config.namespace:
        kwargs["namespace"] = config.namespace
    engine = await make_engine(runtime, EntrypointArgs(EngineType.Dynamic, **kwargs))
    log.info("frontend on http://%s:%d/v1, router mode %s", config.http_host, config.http_port, config.router_mode)
    try:
        await run_input(runtime, "http", engine)
    except asyncio.CancelledError:
        pass


def main(argv=None) -> int:
    try:
        import uvloop
        from dynamo.frontend.frontend_args import FrontendArgGroup  # noqa: F401
    except ImportError as e:
        from dsv41_jax.dynamo import dynamo_missing

        return dynamo_missing(e)
    os.environ.pop("DYN_SYSTEM_PORT", None)  # a worker's setting (the frontend would take its port)
    args = build_parser().parse_args(argv)
    uvloop.run(_amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
