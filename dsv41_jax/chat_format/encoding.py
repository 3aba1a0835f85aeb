"""DeepSeek-V4.1 chat encoding (docs/design/spec.md §10): OpenAI messages -> the prompt text.

The checkpoint ships no chat template; prompts are text built from literal special tokens and
tokenized *without* adding any (``tokenizer.encode(text, add_special_tokens=False)``).

Layout (docs/design/spec.md §10, restated as implemented by :func:`encode_messages`):

* ``<｜begin▁of▁sentence｜>`` opens every fresh prompt (``add_bos=False`` for a continuation).
* One leading ``<｜System｜>`` opens the prompt when the first message is a system message or
  thinking is on; inside it, in order: the effort line (thinking only), the system text, then
  ``"\\n\\n"`` + the tools section (when tools are given, even with tool_choice "none"). Request
  tools attach to the first system message; if there is none an empty one is inserted first.
* A later system message renders as ``<｜System｜>`` + text and counts as a user turn; a developer
  message is a user message (the checkpoint has no developer role).
* User turns are ``<｜User｜>`` + text; consecutive user messages, tool results and the user text
  after them merge into one turn, parts joined by ``"\\n\\n"``; a list of text parts is joined by
  ``"\\n\\n"``. Tool results are ``<tool_result>`` + content + ``</tool_result>`` (null -> empty),
  ordered by the preceding assistant's ``tool_calls`` ids.
* After each user-like turn that is last or followed by an assistant turn: ``<｜Assistant｜>``,
  then ``<think>`` if thinking is on and (tools are given or this is the last user-like turn),
  else ``</think>``.
* Assistant history: in thinking mode, when the turn is kept (tools given, or the turn is after
  the last user-like turn), reasoning + ``</think>``; then content, then (with calls) ``"\\n\\n"``
  + the spaced-DSML calls block; then ``<｜end▁of▁sentence｜>``. Chat mode never renders reasoning.

The prose (tools section, effort line, tier table) is a :class:`Wording`. :func:`load_wording`
reads it from a checkpoint's own ``encoding/*.py`` with :mod:`ast` — the file is parsed, never
imported or executed — so prompts are byte-exact for that checkpoint; otherwise our own wording of
the same rules is used (the tiny and trained-here models).

Resolutions of points §10 leaves open:

* The ``EOS`` in §10's examples (``A1 EOS <｜User｜>``) is the literal end-of-sentence token with no
  blanks around it; ``…`` elides the start of the prompt.
* When the first system message is not the first message, request tools still attach to it (the
  rule says "the first system message"); the tools section then follows that later system text.
* A system-only conversation gets no ``<｜Assistant｜>`` header (only user-like turns get one).
* ``reasoning`` is read from ``reasoning_content`` (falling back to ``reasoning``); history tool
  calls may carry ``arguments`` as a JSON-object string or as an object; ``""`` and other strings
  that do not decode to an object are refused (400), as §10 requires.
* A ``tool`` message without a ``tool_call_id`` is refused (400, as OpenAI); results whose
  ``tool_call_id`` is not among the preceding calls keep their relative order after the known ones.
* ``response_format`` is rendered (after the tools section, in the same system message) only when
  passed, which the server does only when asked to (SPEC: optional, off by default).
"""

from __future__ import annotations

import ast
import logging
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from .effort import DEFAULT_EFFORT_TIER, DEFAULT_EFFORT_TIERS, ChatError, tier_budget
from .dsml import (
    CALLS_NAME,
    DSML,
    INVOKE_NAME,
    PARAMETER_NAME,
    decode_arguments,
    normalize_tool_choice,
    render_calls_block,
    to_json,
    validate_tools,
)

__all__ = [
    "BOS",
    "EOS",
    "SYSTEM",
    "USER",
    "ASSISTANT",
    "THINK_OPEN",
    "THINK_CLOSE",
    "IMAGE",
    "ChatError",
    "DEFAULT_WORDING",
    "EncodedChat",
    "Wording",
    "encode_chat_request",
    "encode_messages",
    "load_wording",
    "read_constants",
]

