"""The deepseekv41 DSML tool-call parser and renderer (docs/design/spec.md §10): parse rules, streaming equal to
non-streaming at every chunk boundary, schema validation, round trips, request validation."""

import itertools
import json
import random
import re

import pytest

from dsv41_jax.chat_format.encoding import ChatError, encode_messages
from dsv41_jax.chat_format.dsml import (
    new_call_id,
    normalize_tool_choice,
    render_calls_block,
    render_invoke,
    should_parse_tools,
    validate_arguments,
    validate_tools,
)
from dsv41_jax.serving.tools import ToolCallStreamParser, parse_tool_calls, strip_dsml

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
            "filters": {"type": "object"}, "ratio": {"type": "number"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "now"}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


def P(name, value, string):
    return f'<｜DSML｜ parameter name="{name}" string="{"true" if string else "false"}">{value}</｜DSML｜ parameter>'


def INV(name, *params):
    return f'<｜DSML｜ invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜ invoke>"


def BLOCK(*invokes):
    return "<｜DSML｜ calls>\n" + "\n".join(invokes) + "\n</｜DSML｜ calls>"


W_BEIJING = INV("get_weather", P("location", "Beijing", True))

# (name, text, expected content, expected [(name, args)], number of warnings)
CASES = [
    ("single", "Let me check.\n\n" + BLOCK(W_BEIJING), "Let me check.", [("get_weather", {"location": "Beijing"})], 0),
    ("no text before", BLOCK(W_BEIJING), "", [("get_weather", {"location": "Beijing"})], 0),
    ("several invokes, string and JSON values",
     "Two things.\n\n" + BLOCK(
         INV("get_weather", P("location", "上海", True), P("unit", "c", True)),
         INV("search", P("query", "  keep my spaces \n", True), P("limit", "5", False),
             P("filters", '{"lang": "中文", "safe": true, "tags": ["a", "b"]}', False), P("ratio", "1e-06", False)),
         '<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>'),
     "Two things.",
     [("get_weather", {"location": "上海", "unit": "c"}),
      ("search", {"query": "  keep my spaces \n", "limit": 5,
                  "filters": {"lang": "中文", "safe": True, "tags": ["a", "b"]}, "ratio": 1e-06}),
      ("now", {})], 0),
    ("string=true is verbatim even when it looks like JSON or markup",
     BLOCK(INV("search", P("query", '{"not": "parsed"} <b>bold</b> 42', True))),
     "", [("search", {"query": '{"not": "parsed"} <b>bold</b> 42'})], 0),
    ("self-closing zero-argument invoke",
     'Time?\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="now"/>\n<｜DSML｜ invoke name="ping" />\n</｜DSML｜ calls>',
     "Time?", [("now", {}), ("ping", {})], 0),
    ("JSON-object invoke body",
     BLOCK('<｜DSML｜ invoke name="get_weather">\n{"location": "Paris", "unit": "f"}\n</｜DSML｜ invoke>'),
     "", [("get_weather", {"location": "Paris", "unit": "f"})], 0),
    ("old unspaced V4 form",
     'Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="location" string="true">Oslo</｜DSML｜parameter>\n'
     "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
     "Sure.", [("get_weather", {"location": "Oslo"})], 0),
    ("V3.2 function_calls wrapper",
     '<｜DSML｜function_calls>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     "", [("now", {})], 0),
    ("schema violation skipped, later call kept",
     BLOCK(INV("get_weather", P("unit", "c", True)), INV("get_weather", P("location", "Rome", True), P("unit", "k", True)),
           INV("search", P("query", "x", True), P("limit", "0", False)), INV("get_weather", P("location", "Rome", True))),
     "", [("get_weather", {"location": "Rome"})], 3),
    ("unknown tool skipped", "Hmm.\n\n" + BLOCK(INV("launch_rockets", P("n", "3", False)), W_BEIJING),
     "Hmm.", [("get_weather", {"location": "Beijing"})], 1),
    ("string=false that is not JSON skipped", BLOCK(INV("search", P("query", "x", True), P("limit", "five", False))),
     "", [], 1),
    ("unterminated invoke (length stop)",
     "Checking.\n\n<｜DSML｜ calls>\n" + '<｜DSML｜ invoke name="get_weather">\n'
     + '<｜DSML｜ parameter name="location" string="true">Bei',
     "Checking.", [], 1),
    ("unterminated block after a complete invoke", "<｜DSML｜ calls>\n" + W_BEIJING + "\n",
     "", [("get_weather", {"location": "Beijing"})], 0),
    ("dangling partial marker", "Checking.\n\n<｜DSML｜ cal", "Checking.", [], 1),
    ("dangling partial token", "Checking.\n\n<｜DS", "Checking.", [], 1),
    ("invoke without the calls wrapper", "x\n" + W_BEIJING, "x", [("get_weather", {"location": "Beijing"})], 0),
    ("text after the block", "A\n\n" + BLOCK(W_BEIJING) + "\n\nB", "A\n\nB",
     [("get_weather", {"location": "Beijing"})], 0),
    ("junk inside the block is dropped", BLOCK("garbage here", W_BEIJING), "",
     [("get_weather", {"location": "Beijing"})], 1),
    ("stray markup in text is stripped", "Hello </｜DSML｜ invoke> world ｜DSML｜!", "Hello  world !", [], 2),
    ("plain text with look-alike characters", "a < b, c｜d, <think> </｜x <｜y", "a < b, c｜d, <think> </｜x <｜y",
     [], 0),
    ("trailing whitespace kept without a block", "Hello\n\n", "Hello\n\n", [], 0),
    ("a lone < at the end is text", "1 <", "1 <", [], 0),
    ("invoke not closed before the next one", BLOCK('<｜DSML｜ invoke name="now">\n', W_BEIJING), "",
     [("get_weather", {"location": "Beijing"})], 1),
    ("parameter not closed", BLOCK('<｜DSML｜ invoke name="search">\n<｜DSML｜ parameter name="query" string="true">x\n'
                                   "</｜DSML｜ invoke>"), "", [], 1),
    ("empty", "", "", [], 0),
]


def ids():
    n = itertools.count()
    return lambda: "call_%024x" % next(n)


def run_stream(chunks, tools=TOOLS):
    p = ToolCallStreamParser(tools, id_factory=ids())
    content, deltas, content_deltas, order = "", [], [], []
    for c in list(chunks) + [None]:
        d = p.feed(c) if c is not None else p.finish()
        content += d.content
        content_deltas.append(d.content)
        deltas += d.calls
        if d.content:
            order.append("content")
        if d.calls:
            order.append("calls")
    calls = {}
    for d in deltas:  # one whole entry per call (issue 49: never two entries of one index)
        assert set(d) == {"index", "id", "type", "function"} and set(d["function"]) == {"name", "arguments"}
        assert d["index"] not in calls
        calls[d["index"]] = d
    return content, [calls[i] for i in sorted(calls)], p.warnings, content_deltas


def as_pairs(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content,expected,n_warn", CASES, ids=[c[0] for c in CASES])
def test_non_streaming(name, text, content, expected, n_warn):
    got_content, calls, warnings = parse_tool_calls(text, TOOLS)
    assert got_content == content
    assert as_pairs(calls) == expected
    assert len(warnings) == n_warn, warnings
    for i, c in enumerate(calls):
        assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"])
        assert c["index"] == i and c["type"] == "function"
        assert c["function"]["arguments"] == json.dumps(expected[i][1], ensure_ascii=False)
    assert "｜DSML｜" not in got_content


@pytest.mark.parametrize("name,text,content,expected,n_warn", CASES, ids=[c[0] for c in CASES])
def test_streaming_equals_non_streaming_at_every_boundary(name, text, content, expected, n_warn):
    reference = parse_tool_calls(text, TOOLS, id_factory=ids())
    n = len(text)
    splits = [[text[:i], text[i:]] for i in range(n + 1)]
    splits.append(list(text))
    if n <= 30:
        splits += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(n + 1), 2)]
    rng = random.Random(n)
    for _ in range(40):
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 10))))
        splits.append([text[i:j] for i, j in zip([0] + cuts, cuts + [n])])
    for chunks in splits:
        got_content, calls, warnings, content_deltas = run_stream(chunks)
        assert (got_content, calls, warnings) == reference, chunks
        for d in content_deltas:  # never a piece of DSML markup in content, partial or whole
            assert "<｜" not in d or "<｜DSML" not in text


