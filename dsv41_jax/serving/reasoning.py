"""The ``deepseek-v41`` reasoning parser (docs/design/spec.md §10, "Reasoning parser").

With thinking on, the output starts inside reasoning (the prompt ends with ``<think>``):

* text before the first ``</think>`` -> ``reasoning_content``; the rest -> ``content``;
* a line-initial ``<｜DSML｜ calls>`` (at the start of the output or right after ``\\n``) inside
  reasoning closes it implicitly: the block and everything after it go to content, where the
  tool-call parser finds it (the unspaced V4 ``<｜DSML｜tool_calls>`` is accepted too);
* no close at all (e.g. a length stop) -> everything is reasoning, and a dangling partial marker
  at the very end (a prefix of ``</think>`` or of the block marker) is dropped;
* a ``<think>`` the model repeats at the very start of its output is dropped.

With thinking off everything is content. Both parts are passed on verbatim (nothing stripped).
:class:`ReasoningParser` streams: reasoning deltas go out as they arrive, holding back only what
may be the start of a marker. :func:`split_reasoning` is the same machine fed the whole text, so
streaming and non-streaming agree for every chunking.

:class:`ChatOutputParser` / :func:`parse_chat_output` chain this parser with the ``deepseekv41``
tool-call parser (:mod:`dsv41_jax.serving.tools`) the way a chat completion needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dsv41_jax.chat_format.dsml import DSML, new_call_id, should_parse_tools

from .tools import ToolCallStreamParser

__all__ = [
    "ChatOutputParser",
    "chat_text_specials",
    "OutputDelta",
    "ReasoningParser",
    "parse_chat_output",
    "split_reasoning",
    "THINK_OPEN",
    "THINK_CLOSE",
    "IMPLICIT_CLOSE_MARKERS",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
IMPLICIT_CLOSE_MARKERS = ("<｜DSML｜ calls>", "<｜DSML｜tool_calls>")


class ReasoningParser:
    """Streaming split of generated text into (reasoning, content) deltas.

    ``feed(delta) -> (reasoning_delta, content_delta)``; ``finish() -> (reasoning, content)``
    flushes what was held back. ``in_reasoning`` tells whether the stream is still inside the
    reasoning part (the server can count ``reasoning_tokens`` with it).
    """

    def __init__(self, thinking: bool):
        self.thinking = bool(thinking)
        self._in_reasoning = self.thinking
        self._buf = ""
        self._at_start = True  # nothing consumed yet (a leading <think> is dropped)
        self._line_start = True  # the next character starts a line
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not self._in_reasoning:
            return "", text
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        self._finished = True
        if not self._in_reasoning:
            return "", ""
        return self._scan(final=True)

    # -- internals
    def _scan(self, final: bool) -> tuple[str, str]:
        buf = self._buf
        if self._at_start:
            if buf.startswith(THINK_OPEN):
                buf = buf[len(THINK_OPEN):]
                self._at_start = False
            elif THINK_OPEN.startswith(buf):
                self._buf = "" if final else buf
                return "", ""  # could still be a repeated <think> (dropped if it dangles)
            else:
                self._at_start = False
        # the earliest close: </think> anywhere, or a block marker at a line start
        best = None  # (position, marker length, keep marker in content)
        i = buf.find(THINK_CLOSE)
        if i >= 0:
            best = (i, len(THINK_CLOSE), False)
        for m in IMPLICIT_CLOSE_MARKERS:
            j = buf.find(m)
            while j >= 0 and not (j == 0 and self._line_start or j > 0 and buf[j - 1] == "\n"):
                j = buf.find(m, j + 1)
            if j >= 0 and (best is None or j < best[0]):
                best = (j, len(m), True)
        if best is not None:
            pos, n, keep = best
            reasoning = buf[:pos]
            content = buf[pos:] if keep else buf[pos + n:]
            self._in_reasoning = False
            self._buf = ""
            return reasoning, content
        hold = self._held(buf)  # at the end (final) a dangling partial marker is dropped
        emit, self._buf = buf[: len(buf) - hold], ("" if final else buf[len(buf) - hold:])
        if emit:
            self._line_start = emit.endswith("\n")
        return emit, ""

    def _held(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that may start a closing marker."""
        best = 0
        for k in range(min(len(THINK_CLOSE) - 1, len(buf)), 0, -1):
            if buf.endswith(THINK_CLOSE[:k]):
                best = k
                break
        for m in IMPLICIT_CLOSE_MARKERS:
            for k in range(min(len(m) - 1, len(buf)), best, -1):
                if buf.endswith(m[:k]):
                    start = len(buf) - k
                    if (start == 0 and self._line_start) or (start > 0 and buf[start - 1] == "\n"):
                        best = k
                    break
        return best


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """Non-streaming split: ``(reasoning_content, content)`` ("" when absent)."""
    p = ReasoningParser(thinking)
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return r1 + r2, c1 + c2


