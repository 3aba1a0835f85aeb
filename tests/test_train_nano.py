"""scripts/train_nano.py and `dsv41_jax.training`: the synthetic corpus, the training step, resume.

Fast checks only (the training itself is not run here): the corpus is deterministic per seed and
renders through the V4.1 chat encoder and the server's parsers; the fake-quants have straight-through
derivatives; a few steps on a fixed batch reduce the loss of the (tiny) model; Orbax save / restore
gives back the same state; bad CLI input exits 2.
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

from dsv41_jax.model import quant
from dsv41_jax.serving.reasoning import parse_chat_output
from dsv41_jax.serving.tokenizer import load_tokenizer
from dsv41_jax.training import data, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_corpus_is_deterministic_per_seed():
    a = [data.make_example(0, i) for i in range(40)]
    b = [data.make_example(0, i) for i in range(40)]
    c = [data.make_example(1, i) for i in range(40)]
    assert [(x.prompt, x.completion) for x in a] == [(x.prompt, x.completion) for x in b]
    assert [(x.prompt, x.completion) for x in a] != [(x.prompt, x.completion) for x in c]
    assert data.make_example(0, 3, attempt=1).prompt != data.make_example(0, 3).prompt or \
        data.make_example(0, 3, attempt=1).completion != data.make_example(0, 3).completion
    assert len({x.kind for x in a}) >= 6 and {x.thinking for x in a} == {False, True}


@pytest.mark.parametrize("kind", data.KINDS)
@pytest.mark.parametrize("thinking", [False, True])
def test_examples_render_and_parse_like_the_server(kind, thinking):
    """prompt + completion is the encoder's rendering (checked inside `render`), and the server's parser
    splits the completion into the expected reasoning / content / tool call."""
    ex = data.make_example(7, 0, kinds=(kind,), thinking=thinking)
    assert ex.completion.endswith(data.EOS)
    text = ex.completion[: -len(data.EOS)]  # the engine stops at EOS and does not return it
    reasoning, content, calls, warnings = parse_chat_output(text, thinking, ex.tools)
    assert not warnings
    assert reasoning == (ex.target["reasoning_content"] if thinking else "")
    if kind == "tool_call":
        assert content == "" and len(calls) == 1
        assert (calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])) == ex.answer
    else:
        assert content == ex.answer and not calls


def test_pack_masks_exactly_the_completion(tok):
    ex = data.make_example(0, 5, kinds=("add",), thinking=False)
    p, c = data.tokenize(ex, tok)
    row = data.pack(p, c, 64, 2)
    m = row["mask"].astype(bool)
    assert m.sum() == len(c)
    assert list(row["targets"][m]) == list(c)
    assert list(row["tokens"][: len(p)]) == list(p)
    assert data.pack(p, c, len(p) + len(c) - 2, 2) is None


def test_grain_batches_are_random_access(tok):
    src = data.PackedSource(tok, 0, 160)
    b3 = next(data.batches(src, 4, 3))
    assert b3["tokens"].shape == (4, 160)
    np.testing.assert_array_equal(b3["tokens"][1], src[13]["tokens"])  # row 3·4 + 1


def test_fake_quants_are_straight_through():
    x = jax.random.normal(jax.random.key(0), (4, 64), jnp.float32) * 3
    for f, block in ((quant.fake_quant_fp8, 32), (quant.fake_quant_fp4_pow2, 32), (quant.fake_quant_fp4_e4m3, 16)):
        y = f(x, block=block)
        assert not np.array_equal(np.asarray(y), np.asarray(x))  # it does quantize
        g = jax.grad(lambda v: jnp.sum(f(v, block=block) * jnp.arange(64.0)))(x)
        np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.arange(64.0), x.shape))


def test_master_params_reproduce_the_quantized_forward():
    """fp32 masters with unit scales give the same logits as the fp8 / MXFP4 checkpoint params."""
    from dsv41_jax.model.params import init_params
    from dsv41_jax.model.transformer import forward

    cfg = trainer.train_config(configs.micro())
    p = init_params(cfg, jax.random.key(0))
    tokens = jnp.arange(16, dtype=jnp.int32)[None] % 300
    a = jax.jit(forward, static_argnums=2)(p, tokens, cfg)
    b = jax.jit(forward, static_argnums=2)(trainer.to_master(p), tokens, cfg)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)


def test_train_steps_reduce_loss_on_a_fixed_batch(tok):
    from dsv41_jax.model.params import init_params

    cfg = configs.micro()
    train, params = trainer.split(trainer.to_master(init_params(cfg, jax.random.key(0))))
    assert not any(k.startswith(("mtp.", "derived.")) or k.endswith(".scale") for k in train)
    src = data.PackedSource(tok, 0, 48, kinds=("add", "sub"))
    batch = jax.tree_util.tree_map(jnp.asarray, next(data.batches(src, 2)))
    opt = trainer.make_optimizer(3e-3, 10, 1, 0.0, 1.0)
    st = opt.init(train)
    step = trainer.make_train_step(cfg, opt)
    losses = []
    for _ in range(4):
        train, st, m = step(train, st, params, batch)
        losses.append(float(m["loss"]))
        assert np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0
    assert losses[-1] < losses[0] - 0.5, losses


def test_orbax_save_and_resume_give_the_same_state(tmp_path):
    train = {"a.weight": jnp.arange(12.0).reshape(3, 4), "b.weight": jnp.ones((5,))}
    opt = trainer.make_optimizer(1e-2, 10, 2, 0.1, 1.0)
    st = opt.init(train)
    grads = jax.tree_util.tree_map(jnp.ones_like, train)
    upd, st = opt.update(grads, st, train)
    train = jax.tree_util.tree_map(lambda a, b: a + b, train, upd)
    trainer.save_state(trainer.checkpoint_manager(str(tmp_path)), 7, train, st, {"seed": 0})
    fresh = opt.init(jax.tree_util.tree_map(jnp.zeros_like, train))
    step, t2, s2, meta = trainer.restore_state(trainer.checkpoint_manager(str(tmp_path)), train, fresh)
    assert step == 7 and meta == {"seed": 0}
    for x, y in zip(jax.tree_util.tree_leaves((train, st)), jax.tree_util.tree_leaves((t2, s2))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert trainer.restore_state(trainer.checkpoint_manager(str(tmp_path / "none")), train, st) is None


def test_cli_rejects_bad_input(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_nano.py"), "--out", str(tmp_path),
                        "--kinds", "add,nope", "--eval-seed", "0", "--stop-step", "9999",
                        "--cache-min-compile-secs", "-1"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert r.returncode == 2
    for what in ("nope", "--eval-seed", "--stop-step", "--cache-min-compile-secs"):
        assert what in r.stderr, (what, r.stderr)


def test_export_round_trips_the_master_values():
    """to_release_params writes checkpoint dtypes/shapes whose dequantized values are the masters' (the
    masters of an init are on the fp8 / MXFP4 grids, so the export must be lossless for them)."""
    from dsv41_jax.model.params import init_params

    cfg = configs.micro()
    p = init_params(cfg, jax.random.key(1))
    master = trainer.to_master(p)
    train, params = trainer.split(master)
    rel = trainer.to_release_params(train, params, p)
    flat_p = jax.tree_util.tree_flatten_with_path(p)[0]
    flat_r = jax.tree_util.tree_flatten_with_path(rel)[0]
    assert [(k, v.shape, v.dtype) for k, v in flat_p] == [(k, v.shape, v.dtype) for k, v in flat_r]
    back = dict(jax.tree_util.tree_flatten_with_path(trainer.to_master(rel))[0])
    for k, v in jax.tree_util.tree_flatten_with_path(master)[0]:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v), err_msg=jax.tree_util.keystr(k))


# ----------------------------------------------------------------------------------- nano's tokenizer


@pytest.fixture(scope="module")
def nano_tok():
    from dsv41_jax.model.config import NANO_DIR

    return load_tokenizer(NANO_DIR)


def test_nano_tokenizer_is_rebuilt_byte_for_byte(tmp_path):
    """scripts/make_nano_tokenizer.py is deterministic: rebuilding it gives the shipped files."""
    from dsv41_jax.model.config import NANO_DIR

    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_nano_tokenizer.py"), "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens.json"):
        with open(os.path.join(NANO_DIR, name), "rb") as a, open(tmp_path / name, "rb") as b:
            assert a.read() == b.read(), name


def test_nano_tokenizer_keeps_the_task_units_whole(nano_tok):
    """Every word a task draws is one token (with and without a leading space), digits and the counted
    letters are one token each, so a look-up key or a copied word is a single token to match."""
    words = list(data.WORDS) + [w.upper() for w in data.WORDS] + list(data.CITIES) + list(data.SKIES)
    for w in words:
        for text in (w, " " + w):
            assert len(nano_tok.encode(text)) == 1, (text, nano_tok.encode(text))
    assert [len(nano_tok.encode(str(d))) for d in range(10)] == [1] * 10
    assert len(nano_tok.encode("12")) == 2  # digits single: 12 is "1" "2"
    assert len(nano_tok.encode("How many a in a b c a?")) == 9  # How many a in a b c a ?
    ex = data.make_example(0, 1, kinds=("tool_call",), thinking=False)
    whole = ex.prompt + ex.completion
    assert nano_tok.decode(nano_tok.encode(whole), skip_special_tokens=False) == whole


def test_nano_preset_matches_its_tokenizer(nano_tok):
    from dsv41_jax.model.config import ModelConfig

    cfg = ModelConfig.preset("nano")
    assert nano_tok.vocab_size <= cfg.vocab_size and cfg.vocab_size % 32 == 0
    assert cfg.engram_pad_token_id == nano_tok.pad_token_id == nano_tok.token_to_id("<\uff5c\u2581pad\u2581\uff5c>")
    assert cfg.dspark_noise_token_id == nano_tok.token_to_id("<\uff5cSystem\uff5c>")


@pytest.mark.parametrize("kinds,seq_len", [(data.TEXT_KINDS, 64), (data.TOOL_KINDS, 240)])
def test_nano_rows_fit_their_bucket_at_the_first_draw(nano_tok, kinds, seq_len):
    """train_nano.py's default row lengths hold every example as drawn (no redraw skews the mix)."""
    for i in range(120):
        ex = data.make_example(3, i, kinds=kinds)
        assert data.pack(*data.tokenize(ex, nano_tok), seq_len, 2) is not None, (ex.kind, ex.prompt)


