#!/usr/bin/env python
"""Multiple-choice accuracy by loglikelihood, offline, with the jitted forward.

    python scripts/eval_loglik.py --model tiny --data tests/data/mc_sample.jsonl --batch-size 8 \\
        [--dtype float32] [--limit N] [--backend forward|engine] [--out result.json] [--items-out items.jsonl]

Input: a JSONL file, one item a line: ``{"context": str, "choices": [str, ...], "answer": int}``
(``gold`` / ``label`` are accepted for ``answer``). Scoring follows lm-evaluation-harness's
``multiple_choice`` output type:

* each (context, choice) pair is encoded as lm-eval's ``_encode_pair``: trailing spaces of the
  context move to the continuation, ``whole = encode(context + choice)`` and the continuation's tokens
  are ``whole[len(encode(context)):]`` (no BOS: the server's ``/tokenize`` and string prompts add
  none either; ``--add-bos`` prepends it to every sequence);
* loglikelihood = sum over the continuation tokens of log p(token | everything before it), from the
  log-softmax of `dsv41_jax.model.forward` in fp32 logits; ``is_greedy`` = every continuation token
  is the argmax;
* ``acc`` = argmax of the loglikelihoods is the answer; ``acc_norm`` = argmax of loglikelihood /
  len(choice in characters) is the answer (lm-eval's ``acc_norm``). Both with their standard error.

Sequences (context + continuation, the last token not fed: it is only a target) are sorted by
length and run in batches of ``--batch-size`` rows right-padded to a multiple of ``--pad-multiple``
tokens (causal attention: padding after a position changes nothing before it), so a few shapes
serve the whole file; the per-position log-softmax and the gather of the target tokens run on the
device and only ``[B, T]`` floats come back. A tqdm progress bar (stderr) counts sequences.

Backends: ``--backend forward`` (default) as above; ``--backend engine`` scores through the serving
`Engine` in-process (``max_tokens=0`` requests with prompt logprobs: the jitted all-logits prefill in
the engine's padded (batch, chunk) buckets) and, given the server's engine flags, gives exactly the
server's numbers. ``tests/test_eval_server.py`` checks both on a 20-item file in the fp32 mode: the
engine backend equals the server's ``/v1/completions`` ``echo`` + ``logprobs`` sums for every item
(1e-5); the forward backend agrees within 1e-3 for most sequences but not all: the full forward and
the chunked paged prefill are different executables whose ~1e-7 accumulation differences can flip
an fp8 activation-quant code (docs/design/spec.md §6), which moves a random-weight tiny model's 20-token sum by up
to ~0.3 (the forward at batch 8 vs batch 1 differs as much). Result: JSON with acc, acc_norm,
their stderr, counts and timing; ``--items-out`` writes one line per item with every choice's
loglikelihood, is_greedy and token count.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_items(path: str, limit: int | None = None) -> list:
    """Items ``{"context", "choices", "answer"}`` from a JSONL file (ValueError naming the line)."""
    items = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            ans = next((rec[k] for k in ("answer", "gold", "label") if k in rec), None)
            if not isinstance(rec.get("context"), str) or not isinstance(rec.get("choices"), list) \
                    or not rec["choices"] or not all(isinstance(c, str) for c in rec["choices"]):
                raise ValueError(f"{path}:{i + 1}: needs 'context' (str) and 'choices' (non-empty list of str)")
            if not isinstance(ans, int) or not 0 <= ans < len(rec["choices"]):
                raise ValueError(f"{path}:{i + 1}: 'answer' must be an index into 'choices'")
            items.append({"context": rec["context"], "choices": rec["choices"], "answer": ans})
            if limit is not None and len(items) >= limit:
                break
    return items


def encode_pair(tokenizer, context: str, continuation: str, add_bos: bool = False) -> tuple:
    """lm-eval's ``_encode_pair``: (context token ids, continuation token ids)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    cont = whole[len(ctx):]
    if add_bos and tokenizer.bos_token_id is not None:
        ctx = [tokenizer.bos_token_id] + ctx
    elif not ctx:  # lm-eval: an empty context is scored after the end-of-text token
        ctx = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0]
    return ctx, cont


