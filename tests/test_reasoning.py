"""The deepseek-v41 reasoning parser (docs/design/spec.md §10): non-streaming rules, and streaming equal to
non-streaming at every chunk boundary."""

import itertools
import random

import pytest

from dsv41_jax.serving.reasoning import ReasoningParser, split_reasoning
from dsv41_jax.serving.tools import ToolCallStreamParser, parse_tool_calls

BLOCK = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
         '<｜DSML｜ parameter name="location" string="true">Beijing</｜DSML｜ parameter>\n'
         '</｜DSML｜ invoke>\n</｜DSML｜ calls>')

# (text, thinking, expected reasoning, expected content)
CASES = [
    ("15% of 240: 0.15*240 = 36.</think>The answer is **36**.", True,
     "15% of 240: 0.15*240 = 36.", "The answer is **36**."),
    ("\nfirst line\n</think>\n\nAnswer", True, "\nfirst line\n", "\n\nAnswer"),
    ("</think>direct", True, "", "direct"),
    ("no close at all, length stop mid-marker </thi", True, "no close at all, length stop mid-marker ", ""),
    ("dangling lone <", True, "dangling lone ", ""),
    ("ends cleanly", True, "ends cleanly", ""),
    ("a < b and <th not a marker", True, "a < b and <th not a marker", ""),
    ("I need the weather.\n\n" + BLOCK, True, "I need the weather.\n\n", BLOCK),
    (BLOCK, True, "", BLOCK),
    ("I need it.\n<｜DSML｜tool_calls>\n...", True, "I need it.\n", "<｜DSML｜tool_calls>\n..."),
    ("not line-initial <｜DSML｜ calls> stays</think>ok", True, "not line-initial <｜DSML｜ calls> stays", "ok"),
    ("think\n<｜DSML｜ cal", True, "think\n", ""),
    ("<think>repeated open</think>x", True, "repeated open", "x"),
    ("<thi", True, "", ""),
    ("<thinking is a word>? </think>y", True, "<thinking is a word>? ", "y"),
    ("one</think>two</think>three", True, "one", "two</think>three"),
    ("r</think>" + "c\n\n" + BLOCK, True, "r", "c\n\n" + BLOCK),
    ("Everything</think> is content", False, "", "Everything</think> is content"),
    ("I need the weather.\n\n" + BLOCK, False, "", "I need the weather.\n\n" + BLOCK),
    ("", True, "", ""),
    ("", False, "", ""),
]


def stream(chunks, thinking):
    p = ReasoningParser(thinking)
    rs, cs = [], []
    for c in chunks:
        r, t = p.feed(c)
        rs.append(r)
        cs.append(t)
    r, t = p.finish()
    rs.append(r)
    cs.append(t)
    return "".join(rs), "".join(cs), rs, cs


@pytest.mark.parametrize("text,thinking,reasoning,content", CASES)
def test_non_streaming(text, thinking, reasoning, content):
    assert split_reasoning(text, thinking) == (reasoning, content)


@pytest.mark.parametrize("text,thinking,reasoning,content", CASES)
def test_streaming_equals_non_streaming_at_every_boundary(text, thinking, reasoning, content):
    n = len(text)
    splits = [[text[:i], text[i:]] for i in range(n + 1)]
    splits.append(list(text))  # one character at a time
    if n <= 40:
        splits += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(n + 1), 2)]
    rng = random.Random(n)
    for _ in range(50):
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 8))))
        splits.append([text[i:j] for i, j in zip([0] + cuts, cuts + [n])])
    for chunks in splits:
        r, c, _, _ = stream(chunks, thinking)
        assert (r, c) == (reasoning, content), chunks


