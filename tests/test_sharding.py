"""Sharded execution on the 8 host CPU devices (`cpu8`): mesh checks, the rules' shardings, the
`shard_map`'d collectives, and sharded ≡ unsharded for the forward, prefill chunks and decode steps.

Equivalence runs in the exact numerics mode (fp64-accumulated matmuls: results do not depend on the
summation order that tp all-reduces change) and must give identical discrete decisions (MoE experts,
index top-k) and bitwise-equal logits (LOGIT_ATOL = 0 says why). The MoE/gather collectives are also
checked bitwise in the default bf16 flow.

Compile budget: the default tier compiles the whole model (`configs.micro`) twice — the extend step (prefill chunks
and decode steps share its [B, T] shape; compiled ahead of time so the same executable's HLO is
inspected) unsharded and on ONE mesh, tp=2 x ep=4, which exercises both axes. The forward and the
other meshes of the issue (tp=2, tp=4, ep=2, ep=4) run the same checks under ``-m slow`` (two more
compiles per mesh).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import configs

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import dispatch, moe as moe_mod
from dsv41_jax.model.params import init_params
from dsv41_jax.model.engram import gather_rows
from dsv41_jax.model.transformer import forward
from dsv41_jax.parallel import collectives, rules
from dsv41_jax.parallel.mesh import MeshError, make_mesh
from dsv41_jax.parallel.plan import MeshPlan

# Exact mode: logits bitwise equal (atol 0) on every mesh. Why that holds: the only sums whose order a
# mesh changes are the tp-split contractions (wo_b and the shared expert's w2 over their split inputs,
# wo_a when tp splits a group's heads) and the all-reduces after them; in the exact mode they accumulate
# in fp64, and their products are exact in fp64 with few significant bits (fp8 GEMMs: <= 8 bits; wo_a:
# fp32 x bf16 = 32 bits), so each fp64 sum — in any order — is the exact sum unless its terms span more
# than ~2^13 in magnitude, and then differs by 2^-53 relative, which rounds to the same fp32 value except
# within 2^-29 of an fp32 rounding boundary. The MoE / Engram / embedding collectives are exact by
# construction (`parallel.collectives`). Attention's q·k and p·v run in fp64 too (`attention._attend_exact`);
# when they were fp32, tp=4 (one head per device: XLA blocks the head-batched einsums differently) gave
# 1.8e-5 on the forward's logits — one flipped fp8 code in the last layer — reproduced by forcing the fp32
# attention back: 1.76e-5 on tp=4, 0 with fp64 attention. Observed with fp64 attention: 0 on tp=2 x ep=4,
# tp=2 and tp=4 (forward, prefill chunks and decode steps); ep=2 / ep=4 split no contraction (0 there
# already with the fp32 attention).
LOGIT_ATOL = 0.0
SEED = 1234
B, CHUNK = 2, 4
PROMPT_LENS = (7, 5)
DECODE_STEPS = 2
CCFG = kvc.CacheConfig(page_size=8, num_pages=6, max_slots=2, max_pages_per_seq=2, retrieval_block=4)

_FWD = jax.jit(forward, static_argnames=("cfg", "return_aux", "par"))
_CACHE: dict = {}


@pytest.fixture(scope="module")
def xcfg(tiny_cfg):
    return tiny_cfg.replace(act_dtype="exact")


@pytest.fixture(scope="module")
def micro_xcfg():
    """`configs.micro` (tiny's sizes and heads, 8 experts, window-only / ratio-2 / ratio-1 + candidate
    layers) in the exact mode: the whole-model mesh checks, at a third of tiny's compile time."""
    return configs.micro().replace(act_dtype="exact")


