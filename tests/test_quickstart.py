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
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT = 600


def _demo():
    spec = importlib.util.spec_from_file_location("quickstart_demo", ROOT / "scripts" / "quickstart_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("quickstart")
    port = _free_port()
    # the defaults, not the shell's (nor the test session's 8 CPU devices)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") and k != "XLA_FLAGS"}
    env["JAX_COMPILATION_CACHE_DIR"] = str(d / "jax_cache")
    env.setdefault("JAX_PLATFORMS", "cpu")
    log_path = d / "server.log"
    logf = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_jax.serve", "--model", "tiny", "--port", str(port)],
                            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            logf.close()
            pytest.fail(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > START_TIMEOUT:
            proc.kill()
            pytest.fail(f"the server did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    yield {"base": base, "log": log_path, "cache": d / "jax_cache"}
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    logf.close()
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
    assert os.listdir(default_server["cache"])  # the persistent cache is on by default


def test_demo_script_fails_loudly_without_a_server():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "quickstart_demo.py"), "--base-url",
                        f"http://127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot reach the server" in r.stderr
