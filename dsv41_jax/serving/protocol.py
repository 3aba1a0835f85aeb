"""OpenAI request parsing / validation and response shapes for the server.

Requests are JSON objects checked field by field here (not by a schema library) so that every
refusal is an OpenAI error body naming the offending field::

    HTTP 400  {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

:class:`APIError` carries status, message, type, param and code; :func:`error_body` builds the JSON.
Unknown fields are ignored (clients send vendor extras through ``extra_body``), except
``logit_bias``, ``suffix`` and ``best_of`` != ``n``, which we cannot honour and refuse instead of
silently ignoring.

:func:`parse_chat_request` / :func:`parse_completion_request` return a :class:`ChatRequest` /
:class:`CompletionRequest`: the raw body plus the resolved :class:`SamplingParams`, streaming
options and the output options (logprobs, echo, separate_reasoning). Everything the chat encoder
owns (messages, tools, tool_choice, reasoning_effort, …) is validated by
:func:`dsv41_jax.chat_format.encoding.encode_chat_request` in the server.

Field rules (OpenAI / vLLM / SGLang semantics):

* ``max_tokens`` / ``max_completion_tokens`` (the latter wins): integer >= 1 or null; null means
  "up to the context length" (chat) — completions default to 16 like OpenAI; a value that does not
  fit beside the prompt in the context is a 400 (code ``context_length_exceeded``, checked by
  :func:`check_context`), as is a prompt that does not leave room for one token.
* ``temperature`` >= 0 (0 is greedy), ``top_p`` in (0, 1], ``top_k`` -1/0 (off) or >= 1, ``min_p`` in
  [0, 1], ``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0, ``seed``
  an integer, ``stop`` a string or a list of at most 16 non-empty strings, ``n`` in 1..max_n.
* chat ``logprobs`` a boolean and ``top_logprobs`` 0..20 (needs ``logprobs: true``); completions
  ``logprobs`` an integer 0..20; with ``echo`` (``n`` = 1, not streamed) it also asks for prompt
  logprobs, and ``max_tokens`` may be 0 (score the prompt alone).
* ``stream`` a boolean; ``stream_options`` only with ``stream: true`` and then an object with a
  boolean ``include_usage`` (and SGLang's ``continuous_usage_stats``).
* extras: ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
  ``include_stop_str_in_output`` / ``no_stop_trim``, ``separate_reasoning`` (false: reasoning stays in
  content), ``thinking_budget`` (an integer >= 0: at most that many reasoning tokens, then
  ``</think>`` is forced; only with thinking on), ``regex`` (constrained decoding).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .sampling import SamplingParams, SamplingParamsError

__all__ = [
    "APIError",
    "ENDPOINTS",
    "ChatRequest",
    "CompletionRequest",
    "MAX_LOGPROBS",
    "MAX_STOP",
    "check_context",
    "error_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_json_body",
    "usage_dict",
]

# Every route of the server: (method, path, what it does). `server.build_app` registers exactly
# these (the last two only for an engine that can pause); ``python -m dsv41_jax.serve --help`` and
# its start-up log list them.
ENDPOINTS = (
    ("POST", "/v1/chat/completions", "chat completions (thinking, tools, response_format, logprobs)"),
    ("POST", "/v1/completions", "completions (echo + logprobs scores the prompt)"),
    ("POST", "/tokenize", "a prompt or a chat -> token ids"),
    ("POST", "/detokenize", "token ids -> text"),
    ("GET", "/tokenizer_info", "the tokenizer's special tokens and limits"),
    ("GET", "/v1/models", "the served model"),
    ("GET", "/v1/models/{model_id}", "one model, by id or alias"),
    ("GET", "/health", "200 while serving (no API key needed)"),
    ("GET", "/metrics", "Prometheus metrics (404 with --disable-metrics)"),
    ("POST", "/pause_generation", "hold the engine between steps"),
    ("POST", "/continue_generation", "run again, or N steps"),
    ("POST", "/start_expert_distribution_record", "clear the routed-expert counts, record (--expert-distribution-recorder)"),
    ("POST", "/stop_expert_distribution_record", "stop recording (the counts are kept)"),
    ("POST", "/dump_expert_distribution_record", "write the counts to --expert-distribution-recorder-file"),
)

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_N = 128


class APIError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or _default_type(self.status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> "APIError":
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_chat_error(cls, e: Any) -> "APIError":
        return cls(400, getattr(e, "message", str(e)), param=getattr(e, "param", None), code=getattr(e, "code", None))


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The one error body of every endpoint: ``param`` and ``code`` are strings or null (as OpenAI's)."""
    for name, v in (("param", param), ("code", code)):
        if v is not None and not isinstance(v, str):
            raise TypeError(f"error_body: {name} must be a string or None, got {v!r}")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    if not raw:
        raise APIError.bad_request("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError.bad_request("request body is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError.bad_request(f"request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})",
                                   code="invalid_json") from None
    except RecursionError:
        raise APIError.bad_request("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError.bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


# ----------------------------------------------------------------------------------- field checks

_MISSING = object()


def _tname(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _bool(body: Mapping, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError.bad_request(f"{name} must be a boolean, got {_tname(v)}", name)
    return v


def _int(body: Mapping, name: str, default: Any = None, *, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 63:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError.bad_request(f"{name} must be an integer, got {_tname(v)}", name)
    if lo is not None and v < lo:
        raise APIError.bad_request(f"{name} must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise APIError.bad_request(f"{name} must be <= {hi}, got {v}", name)
    return v


def _num(body: Mapping, name: str, default: Any = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError.bad_request(f"{name} must be a number, got {_tname(v)}", name)
    if not math.isfinite(v):
        raise APIError.bad_request(f"{name} must be finite", name)
    return float(v)


def _stop(body: Mapping) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError.bad_request("stop must be a string or an array of strings", "stop")
    if len(v) > MAX_STOP:
        raise APIError.bad_request(f"stop may hold at most {MAX_STOP} strings, got {len(v)}", "stop")
    if any(s == "" for s in v):
        raise APIError.bad_request("stop strings must not be empty", "stop")
    return v


def _token_ids(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise APIError.bad_request(f"{name} must be an array of integers", name)
    if any(t < 0 for t in v):
        raise APIError.bad_request(f"{name} must hold non-negative token ids", name)
    return list(v)


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _stream(body: Mapping) -> tuple[bool, StreamOptions]:
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    opts = StreamOptions()
    if so is not None:
        if not isinstance(so, dict):
            raise APIError.bad_request("stream_options must be an object", "stream_options")
        if not stream:
            raise APIError.bad_request("stream_options is only allowed when stream is true", "stream_options")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise APIError.bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
        cu = so.get("continuous_usage_stats")
        if cu is not None and not isinstance(cu, bool):
            raise APIError.bad_request("stream_options.continuous_usage_stats must be a boolean",
                                       "stream_options.continuous_usage_stats")
        opts = StreamOptions(bool(iu), bool(cu))
    return stream, opts


def _model(body: Mapping) -> Optional[str]:
    m = body.get("model")
    if m is None:
        return None
    if not isinstance(m, str):
        raise APIError.bad_request(f"model must be a string, got {_tname(m)}", "model")
    return m


def _sampling(body: Mapping, *, max_tokens: Optional[int], logprobs: Optional[int], n: int,
              vocab_size: Optional[int], prompt_logprobs: Optional[int] = None) -> SamplingParams:
    kw: dict[str, Any] = dict(
        n=n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop=_stop(body),
    )
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _num(body, name)
        if v is not None:
            kw[name] = v
    t = kw.get("temperature")
    if t is not None and t < 0:
        raise APIError.bad_request(f"temperature must be >= 0, got {body.get('temperature')}", "temperature")
    top_p = kw.get("top_p")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise APIError.bad_request(f"top_p must be in (0, 1], got {body.get('top_p')}", "top_p")
    top_k = _int(body, "top_k")
    if top_k is not None:
        if top_k < -1:
            raise APIError.bad_request(f"top_k must be -1 or 0 (off) or >= 1, got {top_k}", "top_k")
        kw["top_k"] = top_k
    seed = _int(body, "seed")
    if seed is not None:
        kw["seed"] = seed
    mt = _int(body, "min_tokens", lo=0)
    if mt is not None:
        kw["min_tokens"] = mt
    if body.get("stop_token_ids") is not None:
        kw["stop_token_ids"] = _token_ids(body["stop_token_ids"], "stop_token_ids")
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
        if body.get(name) is not None:
            kw[name] = _bool(body, name, False)
    if body.get("include_stop_str_in_output") is not None:
        kw["include_stop_str_in_output"] = _bool(body, "include_stop_str_in_output", False)
    elif body.get("no_stop_trim") is not None:  # SGLang's spelling
        kw["include_stop_str_in_output"] = _bool(body, "no_stop_trim", False)
    try:
        sp = SamplingParams(**kw)
        sp.validate(max_logprobs=MAX_LOGPROBS, vocab_size=vocab_size)
    except SamplingParamsError as e:
        raise APIError.bad_request(str(e), e.field) from None
    return sp


def _unsupported(body: Mapping) -> None:
    lb = body.get("logit_bias")
    if lb not in (None, {}):
        raise APIError.bad_request("logit_bias is not supported by this server", "logit_bias")


def _max_tokens(body: Mapping, default: Optional[int], lo: int = 1) -> Optional[int]:
    names = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    if not names:
        return default
    name = names[0]
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise APIError.bad_request(f"{name} must be an integer, got {_tname(v)}", name)
    if v < lo:
        hint = "" if lo == 0 else " (0 only with echo: score the prompt alone)"
        raise APIError.bad_request(f"{name} must be at least {lo}, got {v}{hint}", name)
    return v


def _n(body: Mapping, max_n: int) -> int:
    return _int(body, "n", 1, lo=1, hi=max_n)


# ---------------------------------------------------------------------------------------- chat


@dataclass
class ChatRequest:
    body: dict
    model: Optional[str]
    sampling: SamplingParams
    stream: bool
    stream_options: StreamOptions
    logprobs: bool
    top_logprobs: int
    separate_reasoning: bool = True
    max_tokens_explicit: bool = False
    max_tokens_param: str = "max_tokens"
    thinking_budget: Optional[int] = None


def parse_chat_request(body: dict, *, vocab_size: Optional[int] = None, max_n: int = MAX_N) -> ChatRequest:
    """Validate the sampling / streaming / output fields of a chat-completion body."""
    model = _model(body)
    if body.get("messages") is None:
        raise APIError.bad_request("messages is required", "messages")
    stream, so = _stream(body)
    _unsupported(body)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and top > 0 and not logprobs:
        raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    n = _n(body, max_n)
    mt = _max_tokens(body, None)
    sp = _sampling(body, max_tokens=mt, logprobs=(top or 0) if logprobs else None, n=n, vocab_size=vocab_size)
    sep = _bool(body, "separate_reasoning", True)
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    budget = _int(body, "thinking_budget", None, lo=0)
    return ChatRequest(body, model, sp, stream, so, logprobs, top or 0, sep, mt is not None, param, budget)


# ---------------------------------------------------------------------------------- completions


@dataclass
class CompletionRequest:
    body: dict
    model: Optional[str]
    prompts: list  # each a str or a list of token ids
    sampling: SamplingParams
    stream: bool
    stream_options: StreamOptions
    logprobs: Optional[int]
    echo: bool
    max_tokens_explicit: bool = True
    max_tokens_param: str = "max_tokens"


def _prompts(body: Mapping, vocab_size: Optional[int]) -> list:
    p = body.get("prompt", _MISSING)
    if p is _MISSING or p is None:
        raise APIError.bad_request("prompt is required", "prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        if not p:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            out = [_check_ids(p, "prompt", vocab_size)]
            return out
        if all(isinstance(x, list) for x in p):
            return [_check_ids(x, f"prompt[{i}]", vocab_size) for i, x in enumerate(p)]
    raise APIError.bad_request("prompt must be a string, an array of strings, an array of token ids or an array "
                               "of token-id arrays", "prompt")


def _check_ids(ids: list, name: str, vocab_size: Optional[int]) -> list[int]:
    ids = _token_ids(ids, name)
    if not ids:
        raise APIError.bad_request(f"{name} must not be empty", name)
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        raise APIError.bad_request(f"{name} holds a token id >= the vocabulary size {vocab_size}", name)
    return ids


def parse_completion_request(body: dict, *, vocab_size: Optional[int] = None, max_n: int = MAX_N,
                             max_prompts: int = 256) -> CompletionRequest:
    model = _model(body)
    prompts = _prompts(body, vocab_size)
    if len(prompts) > max_prompts:
        raise APIError.bad_request(f"at most {max_prompts} prompts per request, got {len(prompts)}", "prompt")
    stream, so = _stream(body)
    _unsupported(body)
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise APIError.bad_request("suffix is not supported by this model", "suffix")
    echo = _bool(body, "echo", False)
    lp = body.get("logprobs")
    if isinstance(lp, bool):  # a chat-style boolean: true means "the sampled token's logprob"
        lp = 0 if lp else None
        body = dict(body, logprobs=lp)
    lp = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    n = _n(body, max_n)
    if echo and lp is not None and n > 1:
        raise APIError.bad_request("echo with logprobs needs n = 1 (the prompt logprobs are the same for every "
                                   f"sample), got n={n}", "n")
    if echo and lp is not None and stream:
        raise APIError.bad_request("echo with logprobs is not supported with stream=true", "stream")
    bo = _int(body, "best_of", None, lo=1)
    if bo is not None and bo != n:
        raise APIError.bad_request("best_of other than n is not supported", "best_of")
    mt = _max_tokens(body, 16, lo=0 if echo else 1)
    if mt == 0 and n > 1:
        raise APIError.bad_request("max_tokens=0 (score the prompt alone) needs n = 1", "n")
    # echo + logprobs: prompt logprobs (also computed for max_tokens=0 without logprobs: nothing to sample)
    plp = (lp if lp is not None else 0) if echo and (lp is not None or mt == 0) else None
    sp = _sampling(body, max_tokens=mt, logprobs=lp, n=n, vocab_size=vocab_size, prompt_logprobs=plp)
    return CompletionRequest(body, model, prompts, sp, stream, so, lp, echo)


# ----------------------------------------------------------------------------------- limits


def check_context(prompt_len: int, sp: SamplingParams, context_length: int, *, explicit: bool,
                  param: str = "max_tokens", prompt_param: str = "messages") -> SamplingParams:
    """Check the prompt and ``max_tokens`` against the context; fill ``max_tokens`` when null.
    param / prompt_param: the fields a refusal names (``prompt`` for completions, ``messages`` for chat)."""
    if prompt_len >= context_length:
        raise APIError(400, f"This model's maximum context length is {context_length} tokens. However, your "
                            f"prompt has {prompt_len} tokens, which leaves no room for output.",
                       param=prompt_param, code="context_length_exceeded")
    room = context_length - prompt_len
    if sp.max_tokens is None:
        return sp.replace(max_tokens=room)
    if sp.max_tokens > room:
        if not explicit:  # a default (16) that does not fit: clip silently
            return sp.replace(max_tokens=room)
        raise APIError(400, f"This model's maximum context length is {context_length} tokens. However, you "
                            f"requested {prompt_len + sp.max_tokens} tokens ({prompt_len} in the prompt, "
                            f"{sp.max_tokens} for the completion). Please reduce the prompt or {param}.",
                       param=param, code="context_length_exceeded")
    return sp


def usage_dict(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
               cached_tokens: int | None = None) -> dict:
    u: dict[str, Any] = {
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": int(completion_tokens),
        "total_tokens": int(prompt_tokens) + int(completion_tokens),
    }
    if reasoning_tokens is not None:  # OpenAI's place for it (no top-level duplicate)
        u["completion_tokens_details"] = {"reasoning_tokens": int(reasoning_tokens)}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": int(cached_tokens)}
    return u
