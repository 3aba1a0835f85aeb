"""scripts/bench_serving.py: statistics, prompt sources, and a full sweep against a small
OpenAI-compatible SSE endpoint (stdlib HTTP server on loopback; the benchmark works against any
endpoint). A run against our own live server is marked slow."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_serving.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


bench = _load()


class _Handler(BaseHTTPRequestHandler):
    """Streams max_tokens one-token chunks, 2 ms apart; 'usage' at the end."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers["content-length"])
        req = json.loads(self.rfile.read(n))
        _Handler.seen.append((self.path, req))
        k = int(req.get("max_tokens", 4))
        prompt = req.get("prompt") or req.get("messages")
        p_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        chat = self.path.endswith("chat/completions")
        for i in range(k):
            time.sleep(0.002)
            choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
            self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            self.wfile.flush()
        usage = {"prompt_tokens": p_tokens, "completion_tokens": k, "total_tokens": p_tokens + k}
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture(scope="module")
def fake_endpoint():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_stats_percentiles():
    s = bench._stats([0.001 * i for i in range(1, 101)])
    assert abs(s["mean"] - 50.5) < 1e-9 and abs(s["median"] - 50.5) < 1e-9 and abs(s["p99"] - 99.01) < 1e-6
    assert bench._stats([])["mean"] is None
    r = [bench.RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
         bench.RequestResult(ok=False, error="HTTP 503")]
    out = bench.summarize(r, 2.0, 4)
    assert out["completed"] == 1 and out["failed"] == 1 and out["errors"] == ["HTTP 503"]
    assert out["output_throughput"] == 2.5 and out["request_throughput"] == 0.5
    assert abs(out["tpot_ms"]["mean"] - 100.0) < 1e-9 and abs(out["itl_ms"]["median"] - 100.0) < 1e-9


def test_prompt_sources(tmp_path):
    p = bench.random_prompts(5, 20, 0.5, 0)
    assert len(p) == 5 and all(10 <= len(x["text"].split()) <= 20 for x in p)
    assert p == bench.random_prompts(5, 20, 0.5, 0)  # seeded
    from dsv41_jax.serving.tokenizer import load_tokenizer

    ids = bench.random_prompts(3, 16, 1.0, 1, load_tokenizer("tiny"))
    assert all(len(x["ids"]) == 16 for x in ids)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    items = bench.file_prompts(str(f), 4, 0)
    assert len(items) == 4 and {"text": "a b"} in items
    t = tmp_path / "p.txt"
    t.write_text("one\n\ntwo\n")
    assert [x["text"] for x in bench.file_prompts(str(t), 2, 0)] == ["one", "two"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_sweep_against_an_endpoint(fake_endpoint, tmp_path, endpoint):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    _Handler.seen.clear()
    rc = bench.main(["--base-url", fake_endpoint + "/v1", "--endpoint", endpoint, "--num-prompts", "6",
                     "--concurrency", "1,3", "--random-input-len", "8", "--random-output-len", "5",
                     "--ignore-eos", "--output-json", str(out_json), "--output-png", str(out_png), "--warmup", "1"])
    assert rc == 0
    rep = json.loads(out_json.read_text())
    assert rep["model"] == "fake-model" and [lv["concurrency"] for lv in rep["levels"]] == [1, 3]
    for lv in rep["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0 and lv["total_output_tokens"] == 30
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            assert set(lv[k]) == {"mean", "median", "p99", "std"} and lv[k]["median"] > 0
        assert lv["request_throughput"] > 0 and lv["output_throughput"] > 0 and lv["total_token_throughput"] > 0
        # The endpoint sleeps 2 ms before each of its 5 tokens, so every request lasts >= 10 ms whatever the
        # load (inter-token gaps have no such bound: a loaded client may read two chunks in one recv).
        assert lv["e2e_latency_ms"]["median"] >= 9.9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path, req = _Handler.seen[-1]
    assert path == ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    assert req["stream"] is True and req["stream_options"] == {"include_usage": True} and req["ignore_eos"] is True


def test_unreachable_endpoint_reports_failures(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = bench.main(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2",
                     "--concurrency", "2", "--warmup", "0", "--timeout", "5",
                     "--output-json", str(tmp_path / "x.json")])
    assert rc == 1
    lv = json.loads((tmp_path / "x.json").read_text())["levels"][0]
    assert lv["failed"] == 2 and lv["errors"]


@pytest.mark.slow
def test_against_our_server(tmp_path):
    """The benchmark against `python -m dsv41_jax.serve` on the tiny model (slow: compiles the model)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_server import ENGINE_FLAGS, start_server, stop_server

    proc, base, logf = start_server(ENGINE_FLAGS, tmp_path / "s.log", tmp_path / "jc")
    try:
        out = subprocess.run([sys.executable, str(SCRIPT), "--base-url", base, "--num-prompts", "8",
                              "--concurrency", "1,4", "--tokenizer", "tiny", "--random-input-len", "32",
                              "--random-output-len", "16", "--ignore-eos", "--output-json", str(tmp_path / "r.json"),
                              "--output-png", str(tmp_path / "r.png")], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.returncode == 0, out.stdout + out.stderr
        rep = json.loads((tmp_path / "r.json").read_text())
        assert all(lv["completed"] == 8 and lv["total_output_tokens"] == 128 for lv in rep["levels"])
        assert all(lv["total_input_tokens"] == 8 * 32 for lv in rep["levels"])
    finally:
        assert stop_server(proc, logf) == 0


def test_accept_length_from_metrics_scrapes():
    """Accept length over a level from two /metrics scrapes: ours (counters) and SGLang's (a gauge)."""
    a = {"dsv41:spec_verify_steps_total": 10.0, "dsv41:spec_accepted_tokens_total": 5.0,
         "dsv41:spec_draft_tokens_total": 30.0}
    b = {"dsv41:spec_verify_steps_total": 30.0, "dsv41:spec_accepted_tokens_total": 35.0,
         "dsv41:spec_draft_tokens_total": 90.0}
    r = bench.accept_length(a, b)
    assert r["spec_accept_length"] == 2.5 and r["spec_accept_rate"] == 0.5 and r["spec_verify_steps"] == 20
    assert bench.accept_length({}, {"sglang:spec_accept_length": 3.1})["spec_accept_length"] == 3.1
    assert bench.accept_length({}, {})["spec_accept_length"] is None

