"""The quick start (issue 9, item 3): a server started with nothing but ``--model tiny`` (plus a free
port) has the reasoning parser, the tool-call parser and ``/metrics`` on, and README command 1's
demo (``scripts/quickstart_demo.py``) gets ``reasoning_content`` with thinking on, a ``tool_calls``
response under ``tool_choice: "required"``, a parseable ``json_schema`` answer with thinking on and
Prometheus text. The server runs with its default engine shapes (the tiny model's compact buckets:
two compilations) and its default compilation cache, pointed at this session's temporary directory
through ``$JAX_COMPILATION_CACHE_DIR`` (the flag's documented default) so the user's cache is left alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from servers import free_port, start_server, stop_server, user_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT = 600


def _demo():
    spec = importlib.util.spec_from_file_location("quickstart_demo", ROOT / "scripts" / "quickstart_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("quickstart")
    env = user_env()  # the defaults, not the shell's (nor the test session's 8 CPU devices)
    # its own empty cache directory (not the run's shared one): the test below checks that the default
    # server writes its compiled steps there, and no other test writes there
    cache = str(d / "jax_cache")
    log_path = d / "server.log"
    proc, base, logf = start_server(["--model", "tiny"], log_path, cache, env=env, cwd=ROOT, timeout=START_TIMEOUT)
    yield {"base": base, "log": log_path, "cache": cache}
    rc = stop_server(proc, logf)
    assert rc == 0, log_path.read_text()[-3000:]


def test_default_server_shows_every_feature(default_server):
    out = _demo().run(default_server["base"])
    assert out["reasoning"]["reasoning_content"] and "</think>" not in json.dumps(out["reasoning"])
    assert out["tool_calls"] and all(c["function"]["name"] == "get_weather" for c in out["tool_calls"])
    assert set(out["json"]) == {"answer", "sure"} and isinstance(out["json"]["sure"], bool)
    assert "# TYPE dsv41:num_running_reqs gauge" in out["metrics"] or "dsv41:num_running_reqs" in out["metrics"]
    log = default_server["log"].read_text()
    assert "parsers: reasoning=deepseek-v41, tool calls=deepseekv41" in log
    assert "warm-up done: 2 shapes" in log  # the tiny model's compact buckets
    # an empty cache: every program of the warm-up compiled, none loaded (engine.CacheLoads counts loads)
    done = re.search(r"warm-up done: 2 shapes, (\d+) programs \((\d+) compiled, 0 loaded from the compilation cache\)",
                     log)
    assert done and done.group(1) == done.group(2) != "0", log[-3000:]
    assert os.listdir(default_server["cache"])  # the persistent cache is on by default


def test_metrics_off_is_a_404_that_says_how_to_turn_it_on():
    """--disable-metrics: GET /metrics answers an OpenAI-style 404 naming the way back (the app
    alone, no engine needed for this route)."""
    from fastapi.testclient import TestClient

    from dsv41_jax.serve import build_parser
    from dsv41_jax.serving.server import ServerConfig, build_app
    from dsv41_jax.serving.tokenizer import load_tokenizer

    assert build_parser().parse_args([]).enable_metrics is True
    assert build_parser().parse_args(["--disable-metrics"]).enable_metrics is False
    with pytest.raises(SystemExit):  # both at once is refused, not resolved silently
        build_parser().parse_args(["--enable-metrics", "--disable-metrics"])
    app = build_app(object(), load_tokenizer("tiny"), ServerConfig(enable_metrics=False))
    r = TestClient(app).get("/metrics")
    assert r.status_code == 404
    err = r.json()["error"]
    assert "--disable-metrics" in err["message"] and err["code"] == "metrics_disabled"


def test_parser_flags_resolve():
    """auto: on when the tokenizer has the marker token; none: off; a named parser: on."""
    from dsv41_jax.serve import build_parser, resolve_parser
    from dsv41_jax.serving.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    ns = build_parser().parse_args([])
    assert (ns.reasoning_parser, ns.tool_call_parser) == ("auto", "auto")
    assert resolve_parser("auto", "reasoning", tok) == "deepseek-v41"
    assert resolve_parser("auto", "tool", tok) == "deepseekv41"
    assert resolve_parser("none", "tool", tok) is None and resolve_parser("none", "reasoning", tok) is None

    class NoMarkers:
        def token_to_id(self, s):
            return None

    assert resolve_parser("auto", "reasoning", NoMarkers()) is None
    assert resolve_parser("deepseek-v41", "reasoning", NoMarkers()) == "deepseek-v41"


def test_demo_script_fails_loudly_without_a_server():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_demo.py"), "--base-url",
                        f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot reach the server" in r.stderr


def test_unusable_cache_dir_is_a_clear_error(tmp_path):
    """--compilation-cache-dir that cannot be created: a message and exit status 2 before any model
    loads (not a silent start without the cache); 'none' is how to run without it."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.serve", "--compilation-cache-dir", str(blocker / "jax")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "--compilation-cache-dir" in r.stderr and "'none'" in r.stderr, r.stderr
