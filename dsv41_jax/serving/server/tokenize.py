"""The tokenizer endpoints, in vLLM's spelling (lm-eval's ``tokenizer_backend=remote``):
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dsv41_jax.chat_format.effort import ChatError
from dsv41_jax.serving.protocol import APIError

from .context import ServerContext

__all__ = ["register"]


def prepare_tokenize(ctx: ServerContext, body: dict) -> dict:
    cfg = ctx.cfg
    ctx.check_model(body.get("model"))
    if ("prompt" in body) == ("messages" in body):
        raise APIError.bad_request("give exactly one of 'prompt' (a string) or 'messages' (a chat)", "prompt")
    add_special = body.get("add_special_tokens")
    if add_special is not None and not isinstance(add_special, bool):
        raise APIError.bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise APIError.bad_request("prompt must be a string", "prompt")
        ids = ctx.encode(body["prompt"], bool(add_special))  # vLLM's default for prompts: True; ours: no BOS
    else:  # the chat's prompt exactly as /v1/chat/completions encodes it (it carries its own BOS)
        chat_body = {k: v for k, v in body.items() if k not in ("add_special_tokens", "return_token_strs")}
        try:
            enc = cfg.chat_format.encode(chat_body, render_response_format=cfg.render_response_format)
        except ChatError as e:
            raise APIError.from_chat_error(e) from None
        ids = ctx.encode(enc.prompt, bool(add_special))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": cfg.context_length, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = [ctx.tokenizer.id_to_token(t) for t in ids]
    return out


def register(app: FastAPI, ctx: ServerContext) -> None:
    cfg, tok = ctx.cfg, ctx.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM / SGLang ``/tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}`` (encoded as the
        chat endpoint does), ``add_special_tokens`` (default false: the BOS is not added to a prompt;
        chat prompts already start with it) -> ``{"tokens": [int], "count", "max_model_len"}``."""
        try:
            body = await ctx.read_body(request)
            return JSONResponse(await asyncio.to_thread(prepare_tokenize, ctx, body))
        except APIError as e:
            return ctx.err(e)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """``{"tokens": [int]}`` -> ``{"prompt": str}`` (special tokens kept, as vLLM)."""
        try:
            body = await ctx.read_body(request)
            ctx.check_model(body.get("model"))
            toks = body.get("tokens")
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise APIError.bad_request("tokens must be a list of integers", "tokens")
            if ctx.vocab is not None and any(not (0 <= t < ctx.vocab) for t in toks):
                raise APIError.bad_request(f"tokens must be in [0, {ctx.vocab})", "tokens")
            return JSONResponse({"prompt": tok.decode(toks, skip_special_tokens=False)})
        except APIError as e:
            return ctx.err(e)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What lm-eval's ``tokenizer_backend=remote`` / ``auto`` reads (vLLM's spelling)."""
        def name(tid):
            return tok.id_to_token(tid) if tid is not None else None
        bos = getattr(tok, "bos_token_id", None)
        eos = getattr(tok, "eos_token_id", None)
        pad = getattr(tok, "pad_token_id", None)
        return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.context_length,
                             "max_model_len": cfg.context_length, "vocab_size": ctx.vocab,
                             "bos_token": name(bos), "bos_token_id": bos, "eos_token": name(eos), "eos_token_id": eos,
                             "pad_token": name(pad), "pad_token_id": pad, "add_bos_token": False,
                             "chat_template": "deepseek-v41", "chat_template_name": "deepseek-v41"})
