"""Constrained decoding (llguidance masks) on the tiny tokenizer, without a model.

A "random model" walks each grammar: at every step it samples uniformly among the tokens the
constraint allows, so every path the grammar permits can be taken. What comes out must parse and
validate (JSON schema) or parse as the DSML tool calls the request forced (the real deepseekv41
parser on the real detokenized text).
"""

import json

import jsonschema
import numpy as np
import pytest

from dsv41_jax.chat_format.encoding import ChatError
from dsv41_jax.serving.constrained import GrammarCompiler, GrammarConstraint, tool_call_lark
from dsv41_jax.serving.tokenizer import load_tokenizer
from dsv41_jax.chat_format.dsml import render_calls_block
from dsv41_jax.serving.tools import parse_tool_calls

V = 320


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def gc(tok):
    return GrammarCompiler(tok, V)


def walk(c: GrammarConstraint, rng, max_steps=600, eos=1):
    """Sample uniformly among allowed tokens until EOS / done; returns the generated ids."""
    ids = []
    for _ in range(max_steps):
        m = c.allowed_mask()
        if m is None:
            m = np.ones(V, bool)
        assert m.shape == (V,) and m.dtype == bool and m.any()
        t = int(rng.choice(np.nonzero(m)[0]))
        if t == eos:
            assert c.is_accepting() or c.is_done()
            break
        assert c.accept(t), t
        ids.append(t)
        if c.is_done():
            break
    else:
        pytest.fail("the grammar did not finish")
    return ids


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}},
                                        "required": ["x"], "additionalProperties": False}},
     "properties": {"p": {"$ref": "#/$defs/pt"}, "kind": {"anyOf": [{"const": "x"}, {"type": "null"}]}},
     "required": ["p", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_schema_walks_validate(gc, tok, k):
    schema = SCHEMAS[k]
    rng = np.random.default_rng(k)
    for _ in range(6):
        c = gc.for_request({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
        text = tok.decode(walk(c, rng))
        jsonschema.validate(json.loads(text), schema)
        assert c.is_done() or c.is_accepting()


def test_json_style_is_the_checkpoints(gc, tok):
    """No free whitespace: the separators are ', ' and ': ' (docs/design/spec.md §10's JSON style)."""
    schema = {"type": "object", "properties": {"a": {"enum": [1]}, "b": {"enum": [2]}}, "required": ["a", "b"],
              "additionalProperties": False}
    c = gc.for_request({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    assert tok.decode(walk(c, np.random.default_rng(0))) == '{"a": 1, "b": 2}'


def test_json_object_walks_parse(gc, tok):
    rng = np.random.default_rng(7)
    n_ok = 0
    for _ in range(20):
        c = gc.for_request({"response_format": {"type": "json_object"}})
        ids = walk(c, rng, max_steps=3000)
        if c.is_done() or c.is_accepting():
            assert isinstance(json.loads(tok.decode(ids)), dict)
            n_ok += 1
    assert n_ok >= 10


def test_first_token_is_forced_to_open_the_object(gc, tok):
    c = gc.for_request({"response_format": {"type": "json_object"}})
    m = c.allowed_mask()
    assert {tok.decode([i]) for i in np.nonzero(m)[0]} <= {"{", "{\"", " {"} and m.sum() >= 1
    assert not m[1]  # EOS not allowed before the object


def test_bad_schema_is_a_400(gc):
    with pytest.raises(ChatError) as e:
        gc.for_request({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(ChatError) as e:
        gc.for_request({"response_format": {"type": "yaml"}})
    assert e.value.param == "response_format.type"
    assert gc.for_request({"response_format": {"type": "text"}}) is None
    assert gc.for_request({}) is None


def test_regex(gc, tok):
    rng = np.random.default_rng(3)
    for _ in range(5):
        c = gc.for_request({"regex": "(yes|no) [0-9]{2}"})
        text = tok.decode(walk(c, rng))
        assert text[:3] in ("yes", "no ") and text[-2:].isdigit()


# ------------------------------------------------------------------------------------- tools

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "location": {"type": "string", "enum": ["Beijing", "Paris"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                          "unit": {"type": "string", "maxLength": 4},
                                          "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                   "required": ["x"], "additionalProperties": False}},
                                          "required": ["location"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object", "additionalProperties": True}}},
]


def accept_all(c, ids):
    for t in ids:
        m = c.allowed_mask()
        assert m is None or m[t], t
        assert c.accept(t)


@pytest.mark.parametrize("args", [
    {"location": "Beijing"},
    {"location": "Paris", "days": 3},
    {"location": "Paris", "unit": "C", "opts": {"x": True}},
    {"location": "Beijing", "days": 7, "unit": "F", "opts": {"x": False}},
])
def test_encoder_rendering_is_in_the_tool_grammar(gc, tok, args):
    """What the chat encoder renders for history calls is exactly what the grammar accepts."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        c = gc.for_request({}, tools=TOOLS, tool_choice=choice)
        ids = tok.encode("\n\n" + render_calls_block([("get_weather", args)]))
        accept_all(c, ids)
        assert c.is_done()
        assert c.allowed_mask().tolist() == [t == 1 for t in range(V)]  # only EOS now


def test_several_invokes_and_zero_arg_invokes(gc, tok):
    calls = [("ping", {}), ("get_weather", {"location": "Paris"}), ("free", {"q": "x y", "n": [1, 2]})]
    c = gc.for_request({}, tools=TOOLS, tool_choice="required")
    accept_all(c, tok.encode(render_calls_block(calls)))
    assert c.is_done()
    # named: exactly one invoke of that tool, no other name
    c = gc.for_request({}, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    prefix = tok.encode("\n\n" + render_calls_block([("ping", {})]).split("ping")[0])
    accept_all(c, prefix)
    allowed = [tok.decode([i]) for i in np.nonzero(c.allowed_mask())[0]]
    assert all("ping".startswith(a) for a in allowed) and allowed


@pytest.mark.parametrize("choice", ["required", "get_weather", "ping"])
def test_tool_walks_parse_into_valid_calls(gc, tok, choice):
    rng = np.random.default_rng(["required", "get_weather", "ping"].index(choice))  # explicit, not hash()
    tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for _ in range(8):
        c = gc.for_request({}, tools=TOOLS, tool_choice=tc)
        ids = walk(c, rng, max_steps=2000)
        assert c.is_done()
        text = tok.decode(ids, skip_special_tokens=False)
        content, calls, warnings = parse_tool_calls(text, TOOLS)
        assert content == "" and not warnings and calls, text
        if choice != "required":
            assert [x["function"]["name"] for x in calls] == [choice]
        for x in calls:
            args = json.loads(x["function"]["arguments"])
            if x["function"]["name"] == "get_weather":
                jsonschema.validate(args, TOOLS[0]["function"]["parameters"])


def test_tool_grammar_text(gc):
    lark = tool_call_lark(TOOLS[:1], {"type": "function", "function": {"name": "get_weather"}}, dsml_id=318)
    assert "<[318]>" in lark and '" calls>"' in lark and "%json" in lark
    with pytest.raises(ChatError):
        tool_call_lark(TOOLS, {"type": "function", "function": {"name": "nope"}}, dsml_id=318)


# ------------------------------------------------------------------------------ the object


def test_thinking_gate(gc, tok):
    c = gc.for_request({"response_format": {"type": "json_object"}}, thinking=True)
    for t in tok.encode("some reasoning {not json"):
        m = c.allowed_mask()
        # anything but EOS (the JSON must come) and the DSML token (markup would end the reasoning)
        assert not m[1] and not m[gc.dsml_id] and m.sum() == V - 2 and c.accept(t)
    assert not c.active and not c.is_done()
    assert c.accept(gc.think_close_id)
    m = c.allowed_mask()
    assert m is not None and not m[1] and c.active


def test_thinking_budget(gc, tok):
    # budget only: free for 3 tokens, then </think> is forced, then free again
    c = gc.for_request({}, thinking=True, thinking_budget=3)
    for t in tok.encode("abc"):
        assert c.allowed_mask() is None
        c.accept(t)
    m = c.allowed_mask()
    assert m.sum() == 1 and m[gc.think_close_id]
    c.accept(gc.think_close_id)
    assert c.allowed_mask() is None and not c.is_done() and c.is_accepting()
    d = c.clone()
    c.rollback(2)
    assert c.allowed_mask() is None and d.allowed_mask() is None
    # with a grammar: reasoning, forced close, then JSON
    c = gc.for_request({"response_format": {"type": "json_object"}}, thinking=True, thinking_budget=0)
    assert c.allowed_mask().tolist() == [t == gc.think_close_id for t in range(V)]
    c.accept(gc.think_close_id)
    assert not c.allowed_mask()[1] and c.allowed_mask().any()
    assert gc.for_request({}, thinking=False, thinking_budget=3) is None
    assert gc.for_request({}, thinking=True) is None


def test_fork_rollback_bitmask(gc, tok):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"],
              "additionalProperties": False}
    c = gc.for_request({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})
    ids = tok.encode('{"a": "')
    accept_all(c, ids)
    d = c.clone()
    accept_all(d, tok.encode('yy"}'))
    assert d.is_done() and not c.is_done()
    m = c.allowed_mask()
    bm = c.bitmask()
    assert bm.dtype == np.int32 and bm.shape == ((V + 31) // 32,)
    unpacked = np.unpackbits(bm.view(np.uint8), bitorder="little")[:V].astype(bool)
    assert (unpacked == m).all()
    accept_all(c, tok.encode("x"))
    c.rollback(1)
    assert (c.allowed_mask() == m).all()


def test_wider_model_vocab_and_disallowed_token(tok):
    g = GrammarCompiler(tok, 400)
    c = g.for_request({"response_format": {"type": "json_object"}})
    m = c.allowed_mask()
    assert m.shape == (400,) and not m[320:].any()
    bad = int(np.nonzero(~m[:320])[0][5])
    assert c.accept(bad) is False
    assert c.is_done() and c.allowed_mask().tolist() == [t == 1 for t in range(400)]


def test_grammar_validation_is_cached(gc):
    """A grammar is validated once; later requests with the same constraint reuse the verdict."""
    schema = {"type": "object", "properties": {"cached": {"type": "integer"}}, "required": ["cached"]}
    req = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    spec = gc.spec_for_request(req)
    assert spec.grammar not in gc._cache
    gc.for_request(req)
    assert gc._cache[spec.grammar] == ""
    n = len(gc._cache)
    for _ in range(3):
        gc.for_request(req)
    assert len(gc._cache) == n and next(reversed(gc._cache)) == spec.grammar
