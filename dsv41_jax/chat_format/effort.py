"""The thinking switch and the ``reasoning_effort`` contract (docs/design/spec.md §10, "Thinking switch" and
"Effort values").

Everything here is pure Python and independent of the server: the server calls
:func:`resolve_thinking` once per chat request and :meth:`ServerDefaults.from_env` once at startup
(a bad ``DSV41_DEFAULT_THINKING`` / ``DSV41_REASONING_EFFORT`` fails there, not per request).

Contract (docs/design/spec.md §10):

* Thinking is off by default (env ``DSV41_DEFAULT_THINKING``).
* Top-level ``reasoning_effort`` (or the OpenAI ``reasoning.effort``), or a truthy
  ``reasoning.enabled``, turns thinking on unless the effort is ``"none"``, which turns it off.
  An explicit ``chat_template_kwargs.thinking`` always wins.
* Top-level values: ``none``, ``minimal``, ``low``, ``medium``, ``high``, ``xhigh``, ``max``, or a
  number / numeric string in [0, 0.99] -> ``min(100, max(1, round_half_even(100 * v)))``.
* ``chat_template_kwargs.reasoning_effort`` replaces the top-level value without switching thinking
  on, and also takes an integer budget 1..100.
* Booleans, out-of-range values and unknown tier names -> :class:`ChatError` (HTTP 400) naming the
  parameter.
* Tier table: the checkpoint encoder's ``REASONING_EFFORT_MAPPINGS`` when present, else
  low 50 / high 75 / max 100, default ``high``; ``xhigh`` -> the ``high`` tier (75 by default);
  ``minimal`` and ``medium`` (OpenAI tiers without a V4.1 counterpart) log a warning and use the
  server default; any other string is refused (400), as OpenAI refuses it.

Resolutions of points the SPEC leaves open (documented, tested in tests/test_chat.py):

* ``xhigh`` is an alias of the table's ``high`` entry unless the table has its own ``xhigh``.
* Tier strings are matched case-insensitively after stripping blanks.
* ``"none"`` given through ``chat_template_kwargs.reasoning_effort`` also turns thinking off (it
  replaces the top-level value); any other ``chat_template_kwargs`` value never switches thinking.
* An explicit ``reasoning.enabled: false`` turns thinking off when no effort value decides it.
* ``chat_template_kwargs.enable_thinking`` (the Hugging Face spelling) is accepted as an alias of
  ``chat_template_kwargs.thinking`` (``thinking`` wins when both are given); either must be a
  boolean.
* The integer form is for integers only: ``50.0`` is a float and must lie in [0, 0.99].
* ``reasoning_effort`` top level wins over ``reasoning.effort`` when both are given (both are
  validated).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from typing import Any, Mapping

__all__ = [
    "ChatError",
    "ConfigError",
    "DEFAULT_EFFORT_TIERS",
    "DEFAULT_EFFORT_TIER",
    "OPENAI_EFFORT_TIERS",
    "ServerDefaults",
    "effort_from_fraction",
    "parse_bool_env",
    "parse_tier_table",
    "resolve_thinking",
    "tier_budget",
]

log = logging.getLogger(__name__)

ENV_DEFAULT_THINKING = "DSV41_DEFAULT_THINKING"
ENV_REASONING_EFFORT = "DSV41_REASONING_EFFORT"

DEFAULT_EFFORT_TIERS: dict[str, int] = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT_TIER = "high"
# Tier names the OpenAI API knows; the ones without a V4.1 counterpart warn and use the default.
OPENAI_EFFORT_TIERS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

_NUMERIC_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")


class ChatError(ValueError):
    """A request the chat layer refuses (the server answers 400 with ``param``).

    Defined here (the lowest module of the chat layer) so that effort, tools and chat share it;
    ``dsv41_jax.chat_format.encoding`` re-exports it.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        """The OpenAI error body for this error."""
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


class ConfigError(ValueError):
    """A bad server-side setting (raised at startup)."""


# ----------------------------------------------------------------------------------- helpers


def effort_from_fraction(value: float | str | Decimal) -> int:
    """``min(100, max(1, round_half_even(100 * v)))`` computed on the decimal value as written.

    Floats go through ``repr`` (the shortest round-tripping decimal), so ``0.125`` -> 12 and
    ``0.135`` -> 14 exactly as the decimal literal reads, independent of binary rounding.
    """
    d = value if isinstance(value, Decimal) else Decimal(repr(value) if isinstance(value, float) else str(value))
    n = int((d * 100).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))
    return min(100, max(1, n))


def tier_budget(name: str, tiers: Mapping[str, int]) -> int | None:
    """The budget of tier ``name`` (already normalised) or None if the table has no such tier."""
    if name in tiers:
        return int(tiers[name])
    if name == "xhigh" and "high" in tiers:
        return int(tiers["high"])
    return None


