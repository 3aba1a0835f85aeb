#!/usr/bin/env python
"""Train nano's DSpark draft (its 3 stages) on the frozen, trained target.

    python scripts/eval_nano.py --run runs/nano --export-only --export-dir runs/nano/export   # the target
    python scripts/train_nano_dspark.py --target runs/nano/export --out runs/nano_dspark \\
        --steps 600 --export runs/nano_dspark/export                                          # the draft

What it does: loads the exported (release-format) target checkpoint --target with the project's
loader, turns it into fp32 masters (`training.trainer.to_master`) and trains only the DSpark leaves
(``mtp.*``: the stages, the Markov head, the confidence head, main_proj / main_norm; the target, the
shared embedding and LM head stay frozen) by distillation from the target's greedy outputs,
teacher-forced over rows of the same synthetic corpus and row buckets train_nano.py uses
(`training.dspark_train`: every anchor of a row is one batch element of the serving draft's own
`dspark.propose`, with rings built from the target's features as serving writes them). Every
--log-every steps a line with the loss, each block slot's top-1 agreement with the target and the
expected accept length under greedy verification (teacher-forced); at the start, every --eval-every
steps and when stopping the same on held-out rows (--eval-seed); an Orbax checkpoint every
--ckpt-every steps, at the end, and when --max-minutes runs out or on SIGTERM / Ctrl-C, so an
interrupted run resumes where it stopped.
--export DIR then writes the target with the trained draft in the release format (fp8 32x32 blocks,
MXFP4 experts; the same files as eval_nano.py's export), e.g. for scripts/bench_nano_dspark.py.

Same seeds and the same target -> the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("train_nano_dspark")


def _all_kinds():
    from dsv41_jax.training.data import KINDS

    return KINDS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True,
                    help="an exported release-format nano checkpoint directory (eval_nano.py --run RUN "
                         "--export-only --export-dir DIR): the frozen target whose draft is trained")
    ap.add_argument("--out", required=True, help="run directory: Orbax checkpoints under OUT/ckpt, metrics in "
                    "OUT/metrics.jsonl; a run found there is resumed")
    ap.add_argument("--steps", type=int, default=600, help="total optimizer steps (default 600)")
    ap.add_argument("--batch-size", type=int, default=16, help="text rows per step (default 16)")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per text row (default 64, as train_nano.py)")
    ap.add_argument("--tool-batch-size", type=int, default=2,
                    help="tool-calling rows per step, beside the text rows (default 2; 0 = none)")
    ap.add_argument("--tool-seq-len", type=int, default=240, help="tokens per tool-calling row (default 240)")
    ap.add_argument("--anchors", type=int, default=12,
                    help="draft blocks per text row: the anchors from the completion's second token on "
                         "(default 12: every text completion of the corpus fits; anchor_coverage says)")
    ap.add_argument("--tool-anchors", type=int, default=48, help="draft blocks per tool-calling row (default 48)")
    ap.add_argument("--kinds", default=",".join(_all_kinds()),
                    help="comma-separated task kinds (default all: %(default)s); the tool kinds go to the "
                         "tool rows, the others to the text rows")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; default 3e-3)")
    ap.add_argument("--warmup", type=int, default=20, help="linear warmup steps (default 20)")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay on matrices (default 0.01)")
    ap.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    ap.add_argument("--conf-weight", type=float, default=0.1,
                    help="weight of the confidence head's binary cross entropy (default 0.1; 0 = not trained)")
    ap.add_argument("--seed", type=int, default=0, help="training-data seed (default 0, the target's training rows)")
    ap.add_argument("--eval-seed", type=int, default=1, help="held-out data seed (default 1; must differ from --seed)")
    ap.add_argument("--log-every", type=int, default=10, help="steps between training metric lines (default 10)")
    ap.add_argument("--eval-every", type=int, default=50,
                    help="steps between held-out evaluations (default 50; 0 = off)")
    ap.add_argument("--eval-batches", type=int, default=2, help="held-out batches per evaluation (default 2)")
    ap.add_argument("--ckpt-every", type=int, default=50, help="steps between Orbax checkpoints (default 50)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="stop (after a checkpoint) once this much wall time has passed; 0 = no limit")
    ap.add_argument("--export", default=None, metavar="DIR",
                    help="after training (or at once when --steps is already reached), write the target "
                         "with the trained draft to DIR in the release format (replaced if it exists)")
    ap.add_argument("--cache-min-compile-secs", type=float, default=5.0,
                    help="persist a compiled program in OUT/jax_cache only when it took at least this "
                         "long to compile (default 5.0; 0 = every program), so a resumed run skips "
                         "the slow compiles")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (metric lines only)")
    return ap


def check_args(args) -> list:
    """The argument errors (messages), before anything heavy is imported or loaded."""
    from dsv41_jax.training.data import KINDS

    errors = []
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        errors.append(f"--kinds: unknown kind(s) {bad or '(none given)'}; known: {', '.join(KINDS)}")
    for name in ("steps", "batch_size", "seq_len", "tool_seq_len", "anchors", "tool_anchors", "log_every",
                 "ckpt_every", "eval_batches"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tool_batch_size < 0:
        errors.append(f"--tool-batch-size must be >= 0, got {args.tool_batch_size}")
    if args.eval_every < 0 or args.max_minutes < 0 or args.warmup < 0 or args.cache_min_compile_secs < 0:
        errors.append("--eval-every, --max-minutes, --warmup and --cache-min-compile-secs must be >= 0")
    if args.lr <= 0 or args.clip <= 0 or args.conf_weight < 0 or args.weight_decay < 0:
        errors.append("--lr and --clip must be > 0, --conf-weight and --weight-decay >= 0")
    if args.eval_seed == args.seed:
        errors.append(f"--eval-seed must differ from --seed (both {args.seed}): held-out rows must be unseen")
    if not os.path.isfile(os.path.join(args.target, "config.json")):
        errors.append(f"--target {args.target}: not an exported checkpoint directory (no config.json)")
    if args.export and os.path.abspath(args.export) == os.path.abspath(args.target):
        errors.append("--export must not be the --target directory")
    return errors


def _target_digest(target_dir: str) -> str:
    """sha256 over the target's config.json and safetensors shards (names and bytes)."""
    import hashlib

    h = hashlib.sha256()
    for fn in sorted(os.listdir(target_dir)):
        if fn == "config.json" or fn.endswith(".safetensors"):
            h.update(fn.encode())
            with open(os.path.join(target_dir, fn), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def export(out_dir: str, target_dir: str, train: dict, params: dict, template: dict, cfg, meta: dict) -> None:
    """Write the target with the trained draft to `out_dir` (release format, nano's tokenizer)."""
    import shutil

    from dsv41_jax.model.checkpoint import save_hf_checkpoint
    from dsv41_jax.model.config import NANO_DIR
    from dsv41_jax.training import dspark_train, trainer

    release = dspark_train.to_release_params(train, params, template)
    tok_dir = target_dir if os.path.isfile(os.path.join(target_dir, "tokenizer.json")) else NANO_DIR

    def write(d):
        save_hf_checkpoint(release, cfg, d, shards=1, tokenizer_dir=tok_dir)
        run_json = os.path.join(target_dir, "nano_run.json")
        if os.path.isfile(run_json):  # the target's own run record, as eval_nano.py's export writes it
            shutil.copyfile(run_json, os.path.join(d, "nano_run.json"))
        with open(os.path.join(d, "dspark_run.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    trainer.write_dir(out_dir, write)  # out_dir may be the target's own directory or assets/nano


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    errors = check_args(args)
    if errors:
        for e in errors:
            print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax's per-save INFO lines

    import jax
    import jax.numpy as jnp

    from dsv41_jax.model.checkpoint import load_params
    from dsv41_jax.model.config import ModelConfig
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training import data, dspark_train, trainer

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    cfg = ModelConfig.from_pretrained(args.target)
    if cfg.num_nextn_predict_layers < 1:
        print(f"error: --target {args.target} has no DSpark stages (num_nextn_predict_layers = 0)", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.target)
    os.makedirs(args.out, exist_ok=True)
    trainer.use_run_cache(args.out, args.cache_min_compile_secs)
    meta = {k: v for k, v in vars(args).items()
            if k not in ("max_minutes", "no_progress", "out", "export", "cache_min_compile_secs")}
    meta["target"] = os.path.abspath(args.target)
    meta["target_sha256"] = _target_digest(args.target)  # a resumed run must train on the same weights
    meta["kinds"] = list(kinds)
    log.info("target %s: hidden %d, %d layers + %d DSpark stages (block %d), vocab %d; run %s", args.target,
             cfg.hidden_size, cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.dspark_block_size,
             cfg.vocab_size, json.dumps(meta))

    template = load_params(args.target, cfg)
    train, params = dspark_train.split(trainer.to_master(template))
    log.info("trainable (draft): %d tensors, %d parameters (fp32 masters)", len(train),
             sum(v.size for v in train.values()))
    opt = trainer.make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip)
    opt_state = opt.init(train)
    try:
        start, train, opt_state, manager = trainer.resume(args.out, train, opt_state, meta,
                                                          fresh="starting from the target's draft as it is")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    step = start
    if start < args.steps:
        buckets = data.row_buckets(kinds, args.seq_len, args.batch_size, args.tool_seq_len, args.tool_batch_size)
        if not buckets:
            print("error: no rows: --kinds has only tool kinds and --tool-batch-size is 0", file=sys.stderr)
            return 2
        per_kind = {0: args.anchors, data.TOOL_STREAM: args.tool_anchors}
        n_anchors = tuple(min(per_kind[off], t) for _, t, _, off in buckets)
        step_fn = dspark_train.make_train_step(cfg, opt, n_anchors, args.conf_weight)
        eval_fn = dspark_train.make_eval_step(cfg, n_anchors, args.conf_weight)
        held = data.bucket_stream(tok, args.eval_seed, buckets)
        eval_batches = [jax.tree_util.tree_map(jnp.asarray, next(held)) for _ in range(args.eval_batches)]
        log.info("rows per step: %s", ", ".join(f"{bs} x {t} tokens, {a} anchors ({','.join(ks)})"
                                                for (ks, t, bs, _), a in zip(buckets, n_anchors)))
        step, train, opt_state = trainer.run_loop(
            step_fn, train, opt_state, params, data.bucket_stream(tok, args.seed, buckets, start), start=start,
            last=args.steps, manager=manager, meta=meta, metrics_path=os.path.join(args.out, "metrics.jsonl"),
            evaluate=lambda t: trainer.mean_metrics(eval_fn, t, params, eval_batches), log_every=args.log_every,
            eval_every=args.eval_every, ckpt_every=args.ckpt_every, max_minutes=args.max_minutes,
            desc="train nano draft", postfix="accept_len", no_progress=args.no_progress, eval_at_start=True,
            eval_at_stop=True)
    else:
        log.info("already at step %d >= --steps %d: nothing to train", start, args.steps)
    if args.export:
        export(args.export, args.target, train, params, template, cfg, dict(meta, step=step))
        log.info("exported the target with the step-%d draft to %s", step, args.export)
    return 0


if __name__ == "__main__":
    sys.exit(main())
