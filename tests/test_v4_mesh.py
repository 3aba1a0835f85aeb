"""DeepSeek-V4 on a TP/EP mesh (8 host CPU devices, `cpu8`): the rules' splits of V4's tensors, and sharded ≡
unsharded for micro-v4 (tests/configs.py: tiny-v4 cut to a sliding hash-routed, a CSA and an HCA layer) in the exact
numerics mode — the forward, the paged step (prefill chunks + decode steps, `v4.decode.extend`) and the MTP layer's
paged step (`v4.mtp.extend`), on tp=2 x ep=4: identical discrete
decisions (CSA top-k, experts), logits and cache bit for bit (LOGIT_ATOL = 0, the reason `tests/test_sharding.py`
gives for V4.1 holds here: the only sums a mesh reorders are the tp-split contractions wo_b and the shared
expert's w2, fp64-accumulated in the exact mode; the routed experts' psum has one non-zero term per value).
The expert-parallel reference MoE (plain experts, the release numerics) is checked bitwise on its own.

The serving engine on the mesh gives the one-device engine's greedy tokens and logprobs bit for bit.

The rules' splits and a tiny-v4 checkpoint loaded onto the mesh are checked on tiny-v4 itself.

Compile budget: micro-v4's step at one [B, T] shape and its MTP step, each unsharded and on the mesh, the forward
twice; one engine on the mesh (the one-device engine shares test_v4_engine's settings, so its programs come from
the suite's compilation cache); tp=4, ep=8 and MTP speculation in the engine on the mesh under ``-m slow``."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import configs

from dsv41_jax.model import ModelConfig, forward, init_params
from dsv41_jax.model.cache import CacheConfig
from dsv41_jax.model.params import declare_params, flatten_names
from dsv41_jax.model.v4 import decode as dec4
from dsv41_jax.model.v4 import moe as moe4
from dsv41_jax.model.v4 import mtp
from dsv41_jax.model.v4.params import partition_specs
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import make_mesh
from dsv41_jax.parallel.plan import MeshPlan

CFG = configs.micro_v4().replace(act_dtype="exact")
TINY = ModelConfig.preset("tiny-v4").replace(act_dtype="exact")  # the preset's layout: rules' splits, checkpoints
CCFG = CacheConfig(page_size=8, num_pages=12, max_slots=2, max_pages_per_seq=5)
LOGIT_ATOL = 0.0
LENS = (21, 14)  # prompt lengths: CSA (ratio 4) and HCA (ratio 8) windows cut by the 8-token chunks
CHUNK, DECODE_STEPS = 8, 2
_FWD = jax.jit(forward, static_argnames=("cfg", "return_aux", "par"))
_CACHE: dict = {}


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


def _tokens():
    return np.random.default_rng(7).integers(0, CFG.vocab_size, (2, max(LENS) + DECODE_STEPS)).astype(np.int32)


# ------------------------------------------------------------------------------------------ rules


def test_v4_partition_specs():
    """Every V4 tensor's split on tp=2 x ep=4: heads / o groups / shared expert / vocabulary over tp, routed
    experts and the gate over ep, V4's own tensors (compressors with ape, indexers, tid2eid, hc_head) replicated;
    `v4.params.partition_specs` (the converter's table) and `parallel.rules` (the engine's) agree."""
    specs = partition_specs(TINY, tp=2, ep=4)
    rep = P(None, None)
    want = {"layers.2.attn.wq_b.weight": P("tp", None), "layers.2.attn.wo_a.weight": P("tp", None),
            "layers.2.attn.wo_b.weight": P(None, "tp"), "layers.2.attn.attn_sink": P("tp"),
            "layers.0.ffn.shared_experts.w1.weight": P("tp", None),
            "layers.0.ffn.shared_experts.w2.weight": P(None, "tp"),
            "embed.weight": P("tp", None), "head.weight": P("tp", None),
            "layers.0.ffn.experts.w1.weight": P("ep", None, None), "layers.0.ffn.gate.weight": P("ep", None),
            "layers.3.ffn.gate.bias": P("ep"), "layers.0.ffn.gate.tid2eid": rep,
            "layers.2.attn.compressor.ape": rep, "layers.2.attn.compressor.wkv.weight": rep,
            "layers.3.attn.compressor.ape": rep, "layers.2.attn.indexer.wq_b.weight": rep,
            "layers.2.attn.indexer.weights_proj.weight": rep, "layers.2.attn.indexer.compressor.ape": rep,
            "hc_head_fn": rep, "hc_head_base": P(None), "mtp.0.hc_head_fn": rep, "mtp.0.e_proj.weight": rep,
            "mtp.0.attn.wq_b.weight": P("tp", None), "mtp.0.ffn.experts.w2.weight": P("ep", None, None)}
    for name, sp in want.items():
        assert tuple(specs[name]) == tuple(sp), (name, specs[name])
    decls = flatten_names(declare_params(TINY))
    assert set(specs) == set(decls)
    for name, p in decls.items():  # every logical axis is in the one table (unknown names raise there)
        for ax in p.axes:
            rules.mesh_axis(ax, make_mesh(1, 1))
    abstract = jax.sharding.AbstractMesh((4, 2), ("ep", "tp"))
    for name, s in flatten_names(rules.param_shardings(TINY, abstract)).items():
        a, b = (tuple(x) + (None,) * (len(decls[name].shape) - len(x)) for x in (s.spec, specs[name]))
        assert a == b, (name, a, b)


def test_v4_cache_axes_cover_the_state():
    """`rules.cache_axes` names every leaf of V4's cache (and of the MTP state the engine adds); all replicated."""
    from dsv41_jax.serving.mtp_speculative import with_mtp_state

    state = jax.eval_shape(lambda: with_mtp_state(dec4.init_state(CFG, CCFG), CFG, CCFG))
    axes = rules.cache_axes(state)
    for (path, a), ax in zip(jax.tree_util.tree_leaves_with_path(state),
                             jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        assert len(ax) == a.ndim, jax.tree_util.keystr(path)
        assert all(rules.RULES[n] is None for n in ax), jax.tree_util.keystr(path)


def test_v4_checkpoint_loads_onto_the_mesh(cpu8, tmp_path):
    """A tiny-v4 checkpoint directory (scripts/make_checkpoint.py) read straight onto tp=2 x ep=4 (`plan.load_params`):
    every leaf on its rule's sharding, the values those of the one-device tree; parameters without the MTP layer
    (a transformers-written checkpoint) are placed too."""
    import importlib.util
    import os

    from dsv41_jax.parallel.plan import load_params

    spec = importlib.util.spec_from_file_location(
        "make_checkpoint", os.path.join(os.path.dirname(__file__), "..", "scripts", "make_checkpoint.py"))
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    assert mk.main(["--preset", "tiny-v4", "--out", str(tmp_path / "ck")]) == 0
    mesh = make_mesh(2, 4, cfg=TINY)
    got = load_params(str(tmp_path / "ck"), TINY, mesh)
    want = rules.param_shardings(TINY, mesh)
    tiny = init_params(TINY, jax.random.key(0))
    for (path, a), s, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want),
                               jax.tree_util.tree_leaves(tiny)):
        assert a.sharding.is_equivalent_to(s, a.ndim), jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8)), jax.tree_util.keystr(path)
    no_mtp = rules.shard_params(dict(tiny, mtp=[]), TINY, mesh)
    assert no_mtp["mtp"] == [] and no_mtp["layers"][2]["attn"]["wq_b"].weight.sharding.spec[0] == "tp"


