"""Chat encoding (docs/design/spec.md §10) and the reasoning_effort contract, byte for byte.

The literal strings below spell docs/design/spec.md §10's ``BOS`` / ``EOS`` as the real special tokens.
"""

import json
import logging
from pathlib import Path

import pytest

from dsv41_jax.chat_format.encoding import (
    ASSISTANT,
    BOS,
    DEFAULT_WORDING,
    EOS,
    SYSTEM,
    USER,
    ChatError,
    Wording,
    encode_messages,
    load_wording,
    read_constants,
)
from dsv41_jax.chat_format.effort import (
    ConfigError,
    ServerDefaults,
    effort_from_fraction,
    parse_tier_table,
    resolve_thinking,
)

ASSETS = Path(__file__).resolve().parents[1] / "dsv41_jax" / "assets" / "tiny"
FIXTURE_DIR = Path(__file__).resolve().parent / "data"

EFFORT75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}
WEATHER_JSON = (
    '{"name": "get_weather", "description": "Get the current weather in a city", "parameters": '
    '{"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}'
)


def u(text):
    return {"role": "user", "content": text}


def a(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def call(cid, name, args):
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def tools_section(functions_json, wording=DEFAULT_WORDING):
    return wording.tools_template.format(
        dsml_token="｜DSML｜", tc_block_name=" calls", tool_call_tag_name=" invoke",
        tool_parameter_tag_name=" parameter", thinking_start_token="<think>",
        thinking_end_token="</think>", tool_schemas=functions_json)


# ------------------------------------------------------------------ docs/design/spec.md §10 examples, verbatim

def test_spec_example_chat():
    assert encode_messages([u("Hi")]) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"


def test_spec_example_with_system():
    got = encode_messages([{"role": "system", "content": "Be terse"}, u("Hi")])
    assert got == "<｜begin▁of▁sentence｜><｜System｜>Be terse<｜User｜>Hi<｜Assistant｜></think>"


def test_spec_example_thinking():
    got = encode_messages([u("Hi")], thinking=True)
    assert got == ("<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the "
                   "value, the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>")


def test_spec_example_thinking_history_without_tools():
    msgs = [u("Hi"), a("A1", reasoning_content="R1 is dropped"), u("Q2")]
    got = encode_messages(msgs, thinking=True)
    tail = "<｜User｜>Hi<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>"
    assert got.endswith(tail)
    assert got == "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT75 + tail
    assert "R1" not in got


# ------------------------------------------------------------------------------------ layout

def test_no_bos_for_continuation():
    assert encode_messages([u("Hi")], add_bos=False) == "<｜User｜>Hi<｜Assistant｜></think>"


def test_thinking_with_system_effort_line_first():
    got = encode_messages([{"role": "system", "content": "Be terse"}, u("Hi")], thinking=True, effort=30)
    assert got == BOS + SYSTEM + EFFORT75.replace("75", "30") + "Be terse" + USER + "Hi" + ASSISTANT + "<think>"
    assert got.count(SYSTEM) == 1


@pytest.mark.parametrize("effort,budget", [(None, 75), ("low", 50), ("high", 75), ("xhigh", 75),
                                           ("max", 100), (1, 1), (100, 100), ("MAX", 100)])
def test_effort_line_values(effort, budget):
    got = encode_messages([u("Hi")], thinking=True, effort=effort)
    assert got == BOS + SYSTEM + EFFORT75.replace("75", str(budget)) + USER + "Hi" + ASSISTANT + "<think>"


@pytest.mark.parametrize("effort", [0, 101, True, "minimal", 0.5, "bogus"])
def test_encoder_rejects_bad_effort(effort):
    with pytest.raises(ChatError) as e:
        encode_messages([u("Hi")], thinking=True, effort=effort)
    assert e.value.param == "reasoning_effort"


def test_effort_ignored_in_chat_mode():
    assert encode_messages([u("Hi")], effort=30) == BOS + USER + "Hi" + ASSISTANT + "</think>"


def test_consecutive_user_messages_merge_and_text_parts_join():
    msgs = [u("one"), u([{"type": "text", "text": "two"}, {"type": "text", "text": "three"}]),
            {"role": "developer", "content": "four"}]
    assert encode_messages(msgs) == BOS + USER + "one\n\ntwo\n\nthree\n\nfour" + ASSISTANT + "</think>"


def test_developer_message_is_a_user_turn():
    msgs = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}]
    assert encode_messages(msgs) == BOS + SYSTEM + "S" + USER + "D" + ASSISTANT + "</think>"


