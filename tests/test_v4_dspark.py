"""The DSpark head of DeepSeek-V4-Flash-0731 / Pro-0813 (model/v4/dspark.py) in the exact mode: `make_checkpoint
--preset tiny-v4 --draft dspark` writes the release's mtp.* names and reads back as tiny-v4-dspark, flash-v4-0731 has
the release's shapes and tensor counts; on micro-v4-dspark (tests/configs.py: tiny-v4 cut to a sliding hash-routed, a
CSA and an HCA layer, with tiny-v4-dspark's head: 3 stages reading all three layers) the rings written chunk by chunk
equal one pass's (cached == cold) and so do the proposals; greedy decoding with DSpark speculation == plain greedy,
model-level and in the engine, with the head's own drafts and with an oracle forcing full and partial acceptance; the
MTP / DSpark requirements refuse the other draft kind."""

import functools
import json
import os

import jax
import numpy as np
import pytest

import configs

from dsv41_jax.model import ModelConfig, init_params
from dsv41_jax.model.cache import CacheConfig
from dsv41_jax.model.v4 import dspark as dspark4
from dsv41_jax.model.v4 import mtp
from dsv41_jax.model.v4 import speculative as sp

CFG = configs.micro_v4_dspark().replace(act_dtype="exact")
CCFG = CacheConfig(page_size=16, num_pages=8, max_slots=1, max_pages_per_seq=4)
PROMPT = [int(t) for t in np.random.default_rng(1).integers(0, CFG.vocab_size, 13)]
N = 7
PT = (np.arange(CCFG.max_pages_per_seq, dtype=np.int32) + 1)[None, :]


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


def _step(params, state, batch, all_logits=False, par=None):
    """`sp._SEED_STEP` called as `greedy_dspark` calls it (all_logits passed only when true, par always): jit keys
    its cache on the keyword names, so any other spelling traces and compiles the same program again."""
    kw = dict(all_logits=True) if all_logits else {}
    return sp._SEED_STEP(params, state, batch, CFG, CCFG, par=par, **kw)


@functools.lru_cache(maxsize=None)
def _plain_greedy(prompt):
    """Plain greedy decoding of `prompt` (a tuple), one token per target step, no drafts: `sp.greedy`'s loop run on
    the target step that the DSpark loop uses (`extend_seeding`, its logits `v4.decode.extend`'s), the prompt in one
    pass and each token padded to the verify width G + 1 — the two programs `greedy_dspark` compiles anyway, where
    `sp.greedy` (tested in test_v4_mtp) would compile `extend` at two more shapes."""
    G = CFG.dspark_block_size
    state = dspark4.with_rings(sp.dec4.init_state(CFG, CCFG), CFG, CCFG)
    logits, state = _step(_params(), state, sp._batch(prompt, 0, len(prompt), len(prompt), PT))
    out = [int(np.argmax(np.asarray(logits)[0]))]
    while len(out) < N:
        batch = sp._batch(out[-1:], len(prompt) + len(out) - 1, 1, G + 1, PT)
        logits, state = _step(_params(), state, batch, all_logits=True)
        out.append(int(np.argmax(np.asarray(logits)[0, 0])))
    return out


def _reference():
    return _plain_greedy(tuple(PROMPT))


