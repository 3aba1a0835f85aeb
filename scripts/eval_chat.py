#!/usr/bin/env python
"""Exact-match accuracy of chat answers through the offline API.

    python scripts/eval_chat.py --model tiny --data tests/data/chat_qa.jsonl --thinking both \\
        --max-tokens 64 --out chat_eval.json [engine flags]

Each jsonl record has ``answer`` (and optional ``aliases``) plus either ``question`` (one user
turn) or ``messages`` (OpenAI messages). All prompts go through `LLM.chat` in one batch (greedy by
default), once per thinking mode (``--thinking on|off|both``). The answer is the parsed ``content``
(reasoning removed by the deepseek-v41 reasoning parser); a record is correct when the normalized
content (whitespace collapsed, case folded, surrounding quotes and trailing punctuation stripped)
equals a normalized answer or alias. Reported per mode: accuracy, counts, mean prompt / completion /
reasoning tokens, finish reasons, wall time; with ``--details`` every record's output too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def normalize(text: str) -> str:
    t = " ".join(str(text).split()).casefold()
    t = t.strip().strip("\"'`“”‘’")
    t = re.sub(r"[\s.!?,;:]+$", "", t)
    return t.strip()


def load_records(path: str) -> list:
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "answer" not in rec or ("question" not in rec and "messages" not in rec):
                raise ValueError(f"{path}:{i + 1}: needs 'answer' and 'question' or 'messages'")
            msgs = rec.get("messages") or [{"role": "user", "content": rec["question"]}]
            answers = [rec["answer"]] + list(rec.get("aliases", []))
            out.append({"messages": msgs, "answers": answers, "id": rec.get("id", i)})
    return out


def evaluate(llm, records: list, thinking: bool, params, details: bool) -> dict:
    tok = llm.tokenizer
    t0 = time.perf_counter()
    outs = llm.chat([r["messages"] for r in records], params, thinking=thinking)
    wall = time.perf_counter() - t0
    correct, rows = 0, []
    p_tok = c_tok = r_tok = 0
    reasons = Counter()
    for rec, o in zip(records, outs):
        c = o.outputs[0]
        ok = normalize(c.content or "") in {normalize(a) for a in rec["answers"]}
        correct += ok
        p_tok += len(o.prompt_token_ids)
        c_tok += len(c.token_ids)
        r_tok += len(tok.encode(c.reasoning_content)) if c.reasoning_content else 0
        reasons[c.finish_reason] += 1
        if details:
            rows.append({"id": rec["id"], "correct": bool(ok), "answer": rec["answers"][0], "content": c.content,
                         "reasoning": c.reasoning_content, "finish_reason": c.finish_reason,
                         "completion_tokens": len(c.token_ids)})
    n = len(records)
    res = {"thinking": thinking, "n": n, "correct": correct, "accuracy": correct / n if n else 0.0,
           "mean_prompt_tokens": p_tok / n if n else 0.0, "mean_completion_tokens": c_tok / n if n else 0.0,
           "mean_reasoning_tokens": r_tok / n if n else 0.0, "completion_tokens": c_tok,
           "finish_reasons": dict(reasons), "wall_s": wall}
    if details:
        res["records"] = rows
    return res


def main(argv=None) -> dict:
    from dsv41_jax.serving.engine_args import EngineArgs
    from dsv41_jax.serving.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="jsonl with question|messages and answer")
    ap.add_argument("--thinking", choices=("on", "off", "both"), default="off", help="thinking mode(s) (default off)")
    ap.add_argument("--max-tokens", type=int, default=256, help="completion budget per answer (default 256)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N records")
    ap.add_argument("--details", action="store_true", help="include every record's output in the JSON")
    ap.add_argument("--out", default=None, help="JSON result path")
    EngineArgs.add_cli_args(ap)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = EngineArgs.from_cli_args(ns)

    from dsv41_jax.llm import LLM

    records = load_records(ns.data)[: ns.limit]
    llm = LLM(**vars(args))
    params = SamplingParams(temperature=ns.temperature, max_tokens=ns.max_tokens, seed=args.random_seed)
    modes = {"on": [True], "off": [False], "both": [False, True]}[ns.thinking]
    result = {"model": args.model, "data": ns.data, "max_tokens": ns.max_tokens, "temperature": ns.temperature,
              "modes": {("thinking" if m else "chat"): evaluate(llm, records, m, params, ns.details) for m in modes}}
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)) or ".", exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: {kk: v[kk] for kk in ("accuracy", "correct", "n", "mean_completion_tokens")}
                      for k, v in result["modes"].items()}))
    return result


if __name__ == "__main__":
    main()