@pytest.fixture(scope="module")
def micro_params(micro_xcfg):
    return init_params(micro_xcfg, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(SEED).integers(3, 300, (B, max(PROMPT_LENS))).astype(np.int32)


def _batches():
    """The step batches: prompts in CHUNK-token chunks, then DECODE_STEPS one-token steps per row,
    all in [B, CHUNK] (one compiled shape). Token ids of the decode steps are fixed, not sampled."""
    alloc = kvc.PageAllocator(CCFG.num_pages, CCFG.page_size, CCFG.max_pages_per_seq)
    toks = np.random.default_rng(SEED).integers(3, 300, (B, max(PROMPT_LENS) + DECODE_STEPS)).astype(np.int32)
    pos = [0] * B
    out = []
    ends = [L + DECODE_STEPS for L in PROMPT_LENS]
    while any(pos[b] < ends[b] for b in range(B)):
        rows = []
        for b in range(B):
            n = min(CHUNK, PROMPT_LENS[b] - pos[b]) if pos[b] < PROMPT_LENS[b] else (1 if pos[b] < ends[b] else 0)
            chunk = toks[b, pos[b]: pos[b] + n].tolist()
            alloc.ensure(b, pos[b] + len(chunk))
            rows.append({"tokens": chunk, "start": pos[b], "slot": b if chunk else CCFG.max_slots,
                         "page_table": alloc.pages(b)})
            pos[b] += n
        out.append(dec.make_batch(rows, CHUNK, B, CCFG))
    return out


def _fresh_cache(cfg, mesh, params):
    state = kvc.init_cache(cfg, CCFG) if mesh is None else rules.init_cache(cfg, CCFG, mesh)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    state = kvc.reset_slots(state, np.arange(CCFG.max_slots + 1), pad)
    if mesh is not None:
        state = jax.device_put(state, rules.cache_shardings(cfg, CCFG, mesh))
    return state


def _step(cfg, mesh):
    """The extend step (all logits) with its aux (discrete decisions), jitted with the production step's
    shardings (`rules.step_shardings`, as `decode.jitted_extend` uses them) and the cache donated."""
    fn = functools.partial(dec.extend, cfg=cfg, ccfg=CCFG, all_logits=True, return_aux=True, par=MeshPlan.of(mesh))
    if mesh is None:
        return jax.jit(fn, donate_argnums=(1,))
    (ps, cs, bs), (lg, cs_out) = rules.step_shardings(cfg, CCFG, mesh, all_logits=True)
    return jax.jit(fn, in_shardings=(ps, cs, bs), out_shardings=(lg, cs_out, None), donate_argnums=(1,))


def run_model(cfg, params, tokens, mesh, with_forward: bool):
    """The extend steps' logits, decisions and final cache (and the forward's logits + decisions if
    `with_forward`) for `mesh` (None = unsharded); memoized so each compiles once per session."""
    key = (cfg, None if mesh is None else tuple(mesh.shape.items()), with_forward)
    if key in _CACHE:
        return _CACHE[key]
    p = params if mesh is None else rules.shard_params(params, cfg, mesh)
    res = {"params": p}
    if with_forward:
        logits, aux = _FWD(p, tokens, cfg=cfg, return_aux=True, par=MeshPlan.of(mesh))
        res.update(logits=np.asarray(logits), experts=jax.device_get(aux["experts"]),
                   topk=jax.device_get(aux["topk"]))
    batches = _batches()
    state = _fresh_cache(cfg, mesh, params)
    step = _step(cfg, mesh).lower(p, state, batches[0]).compile()  # AOT: its HLO is inspected below
    res["steps"] = []
    for bt in batches:
        lg, state, aux = step(p, state, bt)
        res["steps"].append({"logits": np.asarray(lg), "experts": jax.device_get(aux["experts"]),
                             "topk": jax.device_get(aux["topk"])})
    res.update(state=state, hlo=step.as_text())
    _CACHE[key] = res
    return res


# ------------------------------------------------------------------------------------ mesh checks


def test_mesh_refuses_impossible_combinations(cpu8, tiny_cfg):
    with pytest.raises(MeshError, match="num_attention_heads=4 is not divisible"):
        make_mesh(tp=8, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="more expert shards than experts"):
        make_mesh(ep=16, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="not divisible by ep"):
        make_mesh(ep=3, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="dspark_n_routed_experts=4"):
        make_mesh(ep=8, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="needs 16 devices, only 8"):
        make_mesh(tp=4, ep=4, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="ep=2 with dp=2"):  # DP attention: experts over all devices
        make_mesh(tp=2, ep=2, dp=2, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="dp=4 x tp=2: more expert shards than experts"):
        make_mesh(tp=2, dp=4, cfg=tiny_cfg)
    with pytest.raises(MeshError, match="positive integer"):
        make_mesh(tp=0)
    m = make_mesh(tp=2, ep=4, cfg=tiny_cfg)
    assert dict(m.shape) == {"ep": 4, "tp": 2} and m.devices.size == 8


# ------------------------------------------------------------------------------------ rules


def test_rules_cover_every_logical_axis(tiny_cfg):
    from dsv41_jax.model.params import declare_params, flatten_names

    for name, p in flatten_names(declare_params(tiny_cfg)).items():
        for ax in p.axes:
            assert ax is None or ax in rules.RULES, f"{name}: logical axis {ax!r} has no rule"
    with pytest.raises(KeyError, match="not in the sharding rules table"):
        rules.mesh_axis("no_such_axis", None)


def test_param_shardings_and_bytes_shrink(cpu8, tiny_cfg):
    specs = {}
    per_dev = {}
    for tp, ep in ((1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 4)):
        mesh = make_mesh(tp, ep, cfg=tiny_cfg)
        ab = rules.param_shapes(tiny_cfg, mesh)
        per_dev[(tp, ep)] = max(rules.param_bytes_per_device(ab).values())
        specs[(tp, ep)] = ab
    ab = specs[(2, 4)]
    lay = ab["layers"][2]
    assert lay["attn"]["wq_b"].weight.sharding.spec == P("tp", None)
    assert lay["attn"]["wo_b"].weight.sharding.spec == P(None, "tp")
    assert lay["attn"]["attn_sink"].sharding.spec == P("tp")
    assert lay["attn"]["wkv"].weight.sharding.spec == P(None, None)
    for w in ("w1", "w2", "w3"):
        for k in ("weight", "scale"):
            assert getattr(lay["ffn"]["experts"][w], k).sharding.spec == P("ep", None, None)
    assert lay["ffn"]["shared_experts"]["w1"].weight.sharding.spec == P("tp", None)
    assert ab["layers"][1]["engram"]["embed"]["weight"].sharding.spec == P(("ep", "tp"), None)  # all devices
    assert specs[(2, 1)]["layers"][1]["engram"]["embed"]["weight"].sharding.spec == P("tp", None)
    assert ab["embed"]["weight"].sharding.spec == P("tp", None)
    assert ab["layers"][0]["hc_attn_fn"].sharding.spec == P(None, None)
    b = per_dev
    assert b[(1, 1)] > b[(2, 1)] > b[(4, 1)]
    assert b[(1, 1)] > b[(1, 2)] > b[(1, 4)] > b[(2, 4)]
    assert b[(2, 1)] > b[(2, 4)]


def test_padded_engram_rows():
    class M:  # a stand-in mesh: only .shape is read
        shape = {"ep": 1, "tp": 4}

    assert rules.padded_shape(("engram_rows", None), (10, 32), M) == (12, 32)

    class M2:
        shape = {"ep": 2, "tp": 4}

    assert rules.padded_shape(("engram_rows", None), (10, 32), M2) == (16, 32)
    assert rules.spec(("engram_rows", None), (16, 32), M2) == P(("ep", "tp"), None)
    assert rules.spec(("experts", "engram_rows"), (4, 16), M2) == P("ep", None)  # ep already used: replicated
    assert rules.padded_shape(("vocab", "embed"), (10, 32), M) == (10, 32)  # replicated, not padded
    assert rules.spec(("vocab", "embed"), (10, 32), M) == P(None, None)
    assert rules.spec(("engram_rows", None), (12, 32), M) == P("tp", None)



def test_place_host_pads_per_block(cpu8, tiny_cfg):
    """`rules.place_host`: each device's block is cut from the host array (rows past its end = ones,
    the Engram row padding), without a padded host copy."""
    mesh = make_mesh(4, 1, cfg=tiny_cfg)
    host = np.arange(20, dtype=np.float32).reshape(10, 2)
    a = rules.place_host(host, (12, 2), jax.sharding.NamedSharding(mesh, P("tp", None)))
    assert a.shape == (12, 2) and [s.data.shape for s in a.addressable_shards] == [(3, 2)] * 4
    full = np.asarray(a)
    assert np.array_equal(full[:10], host) and (full[10:] == 1).all()
    with pytest.raises(ValueError, match="does not fit"):
        rules.place_host(host, (8, 2), rules.replicated(mesh))


def test_cache_and_step_shardings(cpu8, tiny_cfg):
    mesh = make_mesh(2, 4, cfg=tiny_cfg)
    cs = rules.cache_shardings(tiny_cfg, CCFG, mesh)
    # MQA: one latent head read by every query head -> replicated over both axes (rules docstring)
    for s in jax.tree_util.tree_leaves(cs, is_leaf=lambda x: hasattr(x, "spec")):
        assert all(a is None for a in s.spec)
    assert set(cs) == {"window", "comp", "ikeys", "partial", "engram_hist"}
    (ps, cs2, bs), (lg, cs3) = rules.step_shardings(tiny_cfg, CCFG, mesh)
    assert cs2 is cs3 or jax.tree_util.tree_structure(cs2) == jax.tree_util.tree_structure(cs3)
    assert set(bs) == {"tokens", "start", "n_new", "slot", "page_table"}
    assert lg.spec == P(None, None)


# ------------------------------------------------------------------------------------ collectives


@pytest.mark.parametrize("scoped", [False, True])
def test_routed_experts_ep_bitwise(cpu8, tiny_cfg, tiny_params, scoped, monkeypatch):
    """Expert-parallel MoE == the unsharded grouped path, bitwise, in the default bf16 flow; `scoped`:
    with the CPU weight tiles inside `lax.cond` (`model.tiling`, as at flash sizes) forced on."""
    from dsv41_jax.model import tiling

    if scoped:
        monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 0)
    cfg = tiny_cfg
    ex = tiny_params["layers"][3]["ffn"]["experts"]
    rng = np.random.default_rng(SEED)
    xf = jnp.asarray(rng.standard_normal((6, cfg.hidden_size)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(cfg.n_routed_experts, 2, replace=False) for _ in range(6)]), jnp.int32)
    w = jnp.asarray(rng.uniform(0.1, 1.0, (6, 2)), jnp.float32)
    ref = jax.jit(lambda e, x, i, ww: moe_mod._routed_grouped(e, x, i, ww, cfg, jnp.bfloat16))(ex, xf, idx, w)
    for ep in (2, 4):
        mesh = make_mesh(1, ep, cfg=cfg)
        exs = jax.device_put(ex, jax.tree_util.tree_map(lambda _: jax.sharding.NamedSharding(mesh, P("ep")), ex))
        out = jax.jit(lambda e, x, i, ww: collectives.routed_experts(e, x, i, ww, cfg, jnp.bfloat16, mesh))(
            exs, xf, idx, w)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_moe_reference_refused_on_ep_mesh(cpu8, tiny_cfg, tiny_params):
    cfg = tiny_cfg.replace(impl="moe=reference")
    mesh = make_mesh(1, 2, cfg=cfg)
    x = jnp.zeros((1, 2, cfg.hidden_size), jnp.bfloat16)
    with pytest.raises(dispatch.ImplError, match="cannot run expert-parallel"):
        moe_mod.moe(tiny_params["layers"][0]["ffn"], x, 2, cfg, jnp.bfloat16, par=MeshPlan(mesh))


