"""The server's handlers in process, against a model-free engine: the real `Engine` (scheduler, output
processor, the one detokenizer, stops, n > 1, logprobs) over `mock_runner.MockRunner`, whose tokens
each test scripts, behind `AsyncEngine` and the FastAPI app (`fastapi.testclient.TestClient`). No model
and no subprocess: error bodies, SSE framing, n > 1, logprobs shapes and text offsets, the tokenizer
endpoints, and the rough edges of issue 37, each in well under a second.
"""

import json

import pytest
from fastapi.testclient import TestClient

from dsv41_jax.chat_format.encoding import encode_chat_request
from dsv41_jax.serving.async_engine import AsyncEngine
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.protocol import ENDPOINTS
from dsv41_jax.serving.reasoning import chat_text_specials
from dsv41_jax.serving.server import ServerConfig, build_app
from dsv41_jax.serving.tokenizer import load_tokenizer
from mock_runner import MockRunner, mock_logprob

CONTEXT = 2048
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a tool round trip whose result is JSON, thinking off (issue 37's first rough edge)
TOOL_ROUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature_c": 18, "condition": "sunny"}'}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def rig(tok):
    runner = MockRunner(num_pages=600, page_size=16, max_pages_per_seq=CONTEXT // 16, max_slots=4)
    args = EngineArgs(model="tiny", page_size=16, max_running_requests=4, chunked_prefill_size=512,
                      max_prefill_tokens=1024, batch_buckets=[4], token_buckets=[512], decode_log_interval=1000)
    ae = AsyncEngine(Engine(args, runner=runner, tokenizer=tok))
    yield runner, ae
    ae.shutdown()


@pytest.fixture
def client(rig, tok):
    """client(**ServerConfig fields) -> a TestClient of a fresh app on the shared mock engine."""
    runner, ae = rig

    def make(**kw):
        cfg = ServerConfig(**{"model_name": "tiny", "context_length": CONTEXT, "vocab_size": 320, **kw})
        return TestClient(build_app(ae, tok, cfg))

    yield make
    runner.tokens = MockRunner().tokens  # the default script again


def script(runner, tok, *outs):
    """Sample j of every request generates outs[j % len(outs)] (a text, or ids with lists of ids
    inside for special tokens), then EOS."""
    def ids_of(o):
        if isinstance(o, str):
            return tok.encode(o)
        return [t for part in o for t in (tok.encode(part) if isinstance(part, str) else [part])]

    seqs = [ids_of(o) for o in outs]
    eos = tok.eos_token_ids[0]

    def tokens(row, pos):
        s = seqs[row.index % len(seqs)]
        k = pos - row.prompt_len
        return s[k] if 0 <= k < len(s) else eos

    runner.tokens = tokens
    return seqs


def events(r) -> list:
    """The SSE events of a streamed response (checking the framing): JSON objects, then "[DONE]"."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    body = r.text
    assert body.endswith("data: [DONE]\n\n")
    chunks = body.split("\n\n")
    assert chunks[-1] == ""
    out = []
    for c in chunks[:-1]:
        assert c.startswith("data: ") and "\n" not in c, c
        out.append(c[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return [json.loads(c) for c in out[:-1]]


def error(r, status, param="-", code="-") -> dict:
    """The error of an OpenAI error body (one shape everywhere: param and code strings or null)."""
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"}, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"] and isinstance(e["type"], str)
    assert all(e[k] is None or isinstance(e[k], str) for k in ("param", "code")), e
    if param != "-":
        assert e["param"] == param, e
    if code != "-":
        assert e["code"] == code, e
    return e


# ------------------------------------------------------------------------------------ chat


def test_chat_json_and_stream_agree(client, rig, tok):
    """Non-streaming: the OpenAI shape and usage; streaming: role chunk, content deltas, the finish
    chunk, the usage chunk, ``[DONE]``; both carry the same text."""
    script(rig[0], tok, "It is sunny in Paris")
    c = client()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-") and d["model"] == "tiny"
    (ch,) = d["choices"]
    assert ch["message"] == {"role": "assistant", "content": "It is sunny in Paris", "reasoning_content": None}
    assert ch["finish_reason"] == "stop" and ch["logprobs"] is None and ch["matched_stop"] == tok.eos_token_ids[0]
    n_prompt = len(tok.encode(encode_chat_request(body).prompt))
    n_out = len(tok.encode("It is sunny in Paris")) + 1  # and the EOS
    assert d["usage"]["prompt_tokens"] == n_prompt and d["usage"]["completion_tokens"] == n_out
    assert d["usage"]["total_tokens"] == n_prompt + n_out

    ev = events(c.post("/v1/chat/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}))
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == ev[0]["id"] for e in ev)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-1]) == "It is sunny in Paris"
    assert [e["choices"][0]["finish_reason"] for e in ev[1:-1]].count("stop") == 1
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"
    assert ev[-1]["choices"] == [] and ev[-1]["usage"] == d["usage"]
    assert all(e["usage"] is None for e in ev[:-1])


def test_chat_n_choices_and_logprobs_shapes(client, rig, tok):
    """n = 3: three choices with their own scripts, usage summing them (the EOS counted); logprobs.content
    has one item per token of the message (none for the EOS) with top_logprobs of the asked length,
    bytes and the mock's values."""
    outs = ["one", "two two", "three 好"]
    script(rig[0], tok, *outs)
    r = client().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count"}], "n": 3, "logprobs": True, "top_logprobs": 2})
    d = r.json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in d["choices"]] == outs
    assert d["usage"]["completion_tokens"] == sum(len(tok.encode(o)) + 1 for o in outs)
    for c, o in zip(d["choices"], outs):
        items = c["logprobs"]["content"]
        ids = tok.encode(o)  # no entry for the EOS that ended the choice (issue 49), as OpenAI
        assert len(items) == len(ids)
        assert b"".join(bytes(it["bytes"]) for it in items) == o.encode("utf-8")  # exact bytes, 好 too
        for it, t in zip(items, ids):
            assert set(it) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(it["top_logprobs"]) == 2 and it["top_logprobs"][0]["bytes"] == list(tok.token_bytes(t))
        n_p = d["usage"]["prompt_tokens"]
        assert [it["logprob"] for it in items] == pytest.approx([mock_logprob(n_p + j) for j in range(len(ids))])


def test_chat_streaming_n_and_logprobs(client, rig, tok):
    """Streaming with n = 2: each choice's deltas concatenate to its text, each gets one finish chunk,
    the logprobs items stream with the tokens."""
    script(rig[0], tok, "ab cd", "xy")
    ev = events(client().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True, "logprobs": True}))
    text = {0: "", 1: ""}
    n_lp = {0: 0, 1: 0}
    fins = []
    for e in ev:
        (c,) = e["choices"]
        text[c["index"]] += c["delta"].get("content", "")
        n_lp[c["index"]] += len((c["logprobs"] or {}).get("content") or [])
        if c["finish_reason"]:
            fins.append(c["index"])
    assert text == {0: "ab cd", 1: "xy"} and sorted(fins) == [0, 1]
    assert n_lp == {0: len(tok.encode("ab cd")), 1: len(tok.encode("xy"))}  # no entry for the EOS