# ------------------------------------------------------------------ reasoning + tools, chained


@dataclass
class OutputDelta:
    """One step of :class:`ChatOutputParser`: deltas for ``reasoning_content``, ``content`` and
    OpenAI streaming ``tool_calls`` (see :class:`dsv41_jax.serving.tools.ToolCallStreamParser`)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """The chat-completion output pipeline: reasoning parser, then the tool-call parser on the
    content (docs/design/spec.md §10).

    * ``thinking``: the request's resolved thinking switch; ``reasoning_parser=False`` (no
      ``--reasoning-parser``) puts everything into content.
    * Tools are parsed only when ``tools`` are given and ``tool_choice`` is not "none"; with tools
      and tool_choice "none" DSML is only stripped from content; without tools content passes
      through untouched. ``tool_parser=False`` (no ``--tool-call-parser``) disables both.
    * After ``finish()``: ``tool_calls`` (non-streaming shape), ``warnings`` and ``finish_reason(
      default)`` ("tool_calls" when a call was emitted, else ``default``).
    """

    def __init__(
        self,
        thinking: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None,
        *,
        reasoning_parser: bool = True,
        tool_parser: bool = True,
        id_factory: Callable[[], str] = new_call_id,
    ):
        self._reasoning = ReasoningParser(bool(thinking) and reasoning_parser)
        self._tools: ToolCallStreamParser | None = None
        if tool_parser and tools:
            emit = should_parse_tools(tools, tool_choice)
            self._tools = ToolCallStreamParser(tools, id_factory=id_factory, emit_calls=emit)

    @property
    def in_reasoning(self) -> bool:
        return self._reasoning.in_reasoning

    @property
    def tool_calls(self) -> list[dict]:
        return list(self._tools.calls) if self._tools else []

    @property
    def warnings(self) -> list[str]:
        return list(self._tools.warnings) if self._tools else []

    def finish_reason(self, default: str) -> str:
        return "tool_calls" if self.tool_calls else default

    def _content(self, text: str, out: OutputDelta, final: bool) -> None:
        if self._tools is None:
            out.content += text
            return
        d = self._tools.feed(text) if text else None
        if d is not None:
            out.content += d.content
            out.tool_calls += d.calls
        if final:
            d = self._tools.finish()
            out.content += d.content
            out.tool_calls += d.calls

    def feed(self, text: str) -> OutputDelta:
        out = OutputDelta()
        r, c = self._reasoning.feed(text)
        out.reasoning = r
        self._content(c, out, final=False)
        return out

    def finish(self) -> OutputDelta:
        out = OutputDelta()
        r, c = self._reasoning.finish()
        out.reasoning = r
        self._content(c, out, final=True)
        return out


def parse_chat_output(
    text: str,
    thinking: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    **kw: Any,
) -> tuple[str, str, list[dict], list[str]]:
    """Non-streaming :class:`ChatOutputParser`: ``(reasoning, content, tool_calls, warnings)``."""
    p = ChatOutputParser(thinking, tools, tool_choice, **kw)
    a, b = p.feed(text), p.finish()
    return a.reasoning + b.reasoning, a.content + b.content, p.tool_calls, p.warnings


def chat_text_specials(tokenizer: Any, *, thinking: bool, tools: bool) -> tuple[bool, frozenset]:
    """How a chat completion's text treats special tokens: ``(skip_special_tokens, drop_token_ids)``
    for its detokenizer (the server and `LLM.chat` alike).

    The parsers need some special tokens as text (docs/design/spec.md §10): ``｜DSML｜`` while tools
    are given (else the calls markup vanishes and can neither be parsed nor stripped), ``<think>`` /
    ``</think>`` while thinking (``</think>`` splits reasoning from content). With either, special
    tokens are kept except all the others, which are dropped; with neither, all are skipped. With thinking off,
    ``<think>`` / ``</think>`` are never text: the prompt already closed the reasoning (its assistant
    header ends with ``</think>``), so one the model writes is not content.
    """
    keep = ([DSML] if tools else []) + ([THINK_OPEN, THINK_CLOSE] if thinking else [])
    if not keep:
        return True, frozenset()
    kept = {tokenizer.token_to_id(s) for s in keep} - {None}
    return False, frozenset(getattr(tokenizer, "special_token_ids", ()) or ()) - kept
