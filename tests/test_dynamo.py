"""NVIDIA Dynamo, live: our frontend (`python -m dsv41_jax.dynamo.frontend`, KV router) in front of nano
workers (`python -m dsv41_jax.dynamo`), compared with our own server (`python -m dsv41_jax.serve`) on the same
engine flags. No etcd / NATS: file discovery, the tcp request plane, the zmq event plane, every address on
the loopback. One module, one set of processes at a time (the module's `Live` stack): our server answers
first (the reference, then it stops), then two aggregated workers, then a prefill and a decode worker.

In the default run; it needs Dynamo and NIXL installed (scripts/install_dynamo.sh, which `.ci/run` runs) and
fails, never skips, without them (marker ``dynamo`` selects it alone: ``pytest -m dynamo``).

Aggregated (frontend + two workers):

* Greedy chat completions through the frontend equal our server's: content, reasoning_content,
  tool_calls (names and arguments), finish reasons, usage — thinking on and off, tool calls, streaming.
* KV-aware routing: four conversations at once, then their follow-ups at once. Both workers serve
  first turns (the router spreads concurrent requests); before the follow-ups, the router has applied
  every block event the workers published, none refused (its ``kv_cache_events_applied`` counters);
  each follow-up reports as cached at least its first turn's prompt (minus the last token), which
  only the worker that served that turn holds (the conversations share no page); the workers' own
  counters (``POST /engine/control/stats``) add up to the cached tokens the clients saw.
* Errors come back as our server's (a 400 with its message); a refused feature is a 400.
* A client that disconnects mid-stream: the worker aborts the request and its pages return.
* A worker killed mid-stream: the client gets an error event, no choice finishes.

Disaggregated (frontend + prefill worker + decode worker; the request's state moves from the prefill
worker's memory to the decode worker's through NIXL, UCX over host memory):

* The transport alone (`transfer.NixlTransport`, two agents): a buffer READ whole, the offer released by the
  READ's notification; an offer whose prefill process was SIGKILLed is a `TransferError` within the timeout.
* The decode worker's receive step with real NIXL: no prefill result, a dead prefill process, a state of
  another layout each end the request with Dynamo's ``Unknown`` (an error for the client).
* Greedy chat completions through the P/D deployment equal the aggregated ones (our server's, which the
  aggregated workers matched): content, reasoning_content, tool_calls, usage, streaming too. The decode
  worker prefilled nothing (its ``computed_prompt_tokens`` stays 0; ``imported_prompt_tokens`` is every
  prompt; bytes fetched through NIXL > 0), ran DSpark steps; the prefill worker's offers were all read.
* The prefill worker killed under a request in flight (stopped, then SIGKILLed), and requests after it:
  each ends with an error status / a stream error event, and the decode worker's pages stay at their
  baseline.

Engine flags (every process): ``--dtype exact`` (order-independent numerics: a prefix-cache hit, which
changes the prefill chunking, and the batch a request shares give the same tokens as a cold prefill
alone, so the processes' different cache histories and concurrent requests cannot change a greedy
answer), pages of 16 tokens (several blocks per prompt) and DSpark (greedy DSpark equals greedy without
in this mode, tests/test_engine_dspark.py; the disaggregated decode worker drafts from the rings the
prefill worker filled). Requests go concurrently where the comparison allows: one engine step serves
them all (the batch bucket is 4 rows however many are used).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
from servers import free_port, start_server, stop_server, user_env
from xla_flags import COMPILE_ONLY_FLAGS

from dsv41_jax.training import data

pytestmark = pytest.mark.dynamo

FLAGS = ["--dtype", "exact", "--max-running-requests", "4", "--batch-buckets", "4", "--page-size", "16",
         "--chunked-prefill-size", "128", "--context-length", "1024", "--max-total-tokens", "8192",
         "--speculative-algorithm", "DSPARK"]
PAGE = 16
START_TIMEOUT = 900
WORKERS = ("worker0", "worker1")
# The KV router weighs the blocks a worker would have to prefill 10x against the decode load it already has.
# At Dynamo's default (1), four follow-ups sent at once can go to the less loaded worker without their
# prefix (seen: 2 of 4, with the router holding every block event): its policy's trade-off, not a routing
# error, and not what the routing test checks.
ROUTER_FLAGS = ["--router-prefill-load-scale", "10"]


def live_env(d) -> tuple:
    """(environment, JAX compilation cache dir) of the processes a live test starts in directory ``d``.

    XLA's default optimization level, not the suite's -O0 (`user_env` keeps only the compile-only flags):
    these processes run far more than they compile (several engines load the same few programs from the
    cache; exact-mode steps run for every request), and for nano's exact programs -O0 costs on both
    counts. Measured on the 2-core VM (one engine, the flags below, cold / warm cache): -O0 with the
    fusion emitters off 35 / 22 s to start, a [4, 128] prefill step 3.3 s, a decode step 40 ms; XLA's
    defaults 28 / 13 s, 1.0 s and 10 ms."""
    env = user_env()
    keep = [f for f in env.get("XLA_FLAGS", "").split() if f in COMPILE_ONLY_FLAGS]
    env.pop("XLA_FLAGS", None)
    if keep:
        env["XLA_FLAGS"] = " ".join(keep)
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(d / "jax_cache")
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache)
    return env, cache


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





def _post_json(base, body) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def _answers(base, exs) -> list:
    """The answers to every example, asked at once."""
    with cf.ThreadPoolExecutor(len(exs)) as pool:
        resps = list(pool.map(lambda ex: _post_json(base, _body(ex)), exs))
    for r in resps:
        assert r.status_code == 200, r.text
    return [_answer(r.json()) for r in resps]


def _streams(base, exs) -> list:
    with cf.ThreadPoolExecutor(len(exs)) as pool:
        return list(pool.map(lambda ex: _stream(base, _body(ex)), exs))


# valid for Dynamo's own request checks, refused by our chat layer: the client must get our 400 and message
BAD_THINKING = {"model": "nano", "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"thinking": "maybe"}}
STREAMED = (1, 5)  # the examples also compared streamed: thinking text, thinking tool call


def need_dynamo() -> None:
    """Fail (never skip) with what to run when Dynamo or NIXL is not installed."""
    try:
        import dynamo.frontend  # noqa: F401
        import nixl._api  # noqa: F401
    except ImportError as e:
        pytest.fail(f"NVIDIA Dynamo / NIXL not installed ({e}): run scripts/install_dynamo.sh (these tests are in the "
                    "default run)", pytrace=False)


class Live:
    """The module's processes: our server's reference answers (computed once, the server then stopped), then
    one Dynamo deployment at a time (`agg`: two aggregated workers; `pd`: a prefill and a decode worker),
    each behind a frontend with the KV router; asking for the other kind stops the running one first (two
    deployments of nano engines at once would share the two cores)."""

    def __init__(self, d, env):
        self.d, self.env = d, env
        self.dep, self.kind = None, None
        self.examples = _examples()
        server, base, slog = start_server(FLAGS, d / "server.log", env["JAX_COMPILATION_CACHE_DIR"], env=env)
        try:  # it also fills the compilation cache every worker then reads (same engine flags)
            self.ref = _answers(base, self.examples)
            self.ref_streams = _streams(base, [self.examples[i] for i in STREAMED])
            self.ref_bad_thinking = _post_json(base, BAD_THINKING)
        finally:
            stop_server(server, slog)

    def _switch(self, kind: str, workers: list):
        from dsv41_jax.dynamo.local import LocalDeployment

        if self.kind == kind:
            return self.dep
        self.stop()
        dep = LocalDeployment(env=self.env, log_dir=str(self.d / kind))
        self.dep, self.kind = dep, kind
        for name, flags in workers:
            dep.start_worker(name, flags)
        dep.start_frontend(free_port(), "kv", ROUTER_FLAGS)
        dep.wait_ready("nano", timeout=START_TIMEOUT)
        return dep

    def agg(self):
        return self._switch("agg", [(w, FLAGS) for w in WORKERS])

    def pd(self):
        return self._switch("pd", [("prefill", [*FLAGS, "--disaggregation-mode", "prefill"]),
                                   ("decode", [*FLAGS, "--disaggregation-mode", "decode"])])

    def stop(self):
        if self.dep is not None:
            self.dep.stop_all()
        self.dep, self.kind = None, None


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    need_dynamo()
    d = tmp_path_factory.mktemp("dynamo")
    env, _ = live_env(d)
    stack = Live(d, env)
    try:
        yield stack
    finally:
        stack.stop()


# ------------------------------------------------------------------------------------------- aggregated
def test_chat_through_the_frontend_equals_our_server(live):
    fe = live.agg().frontend_url
    got = _answers(fe, live.examples)
    for ex, a, b in zip(live.examples, live.ref, got):
        assert b == a, (ex.messages, a, b)
    seen = {"reasoning": sum(bool(a["reasoning_content"]) for a in live.ref),
            "tools": sum(bool(a["tool_calls"]) for a in live.ref)}
    assert seen["reasoning"] >= 2 and seen["tools"] == 2, seen  # the comparison covered both parsers


def test_streaming_through_the_frontend_equals_our_server(live):
    got = _streams(live.agg().frontend_url, [live.examples[i] for i in STREAMED])
    for a, b in zip(live.ref_streams, got):
        assert b == a and (a["reasoning"] or a["calls"]), (a, b)


def test_errors_come_back_as_ours(live):
    fe = live.agg().frontend_url
    ours = live.ref_bad_thinking
    r = _post_json(fe, BAD_THINKING)
    assert ours.status_code == 400 and r.status_code == 400, (ours.text, r.text)
    assert ours.json()["error"]["message"] in r.text, (ours.text, r.text)
    rf = {"model": "nano", "messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_object"}}
    r = _post_json(fe, rf)
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


_APPLIED = re.compile(r'^dynamo_component_kv_cache_events_applied\{([^}]*)\} (\S+)$', re.M)


def router_events(frontend_url: str) -> dict:
    """The KV router's ``kv_cache_events_applied`` counters, summed over workers: (event type, status) -> n."""
    out: dict = {}
    for labels, value in _APPLIED.findall(httpx.get(frontend_url + "/metrics", timeout=10).text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = (lab["event_type"], lab["status"])
        out[key] = out.get(key, 0) + int(float(value))
    return out


def test_kv_routing_sends_follow_ups_to_the_worker_with_the_prefix(live):
    dep = live.agg()
    fe = dep.frontend_url
    before = [dep.stats(w) for w in WORKERS]
    convs = [_turn1(i) for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda m: _post(fe, m), convs))
    mid = [dep.stats(w) for w in WORKERS]
    served = [m["requests"] - b["requests"] for m, b in zip(mid, before)]
    assert sum(served) == 4 and min(served) >= 1, served  # concurrent first turns spread over both workers
    assert all(m["kv_blocks_published"] > 0 for m in mid), mid
    # the router has what the workers published (events travel asynchronously: wait for them), and refused none
    published = {("stored", "ok"): sum(m["kv_stored_events"] for m in mid),
                 ("removed", "ok"): sum(m["kv_removed_events"] for m in mid)}
    dep.wait(lambda: all(router_events(fe).get(k, 0) >= n for k, n in published.items()),
             "the router to apply the workers' KV events", timeout=60)
    applied = router_events(fe)
    refused = {k: n for k, n in applied.items() if k[1] != "ok" and n}
    assert not refused and published[("stored", "ok")] > 0, (refused, published)
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
    assert hits == served, (hits, served)  # each worker's follow-ups are its own first turns' conversations