def test_later_system_message_is_a_user_turn():
    msgs = [{"role": "system", "content": "S0"}, u("Hi"), a("A1"), {"role": "system", "content": "S1"}]
    got = encode_messages(msgs)
    assert got == (BOS + SYSTEM + "S0" + USER + "Hi" + ASSISTANT + "</think>A1" + EOS
                   + SYSTEM + "S1" + ASSISTANT + "</think>")
    # ... and it is the last user-like turn for the thinking header
    got = encode_messages(msgs, thinking=True)
    assert got == (BOS + SYSTEM + EFFORT75 + "S0" + USER + "Hi" + ASSISTANT + "</think>A1" + EOS
                   + SYSTEM + "S1" + ASSISTANT + "<think>")


def test_later_system_followed_by_user_gets_no_header_of_its_own():
    msgs = [u("Hi"), {"role": "system", "content": "S"}, u("Q")]
    assert encode_messages(msgs) == BOS + USER + "Hi" + SYSTEM + "S" + USER + "Q" + ASSISTANT + "</think>"


def test_system_only_conversation_has_no_header():
    assert encode_messages([{"role": "system", "content": "S"}]) == BOS + SYSTEM + "S"


def test_null_and_missing_content():
    msgs = [u(None), a(None), u("x")]
    assert encode_messages(msgs) == BOS + USER + ASSISTANT + "</think>" + EOS + USER + "x" + ASSISTANT + "</think>"


def test_non_ascii_kept_verbatim():
    assert encode_messages([u("天气 ☀ — ok")]) == BOS + USER + "天气 ☀ — ok" + ASSISTANT + "</think>"


# ----------------------------------------------------------------- assistant history / reasoning

def test_chat_mode_never_renders_reasoning():
    msgs = [u("Hi"), a("A1", reasoning_content="R1"), u("Q2"), a("A2", reasoning_content="R2")]
    got = encode_messages(msgs)
    assert got == (BOS + USER + "Hi" + ASSISTANT + "</think>A1" + EOS + USER + "Q2" + ASSISTANT + "</think>A2" + EOS)


def test_thinking_keeps_reasoning_after_last_user_turn_only():
    msgs = [u("Hi"), a("A1", reasoning_content="R1"), u("Q2"), a("A2", reasoning_content="R2")]
    got = encode_messages(msgs, thinking=True)
    assert got == (BOS + SYSTEM + EFFORT75 + USER + "Hi" + ASSISTANT + "</think>A1" + EOS
                   + USER + "Q2" + ASSISTANT + "<think>R2</think>A2" + EOS)


def test_reasoning_field_alias():
    msgs = [u("Hi"), a("A", reasoning="R")]
    assert encode_messages(msgs, thinking=True).endswith(ASSISTANT + "<think>R</think>A" + EOS)


def test_thinking_with_tools_keeps_all_reasoning_and_opens_every_header():
    msgs = [u("Hi"), a("A1", reasoning_content="R1"), u("Q2"), a("A2", reasoning_content="R2"), u("Q3")]
    got = encode_messages(msgs, thinking=True, tools=[WEATHER])
    head = BOS + SYSTEM + EFFORT75 + "\n\n" + tools_section(WEATHER_JSON)
    assert got == (head + USER + "Hi" + ASSISTANT + "<think>R1</think>A1" + EOS
                   + USER + "Q2" + ASSISTANT + "<think>R2</think>A2" + EOS
                   + USER + "Q3" + ASSISTANT + "<think>")


def test_tool_call_round_in_thinking_mode():
    msgs = [u("Weather in Beijing?"),
            a(None, reasoning_content="Need the tool.", tool_calls=[call("c1", "get_weather", {"location": "Beijing"})]),
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 25C"}]
    got = encode_messages(msgs, thinking=True, tools=[WEATHER])
    block = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
             '<｜DSML｜ parameter name="location" string="true">Beijing</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert got == (BOS + SYSTEM + EFFORT75 + "\n\n" + tools_section(WEATHER_JSON)
                   + USER + "Weather in Beijing?" + ASSISTANT + "<think>Need the tool.</think>" + block + EOS
                   + USER + "<tool_result>sunny, 25C</tool_result>" + ASSISTANT + "<think>")


# --------------------------------------------------------------------------------- tools section