log = logging.getLogger(__name__)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
IMAGE = "<｜deepseek_image｜>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

_ROLES = ("system", "user", "assistant", "tool", "developer")
_IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_file")

# --------------------------------------------------------------------------------- wording

# Our own wording of the tools-section rules (docs/design/spec.md §10 "Tools section"); a checkpoint's encoder
# file replaces it. Format fields: the markup pieces below and {tool_schemas}.
DEFAULT_TOOLS_TEMPLATE = """## Tools

You can use the tools listed below. To call one or more of them, write a "<{dsml_token}{tc_block_name}>" block in exactly this form:

<{dsml_token}{tc_block_name}>
<{dsml_token}{tool_call_tag_name} name="$TOOL_NAME">
<{dsml_token}{tool_parameter_tag_name} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}{tool_parameter_tag_name}>
...
</{dsml_token}{tool_call_tag_name}>
<{dsml_token}{tool_call_tag_name} name="$TOOL_NAME2">
...
</{dsml_token}{tool_call_tag_name}>
</{dsml_token}{tc_block_name}>

Write a string parameter's value as plain text and mark it `string="true"`. Write every other value (numbers, booleans, arrays, objects) as JSON and mark it `string="false"`.

In thinking mode (the reply opens with {thinking_start_token}), put your complete reasoning inside {thinking_start_token}...{thinking_end_token} before any tool call or answer. Otherwise, give the tool calls or the answer directly after {thinking_end_token}.

### Available Tool Schemas

{tool_schemas}

Call tools only by the exact names above, with arguments that follow their parameter schemas.
"""

# The effort line is a protocol fact (docs/design/spec.md §10), identical in our wording.
DEFAULT_EFFORT_TEMPLATE = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)

DEFAULT_RESPONSE_FORMAT_TEMPLATE = "## Response Format\n\nReply with JSON that follows this format:\n{schema}"

_FORMAT_FIELDS = {
    "dsml_token": DSML,
    "dsml": DSML,
    "tc_block_name": CALLS_NAME,
    "tool_calls_block_name": CALLS_NAME,
    "calls_block_name": CALLS_NAME,
    "tool_call_tag_name": INVOKE_NAME,
    "invoke_tag_name": INVOKE_NAME,
    "tool_parameter_tag_name": PARAMETER_NAME,
    "parameter_tag_name": PARAMETER_NAME,
    "thinking_start_token": THINK_OPEN,
    "thinking_end_token": THINK_CLOSE,
    "think_start": THINK_OPEN,
    "think_end": THINK_CLOSE,
    "bos_token": BOS,
    "eos_token": EOS,
}

# Constant names looked up in a checkpoint's encoding file (case-insensitive), per field.
_CONSTANT_NAMES = {
    "tools_template": ("TOOLS_TEMPLATE", "TOOLS_SYSTEM_TEMPLATE", "TOOL_SYSTEM_TEMPLATE", "TOOLS_PROMPT_TEMPLATE"),
    "effort_template": ("REASONING_EFFORT_TEMPLATE",),
    "effort_mappings": ("REASONING_EFFORT_MAPPINGS",),
    "default_effort": ("DEFAULT_REASONING_EFFORT",),
    "response_format_template": ("RESPONSE_FORMAT_TEMPLATE",),
}