def test_client_disconnect_aborts_on_the_worker(live):
    dep = live.agg()
    fe = dep.frontend_url
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


def test_a_worker_lost_mid_stream_is_an_error_not_a_short_answer(live):
    """(The last aggregated test: it kills a worker.) The client gets an error event, never a
    finished-looking answer."""
    dep = live.agg()
    fe = dep.frontend_url
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


# ------------------------------------------------------------------------------------- disaggregated
def test_nixl_transport_moves_a_buffer_and_reports_a_dead_peer(tmp_path):
    need_dynamo()
    from dsv41_jax.dynamo.transfer import NixlTransport, TransferError

    a, b = NixlTransport("t-prefill"), NixlTransport("t-decode")
    buf = (np.arange(1 << 18) % 251).astype(np.uint8)
    desc = a.offer("r1", buf)
    assert json.loads(json.dumps(desc)) == desc and a.pending == 1  # the descriptor travels as JSON
    got = b.fetch(desc, timeout=10)
    assert np.array_equal(got, buf) and b.bytes_fetched == buf.nbytes
    for _ in range(200):  # the READ's notification releases the offer
        a.poll()
        if not a.pending:
            break
        time.sleep(0.01)
    assert a.pending == 0 and a.released == 1
    with pytest.raises(TransferError, match="descriptor"):
        b.fetch({"agent": "x"}, timeout=1)
    desc = _dead_offer("t-dead")
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        b.fetch(desc, timeout=10)
    assert time.monotonic() - t0 < 15 and b.fetch_failures == 2