def test_streaming_one_entry_per_call():
    """Issue 49: a call used to stream as two entries of the same index in one delta (the name with
    empty arguments, then the arguments); now each call is one entry with its whole arguments."""
    text = "Let me check.\n\n" + BLOCK(INV("search", P("query", "q", True), P("limit", "3", False)), W_BEIJING)
    p = ToolCallStreamParser(TOOLS)
    head = p.feed(text[:20])
    assert head.content == "Let me check." and head.calls == []
    rest = p.feed(text[20:])
    tail = p.finish()
    assert rest.content == "" and not tail
    deltas = rest.calls
    assert [d["index"] for d in deltas] == [0, 1]
    assert deltas[0]["function"] == {"name": "search", "arguments": '{"query": "q", "limit": 3}'}
    assert deltas[1]["function"] == {"name": "get_weather", "arguments": '{"location": "Beijing"}'}
    assert deltas[0]["id"] != deltas[1]["id"] and all(d["type"] == "function" for d in deltas)
    assert p.has_calls and [c["function"]["name"] for c in p.calls] == ["search", "get_weather"]


def test_each_invoke_is_emitted_when_it_closes():
    p = ToolCallStreamParser(TOOLS)
    first = "<｜DSML｜ calls>\n" + W_BEIJING
    assert p.feed(first[:-3]).calls == []
    assert [d["index"] for d in p.feed(first[-3:]).calls] == [0]