def test_row_gather_bitwise(cpu8, tiny_cfg, tiny_params):
    """Engram rows split over tp, or over ep x tp: local gather + psum == the unsharded gather, bitwise."""
    e = tiny_params["layers"][1]["engram"]["embed"]
    N = e["weight"].shape[0]
    rows = jnp.asarray(np.random.default_rng(SEED).integers(0, N, (2, 3, 6)), jnp.int32)
    for dt in (jnp.bfloat16, jnp.float32):
        ref = gather_rows(e["weight"], e["scale"], rows, dt)
        for tp, ep in ((2, 1), (4, 1), (2, 4)):
            mesh = make_mesh(tp, ep, cfg=tiny_cfg)
            sh = jax.sharding.NamedSharding(mesh, P(("ep", "tp") if ep > 1 else "tp", None))
            out = jax.jit(lambda t, s, r: collectives.row_gather(t, s, r, dt, mesh))(
                jax.device_put(e["weight"], sh), jax.device_put(e["scale"], sh), rows)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


# ------------------------------------------------------------------------------------ whole model


def _same_decisions(got, ref, what):
    for L in ref["experts"]:
        np.testing.assert_array_equal(got["experts"][L], ref["experts"][L], err_msg=f"{what}: experts, layer {L}")
    for L in ref["topk"]:
        np.testing.assert_array_equal(got["topk"][L], ref["topk"][L], err_msg=f"{what}: index top-k, layer {L}")