# ------------------------------------------------------------------------------------------ experts


def check_reference_moe_bitwise(mesh_of):
    """`v4.moe.routed` with the reference (plain bf16 experts) on the mesh `mesh_of(cfg)` ≡ one device, bitwise, with
    hash-table rows naming one expert twice (their weights summed, as the reference does). Returns (idx, w, par)."""
    cfg = CFG.replace(expert_dtype="bf16", impl="moe=reference")
    ex = init_params(cfg, jax.random.key(1))["layers"][0]["ffn"]["experts"]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((6, cfg.hidden_size)), jnp.float32)
    idx = jnp.asarray([[1, 6], [3, 3], [0, 7], [5, 2], [4, 4], [7, 0]], jnp.int32)
    w = jnp.asarray(rng.random((6, 2)), jnp.float32)
    ref = jax.jit(lambda e, a, i, v: moe4.routed(e, a, i, v, cfg, jnp.float32))(ex, x, idx, w)
    mesh = mesh_of(cfg)
    par = MeshPlan.of(mesh)
    exs = jax.device_put(ex, rules.param_shardings(cfg, mesh)["layers"][0]["ffn"]["experts"])
    got = jax.jit(lambda e, a, i, v: moe4.routed(e, a, i, v, cfg, jnp.float32, par))(exs, x, idx, w)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(ref).view(np.uint32))
    return idx, w, par


