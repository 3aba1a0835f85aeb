"""Which chat encoding a model uses, chosen once from the checkpoint (`ModelConfig.model_family`).

`ChatFormat.for_model` is the one place the choice is made; the server (serve.py, dynamo/frontend.py: its
`ServerConfig.chat_format`, read by serving/server/chat.py and tokenize.py) and `LLM.chat` build one and call
`ChatFormat.encode`:

* ``"deepseek_v41"``: `encoding.encode_chat_request` with the checkpoint's `encoding.load_wording` and
  `effort.ServerDefaults` (thinking switch, 1..100 effort budgets and tiers; DSV41_* environment);
* ``"deepseek_v4"``: `encoding_v4.encode_chat_request_v4` with `encoding_v4.load_v4_wording`; SGLang's mapping
  of ``reasoning_effort`` onto Non-think / Think High / Think Max (`encoding_v4.resolve_v4_thinking`); server
  defaults from ``DSV41_DEFAULT_THINKING`` (as for V4.1) and ``DSV4_REASONING_EFFORT`` ("high" / "max" / empty:
  SGLang's ``SGLANG_DSV4_REASONING_EFFORT``). V4 has no effort tiers: a tier table is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

CHAT_FAMILIES = ("deepseek_v41", "deepseek_v4")
ENV_V4_REASONING_EFFORT = "DSV4_REASONING_EFFORT"


def chat_encoder(model_family: str) -> Callable:
    """The chat-request encoder of ``model_family``; ValueError for a family without one."""
    if model_family == "deepseek_v41":
        from .encoding import encode_chat_request

        return encode_chat_request
    if model_family == "deepseek_v4":
        from .encoding_v4 import encode_chat_request_v4

        return encode_chat_request_v4
    raise ValueError(f"no chat encoding for model family {model_family!r} (known: {', '.join(CHAT_FAMILIES)})")


def family_of_dir(model_dir: str | Path | None) -> str:
    """The chat family of a model directory from its ``config.json`` ``model_type`` (top level or
    ``text_config``, as `model.config_v4.is_v4_dict` reads it): "deepseek_v4", else "deepseek_v41" (also for
    None / a directory without a config: the bundled tiny / nano models)."""
    f = Path(model_dir) / "config.json" if model_dir is not None else None
    if f is None or not f.is_file():
        return "deepseek_v41"
    d = json.loads(f.read_text(encoding="utf-8"))
    types = {d.get("model_type"), (d.get("text_config") or {}).get("model_type")}
    return "deepseek_v4" if "deepseek_v4" in types else "deepseek_v41"


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat encoding: family, the checkpoint's wording and the server's defaults.

    server_defaults: V4.1's `effort.ServerDefaults` (None: thinking off, effort from the wording).
    default_thinking / default_effort: V4's (effort None, "high" or "max")."""

    family: str = "deepseek_v41"
    wording: Any = None
    server_defaults: Any = None
    default_thinking: bool = False
    default_effort: str | None = None

    @classmethod
    def for_model(cls, model_dir: str | Path | None, family: str | None = None, *, tiers: Any = None,
                  environ: Mapping[str, str] | None = None) -> "ChatFormat":
        """The chat format of a model directory (None: the bundled models' defaults); family None: from its
        config.json (`family_of_dir`). tiers: V4.1's ``--reasoning-effort-tiers``. Bad settings raise
        `effort.ConfigError`; an unknown family ValueError."""
        from .effort import ENV_DEFAULT_THINKING, ConfigError, ServerDefaults, parse_bool_env

        family = family or family_of_dir(model_dir)
        env = os.environ if environ is None else environ
        if family == "deepseek_v41":
            from .encoding import load_wording

            wording = load_wording(model_dir)
            return cls(family, wording, ServerDefaults.from_env(env, wording=wording, tiers=tiers))
        if family != "deepseek_v4":
            raise ValueError(f"no chat encoding for model family {family!r} (known: {', '.join(CHAT_FAMILIES)})")
        from .encoding_v4 import V4_EFFORTS, load_v4_wording

        if tiers is not None:
            raise ConfigError("reasoning-effort tiers are V4.1's; a DeepSeek-V4 model has Non-think / Think High / "
                              f"Think Max (set {ENV_V4_REASONING_EFFORT} to 'high' or 'max')")
        effort = (env.get(ENV_V4_REASONING_EFFORT) or "").strip().lower() or None
        if effort not in (None,) + V4_EFFORTS:
            raise ConfigError(f"{ENV_V4_REASONING_EFFORT}={effort!r}: 'high', 'max' or empty")
        return cls(family, load_v4_wording(model_dir), None,
                   parse_bool_env(env.get(ENV_DEFAULT_THINKING), ENV_DEFAULT_THINKING), effort)

    def encode(self, request: Mapping[str, Any], *, render_response_format: bool = False, add_bos: bool = True):
        """Resolve and encode a chat-completion request body (`encoding.EncodedChat` /
        `encoding_v4.EncodedV4Chat`: prompt, thinking, effort, tools, tool_choice, parse_tools, warnings).
        Raises `effort.ChatError` (400) for anything invalid."""
        enc = chat_encoder(self.family)
        if self.family == "deepseek_v41":
            return enc(request, wording=self.wording, server_defaults=self.server_defaults,
                       render_response_format=render_response_format, add_bos=add_bos)
        return enc(request, wording=self.wording, default_thinking=self.default_thinking,
                   default_effort=self.default_effort, render_response_format=render_response_format, add_bos=add_bos)

    @property
    def tool_tag_names(self) -> tuple:
        """The DSML (calls, invoke, parameter) tag names this encoding writes, which a ``tool_choice`` grammar
        forces (`serving.constrained.tool_call_lark`): V4.1's spaced ones, V4's ``tool_calls`` / ``invoke`` /
        ``parameter``."""
        if self.family == "deepseek_v41":
            from .dsml import V41_TAG_NAMES

            return V41_TAG_NAMES
        from .encoding_v4 import V4_TAG_NAMES

        return V4_TAG_NAMES

    def describe(self) -> str:
        """One log line: the family, thinking / effort defaults and where the wording came from."""
        source = getattr(self.wording, "source", None) or "ours"
        if self.family == "deepseek_v41":
            d = self.server_defaults
            if d is None:
                return f"V4.1 chat encoding; wording: {source}"
            return (f"V4.1 chat encoding: thinking {'on' if d.default_thinking else 'off'} by default, default effort "
                    f"{d.default_effort}, tiers {dict(d.tiers)}; wording: {source}")
        return (f"DeepSeek-V4 chat encoding: thinking {'on' if self.default_thinking else 'off'} by default, effort "
                f"{self.default_effort or 'none'} by default (Non-think / Think High / Think Max); wording: {source}")
