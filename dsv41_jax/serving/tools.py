"""The ``deepseekv41`` tool-call parser (docs/design/spec.md §10, "Tool-call parser"): model
output -> OpenAI tool calls.

:func:`parse_tool_calls` (non-streaming) and :class:`ToolCallStreamParser` (streaming): text before
the block is content, each valid invoke becomes an OpenAI tool call (``id`` "call_" + 24 hex,
``type`` "function", ``arguments`` a JSON string). The markup itself, its rendering and the request
checks (``tools`` / ``tool_choice``) are `dsv41_jax.chat_format.dsml`, shared with training.

The parser also accepts a JSON-object invoke body, a self-closing zero-argument invoke
(``<｜DSML｜ invoke name="f"/>``) and the unspaced V4 / V3.2 spellings (``<｜DSML｜tool_calls>``,
``<｜DSML｜function_calls>``, ``<｜DSML｜invoke …>``, ``<｜DSML｜parameter …>``).

Parser rules (shared by the streaming and the non-streaming form, which is the streaming parser
fed the whole text, so the two agree on every chunking):

* content is the text before the first block with its trailing blank line(s) removed; text after
  a block (leading blanks removed) is appended to content after ``"\\n\\n"``;
* an invoke is emitted only once its ``</｜DSML｜ invoke>`` has arrived and it parsed and validated:
  one delta with ``id``, ``type``, the name and the whole ``arguments`` JSON string (a call is
  complete when it is emitted, so there are no argument fragments to stream);
* an unparsable invoke (bad JSON value, unterminated, unknown tool, arguments failing the tool's
  JSON schema) is skipped with a warning; every other piece of DSML markup is dropped, never
  returned as content, and a dangling partial marker at the end of the text is dropped.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from dsv41_jax.chat_format.dsml import DSML, make_validator, new_call_id, to_json

__all__ = ["ToolCallStreamParser", "ToolStreamDelta", "max_tag_length", "parse_tool_calls", "strip_dsml"]

log = logging.getLogger(__name__)

_BLOCK_WORDS = {"calls", "tool_calls", "function_calls"}

# ------------------------------------------------------------------------------- the lexer

_MARKERS = (f"<{DSML}", f"</{DSML}", DSML)
_MAX_TAG = 512  # a tag longer than this without its '>' is junk (unless the tools need longer tags)
# the longest a tag gets beyond the names it carries: '</｜DSML｜ parameter name="' + '" string="false">'
_TAG_OVERHEAD = 64


def max_tag_length(tools: Sequence[Mapping[str, Any]] | None) -> int:
    """The tag-length limit of the lexer for ``tools``: ``_MAX_TAG``, or more when a tool's name or
    one of its top-level parameter names is long. The tool-call grammar forces exactly these names
    (a name the grammar allowed once made a tag the lexer cut off as junk), so every tag the
    grammar can produce must fit."""
    longest = 0
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        longest = max(longest, len(str(fn.get("name") or "")))
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping):
            longest = max([longest] + [len(str(k)) for k in props])
    return max(_MAX_TAG, longest + _TAG_OVERHEAD)
_TAG_RE = re.compile(r"^(</?)?" + DSML + r"\s*([A-Za-z_]+)(.*?)>$", re.S)
_ATTR_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*"([^"]*)"')


def _held_suffix(buf: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a marker."""
    best = 0
    for m in _MARKERS:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


@dataclass
class _Tag:
    raw: str
    kind: str  # "calls" | "invoke" | "parameter" | "junk"
    closing: bool = False
    self_closing: bool = False
    attrs: dict = field(default_factory=dict)


