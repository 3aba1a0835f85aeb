"""``POST /v1/completions``: raw prompts (strings or token ids, one or several, ``n`` choices each),
``echo``, and with ``echo`` + ``logprobs`` the prompt's own logprobs (lm-eval's loglikelihood).

String prompts are tokenized without a BOS unless ``add_special_tokens``; token-id prompts are
taken as sent. Choice ``k * n + j`` is sample j of prompt k. ``logprobs.text_offset`` comes from the
engine's detokenizer, so it is consistent with ``text`` (a special token left out of the text adds
nothing to the offsets).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from dsv41_jax.chat_format.effort import ChatError
from dsv41_jax.serving.protocol import APIError, check_context, parse_completion_request
from dsv41_jax.serving.tokenizer import IncrementalDetokenizer

from .context import ServerContext
from .responses import Choice, Envelope, GenerationRun, json_response, logprob, sse, sse_response

__all__ = ["register"]


def completion_logprobs(tokenizer: Any, ch: Choice, start: int, end: int, top: int, base: int) -> dict:
    """OpenAI completions ``logprobs`` of tokens ``start:end``; ``text_offset`` counts from ``base``
    (the echoed prompt's length, or 0) plus each token's offset in the choice's text."""
    limit = len(ch.text) if ch.done else None  # mid-stream, text held back (a stop string's prefix) may follow
    toks, lps, tops, offs = [], [], [], []
    for j in range(start, min(end, len(ch.logprobs))):
        toks.append(tokenizer.token_str(ch.token_ids[j]))
        lps.append(logprob(ch.logprobs[j]))
        t = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
        tops.append({tokenizer.token_str(a): logprob(b) for a, b in (t or [])[:top]} if top else None)
        off = ch.text_offsets[j]
        offs.append(base + (off if limit is None else min(off, limit)))
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops if top else None, "text_offset": offs}


def _top_dict(tokenizer: Any, pairs: list, tid: int, lp: float) -> dict:
    """{token text: logprob} of the top-k plus the token itself (as vLLM); a text shared by several
    ids keeps its highest logprob."""
    d: dict = {}
    for a, b in list(pairs) + [(tid, lp)]:
        key, v = tokenizer.token_str(a), logprob(b)
        if key not in d or v > d[key]:
            d[key] = v
    return d


def echo_logprobs(tokenizer: Any, ch: Choice, prompt_ids: list, top: int, echo_len: int) -> dict:
    """``echo`` + ``logprobs``: the prompt's tokens (the first with a null logprob and null
    top_logprobs, as OpenAI / vLLM), then the generated ones. Text offsets: the prompt's from the
    detokenizer run over the prompt with special tokens kept (as the echoed text is), the generated
    ones from ``echo_len`` (the echoed text's length) on."""
    plp = ch.prompt_logprobs or [None] * len(prompt_ids)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    detok.add(prompt_ids)
    toks, lps, tops, offs = [], [], [], []
    for i, tid in enumerate(prompt_ids):
        toks.append(tokenizer.token_str(tid))
        offs.append(min(detok.offsets[i], echo_len))
        e = plp[i] if i < len(plp) else None
        if i == 0 or e is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(logprob(e[0]))
            tops.append(_top_dict(tokenizer, e[1][:top], tid, e[0]))
    gen = completion_logprobs(tokenizer, ch, 0, len(ch.token_ids), top, echo_len)
    toks += gen["tokens"]
    lps += gen["token_logprobs"]
    offs += gen["text_offset"]
    for j in range(min(len(ch.token_ids), len(ch.logprobs))):
        t = ch.top_logprobs[j] if j < len(ch.top_logprobs) else None
        tops.append(_top_dict(tokenizer, (t or [])[:top], ch.token_ids[j], ch.logprobs[j]))
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def choice_body(tokenizer: Any, c: Choice, req: Any, prompt_ids: list, echo_text: str) -> dict:
    """A finished choice of a non-streaming response: text (after the echoed prompt), logprobs (with
    echo: the prompt's too), finish_reason, matched_stop."""
    if req.logprobs is None:
        lp = None
    elif req.echo:
        if c.prompt_logprobs is None and c.finish_reason not in ("abort", "error"):
            raise APIError(500, "the engine returned no prompt logprobs", code="internal_error")
        lp = echo_logprobs(tokenizer, c, prompt_ids, req.logprobs, len(echo_text))
    else:
        lp = completion_logprobs(tokenizer, c, 0, len(c.token_ids), req.logprobs, 0)
    out = {"index": c.index, "text": echo_text + c.text, "logprobs": lp, "finish_reason": c.finish_reason or "abort"}
    if c.stop_reason is not None:
        out["matched_stop"] = c.stop_reason
    return out


