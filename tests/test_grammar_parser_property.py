"""Property: whatever a constrained-decoding grammar lets the model emit, the server's own parsers
turn into the intended result (issue 9, item 1).

No model is needed: a "random model" walks each grammar through llguidance's token masks, choosing
among the allowed tokens with a seeded ``numpy`` Generator (seeds are explicit, never ``hash()``).
To keep walks short, tokens that close something (``<``, ``"``, ``}``, ``]``, a newline, ``</think>``,
EOS) get a per-walk weight drawn from a fixed list, so some walks wander and most finish in tens of
tokens. Each walk's ids then go through exactly what a chat completion's output goes through (the engine's
detokenizer with special tokens as `reasoning.chat_text_specials` says, then the server's
``ChatChoice``: the chat output parser — reasoning parser, then the DSML tool-call parser — fed in
random chunks) and the result must be what the request forced:

* ``tool_choice`` "required": no content, no warnings, >= 1 call, each naming a tool and with
  arguments valid under its schema; named: exactly one call of that tool;
* ``response_format`` json_schema / json_object: the content is JSON valid under the schema;
* with thinking on: the same, after a reasoning part that lands in ``reasoning_content`` (every other
  walk with a ``thinking_budget``, which forces ``</think>``).

``WALKS`` walks per mode (>= 1,000, issue 9's bar) run in the default test run.
"""

import json

import jsonschema
import numpy as np
import pytest

from dsv41_jax.serving.constrained import GrammarCompiler
from dsv41_jax.serving.reasoning import ChatOutputParser, chat_text_specials
from dsv41_jax.serving.request import CompletionOutput
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.server.chat import ChatChoice
from dsv41_jax.serving.tokenizer import IncrementalDetokenizer, load_tokenizer

V = 320  # the tiny model's logits width
WALKS = 1000
BOOSTS = (8.0, 30.0, 300.0)  # weight of the closing tokens, drawn per walk

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "location": {"type": "string", "enum": ["Beijing", "Paris"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                          "unit": {"type": "string", "maxLength": 4},
                                          "note": {"type": "string"},
                                          "opts": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                                   "required": ["x"], "additionalProperties": False}},
                                          "required": ["location"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "free", "parameters": {"type": "object", "additionalProperties": True}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "q": {"type": "string", "minLength": 1},
        "filters": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "limit": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 50}, {"type": "null"}]},
        "any": {}}, "required": ["q", "limit"]}}},
]

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
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
]

