#!/usr/bin/env python
"""Write a random checkpoint in the DeepSeek-V4.1 Flash release layout (docs/design/spec.md §8), for tests.

    python scripts/make_checkpoint.py --preset tiny --out DIR [--seed N] [--shards K]
    python scripts/make_checkpoint.py --config my_config.json --out DIR   # any (small) config
    python scripts/make_checkpoint.py --preset tiny-v4 --out DIR   # DeepSeek-V4 (`model.v4.checkpoint`)
    python scripts/make_checkpoint.py --preset tiny-v4 --draft dspark --out DIR   # V4 with a 0731-style DSpark head

Writes DIR/config.json (HF form: text_config + quantization_config), DIR/model.safetensors.index.json,
K shards DIR/model-0000i-of-0000K.safetensors with the release's tensor names and dtypes (F8_E4M3
weights with F8_E8M0 32x32 block scales, packed U8 MXFP4 routed experts with per-32 scales, BF16,
F32), and the tokenizer files. Values are `init_params(cfg, jax.random.key(seed))`: scaled normals
quantized with power-of-two scales, so dequantized weights have std ~ 1/sqrt(fan_in). The same
arguments always give byte-identical files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="config preset (tiny, tiny-v4; flash is far too large to write)")
    ap.add_argument("--config", default=None,
                    help="config.json (HF or flat form) to use instead of --preset")
    ap.add_argument("--out", required=True, help="output directory (created; must be empty or absent)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--shards", type=int, default=2, help="number of safetensors shards (default 2)")
    ap.add_argument("--scale-format", choices=("e8m0", "u8"), default="e8m0",
                    help="dtype of .scale tensors: F8_E8M0 as the release (default) or U8 (same bits)")
    ap.add_argument("--markov-names", choices=("embed_head", "w1_w2"), default="embed_head",
                    help="Markov head tensor names: markov_head.embed/head (default) or markov_w1/w2")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="directory with tokenizer.json etc. to copy (default: the tiny tokenizer)")
    ap.add_argument("--draft", choices=("mtp", "dspark"), default=None,
                    help="DeepSeek-V4 only: the draft to write — an MTP layer (the original Flash / Pro) or a DSpark "
                         "head laid out as Flash-0731 / Pro-0813's (`config_v4.with_dspark`); default: the config's")
    ap.add_argument("--text-only", action="store_true",
                    help="leave out the vision-only tensors (ffn.gate.bias_vl), as a release without the vision "
                         "tower may ship; the loader puts zeros in their place")
    args = ap.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    from dsv41_jax.model.checkpoint import save_hf_checkpoint
    from dsv41_jax.model.config import TINY_DIR, ConfigError, ModelConfig
    from dsv41_jax.model.params import init_params, param_stats

    try:
        cfg = ModelConfig.from_pretrained(args.config) if args.config else ModelConfig.preset(args.preset)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.draft is not None and cfg.model_family != "deepseek_v4":
        print("error: --draft is a DeepSeek-V4 option (V4.1's draft is always its DSpark head)", file=sys.stderr)
        return 2
    if args.draft is not None and args.draft != cfg.draft_kind:
        from dsv41_jax.model import config_v4

        if args.draft == "mtp":
            print(f"error: --draft mtp: this config's draft is a {cfg.draft_kind} head; use a config with an MTP "
                  "layer (e.g. --preset tiny-v4)", file=sys.stderr)
            return 2
        cfg = config_v4.with_dspark(cfg)
    if args.shards < 1:
        print("error: --shards must be >= 1", file=sys.stderr)
        return 2
    stats = param_stats(cfg)
    if stats["bytes"] > 8 << 30:
        print(f"error: this config's checkpoint would be {stats['bytes'] / 2**30:.0f} GiB; this writer is for "
              "small test checkpoints", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and os.listdir(args.out):
        print(f"error: {args.out} exists and is not empty", file=sys.stderr)
        return 2
    tdir = args.tokenizer_dir or TINY_DIR
    t0 = time.time()
    if cfg.model_family == "deepseek_v4":  # DeepSeek-V4 (e.g. --preset tiny-v4): V4's release layout
        if args.markov_names != "embed_head" or args.text_only:
            print("error: --markov-names / --text-only are V4.1 options (V4 has no Markov head or vision tensors)",
                  file=sys.stderr)
            return 2
        from dsv41_jax.model.v4.checkpoint import save_checkpoint

        index = save_checkpoint(init_params(cfg, jax.random.key(args.seed)), cfg, args.out, shards=args.shards,
                                tokenizer_dir=tdir, scale_format=args.scale_format)
        print(f"wrote {args.out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']:,} bytes "
              f"(DeepSeek-V4 layout, {time.time() - t0:.1f} s)")
        return 0
    params = init_params(cfg, jax.random.key(args.seed), tokenizer=os.path.join(tdir, "tokenizer.json"))
    index = save_hf_checkpoint(params, cfg, args.out, shards=args.shards, tokenizer_dir=tdir,
                               scale_format=args.scale_format, markov_names=args.markov_names,
                               vision_tensors=not args.text_only)
    n_files = len(set(index["weight_map"].values()))
    print(f"wrote {args.out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']:,} bytes in "
          f"{n_files} shard(s) ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