def test_reasoning_cut_by_max_tokens_is_openai_shaped(client, rig, tok):
    """Issue 49: reasoning cut by max_tokens has ``content: null`` (it was ""), usage carries
    reasoning_tokens only in completion_tokens_details (it was repeated at the top level), and the
    logprobs stop where the message does; the same usage streamed."""
    thk = tok.token_to_id("</think>")
    script(rig[0], tok, ["mull it over", thk, "42"])
    c = client()
    body = {"messages": [{"role": "user", "content": "Q"}], "reasoning_effort": "high", "logprobs": True}
    cut = c.post("/v1/chat/completions", json={**body, "max_tokens": 2}).json()
    (ch,) = cut["choices"]
    assert ch["finish_reason"] == "length" and ch["message"]["content"] is None
    assert ch["message"]["reasoning_content"] == tok.decode(tok.encode("mull it over")[:2])
    u = cut["usage"]
    assert set(u) == {"prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details",
                      "prompt_tokens_details"}, u
    assert u["completion_tokens_details"] == {"reasoning_tokens": 2} and len(ch["logprobs"]["content"]) == 2
    whole = c.post("/v1/chat/completions", json=body).json()
    (ch,) = whole["choices"]
    assert ch["message"]["content"] == "42" and ch["message"]["reasoning_content"] == "mull it over"
    n_reason = len(tok.encode("mull it over"))
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": n_reason}
    n_msg = n_reason + 1 + len(tok.encode("42"))  # reasoning, </think>, the answer; not the EOS
    assert whole["usage"]["completion_tokens"] == n_msg + 1
    items = ch["logprobs"]["content"]
    assert len(items) == n_msg and items[-1]["token"] != tok.id_to_token(tok.eos_token_ids[0])
    ev = events(c.post("/v1/chat/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}}))
    assert ev[-1]["usage"] == whole["usage"]
    assert sum(len((e["choices"][0]["logprobs"] or {}).get("content") or []) for e in ev[:-1]) == n_msg


def test_no_think_close_in_content_with_thinking_off_after_a_json_tool_result(client, rig, tok):
    """Issue 37: a JSON tool result, thinking off, and a model that writes ``</think>`` anyway: the
    text used to keep ``</think>`` (special tokens are kept while tools are given, and ``</think>``
    was kept as structural whatever the thinking switch) and the reasoning parser, off with thinking
    off, passed it into content. With thinking off ``</think>`` is not text."""
    thk = tok.token_to_id("</think>")
    script(rig[0], tok, ["It is sunny in Paris", thk, "It is sunny in Paris", thk, "1"])
    body = {"messages": TOOL_ROUND, "tools": [WEATHER]}
    prompt = encode_chat_request(body).prompt  # the encoding: the result verbatim, the header closes thinking
    assert prompt.endswith('<tool_result>{"temperature_c": 18, "condition": "sunny"}</tool_result>'
                           '<｜Assistant｜></think>')
    c = client()
    msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert msg["content"] == "It is sunny in ParisIt is sunny in Paris1" and msg["reasoning_content"] is None
    ev = events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in ev)
    assert streamed == msg["content"]
    # with thinking on, </think> still splits reasoning from content
    script(rig[0], tok, ["r", thk, "It is sunny"])
    msg = c.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"thinking": True}}).json()
    assert msg["choices"][0]["message"]["reasoning_content"] == "r"
    assert msg["choices"][0]["message"]["content"] == "It is sunny"