def test_expert_parallel_reference_moe_is_bitwise(cpu8):
    """The reference MoE split over ep=4 (every expert on every token, psum) ≡ one device bitwise."""
    check_reference_moe_bitwise(lambda cfg: make_mesh(2, 4, cfg=cfg))


# ------------------------------------------------------------------------------------------ whole model


def _batches():
    """Prompts in CHUNK-token chunks, then DECODE_STEPS one-token steps per row, all [2, CHUNK]; pages 1.. per
    row (row b's pages b·5 + 1 ..)."""
    toks = _tokens()
    P_ = CCFG.max_pages_per_seq
    pt = np.stack([1 + b * P_ + np.arange(P_) for b in range(2)]).astype(np.int32)
    pos, out = [0, 0], []
    ends = [n + DECODE_STEPS for n in LENS]
    while any(p < e for p, e in zip(pos, ends)):
        n_new = [min(CHUNK, L - p) if p < L else (1 if p < e else 0) for p, L, e in zip(pos, LENS, ends)]
        chunk = np.zeros((2, CHUNK), np.int32)
        for b in range(2):
            chunk[b, :n_new[b]] = toks[b, pos[b]:pos[b] + n_new[b]]
        out.append({"tokens": chunk, "start": np.array(pos, np.int32), "n_new": np.array(n_new, np.int32),
                    "slot": np.array([b if n_new[b] else CCFG.max_slots for b in range(2)], np.int32),
                    "page_table": pt})
        pos = [p + n for p, n in zip(pos, n_new)]
    return out


def _decisions(aux):
    return {k: jax.tree_util.tree_map(np.asarray, aux[k]) for k in ("experts", "topk")}


def _jit_step(fn, mesh, ins, outs):
    if mesh is None:
        return jax.jit(fn, donate_argnums=(1,))
    return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=(1,))