def test_tiny_0731_checkpoint_names_and_round_trip(tmp_path):
    """`make_checkpoint --preset tiny-v4 --draft dspark`: the release's four dspark_* keys and stage ratios, its
    mtp.* tensor names (main_proj / main_norm on stage 0 only; norm, hc_head_*, markov_w1 / w2, confidence_head.proj
    on the last; learned gates, no tid2eid), and the loader reads back the same parameters."""
    import importlib.util

    from dsv41_jax.model.v4.checkpoint import load_params

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_checkpoint.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)

    out = tmp_path / "ck"
    assert mk.main(["--preset", "tiny-v4", "--draft", "dspark", "--out", str(out), "--shards", "2"]) == 0
    conf = json.load(open(out / "config.json"))
    assert {k: conf[k] for k in conf if k.startswith("dspark_")} == {
        "dspark_block_size": 3, "dspark_noise_token_id": 319, "dspark_target_layer_ids": [3, 4, 5],
        "dspark_markov_rank": 16}
    assert conf["compress_ratios"][6:] == [0, 0, 0]
    names = set(json.load(open(out / "model.safetensors.index.json"))["weight_map"])
    mtp_names = {n for n in names if n.startswith("mtp.") and ".experts." not in n}
    expected_extra = {"mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight",
                      "mtp.2.norm.weight", "mtp.2.hc_head_fn", "mtp.2.hc_head_base", "mtp.2.hc_head_scale",
                      "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
                      "mtp.2.confidence_head.proj.weight"}
    assert expected_extra <= mtp_names
    layer = {n.split(".", 2)[2] for n in mtp_names if n.startswith("mtp.1.")}
    assert {"attn.wq_a.weight", "attn.attn_sink", "hc_attn_fn", "ffn.gate.bias"} <= layer
    assert "ffn.gate.tid2eid" not in layer
    assert not any(n.startswith("mtp.1.main_") or n.startswith(("mtp.0.norm", "mtp.1.markov")) for n in names)
    assert sum(n.startswith("mtp.0.ffn.experts.") for n in names) == 3 * 2 * CFG.n_routed_experts

    cfg = ModelConfig.from_pretrained(str(out))
    assert cfg.replace(name="x") == ModelConfig.preset("tiny-v4-dspark").replace(name="x")
    want = init_params(cfg, jax.random.key(0))
    got = load_params(str(out), cfg)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_flash_0731_preset_has_the_release_shapes():
    """flash-v4-0731's declared head has the shapes of the release's shard headers (docs/design/v4.md)."""
    from dsv41_jax.model.params import param_shapes

    cfg = ModelConfig.preset("flash-v4-0731")
    assert len(cfg.compress_ratios) == 46 and cfg.dspark_target_layer_ids == (40, 41, 42)
    m = param_shapes(cfg)["mtp"]
    shapes = {"0.main_proj.weight": m[0]["main_proj"].weight, "0.main_proj.scale": m[0]["main_proj"].scale,
              "2.markov_w1": m[2]["markov_head"]["markov_w1"]["weight"],
              "2.markov_w2": m[2]["markov_head"]["markov_w2"]["weight"],
              "2.confidence": m[2]["confidence_head"]["proj"]["weight"], "2.hc_head_fn": m[2]["hc_head_fn"],
              "1.hc_attn_fn": m[1]["hc_attn_fn"], "1.gate": m[1]["ffn"]["gate"]["weight"],
              "1.wo_a": m[1]["attn"]["wo_a"].weight, "1.wq_b": m[1]["attn"]["wq_b"].weight}
    assert {k: tuple(v.shape) for k, v in shapes.items()} == {
        "0.main_proj.weight": (4096, 12288), "0.main_proj.scale": (32, 96), "2.markov_w1": (129280, 256),
        "2.markov_w2": (129280, 256), "2.confidence": (1, 4352), "2.hc_head_fn": (4, 16384),
        "1.hc_attn_fn": (24, 16384), "1.gate": (256, 4096), "1.wo_a": (8192, 4096), "1.wq_b": (32768, 1024)}
    assert "bias" in m[1]["ffn"]["gate"] and "tid2eid" not in m[1]["ffn"]["gate"]
    # the tensor counts of the release's index: 72,317 in all, per stage 1,568 / 1,565 / 1,572 (experts one each)
    from dsv41_jax.model.params import flatten_names, param_stats
    from dsv41_jax.model.v4.checkpoint import _STACKED
    from dsv41_jax.model.v4.params import declare_params

    per_stage = [0, 0, 0]
    for n, d in flatten_names(declare_params(cfg)).items():
        if n.startswith("mtp."):
            per_stage[int(n.split(".")[1])] += d.shape[0] if _STACKED.match(n) else 1
    assert per_stage == [1568, 1565, 1572] and param_stats(cfg)["tensors"] == 72317


def test_pro_0813_config_reads_as_its_preset(tmp_path):
    """DeepSeek-V4-Pro-0813's config.json key layout (its values as pinned by a third party, docs/design/v4.md: one
    next-token layer declared, the four dspark_* keys with Markov rank 512 and target layers 58-60, 64
    compress_ratios, no dspark_n_* keys) reads as the pro-v4-0813 preset, field for field; the preset declares
    the release index's 149,782 tensors (per stage: Pro's 384 experts x 3 x weight + scale, as Flash-0731's 256)."""
    from dsv41_jax.model.config_v4 import to_v4_dict
    from dsv41_jax.model.params import param_stats

    want = ModelConfig.preset("pro-v4-0813")
    d = {k: v for k, v in to_v4_dict(want).items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    d.update(num_nextn_predict_layers=1, num_hash_layers=3,  # the release's spelling: ratios + hash-layer count
             compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0, 0, 0], dspark_block_size=5,
             dspark_markov_rank=512, dspark_noise_token_id=128799, dspark_target_layer_ids=[58, 59, 60])
    (tmp_path / "config.json").write_text(json.dumps(d))
    got = ModelConfig.from_pretrained(str(tmp_path))
    assert got.replace(name=want.name) == want
    assert (got.num_nextn_predict_layers, got.dspark_n_routed_experts, got.hidden_size) == (3, 384, 7168)
    assert param_stats(want)["tensors"] == 149782


