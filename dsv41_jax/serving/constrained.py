"""Constrained decoding with llguidance: ``response_format`` and ``tool_choice`` required / named.

The constraint is enforced *during sampling*: for every step the engine asks the request's
:class:`GrammarConstraint` for the set of allowed next tokens (:meth:`GrammarConstraint.allowed_mask`,
a ``bool [V]`` array over the model's vocabulary, or ``None`` for "no restriction this step"),
applies it to the logits on device before sampling, and reports the sampled token back with
:meth:`GrammarConstraint.accept`. Nothing is checked afterwards.

Grammars (built by :class:`GrammarCompiler`, which wraps one ``llguidance.LLTokenizer`` made from the
model's HF ``tokenizer.json`` — llguidance installs with no other package and gives masks as
arrays):

* ``response_format: {"type": "json_object"}`` — any JSON object;
* ``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`` — JSON following the
  schema (llguidance's JSON-schema compiler); a schema it cannot compile is a 400 naming
  ``response_format.json_schema.schema``;
* ``regex`` (SGLang's extra request field) — text matching the regular expression;
* ``tool_choice: "required"`` / ``{"type": "function", "function": {"name": ...}}`` — a spaced-DSML
  calls block (docs/design/spec.md §10) exactly as the chat encoder renders history calls: ``\\n\\n`` (optional),
  ``<｜DSML｜ calls>``, one invoke of the named tool (named) or one or more invokes of any tool
  (required), ``</｜DSML｜ calls>``, then EOS. ``｜DSML｜`` is forced as the special token itself (the
  text-level ``<``, `` calls>``, `` invoke name="…">`` … around it are ordinary text). Each invoke
  carries the tool's parameters in the order of its schema's ``properties``: required ones always,
  optional ones optionally; a string-typed parameter is ``string="true"`` with raw text (no ``<``
  inside; an ``enum`` / ``const`` is forced to one of its values, ``maxLength`` bounds the length), any
  other type is ``string="false"`` with JSON following that property's schema. A tool whose
  parameters declare no ``properties`` gets free-form parameters (any name, raw text or any JSON).

JSON style: by default the checkpoint's own (docs/design/spec.md §10): separators ``", "`` and ``": "`` and no other
whitespace, which is also what keeps a weak (e.g. random-weight) model from wandering in
whitespace. ``whitespace_pattern`` (``--constrained-json-whitespace-pattern``) allows free
whitespace matching that regex between tokens instead.

Thinking: when the request thinks (the prompt ends with ``<think>``) the grammar starts only after
the model closes its reasoning with the ``</think>`` token; reasoning itself is free (as SGLang's
reasoning-gated grammars); until then only EOS (the answer must still come) and the ``｜DSML｜``
token (a calls block inside reasoning would end it for the reasoning parser) are excluded. A request's
``thinking_budget`` (an extra field, as SGLang's thinking-budget processor) caps the reasoning: after
that many reasoning tokens only ``</think>`` is allowed; it works with or without a grammar.

The constraint object is what the engine consumes (``allowed_mask()``, ``accept(token_id)``,
``is_done()``); ``fork()`` gives an independent copy for each of the ``n`` choices and
``rollback(k)`` undoes accepted tokens (speculative decoding).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np

from dsv41_jax.chat_format.dsml import V41_TAG_NAMES
from dsv41_jax.chat_format.effort import ChatError

__all__ = [
    "GrammarCompiler",
    "GrammarConstraint",
    "ConstraintSpec",
    "constraint_spec_for_request",
    "tool_call_lark",
]

log = logging.getLogger(__name__)

DSML_TOKEN = "｜DSML｜"
THINK_CLOSE_TOKEN = "</think>"

# default JSON compile options: the checkpoint's JSON style, no free whitespace
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _import_llguidance():
    try:
        import llguidance  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the server
        raise RuntimeError("constrained decoding needs the 'llguidance' package (pip install llguidance)") from e
    return llguidance


class ConstraintSpec:
    """What a request asks to be constrained to (hashable key for the grammar cache)."""

    __slots__ = ("kind", "grammar", "param", "description")

    def __init__(self, kind: str, grammar: str, param: str, description: str):
        self.kind = kind  # "json_object" | "json_schema" | "regex" | "tool_call"
        self.grammar = grammar  # llguidance grammar (JSON text)
        self.param = param  # request field to blame when the grammar does not compile
        self.description = description

    def __repr__(self) -> str:
        return f"ConstraintSpec({self.kind!r}, {self.description!r})"


# --------------------------------------------------------------------------------- lark helpers


def _lark_str(s: str) -> str:
    """A Lark string literal for ``s``."""
    return json.dumps(s, ensure_ascii=False)


def _types_of(schema: Any) -> set[str]:
    """JSON types a (sub)schema admits, roughly ('any' when unknown)."""
    if not isinstance(schema, Mapping):
        return {"any"}
    if "const" in schema:
        return {_json_type(schema["const"])}
    if "enum" in schema and isinstance(schema["enum"], list):
        return {_json_type(v) for v in schema["enum"]}
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for sub in schema[key]:
                out |= _types_of(sub)
            return out
    return {"any"}


def _json_type(v: Any) -> str:
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "array"
    return "object"


def _string_value_rule(schema: Any) -> str:
    """Lark expression for a ``string="true"`` raw value under ``schema``."""
    if isinstance(schema, Mapping):
        if isinstance(schema.get("const"), str):
            return _lark_str(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list):
            strs = [v for v in enum if isinstance(v, str)]
            if strs:
                return "(" + " | ".join(_lark_str(v) for v in strs) + ")"
        lo = schema.get("minLength")
        hi = schema.get("maxLength")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0 else 0
        if isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo:
            return f"/[^<]{{{lo},{hi}}}/"
        if lo:
            return f"/[^<]{{{lo},}}/"
    return "/[^<]*/"


def _json_rule(schema: Any, defs: Mapping[str, Any], style: Mapping[str, Any]) -> str:
    """``%json { ... }`` for a parameter's subschema (root ``$defs`` carried along)."""
    sub = dict(schema) if isinstance(schema, Mapping) else {}
    for k, v in defs.items():
        sub.setdefault(k, v)
    xg = dict(sub.get("x-guidance") or {})
    xg.update(style)
    sub["x-guidance"] = xg
    return "%json " + json.dumps(sub, ensure_ascii=False)