def test_tools_section_chat_mode_no_system():
    got = encode_messages([u("Hi")], tools=[WEATHER])
    section = tools_section(WEATHER_JSON)
    assert got == BOS + SYSTEM + "\n\n" + section + USER + "Hi" + ASSISTANT + "</think>"
    assert section.startswith("## Tools\n\n")
    assert section.endswith(".\n") and not section.endswith("\n\n")
    assert "### Available Tool Schemas\n\n" + WEATHER_JSON + "\n\n" in section
    for placeholder in ("$TOOL_NAME", "$TOOL_NAME2", "$PARAMETER_NAME", "$PARAMETER_VALUE", 'string="true"',
                        'string="false"', "<think>...</think>", "<｜DSML｜ calls>", "</｜DSML｜ invoke>"):
        assert placeholder in section
    assert section.count('<｜DSML｜ invoke name="') == 2


def test_tools_attach_to_first_system_message():
    got = encode_messages([{"role": "system", "content": "Be terse"}, u("Hi")], tools=[WEATHER])
    assert got == BOS + SYSTEM + "Be terse\n\n" + tools_section(WEATHER_JSON) + USER + "Hi" + ASSISTANT + "</think>"


def test_tools_rendered_even_with_tool_choice_none():
    with_none = encode_messages([u("Hi")], tools=[WEATHER], tool_choice="none")
    assert with_none == encode_messages([u("Hi")], tools=[WEATHER])
    assert "## Tools" in with_none


def test_tool_schema_json_style_and_key_order():
    tool = {"type": "function", "function": {
        "parameters": {"type": "object", "properties": {"t": {"type": "number", "default": 1e-06},
                                                        "x": {"type": "number", "default": 3.0}}},
        "strict": False, "name": "wetter", "description": "Wetter für München ☀"}}
    got = encode_messages([u("Hi")], tools=[tool, WEATHER])
    line = ('{"name": "wetter", "description": "Wetter für München ☀", "parameters": {"type": "object", '
            '"properties": {"t": {"type": "number", "default": 1e-06}, "x": {"type": "number", "default": 3.0}}}, '
            '"strict": false}')
    assert "\n\n" + line + "\n" + WEATHER_JSON + "\n\n" in got


def test_tool_schema_only_client_keys():
    tool = {"type": "function", "function": {"name": "noargs"}}
    got = encode_messages([u("Hi")], tools=[tool])
    assert '\n\n{"name": "noargs"}\n\n' in got


def test_response_format_rendered_only_when_passed():
    rf = {"type": "json_object"}
    got = encode_messages([u("Hi")], response_format=rf)
    assert got == (BOS + SYSTEM + "\n\n" + DEFAULT_WORDING.render_response_format(rf) + USER + "Hi"
                   + ASSISTANT + "</think>")
    assert "## Response Format" in got


# ------------------------------------------------------------------------ calls and tool results

def test_calls_markup_exact():
    calls = [call("c1", "search", {"query": "  spaced  ", "limit": 5, "filters": {"lang": "中文", "safe": True},
                                   "ratio": 1e-06, "scale": 3.0, "tags": ["a", "b"], "none": None}),
             call("c2", "now", {})]
    got = encode_messages([u("Hi"), a("Let me look.", tool_calls=calls)])
    expected = (
        "Let me look.\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="search">\n'
        '<｜DSML｜ parameter name="query" string="true">  spaced  </｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">5</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="filters" string="false">{"lang": "中文", "safe": true}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="ratio" string="false">1e-06</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="scale" string="false">3.0</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="tags" string="false">["a", "b"]</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="none" string="false">null</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>\n'
        "</｜DSML｜ calls>" + EOS)
    assert got == BOS + USER + "Hi" + ASSISTANT + "</think>" + expected


def test_history_arguments_may_be_an_object():
    c = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    got = encode_messages([u("Hi"), a("", tool_calls=[c])])
    assert '<｜DSML｜ parameter name="x" string="false">1</｜DSML｜ parameter>' in got


def test_tool_results_in_call_order_merged_with_following_user_text():
    msgs = [u("Q"),
            a("", tool_calls=[call("id_a", "f", {"n": 1}), call("id_b", "f", {"n": 2}), call("id_c", "f", {"n": 3})]),
            {"role": "tool", "tool_call_id": "id_c", "content": "C"},
            {"role": "tool", "tool_call_id": "id_a", "content": None},
            {"role": "tool", "tool_call_id": "id_b", "content": [{"type": "text", "text": "B1"},
                                                                 {"type": "text", "text": "B2"}]},
            u("thanks")]
    got = encode_messages(msgs)
    turn = (USER + "<tool_result></tool_result>\n\n<tool_result>B1\n\nB2</tool_result>\n\n"
            "<tool_result>C</tool_result>\n\nthanks" + ASSISTANT + "</think>")
    assert got.endswith(EOS + turn)
    assert got.count(USER) == 2


