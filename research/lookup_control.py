#!/usr/bin/env python3
"""Control for nano's look-up gap: a plain transformer on the same look-up rows.

nano does not learn the table look-ups ("eel=6, pig=6, bee=1. Value of pig?" -> "6") in its training
budget. This script asks whether that is nano's architecture (sparse attention, compressed KV, mHC,
Engram, fp8 / fp4 fake-quants) or the task at this budget: it trains a textbook pre-LN transformer
(multi-head attention with RoPE, GELU MLP, RMSNorm, untied head; no quantization, no sparsity) on
exactly the rows `scripts/train_nano.py --kinds lookup` trains on (`training.data.PackedSource`:
nano's tokenizer, the V4.1 chat rendering, loss on the completion only), with nano's optimizer
settings (AdamW, warmup then cosine decay, clip 1.0, weight decay 0.01), and prints held-out sequence
accuracy (the fraction of completions greedy decoding would reproduce exactly, teacher-forced) every
--eval-every steps. A random entry of the 2-4 in a table would score ~0.43.

    python research/lookup_control.py                       # 3000 steps, 4 layers, 16 rows x 64 tokens
    python research/lookup_control.py --batch-size 64 --steps 1000
    python research/lookup_control.py --kinds copy --steps 600   # the control's control: copying is learned
    python research/lookup_control.py --format curriculum --curriculum-steps 1500
    python research/lookup_control.py --format multi-question   # ~3 look-ups per row, the corpus's wording
    python research/lookup_control.py --format recall           # bare one-query associative recall

Deterministic: the data is the corpus with --seed (held-out: --eval-seed), the init --init-seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


FORMATS = ("corpus", "question-first", "glued", "word", "every-key", "mix", "curriculum", "multi-question", "recall")
FORMAT_HELP = """look-up format (default corpus: the rows `train_nano.py --kinds lookup` trains on, any --kinds);
the others are look-up rows built here, each half with thinking on: question-first "Value of bee? cat=8,
bee=3." -> "3"; glued "cat8, bee3. Value of bee?" (value one token after its key); word "cat rainy, bee
sunny. Value of bee?" -> "sunny"; every-key "Values of bee, cat? cat=8, bee=3." -> "bee=3, cat=8"; mix:
half every-key rows, half corpus look-ups; curriculum: every-key rows for --curriculum-steps, then corpus
look-ups; multi-question: the corpus look-up as the first turn of a chat whose next user turns ask the
same table's other keys ("Value of cat?"), every answer supervised (several look-ups per row in the
corpus's own wording). Held-out rows: the format's own (corpus look-ups for mix, curriculum and
multi-question); recall: bare associative recall, no chat template: " cat 3 bee 8 | bee" -> "8" as nano's
token ids (a word token, its digit; 2-4 pairs; the query key then its value supervised), the textbook
one-query recall task (held-out: its own rows)"""


def lookup_example(fmt: str, seed: int, index: int, attempt: int = 0):
    """Look-up example `index` of format `fmt` with `seed` (pure), rendered with the V4.1 chat encoder;
    attempt > 0: a redraw for the same index (`LookupRows` redraws rows too long for --seq-len)."""
    import numpy as np

    from dsv41_jax.training import data

    rng = np.random.default_rng([int(seed), int(index), 7, int(attempt)])
    think = bool(rng.integers(2))
    W = data.WORDS
    keys = [W[k] for k in rng.choice(len(W), size=int(rng.integers(2, 5)), replace=False)]
    vals = [str(int(rng.integers(10))) for _ in keys]
    q = int(rng.integers(len(keys)))
    if fmt == "question-first":
        table = ", ".join(f"{k}={v}" for k, v in zip(keys, vals))
        qa = (f"Value of {keys[q]}? {table}.", f"{keys[q]}={vals[q]}", vals[q])
    elif fmt == "glued":
        table = ", ".join(f"{k}{v}" for k, v in zip(keys, vals))
        qa = (f"{table}. Value of {keys[q]}?", f"{keys[q]}{vals[q]}", vals[q])
    elif fmt == "word":
        vals = [data.SKIES[int(rng.integers(len(data.SKIES)))] for _ in keys]
        table = ", ".join(f"{k} {v}" for k, v in zip(keys, vals))
        qa = (f"{table}. Value of {keys[q]}?", f"{keys[q]} {vals[q]}", vals[q])
    elif fmt == "every-key":
        order = [int(i) for i in rng.permutation(len(keys))]
        table = ", ".join(f"{k}={v}" for k, v in zip(keys, vals))
        ans = ", ".join(f"{keys[i]}={vals[i]}" for i in order)
        qa = (f"Values of {', '.join(keys[i] for i in order)}? {table}.", ans, ans)
    else:
        raise ValueError(f"no generator for format {fmt!r}")
    target = {"role": "assistant", "content": qa[2]}
    if think:
        target["reasoning_content"] = qa[1]
    ex = data.Example("lookup", [{"role": "user", "content": qa[0]}], None, think, target, qa[2])
    ex.prompt, ex.completion = data.render(ex)
    return ex


def multi_question_row(seed: int, index: int, tokenizer, seq_len: int, pad_id: int):
    """A multi-question look-up row (pure in seed, index): the corpus's look-up example as the first turn,
    then user turns "Value of <key>?" about the same table (each key once, shuffled, as many as fit in
    seq_len + 1 tokens), with the loss on every assistant answer: history answers as the chat encoder
    renders them ("</think>5<eos>", the answer and its end supervised), the last turn's whole completion.
    Returns a `data.pack`-style row, or None when not even one follow-up fits."""
    import re

    import numpy as np

    from dsv41_jax.chat_format.encoding import EOS, THINK_CLOSE, encode_messages
    from dsv41_jax.training import data

    first = data.make_example(seed, index, kinds=("lookup",))
    rng = np.random.default_rng([int(seed), int(index), 11])
    table = first.messages[0]["content"].split(". Value of ")[0]
    pairs = dict(kv.strip().split("=") for kv in table.split(","))
    asked = first.messages[0]["content"].rsplit(" ", 1)[1].rstrip("?")
    order = [k for k in rng.permutation(sorted(pairs)) if k != asked]
    best = None
    for n in range(1, len(order) + 1):
        msgs = list(first.messages)
        hist = {"role": "assistant", "content": first.answer}
        for k in order[:n - 1]:
            msgs += [hist, {"role": "user", "content": f"Value of {k}?"}]
            hist = {"role": "assistant", "content": pairs[k]}
        k = order[n - 1]
        msgs += [hist, {"role": "user", "content": f"Value of {k}?"}]
        prompt = encode_messages(msgs, thinking=first.thinking)
        completion = ((f"{k}={pairs[k]}" + THINK_CLOSE) if first.thinking else "") + pairs[k] + EOS
        # Tokenize between the special tokens (they are atomic), so each history answer is its own piece.
        pieces = [x for x in re.split(r"(<\uff5c[^>]*\uff5c>|</think>|<think>)", prompt) if x]
        ids, mask = [], []
        for j, piece in enumerate(pieces):
            t = tokenizer.encode(piece)
            # a history answer: the text between "</think>" and the end-of-sentence token
            sup = j > 0 and pieces[j - 1] == THINK_CLOSE and j + 1 < len(pieces) and pieces[j + 1] == EOS
            ids += t
            mask += [sup] * len(t)
            if piece == EOS and j > 1 and pieces[j - 2] == THINK_CLOSE:
                mask[-len(t):] = [True] * len(t)
        assert ids == tokenizer.encode(prompt), "piecewise tokenization differs from the whole prompt's"
        comp = tokenizer.encode(completion)
        full_ids = ids + comp
        if len(full_ids) > seq_len + 1:
            break
        m = np.zeros(seq_len, np.float32)
        for t_, s_ in enumerate(mask):  # target t = ids[t + 1]
            if s_ and t_ >= 1:
                m[t_ - 1] = 1.0
        m[len(ids) - 1:len(full_ids) - 1] = 1.0
        full = np.full(seq_len + 1, pad_id, np.int32)
        full[:len(full_ids)] = full_ids
        best = {"tokens": full[:-1], "targets": full[1:], "mask": m}
    return best


def recall_row(seed: int, index: int, tokenizer, seq_len: int, pad_id: int) -> dict:
    """A bare associative-recall row (pure in seed, index): pairs (" <word>" token, digit token) for 2-4
    distinct words, a separator ("|"), the query word, its digit — the loss on that digit only."""
    import numpy as np

    from dsv41_jax.training import data

    def one(text):
        ids = tokenizer.encode(text)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    rng = np.random.default_rng([int(seed), int(index), 13])
    keys = [one(" " + data.WORDS[k]) for k in rng.choice(len(data.WORDS), size=int(rng.integers(2, 5)), replace=False)]
    vals = [one(str(int(rng.integers(10)))) for _ in keys]
    q = int(rng.integers(len(keys)))
    ids = [x for kv in zip(keys, vals) for x in kv] + [one("|"), keys[q], vals[q]]
    full = np.full(seq_len + 1, pad_id, np.int32)
    full[:len(ids)] = ids
    mask = np.zeros(seq_len, np.float32)
    mask[len(ids) - 2] = 1.0
    return {"tokens": full[:-1], "targets": full[1:], "mask": mask}


class LookupRows:
    """Random-access packed rows of one `lookup_example` format (like `data.PackedSource`)."""

    def __init__(self, fmt, tokenizer, seed, seq_len):
        from dsv41_jax.training import data

        self.fmt, self.tok, self.seed, self.seq_len = fmt, tokenizer, seed, seq_len
        self.pad_id = data.PackedSource(tokenizer, seed, seq_len).pad_id

    def __getitem__(self, i):
        from dsv41_jax.training import data

        for attempt in range(64):
            if self.fmt == "recall":
                return recall_row(self.seed, i, self.tok, self.seq_len, self.pad_id)
            if self.fmt == "multi-question":
                row = multi_question_row(self.seed, i + (attempt << 32), self.tok, self.seq_len, self.pad_id)
                if row is not None:
                    return row
                continue
            ex = lookup_example(self.fmt, self.seed, i, attempt)
            row = data.pack(*data.tokenize(ex, self.tok), self.seq_len, self.pad_id)
            if row is not None:
                return row
        raise ValueError(f"no {self.fmt} look-up fits in --seq-len {self.seq_len} after 64 draws (row {i})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="lookup",
                    help="comma-separated text task kinds to train and evaluate on (default lookup; 'copy' is the "
                         "control that the same model does learn an in-context task)")
    ap.add_argument("--format", default="corpus", choices=FORMATS, help=FORMAT_HELP)
    ap.add_argument("--curriculum-steps", type=int, default=0,
                    help="with --format curriculum: steps of every-key rows before the corpus look-ups")
    ap.add_argument("--steps", type=int, default=3000, help="optimizer steps (default 3000)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows per step (default 16, nano's)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per row (default 64, nano's)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    ap.add_argument("--width", type=int, default=128, help="model width (default 128, nano's hidden size)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4, nano's)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3, nano's)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warmup steps (default 50, nano's)")
    ap.add_argument("--seed", type=int, default=0, help="training-data seed (default 0, nano's)")
    ap.add_argument("--eval-seed", type=int, default=1, help="held-out data seed (default 1)")
    ap.add_argument("--eval-rows", type=int, default=256, help="held-out rows per evaluation (default 256)")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between evaluations (default 100)")
    ap.add_argument("--init-seed", type=int, default=0, help="parameter initialization seed (default 0)")
    ap.add_argument("--out", default="", help="also write the evaluation lines as JSON lines to this file")
    args = ap.parse_args(argv)
    from dsv41_jax.training import data

    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in args.kinds if k not in data.TEXT_KINDS]
    if bad or not args.kinds:
        ap.error(f"--kinds: unknown or tool kinds {bad}; choose from {','.join(data.TEXT_KINDS)}")
    if args.eval_seed == args.seed:
        ap.error("--eval-seed must differ from --seed")
    if args.format != "corpus" and args.kinds != ("lookup",):
        ap.error("--format other than corpus builds look-up rows only; drop --kinds")
    if (args.format == "curriculum") != (args.curriculum_steps > 0) or args.curriculum_steps >= args.steps:
        ap.error("--curriculum-steps (between 1 and --steps - 1) goes with --format curriculum, and only with it")
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be >= 0 and below --steps")
    if args.width % args.heads or (args.width // args.heads) % 2:
        ap.error("--width must split into --heads heads of an even size")
    for k in ("steps", "batch_size", "seq_len", "layers", "eval_rows", "eval_every"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dsv41_jax.model.config import NANO_DIR, ModelConfig
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training import data

    tok = load_tokenizer(NANO_DIR)
    V, D, H, L, T = ModelConfig.preset("nano").vocab_size, args.width, args.heads, args.layers, args.seq_len
    corpus = data.PackedSource(tok, args.seed, T, kinds=args.kinds)
    single = args.format in ("corpus", "mix", "curriculum", "multi-question")  # held out: corpus look-ups
    own = None if args.format in ("corpus", "mix", "curriculum") else LookupRows(args.format, tok, args.seed, T)
    every = LookupRows("every-key", tok, args.seed, T) if args.format in ("mix", "curriculum") else None
    held = (data.PackedSource(tok, args.eval_seed, T, kinds=args.kinds) if single
            else LookupRows(args.format, tok, args.eval_seed, T))

    def train_row(step, i):
        if own is not None:
            return own[i]
        if args.format == "mix" and i % 2:
            return every[i]
        if args.format == "curriculum" and step < args.curriculum_steps:
            return every[i]
        return corpus[i]

    def stack(r):
        return {k: jnp.asarray(np.stack([x[k] for x in r])) for k in r[0]}

    def init(key):
        ks = iter(jax.random.split(key, 8 * L + 4))
        n = lambda *s: jax.random.normal(next(ks), s, jnp.float32) * 0.02  # noqa: E731
        p = {"emb": n(V, D), "head": n(D, V), "norm": jnp.ones(D)}
        p["layers"] = [{"n1": jnp.ones(D), "n2": jnp.ones(D), "wq": n(D, D), "wk": n(D, D), "wv": n(D, D),
                        "wo": n(D, D), "w1": n(D, 4 * D), "w2": n(4 * D, D)} for _ in range(L)]
        return p

    def rms(x, w):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w

    def rope(x):  # [B, T, H, d]: rotate pairs by position * 10000^(-2i/d)
        d = x.shape[-1]
        ang = jnp.arange(x.shape[1])[:, None] * 10000.0 ** (-jnp.arange(0, d, 2) / d)
        c, s = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(x.shape)

    def forward(p, tokens):
        B, Tn = tokens.shape
        x = p["emb"][tokens]
        causal = jnp.tril(jnp.ones((Tn, Tn), bool))
        for lp in p["layers"]:
            h = rms(x, lp["n1"])
            q, k, v = ((h @ lp[w]).reshape(B, Tn, H, D // H) for w in ("wq", "wk", "wv"))
            s = jnp.einsum("bqhd,bkhd->bhqk", rope(q), rope(k)) / np.sqrt(D // H)
            a = jax.nn.softmax(jnp.where(causal, s, -1e9), -1)
            x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, Tn, D) @ lp["wo"]
            x = x + jax.nn.gelu(rms(x, lp["n2"]) @ lp["w1"]) @ lp["w2"]
        return rms(x, p["norm"]) @ p["head"]

    def loss_fn(p, b):
        logits = forward(p, b["tokens"])
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]
        m = b["mask"]
        hit = (logits.argmax(-1) == b["targets"]) | (m == 0)
        return (nll * m).sum() / m.sum(), hit.all(-1).mean()

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    params = init(jax.random.key(args.init_seed))
    state = opt.init(params)

    @jax.jit
    def step(p, st, b):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(p, b)
        upd, st = opt.update(g, st, p)
        return optax.apply_updates(p, upd), st, loss, acc

    evaluate = jax.jit(loss_fn)
    held_rows = stack([held[i] for i in range(args.eval_rows)])
    print(f"plain transformer: {L} layers, width {D}, {H} heads, vocab {V}; {args.batch_size} rows x {T} tokens "
          f"per step, kinds {','.join(args.kinds)}, format {args.format}; backend {jax.default_backend()}", flush=True)
    out = open(args.out, "w") if args.out else None
    t0 = time.time()
    for s in range(args.steps):
        b = stack([train_row(s, i) for i in range(s * args.batch_size, (s + 1) * args.batch_size)])
        params, state, loss, _ = step(params, state, b)
        if (s + 1) % args.eval_every == 0 or s + 1 == args.steps:
            el, ea = evaluate(params, held_rows)
            rec = {"step": s + 1, "train_loss": round(float(loss), 4), "eval_loss": round(float(el), 4),
                   "eval_seq_acc": round(float(ea), 4), "seconds": round(time.time() - t0, 1)}
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
