"""``python -m dsv41_jax.serve``: the OpenAI-compatible server (FastAPI on uvicorn).

    python -m dsv41_jax.serve                      # the embedded tiny model (random weights), :30000
    python -m dsv41_jax.serve --model /path/to/DeepSeek-V4.1-Flash --port 30000

The reasoning parser, the tool-call parser and ``/metrics`` are on by default for every model this
server loads (V4.1-family checkpoints, tiny included: ``auto`` resolves a parser to the V4.1 one
when the tokenizer has its marker tokens, ``</think>`` and ``｜DSML｜``); ``--reasoning-parser none``,
``--tool-call-parser none`` and ``--disable-metrics`` turn them off. The JAX persistent compilation
cache is on by default (``--compilation-cache-dir``), so a second start skips the XLA compilations.

Every engine flag (SGLang spelling: ``--max-running-requests``, ``--chunked-prefill-size``,
``--page-size``, ``--context-length``, ``--kv-cache-dtype``, ``--mem-fraction-static``, ``--tp``,
``--ep``, ``--max-queued-requests`` …) comes from :class:`dsv41_jax.serving.engine_args.EngineArgs`;
the server adds its own group (``--help`` lists them all).

Startup order: flags and the environment (``DSV41_DEFAULT_THINKING``, ``DSV41_REASONING_EFFORT``)
are validated first and the port is bound (not yet listening: a client is refused, not kept
waiting, while the model loads) — a bad value, a port in use or a mesh these devices cannot hold
prints one ``error: ...`` line and exits with status 2 before anything is compiled — then the model
loads and compiles, then the server listens on the bound port. SIGTERM / SIGINT: stop
accepting, let in-flight requests finish for ``--graceful-shutdown-timeout`` seconds, abort the
rest, stop the engine, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import textwrap
import threading
import time

from dsv41_jax.serving.engine_args import HelpFormatter  # stdlib-only module: --help stays light

__all__ = ["build_parser", "main"]

log = logging.getLogger("dsv41_jax.serve")

REASONING_PARSERS = ("deepseek-v41", "deepseek_v41", "auto", "none")
TOOL_CALL_PARSERS = ("deepseekv41", "deepseek_v41", "auto", "none")
# the marker token each V4.1 parser needs in the tokenizer ("auto" turns the parser on when it is there)
_PARSER_MARKERS = {"reasoning": "</think>", "tool": "｜DSML｜"}


def default_cache_dir() -> str:
    """The persistent compilation cache's default: $JAX_COMPILATION_CACHE_DIR, else
    $XDG_CACHE_HOME/dsv41_jax/jax, else ~/.cache/dsv41_jax/jax (the per-user cache directory)."""
    env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(base, "dsv41_jax", "jax")


def _size(text: str) -> int:
    """Bytes from '16777216', '16M', '16MiB', '512k'."""
    s = str(text).strip().lower().replace("ib", "").replace("b", "")
    mult = 1
    for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        v = int(float(s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 16M or 1048576, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return v


def endpoint_lines(endpoints=None) -> str:
    """The server's endpoints, one per line (``--help`` and the start-up log)."""
    from dsv41_jax.serving.protocol import ENDPOINTS

    return "\n".join(f"  {m:4} {p:22} {what}" for m, p, what in (endpoints or ENDPOINTS))