def test_tool_results_unknown_ids_keep_order_after_known():
    msgs = [u("Q"), a("", tool_calls=[call("x", "f", {}), call("y", "f", {})]),
            {"role": "tool", "tool_call_id": "zz", "content": "Z"},
            {"role": "tool", "tool_call_id": "y", "content": "Y"},
            {"role": "tool", "tool_call_id": "x", "content": "X"}]
    got = encode_messages(msgs)
    assert got.endswith(USER + "<tool_result>X</tool_result>\n\n<tool_result>Y</tool_result>\n\n"
                        "<tool_result>Z</tool_result>" + ASSISTANT + "</think>")


def test_tool_results_follow_the_latest_assistant_calls():
    msgs = [u("Q"), a("", tool_calls=[call("1", "f", {}), call("2", "f", {})]),
            {"role": "tool", "tool_call_id": "2", "content": "two"},
            {"role": "tool", "tool_call_id": "1", "content": "one"},
            a("", tool_calls=[call("3", "f", {}), call("4", "f", {})]),
            {"role": "tool", "tool_call_id": "4", "content": "four"},
            {"role": "tool", "tool_call_id": "3", "content": "three"}]
    got = encode_messages(msgs)
    assert "<tool_result>one</tool_result>\n\n<tool_result>two</tool_result>" in got
    assert got.endswith("<tool_result>three</tool_result>\n\n<tool_result>four</tool_result>"
                        + ASSISTANT + "</think>")


# ------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("args", ["not json", "[1, 2]", '"a string"', "", "null", 5])
def test_history_arguments_not_an_object_rejected(args):
    msgs = [u("Hi"), a("", tool_calls=[{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": args}}])]
    with pytest.raises(ChatError) as e:
        encode_messages(msgs)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("content,param", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "messages[0].content[0]"),
    ([{"type": "text", "text": "ok"}, {"type": "input_image", "image_url": "x"}], "messages[0].content[1]"),
    ("look: <｜deepseek_image｜>", "messages[0].content"),
    ([{"type": "text", "text": "<｜deepseek_image｜>"}], "messages[0].content[0].text"),
    ([{"type": "input_audio", "input_audio": {}}], "messages[0].content[0].type"),
    (42, "messages[0].content"),
])
def test_images_and_bad_content_rejected(content, param):
    with pytest.raises(ChatError) as e:
        encode_messages([u(content)])
    assert e.value.param == param


def test_image_token_rejected_in_tool_results_and_reasoning():
    with pytest.raises(ChatError):
        encode_messages([u("q"), {"role": "tool", "tool_call_id": "x", "content": "<｜deepseek_image｜>"}])
    with pytest.raises(ChatError) as e:
        encode_messages([u("q"), a("x", reasoning_content="<｜deepseek_image｜>")], thinking=True)
    assert e.value.param == "messages[1].reasoning_content"


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ("hi", "messages"),
    (["hi"], "messages[0]"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([u("x"), a("y", tool_calls=[{"id": "c"}])], "messages[1].tool_calls[0].function"),
    ([u("x"), a("y", tool_calls=[{"id": "c", "function": {"arguments": "{}"}}])],
     "messages[1].tool_calls[0].function.name"),
])
def test_bad_messages_rejected(messages, param):
    with pytest.raises(ChatError) as e:
        encode_messages(messages)
    assert e.value.param == param


@pytest.mark.parametrize("tools,param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "string"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": 'bad"name'}}], "tools[0].function.name"),
    ([{"type": "function", "function": {}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ("tools", "tools"),
])
def test_invalid_tools_rejected(tools, param):
    with pytest.raises(ChatError) as e:
        encode_messages([u("Hi")], tools=tools)
    assert e.value.param == param


@pytest.mark.parametrize("tool_choice", ["sometimes", {"type": "function", "function": {"name": "nope"}},
                                         {"type": "function"}, 3])
def test_invalid_tool_choice_rejected(tool_choice):
    with pytest.raises(ChatError) as e:
        encode_messages([u("Hi")], tools=[WEATHER], tool_choice=tool_choice)
    assert e.value.param == "tool_choice"


def test_required_tool_choice_without_tools_rejected():
    with pytest.raises(ChatError):
        encode_messages([u("Hi")], tool_choice="required")


def test_chat_error_openai_body():
    err = ChatError("bad", "messages[0].role")
    assert err.to_openai() == {"error": {"message": "bad", "type": "invalid_request_error",
                                         "param": "messages[0].role", "code": None}}


# ------------------------------------------------------------------------------- tokenization

def test_tiny_tokenizer_sees_special_tokens_as_single_ids():
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    special = json.loads((ASSETS / "special_tokens.json").read_text())
    msgs = [{"role": "system", "content": "sys"}, u("Hi"),
            a("A1", reasoning_content="R", tool_calls=[call("c1", "get_weather", {"location": "X", "n": 2})]),
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}, u("more")]
    text = encode_messages(msgs, tools=[WEATHER], thinking=True)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == special["bos"] and ids[1] == special["system"]
    assert ids[-2:] == [special["assistant"], special["think_open"]]
    for key in ("user", "think_close", "dsml", "eos"):
        assert special[key] in ids
    # every special token in the text is one id (the text decodes back exactly)
    n_dsml = text.count("｜DSML｜")
    assert ids.count(special["dsml"]) == n_dsml
    assert ids.count(special["user"]) == text.count(USER)
    assert ids.count(special["eos"]) == text.count(EOS)
    assert tok.decode(ids, skip_special_tokens=False) == text
    chat = tok.encode(encode_messages([u("Hi")]), add_special_tokens=False).ids
    assert chat[0] == special["bos"] and chat[1] == special["user"]
    assert chat[-2:] == [special["assistant"], special["think_close"]]