def _check_mesh(xcfg, tiny_params, tokens, tp, ep, with_forward):
    ref = run_model(xcfg, tiny_params, tokens, None, with_forward)
    mesh = make_mesh(tp, ep, cfg=xcfg)
    got = run_model(xcfg, tiny_params, tokens, mesh, with_forward)
    if with_forward:  # identical discrete decisions, logits within LOGIT_ATOL
        _same_decisions(got, ref, "forward")
        np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=LOGIT_ATOL)
    # prefill chunks + decode steps: same decisions, same logits, same cache codes
    assert len(got["steps"]) == len(ref["steps"]) >= 3
    for i, (a, b) in enumerate(zip(got["steps"], ref["steps"])):
        _same_decisions(a, b, f"step {i}")
        np.testing.assert_allclose(a["logits"], b["logits"], rtol=0, atol=LOGIT_ATOL, err_msg=f"step {i}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got["state"]), jax.tree_util.tree_leaves(ref["state"])):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))
    # placement: params and cache on the rules' shardings, per-device bytes below the unsharded total
    want = rules.param_shardings(xcfg, mesh)
    for a, s in zip(jax.tree_util.tree_leaves(got["params"]), jax.tree_util.tree_leaves(want)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    for a, s in zip(jax.tree_util.tree_leaves(got["state"]),
                    jax.tree_util.tree_leaves(rules.cache_shardings(xcfg, CCFG, mesh))):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(tiny_params))
    assert max(rules.param_bytes_per_device(got["params"]).values()) < total
    return got


def _collectives(hlo: str):
    ops = re.findall(r"=\s*(\S+)\s+(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)"
                     r"(?:-start)?\(", hlo)
    return [(t, op) for t, op in ops]


def test_sharded_step_equals_unsharded_tp2_ep4(cpu8, micro_xcfg, micro_params, tokens):
    """Prefill chunks + decode steps on tp=2 x ep=4 ≡ unsharded (micro); the compiled step's collectives."""
    xcfg = micro_xcfg
    got = _check_mesh(xcfg, micro_params, tokens, 2, 4, with_forward=False)
    ops = _collectives(got["hlo"])
    reduces = [t for t, op in ops if op == "all-reduce"]
    gathers = [t for t, op in ops if op == "all-gather"]
    # one MoE combine per layer (ep) + tp all-reduces (wo_b, shared expert, Engram/embedding gathers)
    assert len(reduces) >= 2 * xcfg.num_hidden_layers, ops
    # no stored weight is ever all-gathered: expert weights are uint8 / e8m0, dense weights fp8
    assert not [t for t in gathers if re.match(r"\(?(u8|f8)", t)], gathers
    E = xcfg.n_routed_experts
    assert not [t for t in gathers if re.search(rf"\[{E},\d+,\d+\]", t)], gathers  # [E, out, in] stacks


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 4), (2, 1), (4, 1), (1, 2), (1, 4)])
def test_sharded_equals_unsharded_all_meshes(cpu8, micro_xcfg, micro_params, tokens, tp, ep):
    """Forward + prefill + decode ≡ unsharded on every mesh of the issue (micro)."""
    _check_mesh(micro_xcfg, micro_params, tokens, tp, ep, with_forward=True)