@dataclass(frozen=True)
class Wording:
    """The prose of the prompt: tools-section template, effort line, tier table, default tier."""

    tools_template: str = DEFAULT_TOOLS_TEMPLATE
    effort_template: str = DEFAULT_EFFORT_TEMPLATE
    effort_mappings: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_EFFORT_TIERS))
    default_effort: str | int = DEFAULT_EFFORT_TIER
    response_format_template: str = DEFAULT_RESPONSE_FORMAT_TEMPLATE
    source: str | None = None  # the encoding file the wording came from (None: ours)

    def render_tools(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """The tools section for already validated ``function`` objects (one JSON line each)."""
        schemas = "\n".join(to_json(dict(f)) for f in functions)
        return self.tools_template.format(**_FORMAT_FIELDS, tool_schemas=schemas)

    def effort_line(self, budget: int) -> str:
        return self.effort_template.format(budget=budget, effort=budget, reasoning_effort=budget)

    def render_response_format(self, response_format: Any) -> str:
        return self.response_format_template.format(schema=to_json(response_format))

    @property
    def default_budget(self) -> int:
        d = self.default_effort
        if isinstance(d, int) and not isinstance(d, bool):
            return d
        b = tier_budget(str(d).lower(), self.effort_mappings)
        return b if b is not None else DEFAULT_EFFORT_TIERS[DEFAULT_EFFORT_TIER]

    def effort_budget(self, effort: int | str | None) -> int:
        """The integer budget for ``effort`` (None: the default tier); bad -> ChatError."""
        if effort is None:
            return self.default_budget
        if isinstance(effort, bool):
            raise ChatError(f"reasoning_effort must not be a boolean, got {effort!r}", "reasoning_effort")
        if isinstance(effort, int):
            if 1 <= effort <= 100:
                return effort
            raise ChatError(f"reasoning effort budget must be 1..100, got {effort!r}", "reasoning_effort")
        if isinstance(effort, str):
            b = tier_budget(effort.strip().lower(), self.effort_mappings)
            if b is not None:
                return b
        raise ChatError(f"unknown reasoning effort {effort!r} (tiers: {', '.join(self.effort_mappings)})",
                        "reasoning_effort")


DEFAULT_WORDING = Wording()


# ------------------------------------------------------------------------ the ast reader

class _NotLiteral(Exception):
    pass


_MAX_LITERAL = 1 << 20  # refuse to build strings / containers larger than this
_STR_METHODS = {"strip", "lstrip", "rstrip", "replace", "join"}


def _size_ok(v: Any) -> Any:
    if isinstance(v, (str, bytes, list, tuple, dict, set)) and len(v) > _MAX_LITERAL:
        raise _NotLiteral
    return v


def _eval_node(node: ast.AST, env: Mapping[str, Any]) -> Any:
    """Evaluate a constant expression without executing anything (literals, names already bound
    to literals, ``+`` on strings/numbers, f-strings of those, containers, ``dict(k=v)``,
    ``textwrap.dedent(s)`` and the str methods strip/lstrip/rstrip/replace/join)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise _NotLiteral
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval_node(node.operand, env)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return -v if isinstance(node.op, ast.USub) else v
        raise _NotLiteral
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _eval_node(node.left, env), _eval_node(node.right, env)
        if (isinstance(a, str) and isinstance(b, str)) or (
            isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool)
        ) or (isinstance(a, (list, tuple)) and type(a) is type(b)):
            return _size_ok(a + b)
        raise _NotLiteral
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                out.append(str(v.value))
            elif isinstance(v, ast.FormattedValue) and v.conversion == -1 and v.format_spec is None:
                x = _eval_node(v.value, env)
                if not isinstance(x, (str, int, float)):
                    raise _NotLiteral
                out.append(str(x))
            else:
                raise _NotLiteral
        return _size_ok("".join(out))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        if any(isinstance(e, ast.Starred) for e in node.elts):
            raise _NotLiteral
        items = [_eval_node(e, env) for e in node.elts]
        if isinstance(node, ast.Tuple):
            return tuple(items)
        return _size_ok(items if isinstance(node, ast.List) else set(items))
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise _NotLiteral
        return _size_ok({_eval_node(k, env): _eval_node(v, env) for k, v in zip(node.keys, node.values)})
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id == "dict" and not node.args:
            if any(k.arg is None for k in node.keywords):
                raise _NotLiteral
            return {k.arg: _eval_node(k.value, env) for k in node.keywords}
        is_dedent = (isinstance(f, ast.Name) and f.id == "dedent") or (
            isinstance(f, ast.Attribute) and f.attr == "dedent"
            and isinstance(f.value, ast.Name) and f.value.id == "textwrap")
        if is_dedent and len(node.args) == 1 and not node.keywords:
            s = _eval_node(node.args[0], env)
            if isinstance(s, str):
                return textwrap.dedent(s)
            raise _NotLiteral
        if isinstance(f, ast.Attribute) and f.attr in _STR_METHODS and not node.keywords:
            obj = _eval_node(f.value, env)
            args = [_eval_node(a, env) for a in node.args]
            if not isinstance(obj, str):
                raise _NotLiteral
            if f.attr == "join":
                if len(args) == 1 and isinstance(args[0], (list, tuple)) and all(isinstance(x, str) for x in args[0]):
                    return _size_ok(obj.join(args[0]))
                raise _NotLiteral
            if all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args) and len(args) <= 3:
                try:
                    return _size_ok(getattr(obj, f.attr)(*args))
                except TypeError:
                    raise _NotLiteral from None
        raise _NotLiteral
    raise _NotLiteral


def read_constants(path: str | Path, skipped: list | None = None) -> dict[str, Any]:
    """The module-level constants of a Python file, read with :mod:`ast` (never executed).

    Only top-level ``NAME = expr`` / ``NAME: T = expr`` statements whose value is a constant
    expression (see :func:`_eval_node`) are kept; a name later rebound to something else is
    dropped (and appended to ``skipped`` when given). Functions, classes, imports and every other
    statement are ignored.
    """
    src = Path(path).read_text(encoding="utf-8")
    tree = ast.parse(src, filename=str(path))
    env: dict[str, Any] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        try:
            v = _eval_node(value, env)
        except (_NotLiteral, RecursionError, ValueError, TypeError):
            for n in names:
                env.pop(n, None)
                if skipped is not None:
                    skipped.append(n)
            continue
        for n in names:
            env[n] = v
    return env


def _pick(constants: Mapping[str, Any], names: Sequence[str]) -> Any:
    upper = {k.upper(): v for k, v in constants.items()}
    for n in names:
        if n in upper:
            return upper[n]
    return None


def _wording_from_constants(constants: Mapping[str, Any], source: str) -> tuple[Wording, int]:
    """A Wording with every usable field taken from ``constants``; also how many were used."""
    fields: dict[str, Any] = {}
    tt = _pick(constants, _CONSTANT_NAMES["tools_template"])
    if isinstance(tt, str):
        try:
            if '{"name": "f_probe"}' in Wording(tools_template=tt).render_tools([{"name": "f_probe"}]):
                fields["tools_template"] = tt
            else:
                log.warning("%s: tools template has no {tool_schemas} field; using our wording", source)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            log.warning("%s: tools template not usable (%r); using our wording", source, e)
    et = _pick(constants, _CONSTANT_NAMES["effort_template"])
    if isinstance(et, str):
        try:
            if "75" in Wording(effort_template=et).effort_line(75):
                fields["effort_template"] = et
            else:
                log.warning("%s: effort template has no budget field; using ours", source)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            log.warning("%s: effort template not usable (%r); using ours", source, e)
    em = _pick(constants, _CONSTANT_NAMES["effort_mappings"])
    if isinstance(em, Mapping) and em and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 100
        for k, v in em.items()
    ):
        fields["effort_mappings"] = {k.lower(): v for k, v in em.items()}
    elif em is not None:
        log.warning("%s: REASONING_EFFORT_MAPPINGS not a {tier: 1..100} dict; using ours", source)
    de = _pick(constants, _CONSTANT_NAMES["default_effort"])
    table = fields.get("effort_mappings", DEFAULT_EFFORT_TIERS)
    if isinstance(de, str) and tier_budget(de.lower(), table) is not None:
        fields["default_effort"] = de.lower()
    elif isinstance(de, int) and not isinstance(de, bool) and 1 <= de <= 100:
        fields["default_effort"] = de
    elif de is not None:
        log.warning("%s: DEFAULT_REASONING_EFFORT %r not in the tier table; using ours", source, de)
    rf = _pick(constants, _CONSTANT_NAMES["response_format_template"])
    if isinstance(rf, str):
        try:
            Wording(response_format_template=rf).render_response_format({})
            fields["response_format_template"] = rf
        except (KeyError, IndexError, ValueError, AttributeError):
            pass
    if "effort_mappings" in fields and "default_effort" not in fields and \
            tier_budget(DEFAULT_EFFORT_TIER, fields["effort_mappings"]) is None:
        fields["default_effort"] = next(iter(fields["effort_mappings"]))
    return replace(DEFAULT_WORDING, source=source if fields else None, **fields), len(fields)


def load_wording(model_dir: str | Path | None) -> Wording:
    """The wording for a model directory: from its ``encoding/*.py`` when one defines the
    constants (read with :mod:`ast`, never executed), else :data:`DEFAULT_WORDING`.

    With several files, the one defining the most recognised constants wins (ties: a name with
    "41" first, then alphabetical).
    """
    if model_dir is None:
        return DEFAULT_WORDING
    enc = Path(model_dir) / "encoding"
    if not enc.is_dir():
        return DEFAULT_WORDING
    best: tuple[int, int] | None = None
    best_wording = DEFAULT_WORDING
    known = {n for names in _CONSTANT_NAMES.values() for n in names}
    for f in sorted(enc.glob("*.py")):
        skipped: list = []
        try:
            constants = read_constants(f, skipped)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError) as e:
            log.warning("cannot read %s: %r", f, e)
            continue
        for name in skipped:
            if name.upper() in known and name not in constants:
                log.warning("%s: %s is not a constant expression; not read", f, name)
        wording, n = _wording_from_constants(constants, str(f))
        if n == 0:
            continue
        key = (n, 1 if "41" in f.name else 0)
        if best is None or key > best:
            best, best_wording = key, wording
    if best_wording.source:
        log.info("chat wording read from %s", best_wording.source)
    return best_wording


# ------------------------------------------------------------------------------ messages


@dataclass
class _Turn:
    kind: str  # "system" | "user" | "assistant"
    text: str = ""
    parts: list = field(default_factory=list)  # user: ("text", s) | ("tool", id, s)
    reasoning: str = ""
    calls: list = field(default_factory=list)  # assistant: [(id, name, args)]
    tools: bool = False  # system: carries the request tools / response_format
    order: dict = field(default_factory=dict)  # user: the preceding assistant's call-id order


def _check_image_token(text: str, param: str) -> str:
    if IMAGE in text:
        raise ChatError(f"{param}: images are not supported (text only); the image placeholder "
                        f"{IMAGE} may not appear in text", param)
    return text


def _content_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_image_token(content, param)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            pp = f"{param}[{j}]"
            if isinstance(part, str):
                parts.append(_check_image_token(part, pp))
                continue
            if not isinstance(part, Mapping):
                raise ChatError(f"{pp} must be a content part object", pp)
            t = part.get("type")
            if t in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatError(f"{pp}.text must be a string", f"{pp}.text")
                parts.append(_check_image_token(text, f"{pp}.text"))
            elif t in _IMAGE_PART_TYPES:
                raise ChatError(f"{pp}: images are not supported (text only)", pp)
            else:
                raise ChatError(f"{pp}: unsupported content part type {t!r} (text only)", f"{pp}.type")
        return "\n\n".join(parts)
    raise ChatError(f"{param} must be a string, null or an array of text parts", param)


def _normalize(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ChatError(f"{p} must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            raise ChatError(f"{p}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{p}.role")
        text = _content_text(m.get("content"), f"{p}.content")
        item: dict[str, Any] = {"role": "user" if role == "developer" else role, "text": text}
        if role == "assistant":
            key = "reasoning_content" if m.get("reasoning_content") is not None else "reasoning"
            r = m.get(key)
            if r is not None and not isinstance(r, str):
                raise ChatError(f"{p}.{key} must be a string", f"{p}.{key}")
            item["reasoning"] = _check_image_token(r or "", f"{p}.{key}")
            calls = []
            tcs = m.get("tool_calls") or []
            if not isinstance(tcs, list):
                raise ChatError(f"{p}.tool_calls must be an array", f"{p}.tool_calls")
            for j, tc in enumerate(tcs):
                q = f"{p}.tool_calls[{j}]"
                fn = tc.get("function") if isinstance(tc, Mapping) else None
                if not isinstance(fn, Mapping):
                    raise ChatError(f"{q}.function must be an object", f"{q}.function")
                name = fn.get("name")
                if not isinstance(name, str) or not name:
                    raise ChatError(f"{q}.function.name must be a non-empty string", f"{q}.function.name")
                try:
                    args = decode_arguments(fn.get("arguments"))
                except ValueError as e:
                    raise ChatError(f"{q}.function.arguments: {e}", f"{q}.function.arguments") from None
                _check_image_token(to_json(args), f"{q}.function.arguments")
                calls.append((tc.get("id"), name, args))
            item["calls"] = calls
        elif role == "tool":  # OpenAI requires the id of the call a result answers
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise ChatError(f"{p}.tool_call_id must be the non-empty id of the tool call this message answers, "
                                f"got {tid!r}", f"{p}.tool_call_id")
            item["tool_call_id"] = tid
        out.append(item)
    return out


def _order_tool_results(parts: list, order: Mapping[str, int]) -> list:
    tool_slots = [k for k, p in enumerate(parts) if p[0] == "tool"]
    if len(tool_slots) < 2 or not order:
        return parts
    tools = [parts[k] for k in tool_slots]
    ranked = sorted(range(len(tools)),
                    key=lambda n: (order.get(tools[n][1], len(order)), n))
    out = list(parts)
    for slot, n in zip(tool_slots, ranked):
        out[slot] = tools[n]
    return out


def _build_turns(msgs: list[dict], attach: bool) -> list[_Turn]:
    if attach:
        first_sys = next((k for k, m in enumerate(msgs) if m["role"] == "system"), None)
        if first_sys is None:
            msgs = [{"role": "system", "text": ""}] + msgs
            first_sys = 0
    turns: list[_Turn] = []
    order: dict[str, int] = {}
    for k, m in enumerate(msgs):
        role = m["role"]
        if role in ("user", "tool"):
            part = ("text", m["text"]) if role == "user" else ("tool", m["tool_call_id"], m["text"])
            if turns and turns[-1].kind == "user":
                turns[-1].parts.append(part)
            else:
                turns.append(_Turn("user", parts=[part], order=order))
        elif role == "system":
            turns.append(_Turn("system", text=m["text"], tools=attach and k == first_sys))
        else:
            turns.append(_Turn("assistant", text=m["text"], reasoning=m["reasoning"], calls=m["calls"]))
            if m["calls"]:
                order = {cid: n for n, (cid, _, _) in enumerate(m["calls"]) if isinstance(cid, str)}
    for t in turns:
        if t.kind == "user":
            t.parts = _order_tool_results(t.parts, t.order)
    return turns


def _render_user(parts: list) -> str:
    out = []
    for p in parts:
        if p[0] == "text":
            out.append(p[1])
        else:
            out.append(TOOL_RESULT_OPEN + p[2] + TOOL_RESULT_CLOSE)
    return "\n\n".join(out)


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    thinking: bool = False,
    effort: int | str | None = None,
    wording: Wording | None = None,
    add_bos: bool = True,
    response_format: Any = None,
) -> str:
    """The V4.1 prompt text for OpenAI chat ``messages`` (docs/design/spec.md §10), byte-exact.

    ``effort`` (thinking only): an integer budget 1..100, a tier of the wording's table, or None
    for the wording's default tier (usually the server resolved it with
    :func:`dsv41_jax.chat_format.effort.resolve_thinking`). ``tool_choice`` does not change the prompt
    (the tools section is rendered even for "none") but is validated. Bad input raises
    :class:`ChatError` with the offending ``param``.
    """
    w = wording or DEFAULT_WORDING
    functions = validate_tools(tools) if tools else []
    if tool_choice is not None:
        normalize_tool_choice(tool_choice, tools)
    budget = w.effort_budget(effort) if thinking else None
    msgs = _normalize(messages)
    attach = bool(functions) or response_format is not None
    turns = _build_turns(msgs, attach)

    def user_like(k: int) -> bool:
        return turns[k].kind == "user" or (turns[k].kind == "system" and k > 0)

    last_user = max((k for k in range(len(turns)) if user_like(k)), default=-1)
    keep_all = bool(functions)  # with tools, earlier reasoning is kept and every header opens <think>

    out = [BOS] if add_bos else []
    for k, t in enumerate(turns):
        if k == 0 and (thinking or t.kind == "system"):
            out.append(SYSTEM)
            if thinking:
                out.append(w.effort_line(budget))
        if t.kind == "system":
            if k > 0:
                out.append(SYSTEM)
            out.append(t.text)
            if t.tools and functions:
                out.append("\n\n" + w.render_tools(functions))
            if t.tools and response_format is not None:
                out.append("\n\n" + w.render_response_format(response_format))
        elif t.kind == "user":
            out.append(USER + _render_user(t.parts))
        else:
            if thinking and (keep_all or k > last_user):
                out.append(t.reasoning + THINK_CLOSE)
            out.append(t.text)
            if t.calls:
                out.append("\n\n" + render_calls_block([(name, args) for _, name, args in t.calls]))
            out.append(EOS)
        if user_like(k) and (k == len(turns) - 1 or turns[k + 1].kind == "assistant"):
            out.append(ASSISTANT + (THINK_OPEN if thinking and (keep_all or k >= last_user) else THINK_CLOSE))
    return "".join(out)


@dataclass
class EncodedChat:
    """What :func:`encode_chat_request` resolved for one chat-completion request."""

    prompt: str
    thinking: bool
    effort: int | None
    tools: list  # the validated request tools (OpenAI shape), [] when none
    tool_choice: str | dict  # normalized: "none" | "auto" | "required" | {"type", "function": {"name"}}
    parse_tools: bool  # run the deepseekv41 parser (tools given and tool_choice != "none")
    warnings: list = field(default_factory=list)


def encode_chat_request(
    request: Mapping[str, Any],
    *,
    wording: Wording | None = None,
    server_defaults: Any = None,
    render_response_format: bool = False,
    add_bos: bool = True,
) -> EncodedChat:
    """Resolve a chat-completion request body (thinking switch, effort, tools) and encode it.

    Reads ``messages``, ``tools``, ``tool_choice``, ``response_format`` (rendered into the prompt
    only with ``render_response_format``), ``reasoning_effort``, ``reasoning`` and
    ``chat_template_kwargs``. ``server_defaults`` is a
    :class:`dsv41_jax.chat_format.effort.ServerDefaults` (None: thinking off, effort from ``wording``).
    Raises :class:`ChatError` (400) for anything invalid.
    """
    from .effort import ServerDefaults, resolve_thinking

    w = wording or DEFAULT_WORDING
    if server_defaults is None:
        server_defaults = ServerDefaults(default_effort=w.default_budget, tiers=w.effort_mappings)
    thinking, effort, warnings = resolve_thinking(request, server_defaults)
    tools = request.get("tools") or []
    validate_tools(tools)
    tool_choice = normalize_tool_choice(request.get("tool_choice"), tools)
    rf = request.get("response_format") if render_response_format else None
    if isinstance(rf, Mapping) and rf.get("type") == "text":
        rf = None
    prompt = encode_messages(request.get("messages"), tools=tools, thinking=thinking, effort=effort, wording=w,
                             add_bos=add_bos, response_format=rf)
    return EncodedChat(prompt, thinking, effort, list(tools), tool_choice,
                       bool(tools) and tool_choice != "none", warnings)