MODES = ["required", "named", "json_schema", "json_object"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def gc(tok):
    return GrammarCompiler(tok, V)


@pytest.fixture(scope="module")
def server_bits(tok):
    """The closing tokens' weights and the ``</think>`` id."""
    closers = [i for i in range(V) if i < tok.vocab_size and tok.decode([i], skip_special_tokens=False)
               in ("<", '"', "}", "]", "\n")]
    closers += [tok.token_to_id("</think>")] + list(tok.eos_token_ids)
    is_closer = np.isin(np.arange(V), closers)
    return {"think_close": tok.token_to_id("</think>"),
            "weights": [np.where(is_closer, b, 1.0) for b in BOOSTS]}


def walk(c, rng, weights, eos, max_steps=4000):
    """Token ids of one walk through the constraint ``c``, ending with EOS: each step draws among
    the allowed tokens with probability proportional to ``weights`` (a step with one allowed token
    takes it without a draw)."""
    ids = []
    for _ in range(max_steps):
        m = c.allowed_mask()
        assert m is not None and m.shape == (V,)
        allowed = np.flatnonzero(m)
        assert allowed.size
        if allowed.size == 1:  # a forced token (most of the DSML markup): nothing to draw
            t = int(allowed[0])
        else:
            cdf = np.cumsum(weights[allowed])
            t = int(allowed[np.searchsorted(cdf, rng.random() * cdf[-1], side="right")])
        ids.append(t)
        if t in eos:
            assert c.is_accepting() or c.is_done()
            return ids
        assert c.accept(t), t
    pytest.fail(f"a walk did not finish in {max_steps} tokens")


def server_parse(tok, bits, ids, rng, *, thinking, tools, tool_choice):
    """A chat completion's output path on ``ids`` (EOS last), in random chunks: the engine's
    detokenizer (the stop token is not text) and the server's chat choice."""
    skip, drop = chat_text_specials(tok, thinking=thinking, tools=bool(tools))
    detok = IncrementalDetokenizer.for_params(tok, tok.encode("prompt"),
                                              SamplingParams(max_tokens=None, skip_special_tokens=skip), drop)
    ch = ChatChoice(0, ChatOutputParser(thinking, tools, tool_choice), bits["think_close"], thinking)
    i = 0
    while i < len(ids):
        k = int(rng.integers(1, 6))
        chunk = ids[i:i + k]
        i += k
        last = i >= len(ids)
        text = detok.add(chunk[:-1]) + detok.finish() if last else detok.add(chunk)
        ch.add(CompletionOutput(0, text, chunk, finish_reason="stop" if last else None,
                                stop_reason=ids[-1] if last else None))
    assert ch.done
    return ch, drop


def request_for(mode, k):
    """(request body, tools, tool_choice, what to check) of walk ``k`` of ``mode``."""
    if mode == "required":
        return {}, TOOLS, "required", None
    if mode == "named":
        name = TOOLS[k % len(TOOLS)]["function"]["name"]
        return {}, TOOLS, {"type": "function", "function": {"name": name}}, name
    if mode == "json_schema":
        schema = SCHEMAS[k % len(SCHEMAS)]
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, \
            None, None, schema
    return {"response_format": {"type": "json_object"}}, None, None, {"type": "object"}


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
@pytest.mark.parametrize("mode", MODES)
def test_every_walk_parses_into_the_forced_result(gc, tok, server_bits, mode, thinking):
    seed = MODES.index(mode) * 2 + int(thinking)  # explicit, per mode
    rng = np.random.default_rng(seed)
    eos = set(tok.eos_token_ids)
    validators = {t["function"]["name"]: jsonschema.Draft202012Validator(t["function"]["parameters"]) for t in TOOLS}
    n_reasoning = 0
    templates = {}
    for k in range(WALKS):
        body, tools, tool_choice, want = request_for(mode, k)
        # with thinking, every other walk caps the reasoning (thinking_budget: then </think> is forced)
        budget = (k // 2) % 5 if thinking and k % 2 else None
        key = json.dumps([body, tool_choice, budget])
        if key not in templates:  # one compiled matcher per request shape; each walk forks it
            templates[key] = gc.for_request(body, tools=tools, tool_choice=tool_choice, thinking=thinking,
                                            thinking_budget=budget)
        c = templates[key].fork()
        ids = walk(c, rng, server_bits["weights"][int(rng.integers(len(BOOSTS)))], eos)
        ch, drop = server_parse(tok, server_bits, ids, rng, thinking=thinking, tools=tools, tool_choice=tool_choice)
        p = ch.parser
        where = f"walk {k} (seed {seed}): {tok.decode(ids, skip_special_tokens=False)!r}"
        if thinking:
            # the reasoning is everything before </think>, and only that
            close = ids.index(server_bits["think_close"])
            n_reasoning += close > 0
            assert ch.reasoning_tokens == close and (budget is None or close <= budget), where
            want_reasoning = tok.decode([t for t in ids[:close] if t not in drop], skip_special_tokens=False)
            if want_reasoning.startswith("<think>"):  # a repeated opening tag is dropped
                want_reasoning = want_reasoning[len("<think>"):]
            assert ch.reasoning == want_reasoning, where
        else:
            assert ch.reasoning == "" and ch.reasoning_tokens == 0, where
        if mode in ("required", "named"):
            assert ch.content == "" and not p.warnings and p.tool_calls, (where, ch.content, p.warnings)
            assert p.finish_reason("stop") == "tool_calls"
            names = [x["function"]["name"] for x in p.tool_calls]
            if want is not None:
                assert names == [want], where
            for x in p.tool_calls:
                errs = list(validators[x["function"]["name"]].iter_errors(json.loads(x["function"]["arguments"])))
                assert not errs, (where, errs[0].message)
        else:
            assert not p.tool_calls
            jsonschema.validate(json.loads(ch.content), want)
    if thinking:
        assert n_reasoning > WALKS // 2  # the walks did reason before answering


# ------------------------------------------------------------------ the disagreements found (issue 9)


def test_long_names_fit_the_parsers_tags(gc, tok, server_bits):
    """A tool or parameter name long enough to make a tag over 512 characters: the grammar forces
    it, so the parser's tag limit must admit it (it used to cut such a tag off as junk and drop the
    invoke: "unexpected markup '<｜DSML｜' inside an invoke")."""
    long_tool, long_param = "t" * 520, "p" * 530
    tools = [{"type": "function", "function": {"name": long_tool, "parameters": {
        "type": "object", "properties": {long_param: {"type": "string", "maxLength": 3}}, "required": [long_param]}}}]
    rng = np.random.default_rng(11)
    eos = set(tok.eos_token_ids)
    for choice in ("required", {"type": "function", "function": {"name": long_tool}}):
        for _ in range(3):
            c = gc.for_request({}, tools=tools, tool_choice=choice)
            ids = walk(c, rng, server_bits["weights"][-1], eos, max_steps=50000)
            ch, _ = server_parse(tok, server_bits, ids, rng, thinking=False, tools=tools, tool_choice=choice)
            assert not ch.parser.warnings and ch.content == ""
            assert ch.parser.tool_calls and ch.finish_reason == "stop"
            for x in ch.parser.tool_calls:  # required may call it several times
                assert x["function"]["name"] == long_tool
                assert list(json.loads(x["function"]["arguments"])) == [long_param]


def test_free_form_parameter_names_are_bounded(gc, tok):
    """A tool without declared properties takes any parameter name, up to FREE_NAME_MAX characters
    (an unbounded name made tags the parser could not read)."""
    from dsv41_jax.serving.constrained import FREE_NAME_MAX

    tools = [{"type": "function", "function": {"name": "free", "parameters": {"type": "object",
                                                                               "additionalProperties": True}}}]
    head = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="free">\n<｜DSML｜ parameter name="'
    for n, ok in ((FREE_NAME_MAX, True), (FREE_NAME_MAX + 1, False)):
        c = gc.for_request({}, tools=tools, tool_choice="required")
        ids = tok.encode(head + "a" * n + '" string="true">')
        assert all(c.accept(t) for t in ids) is ok


def test_names_are_written_verbatim_and_unwritable_names_refused(gc, tok):
    """DSML attributes have no escaping: a backslash in a name is written as is (the encoder's
    spelling), and a name with a quote, '<', '>' or a line break is a 400 under tool_choice
    required / named instead of a grammar whose output can never be parsed back."""
    from dsv41_jax.chat_format.encoding import ChatError
    from dsv41_jax.chat_format.dsml import render_calls_block
    from dsv41_jax.serving.tools import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "a\\b", "parameters": {
        "type": "object", "properties": {"c\\d": {"enum": [1]}}, "required": ["c\\d"]}}}]
    c = gc.for_request({}, tools=tools, tool_choice="required")
    text = render_calls_block([("a\\b", {"c\\d": 1})])
    assert all(c.accept(t) for t in tok.encode(text)) and c.is_done()
    _, calls, warnings = parse_tool_calls(text, tools)
    assert not warnings and json.loads(calls[0]["function"]["arguments"]) == {"c\\d": 1}
    for bad in ('say "hi"', "a<b", "a>b", "two\nlines"):
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {bad: {"type": "integer"}}}}}]
        with pytest.raises(ChatError) as e:
            gc.for_request({}, tools=tools, tool_choice="required")
        assert e.value.param == "tool_choice" and "cannot be written" in str(e.value)
