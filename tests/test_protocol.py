"""Request validation (protocol.py), output normalization and metrics of the server, without a model."""

import json
import math

import pytest

from dsv41_jax.serving.protocol import (
    APIError,
    check_context,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    usage_dict,
)
from dsv41_jax.serving.sampling import SamplingParams

MSG = [{"role": "user", "content": "hi"}]


def bad(fn, body, param=None, status=400, **kw):
    with pytest.raises(APIError) as e:
        fn(body, **kw)
    assert e.value.status == status
    b = e.value.body()
    assert set(b["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert b["error"]["param"] == param, b
    return e.value


def test_json_body():
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"{", b"[1, 2]", b"\xff\xfe", b'"x"'):
        with pytest.raises(APIError) as e:
            parse_json_body(raw)
        assert e.value.status == 400


def test_chat_fields():
    r = parse_chat_request({"model": "m", "messages": MSG, "temperature": 0, "top_p": 0.5, "top_k": 5, "seed": 3,
                            "stop": "x", "max_completion_tokens": 7, "max_tokens": 9, "n": 2, "logprobs": True,
                            "top_logprobs": 4, "presence_penalty": 1, "stream": True,
                            "stream_options": {"include_usage": True}})
    sp = r.sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop, sp.max_tokens, sp.n, sp.logprobs) == \
        (0.0, 0.5, 5, 3, ["x"], 7, 2, 4)
    assert r.stream and r.stream_options.include_usage and r.max_tokens_param == "max_completion_tokens"
    r = parse_chat_request({"messages": MSG})
    assert r.sampling.max_tokens is None and r.sampling.logprobs is None and r.model is None
    assert parse_chat_request({"messages": MSG, "logprobs": True}).sampling.logprobs == 0
    assert parse_chat_request({"messages": MSG, "max_tokens": 5.0}).sampling.max_tokens == 5


@pytest.mark.parametrize("patch,param", [
    ({"temperature": -1}, "temperature"), ({"temperature": "1"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"), ({"max_completion_tokens": 0},
                                                                              "max_completion_tokens"),
    ({"n": 0}, "n"), ({"n": 1000}, "n"), ({"seed": "x"}, "seed"), ({"stop": 5}, "stop"), ({"stop": ["a"] * 17}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 1}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                           "top_logprobs"),
    ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"logit_bias": {"1": 2}}, "logit_bias"), ({"model": 5}, "model"), ({"messages": None}, "messages"),
    ({"temperature": math.inf}, "temperature"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
])
def test_chat_field_errors(patch, param):
    bad(parse_chat_request, dict({"messages": MSG}, **patch), param)