# free-form parameter names (tools without declared properties): bounded, so that every tag the
# grammar can produce stays within the tool-call parser's tag limit (tools.max_tag_length)
FREE_NAME_MAX = 64
_DSML_ATTR_BAD = ('"', "<", ">", "\n", "\r", DSML_TOKEN)


def _dsml_attr(value: str, what: str) -> str:
    """``"value"`` as the chat encoder writes a DSML attribute (verbatim, no escaping: the format has
    none). A name the markup cannot carry (a quote, an angle bracket, a line break, the DSML token)
    could be forced by the grammar but never parsed back, so it is refused (400)."""
    value = str(value)
    if not value or any(b in value for b in _DSML_ATTR_BAD):
        raise ChatError(f"tool_choice cannot be enforced: the {what} {value!r} cannot be written in DSML markup "
                        "(it is empty or contains a quote, '<', '>', a line break or the DSML token)", "tool_choice")
    return '"' + value + '"'


def tool_call_lark(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: Any,
    *,
    dsml_id: int,
    json_style: Mapping[str, Any] | None = None,
    tag_names: Sequence[str] = V41_TAG_NAMES,
) -> str:
    """The Lark grammar (llguidance dialect) of a DSML calls block for ``tool_choice`` "required" (one or
    more invokes of any tool) or a named function (exactly one invoke of it). tag_names: the (calls,
    invoke, parameter) tag names after the DSML token — V4.1's spaced ones by default, DeepSeek-V4's
    unspaced ``tool_calls`` / ``invoke`` / ``parameter`` (`encoding_v4.V4_TAG_NAMES`) for its encoding."""
    calls_t, inv_t, par_t = tag_names
    style = dict(_JSON_STYLE if json_style is None else json_style)
    D = f"<[{int(dsml_id)}]>"
    # Every tag starts with the one-byte lexeme "<"; a closing tag continues with "/" and the DSML
    # token. Keeping "\n", "<" and "/" separate lexemes means no literal is a multi-byte prefix of
    # another one at the same grammar position (llguidance's lexer looks one byte ahead).
    O = f'"<" {D}'
    C = f'"<" "/" {D}'
    fns = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            fns.append(fn)
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f["name"] == name]
        multi = False
    else:
        multi = True
    if not fns:
        raise ChatError("tool_choice names no available tool", "tool_choice")

    rules: list[str] = []
    inv_names = []
    for k, fn in enumerate(fns):
        inv = f"inv{k}"
        inv_names.append(inv)
        params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
        props = params.get("properties") if isinstance(params.get("properties"), Mapping) else None
        open_tag = f'{O} {_lark_str(inv_t + " name=" + _dsml_attr(fn["name"], "tool name") + ">")} "\\n"'
        close_tag = f'"\\n" {C} {_lark_str(inv_t + ">")}'
        addl = params.get("additionalProperties")
        if not props and (addl is True or isinstance(addl, Mapping)):
            # free-form parameters
            rules.append(f"{inv}: {open_tag} ({inv}_p (\"\\n\" {inv}_p)*)? {close_tag}")
            pn, pc = _lark_str(par_t + ' name="'), _lark_str(par_t + ">")
            rules.append(f'{inv}_p: {O} {pn} {inv}_name "\\" string=\\"true\\">" /[^<]*/ {C} {pc}'
                         f' | {O} {pn} {inv}_name "\\" string=\\"false\\">" '
                         f'{_json_rule({}, {}, style)} {C} {pc}')
            rules.append(f'{inv}_name: /[A-Za-z0-9_.\\-]{{1,{FREE_NAME_MAX}}}/')
            continue
        defs = {k2: params[k2] for k2 in ("$defs", "definitions") if isinstance(params.get(k2), Mapping)}
        required = set(params.get("required") or [])
        names = list((props or {}).keys())
        if not names:
            rules.append(f'{inv}: {open_tag} {close_tag}')
            continue
        # one rule per parameter
        for j, pname in enumerate(names):
            sub = props[pname]
            types = _types_of(sub)
            head = f'{O} {_lark_str(par_t + " name=" + _dsml_attr(pname, "parameter name"))}'
            tail = f'{C} {_lark_str(par_t + ">")}'
            alts = []
            if "string" in types or "any" in types:
                alts.append(f'{head} " string=\\"true\\">" {_string_value_rule(sub)} {tail}')
            if types - {"string"}:
                alts.append(f'{head} " string=\\"false\\">" {_json_rule(sub, defs, style)} {tail}')
            rules.append(f"{inv}_p{j}: " + " | ".join(alts))
        # parameters in schema order, joined by "\n": L_j = non-empty list from j, E_j = "\n"-prefixed rest
        n = len(names)
        for j in range(n - 1, -1, -1):
            req = names[j] in required
            e_next = f" {inv}_e{j + 1}" if j + 1 < n else ""
            l_next = f"{inv}_l{j + 1}" if j + 1 < n else None
            # E_j (not needed for j == 0: the list starts with L_0)
            if j == 0:
                pass
            elif req:
                rules.append(f'{inv}_e{j}: "\\n" {inv}_p{j}{e_next}')
            else:
                rules.append(f'{inv}_e{j}: ("\\n" {inv}_p{j})?{e_next}' if e_next else f'{inv}_e{j}: ("\\n" {inv}_p{j})?')
            # L_j
            alts = [f"{inv}_p{j}{e_next}"]
            if not req and l_next is not None:
                alts.append(l_next)
            rules.append(f"{inv}_l{j}: " + " | ".join(alts))
        all_optional = not any(nm in required for nm in names)
        body = f"{inv}_l0?" if all_optional else f"{inv}_l0"
        rules.append(f'{inv}: {open_tag} {body} {close_tag}')
    any_inv = "invoke"
    rules.append(f"{any_inv}: " + " | ".join(inv_names))
    invokes = f'{any_inv} ("\\n" {any_inv})*' if multi else any_inv
    head = [
        'start: "\\n\\n"? calls',
        f'calls: {O} {_lark_str(calls_t + ">")} "\\n" {invokes} "\\n" {C} {_lark_str(calls_t + ">")}',
    ]
    return "\n".join(head + rules) + "\n"


