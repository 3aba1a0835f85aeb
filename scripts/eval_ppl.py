#!/usr/bin/env python
"""Perplexity of a model over a text or jsonl corpus.

    python scripts/eval_ppl.py --model tiny --data tests/data/ppl_sample.txt --seq-len 64 --batch-size 4 \\
        [--max-batches N] [--mesh data=2] [--dtype float32] [--out ppl.json]

Data pipeline (Grain, deterministic order, no shuffling): documents are read in file order (a .txt
file: blank-line separated paragraphs, or one document per line with ``--line-docs``; a .jsonl
file: the ``--text-field`` of each record), each tokenized as BOS + text (no EOS); a
`grain.experimental.ConcatThenSplitIterDataset` packs the token stream into fixed windows of
``seq_len + 1`` tokens (the last one padded), and windows are batched to ``--batch-size`` rows (the
last batch padded with empty rows), so every batch has one shape and one jitted
`dsv41_jax.model.forward` (+ log-softmax) serves them all. Window w predicts w[1:] from w[:-1]
(causal attention over the whole window, across document boundaries, as stream perplexity);
padding and the BOS tokens are not scored.

``--mesh data=N[,tp=M][,ep=K]``: run on a device mesh; the batch is sharded over ``data`` and the
parameters by their logical axes (`dsv41_jax.model.mesh_shardings`). Result: JSON with ppl,
mean NLL per token, token / window / batch counts and timing; a tqdm progress bar on stderr.
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


def read_documents(path: str, text_field: str = "text", line_docs: bool = False) -> list:
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        docs = []
        for i, line in enumerate(raw.splitlines()):
            if line.strip():
                rec = json.loads(line)
                if text_field not in rec:
                    raise ValueError(f"{path}:{i + 1}: no {text_field!r} field")
                docs.append(str(rec[text_field]))
        return docs
    if line_docs:
        return [ln for ln in raw.splitlines() if ln.strip()]
    return [p.strip() for p in raw.split("\n\n") if p.strip()]


def make_dataset(docs: list, tokenizer, seq_len: int, batch_size: int):
    """Grain pipeline -> iterator of dicts: tokens int32 [B, L+1], mask bool [B, L] (targets scored)."""
    import grain
    import grain.experimental as ge
    import numpy as np

    bos = tokenizer.bos_token_id

    def tokenize(text):
        ids = ([bos] if bos is not None else []) + tokenizer.encode(text)
        return {"tokens": np.asarray(ids, np.int32)}

    ds = grain.MapDataset.source(docs).map(tokenize).to_iter_dataset()
    ds = ge.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})

    def finish(batch):
        tok = batch["tokens"]
        seg = batch["tokens_segment_ids"]
        pos = batch["tokens_positions"]
        n = tok.shape[0]
        if n < batch_size:  # pad the last batch: one shape for every batch
            pad = batch_size - n
            tok = np.concatenate([tok, np.zeros((pad, tok.shape[1]), tok.dtype)])
            seg = np.concatenate([seg, np.zeros((pad, seg.shape[1]), seg.dtype)])
            pos = np.concatenate([pos, np.zeros((pad, pos.shape[1]), pos.dtype)])
        scored = (seg[:, 1:] != 0) & ~((pos[:, 1:] == 0) & (tok[:, 1:] == (bos if bos is not None else -1)))
        return {"tokens": tok.astype(np.int32), "mask": scored, "rows": n}

    return ds.batch(batch_size, drop_remainder=False).map(finish)


@functools.lru_cache(maxsize=None)
def nll_step(cfg):
    """jit of (params, tokens [B, L+1], mask [B, L]) -> (sum of target NLL, scored count)."""
    import jax
    import jax.numpy as jnp

    from dsv41_jax.model import forward

    def nll(params, tokens, mask):
        logits = forward(params, tokens[:, :-1], cfg)
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        tgt = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(mask, tgt, 0.0)), jnp.sum(mask)

    return jax.jit(nll)


def parse_mesh(spec: str):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    axes = []
    for part in spec.split(","):
        name, _, size = part.partition("=")
        axes.append((name.strip(), int(size)))
    n = math.prod(s for _, s in axes)
    devs = jax.devices()
    if n > len(devs):
        raise SystemExit(f"--mesh {spec}: needs {n} devices, {len(devs)} available")
    return Mesh(np.asarray(devs[:n]).reshape([s for _, s in axes]), tuple(a for a, _ in axes))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="'tiny' or a model directory (default tiny)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory / tokenizer.json (default: the model's)")
    ap.add_argument("--data", required=True, help=".txt (paragraphs) or .jsonl corpus")
    ap.add_argument("--text-field", default="text", help="jsonl field holding the text (default 'text')")
    ap.add_argument("--line-docs", action="store_true", help=".txt: one document per line instead of per paragraph")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens predicted per window (default 128)")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per batch (default 8)")
    ap.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="activation dtype (auto = the reference bf16 flow)")
    ap.add_argument("--mesh", default=None, help="device mesh, e.g. 'data=2' or 'data=2,tp=2'")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny model's random weights")
    ap.add_argument("--out", default=None, help="JSON result path (default: print only)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv41_jax.model import ModelConfig
    from dsv41_jax.serving.tokenizer import load_tokenizer

    cfg = ModelConfig.from_pretrained(ns.model)
    if ns.dtype != "auto":
        cfg = cfg.replace(act_dtype=ns.dtype)
    mesh = parse_mesh(ns.mesh) if ns.mesh else None
    t0 = time.perf_counter()
    if ns.model == "tiny" and not os.path.isdir(ns.model):
        from dsv41_jax.model import init_params

        params = init_params(cfg, jax.random.key(ns.seed))
        if mesh is not None:
            from dsv41_jax.model import mesh_shardings

            params = jax.device_put(params, mesh_shardings(cfg, mesh))
    else:
        from dsv41_jax.parallel.plan import load_params

        params = load_params(ns.model, cfg, mesh)
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(ns.tokenizer or ns.model)
    docs = read_documents(ns.data, ns.text_field, ns.line_docs)

    step = nll_step(cfg)
    data_sharding = None
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        if "data" in mesh.shape and ns.batch_size % mesh.shape["data"]:
            raise SystemExit(f"--batch-size {ns.batch_size} must be a multiple of the data axis {mesh.shape['data']}")
        data_sharding = NamedSharding(mesh, PartitionSpec("data" if "data" in mesh.shape else None))

    bar = None
    if not ns.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(desc="ppl", unit="batch", file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None
    total_nll, total_tok, batches, windows = 0.0, 0, 0, 0
    compile_s = None
    t1 = time.perf_counter()
    for batch in make_dataset(docs, tok, ns.seq_len, ns.batch_size):
        if ns.max_batches is not None and batches >= ns.max_batches:
            break
        toks, mask = batch["tokens"], batch["mask"]
        if data_sharding is not None:
            toks, mask = jax.device_put(toks, data_sharding), jax.device_put(mask, data_sharding)
        ts = time.perf_counter()
        s, n = step(params, toks, mask)
        s, n = float(s), int(n)
        if compile_s is None:
            compile_s = time.perf_counter() - ts
        total_nll += s
        total_tok += n
        batches += 1
        windows += batch["rows"]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ppl=f"{math.exp(total_nll / max(total_tok, 1)):.3f}", tokens=total_tok)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t1
    if total_tok == 0:
        raise SystemExit("no tokens were scored (empty corpus?)")
    mean = total_nll / total_tok
    result = {"model": ns.model, "data": ns.data, "dtype": cfg.act_dtype, "seq_len": ns.seq_len,
              "batch_size": ns.batch_size, "mesh": ns.mesh, "documents": len(docs), "windows": windows,
              "batches": batches, "tokens": total_tok, "nll_per_token": mean, "ppl": math.exp(mean),
              "load_s": load_s, "compile_s": compile_s, "eval_s": elapsed,
              "tokens_per_s": total_tok / elapsed if elapsed > 0 else None,
              "num_compilations": step._cache_size()}
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)) or ".", exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: result[k] for k in ("ppl", "nll_per_token", "tokens", "batches", "eval_s")}))
    return result


if __name__ == "__main__":
    main()
