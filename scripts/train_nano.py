#!/usr/bin/env python
"""Train the `nano` preset on the synthetic chat corpus, on CPU.

    python scripts/train_nano.py --out runs/nano                # train (resumes if runs/nano has a checkpoint)
    python scripts/train_nano.py --out runs/nano --steps 3000   # continue a finished run to more steps

What it does: builds the `nano` config (tiny's layer layout, every mechanism, 128 wide), initializes
it from `--init-seed`, converts the weights to fp32 masters (`training.trainer`), and trains with
`jax.grad` through the project's own forward (fake-quantized activations with straight-through
derivatives) on rows of the synthetic corpus (`training.data`: rendered with the V4.1 chat encoder,
loss on the completion only), loaded by Grain. Every --log-every steps a line with loss / token
accuracy / sequence accuracy (teacher-forced: the fraction of completions greedy decoding would
reproduce exactly); every --eval-every steps the same on held-out rows (--eval-seed, another seed
than the training data); an Orbax checkpoint every --ckpt-every steps, at the end, and when
--max-minutes runs out or on SIGTERM / Ctrl-C (after the current step), so an interrupted run
resumes where it stopped (same rows, same state).

Same seeds -> same data -> same run. The DSpark stages are not trained here (they stay as
initialized); export to the release format is a later step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("train_nano")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run directory: Orbax checkpoints under OUT/ckpt, metrics in "
                    "OUT/metrics.jsonl; a run found there is resumed")
    ap.add_argument("--steps", type=int, default=2000, help="total optimizer steps (default 2000)")
    ap.add_argument("--batch-size", type=int, default=16, help="text rows per step (default 16)")
    ap.add_argument("--seq-len", type=int, default=64,
                    help="tokens per text row (default 64: every text task fits with nano's tokenizer)")
    ap.add_argument("--tool-batch-size", type=int, default=2,
                    help="tool-calling rows per step, beside the text rows (default 2)")
    ap.add_argument("--tool-seq-len", type=int, default=240,
                    help="tokens per tool-calling row (default 240: its system prompt is long)")
    ap.add_argument("--kinds", default=",".join(_all_kinds()),
                    help="comma-separated task kinds to train on (default all: %(default)s); the tool kinds "
                         "go to the tool rows, the others to the text rows")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW; default 2e-3)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warmup steps (default 50)")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay on matrices (default 0.01)")
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="training-data seed (default 0)")
    ap.add_argument("--eval-seed", type=int, default=1, help="held-out data seed (default 1; must differ from --seed)")
    ap.add_argument("--init-seed", type=int, default=0, help="parameter initialization seed (default 0)")
    ap.add_argument("--log-every", type=int, default=10, help="steps between training metric lines (default 10)")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations (default 100; 0 = off)")
    ap.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation (default 4)")
    ap.add_argument("--ckpt-every", type=int, default=100, help="steps between Orbax checkpoints (default 100)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop (after a checkpoint) once this much wall time has passed; 0 = no limit")
    ap.add_argument("--stop-step", type=int, default=0,
                    help="stop (after a checkpoint) at this step, keeping --steps' learning-rate schedule (how "
                         "the shipped checkpoint was cut: --steps 2200 --stop-step 2160); 0 = run to --steps")
    ap.add_argument("--cache-min-compile-secs", type=float, default=5.0,
                    help="persist a compiled program in OUT/jax_cache only when it took at least this "
                         "long to compile (default 5.0; 0 = every program), so a resumed run skips "
                         "the slow compiles")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (metric lines only)")
    return ap


def _all_kinds():
    from dsv41_jax.training.data import KINDS

    return KINDS


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines
    from dsv41_jax.training.data import KINDS

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    errors = []
    if bad or not kinds:
        errors.append(f"--kinds: unknown kind(s) {bad or '(none given)'}; known: {', '.join(KINDS)}")
    for name in ("steps", "batch_size", "seq_len", "tool_batch_size", "tool_seq_len", "log_every", "ckpt_every",
                 "eval_batches"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0 or args.lr <= 0 or args.max_minutes < 0 or args.cache_min_compile_secs < 0:
        errors.append("--eval-every, --max-minutes and --cache-min-compile-secs must be >= 0 and --lr > 0")
    if args.stop_step < 0 or args.stop_step > args.steps:
        errors.append(f"--stop-step must be in 0..--steps ({args.steps}), got {args.stop_step}")
    if args.eval_seed == args.seed:
        errors.append(f"--eval-seed must differ from --seed (both {args.seed}): held-out rows must be unseen")
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2

    import jax
    import jax.numpy as jnp

    from dsv41_jax.model.config import NANO_DIR, ModelConfig
    from dsv41_jax.model.params import init_params
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training import data, trainer

    cfg = ModelConfig.preset("nano")
    tok = load_tokenizer(NANO_DIR)
    os.makedirs(args.out, exist_ok=True)
    trainer.use_run_cache(args.out, args.cache_min_compile_secs)
    meta = {k: v for k, v in vars(args).items()
            if k not in ("max_minutes", "no_progress", "out", "stop_step", "cache_min_compile_secs")}
    meta["kinds"] = list(kinds)
    log.info("config nano: hidden %d, %d layers + %d DSpark stages, vocab %d; run %s", cfg.hidden_size,
             cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.vocab_size, json.dumps(meta))

    params = trainer.to_master(init_params(cfg, jax.random.key(args.init_seed)))  # engram map: nano's tokenizer
    train, params = trainer.split(params)
    log.info("trainable: %d tensors, %d parameters (fp32 masters)", len(train), sum(v.size for v in train.values()))
    opt = trainer.make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    opt_state = opt.init(train)
    try:
        start, train, opt_state, manager = trainer.resume(args.out, train, opt_state, meta)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    last = args.stop_step or args.steps
    if start >= last:
        log.info("already at step %d >= %s %d: nothing to do", start, "--stop-step" if args.stop_step else "--steps",
                 last)
        return 0

    step_fn = trainer.make_train_step(cfg, opt)
    eval_fn = trainer.make_eval_step(cfg)
    buckets = data.row_buckets(kinds, args.seq_len, args.batch_size, args.tool_seq_len, args.tool_batch_size)
    held = data.bucket_stream(tok, args.eval_seed, buckets)
    eval_batches = [jax.tree_util.tree_map(jnp.asarray, next(held)) for _ in range(args.eval_batches)]
    log.info("rows per step: %s", ", ".join(f"{bs} x {t} tokens ({','.join(ks)})" for ks, t, bs, _ in buckets))
    trainer.run_loop(step_fn, train, opt_state, params, data.bucket_stream(tok, args.seed, buckets, start),
                     start=start, last=last, manager=manager, meta=meta,
                     metrics_path=os.path.join(args.out, "metrics.jsonl"),
                     evaluate=lambda t: trainer.mean_metrics(eval_fn, t, params, eval_batches),
                     log_every=args.log_every, eval_every=args.eval_every, ckpt_every=args.ckpt_every,
                     max_minutes=args.max_minutes, desc="train nano", no_progress=args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