def run_model(mesh):
    """For `mesh` (None: one device): the forward's logits and decisions, every step's (all logits) and the final
    cache, and the MTP layer's steps over the same batches (its logits, output streams and cache); memoized."""
    key = None if mesh is None else tuple(mesh.shape.items())
    if key in _CACHE:
        return _CACHE[key]
    par = MeshPlan.of(mesh)
    params = _params() if mesh is None else rules.shard_params(_params(), CFG, mesh)
    toks = _tokens()[:, :max(LENS)]
    logits, aux = _FWD(params, toks, cfg=CFG, return_aux=True, par=par)
    res = {"params": params, "forward": {"logits": np.asarray(logits), **_decisions(aux)}}
    ins = outs = mins = mouts = None
    if mesh is not None:
        (ps, cs, bs), (lg, cs_out) = par.step_shardings(CFG, CCFG, True)
        rep = rules.replicated(mesh)
        ins, outs = (ps, cs, bs), (lg, cs_out, rep)
        mcs = jax.tree_util.tree_map(lambda _: rep, jax.eval_shape(lambda: mtp.init_state(CFG, CCFG)))
        mins, mouts = (ps, mcs, rep, bs), (lg, mcs, rep)
    step = _jit_step(functools.partial(dec4.extend, cfg=CFG, ccfg=CCFG, return_aux=True, par=par), mesh, ins, outs)
    mstep = _jit_step(functools.partial(mtp.extend, cfg=CFG, ccfg=CCFG, par=par), mesh, mins, mouts)
    state = dec4.init_state(CFG, CCFG) if mesh is None else rules.init_cache(CFG, CCFG, mesh)
    # on the mesh, placed as the MTP step's outputs are: an unplaced first state traced the step a second time
    mstate = mtp.init_state(CFG, CCFG) if mesh is None else jax.device_put(mtp.init_state(CFG, CCFG), mcs)
    res["steps"], res["mtp"] = [], []
    batches = _batches()
    step = step.lower(params, state, batches[0]).compile()  # AOT: its HLO is inspected (`_check_mesh`)
    res["hlo"] = step.as_text()
    for bt in batches:
        lg, state, aux = step(params, state, bt)
        res["steps"].append({"logits": np.asarray(lg), **_decisions(aux)})
        # the MTP layer on this step's streams (as a draft reads them; the next tokens are this chunk's own)
        mlg, mstate, mh = mstep(params, mstate, aux["streams"], bt)
        res["mtp"].append({"logits": np.asarray(mlg), "streams": np.asarray(mh)})
    res.update(state=state, mstate=mstate)
    _CACHE[key] = res
    return res


def _same(a, b, what):
    for kind in ("experts", "topk"):
        assert a[kind].keys() == b[kind].keys()
        for L in b[kind]:
            np.testing.assert_array_equal(a[kind][L], b[kind][L], err_msg=f"{what}: {kind}, layer {L}")
    np.testing.assert_allclose(a["logits"], b["logits"], rtol=0, atol=LOGIT_ATOL, err_msg=what)


def _bits(a, b, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8),
                                      err_msg=f"{what}{jax.tree_util.keystr(path)}")


def _check_mesh(tp, ep):
    ref = run_model(None)
    mesh = make_mesh(tp, ep, cfg=CFG)
    got = run_model(mesh)
    _same(got["forward"], ref["forward"], "forward")
    assert len(got["steps"]) == len(ref["steps"]) >= 4
    for i, (a, b) in enumerate(zip(got["steps"], ref["steps"])):
        _same(a, b, f"step {i}")
    _bits(got["state"], ref["state"], "cache")
    for i, (a, b) in enumerate(zip(got["mtp"], ref["mtp"])):
        _bits(a, b, f"MTP step {i}: ")
    _bits(got["mstate"], ref["mstate"], "MTP cache")
    # the step's collectives: the routed experts' psum in every layer (+ tp's all-reduces), no stored weight moved
    ops = re.findall(r"=\s*(\S+)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
                     r"(?:-start)?\(", got["hlo"])
    if ep > 1:
        assert len([t for t, op in ops if op == "all-reduce"]) >= CFG.num_hidden_layers, ops
    gathers = [t for t, op in ops if op == "all-gather"]
    assert not [t for t in gathers if re.match(r"\(?(u8|f8)", t)], gathers
    assert not [t for t in gathers if re.search(rf"\[{CFG.n_routed_experts},\d+,\d+\]", t)], gathers
    # placement: params on the rules' shardings, the cache replicated, less than the whole model per device
    want = jax.tree_util.tree_leaves(rules.param_shardings(CFG, mesh))
    for a, s in zip(jax.tree_util.tree_leaves(got["params"]), want):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    for a in jax.tree_util.tree_leaves(got["state"]):
        assert a.sharding.is_fully_replicated
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(_params()))
    assert max(rules.param_bytes_per_device(got["params"]).values()) < total