def test_content_held_only_while_it_may_be_markup():
    p = ToolCallStreamParser(TOOLS)
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" <").content == ""  # ' ' and '<' may precede a block
    assert p.feed("b>").content == " <b>"
    assert p.feed("\n\n<｜").content == ""
    d = p.feed("DSML｜ calls>")
    assert d.content == "" and p.finish().content == ""


def test_without_tools_any_name_is_accepted():
    content, calls, warnings = parse_tool_calls(BLOCK(INV("anything", P("x", "1", False))), None)
    assert as_pairs(calls) == [("anything", {"x": 1})] and not warnings


def test_new_call_id_format():
    ids_ = {new_call_id() for _ in range(100)}
    assert len(ids_) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids_)


def test_strip_dsml():
    assert strip_dsml("Answer.\n\n" + BLOCK(W_BEIJING)) == "Answer."
    assert strip_dsml("plain") == "plain"


# ------------------------------------------------------------------------------- round trips

ROUND_TRIP_CALLS = [
    ("get_weather", {"location": "São Paulo", "unit": "c"}),
    ("search", {"query": " padded\nmulti-line ", "limit": 10, "filters": {"a": [1, 2.5, None, True], "b": "ü"},
                "ratio": 3.0}),
    ("now", {}),
    ("search", {"query": "", "ratio": 1e-06}),
]


def test_render_then_parse_round_trips():
    text = "Preface text.\n\n" + render_calls_block(ROUND_TRIP_CALLS)
    content, calls, warnings = parse_tool_calls(text, TOOLS)
    assert content == "Preface text." and not warnings
    assert as_pairs(calls) == ROUND_TRIP_CALLS
    # parsed calls render back to the same markup
    assert render_calls_block(calls) == render_calls_block(ROUND_TRIP_CALLS)


