"""Data-parallel attention on the 8 host CPU devices (`cpu8`): the step on a ("dp", "tp") mesh —
each rank's program on its own rows and state blocks, global ids translated inside it, the MoE
dispatched to the experts on all devices (`parallel.dp`, `parallel.moe_dispatch`) — equals the
one-device run of the same global-id schedule: BITWISE (logits of every row and every cache array, each
slot row and pool page) in the deterministic mode for dp=8 and dp=4 x tp=2 and in the exact mode for
dp=4 x tp=2; the DSpark seeding steps and a block proposal bitwise. The schedule: 5 requests with ragged
prompt lengths on batch rows that leave some ranks with only padding rows, prefill chunks then decode steps,
all in one [B, T] step shape (one compile per mesh and mode; the exact-mode case is in the ``-m slow``
tier). Plus: the mesh refusals, the rules' dp shardings and per-device state bytes / D, and the host-side
rank checks of `decode.pack_rows`.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import configs

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import dspark
from dsv41_jax.model.params import init_params
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import MeshError, make_mesh
from dsv41_jax.parallel.plan import MeshPlan

SEED = 46
B, CHUNK = 8, 4
MAX_SLOTS, NUM_PAGES, PAGE = 8, 24, 8
# (batch row, prompt length): rows 2, 3, 6 are padding (dp=8: ranks 2, 3, 6 have no work; dp=4: rank 1)
REQUESTS = ((0, 7), (1, 3), (4, 9), (5, 5), (7, 6))
DECODE_STEPS = 2
MESHES = {"dp8": (8, 1), "dp4xtp2": (4, 2)}


def _ccfg(dp):
    return kvc.CacheConfig(page_size=PAGE, num_pages=NUM_PAGES, max_slots=MAX_SLOTS, max_pages_per_seq=2,
                           retrieval_block=4, dp=dp)


@pytest.fixture(scope="module")
def cfg():
    return configs.mesh_micro()  # 8 routed and 8 draft experts: one per device on 8 devices


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.key(0))


def _mode_cfg(cfg, mode):
    """"exact": fp32 activations, fp64 sums; "deterministic": the bf16 flow, batch-independent bit for bit;
    "exact+deterministic": both (fp32 activations, the deterministic mode's fp64 sums and exps)."""
    return {"exact": cfg.replace(act_dtype="exact"), "deterministic": cfg.replace(deterministic=True),
            "exact+deterministic": cfg.replace(act_dtype="exact", deterministic=True)}[mode]


def _schedule(ccfg):
    """The step batches (numpy, `pack_rows`) of `REQUESTS` on the rank-major layout of `ccfg`: request j at
    row b lives on rank b // (B / dp) in that rank's next slot and next two pages (global ids)."""
    per = B // ccfg.dp
    toks = np.random.default_rng(SEED).integers(3, 300, (B, 16)).astype(np.int32)
    used: dict = {}
    reqs = []
    for b, L in REQUESTS:
        r = b // per
        k = used.get(r, 0)
        used[r] = k + 1
        pages = list(kvc.rank_pages(ccfg, r))[1 + 2 * k: 3 + 2 * k]
        reqs.append({"row": b, "len": L, "slot": kvc.rank_slots(ccfg, r)[k], "pages": pages})
    pos = {q["row"]: 0 for q in reqs}
    out = []
    while any(pos[q["row"]] < q["len"] + DECODE_STEPS for q in reqs):
        rows = [None] * B
        for q in reqs:
            b, p = q["row"], pos[q["row"]]
            n = min(CHUNK, q["len"] - p) if p < q["len"] else (1 if p < q["len"] + DECODE_STEPS else 0)
            if n:
                rows[b] = {"tokens": toks[b, p: p + n].tolist(), "start": p, "slot": q["slot"],
                           "page_table": q["pages"][: -(-(p + n) // PAGE)]}
            pos[b] = p + n
        # a row without work: its rank's padding (pack_rows pads only past the end, so spell it out)
        rows = [r if r is not None else {"tokens": [], "start": 0, "slot": kvc.scratch_slot(ccfg, i // per),
                                         "page_table": []} for i, r in enumerate(rows)]
        out.append(dec.pack_rows(rows, CHUNK, B, ccfg))
    return out


def _fresh_state(cfg, ccfg, params, mesh):
    state = kvc.init_cache(cfg, ccfg) if mesh is None else rules.init_cache(cfg, ccfg, mesh)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    state = kvc.reset_slots(state, np.arange(kvc.slot_rows(ccfg)), pad)
    if mesh is not None:
        state = jax.device_put(state, rules.cache_shardings(cfg, ccfg, mesh))
    return state


_RUNS: dict = {}


def _run(cfg, params, ccfg, mesh):
    """(logits per step, final cache as numpy) of the schedule; mesh None = one device. Memoized."""
    key = (cfg, ccfg, None if mesh is None else tuple(mesh.shape.items()))
    if key not in _RUNS:
        p = params if mesh is None else rules.shard_params(params, cfg, mesh)
        step = dec.jitted_extend(cfg, ccfg, all_logits=True, par=MeshPlan.of(mesh))
        state = _fresh_state(cfg, ccfg, params, mesh)
        logits = []
        for bt in _schedule(ccfg):
            lg, state = step(p, state, bt)
            logits.append(np.asarray(lg))
        _RUNS[key] = (logits, jax.tree_util.tree_map(np.asarray, state), state)
    return _RUNS[key]


@pytest.mark.parametrize("layout,mode", [("dp8", "deterministic"), ("dp4xtp2", "deterministic"),
                                         # two more compiles (~55 s on the 2-core VM): the slow tier
                                         pytest.param("dp4xtp2", "exact", marks=pytest.mark.slow)])
def test_dp_step_equals_one_device(cpu8, cfg, params, layout, mode):
    dp, tp = MESHES[layout]
    c = _mode_cfg(cfg, mode)
    ccfg = _ccfg(dp)
    mesh = make_mesh(tp=tp, dp=dp, cfg=c)
    ref_logits, ref_state, _ = _run(c, params, ccfg, None)
    logits, state, placed = _run(c, params, ccfg, mesh)
    assert len(logits) == len(ref_logits) >= 4
    # (the exact mode's logits parted by <= 4.8e-7 until the Engram gate's rsqrts ran in fp64: `numerics.rsqrt_f32`)
    for i, (x, y) in enumerate(zip(logits, ref_logits)):
        np.testing.assert_array_equal(x, y, err_msg=f"logits: step {i}")
    flat_ref = jax.tree_util.tree_flatten_with_path(ref_state)[0]
    flat = jax.tree_util.tree_leaves(state)
    for (path, want), got in zip(flat_ref, flat):
        np.testing.assert_array_equal(got, want, err_msg=f"cache {jax.tree_util.keystr(path)}")
    # the state stayed split over dp: every array's leading (slot / page) axis, rank r's block on mesh row r
    for leaf in jax.tree_util.tree_leaves(placed):
        assert leaf.sharding.spec[0] == "dp", leaf.sharding
    # the real rows' logits are not all zero (the schedule does run the model)
    assert np.abs(ref_logits[0][0]).max() > 0


def _per_device_state_bytes(cfg, ccfg, mesh) -> dict:
    """{device: bytes} of the cache arrays of `ccfg` as `rules.cache_shardings` places them on `mesh`."""
    shapes = jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))
    placed = jax.tree_util.tree_map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), shapes,
                                    rules.cache_shardings(cfg, ccfg, mesh))
    return rules.param_bytes_per_device(placed)


def test_dp_state_bytes_fall_by_dp(cpu8, cfg):
    """Per-device bytes of the KV / state arrays (from their shardings): 1/D of the global arrays on a dp
    mesh, where a tp x ep mesh of the same 8 devices holds all of them on every device."""
    today = _per_device_state_bytes(cfg, _ccfg(1), make_mesh(tp=2, ep=4, cfg=cfg))
    assert len(set(today.values())) == 1
    for dp, tp in MESHES.values():
        ccfg = _ccfg(dp)
        total = sum(int(np.prod(s.shape)) * s.dtype.itemsize
                    for s in jax.tree_util.tree_leaves(jax.eval_shape(lambda: kvc.init_cache(cfg, ccfg))))
        per_dev = _per_device_state_bytes(cfg, ccfg, make_mesh(tp=tp, dp=dp, cfg=cfg))
        assert len(per_dev) == 8 and set(per_dev.values()) == {total // dp}
        # the same pools and slots as today's, plus one scratch row per rank instead of one: a D-fold drop but for those
        assert total // dp * dp <= max(today.values()) * (MAX_SLOTS + dp) / (MAX_SLOTS + 1)
        assert total // dp < max(today.values()) / (dp / 2)


def test_dp_mesh_and_rules(cpu8, cfg):
    m = make_mesh(tp=2, dp=4, cfg=cfg)
    assert m.axis_names == ("dp", "tp") and dict(m.shape) == {"dp": 4, "tp": 2}
    assert make_mesh(tp=2, ep=8, dp=4, cfg=cfg).axis_names == ("dp", "tp")  # ep = dp x tp: the same, said explicitly
    with pytest.raises(MeshError, match="ep=2 with dp=4"):
        make_mesh(tp=2, ep=2, dp=4, cfg=cfg)
    with pytest.raises(MeshError, match="needs 16 devices"):
        make_mesh(tp=2, dp=8, cfg=cfg.replace(n_routed_experts=16, dspark_n_routed_experts=16))
    with pytest.raises(MeshError, match="dp=4 x tp=2: n_routed_experts=12 is not divisible by 8"):
        make_mesh(tp=2, dp=4, cfg=cfg.replace(n_routed_experts=12))
    with pytest.raises(MeshError, match="more expert shards than experts"):
        make_mesh(tp=1, dp=8, cfg=cfg.replace(dspark_n_routed_experts=4))
    ab = rules.param_shapes(cfg, m)
    lay = ab["layers"][2]
    assert lay["ffn"]["experts"]["w1"].weight.sharding.spec == P(("dp", "tp"), None, None)
    assert lay["ffn"]["gate"]["weight"].sharding.spec == P(None, None)  # every rank routes its own tokens
    assert lay["attn"]["wq_b"].weight.sharding.spec == P("tp", None)
    assert ab["layers"][1]["engram"]["embed"]["weight"].sharding.spec == P(("dp", "tp"), None)
    (_, cs, bs), (lg, _) = rules.step_shardings(cfg, _ccfg(4), m)
    assert cs["window"]["q"].spec[0] == "dp" and cs["comp"]["1"]["q"].spec[0] == "dp"
    assert bs["slot"].spec == P("dp") and bs["page_table"].spec == P("dp", None) and lg.spec == P("dp", None)
    with pytest.raises(ValueError, match="moe-a2a-backend none"):
        MeshPlan(m, "none")
    assert MeshPlan.of(m).moe_a2a_backend == "all_to_all"
    with pytest.raises(ValueError, match="laid out for dp=1 ranks, the mesh has dp=4"):
        dec.jitted_extend(cfg, _ccfg(1), par=MeshPlan.of(m))
    with pytest.raises(NotImplementedError, match="host Engram tables"):
        dec.jitted_extend(cfg, _ccfg(4), par=MeshPlan.of(m), engram_host_table=True)


def test_pack_rows_rank_blocks():
    ccfg = _ccfg(4)  # 2 slots + scratch and 6 pages per rank
    bt = dec.pack_rows([{"tokens": [5], "start": 0, "slot": 0, "page_table": [1]}], 1, 8, ccfg)
    assert bt["slot"].tolist() == [0, 2, 5, 5, 8, 8, 11, 11]  # padding: each rank's scratch row
    assert bt["page_table"][:, 0].tolist() == [1, 0, 6, 6, 12, 12, 18, 18]  # ... and null page
    with pytest.raises(ValueError, match="outside rank 1's slots 3..4"):
        dec.pack_rows([{"tokens": [], "start": 0, "slot": 2, "page_table": []}] * 2
                      + [{"tokens": [5], "start": 0, "slot": 1, "page_table": [7]}], 1, 8, ccfg)
    with pytest.raises(ValueError, match="leaves rank 0's pages 0..5"):
        dec.pack_rows([{"tokens": [5], "start": 0, "slot": 0, "page_table": [6]}], 1, 8, ccfg)
    with pytest.raises(ValueError, match="does not split into dp=4"):
        dec.pack_rows([], 1, 6, ccfg)
    one = dec.pack_rows([{"tokens": [5], "start": 0, "slot": 0, "page_table": [1]}], 1, 2, _ccfg(1))
    assert one["slot"].tolist() == [0, MAX_SLOTS] and one["page_table"][1].tolist() == [0, 0]  # dp=1: today


def _dspark_run(cfg, params, ccfg, mesh):
    """The schedule through `dspark.extend_seeding` (target cache + draft rings), then one `dspark.propose` at
    every row's next position; both as one program per dp rank on `mesh` (`MeshPlan.rank_step`)."""
    par = MeshPlan.of(mesh)
    state = dspark.with_rings(_fresh_state(cfg, ccfg, params, mesh), cfg, ccfg)
    p = params
    if mesh is not None:
        state = rules.place_state(state, mesh)
        p = rules.shard_params(params, cfg, mesh)

    def propose(params, state, batch, ccfg, par):
        return dspark.propose(params, state["dspark"], batch["anchor"], batch["start"], batch["slot"], cfg, ccfg,
                              par=par)

    def wrap(fn):
        return jax.jit(par.rank_step(fn, cfg, ccfg) if par else functools.partial(fn, ccfg=ccfg, par=None))

    seed = wrap(functools.partial(dspark.extend_seeding, cfg=cfg))
    logits = []
    sched = _schedule(ccfg)
    for bt in sched:
        lg, state = seed(p, state, bt)
        logits.append(np.asarray(lg))
    last = sched[-1]
    pb = {"anchor": np.full((B,), 7, np.int32), "start": last["start"] + last["n_new"], "slot": last["slot"]}
    prop = wrap(propose)(p, state, pb)
    return logits, jax.tree_util.tree_map(np.asarray, state), jax.tree_util.tree_map(np.asarray, prop)


def test_dp_dspark_equals_one_device(cpu8, cfg, params):
    """DSpark on dp=4 x tp=2 (deterministic mode): the seeding steps (target cache and draft rings) and a
    block proposal (tokens, q, logits, confidence) equal one device bitwise."""
    c = _mode_cfg(cfg, "deterministic")
    ccfg = _ccfg(4)
    want = _dspark_run(c, params, ccfg, None)
    got = _dspark_run(c, params, ccfg, make_mesh(tp=2, dp=4, cfg=c))
    for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))
    assert want[2]["tokens"].shape == (B, c.dspark_block_size)