# ------------------------------------------------------------------------------------ host Engram table


def test_host_table_engram_bitwise(cpu8, tiny_cfg, tiny_params, monkeypatch):
    """Engram with the host table ≡ with the tp-sharded table ≡ unsharded, bitwise (bf16 flow), and
    the jitted step holds no table bytes on any device."""
    from dsv41_jax.model.engram import engram
    from dsv41_jax.parallel.host_table import HostTable, host_table_requested

    cfg = tiny_cfg
    mesh = make_mesh(2, 2, cfg=cfg)
    sp = rules.shard_params(tiny_params, cfg, mesh)
    hp = rules.shard_params(tiny_params, cfg, mesh, engram_host_table=True)
    assert isinstance(hp["layers"][1]["engram"]["embed"], HostTable)
    assert sp["layers"][1]["engram"]["embed"]["weight"].sharding.spec == P(("ep", "tp"), None)
    table = sum(x.nbytes for x in jax.tree_util.tree_leaves(tiny_params["layers"][1]["engram"]["embed"]))
    assert table > 0 and hp["layers"][1]["engram"]["embed"].nbytes == table
    dev_s = max(rules.param_bytes_per_device(sp).values())
    dev_h = max(rules.param_bytes_per_device(hp).values())
    assert dev_h < dev_s
    rng = np.random.default_rng(SEED)
    N = tiny_params["layers"][1]["engram"]["embed"]["weight"].shape[0]
    rows = jnp.asarray(rng.integers(0, N, (2, 3, 6)), jnp.int32)
    h = jnp.asarray(rng.standard_normal((2, 3, cfg.hc_mult, cfg.hidden_size)), jnp.bfloat16)
    f = jax.jit(lambda p, h, r, par: engram(p, h, r, cfg, jnp.bfloat16, par=par), static_argnums=3)
    ref = np.asarray(f(tiny_params["layers"][1]["engram"], h, rows, None))
    for p in (sp, hp):
        np.testing.assert_array_equal(np.asarray(f(p["layers"][1]["engram"], h, rows, MeshPlan.of(mesh))), ref)
    monkeypatch.setenv("DSV41_ENGRAM_HOST_TABLE", "1")
    assert host_table_requested() and not host_table_requested(False)
    monkeypatch.setenv("DSV41_ENGRAM_HOST_TABLE", "maybe")
    with pytest.raises(ValueError, match="DSV41_ENGRAM_HOST_TABLE"):
        host_table_requested()


# ------------------------------------------------------------------------------------ scripts/aot_flash.py


