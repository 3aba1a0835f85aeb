"""Where a compiled step's size comes from: the engine's extend step for one (batch, tokens) shape, lowered and
compiled on this machine's backend at the XLA settings of the environment, with its optimized HLO counted by
opcode and by the jitted function that emitted each instruction (the innermost ``jit(...)`` of its op_name).

    python scripts/step_hlo.py --model tiny --dtype exact --batch 4 --tokens 128 [--top 25] [--json FILE]

A compile's CPU time grows with the HLO it optimizes, so this names what to look at when a step compiles slowly
(docs/benchmarks.md, "Test suite": the fp8 activation quant's share). For the test suite's settings run it with
``XLA_FLAGS`` as tests/conftest.py sets them (it prints the flags it ran with). It compiles one program and runs
nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_OPCODE = re.compile(r"= \S+ ([a-z][\w-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_JIT = re.compile(r"jit\(([^)]*)\)")


def census(hlo_text: str) -> dict:
    """Counts of an optimized HLO module's instructions: ``instructions``, ``by_opcode`` {opcode: n} and
    ``by_function`` {innermost nested jit name: n}; an instruction of the step's own body (no nested jit in its
    op_name) counts as "(step body)", one without op_name metadata (parameters, constants, fusion wrappers) as
    "(no op_name)"."""
    by_op, by_fn = collections.Counter(), collections.Counter()
    n = 0
    for line in hlo_text.splitlines():
        m = _OPCODE.search(line)
        if not m or line.lstrip().startswith(("HloModule", "//")):
            continue
        n += 1
        by_op[m.group(1)] += 1
        name = _OP_NAME.search(line)
        jits = _JIT.findall(name.group(1)) if name else []
        by_fn[jits[-1] if len(jits) > 1 else "(step body)" if name else "(no op_name)"] += 1
    return {"instructions": n, "by_opcode": dict(by_op.most_common()), "by_function": dict(by_fn.most_common())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="model name or checkpoint directory, as `serve --model` takes it "
                                                   "(default tiny)")
    p.add_argument("--dtype", default="exact", help="the engine's --dtype (default exact)")
    p.add_argument("--batch", type=int, default=4, help="rows of the step (default 4)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per row (default 128: a prefill chunk; 1 is a "
                                                           "decode step)")
    p.add_argument("--top", type=int, default=25, help="how many opcodes and functions to print (default 25)")
    p.add_argument("--json", default=None, help="also write the whole census (and the timings) to this file")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.batch < 1 or args.tokens < 1 or args.top < 1:
        sys.exit("step_hlo: --batch, --tokens and --top must be >= 1")
    import jax
    import numpy as np

    from dsv41_jax.model import cache as kvc
    from dsv41_jax.serving.engine import Engine
    from dsv41_jax.serving.engine_args import EngineArgs

    B, T = args.batch, args.tokens
    print(f"step_hlo: jax {jax.__version__}, backend {jax.default_backend()}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    try:
        eng = Engine(EngineArgs(model=args.model, dtype=args.dtype, max_running_requests=B, batch_buckets=[B],
                                token_buckets=[T], chunked_prefill_size=T, skip_server_warmup=True))
    except (ValueError, OSError) as e:  # a bad --model / --dtype (ConfigError, CheckpointError are ValueErrors)
        sys.exit(f"step_hlo: {e}")
    r = eng.runner
    z = np.zeros((B,), np.int32)
    pad_slot = kvc.padding_slots(r.ccfg, B)
    toks = r._fill(np.zeros((B, T), np.int32), np.zeros((B,), bool), pad_slot, r.last_token)
    batch = r._place_batch({"tokens": toks, "start": z, "n_new": z, "slot": pad_slot,
                            "page_table": kvc.padding_pages(r.ccfg, B)})
    t0 = time.perf_counter()
    lowered = r._extend_for(T).lower(r.params, r.state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = census(compiled.as_text())
    out.update(model=args.model, dtype=args.dtype, batch=B, tokens=T, lower_s=round(t1 - t0, 2),
               compile_s=round(t2 - t1, 2))
    print(f"extend [{B}, {T}] ({args.model}, {args.dtype}): lowered in {out['lower_s']} s, compiled in "
          f"{out['compile_s']} s; optimized HLO: {out['instructions']} instructions")
    for key in ("by_opcode", "by_function"):
        print(f"{key.replace('_', ' ')}:")
        for k, v in list(out[key].items())[:args.top]:
            print(f"  {v:7d}  {100 * v / max(1, out['instructions']):5.1f} %  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