@functools.lru_cache(maxsize=None)
def token_logprobs_step(cfg):
    """jit of (params, inputs int32 [B, T], targets int32 [B, T]) -> (logprob fp32 [B, T] of each
    target given the inputs up to it, greedy bool [B, T]: the target is the argmax)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import forward

    def step(params, inputs, targets):
        logits = forward(params, inputs, cfg)
        lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        lp = jnp.take_along_axis(lsm, targets[..., None], axis=-1)[..., 0]
        return lp, jnp.argmax(lsm, axis=-1) == targets

    return jax.jit(step)


def score_sequences(params, cfg, seqs: list, *, batch_size: int = 8, pad_multiple: int = 32,
                    progress: bool = True) -> list:
    """Loglikelihood of each ``(context_ids, continuation_ids)``: list of (sum logprob, is_greedy,
    per-token logprobs). Runs sorted by length in padded batches (see the module docstring)."""
    import numpy as np

    step = token_logprobs_step(cfg)
    order = sorted(range(len(seqs)), key=lambda i: -(len(seqs[i][0]) + len(seqs[i][1])))
    out: list = [None] * len(seqs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(seqs), desc="loglik", unit="seq", file=sys.stderr)
    for b0 in range(0, len(order), batch_size):
        idx = order[b0:b0 + batch_size]
        full = [list(seqs[i][0]) + list(seqs[i][1]) for i in idx]
        T = max(len(f) - 1 for f in full)
        T = -(-T // pad_multiple) * pad_multiple
        inputs = np.zeros((batch_size, T), np.int32)
        targets = np.zeros((batch_size, T), np.int32)
        for r, f in enumerate(full):
            inputs[r, :len(f) - 1] = f[:-1]
            targets[r, :len(f) - 1] = f[1:]
        lp, greedy = step(params, inputs, targets)
        lp, greedy = np.asarray(lp), np.asarray(greedy)
        for r, i in enumerate(idx):
            n_ctx, n_cont = len(seqs[i][0]), len(seqs[i][1])
            sl = slice(n_ctx - 1, n_ctx - 1 + n_cont)  # target t+1 is predicted at position t
            toks = [float(x) for x in lp[r, sl]]
            out[i] = (float(np.sum(lp[r, sl], dtype=np.float64)), bool(np.all(greedy[r, sl])), toks)
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    return out


def score_sequences_engine(engine, seqs: list, *, progress: bool = True) -> list:
    """Same as `score_sequences` through the serving `Engine` (no server): every sequence is a
    ``max_tokens=0`` request with ``prompt_logprobs=1``, batched by the scheduler into the jitted
    all-logits prefill launches, exactly as ``/v1/completions`` with ``echo`` computes them."""
    from dsv41_jax.serving.sampling import SamplingParams

    sp = SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0)
    for i, (ctx, cont) in enumerate(seqs):
        engine.add_request(f"loglik-{i}", list(ctx) + list(cont), sp)
    plp: dict = {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(seqs), desc="loglik", unit="seq", file=sys.stderr)
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                plp[int(o.request_id.rsplit("-", 1)[1])] = o.prompt_logprobs
            if o.finished and bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    out = []
    for i, (ctx, cont) in enumerate(seqs):
        full = list(ctx) + list(cont)
        ent = plp[i][len(ctx):len(full)]
        toks = [e[0] for e in ent]
        greedy = all(e[1] and e[1][0][0] == full[len(ctx) + j] for j, e in enumerate(ent))
        out.append((float(sum(toks)), greedy, toks))
    return out


def evaluate(items: list, tokenizer, params, cfg, *, batch_size: int = 8, pad_multiple: int = 32,
             add_bos: bool = False, progress: bool = True, engine=None) -> tuple:
    """(metrics dict, per-item records) for multiple-choice ``items``; ``engine``: score with the
    serving engine (`score_sequences_engine`) instead of the full forward."""
    seqs, owner = [], []
    for i, it in enumerate(items):
        for j, ch in enumerate(it["choices"]):
            seqs.append(encode_pair(tokenizer, it["context"], ch, add_bos))
            owner.append((i, j))
    for (i, j), (_, cont) in zip(owner, seqs):
        if not cont:
            raise ValueError(f"item {i} choice {j}: the continuation has no tokens")
    if engine is not None:
        scores = score_sequences_engine(engine, seqs, progress=progress)
    else:
        scores = score_sequences(params, cfg, seqs, batch_size=batch_size, pad_multiple=pad_multiple,
                                 progress=progress)
    recs = [{"index": i, "answer": it["answer"], "loglik": [], "is_greedy": [], "n_tokens": [],
             "context_ids": None, "continuation_ids": []} for i, it in enumerate(items)]
    for (i, j), (ctx, cont), (ll, greedy, _) in zip(owner, seqs, scores):
        recs[i]["loglik"].append(ll)
        recs[i]["is_greedy"].append(greedy)
        recs[i]["n_tokens"].append(len(cont))
        recs[i]["context_ids"] = ctx
        recs[i]["continuation_ids"].append(cont)
    acc, acc_norm = [], []
    for it, r in zip(items, recs):
        lls = r["loglik"]
        lens = [float(len(c)) for c in it["choices"]]
        r["pred"] = max(range(len(lls)), key=lambda j: (lls[j], -j))
        r["pred_norm"] = max(range(len(lls)), key=lambda j: (lls[j] / lens[j] if lens[j] else lls[j], -j))
        acc.append(float(r["pred"] == it["answer"]))
        acc_norm.append(float(r["pred_norm"] == it["answer"]))

    def stderr(xs):
        n = len(xs)
        if n < 2:
            return None
        m = sum(xs) / n
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)

    n = len(items)
    metrics = {"items": n, "sequences": len(seqs), "acc": sum(acc) / n, "acc_stderr": stderr(acc),
               "acc_norm": sum(acc_norm) / n, "acc_norm_stderr": stderr(acc_norm)}
    return metrics, recs


def main(argv=None) -> dict:
    from dsv41_jax.serving.engine_args import EngineArgs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="JSONL file: one {context, choices, answer} item a line")
    ap.add_argument("--limit", type=int, default=None, help="score only the first N items")
    ap.add_argument("--backend", default="forward", choices=("forward", "engine"),
                    help="forward (default): the jitted full forward in padded batches; engine: the serving "
                         "engine's prefill (the engine flags below apply), the server's exact numerics")
    ap.add_argument("--batch-size", type=int, default=8, help="forward backend: sequences per batch (default 8)")
    ap.add_argument("--pad-multiple", type=int, default=32,
                    help="forward backend: pad each batch's length to a multiple of this (fewer compiled "
                         "shapes; default 32)")
    ap.add_argument("--add-bos", action="store_true", help="prepend the BOS token to every context")
    ap.add_argument("--out", default=None, help="write the metrics JSON here (default: print only)")
    ap.add_argument("--items-out", default=None, help="write one JSON line per item (logliks, is_greedy) here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(ap)  # --model, --tokenizer, --dtype, --seed and the engine flags
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import jax

    from dsv41_jax.model import ModelConfig
    from dsv41_jax.serving.tokenizer import load_tokenizer

    eargs = EngineArgs.from_cli_args(ns)
    cfg = ModelConfig.from_pretrained(eargs.model)
    if eargs.dtype != "auto":
        cfg = cfg.replace(act_dtype=eargs.act_dtype)
    t0 = time.perf_counter()
    if eargs.model == "tiny" and not os.path.isdir(eargs.model):
        from dsv41_jax.model import init_params

        params = init_params(cfg, jax.random.key(eargs.random_seed))
    else:
        from dsv41_jax.model.checkpoint import load_params

        params = load_params(eargs.model, cfg)
    tok = load_tokenizer(eargs.tokenizer or eargs.model)
    engine = None
    if ns.backend == "engine":
        from dsv41_jax.serving.engine import Engine

        engine = Engine(eargs.replace(skip_server_warmup=True), cfg=cfg, params=params, tokenizer=tok)
    load_s = time.perf_counter() - t0
    items = read_items(ns.data, ns.limit)
    if not items:
        raise SystemExit(f"{ns.data}: no items")
    t1 = time.perf_counter()
    metrics, recs = evaluate(items, tok, params, cfg, batch_size=ns.batch_size, pad_multiple=ns.pad_multiple,
                             add_bos=ns.add_bos, progress=not ns.no_progress, engine=engine)
    result = {"model": eargs.model, "data": ns.data, "backend": ns.backend, "dtype": cfg.act_dtype, **metrics,
              "load_s": load_s, "eval_s": time.perf_counter() - t1,
              "num_compilations": (engine.num_compilations() if engine is not None
                                   else token_logprobs_step(cfg)._cache_size())}
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)) or ".", exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    if ns.items_out:
        with open(ns.items_out, "w") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    print(json.dumps({k: result[k] for k in ("items", "acc", "acc_norm", "eval_s")}))
    result["items_detail"] = recs
    return result


if __name__ == "__main__":
    main()
