"""`training.dspark_train` and scripts/train_nano_dspark.py: distilling the DSpark draft on a frozen target.

Fast checks on `configs.micro` with a second DSpark stage (stage chaining included): the teacher-forced
all-anchor draft equals the serving draft (`dspark.propose` on rings written by `extend_seeding`) bit
for bit in exact mode; a few steps on a fixed batch lower the loss and change only ``mtp`` leaves;
the export writes the trained draft (quantized) beside the untouched target and loads back; bad CLI
input exits 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import dspark
from dsv41_jax.model.params import init_params
from dsv41_jax.serving import speculative as spec
from dsv41_jax.serving.tokenizer import load_tokenizer
from dsv41_jax.training import data, dspark_train, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_nano_dspark.py")


def _cfg():
    """micro (3 layers, window 8, block 3) with two DSpark stages."""
    return configs.micro().replace(num_nextn_predict_layers=2, compress_ratios=(0, 2, 1, 0, 0), name="micro2")


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_anchor_positions_rings_and_labels_by_hand():
    # completion tokens at positions 3..6 (mask 2..5): serving anchors t = 3, 4, 5
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 0, 0, 0, 0]], jnp.float32)
    pos, w = dspark_train.anchor_positions(mask, None)
    assert pos.tolist() == [list(range(10))] and w.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0, 0, 0]]
    pos, w = dspark_train.anchor_positions(mask, 4)
    assert pos.tolist() == [[3, 4, 5, 6]] and w.tolist() == [[1, 1, 1, 0]]
    pos, w = dspark_train.anchor_positions(mask, 9)  # past the row: clipped, weight 0
    assert pos.tolist() == [[3, 4, 5, 6, 7, 8, 9, 9, 9]] and w.sum() == 3
    codes = {"v": jnp.arange(10, dtype=jnp.float32)[None, :, None]}  # position p's code is p
    ring = dspark_train.anchor_rings(codes, jnp.asarray([[0, 3, 6, 9]], jnp.int32), 4)["v"][..., 0]
    # anchor t: entry i holds the latest position ≡ i (mod 4) <= t - 1 (clamped to 0 where none)
    assert ring.tolist() == [[0, 0, 0, 0], [0, 1, 2, 0], [4, 5, 2, 3], [8, 5, 6, 7]]
    greedy = jnp.arange(10, dtype=jnp.int32)[None] + 100
    pos, w = dspark_train.anchor_positions(mask, 4)
    lab, sw = dspark_train.block_labels(greedy, mask, pos, w, 3)
    assert lab[0, 0].tolist() == [103, 104, 105] and lab[0, 2].tolist() == [105, 106, 107]
    assert sw[0].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]]


def test_teacher_forced_draft_equals_serving_propose():
    """For every anchor t of two rows, the all-anchor teacher-forced draft (one `target_pass` over the
    rows, rings gathered from their ring codes) gives the same logits and confidences as
    `dspark.propose` at start t on the serving cache after `extend_seeding` committed 0..t−1 one token
    at a time, with a draw forcing the same labels. Tolerance: none — exact mode (fp64-accumulated
    matmuls) makes the full-row forward and the one-token steps agree bit for bit, and the "float32"
    ring codec holds exactly the fp8 codes' values. The run covers an empty ring (t = 0), a partial
    one and wrapped ones (T = 14 > W = 8), and training's config (`train_config`: the reference MoE)."""
    cfg = trainer.train_config(_cfg()).replace(act_dtype="exact")
    params = init_params(cfg, jax.random.key(3))
    B, T, G = 2, 14, cfg.dspark_block_size
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 300, (B, T)), jnp.int32)
    tgt = jax.jit(dspark_train.target_pass, static_argnums=2)(params, tokens, cfg)
    pos, aw = dspark_train.anchor_positions(jnp.ones((B, T)), None)
    labels, _ = dspark_train.block_labels(tgt["greedy"], jnp.ones((B, T)), pos, aw, G)
    tf = jax.jit(dspark_train.teacher_forced_draft, static_argnums=5)(params, tgt["layer_inputs"], tokens, pos,
                                                                       labels, cfg)
    assert tf["logits"].shape == (B, T, G, cfg.vocab_size) and tf["confidence"].shape == (B, T, G)

    ccfg = kvc.CacheConfig(page_size=8, num_pages=B * 2 + 1, max_slots=B, max_pages_per_seq=2)
    alloc = kvc.PageAllocator(ccfg.num_pages, ccfg.page_size, ccfg.max_pages_per_seq)
    st = dspark.with_rings(kvc.init_cache(cfg, ccfg), cfg, ccfg)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    st = kvc.reset_slots(st, np.arange(ccfg.max_slots + 1), pad)
    pages = []
    for i in range(B):
        alloc.ensure(i, ccfg.max_context)
        pages.append(alloc.pages(i))
    seed_step = spec.jitted_extend_seeding(cfg, ccfg)

    @jax.jit
    def serving(p, rings, anchor, start, forced):
        def draw(k, lg):
            return forced[:, k], jax.nn.one_hot(forced[:, k], lg.shape[-1], dtype=jnp.float32)

        return dspark.propose(p, rings, anchor, start, jnp.arange(B, dtype=jnp.int32), cfg, ccfg, G, draw)

    greedy = []
    for t in range(T):
        o = serving(params, st["dspark"], tokens[:, t], jnp.full((B,), t, jnp.int32), labels[:, t])
        np.testing.assert_array_equal(np.asarray(o["logits"]), np.asarray(tf["logits"][:, t]), err_msg=f"t={t}")
        np.testing.assert_array_equal(np.asarray(o["confidence"]), np.asarray(tf["confidence"][:, t]))
        rows = [{"tokens": [int(tokens[i, t])], "start": t, "slot": i, "page_table": pages[i]} for i in range(B)]
        lg, st = seed_step(params, st, dec.make_batch(rows, 1, B, ccfg))
        greedy.append(np.argmax(np.asarray(lg), axis=-1))
    np.testing.assert_array_equal(np.stack(greedy, 1), np.asarray(tgt["greedy"]))  # the labels are the target's