def prepare_completion(ctx: ServerContext, body: dict):
    """Validate a completions request: (request, prompts' ids, sampling params and constraint per
    prompt). CPU work (tokenization, grammar compilation): run off the event loop."""
    cfg = ctx.cfg
    req = parse_completion_request(body, vocab_size=ctx.vocab, max_n=cfg.max_n)
    ctx.check_model(req.model)
    add_special = body.get("add_special_tokens", False)
    if not isinstance(add_special, bool):
        raise APIError.bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    prompts_ids = [ctx.encode(p, add_special) if isinstance(p, str) else list(p) for p in req.prompts]
    for k, ids in enumerate(prompts_ids):
        if not ids:  # "" (token-id prompts are checked non-empty by the parser)
            raise APIError.bad_request("prompt must contain at least one token, got an empty string",
                                       "prompt" if len(prompts_ids) == 1 else f"prompt[{k}]")
    sps = [check_context(len(ids), req.sampling, cfg.context_length, explicit=req.max_tokens_explicit,
                         param="max_tokens", prompt_param="prompt") for ids in prompts_ids]
    constraints = []
    for _ in prompts_ids:
        c = None
        if ctx.grammar is not None:
            c = ctx.grammar.for_request(body)
        elif body.get("response_format") not in (None, {"type": "text"}) or body.get("regex"):
            raise APIError.bad_request("constrained decoding is unavailable on this server", "response_format")
        constraints.append(c)
    if constraints[0] is not None and req.sampling.min_tokens:
        raise APIError.bad_request("min_tokens cannot be combined with a constraint", "min_tokens")
    return req, prompts_ids, sps, constraints


def register(app: FastAPI, ctx: ServerContext) -> None:
    cfg, tok = ctx.cfg, ctx.tokenizer

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        try:
            body = await ctx.read_body(request)
            req, prompts_ids, sps, constraints = await asyncio.to_thread(prepare_completion, ctx, body)
            ctx.admit(len(prompts_ids))
        except ChatError as e:
            return ctx.err(APIError.from_chat_error(e))
        except APIError as e:
            return ctx.err(e)
        rid = ctx.new_id("cmpl")
        env = Envelope(rid, req.model or cfg.model_name, "text_completion", req.stream_options.include_usage)
        n = req.sampling.n
        run = GenerationRun(ctx, rid, prompts_ids, sps, constraints, n, arrival=arrival)
        choices = run.choices
        echo_text = [(p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)) if req.echo else ""
                     for p in req.prompts]

        def report() -> None:
            run.finished([c.finish_reason for c in choices])

        if not req.stream:
            def build() -> dict:
                report()
                out = [choice_body(tok, c, req, prompts_ids[c.index // n], echo_text[c.index // n]) for c in choices]
                return env.body("text_completion", out, usage=run.usage())

            return await json_response(ctx, request, run, build)

        async def events() -> AsyncIterator[bytes]:
            for c in choices:
                k = c.index // n
                if echo_text[k]:
                    yield sse(env.chunk([{"index": c.index, "text": echo_text[k], "logprobs": None,
                                          "finish_reason": None}]))
            async for ch, text, start, end in run.updates():
                lp = (completion_logprobs(tok, ch, start, end, req.logprobs or 0, len(echo_text[ch.index // n]))
                      if req.logprobs is not None and end > start else None)
                if text or lp is not None:
                    yield sse(env.chunk([{"index": ch.index, "text": text, "logprobs": lp, "finish_reason": None}]))
                if ch.done:
                    fin = {"index": ch.index, "text": "", "logprobs": None, "finish_reason": ch.finish_reason}
                    if ch.stop_reason is not None:
                        fin["matched_stop"] = ch.stop_reason
                    yield sse(env.chunk([fin]))
            report()
            if req.stream_options.include_usage:
                yield sse(env.chunk([], run.usage()))

        return sse_response(ctx, run, events())
