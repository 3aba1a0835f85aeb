"""DSML, the tool-call markup of DeepSeek-V4.1 (docs/design/spec.md §10, "Calls markup"), as the
chat encoder writes it.

Shared by serving (the chat encoder, the tool-call parser, constrained decoding) and training (the
nano corpus renders its tool-call targets with :func:`render_calls_block`):

* :func:`render_calls_block` / :func:`render_invoke` write calls as spaced DSML (assistant history,
  training targets);
* :func:`to_json` is the checkpoint's JSON style (schemas and values);
* :func:`validate_tools`, :func:`normalize_tool_choice` and :func:`should_parse_tools` check a
  request's ``tools`` / ``tool_choice``; :func:`validate_arguments` checks arguments against a tool's
  JSON schema (``jsonschema``).

Markup (the space after ``｜DSML｜`` is part of the tag name)::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="NAME">
    <｜DSML｜ parameter name="K" string="true">raw text</｜DSML｜ parameter>
    <｜DSML｜ parameter name="N" string="false">JSON</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

The parser of this markup (model output -> OpenAI tool calls) is `dsv41_jax.serving.tools`.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable, Iterable, Mapping, Sequence

import jsonschema
from jsonschema import validators as _js_validators

from .effort import ChatError

__all__ = [
    "DSML",
    "CALLS_NAME",
    "INVOKE_NAME",
    "PARAMETER_NAME",
    "CALLS_OPEN",
    "CALLS_CLOSE",
    "INVOKE_CLOSE",
    "PARAMETER_CLOSE",
    "V41_TAG_NAMES",
    "decode_arguments",
    "make_validator",
    "new_call_id",
    "normalize_tool_choice",
    "render_calls_block",
    "render_invoke",
    "render_parameter",
    "should_parse_tools",
    "to_json",
    "validate_arguments",
    "validate_tools",
]

DSML = "｜DSML｜"  # one special token (U+FF5C bars)
CALLS_NAME = " calls"
INVOKE_NAME = " invoke"
PARAMETER_NAME = " parameter"
CALLS_OPEN = f"<{DSML}{CALLS_NAME}>"
CALLS_CLOSE = f"</{DSML}{CALLS_NAME}>"
INVOKE_CLOSE = f"</{DSML}{INVOKE_NAME}>"
PARAMETER_CLOSE = f"</{DSML}{PARAMETER_NAME}>"



# ------------------------------------------------------------------------------------ JSON style


def to_json(value: Any) -> str:
    """JSON in the checkpoint's style: separators ``", "`` / ``": "``, non-ASCII kept, key order
    preserved, Python float text (``1e-06``, ``3.0``)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True, default=str)


def new_call_id() -> str:
    """``"call_"`` + 24 lowercase hex digits."""
    return "call_" + secrets.token_hex(12)


# ------------------------------------------------------------------------------------ rendering


def decode_arguments(arguments: Any) -> dict:
    """A tool call's arguments as a dict: a dict as is, or a string that decodes to a JSON object.

    Raises ValueError otherwise (the chat encoder turns it into a 400).
    """
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments are not valid JSON: {e.msg}") from None
        if isinstance(value, dict):
            return value
        raise ValueError(f"arguments must decode to a JSON object, got {type(value).__name__}")
    raise ValueError(f"arguments must be a JSON object string, got {type(arguments).__name__}")


# The tag names after ｜DSML｜: (calls block, invoke, parameter). V4.1 spaces them; DeepSeek-V4 writes
# (`tool_calls`, `invoke`, `parameter`) unspaced (`encoding_v4.V4_TAG_NAMES`).
V41_TAG_NAMES = (CALLS_NAME, INVOKE_NAME, PARAMETER_NAME)


def render_parameter(key: str, value: Any, names: Sequence[str] = V41_TAG_NAMES) -> str:
    tag = names[2]
    if isinstance(value, str):
        return f'<{DSML}{tag} name="{key}" string="true">{value}</{DSML}{tag}>'
    return f'<{DSML}{tag} name="{key}" string="false">{to_json(value)}</{DSML}{tag}>'


def render_invoke(name: str, arguments: Mapping[str, Any], names: Sequence[str] = V41_TAG_NAMES) -> str:
    """One invoke; no arguments gives the open tag, two newlines, the close tag."""
    params = "\n".join(render_parameter(k, v, names) for k, v in arguments.items())
    return f'<{DSML}{names[1]} name="{name}">\n{params}\n</{DSML}{names[1]}>'


def _call_name_args(call: Mapping[str, Any]) -> tuple[str, dict]:
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    return fn["name"], decode_arguments(fn.get("arguments", {}))