def test_parsed_calls_feed_back_into_history_byte_exact():
    model_output = "Let me check.\n\n" + render_calls_block(ROUND_TRIP_CALLS)
    content, calls, _ = parse_tool_calls(model_output, TOOLS)
    prompt = encode_messages([{"role": "user", "content": "q"},
                              {"role": "assistant", "content": content, "tool_calls": calls}], tools=TOOLS)
    assert model_output + "<｜end▁of▁sentence｜>" in prompt


def test_render_invoke_forms():
    assert render_invoke("now", {}) == '<｜DSML｜ invoke name="now">\n\n</｜DSML｜ invoke>'
    assert render_invoke("f", {"s": "x", "n": 1}) == (
        '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="s" string="true">x</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="n" string="false">1</｜DSML｜ parameter>\n</｜DSML｜ invoke>')
    with pytest.raises(ValueError):
        render_calls_block([("f", "[1]")])


# ------------------------------------------------------------------------ request validation

def test_validate_tools_orders_keys():
    fns = validate_tools([{"type": "function", "function": {"strict": True, "parameters": {"type": "object"},
                                                           "description": "d", "name": "f"}}])
    assert list(fns[0]) == ["name", "description", "parameters", "strict"]
    assert validate_tools(None) == []


def test_validate_arguments():
    schema = TOOLS[0]["function"]["parameters"]
    assert validate_arguments({"location": "x"}, schema) is None
    assert validate_arguments({"unit": "c"}, schema)
    assert validate_arguments({"location": 3}, schema)
    assert validate_arguments({"anything": 1}, None) is None


def test_argument_and_schema_validation():
    """Arguments and tools' schemas are checked by jsonschema (the dependency; no hand-written
    fallback beside it)."""
    from dsv41_jax.chat_format import dsml as T
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}, "s": {"type": "string",
              "enum": ["a", "b"]}, "l": {"type": "array", "items": {"type": "number"}}},
              "required": ["n"], "additionalProperties": False}
    assert T.validate_arguments({"n": 2, "s": "a", "l": [1, 2.5]}, schema) is None
    for bad in ({"s": "a"}, {"n": 0}, {"n": 1.5}, {"n": True}, {"n": 1, "s": "c"}, {"n": 1, "x": 1},
                {"n": 1, "l": ["x"]}):
        assert T.validate_arguments(bad, schema), bad
    assert T._check_schema({"type": "object"}) is None
    for bad in ({"type": "objekt"}, {"type": "object", "required": "x"}, {"properties": {"a": 3}},
                {"anyOf": []}, {"items": {"type": 1}}, {"minLength": -1}, {"pattern": "("}, []):
        assert T._check_schema(bad), bad
    assert T.validate_arguments({"a": 1}, {"type": "object", "properties": {"a": False}})
    _, calls, warnings = parse_tool_calls(BLOCK(INV("search", P("query", "x", True), P("limit", "0", False)),
                                                  W_BEIJING), TOOLS)
    assert as_pairs(calls) == [("get_weather", {"location": "Beijing"})] and len(warnings) == 1


def test_tool_choice():
    assert normalize_tool_choice(None, TOOLS) == "auto"
    assert normalize_tool_choice(None, None) == "none"
    assert normalize_tool_choice("required", TOOLS) == "required"
    assert normalize_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS) == {
        "type": "function", "function": {"name": "now"}}
    for bad, tools in (("required", None), ({"type": "function", "function": {"name": "x"}}, TOOLS), ("any", TOOLS)):
        with pytest.raises(ChatError) as e:
            normalize_tool_choice(bad, tools)
        assert e.value.param == "tool_choice"
    assert should_parse_tools(TOOLS, "auto") and should_parse_tools(TOOLS, "required")
    assert not should_parse_tools(TOOLS, "none") and not should_parse_tools(None, "auto")
    assert not should_parse_tools([], "auto")
