"""Offline inference API::

    from dsv41_jax import LLM, SamplingParams

    llm = LLM(model="tiny", max_running_requests=16)          # or a model directory
    outs = llm.generate(["Hello", [0, 5, 7]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

    chats = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=64), thinking=True)
    chats[0].outputs[0].reasoning_content, chats[0].outputs[0].content

Every request runs through the same scheduler as the server (`dsv41_jax.serving.engine.Engine`);
keyword arguments of `LLM` are `EngineArgs` fields (SGLang spellings with underscores), e.g.
``LLM(model=..., speculative_algorithm="DSPARK")`` for DSpark speculative decoding: each output's
``metrics["spec_accept_length"]`` is then that request's accept length (tokens committed per verify
step, 1 + accepted drafts) and `LLM.spec_stats` the engine's totals.

Over several processes (``jax.distributed`` initialized first, `dsv41_jax.parallel.distributed`), every
process runs the same script: on process 0 `LLM` is the engine (`generate`, `chat`; `shutdown` when
done stops the others); on the others `LLM(...)` executes process 0's steps and returns once process 0
shuts down, and `generate` / `chat` there are refused (`LLM.is_follower`).
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Mapping, Optional, Sequence, Union

from dsv41_jax.serving.engine import Engine, EngineError, EngineInternalError, RequestOutput
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)
    except ImportError:  # pragma: no cover
        return None


class LLM:
    """An engine plus a tokenizer, driven synchronously."""

    def __init__(self, model: str = "tiny", *, tokenizer: Optional[str] = None, cfg=None, params=None,
                 engine: Optional[Engine] = None, chat_format=None, **engine_args):
        if engine is not None:
            self.engine = engine
        else:
            args = EngineArgs.from_kwargs(model=model, tokenizer=tokenizer, **engine_args)
            self.engine = Engine(args, cfg=cfg, params=params)
        self._ids = itertools.count()
        self._chat_format = chat_format
        if self.is_follower:  # a follower of a multi-process engine: run the leader's steps until it stops
            self.engine.follow()

    @property
    def is_follower(self) -> bool:
        """This process followed a multi-process engine's leader (its `LLM(...)` returned when the leader stopped)."""
        return getattr(self.engine, "is_follower", False)

    def shutdown(self) -> None:
        """Stop the engine's other processes (a multi-process leader); nothing to do on one process."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    @property
    def chat_format(self):
        """The `chat_format.registry.ChatFormat` `chat` encodes with: the one given, else the model family's
        encoding with its built-in wording and defaults (thinking off unless asked)."""
        if self._chat_format is None:
            from dsv41_jax.chat_format.registry import ChatFormat

            mcfg = getattr(getattr(self.engine, "runner", None), "cfg", None)
            self._chat_format = ChatFormat(family=getattr(mcfg, "model_family", "deepseek_v41"))
        return self._chat_format

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def spec_stats(self) -> Optional[dict]:
        """DSpark totals since the engine started, or None when DSpark is off: ``accept_length``
        (tokens committed per row-step, 1 + accepted drafts), ``accept_rate`` (accepted / proposed
        drafts), ``verify_steps`` (row-steps), ``gamma`` and ``accept_hist`` (row-steps per accepted
        count 0..γ)."""
        if not getattr(self.engine, "spec_gamma", 0):
            return None
        st = self.engine.stats()
        return {"accept_length": st["spec_accept_length"], "accept_rate": st["spec_accept_rate"],
                "verify_steps": st["spec_verify_steps"], "gamma": st["spec_gamma"],
                "accept_hist": st["spec_accept_hist"]}

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _normalize_prompts(prompts) -> list:
        """-> list of (text or None, token ids or None)."""
        if isinstance(prompts, str):
            return [(prompts, None)]
        if isinstance(prompts, Mapping):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [(None, [int(t) for t in prompts])]
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append((p, None))
            elif isinstance(p, Mapping):
                if "prompt_token_ids" in p:
                    out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
                elif "prompt" in p:
                    out.append((p["prompt"], None))
                else:
                    raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
            else:
                out.append((None, [int(t) for t in p]))
        return out

    def generate(self, prompts, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_tqdm: bool = False, constraints: Optional[Sequence[Any]] = None) -> list:
        """Run prompts (a string, a token-id list, or a list of either / of ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts) to completion. Returns one `RequestOutput` per prompt,
        in order (``outputs[i]``: ``text``, ``token_ids``, ``finish_reason``, ``logprobs``,
        ``top_logprobs``)."""
        items = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} for {len(items)} prompts")
        if constraints is not None and len(constraints) != len(items):
            raise ValueError(f"constraints: {len(constraints)} for {len(items)} prompts")
        return self._run(items, params, constraints, use_tqdm=use_tqdm)

    def _run(self, items: list, params: list, constraints: Optional[Sequence[Any]], *, use_tqdm: bool,
             drop_token_ids: Optional[Sequence[Sequence[int]]] = None) -> list:
        """`generate` on normalized prompts; drop_token_ids: per prompt, ids left out of its text."""
        eng = self.engine
        if self.is_follower:
            raise EngineError("LLM: this process followed process 0's multi-process engine until it shut down; "
                              "generate / chat run on process 0")
        rids = []
        for i, ((text, ids), p) in enumerate(zip(items, params)):
            rid = f"llm-{next(self._ids)}"
            eng.add_request(rid, text, p, prompt_token_ids=ids,
                            constraint=None if constraints is None else constraints[i],
                            drop_token_ids=() if drop_token_ids is None else drop_token_ids[i])
            rids.append(rid)
        results: dict = {}
        bar = _progress(len(rids), use_tqdm)
        want = set(rids)
        try:
            while want - set(results):
                for o in eng.step():
                    if o.request_id in want and o.finished:
                        results[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
                if not eng.has_unfinished() and want - set(results):
                    raise RuntimeError("engine stopped before every request finished")
        except BaseException:
            for rid in want - set(results):
                eng.abort_request(rid)
            while eng.has_unfinished():
                eng.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        failed = [results[r].error for r in rids if results[r].error]
        if failed:  # the engine ended requests early: never hand back truncated outputs as results
            raise EngineInternalError(f"{len(failed)} request(s) failed: {failed[0]}")
        return [results[r] for r in rids]

    def chat(self, messages, sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
             thinking: Optional[bool] = None, reasoning_effort: Any = None, tools: Optional[list] = None,
             tool_choice: Any = None, chat_template_kwargs: Optional[dict] = None, use_tqdm: bool = False) -> list:
        """Chat completions for one conversation (a list of OpenAI messages) or a list of them.

        The prompt is built by `chat_format` (the model family's encoding: V4.1's `encode_chat_request`,
        DeepSeek-V4's `encode_chat_request_v4`; thinking switch and effort resolved as the server does; ``thinking=True/False`` sets
        ``chat_template_kwargs.thinking``); the output is split by `reasoning.parse_chat_output`
        into ``outputs[i].reasoning_content``, ``.content`` and ``.tool_calls`` (``.text`` stays the
        raw completion the parsers read, as the server's: the markers they need kept, ``｜DSML｜``
        with tools and ``<think>`` / ``</think>`` while thinking, other special tokens left out;
        `reasoning.chat_text_specials`)."""
        from dsv41_jax.serving.reasoning import chat_text_specials, parse_chat_output

        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        ctk = dict(chat_template_kwargs or {})
        if thinking is not None:
            ctk["thinking"] = bool(thinking)
        encoded = []
        for conv in convs:
            req = {"messages": conv, "chat_template_kwargs": ctk}
            if reasoning_effort is not None:
                req["reasoning_effort"] = reasoning_effort
            if tools:
                req["tools"] = tools
            if tool_choice is not None:
                req["tool_choice"] = tool_choice
            encoded.append(self.chat_format.encode(req))
        if sampling_params is None:
            sampling_params = SamplingParams()
        plist = [sampling_params] * len(convs) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(plist) != len(convs):
            raise ValueError(f"sampling_params: {len(plist)} for {len(convs)} conversations")
        specials = [chat_text_specials(self.tokenizer, thinking=e.thinking, tools=bool(e.tools)) for e in encoded]
        plist = [p.replace(skip_special_tokens=skip) for p, (skip, _) in zip(plist, specials)]
        items = [(e.prompt, self.tokenizer.encode(e.prompt)) for e in encoded]
        outs = self._run(items, plist, None, use_tqdm=use_tqdm, drop_token_ids=[sorted(d) for _, d in specials])
        for o, e in zip(outs, encoded):
            for c in o.outputs:
                r, content, calls, _ = parse_chat_output(c.text, e.thinking, e.tools or None, e.tool_choice)
                c.reasoning_content, c.content, c.tool_calls = r, content, calls
        return outs