def test_completion_fields():
    r = parse_completion_request({"prompt": "a"})
    assert r.prompts == ["a"] and r.sampling.max_tokens == 16 and r.logprobs is None
    r = parse_completion_request({"prompt": [[1, 2], [3]], "logprobs": 3, "echo": False, "n": 2, "best_of": 2},
                                 vocab_size=10)
    assert r.prompts == [[1, 2], [3]] and r.sampling.logprobs == 3 and r.sampling.n == 2
    assert parse_completion_request({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    bad(parse_completion_request, {}, "prompt")
    bad(parse_completion_request, {"prompt": []}, "prompt")
    bad(parse_completion_request, {"prompt": [1, "a"]}, "prompt")
    bad(parse_completion_request, {"prompt": [1, 99]}, "prompt", vocab_size=50)
    bad(parse_completion_request, {"prompt": [[1], []]}, "prompt[1]")
    bad(parse_completion_request, {"prompt": "a", "suffix": "b"}, "suffix")
    bad(parse_completion_request, {"prompt": "a", "best_of": 3}, "best_of")
    bad(parse_completion_request, {"prompt": "a", "echo": True, "logprobs": 1, "n": 2}, "n")
    bad(parse_completion_request, {"prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "stream")
    bad(parse_completion_request, {"prompt": "a", "echo": True, "logprobs": 21}, "logprobs")
    bad(parse_completion_request, {"prompt": "a", "max_tokens": 0}, "max_tokens")  # 0 only with echo
    r = parse_completion_request({"prompt": [[1, 2]], "echo": True, "logprobs": 1, "max_tokens": 1})
    assert r.sampling.prompt_logprobs == 1 and r.sampling.logprobs == 1
    r = parse_completion_request({"prompt": "ab", "echo": True, "max_tokens": 0})
    assert r.sampling.max_tokens == 0 and r.sampling.prompt_logprobs == 0
    assert parse_completion_request({"prompt": "ab", "echo": True}).sampling.prompt_logprobs is None
    bad(parse_completion_request, {"prompt": "a", "logprobs": 30}, "logprobs")


def test_context_checks():
    sp = SamplingParams(max_tokens=None)
    assert check_context(10, sp, 100, explicit=False).max_tokens == 90
    assert check_context(10, SamplingParams(max_tokens=16), 20, explicit=False).max_tokens == 10  # default clipped
    e = bad(lambda b: check_context(10, SamplingParams(max_tokens=95), 100, explicit=True), {}, "max_tokens")
    assert e.code == "context_length_exceeded" and "100" in e.message
    e = bad(lambda b: check_context(100, sp, 100, explicit=False, prompt_param="prompt"), {}, "prompt")
    assert e.code == "context_length_exceeded"
    e = bad(lambda b: check_context(100, sp, 100, explicit=False), {}, "messages")  # chat's default


def test_usage_dict():
    u = usage_dict(3, 4, 2)
    assert u["total_tokens"] == 7 and u["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert "completion_tokens_details" not in usage_dict(1, 1)


def test_metrics_render():
    from dsv41_jax.serving.metrics import ServerMetrics

    stats = {"num_running_reqs": 3, "num_queue_reqs": 1, "token_usage": 0.25, "gen_throughput": 12.5,
             "cache_hit_rate": 0.5, "num_used_tokens": 640}
    m = ServerMetrics(lambda: stats, model_name="tiny")
    t = m.timer()
    t.tokens(1)
    t.tokens(2)
    t.finish()
    m.finished("stop", 10, 1)
    m.rejected(503)
    m.http("/v1/completions", 200)
    text = m.render().decode()
    vals = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("dsv41:")}
    assert vals["dsv41:num_running_reqs"] == 3 and vals["dsv41:token_usage"] == 0.25
    assert vals["dsv41:num_used_tokens"] == 640 and vals["dsv41:cache_hit_rate"] == 0.5
    assert vals["dsv41:generation_tokens_total"] == 3 and vals["dsv41:prompt_tokens_total"] == 10
    assert vals["dsv41:time_to_first_token_seconds_count"] == 1
    assert vals["dsv41:inter_token_latency_seconds_count"] == 2
    assert vals['dsv41:num_requests_total{finish_reason="stop"}'] == 1
    assert vals['dsv41:num_rejected_requests_total{code="503"}'] == 1
    # a failing stats function never breaks a scrape
    m2 = ServerMetrics(lambda: 1 / 0)
    assert b"dsv41:gen_throughput" in m2.render()
    json.dumps(stats)


def test_serve_cli_names_and_sizes():
    import argparse

    from dsv41_jax.serve import _size, build_parser, model_aliases

    assert model_aliases("tiny") == ["tiny"]
    assert "deepseek-ai/DeepSeek-V4.1-Flash" in model_aliases("/data/DeepSeek-V4.1-Flash")
    assert "deepseek-ai/DeepSeek-V4.1-Flash" in model_aliases(
        "/hf/hub/models--deepseek-ai--DeepSeek-V4.1-Flash/snapshots/abc")
    assert _size("16M") == 16 << 20 and _size("512k") == 512 << 10 and _size("1000") == 1000 and _size("2MiB") == 2 << 20
    with pytest.raises(argparse.ArgumentTypeError):
        _size("lots")
    a = build_parser().parse_args(["--tp", "2", "--reasoning-parser", "auto", "--port", "1234", "--seed", "3"])
    assert (a.tp_size, a.reasoning_parser, a.port, a.random_seed, a.model, a.host) == (2, "auto", 1234, 3, "nano",
                                                                                       "127.0.0.1")
