"""A DeepSeek-V4 checkpoint served (issue 48): the real app (`server.build_app` over `AsyncEngine` over the real
`Engine` running `model.v4.decode.extend`) on a micro-v4 checkpoint directory (tests/configs.py: tiny-v4 cut to a
sliding hash-routed, a CSA and an HCA layer) written as ``scripts/make_checkpoint.py`` writes one
(`v4.checkpoint.save_checkpoint`, tiny's tokenizer), with the chat format,
DSML tag names and grammar compiler chosen from the directory as ``python -m dsv41_jax.serve`` chooses them.

Checked: /v1/chat/completions renders V4's encoding with ``reasoning_effort`` mapped as SGLang maps it ("none" ->
Non-think; with thinking on (``chat_template_kwargs.thinking``) "high" -> Think High, "max" -> Think Max;
usage.prompt_tokens is that prompt's length, a thinking
request's random-weight output is all reasoning); ``tool_choice`` named forces a V4 (unspaced) DSML call that the
tool parser reads back into a call validating against the tool's schema; ``response_format`` json_schema output
validates. Random weights: the text means nothing, the structure is what is checked.
"""

import json

import jax
import jsonschema
import pytest
from fastapi.testclient import TestClient

import configs

from dsv41_jax.chat_format.encoding_v4 import V4_TAG_NAMES, encode_chat_request_v4
from dsv41_jax.chat_format.registry import ChatFormat
from dsv41_jax.model import init_params
from dsv41_jax.model.config import TINY_DIR
from dsv41_jax.serving.async_engine import AsyncEngine
from dsv41_jax.serving.constrained import GrammarCompiler
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.server import ServerConfig, build_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from dsv41_jax.model.v4.checkpoint import save_checkpoint

    cfg = configs.micro_v4()
    out = tmp_path_factory.mktemp("micro-v4")
    save_checkpoint(init_params(cfg, jax.random.key(0)), cfg, str(out), tokenizer_dir=TINY_DIR)
    return str(out)


@pytest.fixture(scope="module")
def app(v4_dir):
    args = EngineArgs(model=v4_dir, dtype="exact", page_size=64, context_length=2048, max_total_tokens=4096,
                      max_running_requests=2, chunked_prefill_size=64, batch_buckets=[2], token_buckets=[64],
                      skip_server_warmup=True, decode_log_interval=1000)
    ae = AsyncEngine(Engine(args))
    eng = ae.engine
    assert eng.runner.model_step.family == "deepseek_v4"
    fmt = ChatFormat.for_model(v4_dir)
    assert fmt.family == "deepseek_v4" and fmt.tool_tag_names == V4_TAG_NAMES
    grammar = GrammarCompiler(eng.tokenizer, eng.vocab_size, tag_names=fmt.tool_tag_names)
    cfg = ServerConfig(model_name="micro-v4", context_length=eng.context_length, vocab_size=eng.vocab_size,
                       chat_format=fmt)
    yield TestClient(build_app(ae, eng.tokenizer, cfg, grammar=grammar)), eng.tokenizer, fmt
    ae.shutdown()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "micro-v4", **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("effort,mark", [("none", "non-think"), ("high", "think-high"), ("max", "think-max")])
def test_chat_reasoning_effort_as_sglang(app, effort, mark):
    client, tok, fmt = app
    body = {"messages": MSG, "reasoning_effort": effort}
    if effort != "none":  # SGLang's V4: thinking is switched on by chat_template_kwargs (default off)
        body["chat_template_kwargs"] = {"thinking": True}
    prompt = encode_chat_request_v4(body, wording=fmt.wording).prompt
    max_text = fmt.wording.max_effort_text
    if mark == "non-think":
        assert prompt.endswith("<｜Assistant｜></think>") and max_text not in prompt
    elif mark == "think-high":
        assert prompt.endswith("<｜Assistant｜><think>") and max_text not in prompt
    else:
        assert prompt.endswith("<｜Assistant｜><think>") and max_text in prompt
    r = chat(client, max_tokens=6, temperature=0, **body)
    assert r["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    assert r["usage"]["completion_tokens"] == 6
    m = r["choices"][0]["message"]
    if mark == "non-think":
        assert m.get("reasoning_content") is None
    else:  # a random model never closes </think>: everything is reasoning
        assert m["reasoning_content"] and not m.get("content")


def test_tool_choice_named_forces_a_v4_dsml_call(app):
    client, _, _ = app
    r = chat(client, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=120,
             temperature=0.7, seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_json_schema_output_validates(app):
    client, _, _ = app
    r = chat(client, messages=[{"role": "user", "content": "Weather as JSON."}], max_tokens=40, temperature=1.0,
             seed=1, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    c = r["choices"][0]
    assert c["finish_reason"] == "stop", c
    jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