def _dead_offer(name: str) -> dict:
    """The descriptor of a buffer offered by a process that was then SIGKILLed (a prefill worker gone)."""
    child = ("import sys, json, time, numpy as np; from dsv41_jax.dynamo.transfer import NixlTransport; "
             f"t = NixlTransport({name!r}); d = t.offer('k', np.ones(4096, np.uint8)); "
             "print('DESC ' + json.dumps(d), flush=True); time.sleep(600)")
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        line = p.stdout.readline()
        while line and not line.startswith("DESC "):
            line = p.stdout.readline()
        return json.loads(line[5:])
    finally:
        p.kill()
        p.wait()


def test_decode_worker_ends_a_request_whose_state_cannot_be_had_with_an_error():
    """The decode worker's receive step (`worker._receive`, real NIXL, no engine needed before the state is
    in): no prefill result, a prefill worker gone (NIXL error) and a state that does not fit this engine each
    raise Dynamo's ``Unknown`` (an error status / stream error event for the client), never an empty answer."""
    need_dynamo()
    import asyncio
    from types import SimpleNamespace

    from dynamo.llm.exceptions import Unknown

    from dsv41_jax.dynamo.transfer import NixlTransport
    from dsv41_jax.dynamo.worker import engine_class, parse_args
    from dsv41_jax.serving import handover

    args, engine_args = parse_args(["--disaggregation-mode", "decode", "--transfer-timeout", "10",
                                    "--compilation-cache-dir", "none"])
    w = engine_class()(args, engine_args)
    w.transport = NixlTransport("t-decode-worker")
    layout = ({"window": [np.zeros((4,), np.float32)]}, {"comp": {"1": np.zeros((2,), np.float32)}})
    to_struct = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    w.engine = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(
        handover_layout=lambda: (to_struct(layout[0]), to_struct(layout[1])))))

    def receive(request):
        return asyncio.run(w._receive(request, [1, 2, 3], "r"))

    with pytest.raises(Unknown, match="no prefill result"):
        receive({"token_ids": [1, 2, 3]})
    manifest, _ = handover.pack(handover.PrefilledState([1, 2, 3], 7, 0, layout[0], [layout[1]]))
    with pytest.raises(Unknown, match="KV transfer from the prefill worker failed"):
        receive({"prefill_result": {"disaggregated_params": {"dsv41": {"manifest": manifest,
                                                                       "nixl": _dead_offer("t-dead-2")}}}})
    prefill = NixlTransport("t-prefill-2")
    other = handover.PrefilledState([1, 2, 3], 7, 0, {"window": [np.zeros((5,), np.float32)]}, [layout[1]])
    manifest, buf = handover.pack(other)  # another engine's layout (a window of 5)
    desc = prefill.offer("r", buf)
    with pytest.raises(Unknown, match="layout does not match"):
        receive({"prefill_result": {"disaggregated_params": {"dsv41": {"manifest": manifest, "nixl": desc}}}})
    state = handover.pack(handover.PrefilledState([1, 2, 3], 7, 0, layout[0], [layout[1]]))
    desc = prefill.offer("r2", state[1])
    got = receive({"prefill_result": {"disaggregated_params": {"dsv41": {"manifest": state[0], "nixl": desc}}}})
    assert got.first_token == 7 and got.prompt_ids == [1, 2, 3]  # (the same path, when the state fits)
    assert w.transport.fetch_failures == 1 and w.transport.bytes_fetched == buf.nbytes + state[1].nbytes