@pytest.fixture(scope="module")
def trained():
    """Four steps of the draft on one fixed batch (micro2, tiny's tokenizer, copy / exact rows)."""
    cfg = _cfg()
    master = trainer.to_master(init_params(cfg, jax.random.key(0)))
    train, params = dspark_train.split(master)
    tok = load_tokenizer("tiny")
    batch = jax.tree_util.tree_map(jnp.asarray, next(data.batches(
        data.PackedSource(tok, 0, 96, kinds=("copy", "exact")), 2)))
    opt = trainer.make_optimizer(3e-3, 10, 1, 0.0, 1.0)
    st = opt.init(train)
    step = dspark_train.make_train_step(cfg, opt, n_anchors=24)
    train0, hist = train, []
    for _ in range(5):
        train, st, m = step(train, st, params, (batch,))
        hist.append({k: float(v) for k, v in m.items()})
    return cfg, master, params, train0, train, hist


def test_train_steps_lower_the_loss_and_change_only_the_draft(trained):
    cfg, master, params, train0, train, hist = trained
    assert train and all(k.startswith("mtp.") for k in train)
    assert not any(k.endswith((".scale", ".bias", ".bf16")) for k in train)
    assert {"mtp.0.main_proj.weight", "mtp.1.markov_head.embed.weight", "mtp.1.confidence_head.proj.weight",
            "mtp.0.attn.wkv.weight", "mtp.1.ffn.experts.w1.weight"} <= set(train)
    for m in hist:
        assert np.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["anchor_coverage"] == 1.0
        assert 1.0 <= m["accept_len"] <= m["accept_len_max"] <= 1 + cfg.dspark_block_size
    losses = [m["draft_loss"] for m in hist]
    assert losses[-1] < losses[1] - 0.5, losses  # step 0 runs at the warmup's lr 0
    before, after = _flat(trainer.merge(train0, params)), _flat(trainer.merge(train, params))
    changed = {k for k in before if not np.array_equal(np.asarray(before[k]), np.asarray(after[k]))}
    assert changed and all(k.startswith("['mtp']") for k in changed), sorted(changed)[:5]
    # the ring path and the confidence head receive gradient (wkv only reaches the loss through the rings)
    assert "['mtp'][1]['attn']['wkv'].weight" in changed and "['mtp'][0]['main_norm']['weight']" in changed
    assert "['mtp'][1]['confidence_head']['proj']['weight']" in changed