def test_reasoning_streams_as_it_arrives():
    p = ReasoningParser(True)
    assert p.feed("Hello wor") == ("Hello wor", "")
    assert p.feed("ld </th") == ("ld ", "")  # only the possible marker is held
    assert p.in_reasoning
    assert p.feed("ink>Ans") == ("", "Ans")
    assert not p.in_reasoning
    assert p.feed("wer") == ("", "wer")
    assert p.finish() == ("", "")
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_thinking_off_passes_through():
    p = ReasoningParser(False)
    assert not p.in_reasoning
    assert p.feed("<think>a</think>") == ("", "<think>a</think>")
    assert p.finish() == ("", "")


def test_line_initial_block_closes_reasoning_and_reaches_the_tool_parser():
    """Reasoning parser then tool parser, streamed at every boundary, as the server chains them."""
    text = "Weather needs a tool.\n\n" + BLOCK
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
    for i in range(len(text) + 1):
        rp = ReasoningParser(True)
        tp = ToolCallStreamParser(tools, id_factory=lambda: "call_" + "0" * 24)
        reasoning, content, calls = "", "", []
        for chunk in (text[:i], text[i:], None):
            r, c = rp.feed(chunk) if chunk is not None else rp.finish()
            reasoning += r
            d = tp.feed(c)
            content += d.content
            calls += d.calls
        d = tp.finish()
        content += d.content
        calls += d.calls
        assert reasoning == "Weather needs a tool.\n\n"
        assert content == ""
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(x["function"].get("arguments", "") for x in calls) == '{"location": "Beijing"}'
    _, parsed, _ = parse_tool_calls(split_reasoning(text, True)[1], tools)
    assert [c["function"]["name"] for c in parsed] == ["get_weather"]


# ------------------------------------------------------------------- the chained output parser

from dsv41_jax.serving.reasoning import ChatOutputParser, parse_chat_output  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]

OUTPUTS = [
    # (text, thinking, tools, tool_choice, reasoning, content, [names], finish_reason)
    ("Think.</think>Let me look.\n\n" + BLOCK, True, TOOLS, "auto", "Think.", "Let me look.", ["get_weather"],
     "tool_calls"),
    ("Think.\n\n" + BLOCK, True, TOOLS, "auto", "Think.\n\n", "", ["get_weather"], "tool_calls"),
    ("Plain answer.", True, TOOLS, "auto", "Plain answer.", "", [], "stop"),
    ("r</think>Answer.\n\n" + BLOCK, True, TOOLS, "none", "r", "Answer.", [], "stop"),
    ("Answer.\n\n" + BLOCK, False, None, None, "", "Answer.\n\n" + BLOCK, [], "stop"),
    ("Answer.\n\n" + BLOCK, False, TOOLS, "required", "", "Answer.", ["get_weather"], "tool_calls"),
]


def _stream_output(chunks, thinking, tools, tool_choice):
    p = ChatOutputParser(thinking, tools, tool_choice, id_factory=lambda: "call_" + "a" * 24)
    r = c = ""
    names = []
    for ch in list(chunks) + [None]:
        d = p.feed(ch) if ch is not None else p.finish()
        r += d.reasoning
        c += d.content
        names += [x["function"]["name"] for x in d.tool_calls if "name" in x["function"]]
    return r, c, names, p.finish_reason("stop")


@pytest.mark.parametrize("text,thinking,tools,tool_choice,reasoning,content,names,finish", OUTPUTS)
def test_chat_output_parser(text, thinking, tools, tool_choice, reasoning, content, names, finish):
    r, c, calls, _ = parse_chat_output(text, thinking, tools, tool_choice)
    assert (r, c, [x["function"]["name"] for x in calls]) == (reasoning, content, names)
    for i in range(len(text) + 1):
        assert _stream_output([text[:i], text[i:]], thinking, tools, tool_choice) == (reasoning, content, names, finish)
    assert _stream_output(list(text), thinking, tools, tool_choice) == (reasoning, content, names, finish)


def test_chat_output_parser_without_parsers():
    text = "Think.</think>Answer.\n\n" + BLOCK
    r, c, calls, _ = parse_chat_output(text, True, TOOLS, "auto", reasoning_parser=False, tool_parser=False)
    assert (r, c, calls) == ("", text, [])
