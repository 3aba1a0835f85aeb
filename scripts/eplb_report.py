#!/usr/bin/env python
"""Record a routing distribution and report what redundant experts (EPLB) do to the per-device load.

    python scripts/eplb_report.py                                   # nano, 4 devices, R = 0 and 4
    python scripts/eplb_report.py --devices 8 --redundant 8 --out runs/nano_experts.json
    python scripts/eplb_report.py --distribution runs/nano_experts.json --devices 4 --redundant 4

Recording: nano's bundled checkpoint runs the reference forward (`transformer.forward`, return_aux) over
``--examples`` conversations of its synthetic chat corpus (`training.data.make_example`, ``--seed``;
prompt + completion, each conversation one row, so the trace is the tokens a server would prefill and
decode for them) and counts, per MoE layer, the (token, expert) assignments: the distribution file of
`parallel.eplb` (``--out``), the format ``--init-expert-location`` reads. Or ``--distribution`` reads one.

Report: for each ``--redundant`` R, `eplb.plan_placement` places E + R physical experts over
``--devices`` devices, and `eplb.device_loads` gives the tokens each device receives (a replicated
expert's tokens split evenly over its copies); printed per layer and over all layers: max / mean
tokens per device (1.0 = perfectly balanced). R = 0 is the plain split (expert e on device
e // (E / G)) only when the placement keeps it; the packing already balances without copies, so the
table also shows the contiguous split that EP uses today (``contiguous``).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distribution", default=None, help="read this distribution file instead of recording one")
    ap.add_argument("--examples", type=int, default=64, help="conversations to record (default 64)")
    ap.add_argument("--seed", type=int, default=2000, help="corpus seed of the recorded conversations (default 2000)")
    ap.add_argument("--max-len", type=int, default=256, help="tokens per row; longer conversations are cut (default 256)")
    ap.add_argument("--devices", type=int, default=4, help="devices the experts are spread over (default 4)")
    ap.add_argument("--redundant", default="0,4", help="comma-separated redundant-expert counts R (default 0,4)")
    ap.add_argument("--out", default=None, help="write the recorded distribution here (JSON, eplb's format)")
    return ap


def record(n_examples: int, seed: int, max_len: int) -> dict:
    """{layer_id: tokens per expert} of nano's forward over `n_examples` corpus conversations."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model.checkpoint import load_params
    from dsv41_jax.model.config import NANO_DIR, ModelConfig
    from dsv41_jax.model.transformer import forward
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training.data import make_example, render

    cfg = ModelConfig.from_pretrained(NANO_DIR)
    params = load_params(NANO_DIR, cfg)
    tok = load_tokenizer(NANO_DIR)
    fwd = jax.jit(forward, static_argnames=("cfg", "return_aux"))
    counts: dict = {}
    try:
        from tqdm import tqdm
        it = tqdm(range(n_examples), desc="recording", unit="conv")
    except ImportError:  # tqdm is optional
        it = range(n_examples)
    for i in it:
        prompt, completion = render(make_example(seed, i))
        ids = (tok.encode(prompt) + tok.encode(completion))[:max_len]
        row = np.zeros((1, max_len), np.int32)
        row[0, :len(ids)] = ids
        _, aux = fwd(params, jnp.asarray(row), cfg, return_aux=True)
        for lid, ex in aux["experts"].items():
            e = np.asarray(ex)[0, :len(ids)].reshape(-1)  # the real tokens only (the row's padding is cut)
            c = counts.setdefault(int(lid), np.zeros(cfg.n_routed_experts, np.int64))
            np.add.at(c, e, 1)
    return counts


def contiguous(E: int, G: int):
    """Today's EP split as a placement: expert e on device e // (E / G), one copy each."""
    from dsv41_jax.parallel.eplb import LayerPlacement

    per = E // G
    return LayerPlacement(physical=tuple(tuple(range(d * per, (d + 1) * per)) for d in range(G)), copies=(1,) * E)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dsv41_jax.parallel import eplb

    try:
        Rs = [int(r) for r in args.redundant.split(",")]
    except ValueError:
        print(f"error: --redundant {args.redundant!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    if args.distribution:
        try:
            dist = eplb.load_distribution(args.distribution)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        source = args.distribution
    else:
        dist = record(args.examples, args.seed, args.max_len)
        source = f"nano, {args.examples} corpus conversations (seed {args.seed}, <= {args.max_len} tokens each)"
        if args.out:
            eplb.save_distribution(args.out, dist)
    E = len(next(iter(dist.values())))
    G = args.devices
    if E % G:
        print(f"error: --devices {G}: {E} experts do not split evenly (today's EP needs E % G == 0)", file=sys.stderr)
        return 2
    rows = [("contiguous (today's EP)", {lid: contiguous(E, G) for lid in dist})]
    for R in Rs:
        try:
            rows.append((f"EPLB R={R}", eplb.plan_placement(dist, G, R)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    total = sum(int(v.sum()) for v in dist.values())
    print(f"distribution: {source}; {len(dist)} MoE layers, {E} experts, {total} (token, expert) assignments")
    print(f"devices: {G}; max/mean tokens per device (1.00 = balanced), per layer and over all layers")
    print("| placement | " + " | ".join(f"layer {lid}" for lid in sorted(dist)) + " | all layers |")
    print("|---|" + "---|" * (len(dist) + 1))
    for name, plan in rows:
        per_layer = [eplb.device_loads(dist[lid], plan[lid]) for lid in sorted(dist)]
        ratios = [f"{lo.max() / lo.mean():.2f}" for lo in per_layer]
        # over all layers: the step waits for the slowest device of each layer, so sum the per-layer maxima
        worst = sum(lo.max() for lo in per_layer) / sum(lo.mean() for lo in per_layer)
        print(f"| {name} | " + " | ".join(ratios) + f" | {worst:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