def render_calls_block(calls: Iterable[Mapping[str, Any] | tuple[str, Mapping[str, Any]]],
                       names: Sequence[str] = V41_TAG_NAMES) -> str:
    """``<｜DSML｜ calls>\\n`` + invokes joined by ``\\n`` + ``\\n</｜DSML｜ calls>``.

    ``calls`` are OpenAI tool calls (``{"function": {"name", "arguments"}}``), ``{"name",
    "arguments"}`` dicts or ``(name, arguments)`` pairs; string arguments must decode to an object.
    The chat encoder adds the leading ``"\\n\\n"`` and the EOS. ``names``: the tag names (V4.1's by default).
    """
    invokes = []
    for c in calls:
        if isinstance(c, tuple):
            name, args = c[0], decode_arguments(c[1])
        else:
            name, args = _call_name_args(c)
        invokes.append(render_invoke(name, args, names))
    return f"<{DSML}{names[0]}>\n" + "\n".join(invokes) + f"\n</{DSML}{names[0]}>"


# ------------------------------------------------------------------------------- JSON schemas
# ``jsonschema`` (a dependency) checks tools' parameter schemas and validates parsed arguments.


def _check_schema(schema: Any) -> str | None:
    """None when ``schema`` is a valid JSON schema (for its declared draft), else the problem."""
    if not isinstance(schema, (Mapping, bool)):
        return f"a JSON schema must be an object, got {type(schema).__name__}"
    try:
        _js_validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        return e.message
    return None


def make_validator(schema: Any) -> Callable[[Any], str | None]:
    if schema is None:
        return lambda value: None
    v = _js_validators.validator_for(schema)(schema)

    def check(value: Any) -> str | None:
        err = next(iter(v.iter_errors(value)), None)
        if err is None:
            return None
        where = "".join(f"[{p!r}]" for p in err.absolute_path)
        return f"$ {where}: {err.message}" if where else err.message

    return check


def validate_arguments(arguments: Any, schema: Any) -> str | None:
    """None when ``arguments`` satisfy the JSON ``schema`` (None = anything), else the error."""
    return make_validator(schema)(arguments)


# ------------------------------------------------------------------------- request validation

_BAD_NAME_RE = re.compile(r'["<>\s]|' + DSML)


def validate_tools(tools: Any) -> list[dict]:
    """Check a request's ``tools`` and return their ``function`` objects for the tools section.

    Each function object keeps the client-sent keys only, ordered name, description, parameters,
    then the rest in the client's order. Raises :class:`ChatError` naming the bad field.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError("tools must be an array", "tools")
    out: list[dict] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatError(f"{p} must be an object", p)
        if tool.get("type", "function") != "function":
            raise ChatError(f"{p}.type must be 'function'", f"{p}.type")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatError(f"{p}.function must be an object", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name or _BAD_NAME_RE.search(name):
            raise ChatError(f"{p}.function.name must be a non-empty name without quotes, angle "
                            f"brackets or blanks, got {name!r}", f"{p}.function.name")
        if name in seen:
            raise ChatError(f"duplicate tool name {name!r}", f"{p}.function.name")
        seen.add(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ChatError(f"{p}.function.description must be a string", f"{p}.function.description")
        if fn.get("parameters") is not None:
            params = fn["parameters"]
            if not isinstance(params, Mapping):
                raise ChatError(f"{p}.function.parameters must be a JSON schema object",
                                f"{p}.function.parameters")
            err = _check_schema(params)
            if err:
                raise ChatError(f"{p}.function.parameters is not a valid JSON schema: {err}",
                                f"{p}.function.parameters")
        ordered = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
        ordered.update((k, v) for k, v in fn.items() if k not in ordered)
        out.append(ordered)
    return out


def normalize_tool_choice(tool_choice: Any, tools: Sequence[Mapping] | None) -> str | dict:
    """``"none"`` | ``"auto"`` | ``"required"`` | ``{"type": "function", "function": {"name"}}``.

    None means "auto" with tools and "none" without. ``required`` or a named function without
    tools, or a name that is not among the tools, raises :class:`ChatError` (param tool_choice).
    """
    names = []
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, Mapping) else {}
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ChatError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}",
                            "tool_choice")
        if tool_choice == "required" and not names:
            raise ChatError("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ChatError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                            "tool_choice")
        if name not in names:
            raise ChatError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise ChatError("tool_choice must be a string or an object", "tool_choice")


def should_parse_tools(tools: Sequence | None, tool_choice: Any) -> bool:
    """docs/design/spec.md §10: parse only when tools are given and tool_choice is not "none"."""
    return bool(tools) and tool_choice != "none"