def test_chat_text_specials(tok):
    """What a chat completion's text keeps: ``｜DSML｜`` with tools, ``<think>`` / ``</think>`` only
    while thinking, no other special token; nothing special without tools and thinking."""
    ids = {s: tok.token_to_id(s) for s in ("<think>", "</think>", "｜DSML｜", "<｜User｜>")}
    assert chat_text_specials(tok, thinking=False, tools=False) == (True, frozenset())
    skip, drop = chat_text_specials(tok, thinking=False, tools=True)
    assert not skip and ids["</think>"] in drop and ids["<think>"] in drop and ids["｜DSML｜"] not in drop
    skip, drop = chat_text_specials(tok, thinking=True, tools=False)
    assert not skip and ids["</think>"] not in drop and ids["｜DSML｜"] in drop and ids["<｜User｜>"] in drop
    skip, drop = chat_text_specials(tok, thinking=True, tools=True)
    assert drop == frozenset(tok.special_token_ids) - {ids["<think>"], ids["</think>"], ids["｜DSML｜"]}


def test_chat_tool_call_stream(client, rig, tok):
    """A DSML call block becomes tool_calls (non-streaming and streaming), finish_reason tool_calls."""
    from dsv41_jax.chat_format.dsml import render_calls_block

    block = render_calls_block([("get_weather", {"city": "Paris"})])
    script(rig[0], tok, "\n\n" + block)
    c = client()
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    ch = c.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    (call,) = ch["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ev = events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    per_delta = [e["choices"][0]["delta"]["tool_calls"] for e in ev if "tool_calls" in e["choices"][0]["delta"]]
    for tcs in per_delta:  # issue 49: never two entries of one index in a delta (it sent name, then arguments)
        assert len({tc["index"] for tc in tcs}) == len(tcs), tcs
    (d,) = [tc for tcs in per_delta for tc in tcs]  # one whole entry, as vLLM sends a complete call
    assert d["index"] == 0 and d["type"] == "function" and d["id"].startswith("call_")
    assert d["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert ev[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------------------ completions


def test_completions_text_offset_consistent_with_text(client, rig, tok):
    """Issue 37: text_offset used to add the length of special tokens that text leaves out. Now each
    offset is where the token's text starts in ``text``: a skipped special adds nothing, the three
    byte tokens of 好 share its offset, and every token's text is found at its offset."""
    user = tok.token_to_id("<｜User｜>")
    script(rig[0], tok, ["Hi", user, " there 好 ok"])
    c = client()
    for body in ({"prompt": "Say", "max_tokens": 20, "logprobs": 1},
                 {"prompt": "Say", "max_tokens": 20, "logprobs": 1, "echo": True}):
        ch = c.post("/v1/completions", json=body).json()["choices"][0]
        text, lp = ch["text"], ch["logprobs"]
        base = len("Say") if body.get("echo") else 0
        gen_text = text[base:]
        assert gen_text == "Hi there 好 ok"
        toks = tok.encode("Hi") + [user] + tok.encode(" there 好 ok")
        offs = lp["text_offset"][-len(toks) - 1:]  # the generated tokens and the EOS
        assert offs == sorted(offs) and all(base <= o <= len(text) for o in offs)
        for t, o in zip(toks, offs):
            piece = tok.decode([t], skip_special_tokens=True)
            if "\ufffd" not in piece:  # whole characters: found where the offset says
                assert text[o:o + len(piece)] == piece, (t, o)
        k = len(tok.encode("Hi"))
        assert offs[k] == offs[k + 1] == base + 2  # the special adds nothing
        assert offs[-1] == len(text)  # the EOS starts where the text ends
        if body.get("echo"):  # the prompt's tokens: null first logprob, offsets from 0
            n_p = len(tok.encode("Say"))
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:n_p] == pytest.approx([mock_logprob(j) for j in range(1, n_p)])
            assert lp["text_offset"][0] == 0 and lp["text_offset"][n_p - 1] < base
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(offs) + n_p


def test_completions_stop_string_and_n(client, rig, tok):
    """A stop string ends the choice (matched_stop), text cut before it, offsets within the text;
    several prompts x n: choice k * n + j, usage summing every prompt and choice."""
    script(rig[0], tok, "It is sunny in Paris", "cold")
    c = client()
    ch = c.post("/v1/completions", json={"prompt": "Q", "max_tokens": 30, "stop": ["in Par"],
                                         "logprobs": 0}).json()["choices"][0]
    assert ch["text"] == "It is sunny " and ch["finish_reason"] == "stop" and ch["matched_stop"] == "in Par"
    assert max(ch["logprobs"]["text_offset"]) <= len(ch["text"]) and ch["logprobs"]["top_logprobs"] is None
    d = c.post("/v1/completions", json={"prompt": [[40, 41], [5, 6, 7]], "n": 2, "max_tokens": 3}).json()
    assert [x["index"] for x in d["choices"]] == [0, 1, 2, 3]
    outs = [(tok.encode(o) + list(tok.eos_token_ids))[:3] for o in ("It is sunny in Paris", "cold")] * 2
    assert [x["text"] for x in d["choices"]] == [tok.decode(o) for o in outs]
    assert [x["finish_reason"] for x in d["choices"]] == ["length" if o[-1] != 1 else "stop" for o in outs]
    assert d["usage"]["prompt_tokens"] == 2 + 3
    assert d["usage"]["completion_tokens"] == sum(len(o) for o in outs)


def test_completions_stream_framing(client, rig, tok):
    """Streamed completions: the echo first, text deltas, one finish chunk, the usage chunk; streamed
    logprobs (tokens, text offsets) equal the non-streamed ones."""
    user = tok.token_to_id("<｜User｜>")
    script(rig[0], tok, ["abc", user, " d好f"])
    c = client()
    ev = events(c.post("/v1/completions", json={"prompt": "Q", "max_tokens": 30, "stream": True,
                                                "echo": True, "stream_options": {"include_usage": True}}))
    assert all(e["object"] == "text_completion" for e in ev)
    assert ev[0]["choices"][0]["text"] == "Q"  # the echo comes first
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == "Qabc d好f"
    assert ev[-2]["choices"][0]["finish_reason"] == "stop" and ev[-1]["choices"] == []
    assert ev[-1]["usage"]["completion_tokens"] == len(tok.encode("abc d好f")) + 2
    body = {"prompt": "Q", "max_tokens": 30, "logprobs": 1}
    whole = c.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    parts = [e["choices"][0]["logprobs"] for e in events(c.post("/v1/completions", json={**body, "stream": True}))]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for p in parts if p for x in p[key]] == whole[key], key


