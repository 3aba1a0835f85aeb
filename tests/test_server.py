"""The OpenAI server, live on loopback: ``python -m dsv41_jax.serve`` in a subprocess (the real CLI,
the real engine in fp32 on `configs.micro`, tiny's sizes in 3 layers, saved as a checkpoint and served as
"tiny"), driven with the real ``openai`` client and raw HTTP.

One server per module (compiling the model's two shapes is most of its start-up; a
persistent JAX compilation cache makes the second server of the SIGTERM test start in ~10 s).
Tool calls and JSON outputs come from the real model path: constrained decoding forces the tokens,
and the real detokenizer and parsers turn them into the response.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import httpx
import jsonschema
import pytest

import openai
from servers import serve_cmd as _serve_cmd, start_server, stop_server

from dsv41_jax.chat_format.encoding import encode_chat_request
from dsv41_jax.serving.tokenizer import load_tokenizer

KEY = "test-key-123"
ENGINE_FLAGS = ["--model", "tiny", "--dtype", "float32", "--max-running-requests", "4", "--batch-buckets", "4",
                "--chunked-prefill-size", "64", "--page-size", "64", "--context-length", "2048",
                "--max-total-tokens", "16384"]
SERVER_FLAGS = ENGINE_FLAGS + ["--api-key", KEY, "--reasoning-parser", "deepseek-v41", "--tool-call-parser",
                               "deepseekv41", "--enable-metrics", "--max-body-size", "256K",
                               "--max-queued-requests", "2"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string", "enum": ["Beijing", "Paris"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["location"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory):
    return os.environ.get("DSV41_TEST_JAX_CACHE") or tmp_path_factory.mktemp("jax_cache")


def _on(micro_dir, flags):
    """`flags` with ``--model tiny`` replaced by the micro checkpoint, served under the name "tiny"."""
    i = flags.index("--model")
    return flags[:i] + ["--model", micro_dir, "--served-model-name", "tiny"] + flags[i + 2:]


@pytest.fixture(scope="module")
def server(tmp_path_factory, jax_cache, micro_dir):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    proc, base, logf = start_server(_on(micro_dir, SERVER_FLAGS), log_path, jax_cache)
    yield {"base": base, "proc": proc, "log": log_path}
    rc = stop_server(proc, logf)
    assert rc == 0, open(log_path).read()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def metrics(http) -> dict:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("dsv41:") and " " in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def prompt_len(tok, body) -> int:
    return len(tok.encode(encode_chat_request(body).prompt))


MSG = [{"role": "user", "content": "Hello there, how are you?"}]


# --------------------------------------------------------------------------------------- basics


def test_health_and_models(server, client):
    assert httpx.get(server["base"] + "/health").status_code == 200  # no key needed
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]


def test_chat_non_streaming_usage(client, tok):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.finish_reason == "length" and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == prompt_len(tok, {"messages": MSG})
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert getattr(c.message, "reasoning_content", None) is None  # thinking is off by default


def test_chat_streaming_equals_non_streaming(server, client):
    kw = dict(model="tiny", messages=MSG, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full
    fins = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert fins == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(ch.usage is None for ch in chunks[:-1])
    # the raw stream ends with [DONE]
    body = dict(kw, stream=True)
    with httpx.stream("POST", server["base"] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_seed_n_reproducible(client):
    kw = dict(model="tiny", messages=MSG, max_tokens=8, temperature=1.0, top_p=0.95, n=2, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    ta = [c.message.content for c in sorted(a.choices, key=lambda c: c.index)]
    tb = [c.message.content for c in sorted(b.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1]
    assert ta == tb  # same seed => same outputs
    assert ta[0] != ta[1]  # child j samples with seed + j
    assert a.usage.completion_tokens == 16
    c = client.chat.completions.create(**dict(kw, seed=99))
    assert [x.message.content for x in sorted(c.choices, key=lambda c: c.index)] != ta


def test_stop_string(client):
    kw = dict(model="tiny", messages=MSG, temperature=0)
    text = client.chat.completions.create(max_tokens=24, **kw).choices[0].message.content
    cands = [text[i:i + k] for k in (2, 1) for i in range(3, len(text) - k)
             if text[i:i + k].isprintable() and "\ufffd" not in text[i:i + k] and text[i:i + k].strip()]
    assert cands, repr(text)
    stop = cands[0]
    r = client.chat.completions.create(max_tokens=24, stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.find(stop)]
    s = client.chat.completions.create(max_tokens=24, stop=stop, stream=True, **kw)
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == text[:text.find(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    items = r.choices[0].logprobs.content
    # one item per token of the message: none for an EOS that ended it (issue 49), as OpenAI
    assert len(items) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for it in items:
        assert it.logprob <= 0 and len(it.top_logprobs) == 3
        assert abs(it.top_logprobs[0].logprob - it.logprob) < 1e-4  # greedy: the sampled token is the best
        assert it.top_logprobs[0].logprob >= it.top_logprobs[1].logprob >= it.top_logprobs[2].logprob
        assert bytes(it.bytes).decode("utf-8", "replace") == it.token


# ---------------------------------------------------------------------------------- completions


def test_completions(client, server, tok):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode("The capital of France is")) and r.usage.completion_tokens == 5
    ids = tok.encode("The capital of France is")
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == r.choices[0].text  # token ids and text give the same prompt
    r3 = client.completions.create(model="tiny", prompt=["a b c", "x y z"], n=2, max_tokens=3, temperature=0.8,
                                   seed=7, logprobs=2)
    assert sorted(c.index for c in r3.choices) == [0, 1, 2, 3]
    lp = r3.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    r4 = client.completions.create(model="tiny", prompt="echo me", max_tokens=2, echo=True, temperature=0)
    assert r4.choices[0].text.startswith("echo me")
    chunks = list(client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


def test_prefix_cache_cached_tokens_and_hit_rate(http):
    """A prompt extending a finished request's tokens resumes from the radix prefix cache: usage
    reports the cached prompt tokens, /metrics a hit rate above 0."""
    ids = [(7 * i) % 300 + 10 for i in range(70)]  # past one page (64): a shared page plus a partial copy
    r1 = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r1.status_code == 200 and r1.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # r1 wrote its 70 prompt tokens (its one sampled token is not written): the cache holds them
    r2 = http.post("/v1/completions", json={"model": "tiny", "prompt": ids + [11, 12, 13], "max_tokens": 2,
                                            "temperature": 0})
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 70
    assert metrics(http)["dsv41:cache_hit_rate"] > 0


# ---------------------------------------------------------------- tools / reasoning / structure


def test_tool_choice_named_forces_a_dsml_call(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER, PING], max_tokens=200, temperature=0.7, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_calls_streaming(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, PING],
              max_tokens=300, temperature=0.9, seed=11, tool_choice="required")
    full = client.chat.completions.create(**kw).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.tool_calls
    calls: dict = {}
    fin = None
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        indices = [tc.index for tc in d.tool_calls or []]
        assert len(set(indices)) == len(indices), d  # issue 49: never two entries of one index in a delta
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": None, "args": ""})
            if tc.function.name:
                assert slot["name"] is None and slot["args"] == ""  # the name comes first
                slot["name"] = tc.function.name
            slot["args"] += tc.function.arguments or ""
        fin = ch.choices[0].finish_reason or fin
    assert fin == "tool_calls"
    assert [(v["name"], json.loads(v["args"])) for _, v in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in full.message.tool_calls]
    for _, v in calls.items():
        assert v["name"] in ("get_weather", "ping")


def test_reasoning_content_with_thinking(client, tok):
    body = {"messages": MSG, "reasoning_effort": "high"}
    r = client.chat.completions.create(model="tiny", max_tokens=10, temperature=0, **body)
    c = r.choices[0]
    # a random model never closes </think>: everything is reasoning (docs/design/spec.md §10), none of it in content
    assert c.message.reasoning_content and not c.message.content
    assert r.usage.prompt_tokens == prompt_len(tok, body)
    u = r.model_dump()["usage"]
    assert u["completion_tokens_details"]["reasoning_tokens"] == 10
    chunks = list(client.chat.completions.create(model="tiny", max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, **body))
    streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
    assert streamed == c.message.reasoning_content
    assert chunks[-1].model_dump()["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10
    # an effort of "none" turns thinking off
    assert "reasoning_tokens" not in u and c.message.content is None  # issue 49: as OpenAI (it said "")
    r2 = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, reasoning_effort="none")
    assert getattr(r2.choices[0].message, "reasoning_content", None) is None


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                           "temp": {"type": "integer", "minimum": -30, "maximum": 45},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "temp", "sunny"], "additionalProperties": False}


def test_json_schema_output_validates(client):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Report the weather as JSON."}], max_tokens=60,
            temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=60, temperature=0.5, seed=5,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "w", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_thinking_budget_then_schema(client):
    """Thinking on, the reasoning capped at 6 tokens (then </think> is forced), then JSON by the schema:
    the reasoning parser splits at the real </think>, the content validates."""
    for stream in (False, True):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather as JSON, think first."}],
                  max_tokens=80, temperature=1.0, seed=4, reasoning_effort="max",
                  response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
                  extra_body={"thinking_budget": 6})
        if not stream:
            r = client.chat.completions.create(**kw)
            c = r.choices[0]
            reasoning, content, fin = c.message.reasoning_content, c.message.content, c.finish_reason
            usage = r.model_dump()["usage"]
        else:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                                for ch in chunks if ch.choices)
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            fin = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
            usage = chunks[-1].model_dump()["usage"]
        assert fin == "stop" and reasoning and "</think>" not in reasoning + content
        jsonschema.validate(json.loads(content), SCHEMA)
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 6


# ----------------------------------------------------------------------------------------- errors


def _err(resp, status, param="-", code="-"):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    # one shape everywhere (issue 49: 404 / 405 carried an integer code)
    assert all(body["error"][k] is None or isinstance(body["error"][k], str) for k in ("param", "code")), body
    if param != "-":
        assert body["error"]["param"] == param, body
    if code != "-":
        assert body["error"]["code"] == code, body
    return body["error"]


BAD_CHAT = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": "hi"}, "messages"),
    ({"reasoning_effort": True}, "reasoning_effort"),
    ({"reasoning_effort": 1.5}, "reasoning_effort"),
    ({"reasoning_effort": "ultra"}, "reasoning_effort"),  # issue 49: 200 with the default effort before
    ({"messages": MSG + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
        {"role": "tool", "content": "pong"}], "tools": [PING]}, "messages[2].tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"thinking_budget": -1}, "thinking_budget"),
    ({"stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
]


@pytest.mark.parametrize("patch,param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_requests_are_400(http, patch, param):
    body = dict({"model": "tiny", "messages": MSG, "max_tokens": 4}, **patch)
    _err(http.post("/v1/chat/completions", json=body), 400, param)


def test_other_errors(server, http):
    base = server["base"]
    e = _err(http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                       headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    _err(http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 10 ** 9}), 400,
         "max_tokens", "context_length_exceeded")
    _err(http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 2100, "max_tokens": 4}), 400,
         code="context_length_exceeded")
    _err(http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 99999]}), 400, "prompt")
    _err(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}), 404, "model", "model_not_found")
    _err(httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG}), 401,
         code="invalid_api_key")
    _err(httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": MSG},
                    headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    _err(httpx.get(base + "/v1/models"), 401)
    _err(httpx.get(base + "/metrics"), 401)
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 300_000}]}
    _err(http.post("/v1/chat/completions", json=big), 413, code="request_too_large")
    _err(http.get("/v1/nothing-here"), 404, None, "not_found")
    _err(http.get("/v1/chat/completions"), 405, None, "method_not_allowed")
    _err(http.post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400, "prompt")
    # the server keeps serving
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_openai_client_error_types(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, top_p=2)
    assert e.value.body["param"] == "top_p"
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ------------------------------------------------------------------------- load / disconnect


def _settle(http, want: dict, timeout=120.0) -> dict:
    """Poll /metrics until it shows `want`. Only for states the test has made certain (the engine is
    paused, so nothing else can change them): the timeout guards a hang, it is not a race."""
    t0 = time.monotonic()
    while True:
        m = metrics(http)
        if all(m["dsv41:" + k] == v for k, v in want.items()):
            return m
        assert time.monotonic() - t0 < timeout, (want, m)
        time.sleep(0.1)


def _open_request(base, body, path="/v1/chat/completions") -> socket.socket:
    """Send a request on a raw connection and return the socket unread: closing it is the client
    going away, at a moment the test chooses."""
    host, port = base.split("//")[1].split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=120)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _status_line(s: socket.socket) -> str:
    buf = b""
    while b"\r\n" not in buf:
        chunk = s.recv(256)
        assert chunk, "connection closed before the status line"
        buf += chunk
    return buf.split(b"\r\n", 1)[0].decode()


def test_queue_full_503_and_disconnects_free_the_pool(server, http):
    """Driven through /pause_generation and /continue_generation, so every state asserted is one the
    engine cannot leave on its own: 4 running (max_running_requests) + 2 waiting (max_queued_requests)
    -> 503 queue_full; six streaming clients and then a non-streaming one hang up -> all aborted, the
    pool back to empty. No sleeps stand in for progress."""
    base = server["base"]
    m0 = metrics(http)
    assert m0["dsv41:num_used_tokens"] == 0 and m0["dsv41:num_running_reqs"] == 0
    body = {"model": "tiny", "messages": MSG, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    socks = []
    assert http.post("/pause_generation").json() == {"paused": True}
    try:
        for running in (2, 4):  # two at a time: the queue holds two
            socks += [_open_request(base, body) for _ in range(2)]
            _settle(http, {"num_queue_reqs": 2, "num_running_reqs": running - 2})
            for _ in range(10):  # admit them, one engine step at a time
                if not metrics(http)["dsv41:num_queue_reqs"]:
                    break
                assert http.post("/continue_generation", json={"steps": 1}).json() == {"paused": True}
            _settle(http, {"num_queue_reqs": 0, "num_running_reqs": running})
        socks += [_open_request(base, body) for _ in range(2)]
        m = _settle(http, {"num_queue_reqs": 2, "num_running_reqs": 4})
        assert m["dsv41:num_used_tokens"] > 0
        assert [_status_line(s) for s in socks] == ["HTTP/1.1 200 OK"] * 6  # streams: headers at once
        e = _err(http.post("/v1/chat/completions", json=dict(body, stream=False)), 503, code="queue_full")
        assert "queue" in e["message"]
        for s in socks:  # the clients go away; the engine is still paused, so only the aborts act
            s.close()
        _settle(http, {"num_used_tokens": 0, "num_running_reqs": 0, "num_queue_reqs": 0,
                       "num_aborted_requests_total": m0["dsv41:num_aborted_requests_total"] + 6})
        # a non-streaming client that gives up is aborted too (it waits: the engine is paused)
        s = _open_request(base, dict(body, stream=False))
        _settle(http, {"num_queue_reqs": 1})
        s.close()
        # the queue gauge and the aborted counter are two updates: wait for both (the paused engine
        # reaches this state and cannot leave it)
        _settle(http, {"num_used_tokens": 0, "num_running_reqs": 0, "num_queue_reqs": 0,
                       "num_aborted_requests_total": m0["dsv41:num_aborted_requests_total"] + 7})
    finally:
        for s in socks:
            s.close()
        assert http.post("/continue_generation").json() == {"paused": False}


def test_pause_and_continue_generation(server, http, client):
    """Requests sent while paused wait (no tokens) and complete after /continue_generation; bad step
    counts are a 400."""
    _err(http.post("/continue_generation", json={"steps": -1}), 400, param="steps")
    _err(http.post("/continue_generation", json={"steps": "2"}), 400, param="steps")
    assert http.post("/pause_generation").json() == {"paused": True}
    try:
        s = _open_request(server["base"], {"model": "tiny", "messages": MSG, "max_tokens": 3, "ignore_eos": True})
        m = _settle(http, {"num_queue_reqs": 1, "num_running_reqs": 0})
        assert m["dsv41:num_used_tokens"] == 0
        assert http.post("/continue_generation", json={"steps": 0}).json() == {"paused": True}
        assert metrics(http)["dsv41:num_queue_reqs"] == 1
    finally:
        assert http.post("/continue_generation").json() == {"paused": False}
    with s:
        s.settimeout(120)
        assert _status_line(s) == "HTTP/1.1 200 OK"
    assert client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices[0].finish_reason


def test_metrics_endpoint(http, client):
    client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5)
    text = http.get("/metrics").text
    for name in ("dsv41:num_running_reqs", "dsv41:num_queue_reqs", "dsv41:token_usage", "dsv41:gen_throughput",
                 "dsv41:cache_hit_rate", "dsv41:time_to_first_token_seconds_bucket",
                 "dsv41:inter_token_latency_seconds_bucket", "dsv41:e2e_request_latency_seconds_count",
                 "dsv41:generation_tokens_total", "dsv41:prompt_tokens_total"):
        assert name in text, name
    m = metrics(http)
    assert m["dsv41:time_to_first_token_seconds_count"] >= 1 and m["dsv41:generation_tokens_total"] >= 5


# ------------------------------------------------------------------------------ process level


def test_help_and_bad_environment():
    out = subprocess.run(_serve_cmd() + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--host", "--port", "--api-key", "--reasoning-parser", "--tool-call-parser",
                 "--enable-metrics", "--max-queued-requests", "--max-running-requests", "--chunked-prefill-size",
                 "--page-size", "--context-length", "--kv-cache-dtype", "--mem-fraction-static", "--tp-size",
                 "--ep-size", "--max-body-size", "--random-seed", "--impl"):
        assert flag in out.stdout, flag
    r = subprocess.run(_serve_cmd() + ["--impl", "xla,moe=fast"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "impl" in r.stderr and "fast" in r.stderr, r.stderr
    for env in ({"DSV41_REASONING_EFFORT": "ludicrous"}, {"DSV41_DEFAULT_THINKING": "perhaps"},
                {"DSV41_REASONING_EFFORT": "101"}):
        r = subprocess.run(_serve_cmd(), capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
        assert r.returncode != 0 and "DSV41_" in r.stderr, (env, r.stderr)


def _startup_programs(log: str) -> tuple:
    """(programs, compiled, loaded) of the server log's "engine ready" line."""
    m = re.search(r"engine ready in [\d.]+s: (\d+) XLA programs \((\d+) compiled, (\d+) loaded from the persistent "
                  r"compilation cache\); summed over threads: tracing [\d.]+s, lowering [\d.]+s, compiling or "
                  r"loading [\d.]+s", log)
    assert m, log[-3000:]
    return tuple(int(x) for x in m.groups())