def test_two_buckets_weigh_every_completion_token_alike(tok):
    """A step over (short rows, long rows) has the token-weighted mean loss of the two."""
    from dsv41_jax.model.params import init_params

    cfg = trainer.train_config(configs.micro())
    train, params = trainer.split(trainer.to_master(init_params(cfg, jax.random.key(0))))
    # Same row shape for both parts (one program for the parts, one for the pair), different
    # completion lengths (an addition answer vs a copied phrase), so the token weighting shows.
    a = jax.tree_util.tree_map(jnp.asarray, next(data.batches(data.PackedSource(tok, 0, 48, kinds=("add",)), 2)))
    b = jax.tree_util.tree_map(jnp.asarray, next(data.batches(data.PackedSource(tok, 0, 48, kinds=("copy",)), 2)))
    na, nb = float(a["mask"].sum()), float(b["mask"].sum())
    assert na != nb
    f = jax.jit(trainer.loss_and_metrics, static_argnums=3)
    la, lb, lab = (f(train, params, x, cfg)[1] for x in (a, b, (a, b)))
    np.testing.assert_allclose(float(lab["loss"]), (float(la["loss"]) * na + float(lb["loss"]) * nb) / (na + nb),
                               rtol=1e-5)
    np.testing.assert_allclose(float(lab["seq_acc"]), (float(la["seq_acc"]) + float(lb["seq_acc"])) / 2, rtol=1e-6)