# ------------------------------------------------------------------------------------ wording

def test_wording_from_fixture_is_read_not_executed(tmp_path):
    consts = read_constants(FIXTURE_DIR / "encoding" / "encoding_dsv41.py")
    assert consts["REASONING_EFFORT_MAPPINGS"] == {"low": 40, "high": 80, "max": 100}
    assert consts["DSML_TOKEN"] == "｜DSML｜"
    assert "SCRATCH" not in consts  # rebound to a computed value
    assert "_LOADED_AT_IMPORT" not in consts
    assert consts["TOOLS_TEMPLATE"].endswith("{tool_schemas}\n\nUse only the names and schemas listed.\n")
    # importing it would fail
    import runpy
    with pytest.raises(BaseException):
        runpy.run_path(str(FIXTURE_DIR / "encoding" / "encoding_dsv41.py"))

    w = load_wording(FIXTURE_DIR)
    assert w.source and w.source.endswith("encoding_dsv41.py")
    assert w.effort_mappings == {"low": 40, "high": 80, "max": 100}
    assert w.default_budget == 80
    got = encode_messages([u("Hi")], tools=[WEATHER], thinking=True, wording=w)
    assert got == (BOS + SYSTEM + EFFORT75.replace("75", "80") + "\n\n" + tools_section(WEATHER_JSON, w)
                   + USER + "Hi" + ASSISTANT + "<think>")
    assert "Fixture wording" in got and "### Tool Catalogue\n\n" + WEATHER_JSON + "\n\n" in got
    assert encode_messages([u("Hi")], thinking=True, effort="xhigh", wording=w).count("Effort: 80 ") == 1
    d = ServerDefaults.from_env({}, wording=w)
    assert d.default_effort == 80 and dict(d.tiers) == {"low": 40, "high": 80, "max": 100}


def test_load_wording_defaults(tmp_path):
    assert load_wording(None) is DEFAULT_WORDING
    assert load_wording(tmp_path) is DEFAULT_WORDING
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "helpers.py").write_text("def f():\n    return 1\n")
    assert load_wording(tmp_path) is DEFAULT_WORDING
    (tmp_path / "encoding" / "broken.py").write_text("this is not python (\n")
    assert load_wording(tmp_path) is DEFAULT_WORDING


def test_ast_reader_never_executes(tmp_path):
    marker = tmp_path / "executed"
    enc = tmp_path / "encoding"
    enc.mkdir()
    (enc / "encoding.py").write_text(
        "import os\n"
        f"X = os.system('touch {marker}')\n"
        f"Y = __import__('os').system('touch {marker}')\n"
        f"Z = open('{marker}', 'w')\n"
        "A = 'a' + 'b'\n"
        "B = f'{A}-c'\n"
        "C = '\\n'.join(['x', 'y']).strip()\n"
        "D = dict(low=10, high=60, max=90)\n"
        "REASONING_EFFORT_MAPPINGS = D\n"
        "DEFAULT_REASONING_EFFORT = 'max'\n"
        "TOOLS_TEMPLATE = 'no placeholder here {unknown_field}'\n"
        "REASONING_EFFORT_TEMPLATE = 'Effort={budget}\\n'\n"
        "if True:\n    INSIDE = 'skipped'\n")
    consts = read_constants(enc / "encoding.py")
    assert not marker.exists()
    assert consts["A"] == "ab" and consts["B"] == "ab-c" and consts["C"] == "x\ny"
    assert "X" not in consts and "Y" not in consts and "Z" not in consts and "INSIDE" not in consts
    w = load_wording(tmp_path)
    assert not marker.exists()
    assert w.tools_template == DEFAULT_WORDING.tools_template  # unusable template -> ours
    assert w.effort_mappings == {"low": 10, "high": 60, "max": 90} and w.default_budget == 90
    assert encode_messages([u("Hi")], thinking=True, wording=w) == BOS + SYSTEM + "Effort=90\n" + USER + "Hi" \
        + ASSISTANT + "<think>"