def test_export_writes_the_quantized_draft_and_loads(trained, tmp_path):
    from dsv41_jax.model.checkpoint import load_params, requantize_np, save_hf_checkpoint

    cfg, _, params, _, train, _ = trained
    template = init_params(cfg, jax.random.key(0))
    rel = dspark_train.to_release_params(train, params, template)
    save_hf_checkpoint(rel, cfg, str(tmp_path), shards=1)
    back = _flat(load_params(str(tmp_path), cfg))
    tmpl, exp = _flat(template), _flat(rel)
    assert set(back) == set(tmpl)
    for k, v in back.items():
        assert v.dtype == tmpl[k].dtype and v.shape == tmpl[k].shape, k
        np.testing.assert_array_equal(np.asarray(v).view(np.uint8) if v.dtype.itemsize == 1 else np.asarray(v),
                                      np.asarray(exp[k]).view(np.uint8) if v.dtype.itemsize == 1 else
                                      np.asarray(exp[k]), err_msg=k)
        if not k.startswith("['mtp']"):  # the target is the template's, code for code
            a, b = np.asarray(v), np.asarray(tmpl[k])
            np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                          b.view(np.uint8) if b.dtype.itemsize == 1 else b, err_msg=k)
    # the draft's fp8 weights are the trained masters' quantization, its bf16 leaves their rounding
    w = np.asarray(train["mtp.0.attn.wkv.weight"], np.float32)
    q, s = requantize_np("fp8", w)
    np.testing.assert_array_equal(np.asarray(back["['mtp'][0]['attn']['wkv'].weight"]).view(np.uint8),
                                  np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(back["['mtp'][0]['attn']['wkv'].scale"]).view(np.uint8),
                                  np.asarray(s).view(np.uint8))
    mk = np.asarray(train["mtp.1.markov_head.embed.weight"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back["['mtp'][1]['markov_head']['embed']['weight']"]), mk)
    assert not np.array_equal(np.asarray(back["['mtp'][0]['attn']['wkv'].weight"]).view(np.uint8),
                              np.asarray(template["mtp"][0]["attn"]["wkv"].weight).view(np.uint8))
    # the default export still keeps the template's draft
    keep = _flat(trainer.to_release_params(*trainer.split(trainer.to_master(template)), template))
    np.testing.assert_array_equal(np.asarray(keep["['mtp'][1]['markov_head']['embed']['weight']"]),
                                  np.asarray(template["mtp"][1]["markov_head"]["embed"]["weight"]))


def test_cli_rejects_bad_input(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, SCRIPT, "--target", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                        "--kinds", "add,nope", "--eval-seed", "0", "--steps", "0", "--cache-min-compile-secs", "-1"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    for what in ("nope", "--eval-seed", "--steps", "--target", "--cache-min-compile-secs"):
        assert what in r.stderr, (what, r.stderr)
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and "--target" in r.stderr
    r = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0
    for flag in ("--target", "--out", "--steps", "--batch-size", "--lr", "--max-minutes", "--seed", "--eval-seed",
                 "--export", "--cache-min-compile-secs"):
        assert flag in r.stdout
    bench = os.path.join(ROOT, "scripts", "bench_nano_dspark.py")
    r = subprocess.run([sys.executable, bench, "--model", str(tmp_path / "none"), "--modes", "maybe", "--n", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--modes" in r.stderr and "--n" in r.stderr and "--model" in r.stderr, r.stderr


def test_script_trains_resumes_and_exports(tmp_path):
    """The script end to end on a micro2 target (tiny's tokenizer): a run stopped by --max-minutes after
    its first step, rerun, resumes from the step-1 checkpoint (and finds its compiled step in the run's
    persistent cache), finishes and exports; the export loads with the draft changed and the target
    the same; a rerun with other settings is refused (exit 2). ~40 s: three subprocesses, one compile."""
    from dsv41_jax.model.checkpoint import load_params, save_hf_checkpoint
    from dsv41_jax.model.config import ModelConfig

    cfg = _cfg()
    target = tmp_path / "target"
    save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, str(target), shards=1)
    env = dict(os.environ, PYTHONPATH=ROOT)
    base = [sys.executable, SCRIPT, "--target", str(target), "--out", str(tmp_path / "run"), "--kinds", "add",
            "--batch-size", "2", "--tool-batch-size", "0", "--seq-len", "48", "--anchors", "8", "--eval-every", "0",
            "--log-every", "1", "--warmup", "1", "--steps", "2", "--no-progress",
            "--cache-min-compile-secs", "0"]  # the step is cached however fast this machine compiles it
    r = subprocess.run(base + ["--max-minutes", "0.0001"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reached at step 1" in r.stdout + r.stderr
    r = subprocess.run(base + ["--export", str(tmp_path / "export")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from the step-1 checkpoint" in r.stderr and "step 2: train" in r.stdout + r.stderr
    assert len(list((tmp_path / "run" / "jax_cache").glob("jit_step*"))) == 1  # the resumed step was not recompiled
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    got = _flat(load_params(str(tmp_path / "export"), ModelConfig.from_pretrained(str(tmp_path / "export"))))
    ref = _flat(load_params(str(target), cfg))

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return np.array_equal(a.view(np.uint8), b.view(np.uint8)) if a.dtype.itemsize == 1 else np.array_equal(a, b)

    changed = {k for k in ref if not same(ref[k], got[k])}
    assert changed and all(k.startswith("['mtp']") for k in changed)
    assert json.loads((tmp_path / "export" / "dspark_run.json").read_text())["step"] == 2
    r = subprocess.run(base + ["--lr", "1e-4"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "other settings" in r.stderr