@pytest.mark.slow  # one more whole-model compile (~40 s alone, minutes on busy cores)
def test_aot_flash_script_tiny(cpu8, tmp_path):
    """The abstract lowering script on one mesh (tiny config: no weights are allocated either way); its
    parameter bytes agree with `param_stats` and shrink per device."""
    import importlib.util
    import json
    import os

    from dsv41_jax.model import ModelConfig
    from dsv41_jax.model.params import param_stats

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "aot_flash.py")
    spec = importlib.util.spec_from_file_location("aot_flash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "aot.json"
    assert mod.main(["--config", "tiny", "--tp", "2", "--ep", "2", "--batch", "2", "--context", "32",
                     "--page-size", "16", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    total = param_stats(ModelConfig.preset("tiny"))["bytes"]
    assert rep["param_bytes_checkpoint"] == rep["param_bytes_placed_global"] == total
    assert rep["param_bytes_derived"] > 0  # the load-time wo_a.bf16 copies, counted apart
    assert rep["param_bytes_per_device_max"] < total
    assert rep["collective_bytes"].get("all-reduce", 0) > 0
    assert rep["memory_analysis"]["temp_size_in_bytes"] > 0 and rep["cost_analysis"]["flops"] > 0
    assert mod.main(["--config", "tiny", "--tp", "3"]) == 2  # refused: heads not divisible


def test_aot_flash_memory_only_counts_snapshot_pool_and_draft(cpu8, tmp_path):
    """`aot_flash.py --memory-only` (shapes only, no compile): the prefix cache's snapshot pool per device
    is its rows (default 4 x batch) times a point = the cache's per-slot rows of one slot (window rings,
    partial groups, Engram history, DSpark rings; replicated, as the cache), and the DSpark draft's
    parameters and rings are listed (``--no-dspark``: no rings)."""
    import importlib.util
    import json
    import os

    import jax
    import numpy as np

    from dsv41_jax.model import ModelConfig, dspark
    from dsv41_jax.model import cache as kvc

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "aot_flash.py")
    spec = importlib.util.spec_from_file_location("aot_flash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "mem.json"
    argv = ["--config", "tiny", "--tp", "2", "--ep", "2", "--batch", "3", "--context", "32", "--page-size", "16",
            "--memory-only", "--out", str(out)]
    assert mod.main(argv) == 0
    rep = json.loads(out.read_text())
    cfg = ModelConfig.preset("tiny")
    ccfg = kvc.CacheConfig(page_size=16, num_pages=7, max_slots=3, max_pages_per_seq=2)
    st = jax.eval_shape(lambda: dspark.with_rings(kvc.init_cache(cfg, ccfg), cfg, ccfg))
    row = sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for k in ("window", "partial", "engram_hist", "dspark")
              for x in jax.tree_util.tree_leaves(st[k]))
    assert rep["snapshot_rows"] == 64 and rep["snapshot_point_bytes_per_device"] == row  # 4 x 3, at least 64
    assert rep["snapshot_pool_bytes_per_device"] == 64 * row
    assert rep["dspark"] and rep["dspark_param_bytes_per_device"] > 0 and rep["dspark_rings_bytes_per_device"] > 0
    assert "memory_analysis" not in rep and rep["device_bytes_needed"] > rep["param_bytes_per_device_max"]
    assert mod.main(argv + ["--no-dspark", "--radix-cache-snapshots", "2"]) == 0
    rep = json.loads(out.read_text())
    assert rep["dspark_rings_bytes_per_device"] == 0 and rep["snapshot_rows"] == 2
    assert rep["snapshot_point_bytes_per_device"] < row


def test_collective_bytes_parser():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "aot_flash.py")
    spec = importlib.util.spec_from_file_location("aot_flash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hlo = ("%a = f32[8,8]{1,0} all-reduce(%x), replica_groups={}\n"
           "%b = (bf16[2,4]{1,0}, f32[2]{0}) all-gather-start(%y), dimensions={0}\n"
           "%c = u8[16]{0} all-to-all(%z)\n")
    assert mod.collective_bytes(hlo) == {"all-reduce": 256, "all-gather": 24, "all-to-all": 16}
    hlo += ('%d = f32[8,8]{1,0} all-reduce(%w), metadata={op_name="jit(extend)/shard_map/psum" stack_frame_id=3}\n'
            '%e = f16[4,2]{1,0} collective-permute(%v), metadata={op_name="jit(extend)/cond/branch_1_fun/slice"}\n')
    src = mod.collective_sources(hlo)
    assert src[0]["bytes"] == src[1]["bytes"] == 256 and src[-1]["bytes"] == 16  # largest first
    assert {"kind": "all-reduce", "type": "f32[8,8]", "op_name": "jit(extend)/shard_map/psum", "count": 1,
            "bytes": 256} in src
    assert {"kind": "collective-permute", "type": "f16[4,2]", "op_name": "jit(extend)/cond/branch_1_fun/slice",
            "count": 1, "bytes": 16} in src and len(src) == 5
    # --keep-layers: the flash cut used in docs/results/aot_flash_tp2ep4_keep_0_1_2_20_cpu.json
    from dsv41_jax.model import ModelConfig

    c = mod.keep_layers(ModelConfig.preset("flash"), [0, 1, 2, 20])
    plans = [c.layer_plan(i) for i in range(4)]
    assert c.num_hidden_layers == 4 and c.num_nextn_predict_layers == 0 and c.hidden_size == 5120
    assert [p.compress_ratio for p in plans] == [0, 0, 2, 1] and plans[1].is_engram
    assert plans[2].is_kv_source and plans[3].is_kv_source and plans[3].is_candidate_source
    with pytest.raises(ValueError, match="--keep-layers"):
        mod.keep_layers(c, [4])


# ------------------------------------------------------------------------------------ multi-host

_WORKER = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"  # XLA_FLAGS: from the test (4 devices, this session's compile settings)
from dsv41_jax.parallel.distributed import initialize
assert initialize()  # from DSV41_COORDINATOR_ADDRESS / DSV41_NUM_PROCESSES / DSV41_PROCESS_ID
import jax, numpy as np
from dsv41_jax.model import ModelConfig, init_params
from dsv41_jax.model.transformer import forward
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import make_mesh
from dsv41_jax.parallel.plan import MeshPlan
assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
cfg = ModelConfig.preset("tiny").replace(act_dtype="exact")
mesh = make_mesh(2, 4, cfg=cfg)
params = rules.shard_params(init_params(cfg, jax.random.key(0)), cfg, mesh)
toks = np.load(sys.argv[1])
tok = jax.make_array_from_callback(toks.shape, rules.replicated(mesh), lambda idx: toks[idx])
fwd = jax.jit(forward, static_argnames=("cfg", "return_aux", "par"), out_shardings=rules.replicated(mesh))
out = fwd(params, tok, cfg=cfg, par=MeshPlan(mesh))  # logits gathered (the head splits the vocabulary over tp)
np.save(sys.argv[2] + f".{jax.process_index()}.npy", np.asarray(out.addressable_data(0)))
"""


@pytest.mark.slow  # two processes compile the sharded forward
def test_two_processes_forward(cpu8, xcfg, tiny_params, tokens, tmp_path):
    """jax.distributed over loopback, 2 processes x 4 CPU devices = one tp=2 x ep=4 mesh: the sharded
    forward agrees with the single-process unsharded forward (exact mode, LOGIT_ATOL). The workers compile
    with this process's XLA settings (`xla_flags.compile_speed_flags`: the suite's -O0 and fusion emitters
    off on a CPU), as the reference does: at XLA's default level LLVM contracts a*b+c into FMAs, which
    changes fp32 results in the last bit whatever the mesh (issue 49: on jax 0.12, 3,682 of 4,480 logits
    parted by up to 7.2e-7 while the workers ran at XLA's defaults and the reference at -O0)."""
    import os
    import socket
    import subprocess
    import sys

    from xla_flags import compile_speed_flags

    ref = run_model(xcfg, tiny_params, tokens, None, with_forward=True)["logits"]
    np.save(tmp_path / "toks.npy", tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for pid in range(2):
        flags = compile_speed_flags(os.environ.get("XLA_FLAGS", "")) + ["--xla_force_host_platform_device_count=4"]
        env = dict(os.environ, PYTHONPATH=root, DSV41_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   DSV41_NUM_PROCESSES="2", DSV41_PROCESS_ID=str(pid), XLA_FLAGS=" ".join(flags))
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / "toks.npy"),
                                       str(tmp_path / "out")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1500)[0] for p in procs]
    for p, lg in zip(procs, logs):
        assert p.returncode == 0, lg[-3000:]
    for pid in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"out.{pid}.npy"), ref, rtol=0, atol=LOGIT_ATOL)