# ------------------------------------------------------------------------------------ errors


def test_overlong_prompt_names_its_field(client, tok):
    """Issue 37: an over-long prompt on /v1/completions is "param": "prompt" (it said "messages");
    on chat it is "messages"; a max_tokens that does not fit names max_tokens."""
    c = client()
    e = error(c.post("/v1/completions", json={"prompt": [5] * CONTEXT}), 400, "prompt", "context_length_exceeded")
    assert str(CONTEXT) in e["message"]
    error(c.post("/v1/completions", json={"prompt": "a" * (CONTEXT + 10)}), 400, "prompt")
    error(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * CONTEXT}]}), 400,
          "messages", "context_length_exceeded")
    error(c.post("/v1/completions", json={"prompt": "Q", "max_tokens": CONTEXT}), 400, "max_tokens",
          "context_length_exceeded")


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", b"[1]", 400, None, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model",
     "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400,
     "temperature", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format", None),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),  # issue 49: "param" was null
    ("/v1/completions", {"prompt": ["Q", ""]}, 400, "prompt[1]", None),
    # issue 49: accepted before (an unknown effort silently took the default; a result without its call's id)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "ultra"}, 400,
     "reasoning_effort", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"reasoning_effort": "extreme"}}, 400,
     "chat_template_kwargs.reasoning_effort", None),
    ("/v1/chat/completions", {"messages": TOOL_ROUND[:2] + [{"role": "tool", "content": "18 C"}]}, 400,
     "messages[2].tool_call_id", None),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "prompt", None),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens", None),
    ("/detokenize", {"tokens": [320]}, 400, "tokens", None),
])
def test_bad_requests_are_openai_errors(client, path, body, status, param, code):
    c = client()
    r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
    error(r, status, param, code)


