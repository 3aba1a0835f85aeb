"""The chat encoding chosen from the checkpoint (dsv41_jax/chat_format/registry.py `ChatFormat`), without an engine:
a tiny-v4 checkpoint directory gets the DeepSeek-V4 encoding (its encoder file's prose, SGLang's reasoning-effort
mapping: Non-think / Think High / Think Max), a V4.1 one V4.1's encoding exactly as the server called it before;
the server's /tokenize renders a chat with the format it was given; a tool-call block in V4's DSML spelling
parses back into the calls it was rendered from."""

import json
import os
import shutil

import pytest
from fastapi.testclient import TestClient

from dsv41_jax.chat_format.dsml import render_calls_block
from dsv41_jax.chat_format.effort import ConfigError, ServerDefaults
from dsv41_jax.chat_format.encoding import encode_chat_request, load_wording
from dsv41_jax.chat_format.encoding_v4 import V4_TAG_NAMES, encode_chat_request_v4, load_v4_wording
from dsv41_jax.chat_format.registry import ChatFormat, family_of_dir
from dsv41_jax.model import ModelConfig
from dsv41_jax.model.config import NANO_DIR, TINY_DIR
from dsv41_jax.serving.server import ServerConfig, build_app
from dsv41_jax.serving.tokenizer import load_tokenizer
from dsv41_jax.serving.tools import parse_tool_calls

HERE = os.path.dirname(__file__)
V4_CHAT = os.path.join(HERE, "data", "v4", "chat_model")
with open(os.path.join(V4_CHAT, "reference_prompts.json"), encoding="utf-8") as f:
    REFERENCE = json.load(f)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    """A tiny-v4 checkpoint directory's chat side: its config.json and the (fixture) encoder file."""
    d = tmp_path_factory.mktemp("tiny_v4")
    with open(d / "config.json", "w", encoding="utf-8") as f:
        json.dump(ModelConfig.preset("tiny-v4").to_hf_dict(), f)
    shutil.copytree(os.path.join(V4_CHAT, "encoding"), d / "encoding")
    return str(d)


def test_a_v4_checkpoint_gets_the_v4_encoding(v4_dir):
    fmt = ChatFormat.for_model(v4_dir, environ={})
    assert family_of_dir(v4_dir) == fmt.family == "deepseek_v4"
    assert fmt.wording.source.endswith("encoding_dsv4.py") and "DeepSeek-V4" in fmt.describe()
    for name in ("chat_user", "think_tools_round", "response_format"):
        case = REFERENCE[name]
        req = {"messages": case["messages"], "tools": case.get("tools"), "response_format": case.get("response_format"),
               "chat_template_kwargs": {"thinking": bool(case.get("thinking"))}}
        if case.get("effort"):
            req["reasoning_effort"] = case["effort"]
        assert fmt.encode(req, render_response_format=True).prompt == case["expected"], name
    assert fmt.encode({"messages": HI}).prompt == encode_chat_request_v4({"messages": HI},
                                                                         wording=load_v4_wording(v4_dir)).prompt


def test_v4_reasoning_efforts_map_as_sglang(v4_dir):
    """Non-think / Think High / Think Max from reasoning_effort; the server default effort from the environment."""
    fmt = ChatFormat.for_model(v4_dir, environ={})
    exp = {k: v["expected"] for k, v in REFERENCE.items()}
    on = {"thinking": True}
    assert fmt.encode({"messages": HI}).prompt == exp["chat_user"]  # thinking off by default
    thinking_default = ChatFormat.for_model(v4_dir, environ={"DSV41_DEFAULT_THINKING": "1"})
    assert thinking_default.encode({"messages": HI}).prompt == exp["think"]
    assert thinking_default.encode({"messages": HI, "reasoning_effort": "none"}).prompt == exp["chat_user"]  # Non-think
    high = fmt.encode({"messages": HI, "chat_template_kwargs": on, "reasoning_effort": "high"})
    assert high.prompt == exp["think_high"] and high.effort == "high"
    mx = fmt.encode({"messages": HI, "chat_template_kwargs": on, "reasoning_effort": "max"})
    assert mx.effort == "max" and mx.prompt.startswith("<｜begin▁of▁sentence｜>Fixture max effort")
    dflt = ChatFormat.for_model(v4_dir, environ={"DSV41_DEFAULT_THINKING": "1", "DSV4_REASONING_EFFORT": "max"})
    assert dflt.encode({"messages": HI}).prompt == mx.prompt
    with pytest.raises(ConfigError, match="DSV4_REASONING_EFFORT"):
        ChatFormat.for_model(v4_dir, environ={"DSV4_REASONING_EFFORT": "medium"})
    with pytest.raises(ConfigError, match="tiers"):
        ChatFormat.for_model(v4_dir, environ={}, tiers={"high": 80})


def test_v41_choice_is_what_the_server_did_before():
    for model_dir in (None, NANO_DIR, TINY_DIR):
        fmt = ChatFormat.for_model(model_dir, environ={})
        wording = load_wording(model_dir)
        old = dict(wording=wording, server_defaults=ServerDefaults.from_env({}, wording=wording))
        assert fmt.family == "deepseek_v41"
        for req in ({"messages": HI}, {"messages": HI, "tools": [WEATHER], "reasoning_effort": "high",
                                       "chat_template_kwargs": {"thinking": True}}):
            assert fmt.encode(req) == encode_chat_request(req, **old)
    assert ChatFormat(server_defaults=ServerDefaults()).encode({"messages": HI}) == encode_chat_request(
        {"messages": HI}, server_defaults=ServerDefaults())
    with pytest.raises(ValueError, match="no chat encoding"):
        ChatFormat.for_model(None, "llama")


def test_tokenize_endpoint_renders_the_configured_format(v4_dir):
    tok = load_tokenizer("tiny")
    body = {"model": "tiny", "messages": HI, "chat_template_kwargs": {"thinking": True}}
    for fmt in (ChatFormat.for_model(v4_dir, environ={}), ChatFormat(server_defaults=ServerDefaults())):
        app = build_app(object(), tok, ServerConfig(model_name="tiny", vocab_size=320, chat_format=fmt))
        r = TestClient(app).post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok.encode(fmt.encode(body).prompt)


def test_a_v4_tool_call_block_parses():
    """The calls block V4's encoder writes (unspaced DSML, string="true|false" parameters) parses back."""
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Zürich"})]
    block = render_calls_block(calls, V4_TAG_NAMES)
    assert block.startswith("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">")
    content, got, warnings = parse_tool_calls("Let me check.\n\n" + block, [WEATHER])
    assert content == "Let me check." and warnings == []
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [
        (n, a) for n, a in calls]