def _seed(chunks, params=None, par=None):
    """The prompt through `extend_seeding` in chunks of the given sizes, each padded to the chunk's width (params:
    default `_params()`; par: a mesh plan)."""
    params = _params() if params is None else params
    state = dspark4.with_rings(sp.dec4.init_state(CFG, CCFG), CFG, CCFG)
    done = 0
    for n, width, all_logits in chunks:
        batch = sp._batch(PROMPT[done:done + n], done, n, width, PT)
        _, state = _step(params, state, batch, all_logits, par)
        done += n
    assert done == len(PROMPT)
    return state


def test_rings_and_proposals_cached_equal_cold():
    """The prompt in one step vs in chunks of 4, 4, 4 and 1 (the verify step's shape, padded): the same rings (the
    last W positions of every stage) and target cache, so the same proposal."""
    G = CFG.dspark_block_size
    cold = _seed([(len(PROMPT), len(PROMPT), False)])
    warm = _seed([(4, G + 1, True)] * 3 + [(1, G + 1, True)])
    for a, b in zip(jax.tree.leaves(cold), jax.tree.leaves(warm)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ring = np.asarray(cold["dspark"][0])[0]
    assert np.abs(ring).min(axis=-1).max() > 0 and ring.shape == (CFG.sliding_window, CFG.head_dim)  # all W filled
    props = [sp._PROPOSE(_params(), st["dspark"], np.array([5], np.int32), np.array([len(PROMPT)], np.int32),
                         np.zeros(1, np.int32), CFG, CCFG, gamma=G, par=None) for st in (cold, warm)]
    for k in ("tokens", "logits", "confidence"):
        np.testing.assert_array_equal(np.asarray(props[0][k]), np.asarray(props[1][k]))
    assert np.isfinite(np.asarray(props[0]["confidence"])).all()


@functools.lru_cache(maxsize=None)
def _greedy_dspark(mesh=None):
    """`greedy_dspark` of PROMPT on one device (mesh None) or on `mesh` (params placed by the rules): (tokens, stats,
    the drafts of every step)."""
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.plan import MeshPlan

    params = _params() if mesh is None else rules.shard_params(_params(), CFG, mesh)
    drafts = []
    out, stats = sp.greedy_dspark(params, PROMPT, N, CFG, CCFG, propose=lambda o, d: drafts.append(list(d)) or d,
                                  par=MeshPlan.of(mesh))
    return out, stats, drafts


def test_greedy_with_dspark_equals_plain_greedy():
    out, stats, _ = _greedy_dspark()
    assert out == _reference()
    assert 1 <= stats["steps"] <= N - 1 and 0 <= stats["accepted"] <= CFG.dspark_block_size * stats["steps"]


def test_dspark_on_tp2_ep4_equals_one_device(cpu8):
    """The head on tp=2 x ep=4 (stages' params by the rules under ``mtp.*``, their MoE over ep, sublayer exits
    replicated): the rings and target cache after the prompt (one pass, and chunks 4, 4, 4, 1), the proposal from
    them, and `greedy_dspark`'s tokens and every step's drafts equal one device's bit for bit."""
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh
    from dsv41_jax.parallel.plan import MeshPlan

    mesh = make_mesh(2, 4, cfg=CFG)
    par, params = MeshPlan.of(mesh), rules.shard_params(_params(), CFG, mesh)
    assert params["mtp"][1]["ffn"]["experts"]["w1"].weight.sharding.spec[0] == "ep"
    G = CFG.dspark_block_size
    ref = _seed([(len(PROMPT), len(PROMPT), False)])
    props = []
    # the chunks' first at the prompt's width (the cold program), the rest at the verify width on the mesh-placed
    # state (`greedy_dspark`'s verify program): two compiled programs serve both seedings and the greedy loop
    for st, p, pr in [(ref, _params(), None)] + [(_seed(c, params, par), params, par)
                                                  for c in ([(len(PROMPT), len(PROMPT), False)],
                                                            [(4, len(PROMPT), False)] + [(4, G + 1, True)] * 2
                                                            + [(1, G + 1, True)])]:
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(st), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                          err_msg=jax.tree_util.keystr(path))
        props.append(sp._PROPOSE(p, st["dspark"], np.array([5], np.int32), np.array([len(PROMPT)], np.int32),
                                 np.zeros(1, np.int32), CFG, CCFG, gamma=G, par=pr))
    for got in props[1:]:
        for k in ("tokens", "logits", "confidence", "probs"):
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), np.asarray(props[0][k]).view(np.uint8))
    out, stats, drafts = _greedy_dspark(mesh)
    assert (out, stats, drafts) == _greedy_dspark() and out == _reference() and len(drafts) >= 2