def test_sigterm_finishes_in_flight_and_exits_0(server, tmp_path, jax_cache, micro_dir):
    """SIGTERM mid-stream: the stream ends normally, the process exits 0. This second start of the same
    engine (after the module's server) says how it started: issue 49, a warm start that loaded every
    program from the persistent cache logged only "2 extend shapes compiled in 2 threads: 14.3s"."""
    first = _startup_programs(server["log"].read_text())
    assert first[0] > 0 and first[1] + first[2] == first[0]
    flags = _on(micro_dir, ENGINE_FLAGS + ["--graceful-shutdown-timeout", "60"])
    proc, base, logf = start_server(flags, tmp_path / "s.log", jax_cache)
    try:
        lines = []
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=120,
                          json={"model": "tiny", "messages": MSG, "max_tokens": 40, "ignore_eos": True,
                                "stream": True}) as resp:
            it = resp.iter_lines()
            for ln in it:
                if ln.startswith("data: {") and '"content":"' in ln and '"content":""' not in ln:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                    break
            lines = [ln for ln in it if ln]
        assert lines[-1] == "data: [DONE]"
        fins = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]]
        assert fins[-1] == "length"  # the in-flight request ran to its end
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        logf.close()
    log = open(tmp_path / "s.log").read()
    assert rc == 0, log[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(base + "/health", timeout=2)
    programs, compiled, loaded = _startup_programs(log)
    assert programs == first[0] and compiled + loaded == programs
    # the concurrent warm-up compile says what it compiled and what it loaded (not "compiled" for both)
    m = re.search(r"warm-up: (\d+) extend shapes prepared in \d+ threads in [\d.]+s \((\d+) compiled, (\d+) loaded "
                  r"from the compilation cache\)", log)
    assert m, log[-3000:]
    shapes, w_compiled, w_loaded = (int(x) for x in m.groups())
    assert shapes >= 2 and w_compiled + w_loaded == shapes
    if str(jax_cache).lower() != "none":  # the same engine as the module's server: every program is loaded
        assert loaded == programs, log[-3000:]
        assert (w_compiled, w_loaded) == (0, shapes), m.group(0)