# ----------------------------------------------------------------------------- request -> spec


def _json_options(whitespace_pattern: str | None) -> dict:
    if whitespace_pattern:
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern,
                "item_separator": ",", "key_separator": ":"}
    return dict(_JSON_STYLE)


def constraint_spec_for_request(
    request: Mapping[str, Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: Any = None,
    dsml_id: int | None = None,
    whitespace_pattern: str | None = None,
    tag_names: Sequence[str] = V41_TAG_NAMES,
) -> ConstraintSpec | None:
    """The constraint a request body asks for, or None.

    ``tool_choice`` "required" / named (already normalized, see
    :func:`dsv41_jax.chat_format.dsml.normalize_tool_choice`) wins over ``response_format``; then
    ``response_format`` json_object / json_schema; then SGLang's ``regex`` field. Shape errors are
    :class:`ChatError` (400) naming the field.
    """
    llg = _import_llguidance()
    style = _json_options(whitespace_pattern)
    if tools and (tool_choice == "required" or isinstance(tool_choice, Mapping)):
        if dsml_id is None:
            raise ChatError("this model's tokenizer has no DSML token; tool_choice required/named is unavailable",
                            "tool_choice")
        lark = tool_call_lark(tools, tool_choice, dsml_id=dsml_id, json_style=style, tag_names=tag_names)
        desc = "tool_choice=" + (tool_choice if isinstance(tool_choice, str) else tool_choice["function"]["name"])
        return ConstraintSpec("tool_call", llg.LLMatcher.grammar_from_lark(lark), "tool_choice", desc)
    rf = request.get("response_format")
    if rf is not None:
        if not isinstance(rf, Mapping):
            raise ChatError("response_format must be an object", "response_format")
        t = rf.get("type")
        if t == "text":
            pass
        elif t == "json_object":
            return ConstraintSpec("json_object", llg.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, overrides=style), "response_format", "json_object")
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, Mapping):
                raise ChatError("response_format.json_schema must be an object with a 'schema'",
                                "response_format.json_schema")
            schema = js.get("schema", js.get("schema_"))
            if schema is None:
                schema = {}  # OpenAI allows omitting it: any JSON
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, Mapping):
                raise ChatError("response_format.json_schema.schema must be a JSON schema object",
                                "response_format.json_schema.schema")
            try:
                g = llg.LLMatcher.grammar_from_json_schema(dict(schema), overrides=style)
            except (ValueError, TypeError) as e:
                raise ChatError(f"response_format.json_schema.schema: {e}", "response_format.json_schema.schema") from None
            name = js.get("name") or "schema"
            return ConstraintSpec("json_schema", g, "response_format.json_schema.schema", f"json_schema {name}")
        else:
            raise ChatError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {t!r}",
                            "response_format.type")
    regex = request.get("regex")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ChatError("regex must be a non-empty string", "regex")
        return ConstraintSpec("regex", llg.LLMatcher.grammar_from_regex(regex), "regex", "regex")
    return None