def parse_tier_table(spec: str | Mapping[str, Any]) -> dict[str, int]:
    """Parse a tier table: a mapping or a ``"low=50,high=75,max=100"`` string. Values 1..100."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part and ":" not in part:
                raise ConfigError(f"bad tier table entry {part!r} (expected name=budget)")
            k, v = re.split(r"[=:]", part, maxsplit=1)
            items.append((k, v))
    out: dict[str, int] = {}
    for k, v in items:
        name = str(k).strip().lower()
        if not name or name == "none":
            raise ConfigError(f"bad tier name {k!r}")
        if isinstance(v, bool):
            raise ConfigError(f"tier {name!r}: budget must be an integer 1..100, got {v!r}")
        try:
            iv = int(str(v).strip()) if not isinstance(v, int) else v
        except ValueError:
            raise ConfigError(f"tier {name!r}: budget must be an integer 1..100, got {v!r}") from None
        if not 1 <= iv <= 100:
            raise ConfigError(f"tier {name!r}: budget must be an integer 1..100, got {v!r}")
        out[name] = iv
    if not out:
        raise ConfigError("empty tier table")
    return out


def parse_bool_env(value: str | None, name: str, default: bool = False) -> bool:
    """Parse a boolean environment value (1/0, true/false, yes/no, on/off); bad -> ConfigError."""
    if value is None or value.strip() == "":
        return default
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on", "y", "t"):
        return True
    if v in ("0", "false", "no", "off", "n", "f"):
        return False
    raise ConfigError(f"{name}={value!r}: expected a boolean (true/false, 1/0, yes/no, on/off)")


@dataclass(frozen=True)
class ServerDefaults:
    """Server-side defaults for the thinking switch and the effort budget.

    ``tiers`` is the tier table (the checkpoint's ``REASONING_EFFORT_MAPPINGS`` when present);
    ``default_effort`` is the resolved integer budget used when a request names no usable effort.
    """

    default_thinking: bool = False
    default_effort: int = DEFAULT_EFFORT_TIERS[DEFAULT_EFFORT_TIER]
    tiers: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_EFFORT_TIERS))

    def __post_init__(self):
        if isinstance(self.default_effort, bool) or not isinstance(self.default_effort, int) or not (
            1 <= self.default_effort <= 100
        ):
            raise ConfigError(f"default_effort must be an integer 1..100, got {self.default_effort!r}")
        object.__setattr__(self, "tiers", parse_tier_table(self.tiers))

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        wording: Any = None,
        tiers: Mapping[str, int] | str | None = None,
        default_thinking: bool | None = None,
        default_effort: str | int | None = None,
    ) -> "ServerDefaults":
        """Build the defaults at startup; a bad value raises :class:`ConfigError`.

        Precedence per field: explicit argument (a server flag) > environment > checkpoint wording
        (``wording.effort_mappings`` / ``wording.default_effort``) > built-in defaults.
        ``DSV41_REASONING_EFFORT`` takes a tier of the table (``xhigh`` = ``high``) or 1..100.
        """
        env = os.environ if environ is None else environ
        if tiers is None:
            tiers = getattr(wording, "effort_mappings", None) or DEFAULT_EFFORT_TIERS
        table = parse_tier_table(tiers)

        if default_thinking is None:
            default_thinking = parse_bool_env(env.get(ENV_DEFAULT_THINKING), ENV_DEFAULT_THINKING)

        source = ENV_REASONING_EFFORT
        if default_effort is None:
            raw = env.get(ENV_REASONING_EFFORT)
            if raw is not None and raw.strip() != "":
                default_effort = raw
            else:
                source = "checkpoint default effort"
                default_effort = getattr(wording, "default_effort", None) or DEFAULT_EFFORT_TIER
        else:
            source = "default effort"
        budget = _startup_effort(default_effort, table, source)
        return cls(default_thinking=bool(default_thinking), default_effort=budget, tiers=table)


def _startup_effort(value: str | int, tiers: Mapping[str, int], source: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{source}={value!r}: expected a tier ({', '.join(tiers)}) or an integer 1..100")
    if isinstance(value, int):
        if 1 <= value <= 100:
            return value
        raise ConfigError(f"{source}={value!r}: an integer budget must be 1..100")
    s = str(value).strip().lower()
    if re.fullmatch(r"[+-]?\d+", s):
        iv = int(s)
        if 1 <= iv <= 100:
            return iv
        raise ConfigError(f"{source}={value!r}: an integer budget must be 1..100")
    b = tier_budget(s, tiers)
    if b is None:
        names = sorted(set(tiers) | ({"xhigh"} if "high" in tiers else set()))
        raise ConfigError(f"{source}={value!r}: expected a tier ({', '.join(names)}) or an integer 1..100")
    return b


# ----------------------------------------------------------------------------------- requests

# A parsed effort value: ("none", None) | ("budget", int) | ("default", None)
_Effort = tuple


def _parse_effort(value: Any, param: str, tiers: Mapping[str, int], warnings: list[str], *, allow_int: bool) -> _Effort:
    what = (
        "one of none, minimal, low, medium, high, xhigh, max, a number in [0, 0.99]"
        + (" or an integer budget 1..100" if allow_int else
           " (integer budgets 1..100 go in chat_template_kwargs.reasoning_effort)")
    )
    if isinstance(value, bool):
        raise ChatError(f"{param} must be {what}; booleans are not accepted, got {value!r}", param)
    if isinstance(value, int):
        if value == 0:
            return ("budget", 1)  # 0 lies in [0, 0.99]: max(1, 0) = 1
        if allow_int and 1 <= value <= 100:
            return ("budget", value)
        raise ChatError(f"{param} must be {what}, got {value!r}", param)
    if isinstance(value, float):
        if math.isfinite(value) and 0.0 <= value <= 0.99:
            return ("budget", effort_from_fraction(value))
        raise ChatError(f"{param} must be {what}, got {value!r}", param)
    if isinstance(value, str):
        s = value.strip()
        if _NUMERIC_RE.match(s):
            try:
                d = Decimal(s)
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                raise ChatError(f"{param} must be {what}, got {value!r}", param) from None
            if Decimal(0) <= d <= Decimal("0.99"):
                return ("budget", effort_from_fraction(d))
            raise ChatError(f"{param} must be {what}, got {value!r}", param)
        name = s.lower()
        if name == "none":
            return ("none", None)
        b = tier_budget(name, tiers)
        if b is not None:
            return ("budget", b)
        if name in OPENAI_EFFORT_TIERS:  # an OpenAI tier the table lacks (minimal, medium): the default
            msg = f"{param}={value!r} has no DeepSeek-V4.1 counterpart; using the server default effort"
            log.warning(msg)
            warnings.append(msg)
            return ("default", None)
        raise ChatError(f"{param} must be {what}, got {value!r}", param)  # OpenAI refuses unknown tiers too
    raise ChatError(f"{param} must be {what}, got a {type(value).__name__}", param)


def _explicit_bool(value: Any, param: str) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    raise ChatError(f"{param} must be a boolean, got {value!r}", param)


def resolve_thinking(
    request: Mapping[str, Any], server_defaults: ServerDefaults | None = None
) -> tuple[bool, int | None, list[str]]:
    """Resolve a chat request's thinking switch and effort budget (docs/design/spec.md §10).

    Returns ``(thinking, effort, warnings)``: ``effort`` is the integer budget 1..100 to render in
    the effort line when ``thinking`` is on, else None. Raises :class:`ChatError` (400) for
    booleans, out-of-range values and wrongly typed fields.
    """
    d = server_defaults or ServerDefaults()
    tiers = d.tiers
    warnings: list[str] = []

    ctk = request.get("chat_template_kwargs")
    if ctk is None:
        ctk = {}
    if not isinstance(ctk, Mapping):
        raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
    reasoning = request.get("reasoning")
    if reasoning is None:
        reasoning = {}
    if not isinstance(reasoning, Mapping):
        raise ChatError("reasoning must be an object", "reasoning")

    top = None
    top_param = None
    if request.get("reasoning_effort") is not None:
        top = _parse_effort(request["reasoning_effort"], "reasoning_effort", tiers, warnings, allow_int=False)
        top_param = "reasoning_effort"
    if reasoning.get("effort") is not None:
        other = _parse_effort(reasoning["effort"], "reasoning.effort", tiers,
                              warnings if top is None else [], allow_int=False)
        if top is None:
            top, top_param = other, "reasoning.effort"
    kw = None
    if ctk.get("reasoning_effort") is not None:
        kw = _parse_effort(ctk["reasoning_effort"], "chat_template_kwargs.reasoning_effort", tiers, warnings,
                           allow_int=True)

    # The switch: top-level effort (on unless "none") > reasoning.enabled > server default;
    # "none" through chat_template_kwargs also turns it off; an explicit kwarg wins over all.
    switch: bool | None = None
    if top is not None:
        switch = top[0] != "none"
    elif reasoning.get("enabled") is not None:
        switch = bool(reasoning.get("enabled"))
    if kw is not None and kw[0] == "none":
        switch = False
    explicit = _explicit_bool(ctk.get("thinking"), "chat_template_kwargs.thinking")
    alias = _explicit_bool(ctk.get("enable_thinking"), "chat_template_kwargs.enable_thinking")
    if explicit is None:
        explicit = alias
    if explicit is not None:
        thinking = explicit
    elif switch is not None:
        thinking = switch
    else:
        thinking = d.default_thinking

    if not thinking:
        return False, None, warnings
    effective = kw if kw is not None else top
    if effective is not None and effective[0] == "budget":
        return True, int(effective[1]), warnings
    if effective is not None and effective[0] == "none":
        src = "chat_template_kwargs.reasoning_effort" if kw is not None else top_param
        msg = f"{src}='none' with thinking forced on by chat_template_kwargs; using the server default effort"
        log.warning(msg)
        warnings.append(msg)
    return True, d.default_effort, warnings