def test_custom_wording_object():
    w = Wording(tools_template="## Tools\n{tool_schemas}\n")
    got = encode_messages([u("Hi")], tools=[WEATHER], wording=w)
    assert got == BOS + SYSTEM + "\n\n## Tools\n" + WEATHER_JSON + "\n" + USER + "Hi" + ASSISTANT + "</think>"


# --------------------------------------------------------------------- reasoning_effort contract

def rt(req, **defaults):
    return resolve_thinking(req, ServerDefaults(**defaults) if defaults else None)


def test_thinking_off_by_default():
    assert rt({}) == (False, None, [])
    assert rt({}, default_thinking=True) == (True, 75, [])


@pytest.mark.parametrize("value,budget", [
    ("low", 50), ("high", 75), ("xhigh", 75), ("max", 100), (" High ", 75),
    (0, 1), (0.0, 1), (0.004, 1), (0.005, 1), (0.015, 2), (0.125, 12), (0.135, 14), (0.5, 50), (0.99, 99),
    ("0.5", 50), ("0.125", 12), (".25", 25), ("0", 1), ("9.9e-1", 99),
])
def test_top_level_effort_values(value, budget):
    thinking, effort, warnings = rt({"reasoning_effort": value})
    assert (thinking, effort, warnings) == (True, budget, [])


@pytest.mark.parametrize("value", ["minimal", "medium", " Medium "])
def test_unmapped_openai_tiers_warn_once_and_use_default(value, caplog):
    with caplog.at_level(logging.INFO):
        thinking, effort, warnings = rt({"reasoning_effort": value})
    assert thinking is True and effort == 75 and len(warnings) == 1
    assert [r.levelno for r in caplog.records if value in r.getMessage()] == [logging.WARNING]  # logged once
    assert rt({"reasoning_effort": value}, default_effort=33)[1] == 33


@pytest.mark.parametrize("param", ["reasoning_effort", "reasoning.effort", "chat_template_kwargs.reasoning_effort"])
@pytest.mark.parametrize("value", ["ultra", "", "highest"])
def test_unknown_tier_names_are_400(param, value):
    """Issue 49: an unknown effort name was accepted with the default effort; OpenAI answers 400."""
    head, _, tail = param.partition(".")
    req = {head: {tail: value}} if tail else {head: value}
    with pytest.raises(ChatError) as e:
        rt(req)
    assert e.value.param == param and repr(value) in e.value.message


def test_none_turns_thinking_off():
    assert rt({"reasoning_effort": "none"}) == (False, None, [])
    assert rt({"reasoning_effort": "none"}, default_thinking=True) == (False, None, [])
    assert rt({"reasoning": {"effort": "none"}}, default_thinking=True)[0] is False


@pytest.mark.parametrize("value", [True, False, 1, 50, 100, 1.0, 0.995, -0.1, "1", "50", "-0.2", "1e3",
                                   float("nan"), float("inf"), [0.5], {"x": 1}])
def test_top_level_bad_values_rejected(value):
    with pytest.raises(ChatError) as e:
        rt({"reasoning_effort": value})
    assert e.value.param == "reasoning_effort"


def test_openai_reasoning_object():
    assert rt({"reasoning": {"effort": "low"}}) == (True, 50, [])
    assert rt({"reasoning": {"enabled": True}}) == (True, 75, [])
    assert rt({"reasoning": {"enabled": 1}}) == (True, 75, [])
    assert rt({"reasoning": {"enabled": False}}, default_thinking=True) == (False, None, [])
    assert rt({"reasoning": {"enabled": False, "effort": "max"}}) == (True, 100, [])
    assert rt({"reasoning_effort": "low", "reasoning": {"effort": "max"}}) == (True, 50, [])
    with pytest.raises(ChatError) as e:
        rt({"reasoning": {"effort": True}})
    assert e.value.param == "reasoning.effort"
    with pytest.raises(ChatError) as e:
        rt({"reasoning": "high"})
    assert e.value.param == "reasoning"


