"""Redundant experts on the model (issue 46 item 7): with an `eplb.ExpertLocation` in the mesh plan the routed
experts are stored as E + R physical experts and each assignment visits one copy of its expert, and the results
are the SAME BITS as without copies (deterministic mode and --dtype exact), for the dispatch backend
(all_to_all) and the psum backend (none); a replicated expert's rows are spread over its copies (counted by the
dispatch itself); the refusals.

8 fake CPU devices; tiny shapes (the tiny config's layer-3 experts for the dispatch, `eplb_cfg` for the decode
step), each test one token count so its cases share one compiled program.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import configs
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import layer_scan, moe
from dsv41_jax.model.config import _engram_rows
from dsv41_jax.model.params import init_params
from dsv41_jax.parallel import eplb, rules
from dsv41_jax.parallel import moe_dispatch as md
from dsv41_jax.parallel.collectives import routed_experts
from dsv41_jax.parallel.mesh import make_mesh
from dsv41_jax.parallel.plan import MeshPlan

SEED = 46
N = 16
HOT = (1, 6)  # the skewed distribution's hot experts


def _skewed(E, L):
    load = np.full(E, 10, np.int64)
    load[list(HOT)] = (400, 200)
    return {lid: load.copy() for lid in range(L)}


def _check(got, want, what):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=what)


@pytest.fixture(scope="module")
def ex(tiny_params):
    return tiny_params["layers"][3]["ffn"]["experts"]


def _phys(ex, loc, lid=0):
    ids = jnp.asarray(loc.physical_ids(lid))
    return jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=0), ex)


def _tables(loc, lid=0):
    slot, copies = loc.tables()
    return jnp.asarray(slot[lid]), jnp.asarray(copies[lid])


@pytest.mark.parametrize("mode", ["exact", "deterministic"])
def test_dispatch_with_copies_equals_one_device(cpu8, tiny_cfg, ex, mode):
    """dp8, E = 8 + R = 8 copies (2 physical experts per device): bitwise the one-device grouped path, and the
    dispatch's received-row counts show the hot experts' rows spread (max/mean down)."""
    cfg, dt = (tiny_cfg.replace(act_dtype="exact"), jnp.float32) if mode == "exact" else \
        (tiny_cfg.replace(deterministic=True), jnp.bfloat16)
    mesh = Mesh(np.array(cpu8), ("dp",))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    loc = eplb.ExpertLocation.from_distribution(_skewed(E, 1), 8, 8, 1)
    assert all(loc.layers[0][1].copies[e] > 1 for e in HOT)
    f = jax.jit(lambda e, x, i, w, t: md.routed_experts_dispatch(e, x, i, w, cfg, dt, mesh, token_axes="dp",
                                                                 expert_axes="dp", location=t, return_load=True))
    g = jax.jit(lambda e, x, i, w: md.routed_experts_dispatch(e, x, i, w, cfg, dt, mesh, token_axes="dp",
                                                              expert_axes="dp", return_load=True))
    ref = jax.jit(lambda e, x, i, w: moe._routed_grouped(e, x, i, w, cfg, dt))
    rng = np.random.default_rng(SEED)
    x = jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), dt)
    w = rng.uniform(0.1, 1.0, (N, k)).astype(np.float32)
    rand = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    hot = np.tile(np.array(HOT, np.int32), (N, 1))  # every token on the two hot experts
    for case, idx in (("random", rand), ("hot", hot)):
        want = ref(ex, x, idx, w)
        got, load = f(_phys(ex, loc), x, idx, w, _tables(loc))
        _check(got, want, f"{mode} {case}")
        base, load0 = g(ex, x, idx, w)
        _check(base, want, f"{mode} {case} (no copies)")
        assert int(load.sum()) == int(load0.sum()) == N * k
        if case == "hot":  # without copies two devices take every row; with them, the copies' devices share them
            assert sorted(np.asarray(load0).tolist())[-2:] == [N, N]
            pl = loc.layers[0][1]
            owners = set(pl.owners(HOT[0])) | set(pl.owners(HOT[1]))
            assert set(np.flatnonzero(np.asarray(load)).tolist()) == owners  # every copy's device takes rows
            assert np.asarray(load).max() <= N * 2 // 3  # 9 of 32 rows here, where one device took 16


def test_psum_backend_with_copies(cpu8, tiny_cfg, ex):
    """The plain ep mesh's psum path (`collectives.routed_experts`): ep 4, R = 4 (3 physical per device)."""
    cfg, dt = tiny_cfg.replace(act_dtype="exact"), jnp.float32
    mesh = Mesh(np.array(cpu8[:4]), ("ep",))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    loc = eplb.ExpertLocation.from_distribution(_skewed(E, 1), 4, 4, 1)
    rng = np.random.default_rng(SEED + 1)
    x = jnp.asarray(rng.standard_normal((N, cfg.hidden_size)), dt)
    w = rng.uniform(0.1, 1.0, (N, k)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    want = jax.jit(lambda e, x, i, w: moe._routed_grouped(e, x, i, w, cfg, dt))(ex, x, idx, w)
    got = jax.jit(lambda e, x, i, w, t: routed_experts(e, x, i, w, cfg, dt, mesh, location=t))(
        _phys(ex, loc), x, idx, w, _tables(loc))
    _check(got, want, "psum with copies")


# ------------------------------------------------------------------------------------------ the decode step

B, T = 2, 4
CCFG = kvc.CacheConfig(page_size=8, num_pages=8, max_slots=2, max_pages_per_seq=2, retrieval_block=4)


def eplb_cfg():
    """`configs.mesh_micro`'s MoE (8 routed, 8 draft experts) on window-only attention: layer 0 with Engram (a
    run of one) and layers 1-2 one layer-scan run, so the step has an unscanned layer and a scanned run whose
    layers place their experts differently. What these tests are about is the MoE: the ratio-2 / ratio-1
    attention layers micro adds only lengthen each compile (the three decode-step cells: 85 -> 67 s in one process)."""
    return configs.mesh_micro().replace(
        compress_ratios=(0, 0, 0, 0), kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=None, engram_layer_ids=(0,), engram_num_embeddings=tuple(_engram_rows((0,), 4, 2, 50)),
        name="eplb_window")


@pytest.fixture(scope="module")
def micro():
    cfg = eplb_cfg().replace(deterministic=True)
    assert layer_scan.layer_runs(cfg) == ((0, 1), (1, 2))  # an unscanned layer and a scanned run
    return cfg, init_params(cfg, jax.random.key(0))


def _steps(cfg, params, plan):
    """Logits of a 6-token prefill (two chunks) + 2 decode steps of 2 rows on `plan`'s mesh (numpy)."""
    mesh = plan.mesh
    p = layer_scan.stack_layers(rules.shard_params(params, cfg, mesh), cfg)  # the run's layers on one stack
    if plan.expert_location is not None:
        p = eplb.expand_params(p, plan.expert_location)
    step = dec.jitted_extend(cfg, CCFG, all_logits=True, par=plan)
    state = kvc.init_cache(cfg, CCFG)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    state = jax.device_put(kvc.reset_slots(state, np.arange(kvc.slot_rows(CCFG)), pad),
                           rules.cache_shardings(cfg, CCFG, mesh))
    toks = np.random.default_rng(SEED).integers(3, 300, (B, 8)).astype(np.int32)
    out = []
    for start, n in ((0, 4), (4, 2), (6, 1), (7, 1)):
        rows = [{"tokens": toks[b, start:start + n].tolist(), "start": start, "slot": b, "page_table": [1 + b]}
                for b in range(B)]
        lg, state = step(p, state, dec.pack_rows(rows, T, B, CCFG))
        out.append(np.asarray(lg))
    return out


@pytest.mark.parametrize("backend,ep,R,mode", [("all_to_all", 8, 8, "deterministic"), ("none", 4, 4, "deterministic"),
                                               ("all_to_all", 4, 4, "exact")])
def test_decode_step_with_copies_equals_without(cpu8, micro, backend, ep, R, mode):
    """The decode step (layer-scanned runs included: the placement is per layer) with R copies on an ep mesh
    equals R = 0 on the same mesh bit for bit (deterministic mode; --dtype exact)."""
    cfg, params = micro
    if mode == "exact":
        cfg = cfg.replace(act_dtype="exact", deterministic=False)
    mesh = make_mesh(ep=ep, cfg=cfg)
    L = cfg.num_hidden_layers
    rng = np.random.default_rng(SEED)
    dist = {lid: rng.zipf(1.5, cfg.n_routed_experts).astype(np.int64) for lid in range(L)}
    loc = eplb.ExpertLocation.from_distribution(dist, ep, R, L)
    assert len({loc.placement(i) for i in range(L)}) > 1  # the layers' placements differ
    want = _steps(cfg, params, MeshPlan(mesh, backend))
    got = _steps(cfg, params, MeshPlan(mesh, backend, expert_location=loc))
    for i, (a, b) in enumerate(zip(got, want)):
        _check(a, b, f"{backend} step {i}")
    assert np.abs(want[0]).max() > 0


def test_plan_refusals(cpu8, micro):
    cfg, _ = micro
    E, L = cfg.n_routed_experts, cfg.num_hidden_layers
    loc4 = eplb.ExpertLocation.uniform(E, 4, 4, L)
    with pytest.raises(ValueError, match="no expert parallelism"):
        MeshPlan(make_mesh(tp=4, cfg=cfg), expert_location=loc4)
    with pytest.raises(ValueError, match="placement is for 4 devices, the experts are split over 8"):
        MeshPlan(make_mesh(ep=8, cfg=cfg), "all_to_all", expert_location=loc4)
    with pytest.raises(ValueError, match="do not divide evenly over 4 devices"):
        eplb.ExpertLocation.uniform(E, 4, 3, L)
    with pytest.raises(ValueError, match="more copies than"):
        eplb.ExpertLocation.uniform(E, 2, 10, L)
    with pytest.raises(ValueError, match="the model has MoE layers"):
        eplb.ExpertLocation.from_distribution({0: np.ones(E)}, 4, 4, L)


# ------------------------------------------------------------------------------------------ flags


def test_engine_flags_refuse_impossible(tmp_path):
    """--ep-num-redundant-experts / --init-expert-location / --expert-distribution-recorder: impossible
    combinations refused in one line (what needs the model and the mesh: tests/test_eplb_serving.py)."""
    from dsv41_jax.serving.engine_args import EngineArgs

    f = tmp_path / "d.json"
    eplb.save_distribution(str(f), {0: np.arange(8)})
    for kw, msg in (({"ep_num_redundant_experts": -1}, "integer >= 0"),
                    ({"ep_num_redundant_experts": 4}, "need expert parallelism"),
                    ({"ep_num_redundant_experts": 4, "ep_size": 4}, "need --init-expert-location"),
                    ({"init_expert_location": str(f), "ep_size": 4}, "no effect without"),
                    ({"ep_num_redundant_experts": 4, "ep_size": 4, "init_expert_location": str(tmp_path / "x")},
                     "is not a file")):
        with pytest.raises(ValueError, match=msg):
            EngineArgs(model="tiny", **kw)
    assert EngineArgs(model="tiny").ep_num_redundant_experts == 0
    assert EngineArgs(model="tiny", ep_size=4, ep_num_redundant_experts=4, init_expert_location=str(f),
                      expert_distribution_recorder=True).expert_distribution_recorder
    import argparse

    ns = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "tiny", "--ep-num-redundant-experts", "8",
                                               "--init-expert-location", str(f), "--expert-distribution-recorder"])
    assert (ns.ep_num_redundant_experts, ns.init_expert_location, ns.expert_distribution_recorder) == (8, str(f), True)
