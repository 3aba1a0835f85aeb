"""The DeepSeek-V4 chat encoding (dsv41_jax/chat_format/encoding_v4.py; docs/design/v4.md "Chat").

tests/data/v4/chat_model/reference_prompts.json holds prompts produced by SGLang's `encoding_dsv4.encode_messages`
(python/sglang/srt/entrypoints/openai/encoding_dsv4.py at commit 00370f27, "adapted from the DeepSeek-V4
release reference implementation"), run in a scratch folder (not in this repository) the way SGLang's
serving_chat calls it (an empty system message first, request tools on it), with its prose constants
replaced by the invented ones of tests/data/v4/chat_model/encoding/encoding_dsv4.py. Each case lists the
messages, tools, thinking switch, effort and response_format it was rendered with.
"""

import json
import os

import pytest

from dsv41_jax.chat_format.dsml import render_calls_block
from dsv41_jax.chat_format.effort import ChatError
from dsv41_jax.chat_format.encoding_v4 import (
    DEFAULT_V4_WORDING,
    encode_chat_request_v4,
    encode_messages_v4,
    load_v4_wording,
    resolve_v4_thinking,
)
from dsv41_jax.chat_format.registry import chat_encoder

MODEL = os.path.join(os.path.dirname(__file__), "data", "v4", "chat_model")
with open(os.path.join(MODEL, "reference_prompts.json"), encoding="utf-8") as f:
    REFERENCE = json.load(f)

BOS = "<｜begin▁of▁sentence｜>"


@pytest.fixture(scope="module")
def wording():
    return load_v4_wording(MODEL)


def test_wording_read_with_ast_never_executed(wording):
    """The fixture raises on import; its constants are still read."""
    assert wording.source.endswith("encoding_dsv4.py")
    assert wording.max_effort_text == "Fixture max effort: think as long as it takes.\nCheck everything twice.\n\n"
    assert wording.sections.tools_template.startswith("## Fixture Tools\n")
    assert wording.sections.response_format_template.startswith("## Fixture Response Format")
    assert load_v4_wording(None) is DEFAULT_V4_WORDING
    assert load_v4_wording(os.path.dirname(MODEL)) is DEFAULT_V4_WORDING  # no encoding/ there


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_matches_reference_encoder(name, wording):
    case = REFERENCE[name]
    got = encode_messages_v4(case["messages"], tools=case.get("tools"), thinking=case.get("thinking", False),
                             effort=case.get("effort"), wording=wording, response_format=case.get("response_format"))
    assert got == case["expected"]


def test_reference_cases_cover_the_rules():
    """The reference data exercises what differs between V4 and V4.1 (guards against a thinned-out file)."""
    exp = {k: v["expected"] for k, v in REFERENCE.items()}
    assert exp["chat_user"] == BOS + "<｜User｜>Hi<｜Assistant｜></think>"
    assert exp["think_high"] == exp["think"] == BOS + "<｜User｜>Hi<｜Assistant｜><think>"
    assert exp["chat_max_ignored"] == exp["chat_user"]
    assert exp["think_max_system"].startswith(BOS + "Fixture max effort")
    assert "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">" in exp["think_tools_round"]
    assert "R1" not in exp["think_history"] and "dev rules" not in exp["developer_think_dropped"]
    assert "dev rules" in exp["developer_chat_kept"]
    assert exp["tool_results_unknown_id"].endswith(
        "<tool_result>Z</tool_result>\n\n<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>"
        "<｜Assistant｜><think>")


def test_default_wording_layout():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    p = encode_messages_v4([{"role": "user", "content": "Hi"}], tools=tools, thinking=True, effort="max")
    assert p.startswith(BOS + DEFAULT_V4_WORDING.max_effort_text + "\n\n## Tools\n")
    assert '{"name": "f", "parameters": {"type": "object", "properties": {}}}' in p
    assert p.endswith("<｜User｜>Hi<｜Assistant｜><think>")
    assert encode_messages_v4([{"role": "user", "content": "Hi"}], thinking=True, effort="high") == \
        encode_messages_v4([{"role": "user", "content": "Hi"}], thinking=True)


def test_dsml_tag_names_v4_vs_v41():
    calls = [("f", {"a": "x", "b": 1})]
    assert render_calls_block(calls) == (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="b" string="false">1</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert render_calls_block(calls, ("tool_calls", "invoke", "parameter")) == (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


# (request, default_thinking, default_effort) -> (thinking, effort), as SGLang maps them for V4
@pytest.mark.parametrize("req, dt, de, want", [
    ({}, False, None, (False, None)),  # Non-think by default
    ({"reasoning_effort": "high"}, False, None, (False, None)),  # an effort does not switch thinking on
    ({"chat_template_kwargs": {"thinking": True}}, False, None, (True, None)),  # Think High
    ({"chat_template_kwargs": {"thinking": True}}, False, "max", (True, "max")),  # the server default
    ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "max"}, False, None, (True, "max")),
    ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "high"}, False, "max", (True, "high")),
    ({"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "medium"}, False, "max", (True, None)),
    ({"reasoning_effort": "max"}, True, None, (True, "max")),
    ({"reasoning_effort": "none"}, True, "max", (False, None)),  # Non-think
    ({"reasoning": {"enabled": True}}, False, None, (True, None)),
    ({"reasoning": {"enabled": True, "effort": "max"}}, False, None, (True, "max")),  # honoured (SGLang drops it)
    ({"chat_template_kwargs": {"reasoning_effort": "max"}, "reasoning_effort": "high"}, True, None, (True, "max")),
    ({"chat_template_kwargs": {"reasoning_effort": "none"}}, True, None, (True, None)),  # kwarg "none": no switch
    ({"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "max"}, True, None, (False, None)),
    ({"chat_template_kwargs": {"enable_thinking": True}}, False, None, (True, None)),
])
def test_reasoning_effort_mapping(req, dt, de, want):
    thinking, effort, _ = resolve_v4_thinking(req, default_thinking=dt, default_effort=de)
    assert (thinking, effort) == want


def test_effort_without_counterpart_warns():
    _, effort, warnings = resolve_v4_thinking({"reasoning_effort": "low", "chat_template_kwargs": {"thinking": True}})
    assert effort is None and len(warnings) == 1 and "low" in warnings[0]


@pytest.mark.parametrize("req, param", [
    ({"reasoning_effort": 5}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs.thinking"),
    ({"reasoning": "max"}, "reasoning"),
])
def test_bad_reasoning_fields_are_400(req, param):
    with pytest.raises(ChatError) as e:
        resolve_v4_thinking(req)
    assert e.value.param == param


def test_bad_input_is_refused():
    with pytest.raises(ChatError):
        encode_messages_v4([{"role": "user", "content": "Hi"}], thinking=True, effort="low")
    with pytest.raises(ChatError):
        encode_messages_v4([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError):
        resolve_v4_thinking({}, default_effort="medium")


def test_encode_chat_request_and_registry():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    req = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "tool_choice": "none",
           "chat_template_kwargs": {"thinking": True}, "reasoning_effort": "max"}
    enc = chat_encoder("deepseek_v4")(req)
    assert (enc.thinking, enc.effort, enc.parse_tools, enc.tool_choice) == (True, "max", False, "none")
    assert enc.prompt == encode_messages_v4(req["messages"], tools=tools, thinking=True, effort="max")
    assert chat_encoder("deepseek_v41").__module__ == "dsv41_jax.chat_format.encoding"
    assert encode_chat_request_v4 is chat_encoder("deepseek_v4")
    with pytest.raises(ValueError, match="deepseek_v5"):
        chat_encoder("deepseek_v5")