def test_chat_template_kwargs_effort_does_not_switch_thinking_on():
    assert rt({"chat_template_kwargs": {"reasoning_effort": 30}}) == (False, None, [])
    assert rt({"chat_template_kwargs": {"reasoning_effort": 30, "thinking": True}}) == (True, 30, [])
    assert rt({"chat_template_kwargs": {"reasoning_effort": 30}}, default_thinking=True) == (True, 30, [])
    # it replaces the top-level value; the top-level value still switches thinking on
    assert rt({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": 30}}) == (True, 30, [])
    assert rt({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}) == (True, 50, [])
    assert rt({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": 0.2}}) == (True, 20, [])
    # "none" there turns thinking off (it replaces the top-level value)
    assert rt({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "none"}})[0] is False


@pytest.mark.parametrize("value", [1, 42, 100])
def test_chat_template_kwargs_integer_budgets(value):
    assert rt({"chat_template_kwargs": {"thinking": True, "reasoning_effort": value}}) == (True, value, [])


@pytest.mark.parametrize("value", [True, False, 101, -1, 50.0, 1.5, "50", "2.0"])
def test_chat_template_kwargs_bad_values_rejected(value):
    with pytest.raises(ChatError) as e:
        rt({"chat_template_kwargs": {"thinking": True, "reasoning_effort": value}})
    assert e.value.param == "chat_template_kwargs.reasoning_effort"


def test_explicit_thinking_kwarg_wins():
    assert rt({"reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}) == (False, None, [])
    assert rt({"reasoning": {"enabled": True}, "chat_template_kwargs": {"thinking": False}})[0] is False
    t, e, w = rt({"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}})
    assert (t, e, len(w)) == (True, 75, 1)
    assert rt({"chat_template_kwargs": {"enable_thinking": True}}) == (True, 75, [])
    assert rt({"chat_template_kwargs": {"enable_thinking": True, "thinking": False}})[0] is False
    with pytest.raises(ChatError) as e:
        rt({"chat_template_kwargs": {"thinking": "yes"}})
    assert e.value.param == "chat_template_kwargs.thinking"
    with pytest.raises(ChatError) as e:
        rt({"chat_template_kwargs": [1]})
    assert e.value.param == "chat_template_kwargs"


def test_bad_top_level_rejected_even_when_kwargs_override():
    with pytest.raises(ChatError) as e:
        rt({"reasoning_effort": True, "chat_template_kwargs": {"reasoning_effort": 40}})
    assert e.value.param == "reasoning_effort"


def test_effort_from_fraction_round_half_even():
    assert [effort_from_fraction(x) for x in (0.005, 0.015, 0.025, 0.125, 0.145, 0.99, 0.0)] == [1, 2, 2, 12, 14, 99, 1]


def test_server_defaults_from_env():
    d = ServerDefaults.from_env({})
    assert (d.default_thinking, d.default_effort, dict(d.tiers)) == (False, 75, {"low": 50, "high": 75, "max": 100})
    assert ServerDefaults.from_env({"DSV41_DEFAULT_THINKING": "true"}).default_thinking is True
    assert ServerDefaults.from_env({"DSV41_DEFAULT_THINKING": "0"}).default_thinking is False
    assert ServerDefaults.from_env({"DSV41_REASONING_EFFORT": "max"}).default_effort == 100
    assert ServerDefaults.from_env({"DSV41_REASONING_EFFORT": "xhigh"}).default_effort == 75
    assert ServerDefaults.from_env({"DSV41_REASONING_EFFORT": "42"}).default_effort == 42
    assert ServerDefaults.from_env({"DSV41_REASONING_EFFORT": " LOW "}).default_effort == 50
    d = ServerDefaults.from_env({"DSV41_REASONING_EFFORT": "low"}, tiers="low=20,high=60,max=90")
    assert d.default_effort == 20 and rt_with(d, {"reasoning_effort": "max"}) == (True, 90, [])
    assert ServerDefaults.from_env({}, default_effort=12).default_effort == 12


def rt_with(defaults, req):
    return resolve_thinking(req, defaults)


@pytest.mark.parametrize("env", [
    {"DSV41_DEFAULT_THINKING": "maybe"},
    {"DSV41_REASONING_EFFORT": "medium"},
    {"DSV41_REASONING_EFFORT": "minimal"},
    {"DSV41_REASONING_EFFORT": "none"},
    {"DSV41_REASONING_EFFORT": "0"},
    {"DSV41_REASONING_EFFORT": "101"},
    {"DSV41_REASONING_EFFORT": "0.5"},
    {"DSV41_REASONING_EFFORT": "true"},
])
def test_bad_env_fails_at_startup(env):
    with pytest.raises(ConfigError):
        ServerDefaults.from_env(env)


def test_tier_table_parsing():
    assert parse_tier_table("low=10, high=70,max=100") == {"low": 10, "high": 70, "max": 100}
    assert parse_tier_table({"LOW": 5}) == {"low": 5}
    for bad in ("low=0", "low=abc", "low", "", {"none": 5}, {"x": True}):
        with pytest.raises(ConfigError):
            parse_tier_table(bad)


def test_resolved_effort_feeds_the_encoder():
    thinking, effort, _ = rt({"reasoning_effort": 0.3})
    got = encode_messages([u("Hi")], thinking=thinking, effort=effort)
    assert got == BOS + SYSTEM + EFFORT75.replace("75", "30") + USER + "Hi" + ASSISTANT + "<think>"


# --------------------------------------------------------------------- more layout + requests

def test_thinking_system_and_tools_order_inside_leading_system():
    got = encode_messages([{"role": "system", "content": "Be terse"}, u("Hi")], tools=[WEATHER], thinking=True)
    assert got == (BOS + SYSTEM + EFFORT75 + "Be terse\n\n" + tools_section(WEATHER_JSON)
                   + USER + "Hi" + ASSISTANT + "<think>")


def test_tools_attach_to_a_later_first_system_message():
    got = encode_messages([u("Hi"), {"role": "system", "content": "S"}], tools=[WEATHER])
    assert got == BOS + USER + "Hi" + SYSTEM + "S\n\n" + tools_section(WEATHER_JSON) + ASSISTANT + "</think>"


def test_encode_chat_request():
    from dsv41_jax.chat_format.encoding import encode_chat_request

    req = {"messages": [u("Hi")], "tools": [WEATHER], "reasoning_effort": "low"}
    enc = encode_chat_request(req)
    assert enc.thinking and enc.effort == 50 and enc.tool_choice == "auto" and enc.parse_tools
    assert enc.prompt == encode_messages([u("Hi")], tools=[WEATHER], thinking=True, effort=50)
    enc = encode_chat_request({"messages": [u("Hi")], "tools": [WEATHER], "tool_choice": "none"})
    assert not enc.thinking and enc.effort is None and not enc.parse_tools and "## Tools" in enc.prompt
    enc = encode_chat_request({"messages": [u("Hi")], "reasoning_effort": "medium"})
    assert enc.thinking and enc.effort == 75 and len(enc.warnings) == 1
    enc = encode_chat_request({"messages": [u("Hi")], "response_format": {"type": "json_object"}})
    assert "Response Format" not in enc.prompt
    enc = encode_chat_request({"messages": [u("Hi")], "response_format": {"type": "json_object"}},
                              render_response_format=True)
    assert "Response Format" in enc.prompt
    w = load_wording(FIXTURE_DIR)
    enc = encode_chat_request({"messages": [u("Hi")], "reasoning": {"enabled": True}}, wording=w)
    assert enc.effort == 80
    with pytest.raises(ChatError) as e:
        encode_chat_request({"messages": [u("Hi")], "reasoning_effort": False})
    assert e.value.param == "reasoning_effort"
    with pytest.raises(ChatError) as e:
        encode_chat_request({"messages": [u("Hi")], "tool_choice": "required"})
    assert e.value.param == "tool_choice"
    enc = encode_chat_request({"messages": [u("Hi")]}, server_defaults=ServerDefaults(default_thinking=True),
                              add_bos=False)
    assert enc.prompt == SYSTEM + EFFORT75 + USER + "Hi" + ASSISTANT + "<think>"
    with pytest.raises(ChatError) as e:
        encode_chat_request({})
    assert e.value.param == "messages"


def _imported_modules(path: Path) -> set:
    """The absolute module names a source file imports (relative imports resolved)."""
    import ast

    pkg = ".".join(path.relative_to(ASSETS.parents[2]).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
    return out


def test_training_and_the_chat_format_never_import_serving():
    """The chat encoding training and serving share lives in `dsv41_jax.chat_format`, which imports
    nothing else of the project; training builds on it, never on `serving`."""
    root = ASSETS.parents[1]
    fmt = sorted((root / "chat_format").glob("*.py"))
    assert len(fmt) >= 3
    for path in fmt:
        ours = {m for m in _imported_modules(path) if m.startswith("dsv41_jax")}
        assert all(m.startswith("dsv41_jax.chat_format") for m in ours), (path.name, ours)
    found = False
    for path in sorted((root / "training").glob("*.py")):
        mods = _imported_modules(path)
        found |= "dsv41_jax.chat_format.encoding" in mods
        assert not any(m.startswith("dsv41_jax.serving") for m in mods), (path.name, mods)
    assert found  # the check looks at the right files (data.py renders with the shared encoder)