# ------------------------------------------------------------------------------------ compiler


class GrammarCompiler:
    """One per server: the llguidance tokenizer of the model plus a small cache of validated grammars.

    ``tokenizer`` is a :class:`dsv41_jax.serving.tokenizer.Tokenizer` (its ``.hf`` HF tokenizer is
    serialized for llguidance) or the text of a ``tokenizer.json``. ``vocab_size`` is the model's
    logits width (may exceed the tokenizer's; the extra ids are never allowed under a grammar).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *, eos_token_ids: Sequence[int] | None = None,
                 whitespace_pattern: str | None = None, cache_size: int = 256,
                 tag_names: Sequence[str] = V41_TAG_NAMES):
        llg = _import_llguidance()
        self._llg = llg
        if isinstance(tokenizer, str):
            tok_json = tokenizer
            hf = None
        else:
            hf = getattr(tokenizer, "hf", tokenizer)
            tok_json = hf.to_str()
        if eos_token_ids is None:
            eos_token_ids = list(getattr(tokenizer, "eos_token_ids", ()) or [])
        eos = [int(t) for t in eos_token_ids]
        self.llg_tokenizer = llg.LLTokenizer(tok_json, eos_token=eos or None)
        self.tokenizer_vocab = int(self.llg_tokenizer.vocab_size)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.tokenizer_vocab
        self.eos_token_ids = eos or list(self.llg_tokenizer.eos_tokens)
        self.whitespace_pattern = whitespace_pattern
        self.tag_names = tuple(tag_names)  # the chat encoding's DSML tag names (`ChatFormat.tool_tag_names`)

        def tid(s):
            if hf is not None and hasattr(hf, "token_to_id"):
                return hf.token_to_id(s)
            if hasattr(tokenizer, "token_to_id"):
                return tokenizer.token_to_id(s)
            ids = self.llg_tokenizer.tokenize_str(s, parse_special=True)
            return ids[0] if len(ids) == 1 else None

        self.dsml_id = tid(DSML_TOKEN)
        self.think_close_id = tid(THINK_CLOSE_TOKEN)
        self._cache: "OrderedDict[str, str]" = OrderedDict()  # grammar -> "" (ok) | error
        self._cache_size = cache_size
        self._lock = threading.Lock()

    # -- building
    def spec_for_request(self, request: Mapping[str, Any], *, tools=None, tool_choice=None) -> ConstraintSpec | None:
        return constraint_spec_for_request(request, tools=tools, tool_choice=tool_choice, dsml_id=self.dsml_id,
                                           whitespace_pattern=self.whitespace_pattern, tag_names=self.tag_names)

    def validate(self, spec: ConstraintSpec) -> None:
        """Compile-check ``spec`` (cached); a grammar llguidance refuses -> ChatError (400)."""
        with self._lock:
            err = self._cache.get(spec.grammar)
            if err is not None:
                self._cache.move_to_end(spec.grammar)
        if err is None:
            is_err, msgs = self._llg.LLMatcher.validate_grammar_with_warnings(spec.grammar, self.llg_tokenizer)
            err = msgs[0] if is_err and msgs else ""
            with self._lock:
                self._cache[spec.grammar] = err
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if err:
            raise ChatError(f"{spec.param}: cannot be enforced: {err}", spec.param)

    def constraint(self, spec: ConstraintSpec | None, *, thinking: bool = False,
                   thinking_budget: int | None = None) -> "GrammarConstraint":
        """A fresh per-request constraint. ``thinking``: the grammar starts after ``</think>``;
        ``thinking_budget`` (thinking only): at most that many reasoning tokens, then ``</think>`` is
        forced. ``spec=None`` with a budget gives a budget-only constraint."""
        matcher = None
        if spec is not None:
            self.validate(spec)
            matcher = self._llg.LLMatcher(self.llg_tokenizer, spec.grammar, log_level=0)
            if matcher.is_error():
                raise ChatError(f"{spec.param}: cannot be enforced: {matcher.get_error()}", spec.param)
        gate = self.think_close_id if thinking else None
        if thinking and gate is None and thinking_budget is not None:
            raise ChatError("thinking_budget: this tokenizer has no </think> token", "thinking_budget")
        return GrammarConstraint(matcher, self.vocab_size, self.eos_token_ids, gate_token_id=gate, spec=spec,
                                 thinking_budget=thinking_budget if thinking else None,
                                 reasoning_excluded_ids=[self.dsml_id] if self.dsml_id is not None else ())

    def for_request(self, request: Mapping[str, Any], *, tools=None, tool_choice=None, thinking: bool = False,
                    thinking_budget: int | None = None) -> "GrammarConstraint | None":
        """The constraint of a request body, or None when it asks for none."""
        spec = self.spec_for_request(request, tools=tools, tool_choice=tool_choice)
        if spec is None and not (thinking and thinking_budget is not None):
            return None
        return self.constraint(spec, thinking=thinking, thinking_budget=thinking_budget)


# ---------------------------------------------------------------------------------- constraint


class GrammarConstraint:
    """Per-request (per-choice) grammar state, the object the engine applies before sampling.

    * ``allowed_mask()`` -> ``np.ndarray`` bool ``[vocab_size]`` of the tokens allowed next, or
      ``None`` when nothing is restricted (budget-only constraints outside the forced close); in the
      reasoning phase before a grammar every token but EOS is allowed;
    * ``bitmask()`` -> the same as packed ``int32 [ceil(V/32)]`` (bit i of word i // 32), or None;
    * ``accept(token_id) -> bool`` advances the grammar (False: the token was not allowed; the
      constraint then allows only EOS);
    * ``is_done()``: the grammar is complete and admits nothing but EOS;
    * ``fork()`` / ``clone()``: an independent copy (one per choice of an ``n > 1`` request);
    * ``rollback(k)``: undo the last ``k`` accepted tokens.

    ``matcher`` None: no grammar (only the reasoning gate / thinking budget).
    """

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int], *,
                 gate_token_id: int | None = None, spec: ConstraintSpec | None = None,
                 thinking_budget: int | None = None, reasoning_excluded_ids: Sequence[int] = ()):
        self._m = matcher
        # tokens the reasoning may not contain when a grammar follows: the DSML token (a line-initial
        # calls block inside reasoning ends it implicitly for the reasoning parser, docs/design/spec.md §10, while
        # the grammar would still wait for </think>; the forced markup belongs after </think>)
        self._reasoning_excluded = [int(t) for t in reasoning_excluded_ids]
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._gate_id = gate_token_id
        self._gated = gate_token_id is not None
        self._budget = thinking_budget if gate_token_id is not None else None
        self._free = 0  # reasoning tokens accepted so far
        self._history: list[tuple[str, int]] = []  # ("gate"|"free"|"grammar"|"eos"|"after"|"failed", token)
        self._failed = False
        self.spec = spec
        self.accepted = 0

    @property
    def active(self) -> bool:
        """Past the reasoning gate (the grammar, if any, is in force)."""
        return not self._gated

    def _only(self, ids) -> np.ndarray:
        m = np.zeros(self.vocab_size, dtype=bool)
        for t in ids:
            if 0 <= t < self.vocab_size:
                m[t] = True
        return m

    def _eos_only(self) -> np.ndarray:
        return self._only(self.eos_token_ids)

    def allowed_mask(self) -> np.ndarray | None:
        if self._gated:
            if self._budget is not None and self._free >= self._budget:
                return self._only([self._gate_id])  # the budget is spent: close the reasoning
            if self._m is not None:
                # a grammar is still to come: the output may not end inside the reasoning, nor
                # contain markup that the parsers would read as the end of the reasoning
                return ~self._only(self.eos_token_ids + self._reasoning_excluded)
            return None
        if self._m is None:
            return None
        if self._failed or self._m.is_error():
            return self._eos_only()
        raw = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if raw.size * 8 >= self.vocab_size:  # the usual case: the mask covers the logits' width
            out = np.unpackbits(raw, count=self.vocab_size, bitorder="little").view(bool)
        else:  # a tokenizer narrower than the logits: the padding ids are never allowed
            out = np.zeros(self.vocab_size, dtype=bool)
            out[: raw.size * 8] = np.unpackbits(raw, bitorder="little").view(bool)
        if not out.any():  # never leave the sampler without a choice
            return self._eos_only()
        return out

    def bitmask(self) -> np.ndarray | None:
        m = self.allowed_mask()
        if m is None:
            return None
        words = (self.vocab_size + 31) // 32
        padded = np.zeros(words * 32, dtype=bool)
        padded[: self.vocab_size] = m
        return np.packbits(padded, bitorder="little").view(np.int32).copy()

    def accept(self, token_id: int) -> bool:
        token_id = int(token_id)
        self.accepted += 1
        if self._gated:
            if token_id == self._gate_id:
                self._gated = False
                self._history.append(("gate", token_id))
            else:
                self._free += 1
                self._history.append(("free", token_id))
            return True
        if self._m is None:
            self._history.append(("after", token_id))
            return True
        if self._failed:
            self._history.append(("failed", token_id))
            return False
        if token_id in self.eos_token_ids and (self._m.is_accepting() or self._m.is_stopped()):
            self._history.append(("eos", token_id))
            return True
        ok = bool(self._m.consume_token(token_id))
        if not ok:
            log.warning("constrained decoding: token %d is not allowed by %s (%s); only EOS from now on",
                        token_id, self.spec.description if self.spec else "the grammar", self._m.get_error())
            self._failed = True
            self._history.append(("failed", token_id))
            return False
        self._history.append(("grammar", token_id))
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        ok = True
        for t in token_ids:
            ok = self.accept(t) and ok
        return ok

    def is_done(self) -> bool:
        if self._gated or self._m is None:
            return False
        return self._failed or bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        if self._gated:
            return False
        if self._m is None:
            return True
        return not self._failed and bool(self._m.is_accepting())

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens."""
        n_grammar = 0
        for _ in range(min(int(k), len(self._history))):
            kind, _tok = self._history.pop()
            self.accepted -= 1
            if kind == "grammar":
                n_grammar += 1
            elif kind == "gate":
                self._gated = True
            elif kind == "free":
                self._free -= 1
            elif kind == "failed":
                if not any(h[0] == "failed" for h in self._history):
                    self._failed = False
        if n_grammar:
            self._m.rollback(n_grammar)

    def fork(self) -> "GrammarConstraint":
        c = copy.copy(self)
        c._m = self._m.deep_copy() if self._m is not None else None
        c._history = list(self._history)
        return c

    clone = fork  # the engine's name for it

    def __repr__(self) -> str:
        state = "gated" if self._gated else ("failed" if self._failed else ("done" if self.is_done() else "active"))
        what = self.spec.description if self.spec else "thinking budget"
        return f"GrammarConstraint({what}, {state})"