def _classify(raw: str) -> _Tag:
    m = _TAG_RE.match(raw)
    if not m:
        return _Tag(raw, "junk")
    opener, word, rest = m.group(1), m.group(2).lower(), m.group(3)
    closing = opener == "</"
    if word in _BLOCK_WORDS:
        kind = "calls"
    elif word in ("invoke", "parameter"):
        kind = word
    else:
        return _Tag(raw, "junk")
    if opener is None:  # the '<' is missing: treat as junk markup
        return _Tag(raw, "junk")
    self_closing = rest.rstrip().endswith("/")
    attrs = dict(_ATTR_RE.findall(rest))
    return _Tag(raw, kind, closing, self_closing and not closing, attrs)


class _Lexer:
    """Splits a text stream into plain text and DSML tags; holds back what may start a tag."""

    def __init__(self, max_tag: int = _MAX_TAG):
        self.buf = ""
        self.max_tag = int(max_tag)

    def feed(self, text: str, final: bool = False) -> list:
        self.buf += text
        out: list = []
        while True:
            buf = self.buf
            p = buf.find(DSML)
            if p < 0:
                if final:
                    h = _held_suffix(buf)
                    tail = buf[len(buf) - h:] if h else ""
                    if "｜" in tail:  # a dangling partial marker (not a lone '<'): dropped
                        buf = buf[: len(buf) - h]
                    if buf:
                        out.append(buf)
                    if "｜" in tail:
                        out.append(_Tag(tail, "junk"))
                    self.buf = ""
                else:
                    h = _held_suffix(buf)
                    if len(buf) > h:
                        out.append(buf[: len(buf) - h])
                    self.buf = buf[len(buf) - h:]
                return out
            start = p
            if p >= 2 and buf[p - 2:p] == "</":
                start = p - 2
            elif p >= 1 and buf[p - 1] == "<":
                start = p - 1
            if start:
                out.append(buf[:start])
            q = p + len(DSML)
            if start == p:  # a bare DSML token (no '<' before it): drop just the token
                out.append(_Tag(DSML, "junk"))
                self.buf = buf[q:]
                continue
            limit = start + self.max_tag
            end = None
            for i in range(q, min(len(buf), limit)):
                c = buf[i]
                if c == ">":
                    end = ("tag", i + 1)
                    break
                if c in "<\n" or buf.startswith(DSML, i):
                    end = ("junk", q)
                    break
            if end is None:
                if final or len(buf) >= limit:
                    end = ("junk", len(buf) if final and len(buf) < limit else q)
                else:
                    self.buf = buf[start:]
                    return out
            cut = end[1]
            tag = _classify(buf[start:cut]) if end[0] == "tag" else _Tag(buf[start:cut], "junk")
            out.append(tag)
            self.buf = buf[cut:]


# ------------------------------------------------------------------------------- the parser


@dataclass
class ToolStreamDelta:
    """What one ``feed`` / ``finish`` produced: a content delta and OpenAI tool-call deltas."""

    content: str = ""
    calls: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class _Unparsable(Exception):
    pass


