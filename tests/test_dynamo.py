"""NVIDIA Dynamo, live: our frontend (`python -m dsv41_jax.dynamo.frontend`, KV router) and two
aggregated nano workers (`python -m dsv41_jax.dynamo`), beside our own server (`python -m dsv41_jax.serve`)
with the same engine flags. No etcd / NATS: file discovery, the tcp request plane, the zmq event plane, every
address on the loopback.

Marked ``dynamo``: not in the default run, selected with ``pytest -m dynamo``; they need Dynamo installed
(scripts/install_dynamo.sh) and fail, never skip, without it.

* Greedy chat completions through the frontend equal our server's: content, reasoning_content,
  tool_calls (names and arguments), finish reasons, usage — thinking on and off, tool calls, streaming.
* KV-aware routing: four conversations at once, then their follow-ups at once. Both workers serve
  first turns (the router spreads concurrent requests); each follow-up reports as cached at least its
  first turn's prompt (minus the last token), which only the worker that served that turn holds (the
  conversations share no page); the workers' own counters (``POST /engine/control/stats``) add up to
  the cached tokens the clients saw, and both published blocks.
* A client that disconnects mid-stream: the worker aborts the request and its pages return.
* A worker killed mid-stream: the client gets an error event, no choice finishes.

Engine flags: ``--dtype exact`` (order-independent numerics: a prefix-cache hit, which changes the
prefill chunking, gives the same tokens as a cold prefill, so the workers' and the server's different
cache histories cannot change a greedy answer) and pages of 16 tokens (several blocks per prompt).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os

import httpx
import pytest
from servers import free_port, start_server, stop_server, user_env

from dsv41_jax.training import data

pytestmark = pytest.mark.dynamo

ENGINE_FLAGS = ["--dtype", "exact", "--max-running-requests", "4", "--batch-buckets", "4", "--page-size", "16",
                "--chunked-prefill-size", "128", "--context-length", "1024", "--max-total-tokens", "8192"]
PAGE = 16
START_TIMEOUT = 900
WORKERS = ("worker0", "worker1")


def live_env(d) -> tuple:
    """(environment, JAX compilation cache dir) of the processes a live test starts in directory ``d``."""
    env = user_env()
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(d / "jax_cache")
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache)
    return env, cache


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import dynamo.frontend  # noqa: F401 (fails, with the import error, when Dynamo is not installed)

    from dsv41_jax.dynamo.local import LocalDeployment

    d = tmp_path_factory.mktemp("dynamo")
    env, cache = live_env(d)
    # our server first: it fills the compilation cache the workers (same engine flags) then read
    server, base, slog = start_server(ENGINE_FLAGS, d / "server.log", cache, env=env)
    dep = LocalDeployment(env=env, log_dir=str(d))
    try:
        for name in WORKERS:
            dep.start_worker(name, ENGINE_FLAGS)
        dep.start_frontend(free_port(), "kv")
        dep.wait_ready("nano", timeout=START_TIMEOUT)
        yield {"frontend": dep.frontend_url, "server": base, "dep": dep}
    finally:
        dep.stop_all()
        stop_server(server, slog)


def _examples():
    out = []
    for i, think in enumerate((False, True, False, True)):
        out.append(data.make_example(1000, i, kinds=data.TEXT_KINDS, thinking=think))
    for i, think in enumerate((False, True)):
        out.append(data.make_example(1001, i, kinds=("tool_call",), thinking=think))
    return out


def _body(ex, **kw):
    b = {"model": "nano", "messages": ex.messages, "temperature": 0, "max_tokens": 96,
         "chat_template_kwargs": {"thinking": ex.thinking}, **kw}
    if ex.tools:
        b["tools"] = ex.tools
    return b


def _answer(resp: dict) -> dict:
    ch = resp["choices"][0]
    m = ch["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
    u = resp["usage"]
    return {"content": m.get("content"), "reasoning_content": m.get("reasoning_content"), "tool_calls": calls,
            "finish_reason": ch["finish_reason"], "prompt_tokens": u["prompt_tokens"],
            "completion_tokens": u["completion_tokens"]}


def test_chat_through_the_frontend_equals_our_server(cluster):
    seen = {"reasoning": 0, "tools": 0}
    for ex in _examples():
        ours = httpx.post(cluster["server"] + "/v1/chat/completions", json=_body(ex), timeout=300)
        dyn = httpx.post(cluster["frontend"] + "/v1/chat/completions", json=_body(ex), timeout=300)
        assert ours.status_code == 200 and dyn.status_code == 200, (ours.text, dyn.text)
        a, b = _answer(ours.json()), _answer(dyn.json())
        assert b == a, (ex.messages, a, b)
        seen["reasoning"] += bool(a["reasoning_content"])
        seen["tools"] += bool(a["tool_calls"])
    assert seen["reasoning"] >= 2 and seen["tools"] == 2, seen  # the comparison covered both parsers


def _stream(base, body) -> dict:
    content, reasoning, calls, finish = "", "", {}, None
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj.get("choices") or []:
                dl = ch.get("delta") or {}
                content += dl.get("content") or ""
                reasoning += dl.get("reasoning_content") or ""
                for tc in dl.get("tool_calls") or []:
                    c = calls.setdefault(tc["index"], ["", ""])
                    c[0] += (tc.get("function") or {}).get("name") or ""
                    c[1] += (tc.get("function") or {}).get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    return {"content": content, "reasoning": reasoning, "finish": finish,
            "calls": [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]}


def test_streaming_through_the_frontend_equals_our_server(cluster):
    exs = _examples()
    for ex in (exs[1], exs[5]):  # thinking text, thinking tool call
        a, b = _stream(cluster["server"], _body(ex)), _stream(cluster["frontend"], _body(ex))
        assert b == a and (a["reasoning"] or a["calls"]), (a, b)


def test_errors_come_back_as_ours(cluster):
    # valid for Dynamo's own request checks, refused by our chat layer: the client gets our 400 and message
    bad = {"model": "nano", "messages": [{"role": "user", "content": "hi"}],
           "chat_template_kwargs": {"thinking": "maybe"}}
    r = httpx.post(cluster["frontend"] + "/v1/chat/completions", json=bad, timeout=60)
    ours = httpx.post(cluster["server"] + "/v1/chat/completions", json=bad, timeout=60)
    assert ours.status_code == 400 and r.status_code == 400, (ours.text, r.text)
    assert ours.json()["error"]["message"] in r.text, (ours.text, r.text)
    rf = {"model": "nano", "messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_object"}}
    r = httpx.post(cluster["frontend"] + "/v1/chat/completions", json=rf, timeout=60)
    assert r.status_code == 400 and "constrained decoding" in r.text, r.text  # refused, not ignored


WORDS = ("amber river", "bold falcon", "cedar window", "dusty lantern")


def _turn1(i):
    ex = data.make_example(1002, i, kinds=data.TEXT_KINDS, thinking=False)
    msg = dict(ex.messages[-1])
    # a first page of its own: the conversations share no block, so only one worker can hold each prefix
    msg["content"] = f"({WORDS[i]} {i}) " * 6 + msg["content"]
    return ex.messages[:-1] + [msg]


def _post(base, messages):
    r = httpx.post(base + "/v1/chat/completions", timeout=300,
                   json={"model": "nano", "messages": messages, "temperature": 0, "max_tokens": 24,
                         "chat_template_kwargs": {"thinking": False}})
    assert r.status_code == 200, r.text
    return r.json()


def test_kv_routing_sends_follow_ups_to_the_worker_with_the_prefix(cluster):
    fe, dep = cluster["frontend"], cluster["dep"]
    before = [dep.stats(w) for w in WORKERS]
    convs = [_turn1(i) for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda m: _post(fe, m), convs))
    mid = [dep.stats(w) for w in WORKERS]
    served = [m["requests"] - b["requests"] for m, b in zip(mid, before)]
    assert sum(served) == 4 and min(served) >= 1, served  # concurrent first turns spread over both workers
    assert all(m["kv_blocks_published"] > 0 for m in mid), mid
    follow = [c + [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""},
                   {"role": "user", "content": "And then?"}] for c, r in zip(convs, first)]
    with cf.ThreadPoolExecutor(4) as pool:
        second = list(pool.map(lambda m: _post(fe, m), follow))
    after = [dep.stats(w) for w in WORKERS]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in second]
    p1 = [r["usage"]["prompt_tokens"] for r in first]
    assert all(p >= 4 * PAGE for p in p1), p1
    for c, p in zip(cached, p1):  # at least the first turn's prompt (its prompt-end point)
        assert c >= p - 1, (cached, p1)
    worker_cached = sum(a["cached_prompt_tokens"] - m["cached_prompt_tokens"] for a, m in zip(after, mid))
    assert worker_cached == sum(cached), (worker_cached, cached)
    hits = [a["prefix_cache_hits"] - m["prefix_cache_hits"] for a, m in zip(after, mid)]
    assert hits == [m["requests"] - b["requests"] for m, b in zip(mid, before)], (hits, served)


def test_client_disconnect_aborts_on_the_worker(cluster):
    fe, dep = cluster["frontend"], cluster["dep"]
    before = [dep.stats(w) for w in WORKERS]
    body = {"model": "nano", "messages": [{"role": "user", "content": "Count slowly."}], "temperature": 0,
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fe + "/v1/chat/completions", json=body, timeout=300) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break  # the client goes away mid-answer

    def settled():
        s = [dep.stats(w) for w in WORKERS]
        aborted = sum(a["requests_aborted"] - b["requests_aborted"] for a, b in zip(s, before))
        idle = all(x["num_running_reqs"] == 0 and x["num_used_tokens"] == y["num_used_tokens"]
                   for x, y in zip(s, before))
        return aborted == 1 and idle

    dep.wait(settled, "the worker to abort the request and free its pages", timeout=120)


def test_a_worker_lost_mid_stream_is_an_error_not_a_short_answer(cluster):
    """(Last: it kills a worker.) The client gets an error event, never a finished-looking answer."""
    fe, dep = cluster["frontend"], cluster["dep"]
    body = {"model": "nano", "messages": [{"role": "user", "content": "Count slowly, please."}], "temperature": 0,
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    events, killed = [], None
    with httpx.stream("POST", fe + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3 and killed is None:
                busy = [w for w in WORKERS if dep.stats(w)["num_running_reqs"] == 1]
                assert len(busy) == 1, busy
                killed = busy[0]
                dep.procs[killed][0].kill()
    assert killed is not None
    assert "error" in events[-1], events[-3:]
    finishes = [c.get("finish_reason") for e in events for c in e.get("choices") or []]
    assert not any(finishes), finishes  # no choice claims to have finished