def test_lookup_control_script_trains_and_reports(tmp_path):
    """research/lookup_control.py (the plain-transformer control for the look-up gap, README): trains on
    the corpus's look-up rows, writes one JSON line per evaluation, is deterministic, refuses bad flags."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lookup_control", os.path.join(ROOT, "research", "lookup_control.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    outs = []
    for i in range(2):
        out = tmp_path / f"c{i}.jsonl"
        assert mod.main(["--steps", "3", "--eval-every", "2", "--layers", "1", "--width", "32", "--eval-rows", "4",
                         "--batch-size", "2", "--warmup", "1", "--out", str(out)]) == 0
        outs.append([json.loads(l) for l in out.read_text().splitlines()])
    assert [r["step"] for r in outs[0]] == [2, 3]
    assert all(0.0 <= r["eval_seq_acc"] <= 1.0 and r["eval_loss"] > 0 for r in outs[0])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(outs[0]) == strip(outs[1])
    # A format built by the script: the rows are what its doc says (every key asked, answered in order).
    ex = mod.lookup_example("every-key", 0, 3)
    asked = ex.messages[0]["content"].split("?")[0][len("Values of "):].split(", ")
    table = dict(kv.split("=") for kv in ex.messages[0]["content"].split("? ")[1].rstrip(".").split(", "))
    assert ex.answer == ", ".join(f"{k}={table[k]}" for k in asked) and sorted(asked) == sorted(table)
    # multi-question: the corpus look-up first, then follow-ups on the same table; every answer is supervised.
    from dsv41_jax.model.config import NANO_DIR
    from dsv41_jax.serving.tokenizer import load_tokenizer
    from dsv41_jax.training import data

    tok = load_tokenizer(NANO_DIR)
    first = data.make_example(0, 5, kinds=("lookup",))
    table = dict(kv.strip().split("=") for kv in first.messages[0]["content"].split(". Value")[0].split(","))
    row = mod.multi_question_row(0, 5, tok, 64, 0)
    sup = [tok.decode([int(t)]) for t, m in zip(row["targets"], row["mask"]) if m]
    digits = [s for s in sup if s.isdigit()]
    assert digits[0] == first.answer and len(digits) >= 2 + first.thinking  # (thinking: the reasoning's digit too)
    eos = tok.token_to_id(data.EOS)
    sup_ids = [int(t) for t, m in zip(row["targets"], row["mask"]) if m]
    assert all(d in table.values() for d in digits) and sup_ids.count(eos) >= 2
    # recall: bare pairs, the query key, its value as the one supervised target.
    r = mod.recall_row(0, 7, tok, 64, 0)
    ids = [int(t) for t in r["tokens"]]
    at = int(np.flatnonzero(r["mask"])[0])
    assert r["mask"].sum() == 1 and tok.decode([ids[at - 1]]) == "|"
    pairs = dict(zip(ids[0:at - 1:2], ids[1:at - 1:2]))
    assert int(r["targets"][at]) == pairs[ids[at]]
    assert mod.main(["--format", "curriculum", "--curriculum-steps", "1", "--steps", "2", "--eval-every", "2",
                     "--layers", "1", "--width", "32", "--eval-rows", "4", "--batch-size", "2", "--warmup", "1"]) == 0
    for bad in (["--kinds", "tool_call"], ["--eval-seed", "0"], ["--width", "30"], ["--steps", "0"],
                ["--steps", "10", "--warmup", "10"], ["--format", "curriculum"], ["--curriculum-steps", "5"],
                ["--format", "word", "--kinds", "copy"]):
        with pytest.raises(SystemExit) as e:
            mod.parse_args(bad)
        assert e.value.code == 2, bad