class ToolCallStreamParser:
    """The ``deepseekv41`` tool-call parser, streaming.

    ``feed(delta)`` and ``finish()`` return a :class:`ToolStreamDelta`; a call is emitted when its
    invoke closes (its arguments are validated whole), as one OpenAI streaming tool-call delta
    ``{"index", "id", "type": "function", "function": {"name", "arguments"}}`` with the complete
    arguments: one entry per call, never two entries of one index in a delta (issue 49). ``warnings``
    collects the reasons invokes were skipped or markup was dropped; ``calls`` the finished calls
    (non-streaming shape). With ``emit_calls=False`` the parser only strips DSML from content.
    """

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        id_factory: Callable[[], str] = new_call_id,
        emit_calls: bool = True,
    ):
        self._lexer = _Lexer(max_tag_length(tools))
        self._id_factory = id_factory
        self._emit_calls = emit_calls
        self._check_names = tools is not None
        self._validators: dict[str, Callable[[Any], str | None]] = {}
        for t in tools or []:
            fn = t.get("function", t) if isinstance(t, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                self._validators[fn["name"]] = make_validator(fn.get("parameters"))
        self.warnings: list[str] = []
        self.calls: list[dict] = []
        self._state = "outside"  # outside | block | invoke
        self._pending_ws = ""
        self._after_block = False
        self._content_emitted = False
        self._invoke_tag: _Tag | None = None
        self._invoke_parts: list = []
        self._finished = False
        self._junk = ""
        self._markup_last = False

    # -- public
    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> ToolStreamDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._run(self._lexer.feed(text))

    def finish(self) -> ToolStreamDelta:
        if self._finished:
            return ToolStreamDelta()
        delta = self._run(self._lexer.feed("", final=True))
        self._finished = True
        self._flush_junk()
        if self._state == "invoke":
            self._warn(f"unterminated invoke {self._invoke_tag.attrs.get('name')!r} skipped")
        if self._state == "outside" and self._pending_ws and not self._after_block and not self._markup_last:
            delta.content += self._pending_ws
        self._pending_ws = ""
        return delta

    # -- internals
    def _warn(self, msg: str) -> None:
        log.warning("deepseekv41 tool parser: %s", msg)
        self.warnings.append(msg)

    def _run(self, tokens: list) -> ToolStreamDelta:
        out = ToolStreamDelta()
        for tok in tokens:
            if self._state == "outside":
                self._outside(tok, out)
            elif self._state == "block":
                self._block(tok, out)
            else:
                self._invoke(tok, out)
        return out

    def _outside(self, tok, out: ToolStreamDelta) -> None:
        if isinstance(tok, str):
            if self._after_block:
                tok = tok.lstrip()
                if not tok:
                    return
                self._after_block = False
                if self._content_emitted:
                    tok = "\n\n" + tok
            self._markup_last = False
            s = self._pending_ws + tok
            body = s.rstrip()
            self._pending_ws = s[len(body):]
            if body:
                out.content += body
                self._content_emitted = True
            return
        if tok.kind == "calls" and not tok.closing:
            self._pending_ws = ""
            self._state = "block"
        elif tok.kind == "invoke" and not tok.closing:  # an invoke without its calls wrapper
            self._pending_ws = ""
            self._state = "block"
            self._block(tok, out)
        else:
            self._warn(f"stray DSML markup {tok.raw!r} dropped")
            self._markup_last = True  # blanks before markup that ends the text are dropped

    def _flush_junk(self) -> None:
        if self._junk.strip():
            self._warn(f"text inside the calls block dropped: {self._junk.strip()[:80]!r}")
        self._junk = ""

    def _block(self, tok, out: ToolStreamDelta) -> None:
        if isinstance(tok, str):
            self._junk += tok
            return
        self._flush_junk()
        if tok.kind == "calls" and tok.closing:
            self._state = "outside"
            self._after_block = True
            self._pending_ws = ""
        elif tok.kind == "invoke" and not tok.closing:
            if tok.self_closing:
                self._finish_invoke(tok, [], out)
            else:
                self._invoke_tag = tok
                self._invoke_parts = []
                self._state = "invoke"
        elif tok.kind == "calls":
            pass  # a repeated block open
        else:
            self._warn(f"stray DSML markup {tok.raw!r} dropped")

    def _invoke(self, tok, out: ToolStreamDelta) -> None:
        if isinstance(tok, _Tag) and tok.kind == "invoke" and tok.closing:
            self._state = "block"
            self._finish_invoke(self._invoke_tag, self._invoke_parts, out)
            return
        if isinstance(tok, _Tag) and (tok.kind == "calls" or (tok.kind == "invoke" and not tok.closing)):
            self._warn(f"invoke {self._invoke_tag.attrs.get('name')!r} not closed; skipped")
            self._state = "block"
            self._block(tok, out)
            return
        self._invoke_parts.append(tok)

    def _finish_invoke(self, tag: _Tag, parts: list, out: ToolStreamDelta) -> None:
        name = tag.attrs.get("name")
        try:
            if not name:
                raise _Unparsable("invoke without a name")
            if self._check_names and name not in self._validators:
                raise _Unparsable(f"unknown tool {name!r}")
            args = _parse_invoke_body(parts)
            if self._check_names:
                err = self._validators[name](args)
                if err:
                    raise _Unparsable(f"arguments of {name!r} do not match its schema: {err}")
        except _Unparsable as e:
            self._warn(f"invoke skipped: {e}")
            return
        if not self._emit_calls:
            return
        index = len(self.calls)
        call_id = self._id_factory()
        arguments = to_json(args)
        self.calls.append({"id": call_id, "index": index, "type": "function",
                           "function": {"name": name, "arguments": arguments}})
        out.calls.append({"index": index, "id": call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}})


