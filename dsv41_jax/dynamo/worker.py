"""Our engine as a Dynamo worker (``python -m dsv41_jax.dynamo``): tokens in, tokens out.

`engine_class()` is a ``dynamo.common.backend.LLMEngine``: Dynamo's Rust ``Worker`` registers the model
(``ModelInput.Tokens``: the frontend tokenizes, the worker generates token ids), serves the endpoint
``namespace.component.endpoint``, watches for cancellation and drains on SIGTERM; this class wraps
`serving.async_engine.AsyncEngine`:

* ``start`` builds the engine (load, compile, warm up) off the event loop and returns the
  registration: the model directory (tokenizer.json, config.json: the frontend reads its tokenizer
  there), the served name, ``context_length``, ``kv_cache_block_size`` = our page size, the pool's
  pages, ``max_num_seqs`` = max_running_requests;
* ``generate`` reads the request: the sampling parameters our own frontend sends whole
  (``extra_args.dsv41.sampling``, `dsv41_jax.dynamo.frontend`), else Dynamo's ``sampling_options`` /
  ``stop_conditions`` / ``output_options`` (a stock ``dynamo.frontend``); it yields each step's new
  token ids (for our frontend with their text, from the engine's detokenizer with the ids the
  frontend asks to leave out, ``extra_args.dsv41.drop_token_ids``), and with the last chunk the finish reason, the stop reason (the EOS id or stop string)
  and ``completion_usage`` with ``prompt_tokens_details.cached_tokens`` (prefix-cache hit). A request
  the engine refuses raises ``InvalidArgument`` (HTTP 400), a full queue ``Unknown`` with the reason,
  an engine-ended request (finish reason "error") ``Unknown`` — never a short success;
* ``abort`` (client gone, request cancelled) aborts the request in the engine: its pages go back;
* ``kv_event_sources``: with the radix cache on, the cache's stored / removed prefixes are published
  at page granularity (`kv_events.KvBlockEvents`) through Dynamo's ``KvEventPublisher``, so the
  frontend's ``--router-mode kv`` sends a conversation's next turn to the worker holding its prefix;
* ``engine_control("stats")`` (``POST /engine/control/stats`` on the worker's system port,
  ``DYN_SYSTEM_PORT``) returns the engine's own counters (requests, cached prompt tokens, prefix
  cache hits, published KV blocks).

Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``; Dynamo's protocol: the
frontend sends a request first to a prefill worker with ``max_tokens=1``, then hands that worker's
final ``disaggregated_params`` to a decode worker as ``prefill_result.disaggregated_params``):

* a *prefill* worker runs the request with ``handover=True`` (`serving.handover`): its engine prefills
  the prompt, samples the first token and exports the request's state (pages, slot rows with the
  DSpark rings); the worker packs it to one buffer, offers it through NIXL (`transfer.NixlTransport`)
  and ends with ``disaggregated_params = {"dsv41": {"manifest": ..., "nixl": <descriptor>}}``;
* a *decode* worker READs the buffer from the prefill worker's memory (NIXL), checks it against its
  own engine (`handover.unpack`: model, page size, numerics, DSpark rings, digest) and runs the request
  with ``prefilled=``: the first token is the prefill worker's, the state goes into its own pages, it
  decodes (with DSpark when on) and prefills nothing; the bytes moved and the time are logged and
  counted (``engine_control("stats")``: ``handovers_imported``, ``imported_prompt_tokens``,
  ``computed_prompt_tokens``, ``transfer_*``).

A decode request without a prefill result, a failed or timed-out transfer (prefill worker gone, NIXL
error) or a state that does not fit ends with ``Unknown`` (the client gets an error status or a stream
error event, never a 200 with empty content); nothing was allocated on the decode side. The prefill
worker's pages go back when it exports; its buffer when the decode side's READ completes, or after
``--transfer-ttl`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import time
from typing import Any, Optional

log = logging.getLogger("dsv41_jax.dynamo")

__all__ = ["build_parser", "engine_class", "main", "sampling_from_request"]

DISAGGREGATION_MODES = ("aggregated", "prefill", "decode")
_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
_DYN_MODE = {"aggregated": "agg", "prefill": "prefill", "decode": "decode"}  # Dynamo's DisaggregationMode values


def build_parser() -> argparse.ArgumentParser:
    from dsv41_jax.serve import default_cache_dir
    from dsv41_jax.serving.engine_args import EngineArgs

    p = argparse.ArgumentParser(
        prog="python -m dsv41_jax.dynamo",
        description="DeepSeek-V4.1 (JAX) as an NVIDIA Dynamo worker: registers the model with the Dynamo "
                    "frontend and serves token requests. Run the frontend with `python -m dsv41_jax.dynamo.frontend` "
                    "(our chat encoding and parsers) or `python -m dynamo.frontend`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    EngineArgs.add_cli_args(p, model_default="nano")
    g = p.add_argument_group("dynamo")
    g.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"), help="Dynamo namespace")
    g.add_argument("--component", default=None,
                   help="Dynamo component name of this worker (default: dsv41, prefill workers dsv41_prefill)")
    g.add_argument("--endpoint", default="generate", help="Dynamo endpoint name")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    g.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=("etcd", "file", "kubernetes", "mem"),
                   help="Dynamo discovery: etcd, or file (a directory shared with the frontend, $DYN_FILE_KV)")
    g.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=("tcp", "nats"),
                   help="Dynamo request plane")
    g.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE") or None, choices=("nats", "zmq"),
                   help="Dynamo event plane for KV events (default: Dynamo's choice)")
    g.add_argument("--disaggregation-mode", default="aggregated", choices=DISAGGREGATION_MODES,
                   help="worker role: aggregated, or prefill / decode (the request's state moves from the prefill "
                        "worker to the decode worker through NIXL)")
    g.add_argument("--transfer-timeout", type=float, default=None,
                   help="decode role: seconds a state transfer may take before the request fails (default 60)")
    g.add_argument("--transfer-ttl", type=float, default=None,
                   help="prefill role: seconds an exported state waits for its decode worker before it is dropped "
                        "(default 120)")
    g.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not publish the prefix cache's blocks (the frontend's KV router then sees nothing)")
    g.add_argument("--compilation-cache-dir", default=default_cache_dir(),
                   help="JAX persistent compilation cache ('none' disables it)")
    g.add_argument("--log-level", default=os.environ.get("DSV41_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error"))
    return p


def sampling_from_request(request: dict):
    """Our `SamplingParams` for a Dynamo token request: the frontend's own copy when our frontend sent
    it (``extra_args.dsv41.sampling``), else built from Dynamo's fields. Bad values raise
    `SamplingParamsError` (a ValueError)."""
    from dsv41_jax.serving.sampling import SamplingParams

    ours = ((request.get("extra_args") or {}).get("dsv41") or {}).get("sampling")
    if ours is not None:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in ours.items() if k in names})
    so = request.get("sampling_options") or {}
    sc = request.get("stop_conditions") or {}
    oo = request.get("output_options") or {}
    kw: dict = {}
    for name in ("temperature", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if so.get(name) is not None:
            kw[name] = so[name]
    if so.get("top_k") not in (None, 0):
        kw["top_k"] = so["top_k"]
    if so.get("n") not in (None, 1):
        kw["n"] = so["n"]
    kw["max_tokens"] = sc.get("max_tokens")
    if sc.get("min_tokens"):
        kw["min_tokens"] = sc["min_tokens"]
    if sc.get("ignore_eos"):
        kw["ignore_eos"] = True
    if sc.get("stop"):
        kw["stop"] = list(sc["stop"])
    stop_ids = list(sc.get("stop_token_ids_hidden") or []) + list(sc.get("stop_token_ids") or [])
    if stop_ids:
        kw["stop_token_ids"] = stop_ids
    if oo.get("logprobs") is not None:
        kw["logprobs"] = oo["logprobs"]
    if oo.get("skip_special_tokens") is not None:
        kw["skip_special_tokens"] = bool(oo["skip_special_tokens"])
    return SamplingParams(**kw)


def engine_class():
    """The ``LLMEngine`` subclass (built on first call: it needs Dynamo's base class)."""
    from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
    from dynamo.common.backend.publisher import PushSource
    from dynamo.common.constants import DisaggregationMode
    from dynamo.llm.exceptions import InvalidArgument, Unknown

    class _DsvEngine(LLMEngine):
        def __init__(self, args: argparse.Namespace, engine_args):
            self.args = args
            self.engine_args = engine_args
            self.engine = None  # AsyncEngine, built in start()
            self.blocks: dict = {}  # dp rank -> its prefix cache's KvBlockEvents
            self.loop: Optional[asyncio.AbstractEventLoop] = None
            self.requests = 0
            self.mode = args.disaggregation_mode
            self.transport = None  # NixlTransport (prefill / decode roles)
            self.transfer_seconds = 0.0

        @classmethod
        async def from_args(cls, argv=None):
            args, engine_args = parse_args(argv)
            name = args.served_model_name or _served_name(engine_args.model)
            if args.component is None:
                args.component = "dsv41_prefill" if args.disaggregation_mode == "prefill" else "dsv41"
            wc = WorkerConfig(namespace=args.namespace, component=args.component, endpoint=args.endpoint,
                              model_name=engine_args.model, served_model_name=name,
                              discovery_backend=args.discovery_backend, request_plane=args.request_plane,
                              event_plane=args.event_plane,
                              enable_kv_routing=args.kv_events and args.disaggregation_mode != "decode",
                              disaggregation_mode=DisaggregationMode(_DYN_MODE[args.disaggregation_mode]))
            args.served_model_name = name
            return cls(args, engine_args), wc

        async def start(self, worker_id: int):
            from dsv41_jax.serving.async_engine import AsyncEngine

            self.loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            if self.mode != "aggregated":
                from dsv41_jax.dynamo.transfer import NixlTransport

                self.transport = NixlTransport(f"dsv41-{self.mode}-{worker_id}", ttl=self.args.transfer_ttl)
            self.engine = await asyncio.to_thread(AsyncEngine, self.engine_args)
            inner = self.engine.engine
            a = inner.allocator
            log.info("engine ready in %.1fs: %s, page size %d, %d pages, context_length %d, worker %s, role %s%s",
                     time.perf_counter() - t0, self.engine_args.model, a.page_size, a.capacity,
                     inner.context_length, worker_id, self.mode,
                     f", NIXL agent {self.transport.name}" if self.transport is not None else "")
            return EngineConfig(
                model=self.engine_args.model, served_model_name=self.args.served_model_name,
                llm=LlmRegistration(context_length=inner.context_length, kv_cache_block_size=a.page_size,
                                    total_kv_blocks=a.capacity, max_num_seqs=self.engine_args.max_running_requests,
                                    max_num_batched_tokens=self.engine_args.max_prefill_tokens))

        # -------------------------------------------------------------------------- KV events
        async def kv_event_sources(self):
            cache = self.engine.engine.prefix_cache if self.engine is not None else None
            if not self.args.kv_events or cache is None or self.mode == "decode":
                log.info("KV events: off (%s)", "--no-kv-events" if not self.args.kv_events else
                         "decode role: the router places prefills" if self.mode == "decode" else "no radix cache")
                return []
            # one source per data-parallel attention rank: each rank's prefix cache publishes its own blocks
            return [PushSource(on_ready=functools.partial(self._kv_ready, r), dp_rank=r)
                    for r in range(len(self._prefix_caches()))]

        def _prefix_caches(self) -> list:
            """The engine's prefix caches, one per dp rank (rank r's at index r)."""
            runner = self.engine.engine.runner
            return list(getattr(runner, "prefix_caches", [runner.prefix_cache]))

        def _kv_ready(self, rank: int, publisher) -> None:
            from dsv41_jax.dynamo.kv_events import KvBlockEvents

            loop = self.loop

            def send(ev):  # engine thread -> the event loop (publisher calls stay on one thread)
                if ev[0] == "stored":
                    _, toks, nbt, hs, parent = ev
                    loop.call_soon_threadsafe(lambda: publisher.publish_stored(toks, nbt, hs, parent))
                else:
                    loop.call_soon_threadsafe(lambda: publisher.publish_removed(ev[1]))

            ps = self.engine.engine.allocator.page_size
            self.blocks[rank] = KvBlockEvents(ps, send)
            self._prefix_caches()[rank].on_tree_event = self.blocks[rank].on_tree_event
            log.info("KV events: the prefix cache%s publishes its blocks (%d tokens each)",
                     f" of dp rank {rank}" if len(self._prefix_caches()) > 1 else "", ps)

        # -------------------------------------------------------------------------- requests
        @staticmethod
        def _rid(context) -> str:
            return f"dyn-{context.id()}"

        async def generate(self, request, context):
            from dsv41_jax.serving.engine import EngineError, EngineInternalError, QueueFullError
            from dsv41_jax.serving.handover import HandoverError

            ids = [int(t) for t in request.get("token_ids") or []]
            try:
                sp = sampling_from_request(request)
            except (ValueError, TypeError) as e:
                raise InvalidArgument(str(e)) from None
            rid = self._rid(context)
            self.requests += 1
            ours = (request.get("extra_args") or {}).get("dsv41")
            drop = tuple(int(t) for t in (ours or {}).get("drop_token_ids") or ())
            generated = {}
            kw: dict = {}
            if self.mode == "prefill":
                if sp.n != 1:
                    raise InvalidArgument("n > 1 is not served by disaggregated workers")
                # Dynamo's contract: the prefill worker gives the first token (and the state after the prompt)
                sp = sp.replace(max_tokens=1, min_tokens=min(sp.min_tokens, 1))
                kw["handover"] = True
            elif self.mode == "decode":
                kw["prefilled"] = await self._receive(request, ids, rid)
            try:
                async for out in self.engine.generate(ids, sp, rid, drop_token_ids=drop, **kw):
                    for c in out.outputs:
                        generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                        chunk: dict = {"token_ids": [int(t) for t in c.token_ids], "index": c.index}
                        if ours is not None:  # our frontend: the engine's text (its one detokenizer)
                            chunk["text"] = c.text
                        if c.finish_reason is not None:
                            chunk["finish_reason"] = _FINISH.get(c.finish_reason, c.finish_reason)
                            if c.stop_reason is not None:
                                chunk["stop_reason"] = c.stop_reason
                        if out.finished and c.finish_reason is not None:
                            total = sum(generated.values())
                            chunk["completion_usage"] = {
                                "prompt_tokens": len(ids), "completion_tokens": total,
                                "total_tokens": len(ids) + total,
                                "prompt_tokens_details": {"cached_tokens": int(out.num_cached_tokens or 0)}}
                            if self.mode == "prefill":
                                chunk["disaggregated_params"] = self._offer(rid, out)
                        yield chunk
            except HandoverError as e:  # a state from the prefill worker this engine cannot take: not the client's fault
                raise Unknown(f"the prefill worker's state does not fit this decode worker: {e}") from None
            except (EngineError, ValueError) as e:
                raise InvalidArgument(str(e)) from None
            except QueueFullError as e:
                raise Unknown(f"queue full: {e}") from None
            except EngineInternalError as e:
                raise Unknown(f"the engine ended the request: {e}") from None

        # -------------------------------------------------------------------------- disaggregation
        def _offer(self, rid: str, out) -> dict:
            """Prefill role: the exported state's buffer offered through NIXL; the disaggregated_params
            the frontend hands to the decode worker."""
            from dsv41_jax.serving import handover

            st = out.prefilled_state
            if st is None:  # (the engine exports every handover request that finished with a token)
                raise Unknown("the prefill worker's engine exported no state for the request")
            manifest, buf = handover.pack(st)
            desc = self.transport.offer(rid, buf)
            log.info("request %s: prefilled %d tokens, state of %d bytes (%d pages) offered via NIXL", rid,
                     len(st.prompt_ids), buf.nbytes, len(st.pages))
            return {"dsv41": {"manifest": manifest, "nixl": desc}}

        async def _receive(self, request, ids: list, rid: str):
            """Decode role: the request's state from its prefill worker (NIXL READ), checked against this
            engine. Raises `Unknown` (an error for the client) when there is none or it cannot be had."""
            from dsv41_jax.dynamo.transfer import TransferError
            from dsv41_jax.serving import handover

            pr = request.get("prefill_result") or {}
            params = (pr.get("disaggregated_params") or {}).get("dsv41")
            if not params or "manifest" not in params or "nixl" not in params:
                raise Unknown("decode worker: the request carries no prefill result from a dsv41_jax prefill worker "
                              "(run prefill workers beside the decode workers)")
            t0 = time.perf_counter()
            try:
                buf = await asyncio.to_thread(self.transport.fetch, params["nixl"], self.args.transfer_timeout)
                state = handover.unpack(params["manifest"], buf, self.engine.engine.runner.handover_layout())
            except (TransferError, handover.HandoverError) as e:
                log.error("request %s: state transfer failed: %s", rid, e)
                raise Unknown(f"KV transfer from the prefill worker failed: {e}") from None
            dt = time.perf_counter() - t0
            self.transfer_seconds += dt
            log.info("request %s: received %d bytes (%d prompt tokens, %d pages) from %s via NIXL in %.1f ms", rid,
                     buf.nbytes, len(state.prompt_ids), len(state.pages), params["nixl"].get("agent"), dt * 1e3)
            return state

        async def abort(self, context):
            if self.engine is not None:
                self.engine.abort(self._rid(context))

        async def cleanup(self):
            if self.engine is not None:
                for c in self._prefix_caches():
                    if c is not None:
                        c.on_tree_event = None
                await asyncio.to_thread(self.engine.shutdown)
                self.engine = None
            if self.transport is not None:
                self.transport.close()

        # -------------------------------------------------------------------------- stats
        def supported_controls(self):
            return {"stats"}

        async def engine_control(self, control, body):
            if control != "stats" or self.engine is None:
                return {"status": "error", "message": f"unsupported engine control: {control}"}
            s = await asyncio.to_thread(self.engine.stats)
            keep = ("requests_finished", "prompt_tokens", "cached_prompt_tokens", "computed_prompt_tokens",
                    "generation_tokens", "prefix_cache_hits", "prefix_cache_entries", "requests_aborted",
                    "num_running_reqs", "num_used_tokens", "max_total_num_tokens", "handovers_exported",
                    "handover_bytes_exported", "handovers_imported", "handover_bytes_imported",
                    "imported_prompt_tokens", "spec_verify_steps", "spec_accepted_tokens", "requests_failed")
            out = {k: s[k] for k in keep if k in s}
            out["requests"] = self.requests
            out["disaggregation_mode"] = self.mode
            if self.transport is not None:
                out.update(self.transport.stats(), transfer_seconds=self.transfer_seconds)
            b = list(self.blocks.values())  # (over the dp ranks)
            out["kv_blocks_published"] = sum(x.num_blocks for x in b) if b else None
            # events handed to the publisher (the router's `kv_cache_events_applied` counts them in)
            out["kv_stored_events"] = sum(x.stored_events for x in b)
            out["kv_removed_events"] = sum(x.removed_events for x in b)
            return {"status": "ok", "stats": out}

    return _DsvEngine


def _served_name(model: str) -> str:
    if model == "tiny":
        return "tiny"
    return os.path.basename(os.path.normpath(model)) or model


def parse_args(argv=None):
    """(namespace, EngineArgs); exits with status 2 and a message for a bad value."""
    from dsv41_jax.serving.engine_args import EngineArgs

    p = build_parser()
    args = p.parse_args(argv)
    mode = args.disaggregation_mode
    for flag, value, role in (("--transfer-timeout", args.transfer_timeout, "decode"),
                              ("--transfer-ttl", args.transfer_ttl, "prefill")):
        if value is not None and mode != role:
            p.error(f"{flag} applies to {role} workers (--disaggregation-mode {role}), not to a {mode} worker")
        if value is not None and value <= 0:
            p.error(f"{flag} must be > 0, got {value}")
    args.transfer_timeout = 60.0 if args.transfer_timeout is None else args.transfer_timeout
    args.transfer_ttl = 120.0 if args.transfer_ttl is None else args.transfer_ttl
    if mode != "aggregated":
        try:
            import nixl._api  # noqa: F401
        except ImportError as e:
            p.error(f"--disaggregation-mode {args.disaggregation_mode}: needs NIXL, which is not installed ({e}); "
                    "install it with scripts/install_dynamo.sh")
    try:
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.resolved_impl()
    except (ValueError, TypeError) as e:
        p.error(str(e))
    if not os.path.isdir(engine_args.model):
        p.error(f"--model {engine_args.model!r}: a model directory is needed (the frontend reads its tokenizer "
                "there): 'nano' or a model directory")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    cache_dir = args.compilation_cache_dir
    if cache_dir and cache_dir.lower() != "none":
        import jax

        cache_dir = os.path.expanduser(cache_dir)
        os.makedirs(cache_dir, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return args, engine_args


def main(argv=None) -> int:
    try:
        from dynamo.common.backend.run import run
    except ImportError as e:
        from dsv41_jax.dynamo import dynamo_missing

        return dynamo_missing(e)
    cls = engine_class()
    run(cls, argv)
    return 0