def test_distributed_settings(monkeypatch):
    from dsv41_jax.parallel.distributed import settings

    for k in ("DSV41_COORDINATOR_ADDRESS", "DSV41_NUM_PROCESSES", "DSV41_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert settings() == {}
    assert settings("h:1", 2, 1) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}
    with pytest.raises(ValueError, match="need --coordinator-address"):
        settings(num_processes=2)
    with pytest.raises(ValueError, match="outside 0..1"):
        settings("h:1", 2, 2)
    monkeypatch.setenv("DSV41_COORDINATOR_ADDRESS", "h:2")
    monkeypatch.setenv("DSV41_NUM_PROCESSES", "4")
    monkeypatch.setenv("DSV41_PROCESS_ID", "3")
    assert settings() == {"coordinator_address": "h:2", "num_processes": 4, "process_id": 3}


# ------------------------------------------------------------------------------------ CPU row tiles on a mesh


def test_split_row_tiles_stay_local(cpu8, tiny_cfg, tiny_params, monkeypatch):
    """`model.tiling` on a mesh: the CPU row tiles of a weight whose rows are split over tp (wq_b, wo_a,
    the head, the shared expert) are taken within each device's rows, so the compiled product moves no
    weight — no collective at all for a replicated input — and equals the unsharded, untiled product.
    (Contiguous tiles of a split weight made XLA move widened weight tiles between devices: ~2.9 GB
    per flash decode step, scripts/aot_flash.py; this test then fails on collective-permutes.)"""
    from dsv41_jax.model import linear, tiling

    monkeypatch.setitem(tiling.SCOPED_BACKENDS, jax.default_backend(), 4)
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 0)
    monkeypatch.setattr(tiling, "TILE_BYTES", 8192)  # several tiles per shard at tiny sizes
    tiling._itemsize.cache_clear()
    cfg = tiny_cfg.replace(act_dtype="float32")
    dt = jnp.float32
    mesh = make_mesh(2, 1, cfg=cfg)
    sp = rules.shard_params(tiny_params, cfg, mesh)
    rng = np.random.default_rng(SEED)
    H, hd, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    x_small = jnp.asarray(rng.standard_normal((2, 1, cfg.q_lora_rank)), dt)  # decode rows: block GEMM
    xh = jnp.asarray(rng.standard_normal((2, 1, cfg.hidden_size)), dt)
    o = jnp.asarray(rng.standard_normal((2, 1, G, H * hd // G)), dt)

    def fn(p, xs, xh, o, par):
        with tiling.on_mesh(par):
            a = p["layers"][2]
            return (linear.fp8(xs, a["attn"]["wq_b"], cfg, dt, row_axis="heads"),  # 2 tiles per shard
                    linear.f32(xh, p["head"]["weight"], cfg, row_axis="vocab"),  # 5 tiles per shard
                    linear.wo_a(o, a["attn"]["wo_a"], cfg, dt, row_axis="heads"))  # 1 group per shard

    try:
        nt_all, split = tiling.plan(H * hd, cfg.q_lora_rank, 32, "heads")
        assert split is None and nt_all >= 4  # no mesh: tiles of the whole weight
        with tiling.on_mesh(MeshPlan(mesh)):
            nt, split = tiling.plan(H * hd, cfg.q_lora_rank, 32, "heads")
        assert split is not None and split.k == 2 and nt >= 2  # tiled within each device's rows
        ref = jax.jit(fn, static_argnums=4)(tiny_params, x_small, xh, o, None)
        o_sh = jax.device_put(o, jax.sharding.NamedSharding(mesh, P(None, None, "tp", None)))  # head-split
        f = jax.jit(fn, static_argnums=4).lower(sp, x_small, xh, o_sh, MeshPlan(mesh)).compile()
        got = f(sp, x_small, xh, o_sh)
    finally:
        tiling._itemsize.cache_clear()
    hlo = f.as_text()
    assert hlo.count("conditional(") >= 8  # the tiles are there
    # nothing moves but the tiles' 4-byte predicates (`tiling._always_true` reads one element)
    assert all(op == "all-reduce" and re.fullmatch(r"f32\[[1,]*\]\S*", t) for t, op in _collectives(hlo)), \
        _collectives(hlo)
    for g, r in zip(got, ref):
        assert g.sharding.spec[-1] == "tp"  # the output follows the rows' split
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # two more compiles of tiny's attention layers (~15 s alone)
def test_aot_flash_attention_cost_dp(cpu8, tmp_path):
    """`aot_flash.py --dp 2 --attention-cost` (tiny): the attention sublayers alone compiled on the dp mesh
    and on ep over the same 2 devices; per device the dp program does half the rows' work (transcendentals:
    exactly half; FLOPs and bytes: under ep's, at least half, the weights being read whatever the rows)."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "aot_flash.py")
    spec = importlib.util.spec_from_file_location("aot_flash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "att.json"
    assert mod.main(["--config", "tiny", "--dp", "2", "--batch", "4", "--context", "32", "--page-size", "16",
                     "--memory-only", "--attention-cost", "--out", str(out)]) == 0
    att = json.loads(out.read_text())["attention_cost"]
    assert att["layers"] == 10 and att["dp"]["flops"] > 0
    assert att["ratio"]["transcendentals"] == 0.5
    assert 0.5 <= att["ratio"]["flops"] < 1 and 0.5 <= att["ratio"]["bytes accessed"] < 1
    assert att["dp"]["weight_bytes"] == att["ep"]["weight_bytes"] > 0  # replicated in both (tp=1)