def _raw(tok) -> str:
    return tok if isinstance(tok, str) else tok.raw


def _merge_text(parts: list) -> list:
    out: list = []
    for t in parts:
        if isinstance(t, str) and out and isinstance(out[-1], str):
            out[-1] += t
        else:
            out.append(t)
    return out


def _parse_invoke_body(parts: list) -> dict:
    parts = _merge_text(parts)
    if not any(isinstance(t, _Tag) and t.kind == "parameter" for t in parts):
        body = "".join(_raw(t) for t in parts).strip()
        if not body:
            return {}
        if any(isinstance(t, _Tag) for t in parts):
            raise _Unparsable("stray DSML markup inside an invoke")
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            raise _Unparsable(f"invoke body is neither parameters nor a JSON object ({e.msg})") from None
        if not isinstance(value, dict):
            raise _Unparsable("a JSON invoke body must be an object")
        return value
    args: dict = {}
    i = 0
    while i < len(parts):
        t = parts[i]
        if isinstance(t, str):
            if t.strip():
                raise _Unparsable(f"unexpected text between parameters: {t.strip()[:40]!r}")
            i += 1
            continue
        if t.kind != "parameter" or t.closing:
            raise _Unparsable(f"unexpected markup {t.raw!r} inside an invoke")
        key = t.attrs.get("name")
        if key is None:
            raise _Unparsable("parameter without a name")
        is_string = t.attrs.get("string")
        j = i + 1
        raw = []
        while j < len(parts) and not (isinstance(parts[j], _Tag) and parts[j].kind == "parameter"):
            raw.append(_raw(parts[j]))
            j += 1
        if j >= len(parts) or not parts[j].closing:
            raise _Unparsable(f"parameter {key!r} not closed")
        value_text = "".join(raw)
        if is_string == "true":
            value: Any = value_text  # verbatim, not stripped
        elif is_string == "false":
            try:
                value = json.loads(value_text)
            except json.JSONDecodeError:
                raise _Unparsable(f"parameter {key!r} is string=\"false\" but not JSON: {value_text[:40]!r}") from None
        else:  # no string attribute: JSON when it parses, else the raw text
            try:
                value = json.loads(value_text)
            except json.JSONDecodeError:
                value = value_text
        args[key] = value
        i = j + 1
    return args


def parse_tool_calls(
    text: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    id_factory: Callable[[], str] = new_call_id,
) -> tuple[str, list[dict], list[str]]:
    """Non-streaming ``deepseekv41`` parse: ``(content, calls, warnings)``.

    ``calls`` are OpenAI tool calls ``{"id", "index", "type": "function", "function": {"name",
    "arguments"}}``; ``content`` is "" when there is none. ``tools=None`` accepts any tool name
    without schema checks.
    """
    p = ToolCallStreamParser(tools, id_factory=id_factory)
    a = p.feed(text)
    b = p.finish()
    return a.content + b.content, list(p.calls), list(p.warnings)


def strip_dsml(text: str) -> str:
    """Content with every DSML block and tag removed (for outputs whose calls are not parsed)."""
    p = ToolCallStreamParser(None, emit_calls=False)
    return p.feed(text).content + p.finish().content
