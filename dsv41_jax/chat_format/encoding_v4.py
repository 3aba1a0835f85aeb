"""DeepSeek-V4 chat encoding (docs/design/v4.md "Chat"): OpenAI messages -> the V4 prompt text.

The earlier V4 checkpoints (Flash, Pro, Flash-0731, Pro-0813) ship their encoder as Python
(``encoding/encoding_dsv4.py``, ``encode_messages``); SGLang serves them with an adaptation of it. This
module implements the same layout with the pieces V4 shares with V4.1 (`encoding`: special tokens,
message checks, tool-result merging, the ``ast`` reader of a checkpoint's constants; `dsml`: the JSON
style, tools / tool_choice checks, the calls block with V4's tag names):

* BOS opens a fresh prompt. With tools (or a rendered ``response_format``) and no leading system message,
  an empty one is inserted first (SGLang does this for every request; it renders nothing when empty).
* system -> its text (no special token), then ``"\\n\\n"`` + the tools section, then ``"\\n\\n"`` +
  the response-format section. A later system message renders the same way, inline.
* user -> ``<｜User｜>`` + text; consecutive user messages and tool results merge into one user turn,
  parts joined by ``"\\n\\n"``, a tool result as ``<tool_result>`` + content + ``</tool_result>``, ordered
  by the preceding assistant's call ids (an unknown id sorts first, as the reference's sort key 0).
* developer -> ``<｜User｜>`` + text (V4 has the role); in thinking mode without tools, developer
  messages before the last user turn are dropped.
* assistant -> [reasoning + ``</think>``] + content + [``"\\n\\n"`` + calls block] + EOS; the reasoning part
  only in thinking mode for turns after the last user turn, or for every turn when tools are given.
* After a user / developer turn that is last or followed by an assistant turn: ``<｜Assistant｜>`` then
  ``<think>`` (thinking, and the turn is the last user turn or tools are given) else ``</think>``.
* Think Max: the max-effort paragraph right after BOS (thinking mode only). Think High renders exactly
  as plain thinking; Non-think is thinking off.
* Calls block: ``<｜DSML｜tool_calls>`` / ``<｜DSML｜invoke name="...">`` / ``<｜DSML｜parameter name="..."
  string="true|false">`` (V4.1 spaces these names).

The prose (tools section, max-effort paragraph, response-format section) is a `V4Wording`: read from a
checkpoint's ``encoding/*.py`` with ``ast`` (never executed) when the model directory has one, so
prompts are byte-exact for that checkpoint; otherwise our own wording of the same rules.

Reasoning efforts (`resolve_v4_thinking`), as SGLang maps them for V4: thinking is off by default;
``chat_template_kwargs.thinking`` (or ``enable_thinking``) sets it, ``reasoning.enabled`` turns it on,
``reasoning_effort`` "none" turns it off — another effort does **not** turn thinking on. The effort passed
to the encoder is "max" or "high" when requested (``reasoning_effort``, ``chat_template_kwargs.reasoning_effort``
or ``reasoning.effort``), else the server default (SGLang: ``SGLANG_DSV4_REASONING_EFFORT``), else none;
every other tier (low, minimal, medium, xhigh) renders as none, with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from .dsml import normalize_tool_choice, render_calls_block, validate_tools
from .effort import ChatError, _explicit_bool
from .encoding import (
    ASSISTANT,
    BOS,
    DEFAULT_TOOLS_TEMPLATE,
    EOS,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_RESULT_CLOSE,
    TOOL_RESULT_OPEN,
    USER,
    Wording,
    _normalize,
    _pick,
    _wording_from_constants,
    read_constants,
)

__all__ = ["V4_TAG_NAMES", "V4_EFFORTS", "V4Wording", "DEFAULT_V4_WORDING", "EncodedV4Chat", "encode_messages_v4",
           "encode_chat_request_v4", "load_v4_wording", "resolve_v4_thinking"]

log = logging.getLogger(__name__)

V4_TAG_NAMES = ("tool_calls", "invoke", "parameter")
V4_EFFORTS = ("high", "max")  # what the V4 encoder renders (Think High / Think Max)

# Our wording of V4's tools-section rules (a checkpoint's encoder file replaces it): V4.1's wording with
# V4's fixed DSML tag names filled in. Format fields left: {dsml_token}, {thinking_start_token},
# {thinking_end_token}, {tool_schemas}.
DEFAULT_V4_TOOLS_TEMPLATE = DEFAULT_TOOLS_TEMPLATE
for _field, _name in zip(("tc_block_name", "tool_call_tag_name", "tool_parameter_tag_name"), V4_TAG_NAMES):
    DEFAULT_V4_TOOLS_TEMPLATE = DEFAULT_V4_TOOLS_TEMPLATE.replace("{" + _field + "}", _name)
del _field, _name

# Our wording of the Think Max instruction (the checkpoint's REASONING_EFFORT_MAX replaces it).
DEFAULT_MAX_EFFORT_TEXT = (
    "Reasoning Effort: maximum. Think as thoroughly as you can: break the problem down, check every step "
    "and alternative, and write out your whole deliberation before answering.\n\n"
)


@dataclass(frozen=True)
class V4Wording:
    """V4's prose: the tools / response-format sections (a V4.1 `Wording` holds those templates) and the
    Think Max paragraph."""

    sections: Wording = Wording(tools_template=DEFAULT_V4_TOOLS_TEMPLATE)
    max_effort_text: str = DEFAULT_MAX_EFFORT_TEXT
    source: str | None = None


DEFAULT_V4_WORDING = V4Wording()


def load_v4_wording(model_dir: str | Path | None) -> V4Wording:
    """The V4 wording of a model directory: from its ``encoding/*.py`` (``encoding_dsv4.py`` first) read with
    ``ast``, never executed — ``TOOLS_TEMPLATE``, ``REASONING_EFFORT_MAX``, ``response_format_template`` —
    else ours."""
    if model_dir is None:
        return DEFAULT_V4_WORDING
    enc = Path(model_dir) / "encoding"
    files = sorted(enc.glob("*.py"), key=lambda f: (f.name != "encoding_dsv4.py", f.name)) if enc.is_dir() else []
    for f in files:
        try:
            constants = read_constants(f)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError) as e:
            log.warning("cannot read %s: %r", f, e)
            continue
        sections, n = _wording_from_constants(constants, str(f))
        mx = _pick(constants, ("REASONING_EFFORT_MAX",))
        if n == 0 and not isinstance(mx, str):
            continue
        if sections.tools_template == Wording().tools_template:  # the file has none: V4's, not V4.1's
            sections = replace(sections, tools_template=DEFAULT_V4_TOOLS_TEMPLATE)
        log.info("V4 chat wording read from %s", f)
        return V4Wording(sections=sections, max_effort_text=mx if isinstance(mx, str) else DEFAULT_MAX_EFFORT_TEXT,
                         source=str(f))
    return DEFAULT_V4_WORDING


# ------------------------------------------------------------------------------ messages

def _merge(msgs: list[dict], attach: bool) -> list[dict]:
    """Tool results and consecutive user messages merged into user turns (``parts``); request tools
    attached to a leading system message (inserted empty when missing)."""
    if attach and (not msgs or msgs[0]["role"] != "system"):
        msgs = [{"role": "system", "text": ""}] + msgs
    out: list[dict] = []
    order: dict[str, int] = {}
    for k, m in enumerate(msgs):
        role = m["role"]
        if role in ("user", "tool"):
            part = ("text", m["text"]) if role == "user" else ("tool", m["tool_call_id"], m["text"])
            if out and out[-1]["role"] == "user":
                out[-1]["parts"].append(part)
            else:
                out.append({"role": "user", "parts": [part], "order": order})
        else:
            out.append(dict(m, tools=attach and k == 0 and role == "system"))
            if role == "assistant" and m["calls"]:
                order = {cid: n for n, (cid, _, _) in enumerate(m["calls"]) if isinstance(cid, str)}
    for t in out:
        if t["role"] == "user":
            tools = [p for p in t["parts"] if p[0] == "tool"]
            ranked = iter(sorted(tools, key=lambda p: t["order"].get(p[1] or "", 0)))  # stable; unknown id -> 0
            t["parts"] = [next(ranked) if p[0] == "tool" else p for p in t["parts"]]
    return out


def encode_messages_v4(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    thinking: bool = False,
    effort: str | None = None,
    wording: V4Wording | None = None,
    add_bos: bool = True,
    response_format: Any = None,
) -> str:
    """The DeepSeek-V4 prompt for OpenAI chat ``messages`` (module doc). ``effort``: None, "high" or "max"
    (Think Max adds its paragraph in thinking mode). Bad input raises `ChatError` with the offending param."""
    w = wording or DEFAULT_V4_WORDING
    if effort not in (None,) + V4_EFFORTS:
        raise ChatError(f"reasoning effort for DeepSeek-V4 must be one of {V4_EFFORTS} or none, got {effort!r}",
                        "reasoning_effort")
    functions = validate_tools(tools) if tools else []
    if tool_choice is not None:
        normalize_tool_choice(tool_choice, tools)
    msgs = _normalize(messages)
    for i, m in enumerate(messages):  # _normalize maps developer to user; V4 keeps the role
        if isinstance(m, Mapping) and m.get("role") == "developer":
            msgs[i]["role"] = "developer"
    attach = bool(functions) or response_format is not None
    turns = _merge(msgs, attach)
    keep_all = bool(functions)  # with tools no reasoning is dropped and every header opens <think>

    def last_user_index() -> int:
        return max((k for k, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)

    if thinking and not keep_all:  # earlier developer messages are dropped (the reference's drop_thinking)
        lu = last_user_index()
        turns = [t for k, t in enumerate(turns) if not (t["role"] == "developer" and k < lu)]
    last_user = last_user_index()

    out = [BOS] if add_bos else []
    if thinking and effort == "max":
        out.append(w.max_effort_text)
    for k, t in enumerate(turns):
        role = t["role"]
        if role == "system":
            out.append(t["text"])
            if t["tools"] and functions:
                out.append("\n\n" + w.sections.render_tools(functions))
            if t["tools"] and response_format is not None:
                out.append("\n\n" + w.sections.render_response_format(response_format))
        elif role == "user":
            out.append(USER + "\n\n".join(p[1] if p[0] == "text" else TOOL_RESULT_OPEN + p[2] + TOOL_RESULT_CLOSE
                                          for p in t["parts"]))
        elif role == "developer":
            out.append(USER + t["text"])
        else:
            if thinking and (keep_all or k > last_user):
                out.append(t["reasoning"] + THINK_CLOSE)
            out.append(t["text"])
            if t["calls"]:
                out.append("\n\n" + render_calls_block([(n, a) for _, n, a in t["calls"]], V4_TAG_NAMES))
            out.append(EOS)
        if role in ("user", "developer") and (k == len(turns) - 1 or turns[k + 1]["role"] == "assistant"):
            out.append(ASSISTANT + (THINK_OPEN if thinking and (keep_all or k >= last_user) else THINK_CLOSE))
    return "".join(out)


# ------------------------------------------------------------------------------ requests

def _effort_value(value: Any, param: str, warnings: list) -> str:
    """A requested effort, checked: "none" | "high" | "max" | another string (no V4 counterpart: warned)."""
    if not isinstance(value, str):
        raise ChatError(f"{param} must be a string (none, low, medium, high, max, ...), got {value!r}", param)
    v = value.strip().lower()
    if v not in ("none",) + V4_EFFORTS:
        msg = f"{param}={value!r} has no DeepSeek-V4 counterpart (Think High / Think Max); rendering no effort"
        log.warning(msg)
        warnings.append(msg)
    return v


def resolve_v4_thinking(request: Mapping[str, Any], *, default_thinking: bool = False,
                        default_effort: str | None = None) -> tuple[bool, str | None, list[str]]:
    """``(thinking, effort, warnings)`` for a chat request, mapped as SGLang maps it for V4
    (`reasoning_request.normalize_reasoning_request` + `serving_chat`): the effort is
    ``chat_template_kwargs.reasoning_effort`` > ``reasoning.effort`` > ``reasoning_effort``; thinking is
    ``chat_template_kwargs.thinking`` (alias ``enable_thinking``) > ``reasoning.enabled`` (on) > the effort
    "none" given as ``reasoning_effort`` / ``reasoning.effort`` (off) > ``default_thinking``. The encoder gets
    "high" / "max" when that is the effort, ``default_effort`` when none was requested, else nothing.

    Non-think = thinking off; Think High = thinking with "high" (or nothing); Think Max = thinking with "max".
    Our one departure: SGLang drops ``reasoning.effort`` "max"; it is honoured here. Raises `ChatError`
    (400) for wrongly typed fields."""
    if default_effort not in (None,) + V4_EFFORTS:
        raise ValueError(f"default V4 reasoning effort must be none, 'high' or 'max', got {default_effort!r}")
    warnings: list[str] = []
    ctk = request.get("chat_template_kwargs") or {}
    reasoning = request.get("reasoning") or {}
    if not isinstance(ctk, Mapping):
        raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
    if not isinstance(reasoning, Mapping):
        raise ChatError("reasoning must be an object", "reasoning")
    top = None
    if request.get("reasoning_effort") is not None:
        top = _effort_value(request["reasoning_effort"], "reasoning_effort", [])
    if reasoning.get("effort") is not None:
        top = _effort_value(reasoning["effort"], "reasoning.effort", [])
    kw = None
    if ctk.get("reasoning_effort") is not None:
        kw = _effort_value(ctk["reasoning_effort"], "chat_template_kwargs.reasoning_effort", [])
    effective = kw if kw is not None else top
    if effective is not None:  # warn once, for the value that is used
        _effort_value(effective, "reasoning effort", warnings)

    switch = None
    if _explicit_bool(reasoning.get("enabled"), "reasoning.enabled"):
        switch = True
    elif top == "none":
        switch = False
    explicit = _explicit_bool(ctk.get("thinking"), "chat_template_kwargs.thinking")
    if explicit is None:
        explicit = _explicit_bool(ctk.get("enable_thinking"), "chat_template_kwargs.enable_thinking")
    thinking = explicit if explicit is not None else (switch if switch is not None else default_thinking)
    if not thinking:
        return False, None, warnings
    if effective is None:
        return True, default_effort, warnings
    return True, effective if effective in V4_EFFORTS else None, warnings


@dataclass
class EncodedV4Chat:
    """What `encode_chat_request_v4` resolved for one chat-completion request."""

    prompt: str
    thinking: bool
    effort: str | None
    tools: list
    tool_choice: str | dict
    parse_tools: bool
    warnings: list


def encode_chat_request_v4(request: Mapping[str, Any], *, wording: V4Wording | None = None,
                           default_thinking: bool = False, default_effort: str | None = None,
                           render_response_format: bool = False, add_bos: bool = True) -> EncodedV4Chat:
    """Resolve a chat-completion request body (thinking, effort, tools) and encode it as V4."""
    thinking, effort, warnings = resolve_v4_thinking(request, default_thinking=default_thinking,
                                                     default_effort=default_effort)
    tools = request.get("tools") or []
    validate_tools(tools)
    tool_choice = normalize_tool_choice(request.get("tool_choice"), tools)
    rf = request.get("response_format") if render_response_format else None
    if isinstance(rf, Mapping) and rf.get("type") == "text":
        rf = None
    prompt = encode_messages_v4(request.get("messages"), tools=tools, thinking=thinking, effort=effort,
                                wording=wording, add_bos=add_bos, response_format=rf)
    return EncodedV4Chat(prompt, thinking, effort, list(tools), tool_choice, bool(tools) and tool_choice != "none",
                         warnings)