def test_accepted_and_rejected_drafts_keep_the_output():
    """An oracle proposes the true continuation, wrong in one slot every other step: steps accept all 3 drafts or
    a prefix, the commit re-runs the step for it, and the output is still plain greedy's."""
    ref, G = _reference(), CFG.dspark_block_size
    seen = []

    def oracle(out, drafts):
        prop = [ref[len(out) + i] if len(out) + i < len(ref) else 0 for i in range(len(drafts))]
        seen.append(len(seen))
        if len(seen) % 2 == 0:
            prop[1] = (prop[1] + 1) % CFG.vocab_size
        return prop

    out, stats = sp.greedy_dspark(_params(), PROMPT, N, CFG, CCFG, propose=oracle)
    assert out == ref
    assert stats["accepted"] > stats["steps"] and stats["accepted"] < G * stats["steps"]


def test_draft_kinds_refuse_each_other():
    params = _params()
    with pytest.raises(NotImplementedError, match="DSpark head"):
        mtp.require(params, CFG)
    with pytest.raises(NotImplementedError, match="MTP layer"):
        dspark4.require(params, ModelConfig.preset("tiny-v4"))
    with pytest.raises(ValueError, match="no DSpark stages"):
        sp.greedy_dspark(dict(params, mtp=[]), PROMPT, 2, CFG, CCFG)
    with pytest.raises(ValueError, match="gamma"):
        sp.greedy_dspark(params, PROMPT, 2, CFG, CCFG, gamma=CFG.dspark_block_size + 1)


# ---------------------------------------------------------------- the engine (--speculative-algorithm DSPARK)

KW = dict(model="tiny", page_size=8, max_total_tokens=256, context_length=64, max_running_requests=2,
          chunked_prefill_size=8, batch_buckets=[2], token_buckets=[8], skip_server_warmup=True,
          decode_log_interval=1000)
PROMPT2 = [int(t) for t in np.random.default_rng(2).integers(0, CFG.vocab_size, len(PROMPT))]


@functools.lru_cache(maxsize=None)
def _one_device_engine():
    from dsv41_jax.serving.engine import Engine

    return Engine(cfg=CFG, params=_params(), speculative_algorithm="DSPARK", **KW)


def _serve(eng, tag, logprobs=None):
    """PROMPT and PROMPT2 together, greedy, N tokens each: [(tokens, logprobs, top_logprobs)] per prompt (a row with
    logprobs never speculates: `Scheduler.can_speculate`)."""
    from dsv41_jax.serving.sampling import SamplingParams

    rids = [f"{tag}{i}" for i in range(2)]
    for rid, p in zip(rids, (PROMPT, PROMPT2)):
        eng.add_request(rid, prompt_token_ids=p,
                        sampling_params=SamplingParams(max_tokens=N, temperature=0.0, logprobs=logprobs))
    done = {o.request_id: o for o in eng.run_until_done()}
    assert all(done[r].finished and done[r].error is None for r in rids)
    return [(done[r].outputs[0].token_ids, done[r].outputs[0].logprobs, done[r].outputs[0].top_logprobs)
            for r in rids]


def _references():
    return [_reference(), _plain_greedy(tuple(PROMPT2))]