def test_sharded_equals_unsharded_tp2_ep4(cpu8):
    """Forward, paged step (prefill chunks + decode) and MTP step on tp=2 x ep=4 ≡ one device, bit for bit."""
    _check_mesh(2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(4, 1), (1, 8)])
def test_sharded_equals_unsharded_other_meshes(cpu8, tp, ep):
    """tp=4 (one head per device, the o groups' rows split inside a group) and ep=8 (one expert per device)."""
    _check_mesh(tp, ep)


def test_mesh_sizes_checked_against_v4s_experts():
    """ep is checked against the routed experts, which V4's MTP layer shares (not a DSpark draft's count)."""
    from dsv41_jax.parallel.mesh import MeshError, check_sizes

    check_sizes(CFG.replace(dspark_n_routed_experts=3), tp=1, ep=8)
    with pytest.raises(MeshError, match="n_routed_experts=8 is not divisible by ep"):
        check_sizes(CFG, tp=1, ep=3)


# ------------------------------------------------------------------------------------------ engine


PROMPTS = [np.random.default_rng(4).integers(0, CFG.vocab_size, n).tolist() for n in (27, 13)]


def _engine(**kw):
    """A micro-v4 engine with test_v4_engine's config and settings (the one-device engine's programs are that
    module's: one compile per run through the suite's compilation cache) plus `kw` (the mesh, speculation)."""
    from test_v4_engine import KW

    from dsv41_jax.serving.engine import Engine

    return Engine(cfg=CFG, params=_params(), **KW, **kw)


def _serve(eng, logprobs=2):
    """The PROMPTS together, greedy, 6 tokens each: [(tokens, logprobs, top_logprobs)] per prompt."""
    from dsv41_jax.serving.sampling import SamplingParams

    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt_token_ids=p,
                        sampling_params=SamplingParams(max_tokens=6, temperature=0.0, logprobs=logprobs))
    outs = {o.request_id: o.outputs[0] for o in eng.run_until_done() if o.finished}
    return [(outs[f"r{i}"].token_ids, outs[f"r{i}"].logprobs, outs[f"r{i}"].top_logprobs) for i in range(len(PROMPTS))]


@functools.lru_cache(maxsize=None)
def _one_device():
    return _serve(_engine())


def test_engine_on_tp2_ep4_equals_one_device(cpu8):
    """The serving engine with micro-v4 on --tp-size 2 --ep-size 4 (`V4Step` on the mesh: params by the rules, the
    cache replicated, chunked prefill cutting CSA / HCA windows, ragged rows, decode) gives the one-device engine's
    greedy tokens and logprobs (top-2 included) bit for bit."""
    ref = _one_device()
    eng = _engine(tp_size=2, ep_size=4)
    assert eng.runner.model_step.family == "deepseek_v4" and dict(eng.runner.mesh.shape) == {"ep": 4, "tp": 2}
    ffn = eng.runner.params["layers"][2]["ffn"]
    assert ffn["experts"]["w1"].weight.sharding.spec[0] == "ep"
    assert ffn["shared_experts"]["w1"].weight.sharding.spec[0] == "tp"
    assert eng.runner.state["comp"]["2"].sharding.is_fully_replicated
    assert _serve(eng) == ref
    assert all(len(t) == 6 for t, _, _ in ref)


@pytest.mark.slow
def test_engine_mtp_on_tp2_ep4_equals_one_device(cpu8):
    """MTP speculation (EAGLE, γ = 2) on tp=2 x ep=4 (`mtp_speculative` on the mesh, its per-slot state replicated):
    the one-device plain greedy tokens (requests without logprobs: a logprobs row never speculates)."""
    ref = _one_device()
    spec = _engine(tp_size=2, ep_size=4, speculative_algorithm="EAGLE", speculative_num_steps=2,
                   speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    assert [t for t, _, _ in _serve(spec, logprobs=None)] == [t for t, _, _ in ref]
    assert spec.stats()["spec_verify_steps"] > 0
    assert spec.runner.state["mtp"]["h"].sharding.is_fully_replicated