def test_disaggregated_answers_equal_aggregated_and_decode_prefilled_nothing(live):
    dep = live.pd()
    fe = dep.frontend_url
    p0, d0 = dep.stats("prefill"), dep.stats("decode")
    assert d0["disaggregation_mode"] == "decode" and p0["disaggregation_mode"] == "prefill"
    got = _answers(fe, live.examples)
    for ex, want, g in zip(live.examples, live.ref, got):
        assert g == want, (ex.messages, want, g)
    streamed = [live.examples[i] for i in STREAMED]
    assert _streams(fe, streamed) == live.ref_streams
    n = len(live.examples) + len(streamed)
    prompt_tokens = sum(g["prompt_tokens"] for g in got) + sum(live.ref[i]["prompt_tokens"] for i in STREAMED)
    p1, d1 = dep.stats("prefill"), dep.stats("decode")
    assert d1["computed_prompt_tokens"] == d0["computed_prompt_tokens"] == 0  # the decode worker prefilled nothing
    assert d1["handovers_imported"] - d0["handovers_imported"] == n
    assert d1["imported_prompt_tokens"] - d0["imported_prompt_tokens"] == prompt_tokens
    assert d1["transfer_bytes_fetched"] - d0["transfer_bytes_fetched"] == (
        d1["handover_bytes_imported"] - d0["handover_bytes_imported"]) > 0
    assert d1["spec_verify_steps"] > d0["spec_verify_steps"]  # DSpark on the decode side
    assert p1["handovers_exported"] - p0["handovers_exported"] == n
    assert p1["generation_tokens"] - p0["generation_tokens"] == n  # one token each: the first
    dep.wait(lambda: dep.stats("prefill")["transfer_offers_pending"] == 0, "the prefill worker's offers to be read",
             timeout=30)
    assert d1["num_running_reqs"] == 0


