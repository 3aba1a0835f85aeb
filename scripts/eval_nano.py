#!/usr/bin/env python
"""Export a `train_nano.py` run to the release format and score it by greedy generation.

    python scripts/eval_nano.py --run runs/nano                      # export runs/nano/export, score 200+200 prompts
    python scripts/eval_nano.py --model runs/nano/export --n 50      # score an exported checkpoint

Export: the run's latest Orbax state -> `trainer.to_release_params` (fp8 32×32 blocks, MXFP4 experts,
per-row fp8 Engram tables, bf16 / fp32 as declared) -> `checkpoint.save_hf_checkpoint` (config.json,
index, safetensors shards, nano's tokenizer). Scoring loads that checkpoint into the serving
engine (`dsv41_jax.LLM`, the engine the server runs) and asks held-out prompts (--seed, another seed
than training) through `LLM.chat`, which builds the prompt with the server's chat encoder and splits
the output with the server's parsers: an answer is right when ``content`` equals the expected answer
exactly (and, with thinking on, the reasoning came back in ``reasoning_content``); a tool call is
right when it has the right name and arguments and no DSML is left in ``content``. Then
(--tool-server) held-out tool-calling prompts go through a live server (`python -m dsv41_jax.serve`)
with the `openai` client and ``tools=[...]``. Prints one line per kind and mode and writes the numbers
as JSON (--json).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

log = logging.getLogger("eval_nano")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a train_nano.py run directory: its latest checkpoint is exported, then scored")
    src.add_argument("--model", help="an exported (release-format) nano checkpoint directory to score")
    ap.add_argument("--export-dir", default=None, help="where --run's export goes (default RUN/export; replaced)")
    ap.add_argument("--n", type=int, default=200, help="held-out prompts per thinking mode (default 200)")
    ap.add_argument("--seed", type=int, default=1000, help="held-out data seed (default 1000; training uses 0)")
    ap.add_argument("--kinds", default=None, help="comma-separated task kinds (default: the run's kinds, or the "
                    "text kinds for --model)")
    ap.add_argument("--modes", default="off,on", help="thinking modes to score: off, on or off,on (default)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generation limit per prompt (default 64)")
    ap.add_argument("--batch", type=int, default=16, help="max running requests in the engine (default 16)")
    ap.add_argument("--tool-server", type=int, default=100,
                    help="held-out tool-calling prompts sent through a live `python -m dsv41_jax.serve` with the "
                         "openai client and tools=[get_weather] (default 100, half with thinking on; 0 = skip)")
    ap.add_argument("--json", default=None, help="write the scores here as JSON")
    ap.add_argument("--export-only", action="store_true", help="with --run: export and stop")
    return ap


def export_run(run: str, out: str) -> dict:
    """Export `run`'s latest checkpoint to `out` (release format). Returns the run's meta."""
    import jax

    from dsv41_jax.model.checkpoint import save_hf_checkpoint
    from dsv41_jax.model.config import NANO_DIR, ModelConfig
    from dsv41_jax.model.params import init_params
    from dsv41_jax.training import trainer

    cfg = ModelConfig.preset("nano")
    template = init_params(cfg, jax.random.key(0))
    train, params = trainer.split(trainer.to_master(template))
    mgr = trainer.checkpoint_manager(os.path.join(run, "ckpt"))
    opt_like = trainer.make_optimizer(1e-3, 10, 1, 0.0, 1.0).init(train)  # its structure only
    got = trainer.restore_state(mgr, train, opt_like)
    if got is None:
        raise SystemExit(f"error: no checkpoint under {os.path.join(run, 'ckpt')}")
    step, train, _, meta = got
    if meta.get("init_seed", 0) != 0:  # the untrained leaves (DSpark stages, biases) come from the init
        template = init_params(cfg, jax.random.key(meta["init_seed"]))
    release = trainer.to_release_params(train, params, template)
    meta = dict(meta, step=step)

    def write(d):
        save_hf_checkpoint(release, cfg, d, shards=1, tokenizer_dir=NANO_DIR)
        with open(os.path.join(d, "nano_run.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)

    trainer.write_dir(out, write)  # `out` may be assets/nano, where the tokenizer files come from
    log.info("exported step %d of %s to %s", step, run, out)
    return meta


def score(model_dir: str, kinds, n: int, seed: int, modes, max_tokens: int, batch: int) -> dict:
    """Greedy generation through the serving engine and its chat parsers; exact-answer accuracy."""
    from dsv41_jax import LLM
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.training import data

    llm = LLM(model=model_dir, max_running_requests=batch)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = {}
    for mode in modes:
        think = mode == "on"
        exs = [data.make_example(seed, i, kinds=kinds, thinking=think) for i in range(n)]
        right = collections.Counter()
        total = collections.Counter()
        t0 = time.time()
        groups = collections.defaultdict(list)  # LLM.chat takes one tools list per call
        for ex in exs:
            groups[json.dumps(ex.tools)].append(ex)
        samples = []
        for _, group in sorted(groups.items()):
            res = llm.chat([g.messages for g in group], sp, thinking=think, tools=group[0].tools, use_tqdm=True)
            for ex, r in zip(group, res):
                c = r.outputs[0]
                if ex.kind == "tool_call":
                    calls = c.tool_calls or []
                    ok = (len(calls) == 1 and "DSML" not in (c.content or "")
                          and (calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])) == ex.answer)
                else:
                    ok = c.content == ex.answer and (not think or bool(c.reasoning_content))
                right[ex.kind] += ok
                total[ex.kind] += 1
                if len(samples) < 3 and not ok:
                    samples.append({"kind": ex.kind, "want": ex.answer, "text": c.text})
        acc = sum(right.values()) / max(1, sum(total.values()))
        out[f"thinking_{mode}"] = {"accuracy": acc, "n": sum(total.values()), "seconds": time.time() - t0,
                                   "per_kind": {k: right[k] / total[k] for k in sorted(total)},
                                   "wrong_samples": samples}
        print(f"thinking {mode}: exact-answer accuracy {acc:.3f} on {sum(total.values())} prompts "
              f"({time.time() - t0:.0f} s); " + ", ".join(f"{k} {right[k]}/{total[k]}" for k in sorted(total)))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def score_tool_server(model_dir: str, n: int, seed: int, max_tokens: int, workers: int = 8,
                      timeout: float = 900.0) -> dict:
    """`n` held-out tool-calling prompts (the `tool_call` kind, thinking on for odd i) through a live
    server: `python -m dsv41_jax.serve --model MODEL_DIR` in a subprocess, the `openai` client with
    ``tools=[get_weather]``; right = finish_reason "tool_calls", one call with the right name and
    arguments, no DSML left in ``content`` (and with thinking on, the reasoning in reasoning_content)."""
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from dsv41_jax.training import data

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    logf = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="eval_nano_server_", delete=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_jax.serve", "--model", model_dir, "--port", str(port)],
                            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"error: the server exited with {proc.returncode}; log: {logf.name}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > timeout:
                raise SystemExit(f"error: the server did not start in {timeout:.0f} s; log: {logf.name}")
            time.sleep(0.5)
        log.info("server healthy after %.1f s (log %s)", time.time() - t0, logf.name)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        name = client.models.list().data[0].id
        exs = [data.make_example(seed, i, kinds=("tool_call",), thinking=bool(i % 2)) for i in range(n)]

        def ask(ex):
            r = client.chat.completions.create(
                model=name, messages=ex.messages, tools=ex.tools, temperature=0.0, max_tokens=max_tokens,
                extra_body={"chat_template_kwargs": {"thinking": ex.thinking}})
            ch = r.choices[0]
            calls = ch.message.tool_calls or []
            got = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
            ok = (ch.finish_reason == "tool_calls" and got == [ex.answer] and "DSML" not in (ch.message.content or "")
                  and (not ex.thinking or bool(getattr(ch.message, "reasoning_content", None))))
            return ok, {"want": ex.answer, "finish_reason": ch.finish_reason, "calls": got,
                        "content": ch.message.content, "thinking": ex.thinking}

        t1 = time.time()
        with ThreadPoolExecutor(workers) as pool:
            res = list(pool.map(ask, exs))
        right = sum(ok for ok, _ in res)
        by_mode = {m: sum(ok for (ok, _), ex in zip(res, exs) if ex.thinking == (m == "on")) for m in ("off", "on")}
        out = {"accuracy": right / n, "n": n, "right": right, "right_by_thinking": by_mode,
               "seconds": time.time() - t1, "wrong_samples": [d for ok, d in res if not ok][:5]}
        print(f"tool calls through the server (openai client): {right}/{n} = {right / n:.3f} "
              f"(thinking off {by_mode['off']}, on {by_mode['on']}; {time.time() - t1:.0f} s)")
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    from dsv41_jax.training.data import KINDS, TEXT_KINDS

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("off", "on") for m in modes):
        print(f"error: --modes must be off, on or off,on, got {args.modes!r}", file=sys.stderr)
        return 2
    if args.n < 1 or args.max_tokens < 1 or args.batch < 1 or args.tool_server < 0:
        print("error: --n, --max-tokens and --batch must be >= 1, --tool-server >= 0", file=sys.stderr)
        return 2
    meta = {}
    model = args.model
    if args.run:
        model = args.export_dir or os.path.join(args.run, "export")
        meta = export_run(args.run, model)
        if args.export_only:
            return 0
    elif not os.path.isdir(model):
        print(f"error: --model {model}: no such directory", file=sys.stderr)
        return 2
    kinds = tuple(args.kinds.split(",")) if args.kinds else tuple(meta.get("kinds", TEXT_KINDS))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        print(f"error: --kinds: unknown {bad}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if meta and args.seed in (meta.get("seed"), meta.get("eval_seed")):
        print(f"error: --seed {args.seed} is one the run trained or selected on; use another", file=sys.stderr)
        return 2
    res = {"model": model, "run": meta, "seed": args.seed, "kinds": list(kinds),
           **score(model, kinds, args.n, args.seed, modes, args.max_tokens, args.batch)}
    if args.tool_server:
        res["tool_server"] = score_tool_server(model, args.tool_server, args.seed + 1, max(args.max_tokens, 96))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
