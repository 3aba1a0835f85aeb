"""NVIDIA Dynamo, live: prefill/decode disaggregation. Our frontend (`python -m dsv41_jax.dynamo.frontend`), a
prefill worker and a decode worker (`python -m dsv41_jax.dynamo --disaggregation-mode prefill|decode`), DSpark
on both (the prefill side fills the draft rings the decode side drafts from); the request's state moves from
the prefill worker's memory to the decode worker's through NIXL (UCX, host memory).

Marked ``dynamo`` (``pytest -m dynamo``): needs Dynamo and NIXL (scripts/install_dynamo.sh); fails, never
skips, without them.

* The transport alone (`transfer.NixlTransport`, two agents): a buffer READ whole, the offer released by the
  READ's notification; an offer whose prefill process was SIGKILLed is a `TransferError` within the timeout.
* The decode worker's receive step with real NIXL: no prefill result, a dead prefill process, a state of
  another layout each end the request with Dynamo's ``Unknown`` (an error for the client).
* Greedy chat completions through the P/D deployment equal the aggregated ones (our server with the same
  engine flags, DSpark on: tests/test_dynamo.py shows it equals aggregated Dynamo workers): content,
  reasoning_content, tool_calls, usage, streaming too. The decode worker prefilled nothing (its
  ``computed_prompt_tokens`` stays 0; ``imported_prompt_tokens`` is every prompt; bytes fetched through
  NIXL > 0), ran DSpark steps; the prefill worker's offers were all read and released.
* The prefill worker killed under a request in flight (stopped, then SIGKILLed), and requests after it:
  each ends with an error status / a stream error event, and the decode worker's pages stay at their
  baseline.

Engine flags: as tests/test_dynamo.py (``--dtype exact``, pages of 16) plus ``--speculative-algorithm DSPARK``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
from servers import free_port, start_server, stop_server
from test_dynamo import ENGINE_FLAGS, _answer, _body, _examples, _stream, live_env

pytestmark = pytest.mark.dynamo

FLAGS = ENGINE_FLAGS + ["--speculative-algorithm", "DSPARK"]
START_TIMEOUT = 900


def test_nixl_transport_moves_a_buffer_and_reports_a_dead_peer(tmp_path):
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


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    import dynamo.frontend  # noqa: F401 (fails, with the import error, when Dynamo is not installed)
    import nixl._api  # noqa: F401

    from dsv41_jax.dynamo.local import LocalDeployment

    d = tmp_path_factory.mktemp("dynamo_pd")
    env, cache = live_env(d)
    # the aggregated answers first (our server, same engine flags); it also fills the compilation cache the
    # workers then read, and is stopped before they start (two nano engines at a time on a small machine)
    server, base, slog = start_server(FLAGS, d / "server.log", cache, env=env)
    try:
        exs = _examples()
        ref = []
        for ex in exs:
            r = httpx.post(base + "/v1/chat/completions", json=_body(ex), timeout=300)
            assert r.status_code == 200, r.text
            ref.append(_answer(r.json()))
        ref_stream = _stream(base, _body(exs[5]))
    finally:
        stop_server(server, slog)
    dep = LocalDeployment(env=env, log_dir=str(d))
    try:
        dep.start_worker("prefill", [*FLAGS, "--disaggregation-mode", "prefill"])
        dep.start_worker("decode", [*FLAGS, "--disaggregation-mode", "decode"])
        dep.start_frontend(free_port(), "kv")
        dep.wait_ready("nano", timeout=START_TIMEOUT)
        yield {"frontend": dep.frontend_url, "dep": dep, "examples": exs, "ref": ref, "ref_stream": ref_stream}
    finally:
        dep.stop_all()


def test_disaggregated_answers_equal_aggregated_and_decode_prefilled_nothing(pd):
    fe, dep = pd["frontend"], pd["dep"]
    p0, d0 = dep.stats("prefill"), dep.stats("decode")
    assert d0["disaggregation_mode"] == "decode" and p0["disaggregation_mode"] == "prefill"
    prompt_tokens = 0
    for ex, want in zip(pd["examples"], pd["ref"]):
        r = httpx.post(fe + "/v1/chat/completions", json=_body(ex), timeout=300)
        assert r.status_code == 200, r.text
        got = _answer(r.json())
        assert got == want, (ex.messages, want, got)
        prompt_tokens += got["prompt_tokens"]
    assert _stream(fe, _body(pd["examples"][5])) == pd["ref_stream"]
    n = len(pd["examples"]) + 1
    p1, d1 = dep.stats("prefill"), dep.stats("decode")
    assert d1["computed_prompt_tokens"] == d0["computed_prompt_tokens"] == 0  # the decode worker prefilled nothing
    assert d1["handovers_imported"] - d0["handovers_imported"] == n
    assert d1["imported_prompt_tokens"] - d0["imported_prompt_tokens"] == prompt_tokens + pd["ref"][5]["prompt_tokens"]
    assert d1["transfer_bytes_fetched"] - d0["transfer_bytes_fetched"] == (
        d1["handover_bytes_imported"] - d0["handover_bytes_imported"]) > 0
    assert d1["spec_verify_steps"] > d0["spec_verify_steps"]  # DSpark on the decode side
    assert p1["handovers_exported"] - p0["handovers_exported"] == n
    assert p1["generation_tokens"] - p0["generation_tokens"] == n  # one token each: the first
    dep.wait(lambda: dep.stats("prefill")["transfer_offers_pending"] == 0, "the prefill worker's offers to be read",
             timeout=30)
    assert d1["num_running_reqs"] == 0


def test_prefill_worker_gone_is_an_error_and_the_decode_side_stays_clean(pd):
    """(Last: it kills the prefill worker.) A request in flight when the prefill worker dies (it is stopped
    first, so the request waits on it, then SIGKILLed), and requests after that: each ends with an error
    status or a stream error event, none with a finished-looking answer; the decode worker holds nothing."""
    fe, dep = pd["frontend"], pd["dep"]
    before = dep.stats("decode")
    proc = dep.procs["prefill"][0]
    ex = pd["examples"][0]

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
    r = httpx.post(fe + "/v1/chat/completions", json=_body(ex), timeout=300)
    assert r.status_code >= 400, (r.status_code, r.text)  # never a 200 with empty content
    status, events = stream_events()
    assert failed(status, events), (status, events[-3:])
    after = dep.stats("decode")
    assert after["num_running_reqs"] == 0 and after["num_used_tokens"] == before["num_used_tokens"]
    assert after["handovers_imported"] == before["handovers_imported"]