def test_prefill_worker_gone_is_an_error_and_the_decode_side_stays_clean(live):
    """(Last: it kills the prefill worker.) A request in flight when the prefill worker dies (it is stopped
    first, so the request waits on it, then SIGKILLed), and requests after that: each ends with an error
    status or a stream error event, none with a finished-looking answer; the decode worker holds nothing."""
    dep = live.pd()
    fe = dep.frontend_url
    before = dep.stats("decode")
    proc = dep.procs["prefill"][0]
    ex = live.examples[0]

    def stream_events():
        events, status = [], None
        with httpx.stream("POST", fe + "/v1/chat/completions", json={**_body(ex), "stream": True},
                          timeout=300) as s:
            status = s.status_code
            if status == 200:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
        return status, events

    def failed(status, events):
        if status != 200:
            return status >= 400
        finished = any(c.get("finish_reason") for e in events for c in e.get("choices") or [])
        return bool(events) and "error" in events[-1] and not finished

    proc.send_signal(signal.SIGSTOP)  # the next request waits on the prefill worker ...
    with cf.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(stream_events)
        time.sleep(3)
        proc.kill()  # ... which dies under it
        proc.wait()
        status, events = inflight.result(timeout=300)
    assert failed(status, events), (status, events[-3:])
    r = _post_json(fe, _body(ex))
    assert r.status_code >= 400, (r.status_code, r.text)  # never a 200 with empty content
    status, events = stream_events()
    assert failed(status, events), (status, events[-3:])
    after = dep.stats("decode")
    assert after["num_running_reqs"] == 0 and after["num_used_tokens"] == before["num_used_tokens"]
    assert after["handovers_imported"] == before["handovers_imported"]