def test_engine_dspark_greedy_equals_plain_greedy():
    """The engine with V4's DSpark head (`serving.v4_dspark_speculative`: rings seeded by 8-token prefill chunks,
    two rows per launch): greedy gives the model-level plain greedy tokens, with the head's own drafts and with an
    oracle fixing drafts so rows accept 0..γ of them (each prefix committed by re-running the target step); one
    request's drafts at every step are the model-level `greedy_dspark`'s, cold and from the prefix cache (the
    snapshot holds the rings); a checkpoint whose draft is an MTP layer is refused."""
    from oracle_drafter import oracle_drafts

    from dsv41_jax.serving.engine import Engine, EngineError
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.serving.speculator import V4DSparkSpeculator

    ref = _references()
    eng = _one_device_engine()
    assert isinstance(eng.runner.speculator, V4DSparkSpeculator) and eng.spec_gamma == CFG.dspark_block_size
    g = eng.spec_gamma
    greedy = SamplingParams(max_tokens=N, temperature=0.0)

    def run(tag):
        return [t for t, _, _ in _serve(eng, tag)]

    assert run("own") == ref
    assert eng.stats()["spec_verify_steps"] > 0
    eng.prefix_cache.clear_cache()
    seen = {}

    def oracle(L):
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = int(r.req_id[-1])
            want = ref[i][r.step:r.step + g]
            out[b, :len(want)] = want
            seen[i] = seen.get(i, -1) + 1
            k = g - (seen[i] + i) % (g + 1)  # the first wrong draft, cycling down per row (k = γ: all right)
            if k < len(want):
                out[b, k] = (want[k] + 1) % CFG.vocab_size
        return out

    with oracle_drafts(eng, oracle) as drafter:
        assert run("orc") == ref
    assert {n for a in drafter.accepts() for n in a} == set(range(g + 1))
    assert eng.allocator.used_pages == 0

    # the engine's rings (8-token prefill chunks, commits, a prefix-cache snapshot) give the model-level loop's drafts
    ref_drafts = []
    sp.greedy_dspark(_params(), PROMPT, N, CFG, CCFG, propose=lambda out, d: ref_drafts.append(list(d)) or d)

    class Recording(V4DSparkSpeculator):
        def launch(self, params, dev, L, warm=False):
            if warm or not L.rows:
                return super().launch(params, dev, L, warm)
            batch, step = self.batch(L)
            drafts = np.asarray(self._propose(params, dev.state, dev.slot_tensors, batch, step)).astype(np.int32)
            got.append(drafts[0].tolist())
            return self.verify(params, dev, L, batch, step, drafts,
                               self.grammar_masks(params, dev, L, batch, step, drafts))

    base = eng.runner.speculator
    rec = Recording.__new__(Recording)
    rec.__dict__.update(base.__dict__)
    eng.runner.speculator = rec
    eng.prefix_cache.clear_cache()
    try:
        for tag in ("cold", "cached"):
            got = []
            eng.add_request(f"alone-{tag}", prompt_token_ids=PROMPT, sampling_params=greedy)
            (o,) = eng.run_until_done()
            assert bool(o.num_cached_tokens) == (tag == "cached") and o.outputs[0].token_ids == ref[0]
            assert got == ref_drafts and len(got) >= 2, (tag, got, ref_drafts)
    finally:
        eng.runner.speculator = base
    with pytest.raises(EngineError, match="draft is an MTP layer"):
        Engine(cfg=ModelConfig.preset("tiny-v4"), params=init_params(ModelConfig.preset("tiny-v4"), jax.random.key(0)),
               speculative_algorithm="DSPARK", **KW)


def test_engine_dspark_on_tp2_ep4_equals_one_device(cpu8):
    """``--speculative-algorithm DSPARK`` on --tp-size 2 --ep-size 4 (`v4_dspark_speculative` on the mesh: params by
    the rules, cache and rings replicated): the head's own drafts give plain greedy's tokens, and requests with
    logprobs (plain launches, which write the rings) the one-device DSpark engine's tokens and logprobs (top-2
    included) bit for bit."""
    from dsv41_jax.serving.engine import Engine
    from dsv41_jax.serving.speculator import V4DSparkSpeculator

    one = _one_device_engine()
    one.prefix_cache.clear_cache()
    ref_lp = _serve(one, "lp", logprobs=2)
    eng = Engine(cfg=CFG, params=_params(), speculative_algorithm="DSPARK", tp_size=2, ep_size=4, **KW)
    assert isinstance(eng.runner.speculator, V4DSparkSpeculator) and eng.runner.speculator.mesh is not None
    assert dict(eng.runner.mesh.shape) == {"ep": 4, "tp": 2}
    assert [t for t, _, _ in _serve(eng, "own")] == _references()
    assert eng.stats()["spec_verify_steps"] > 0
    assert all(r.sharding.is_fully_replicated for r in eng.runner.state["dspark"])
    eng.prefix_cache.clear_cache()
    assert _serve(eng, "lp", logprobs=2) == ref_lp and [t for t, _, _ in ref_lp] == _references()