def test_routes_auth_size_and_queue(client):
    c = client(api_key="k", max_body_bytes=1000, max_queued_requests=0)
    assert c.get("/health").json() == {"status": "ok"}  # no key needed
    e = error(c.get("/v1/models"), 401, code="invalid_api_key")
    assert e["type"] == "invalid_request_error"
    h = {"Authorization": "Bearer k"}
    assert c.get("/v1/models", headers=h).json()["data"][0]["id"] == "tiny"
    error(c.get("/v1/models/nope", headers=h), 404, "model", "model_not_found")
    error(c.get("/nope", headers=h), 404, None, "not_found")  # issue 49: an integer code (404) before
    error(c.get("/v1/completions", headers=h), 405, None, "method_not_allowed")
    error(c.post("/v1/completions", headers=h, content=b"x" * 2000), 413, code="request_too_large")
    e = error(c.post("/v1/completions", headers=h, json={"prompt": "Q"}), 503, code="queue_full")
    assert c.post("/v1/completions", headers=h, json={"prompt": "Q"}).headers["retry-after"] == "1"
    error(client().get("/metrics"), 404, code="metrics_disabled")


def test_tokenizer_endpoints(client, tok):
    c = client()
    r = c.post("/tokenize", json={"prompt": "Hi there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hi there") and r["count"] == len(r["tokens"]) and r["max_model_len"] == CONTEXT
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    msgs = [{"role": "user", "content": "Hi"}]
    assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == tok.encode(
        encode_chat_request({"messages": msgs}).prompt)
    assert c.post("/detokenize", json={"tokens": tok.encode("Hi there")}).json() == {"prompt": "Hi there"}
    info = c.get("/tokenizer_info").json()
    assert info["eos_token_id"] == tok.eos_token_id and info["max_model_len"] == CONTEXT


def test_every_route_is_listed(client, rig):
    """The endpoint list (--help, the start-up log) is exactly the app's routes: the tokenizer
    endpoints were missing from it."""
    from dsv41_jax.serve import build_parser

    app = client().app.fastapi
    routes = {(m, r.path.replace(":path", "")) for r in app.routes for m in getattr(r, "methods", ()) or ()
              if m != "HEAD"}
    assert routes == {(m, p) for m, p, _ in ENDPOINTS}
    helptext = build_parser().format_help()
    for m, p, _ in ENDPOINTS:
        assert f"{m:4} {p}" in helptext, p
    assert {"/tokenize", "/detokenize", "/tokenizer_info"} <= {p for _, p, _ in ENDPOINTS}
