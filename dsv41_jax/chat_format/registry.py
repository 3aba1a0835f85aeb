"""Which chat encoding a model family uses (`ModelConfig.model_family`): the server and `LLM.chat` pick it
from the checkpoint's config.

* ``"deepseek_v41"``: `encoding.encode_chat_request` (``wording=``, ``server_defaults=`` with 1..100 budgets);
* ``"deepseek_v4"``: `encoding_v4.encode_chat_request_v4` (``wording=``, ``default_thinking=``,
  ``default_effort=`` None / "high" / "max"), wording from `encoding_v4.load_v4_wording`.
"""

from __future__ import annotations

from typing import Callable

CHAT_FAMILIES = ("deepseek_v41", "deepseek_v4")


def chat_encoder(model_family: str) -> Callable:
    """The chat-request encoder of ``model_family``; ValueError for a family without one."""
    if model_family == "deepseek_v41":
        from .encoding import encode_chat_request

        return encode_chat_request
    if model_family == "deepseek_v4":
        from .encoding_v4 import encode_chat_request_v4

        return encode_chat_request_v4
    raise ValueError(f"no chat encoding for model family {model_family!r} (known: {', '.join(CHAT_FAMILIES)})")
