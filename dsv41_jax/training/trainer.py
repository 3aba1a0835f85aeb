"""Training the `nano` preset with `jax.grad` through the project's own forward (scripts/train_nano.py).

Master weights are fp32. The parameter tree keeps the checkpoint's layout, with every quantized
weight replaced by its fp32 master value and a unit scale, which the model's linears take as they are:
an fp8 pair {"weight": fp32 [N, K], "scale": e8m0 ones} dequantizes to the fp32 weight itself, and an
MXFP4 expert stack {"weight": fp32 [E, N, K], "scale": ones} likewise (`quant.dequantize_mxfp4` reads a
float "packed" as the unpacked values). Activations keep the model's fake-quants, whose derivative is
the straight-through estimator (`quant._straight_through`), so the forward trained is the forward
served. The release's fp8 / MXFP4 formats are applied at export (`to_release_params`).

Frozen (not in the trainable tree): scales, the gate's load-balancing biases (they only move the
top-k, which has no gradient), the ``wo_a`` bf16 copy (rebuilt at export), the tokenizer-derived
tables, and the DSpark stages (trained afterwards on the frozen target).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv41_jax.model import quant
from dsv41_jax.model.config import ModelConfig
from dsv41_jax.model.params import key_name
from dsv41_jax.model.transformer import forward
from dsv41_jax.model.weights import Fp8, Mxfp4

log = logging.getLogger(__name__)

_FROZEN_KEYS = ("scale", "bias", "bias_vl", "bf16")


def train_config(cfg: ModelConfig) -> ModelConfig:
    """The config the training step runs: fp32 activations, the reference implementations (the
    every-expert MoE, whose gradient reaches every routed expert it weights) and the unrolled layer
    loop (the scan's stacked storage bitcasts the declared fp8 dtypes, which fp32 masters are not)."""
    return cfg.replace(act_dtype="float32", impl="reference", layer_scan=False)


def _path_names(path) -> tuple:
    return tuple(key_name(k) for k in path)


def _quantized(node) -> bool:
    """Whether `node` is a quantized (weight, scale) pair: a `weights.Fp8` / `weights.Mxfp4`, or the Engram
    table's {"weight": fp8 rows, "scale"} dict."""
    if isinstance(node, (Fp8, Mxfp4)):
        return node.weight.dtype in (quant.FP8, jnp.uint8)
    return isinstance(node, dict) and set(node) >= {"weight", "scale"} and node["weight"].dtype == quant.FP8


def _pair(node) -> tuple:
    """(weight, scale) of a `_quantized` node."""
    return (node.weight, node.scale) if isinstance(node, (Fp8, Mxfp4)) else (node["weight"], node["scale"])


def is_trainable(names: tuple) -> bool:
    """Whether the leaf at `names` (a path of dict keys / list indices) is a trained master weight."""
    return names[0] not in ("derived", "mtp") and names[-1] not in _FROZEN_KEYS


def to_master(params: dict) -> dict:
    """Checkpoint-format params (`init_params` / `load_params`) -> master params: every fp8 / MXFP4
    weight dequantized to fp32 with unit scales, bf16 leaves widened to fp32."""

    def conv(node, name=""):
        if _quantized(node):
            w, s = _pair(node)
            one = jnp.ones(s.shape, quant.E8M0)
            if isinstance(node, Mxfp4):  # MXFP4 experts [E, N, K/2]
                return Mxfp4(jax.vmap(lambda a, b: quant.dequantize_mxfp4(a, b, jnp.float32))(w, s), one)
            if isinstance(node, Fp8):
                return dataclasses.replace(node, weight=quant.dequantize_fp8_block(w, s, jnp.float32), scale=one)
            # the Engram table: per-row scales [N, de/32]
            return dict(node, weight=w.astype(jnp.float32) * jnp.repeat(quant.e8m0_to_f32(s), 32, axis=1), scale=one)
        if isinstance(node, (Fp8, Mxfp4)):  # already masters
            return jax.tree_util.tree_map(conv, node)
        if isinstance(node, dict):
            return {k: conv(v, f"{name}/{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [conv(v, f"{name}/{i}") for i, v in enumerate(node)]
        if node is not None and jnp.issubdtype(node.dtype, jnp.floating) and node.dtype == jnp.bfloat16:
            return node.astype(jnp.float32)
        return node

    return conv(params)


def split(params: dict) -> tuple[dict, dict]:
    """(trainable {path string: array}, the whole tree) — the flat dict is what the optimizer sees."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _path_names(path)
        if is_trainable(names):
            flat[".".join(names)] = leaf
    return flat, params


def merge(train: dict, params: dict) -> dict:
    """`params` with its trainable leaves replaced by `train`'s (same keys as `split`)."""

    def put(path, leaf):
        key = ".".join(_path_names(path))
        return train.get(key, leaf)

    return jax.tree_util.tree_map_with_path(put, params)


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to lr/10, global-norm clipping; decay on matrices only."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1), lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=weight_decay,
                                   mask=lambda t: {k: v.ndim >= 2 for k, v in t.items()}))


def loss_and_metrics(train: dict, params: dict, batch, cfg: ModelConfig):
    """Masked next-token cross entropy over the completion tokens.

    batch: tokens / targets int32 [B, T], mask float32 [B, T] (`data.pack`), or a tuple of such
    row batches of different shapes (e.g. short text rows and long tool-calling rows): the loss is the
    mean over every completion token of all of them. Returns (loss, metrics): ``acc`` = token
    accuracy of the argmax on masked positions, ``seq_acc`` = fraction of rows whose every masked
    token is the argmax (teacher-forced: greedy decoding reproduces such a completion)."""
    parts = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    full = merge(train, params)
    nll_sum = hit_sum = ok_rows = rows = n_tok = 0.0
    for b in parts:
        logits = forward(full, b["tokens"], cfg)  # fp32 [B, T, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, b["targets"][..., None], axis=-1)[..., 0]
        m = b["mask"]
        hit = (jnp.argmax(logits, axis=-1) == b["targets"]).astype(jnp.float32)
        has = (m.sum(-1) > 0).astype(jnp.float32)
        row_ok = jnp.all((hit > 0) | (m == 0), axis=-1).astype(jnp.float32)
        nll_sum += (nll * m).sum()
        hit_sum += (hit * m).sum()
        n_tok += m.sum()
        ok_rows += (row_ok * has).sum()
        rows += has.sum()
    n = jnp.maximum(n_tok, 1.0)
    loss = nll_sum / n
    return loss, {"loss": loss, "acc": hit_sum / n, "seq_acc": ok_rows / jnp.maximum(rows, 1.0)}


def make_train_step(cfg: ModelConfig, opt: optax.GradientTransformation) -> Callable:
    """jit((train, opt_state, params, batch) -> (train, opt_state, metrics)); `params` supplies the
    frozen leaves. `cfg` is the model config (turned into `train_config` here)."""
    tcfg = train_config(cfg)

    @jax.jit
    def step(train, opt_state, params, batch):
        (_, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(train, params, batch, tcfg)
        updates, opt_state = opt.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))
        return train, opt_state, metrics

    return step


