"""``POST /v1/chat/completions``: V4.1 chat encoding (`dsv41_jax.chat_format`), the
``deepseek-v41`` reasoning parser into ``reasoning_content``, the ``deepseekv41`` DSML tool-call
parser into ``tool_calls``; ``response_format`` / ``tool_choice`` required-or-named enforced by
llguidance masks; SSE streaming with ``stream_options.include_usage`` (and
``continuous_usage_stats``).

Text: the engine's detokenizer, told which special tokens the parsers need
(`reasoning.chat_text_specials`: ``｜DSML｜`` with tools, ``<think>`` / ``</think>`` while thinking;
every other special token is dropped). Usage counts every generated token; ``reasoning_tokens``
those before ``</think>``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Mapping

from fastapi import FastAPI, Request

from dsv41_jax.chat_format.effort import ChatError
from dsv41_jax.chat_format.encoding import EncodedChat
from dsv41_jax.serving.protocol import APIError, ChatRequest, check_context, parse_chat_request
from dsv41_jax.serving.reasoning import ChatOutputParser, OutputDelta, chat_text_specials

from .context import ServerContext
from .responses import Choice, Envelope, GenerationRun, json_response, logprob, sse, sse_response

__all__ = ["ChatChoice", "register"]


class ChatChoice(Choice):
    """A chat choice: the output parser over its text, the reasoning token count, the parsed parts."""

    def __init__(self, index: int, parser: ChatOutputParser, think_close_id: Any, thinking: bool):
        super().__init__(index)
        self.parser = parser
        self.think_close_id = think_close_id
        self.reasoning_tokens = 0
        self._reasoning_open = thinking and parser.in_reasoning
        self.reasoning = ""  # the parsed parts so far
        self.content = ""
        self.delta = OutputDelta()  # what the last update parsed into
        self.ends_with_stop_token = False  # the last token is the stop token (EOS) that ended the choice

    @property
    def num_text_tokens(self) -> int:
        """The tokens of the message: all but a stop token (EOS) that ended the choice (it is neither
        text nor reasoning, and OpenAI's logprobs have no entry for it; usage still counts it)."""
        return len(self.token_ids) - self.ends_with_stop_token

    def add(self, c: Any) -> str:
        """Take one delta output: count reasoning tokens, parse the new text into `delta`."""
        ids = list(c.token_ids)
        if c.finish_reason is not None and isinstance(c.stop_reason, int) and ids and ids[-1] == c.stop_reason:
            ids = ids[:-1]  # the stop token (EOS) that ended the choice is not reasoning
            self.ends_with_stop_token = True
        if self._reasoning_open:
            for t in ids:
                if t == self.think_close_id:
                    self._reasoning_open = False
                    break
                self.reasoning_tokens += 1
        text = super().add(c)
        self.delta = self.parse(text)
        return text

    def end(self, reason: str = "abort") -> None:
        super().end(reason)
        self.delta = self.parse("")

    def parse(self, text: str) -> OutputDelta:
        """Run the output parser on new text (and finish it when the choice is done)."""
        delta = OutputDelta()
        if text:
            d = self.parser.feed(text)
            delta.reasoning, delta.content, delta.tool_calls = d.reasoning, d.content, list(d.tool_calls)
        if self._reasoning_open and not self.parser.in_reasoning:
            self._reasoning_open = False  # an implicit close (a DSML block inside reasoning)
        if self.done:
            d = self.parser.finish()
            delta.reasoning += d.reasoning
            delta.content += d.content
            delta.tool_calls += d.tool_calls
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    def finish_reason_out(self) -> str:
        return self.parser.finish_reason(self.finish_reason or "stop")


def chat_logprobs(tokenizer: Any, ch: ChatChoice, start: int, end: int, top: int) -> list:
    """``logprobs.content`` items of tokens ``start:end`` (token, logprob, bytes, top_logprobs); none
    for the stop token that ended the choice (`ChatChoice.num_text_tokens`)."""
    out = []
    for j in range(start, min(end, len(ch.logprobs), ch.num_text_tokens)):
        b = tokenizer.token_bytes(ch.token_ids[j])
        item = {"token": b.decode("utf-8", errors="replace"), "logprob": logprob(ch.logprobs[j]), "bytes": list(b),
                "top_logprobs": []}
        tops = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
        for t, lp in (tops or [])[:top]:
            tb = tokenizer.token_bytes(t)
            item["top_logprobs"].append({"token": tb.decode("utf-8", errors="replace"), "logprob": logprob(lp),
                                         "bytes": list(tb)})
        out.append(item)
    return out


def choice_body(tokenizer: Any, c: ChatChoice, req: ChatRequest, separated: bool) -> dict:
    """A finished choice of a non-streaming response: the message (content, reasoning_content,
    tool_calls), logprobs, finish_reason, matched_stop."""
    calls = c.parser.tool_calls
    reasoning = (c.reasoning or None) if separated else None
    # no content beside tool calls or reasoning (cut by max_tokens, say) is null, as OpenAI / vLLM
    msg: dict[str, Any] = {"role": "assistant", "content": c.content or (None if calls or reasoning else ""),
                           "reasoning_content": reasoning}
    if calls:
        msg["tool_calls"] = [{"id": tc["id"], "type": "function", "function": tc["function"]} for tc in calls]
    lp = ({"content": chat_logprobs(tokenizer, c, 0, c.num_text_tokens, req.top_logprobs), "refusal": None}
          if req.logprobs else None)
    out = {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": c.finish_reason_out()}
    if c.stop_reason is not None:
        out["matched_stop"] = c.stop_reason
    return out


def delta_items(tokenizer: Any, ch: ChatChoice, start: int, end: int, req: ChatRequest) -> list:
    """The stream items of one update of a choice (tokens ``start:end``): its parsed delta with the
    tokens' logprobs, then the finish item when the choice is done."""
    items = []
    lp = ({"content": chat_logprobs(tokenizer, ch, start, end, req.top_logprobs), "refusal": None}
          if req.logprobs and min(end, ch.num_text_tokens) > start else None)
    delta = ch.delta
    if delta or lp is not None:
        d: dict[str, Any] = {}
        if delta.reasoning:
            d["reasoning_content"] = delta.reasoning
        if delta.content:
            d["content"] = delta.content
        if delta.tool_calls:
            d["tool_calls"] = delta.tool_calls
        items.append({"index": ch.index, "delta": d, "logprobs": lp, "finish_reason": None})
    if ch.done:
        fin: dict[str, Any] = {"index": ch.index, "delta": {}, "logprobs": None,
                               "finish_reason": ch.finish_reason_out()}
        if ch.stop_reason is not None:
            fin["matched_stop"] = ch.stop_reason
        items.append(fin)
    return items


def _wants_constraint(body: Mapping, enc: EncodedChat) -> bool:
    rf = body.get("response_format")
    if isinstance(rf, Mapping) and rf.get("type") in ("json_object", "json_schema"):
        return True
    return bool(enc.tools) and (enc.tool_choice == "required" or isinstance(enc.tool_choice, Mapping))


def prepare_chat(ctx: ServerContext, body: dict) -> tuple[ChatRequest, EncodedChat, list, Any, Any, frozenset]:
    """Validate and encode a chat request: (request, encoded chat, prompt ids, sampling params,
    constraint, drop ids). CPU work (encoding, tokenization, grammar compilation): run off the loop."""
    cfg = ctx.cfg
    req = parse_chat_request(body, vocab_size=ctx.vocab, max_n=cfg.max_n)
    ctx.check_model(req.model)
    try:
        enc = cfg.chat_format.encode(body, render_response_format=cfg.render_response_format)
    except ChatError as e:
        raise APIError.from_chat_error(e) from None
    prompt_ids = ctx.tokenizer.encode(enc.prompt)
    sp = check_context(len(prompt_ids), req.sampling, cfg.context_length, explicit=req.max_tokens_explicit,
                       param=req.max_tokens_param)
    forced_tools = bool(enc.tools) and (enc.tool_choice == "required" or isinstance(enc.tool_choice, Mapping))
    if forced_tools and not cfg.tool_call_parser:
        raise APIError.bad_request("tool_choice 'required' or a named function needs the server's tool-call "
                                   "parser (--tool-call-parser deepseekv41)", "tool_choice")
    constraint = None
    try:
        if ctx.grammar is not None:
            constraint = ctx.grammar.for_request(body, tools=enc.tools, tool_choice=enc.tool_choice,
                                                 thinking=enc.thinking, thinking_budget=req.thinking_budget)
        elif _wants_constraint(body, enc) or (enc.thinking and req.thinking_budget is not None):
            raise APIError.bad_request("constrained decoding is unavailable on this server", "response_format")
    except ChatError as e:
        raise APIError.from_chat_error(e) from None
    if constraint is not None and constraint.spec is not None and sp.min_tokens:
        raise APIError.bad_request("min_tokens cannot be combined with a response_format / tool_choice "
                                   "constraint", "min_tokens")
    skip_special, drop_ids = chat_text_specials(ctx.tokenizer, thinking=enc.thinking, tools=bool(enc.tools))
    return req, enc, prompt_ids, sp.replace(skip_special_tokens=skip_special), constraint, drop_ids


def register(app: FastAPI, ctx: ServerContext) -> None:
    cfg = ctx.cfg
    think_close_id = ctx.tokenizer.token_to_id("</think>")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        try:
            body = await ctx.read_body(request)
            req, enc, prompt_ids, sp, constraint, drop_ids = await asyncio.to_thread(prepare_chat, ctx, body)
            ctx.admit()
        except APIError as e:
            return ctx.err(e)
        rid = ctx.new_id("chatcmpl")
        env = Envelope(rid, req.model or cfg.model_name, "chat.completion.chunk", req.stream_options.include_usage)
        separated = bool(enc.thinking and cfg.reasoning_parser and req.separate_reasoning)

        def make_choice(i: int) -> ChatChoice:
            parser = ChatOutputParser(enc.thinking, enc.tools, enc.tool_choice,
                                      reasoning_parser=bool(cfg.reasoning_parser) and req.separate_reasoning,
                                      tool_parser=bool(cfg.tool_call_parser))
            return ChatChoice(i, parser, think_close_id, enc.thinking)

        run = GenerationRun(ctx, rid, [prompt_ids], [sp], [constraint], sp.n, make_choice=make_choice,
                            drop_ids=drop_ids, arrival=arrival)
        choices: list[ChatChoice] = run.choices  # type: ignore[assignment]

        def usage() -> dict:
            return run.usage(sum(c.reasoning_tokens for c in choices))

        def report() -> None:
            run.finished([c.finish_reason_out() for c in choices], sum(c.reasoning_tokens for c in choices))

        if not req.stream:
            def build() -> dict:
                report()
                out = [choice_body(ctx.tokenizer, c, req, separated) for c in choices]
                return env.body("chat.completion", out, usage=usage())

            return await json_response(ctx, request, run, build)

        async def events() -> AsyncIterator[bytes]:
            for c in choices:
                yield sse(env.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]))
            async for ch, _, start, end in run.updates():
                for it in delta_items(ctx.tokenizer, ch, start, end, req):
                    yield sse(env.chunk([it], usage() if req.stream_options.continuous_usage_stats else None))
            report()
            if req.stream_options.include_usage:
                yield sse(env.chunk([], usage()))

        return sse_response(ctx, run, events())