class _HelpFormatter(HelpFormatter):
    """Wraps each line of the description and the epilog on its own, so the endpoint list keeps one
    endpoint per line (an indented line continues under its text column); each flag's default is
    stated once (`engine_args.HelpFormatter`)."""

    def _fill_text(self, text, width, indent):
        out = []
        for line in text.splitlines():
            hang = " " * (len(line) - len(line.lstrip()) + (28 if line.startswith("  ") else 0))
            out.append(textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + hang) or indent)
        return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    from dsv41_jax.serving.engine_args import EngineArgs

    p = argparse.ArgumentParser(
        prog="python -m dsv41_jax.serve",
        description="OpenAI-compatible server for DeepSeek-V4.1 Flash (JAX). Without --model it serves nano, "
                    "the small model of this architecture trained on a synthetic chat corpus and bundled in the "
                    "package (it reasons, calls tools and speculates for real, on any machine); --model tiny "
                    "serves the random-weight tiny model the tests use.",
        formatter_class=_HelpFormatter,
        epilog="Environment: DSV41_DEFAULT_THINKING (true/false, default false) turns thinking on for requests "
               "that do not decide it; DSV41_REASONING_EFFORT (a tier such as high/max, or 1..100) is the default "
               "effort. Both are validated at startup.\n\nEndpoints:\n" + endpoint_lines())
    EngineArgs.add_cli_args(p, model_default="nano")
    from dsv41_jax.parallel.distributed import add_distributed_args

    add_distributed_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=30000, help="TCP port")
    g.add_argument("--api-key", default=os.environ.get("DSV41_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $DSV41_API_KEY, else no key)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id reported by /v1/models and accepted in requests (default: the --model "
                        "name: 'nano', 'tiny', or the model directory's name, its Hugging Face id when the path "
                        "shows one); the model path and directory name are accepted too")
    g.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="split thinking into reasoning_content: deepseek-v41; auto (the default) = deepseek-v41 "
                        "when the tokenizer has </think> (every V4.1-family model, tiny included); none = "
                        "reasoning and answer arrive together in content")
    g.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                   help="parse spaced-DSML tool calls into message.tool_calls: deepseekv41; auto (the default) = "
                        "deepseekv41 when the tokenizer has the DSML token (every V4.1-family model); none = the "
                        "markup is stripped from content and tool_choice required / named is refused (400)")
    mg = g.add_mutually_exclusive_group()
    mg.add_argument("--enable-metrics", dest="enable_metrics", action="store_true", default=True,
                    help="serve Prometheus metrics at GET /metrics (running / queued requests, token usage, "
                         "throughput, TTFT / ITL histograms, cache hit rate); on by default")
    mg.add_argument("--disable-metrics", dest="enable_metrics", action="store_false", default=argparse.SUPPRESS,
                    help="no /metrics endpoint (it answers 404 saying how to turn it on)")
    g.add_argument("--max-body-size", type=_size, default=16 << 20,
                   help="largest request body in bytes (K/M/G suffixes); larger bodies get HTTP 413")
    g.add_argument("--graceful-shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted")
    g.add_argument("--reasoning-effort-tiers", default=None,
                   help="tier table, e.g. 'low=50,high=75,max=100' (default: the checkpoint encoder's "
                        "REASONING_EFFORT_MAPPINGS, else that table)")
    g.add_argument("--render-response-format", action="store_true",
                   help="also describe response_format in the system prompt (it is always enforced by "
                        "constrained decoding; rendering is off by default, as in SGLang)")
    g.add_argument("--constrained-json-whitespace-pattern", default=None,
                   help="regex of the whitespace allowed between JSON tokens under response_format / tool "
                        "constraints (default: none; the checkpoint's ', ' and ': ' separators only)")
    g.add_argument("--max-n", type=int, default=16, help="largest n (choices per request) accepted")
    g.add_argument("--timeout-keep-alive", type=int, default=5, help="HTTP keep-alive timeout in seconds")
    g.add_argument("--compilation-cache-dir", default=default_cache_dir(),
                   help="JAX persistent compilation cache: every compiled step is stored there, so later starts "
                        "skip the warm-up's XLA compilations (entries are keyed by the program, the flags and the "
                        "jax / jaxlib versions, so a stale entry is never reused); 'none' disables it. Default: "
                        "$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/dsv41_jax/jax, else "
                        "~/.cache/dsv41_jax/jax; here: %(default)s")
    g.add_argument("--log-level", default=os.environ.get("DSV41_LOG_LEVEL", "info"),
                   choices=("debug", "info", "warning", "error"), help="log level of the server and the engine")
    g.add_argument("--log-level-http", default="warning", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's access-log level")
    return p


def resolve_parser(value: str, kind: str, tokenizer) -> "str | None":
    """The parser a ``--reasoning-parser`` / ``--tool-call-parser`` value selects: None for "none";
    for "auto", the V4.1 parser when the tokenizer has its marker token (a model without it could
    never produce the markup); the named parser otherwise."""
    known = "deepseek-v41" if kind == "reasoning" else "deepseekv41"
    if value == "none":
        return None
    if value == "auto" and tokenizer.token_to_id(_PARSER_MARKERS[kind]) is None:
        log.info("%s parser: auto -> none (the tokenizer has no %s token)", kind, _PARSER_MARKERS[kind])
        return None
    return known


def model_aliases(model: str) -> list:
    """Names a request may use for the served model: the path, its directory name, and the Hugging
    Face repo id when the path shows it (``.../models--ORG--NAME/snapshots/<rev>`` or a directory
    named like a DeepSeek release, as in the vendor pages' ``deepseek-ai/DeepSeek-V4.1-Flash``)."""
    out = [model]
    norm = os.path.normpath(model)
    base = os.path.basename(norm)
    out.append(base)
    for part in norm.split(os.sep):
        if part.startswith("models--") and part.count("--") >= 2:
            org, name = part[len("models--"):].split("--", 1)
            out += [f"{org}/{name}", name]
    if base.lower().startswith("deepseek"):
        out.append(f"deepseek-ai/{base}")
    return list(dict.fromkeys(a for a in out if a))


def _served_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model == "tiny":
        return "tiny"
    hub = [a for a in model_aliases(args.model) if "/" in a and not os.path.exists(a)]
    return hub[0] if hub else (os.path.basename(os.path.normpath(args.model)) or args.model)


class CompileTimes:
    """Where a start-up's time went, from JAX's monitoring events while active (a context manager): the
    number of XLA programs built (compiled, or loaded from the persistent compilation cache) and the
    seconds spent tracing, lowering and compiling / loading, summed over the threads that built them
    (the warm-up compiles in threads). A warm start loads every program, yet still traces and lowers
    each: that, not XLA, is most of its time."""

    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "build"}  # XLA's compile or a cache load

    def __init__(self):
        self.secs = dict.fromkeys(self.EVENTS.values(), 0.0)
        self.programs = 0
        self._lock = threading.Lock()

    def __call__(self, event: str, duration_secs: float, **kwargs) -> None:
        what = self.EVENTS.get(event)
        if what is not None:
            with self._lock:
                self.secs[what] += duration_secs
                self.programs += what == "build"

    def __enter__(self) -> "CompileTimes":
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self)

    def summary(self, cache_loads: int) -> str:
        """'N XLA programs (C compiled, L loaded from the persistent compilation cache); tracing ..."""
        loads = min(cache_loads, self.programs)
        s = self.secs
        return (f"{self.programs} XLA programs ({self.programs - loads} compiled, {loads} loaded from the persistent "
                f"compilation cache); summed over threads: tracing {s['trace']:.1f}s, lowering {s['lower']:.1f}s, "
                f"compiling or loading {s['build']:.1f}s")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) but not listening: taken before the model loads, so a port in use
    is refused at once rather than after the compile, and handed to uvicorn, which listens on it once
    the server is ready (until then a client's connection is refused, not queued). Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse it at once
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s %(levelname)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    if args.log_level != "debug":  # JAX's "Unable to initialize backend 'tpu' / 'proxy'" on every CPU start: noise
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)

    # ---- multi-host first: jax.distributed must start before anything asks JAX for a backend (resolved_impl
    # does); process 0 serves HTTP, the others only execute its steps (`serving.multihost`)
    import jax

    from dsv41_jax.parallel.distributed import initialize_from

    try:
        follower = initialize_from(args) and jax.process_index() > 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # ---- validate everything cheap before loading the model
    from dsv41_jax.chat_format.effort import ConfigError, parse_tier_table
    from dsv41_jax.chat_format.registry import ChatFormat
    from dsv41_jax.serving.engine_args import EngineArgs

    try:
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.resolved_impl()  # --impl: refused here if this backend cannot honour it (and logged)
    except (ValueError, TypeError, NotImplementedError) as e:  # NotImplementedError: a checkpoint family
        # the model cannot run yet (a DeepSeek-V4 config, issue 48), found while sizing the model
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.model = engine_args.model  # "nano" resolved to its bundled directory
    if args.model != "tiny" and not os.path.exists(args.model):
        print(f"error: --model {args.model!r}: no such directory (use 'nano', 'tiny' or a model directory)", file=sys.stderr)
        return 2
    if os.path.isdir(args.model):  # the checkpoint's family and what it cannot serve with: before anything loads
        from dsv41_jax.model.config import ConfigError, ModelConfig
        from dsv41_jax.serving.model_step import for_config
        from dsv41_jax.serving.request import EngineError

        try:
            mcfg = ModelConfig.from_pretrained(args.model)
            for_config(mcfg).refuse(engine_args, mcfg)  # e.g. a DeepSeek-V4 checkpoint on a mesh or with DSpark
        except (ConfigError, OSError) as e:
            print(f"error: --model {args.model!r}: {e}", file=sys.stderr)
            return 2
        except EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not (0 < args.port < 65536):
        print(f"error: --port must be 1..65535, got {args.port}", file=sys.stderr)
        return 2
    model_dir = args.model if os.path.isdir(args.model) else None
    try:  # the chat encoding of the checkpoint's family, its wording and the defaults: chosen once, here
        tiers = parse_tier_table(args.reasoning_effort_tiers) if args.reasoning_effort_tiers else None
        chat_format = ChatFormat.for_model(model_dir, tiers=tiers)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.constrained_json_whitespace_pattern:
        import re
        try:
            re.compile(args.constrained_json_whitespace_pattern)
        except re.error as e:
            print(f"error: --constrained-json-whitespace-pattern: {e}", file=sys.stderr)
            return 2
    try:
        sock = None if follower else bind_port(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e} (another server there? pick "
              f"a free port with --port)", file=sys.stderr)
        return 2
    log.info("chat: %s", chat_format.describe())

    # ---- the engine (loads and compiles the model)
    cache_dir = args.compilation_cache_dir
    if cache_dir and cache_dir.lower() != "none":
        cache_dir = os.path.expanduser(cache_dir)
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            print(f"error: --compilation-cache-dir {cache_dir!r}: {e} (pass 'none' to run without the cache)",
                  file=sys.stderr)
            return 2
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        # every executable, even the small helpers that compile in under a second: a warm start
        # then compiles nothing at all
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        log.info("JAX compilation cache: %s", cache_dir)
    else:
        log.info("JAX compilation cache: off")
    devs = jax.devices()
    log.info("JAX %s, backend %s: %d device(s) (%s)", jax.__version__, jax.default_backend(), len(devs),
             devs[0].device_kind if devs else "?")
    try:
        engine_args.check_devices(len(devs), devs[0].platform if devs else "none")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("engine: model=%s dtype=%s (activations %s) kv_cache_dtype=%s page_size=%d max_running_requests=%d "
             "chunked_prefill_size=%d max_queued_requests=%s tp=%d ep=%d dp=%d", engine_args.model, engine_args.dtype,
             engine_args.act_dtype, engine_args.kv_cache_dtype, engine_args.page_size,
             engine_args.max_running_requests, engine_args.chunked_prefill_size, engine_args.max_queued_requests,
             engine_args.tp_size, engine_args.ep_size, engine_args.dp_size)
    from dsv41_jax.parallel.mesh import MeshError
    from dsv41_jax.serving.async_engine import AsyncEngine
    from dsv41_jax.serving.engine import CacheLoads, EngineError, QueueFullError

    t0 = time.perf_counter()
    try:
        with CacheLoads() as loads, CompileTimes() as times:
            engine = AsyncEngine(engine_args, start=not follower)
    except (EngineError, MeshError, NotImplementedError) as e:  # a refused configuration (DSpark without
        # mtp.* weights, a mesh these devices cannot hold, a checkpoint family the model cannot run yet):
        # one line saying why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - report and exit non-zero
        log.exception("engine start failed")
        print(f"error: engine start failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    log.info("engine ready in %.1fs: %s", time.perf_counter() - t0, times.summary(loads.count))
    if follower:  # multi-process: process 0 schedules and serves; this one executes its steps until it stops
        try:
            engine.engine.follow()
        except EngineError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0

    import llguidance

    from dsv41_jax.serving.constrained import GrammarCompiler
    from dsv41_jax.serving.server import ServerConfig, build_app, endpoints

    inner = engine.engine
    tokenizer = inner.tokenizer
    vocab = inner.vocab_size
    reasoning_parser = resolve_parser(args.reasoning_parser, "reasoning", tokenizer)
    tool_parser = resolve_parser(args.tool_call_parser, "tool", tokenizer)
    log.info("parsers: reasoning=%s, tool calls=%s", reasoning_parser or "none", tool_parser or "none")
    grammar = GrammarCompiler(tokenizer, vocab, whitespace_pattern=args.constrained_json_whitespace_pattern,
                              tag_names=chat_format.tool_tag_names)
    log.info("constrained decoding: llguidance %s (response_format json_object / json_schema, regex, "
             "tool_choice required / named)", getattr(llguidance, "__version__", "?"))
    name = _served_name(args)
    aliases = [a for a in model_aliases(args.model) if a != name]
    cfg = ServerConfig(
        model_name=name, model_aliases=aliases, api_key=args.api_key or None,
        context_length=inner.context_length, vocab_size=vocab,
        max_body_bytes=args.max_body_size, max_queued_requests=engine_args.max_queued_requests,
        max_running_requests=engine_args.max_running_requests, reasoning_parser=reasoning_parser,
        tool_call_parser=tool_parser, chat_format=chat_format, enable_metrics=args.enable_metrics,
        render_response_format=args.render_response_format, max_n=args.max_n)
    app = build_app(engine, tokenizer, cfg, grammar=grammar, on_shutdown=engine.shutdown,
                    queue_full_errors=(QueueFullError,), bad_request_errors=(EngineError,))
    log.info("serving %r (aliases %s) on http://%s:%d/v1, context_length=%d, API key %s, metrics %s, body limit "
             "%d bytes", name, aliases, args.host, args.port, cfg.context_length,
             "required" if cfg.api_key else "off", "on /metrics" if cfg.enable_metrics else "off",
             cfg.max_body_bytes)
    log.info("endpoints:\n%s", endpoint_lines(endpoints(engine)))
    return run_uvicorn(app, args, sock)


def run_uvicorn(app, args, sock: socket.socket) -> int:
    """Serve `app` on `sock` (`bind_port`'s) until a signal stops it; the exit status."""
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level_http,
                            timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout, lifespan="on",
                            access_log=args.log_level_http in ("debug", "info"))
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
    # handlers in place that re-raise is a no-op and the process exits 0
    received = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: received.append(s))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a second Ctrl-C
        pass
    if getattr(server, "started", True) is False:
        log.error("the server did not start (port %d in use?)", args.port)
        return 1
    log.info("server stopped%s", f" (signal {received[0]})" if received else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