def make_eval_step(cfg: ModelConfig) -> Callable:
    tcfg = train_config(cfg)

    @jax.jit
    def ev(train, params, batch):
        return loss_and_metrics(train, params, batch, tcfg)[1]

    return ev


# ----------------------------------------------------------------------------------- checkpoints


def checkpoint_manager(directory: str, keep: int = 2):
    """An Orbax `CheckpointManager` over `directory` (absolute path; created), keeping the last `keep`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))


def save_state(manager, step: int, train: dict, opt_state, meta: dict) -> None:
    """Save (train, opt_state) at `step` with JSON `meta` (the run's arguments), and wait for it."""
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave({"train": train, "opt": opt_state}),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()


def restore_state(manager, train_like: dict, opt_like, step: int | None = None):
    """(step, train, opt_state, meta) of the latest (or `step`'s) checkpoint, or None if there is none.

    train_like / opt_like: trees of the same structure (their shapes and dtypes are the targets)."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    if step is None:
        return None
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"train": train_like, "opt": opt_like})
    got = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                        meta=ocp.args.JsonRestore()))
    # Orbax hands back arrays with an explicit sharding, which lowers to another program than a fresh
    # run's (a persistent-cache miss: the step would compile again); plain arrays hit the cache.
    state = jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), got["state"])
    return step, state["train"], state["opt"], got["meta"]


def use_run_cache(run_dir: str, min_compile_secs: float) -> None:
    """Point JAX's persistent compilation cache at RUN_DIR/jax_cache, keeping the programs that took at
    least `min_compile_secs` to compile, so a resumed run loads its compiled step instead of compiling it
    again (minutes on a busy CPU). Call before the first compile."""
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.abspath(run_dir), "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)


def resume(run_dir: str, train: dict, opt_state, meta: dict, fresh: str = "starting from scratch"):
    """(start step, train, opt_state, manager) for the run in `run_dir`: its latest Orbax checkpoint under
    RUN_DIR/ckpt if there is one (logged), else step 0 and the given state. Raises ValueError naming the
    settings when the checkpoint's `meta` differs from `meta` in anything but ``steps``."""
    ckpt = os.path.join(run_dir, "ckpt")
    manager = checkpoint_manager(ckpt)
    got = restore_state(manager, train, opt_state)
    if got is None:
        log.info("no checkpoint in %s: %s", ckpt, fresh)
        return 0, train, opt_state, manager
    start, train, opt_state, old = got
    changed = {k: (old.get(k), v) for k, v in meta.items() if k != "steps" and old.get(k) != v}
    if changed:
        raise ValueError(f"{run_dir} holds a run with other settings {changed}; use another --out")
    log.info("resumed from the step-%d checkpoint in %s", start, ckpt)
    return start, train, opt_state, manager


# ----------------------------------------------------------------------------------- the loop


def run_loop(step_fn: Callable, train: dict, opt_state, params: dict, batches, *, start: int, last: int,
             manager, meta: dict, metrics_path: str, evaluate: Callable[[dict], dict], log_every: int,
             eval_every: int, ckpt_every: int, max_minutes: float, desc: str, postfix: str = "acc",
             no_progress: bool = False, eval_at_start: bool = False, eval_at_stop: bool = False):
    """The training loop the nano scripts share; returns (step, train, opt_state).

    Runs ``step_fn(train, opt_state, params, batch)`` from step `start` to `last` over `batches` (an
    iterator of host batches); every `log_every` steps a metric line (mean over the steps since the
    last) to the progress bar and `metrics_path` (JSON lines); every `eval_every` steps and at `last`
    (and at step 0 with `eval_at_start`, on stopping early with `eval_at_stop`) ``evaluate(train)``'s
    held-out metrics; an Orbax checkpoint (`save_state` with `meta`) every `ckpt_every` steps, at `last`
    and when stopping early: after `max_minutes` of wall time or on SIGTERM / SIGINT (the step in flight
    finishes first; a second signal gives up at once), so a rerun resumes where it stopped."""
    from tqdm import tqdm

    def fmt(m):
        return " ".join(f"{k}={float(v):.4f}" for k, v in sorted(m.items()))

    stop = []

    def on_signal(signum, _frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    t0 = time.time()
    bar = tqdm(total=last, initial=start, desc=desc, unit="step", disable=no_progress, file=sys.stderr,
               dynamic_ncols=True)
    ckpt_dir = getattr(manager, "directory", "")
    acc_m: dict = {}
    step = start
    with open(metrics_path, "a", encoding="utf-8") as mf:
        def record(split, m):
            bar.write(f"step {step}: {'train' if split == 'train' else 'held-out'} {fmt(m)}")
            mf.write(json.dumps({"step": step, "split": split, **m}) + "\n")
            mf.flush()

        if start == 0 and eval_every and eval_at_start:
            record("eval", evaluate(train))
        while step < last:
            batch = jax.tree_util.tree_map(jnp.asarray, next(batches))
            ts = time.time()
            train, opt_state, m = step_fn(train, opt_state, params, batch)
            m = {k: float(v) for k, v in m.items()}
            step += 1
            m["step_s"] = time.time() - ts
            for k, v in m.items():
                acc_m.setdefault(k, []).append(v)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", **{postfix: f"{m[postfix]:.3f}"})
            if step % log_every == 0:
                record("train", {k: float(np.mean(v)) for k, v in acc_m.items()})
                acc_m = {}
            out_of_time = bool(stop) or bool(max_minutes and (time.time() - t0) > max_minutes * 60)
            if eval_every and (step % eval_every == 0 or step == last or (out_of_time and eval_at_stop)):
                record("eval", evaluate(train))
            if step % ckpt_every == 0 or step == last or out_of_time:
                save_state(manager, step, train, opt_state, meta)
                bar.write(f"step {step}: checkpoint saved to {ckpt_dir}")
            if out_of_time:
                why = f"{stop[0]} received" if stop else f"--max-minutes {max_minutes} reached"
                bar.write(f"{why} at step {step}; rerun the same command to resume")
                break
    bar.close()
    log.info("%s: at step %d after %.1f min", desc, step, (time.time() - t0) / 60)
    return step, train, opt_state


def mean_metrics(eval_fn: Callable, train: dict, params: dict, batches: list) -> dict:
    """The mean over `batches` of ``eval_fn(train, params, batch)``'s metrics (floats)."""
    ev = [{k: float(v) for k, v in eval_fn(train, params, b).items()} for b in batches]
    return {k: float(np.mean([e[k] for e in ev])) for k in ev[0]}


# ----------------------------------------------------------------------------------- export


def to_release_params(train: dict, params: dict, template: dict, *, trained_mtp: bool = False) -> dict:
    """Master params -> checkpoint-format params (the release's fp8 32×32 blocks, MXFP4 experts,
    per-row fp8 Engram tables, bf16 / fp32 as declared), on the host with the numpy quantizers.

    train / params: as `split` returns them (trained leaves, the rest); template: checkpoint-format
    params of the same config (`init_params`): their dtypes are the targets, and their values are kept
    for every leaf that is not trained (the DSpark stages, the gate biases, derived tables). The
    ``wo_a`` bf16 copy is rebuilt from the quantized pair.

    trained_mtp: the DSpark stages (``mtp``) are exported from train / params like the target's
    leaves instead of kept from the template (`training.dspark_train`, which trains them on the
    frozen target); ``derived`` is still the template's."""
    from dsv41_jax.model.checkpoint import dequant_fp8_block_np, requantize_np

    full = merge(train, params)

    def conv(node, tmpl, name=""):
        if _quantized(tmpl):
            if name.split("/")[1] == "mtp" and not trained_mtp:  # DSpark stages: not trained here
                return tmpl
            w = np.asarray(_pair(node)[0], np.float32)
            if isinstance(tmpl, Mxfp4):
                qs = [requantize_np("mxfp4", w[e]) for e in range(w.shape[0])]
                q, s = np.stack([a for a, _ in qs]), np.stack([b for _, b in qs])
            else:
                q, s = requantize_np("fp8" if isinstance(tmpl, Fp8) else "fp8_rows", w)
            q, s = jnp.asarray(q), jnp.asarray(s)
            for k, got, want in zip(("weight", "scale"), (q, s), _pair(tmpl)):
                if got.shape != want.shape or got.dtype != want.dtype:
                    raise ValueError(f"{name}/{k}: exported {got.shape} {got.dtype}, the checkpoint "
                                     f"declares {want.shape} {want.dtype}")
            if isinstance(tmpl, Mxfp4):
                return Mxfp4(q, s)
            if isinstance(tmpl, Fp8):  # wo_a's bf16 copy rebuilt from the quantized pair
                return Fp8(q, s, None if tmpl.bf16 is None else
                           jnp.asarray(dequant_fp8_block_np(np.asarray(q), np.asarray(s)).astype(jnp.bfloat16)))
            return dict(tmpl, weight=q, scale=s)
        if isinstance(node, dict):
            return {k: conv(node[k], tmpl[k], f"{name}/{k}") for k in tmpl}
        if isinstance(node, list):
            return [conv(a, b, f"{name}/{i}") for i, (a, b) in enumerate(zip(node, tmpl))]
        if name.split("/")[1] == "derived" or (name.split("/")[1] == "mtp" and not trained_mtp):
            return tmpl
        return jnp.asarray(np.asarray(node, np.float32).astype(tmpl.dtype))

    return conv(full, template)


def write_dir(out_dir: str, write: Callable[[str], None]) -> None:
    """Run ``write(tmp)`` on a fresh directory beside `out_dir`, then put it in `out_dir`'s place.

    An export may be written over the directory its tokenizer comes from (the package's assets/nano),
    so nothing of `out_dir` is removed before the new files are all written."""
    tmp = os.path.normpath(out_dir) + ".export_tmp"
    if os.path.isdir(tmp):
        shutil.rmtree(tmp)
    write(tmp)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
