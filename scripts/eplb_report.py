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

``--measure-dispatch`` (with a recording) then MEASURES it: the recorded routings go, in steps of
``--step-tokens``, through the model's all_to_all dispatch (`moe_dispatch.routed_experts_dispatch` with the
placement's `eplb.ExpertLocation`, nano's experts stored as E + R physical experts) on ``--devices`` fake CPU
devices, and the rows each device receives are the dispatch's own count (``return_load``).
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
    ap.add_argument("--measure-dispatch", action="store_true",
                    help="also MEASURE the load: the recorded tokens' routings go through the model's all_to_all "
                         "dispatch (moe_dispatch.routed_experts_dispatch, nano's experts, --devices fake CPU "
                         "devices) in steps of --step-tokens, and the rows each device receives are counted by the "
                         "dispatch itself (contiguous split vs EPLB with each R; needs a recording, not --distribution)")
    ap.add_argument("--step-tokens", type=int, default=512, help="tokens per measured step (default 512)")
    return ap


def record(n_examples: int, seed: int, max_len: int, routes: dict = None) -> dict:
    """{layer_id: tokens per expert} of nano's forward over `n_examples` corpus conversations (and, into
    `routes` when given, {layer_id: [int32 [n, k] of each conversation's real tokens]})."""
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
            e = np.asarray(ex)[0, :len(ids)]  # the real tokens only (the row's padding is cut)
            if routes is not None:
                routes.setdefault(int(lid), []).append(e.astype(np.int32))
            e = e.reshape(-1)
            c = counts.setdefault(int(lid), np.zeros(cfg.n_routed_experts, np.int64))
            np.add.at(c, e, 1)
    return counts


def measure(routes: dict, dist: dict, G: int, Rs, step_tokens: int) -> list:
    """[(name, over-all-layers max/mean)]: each layer's recorded routings through the all_to_all dispatch on G
    fake CPU devices in steps of `step_tokens` tokens, the rows per device as the dispatch counts them; per step
    the busiest device counts, so the figure is Σ_steps,layers max / Σ mean (the contiguous split, then each R)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from dsv41_jax.model.checkpoint import load_params
    from dsv41_jax.model.config import NANO_DIR, ModelConfig
    from dsv41_jax.parallel import eplb
    from dsv41_jax.parallel import moe_dispatch as md

    if len(jax.devices()) < G:
        raise SystemExit(f"error: --measure-dispatch: {G} devices needed, {len(jax.devices())} present")
    cfg = ModelConfig.from_pretrained(NANO_DIR).replace(deterministic=True)
    params = load_params(NANO_DIR, cfg)
    mesh = Mesh(np.array(jax.devices()[:G]), ("ep",))
    D, k = cfg.hidden_size, cfg.num_experts_per_tok

    def run(ex, idx, loc_t):
        f = jax.jit(lambda e, x, i, w, t: md.routed_experts_dispatch(
            e, x, i, w, cfg, jnp.bfloat16, mesh, token_axes="ep", expert_axes="ep", location=t, return_load=True)[1])
        return np.asarray(f(ex, jnp.zeros((idx.shape[0], D), jnp.bfloat16), idx, np.ones(idx.shape, np.float32), loc_t))

    out = []
    for R in [None] + list(Rs):
        loc = None if R is None else eplb.ExpertLocation.from_distribution(dist, G, R, len(dist))
        mx = mean = 0.0
        for lid in sorted(routes):
            ex = params["layers"][lid]["ffn"]["experts"]
            t = None
            if loc is not None:
                ids = jnp.asarray(loc.physical_ids(lid))
                ex = jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=0), ex)
                slot, copies = loc.tables()
                t = (jnp.asarray(slot[lid]), jnp.asarray(copies[lid]))
            idx = np.concatenate(routes[lid])
            n = -(-idx.shape[0] // step_tokens) * step_tokens
            valid_pad = np.full((n - idx.shape[0], k), -1, np.int32)  # past the trace: no expert (not dispatched)
            idx = np.concatenate([idx, valid_pad])
            for s in range(0, n, step_tokens):
                load = run(ex, idx[s:s + step_tokens], t)
                mx += load.max()
                mean += load.mean()
        out.append(("contiguous (today's EP)" if R is None else f"EPLB R={R}", mx / mean))
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dsv41_jax.parallel import eplb

    try:
        Rs = [int(r) for r in args.redundant.split(",")]
    except ValueError:
        print(f"error: --redundant {args.redundant!r}: expected comma-separated integers", file=sys.stderr)
        return 2
    if args.measure_dispatch and args.distribution:
        print("error: --measure-dispatch needs a recording (the tokens' routings), not --distribution", file=sys.stderr)
        return 2
    if args.distribution:
        try:
            dist = eplb.load_distribution(args.distribution)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        source = args.distribution
    else:
        if args.measure_dispatch and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={args.devices}").strip()
        routes = {} if args.measure_dispatch else None
        dist = record(args.examples, args.seed, args.max_len, routes)
        source = f"nano, {args.examples} corpus conversations (seed {args.seed}, <= {args.max_len} tokens each)"
        if args.out:
            eplb.save_distribution(args.out, dist)
    E = len(next(iter(dist.values())))
    G = args.devices
    if E % G:
        print(f"error: --devices {G}: {E} experts do not split evenly (today's EP needs E % G == 0)", file=sys.stderr)
        return 2
    rows = [("contiguous (today's EP)", {lid: eplb.LayerPlacement.contiguous(E, G) for lid in dist})]
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
    if args.measure_dispatch:
        print(f"\nmeasured by the all_to_all dispatch ({G} fake CPU devices, steps of {args.step_tokens} tokens): "
              "Σ per-step max / Σ per-step mean rows per device, all layers")
        print("| placement | measured max/mean |")
        print("|---|---|")
        for name, r in measure(routes, dist, G, Rs, args.step_tokens):
            print(f"| {name} | {r:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
