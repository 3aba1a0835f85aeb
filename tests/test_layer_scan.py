"""Runs of plan-identical layers as one lax.scan (issue 10 item 5): scanned ≡ unrolled.

tiny has no run of >= 2 plan-identical layers (every layer is a source, an Engram layer or a consumer
of a different source), so the equivalence tests use `tiny_runs_cfg`: tiny's sizes over 5 layers
with a window-only run (layers 0-1) and a run of compressed consumers (3-4, reading source 2's pool
and top-k), with DSpark reading the scanned layers' inputs (targets 2, 3, 4). (It had two more
layers, a ratio-1 candidate source and its consumer, outside any run: they cost compile time and
were not what the scan changes.) In the exact numerics
mode (fp32 activations, fp64-accumulated matmuls) the scan computes the same operations as the
unrolled loop, and the tests require *bitwise* equal logits, layer inputs and cache, and identical
top-k / candidate / expert decisions. Cost: 4 compiles of the 5-layer model (forward and one [2, T]
cached step, scanned and unrolled).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, forward, init_params, layer_scan
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model.config import _engram_rows
from dsv41_jax.model.params import declare_params, param_shapes

CCFG = kvc.CacheConfig(page_size=8, num_pages=12, max_slots=2, max_pages_per_seq=4)
T = 12  # > window (8), several ratio-2 groups, > index_topk (4)


def tiny_runs_cfg(**kw) -> ModelConfig:
    """Runs (0-1) and (3-4); layer 2 is the KV + index source, with Engram; one DSpark stage."""
    t = ModelConfig.preset("tiny")
    return t.replace(num_hidden_layers=5, compress_ratios=(0, 0, 2, 2, 2, 0), kv_source_layer_ids=(2,),
                     index_source_layer_ids=(2,), candidate_source_layer_id=None, engram_layer_ids=(2,),
                     engram_num_embeddings=tuple(_engram_rows((2,), 4, 2, 50)), num_nextn_predict_layers=1,
                     dspark_target_layer_ids=(2, 3, 4), name="tiny_runs", **kw)


@pytest.fixture(scope="module")
def cfgs():
    on = tiny_runs_cfg(act_dtype="exact")
    return on, on.replace(layer_scan=False)


@pytest.fixture(scope="module")
def params(cfgs):
    return init_params(cfgs[0], jax.random.key(3))


def test_runs(cfgs):
    """Which layers form runs: flash's 18 bodies for 40 layers (docs/design/layer_scan.md), none in tiny, and
    the switch turns them off."""
    assert all(n == 1 for _, n in layer_scan.layer_runs(ModelConfig.preset("tiny")))
    flash = ModelConfig.preset("flash")
    assert layer_scan.layer_runs(flash) == ((0, 1), (1, 1), (2, 1), (3, 5), (8, 1), (9, 5), (14, 1), (15, 5),
                                           (20, 1), (21, 3), (24, 1), (25, 3), (28, 1), (29, 3), (32, 1),
                                           (33, 3), (36, 1), (37, 3))
    on, off = cfgs
    assert layer_scan.layer_runs(on) == ((0, 2), (2, 1), (3, 2))
    assert layer_scan.layer_runs(off) == tuple((i, 1) for i in range(5))
    assert layer_scan.has_runs(on) and not layer_scan.has_runs(off)
    with pytest.raises(ValueError, match="layer_scan"):
        ModelConfig.preset("tiny").replace(layer_scan="yes")


def test_stacked_layout_round_trip(cfgs, params):
    """stack_layers / unstack_layers are exact inverses, and the same function stacks declarations and
    abstract shapes consistently with the arrays (what the abstract bench and the mesh shardings use)."""
    on, _ = cfgs
    st = layer_scan.stack_layers(params, on)
    assert st["layers"][0] is None and st["layers"][4] is None and st["layers"][2] is not None
    assert sorted(st["layer_stacks"]) == ["0", "3"]
    w = st["layer_stacks"]["3"]["attn"]["wq_b"].weight
    assert w.shape == (2,) + params["layers"][3]["attn"]["wq_b"].weight.shape
    back = layer_scan.unstack_layers(st, on)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for i in (2, 4):  # either layout answers per-layer reads (4: the second row of a stack)
        np.testing.assert_array_equal(np.asarray(layer_scan.layer_params(st, i, on)["ffn_norm"]["weight"]),
                                      np.asarray(params["layers"][i]["ffn_norm"]["weight"]))
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), layer_scan.stack_layers(param_shapes(on), on))
    assert shapes == jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), st)
    decl = layer_scan.stack_layers(declare_params(on), on)
    assert decl["layer_stacks"]["0"]["attn"]["wq_b"].weight.axes == (None, "heads", "q_lora")


def _scan_lengths(jaxpr) -> list:
    """Lengths of the top-level scans that iterate over stacked inputs (a run of layers scans its
    stacked weights). A fori_loop (Sinkhorn's, on backends where the "xla" mhc path keeps the loop)
    also traces to a scan, but one without scanned inputs: left out."""
    return [int(e.params["length"]) for e in jaxpr.eqns if e.primitive.name == "scan" and _n_scanned(e) > 0]


def _n_scanned(eqn) -> int:
    """How many inputs a scan equation iterates over (its xs)."""
    p = eqn.params
    if "num_consts" in p:  # JAX 0.10: flat invars = consts + carry + xs
        return len(eqn.invars) - p["num_consts"] - p["num_carry"]
    _, _, xs = p["ft_in"].update(eqn.invars).unpack()  # JAX 0.12: a (consts, carry, xs) tree
    return len(xs)


def test_forward_scan_equals_unrolled(cfgs, params):
    """Full forward in the exact mode: scanned (canonical params, stacked under jit) ≡ unrolled, bitwise
    logits / layer inputs / hidden state, identical top-k, candidate and expert choices; the scanned
    trace holds the two runs as two scans of length 2."""
    on, off = cfgs
    tokens = jax.random.randint(jax.random.key(5), (2, T), 3, 300, dtype=jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "return_aux"))
    lg_s, aux_s = fwd(params, tokens, on, return_aux=True)
    lg_u, aux_u = fwd(params, tokens, off, return_aux=True)
    np.testing.assert_array_equal(np.asarray(lg_s), np.asarray(lg_u))
    for key in ("topk", "cand", "experts", "layer_inputs"):
        assert sorted(aux_s[key]) == sorted(aux_u[key]), key
        for lid in aux_u[key]:
            np.testing.assert_array_equal(np.asarray(aux_s[key][lid]), np.asarray(aux_u[key][lid]), err_msg=f"{key} {lid}")
    np.testing.assert_array_equal(np.asarray(aux_s["hidden"]), np.asarray(aux_u["hidden"]))
    # the traces the calls above compiled (jit's trace cache: no new trace)
    assert _scan_lengths(fwd.trace(params, tokens, on, return_aux=True).jaxpr.jaxpr) == [2, 2]
    assert _scan_lengths(fwd.trace(params, tokens, off, return_aux=True).jaxpr.jaxpr) == []


def _fresh(cfg, params, mesh=None):
    if mesh is None:
        st = kvc.init_cache(cfg, CCFG)
    else:
        from dsv41_jax.parallel import rules

        st = rules.init_cache(cfg, CCFG, mesh)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    st = kvc.reset_slots(st, np.arange(CCFG.max_slots + 1), pad)
    if mesh is not None:
        st = jax.device_put(st, rules.cache_shardings(cfg, CCFG, mesh))
    return st


def _batches():
    """A ragged two-row prefill chunk, then one decode token per row, both in one [2, T] step (one compile)."""
    toks = np.asarray(jax.random.randint(jax.random.key(7), (2, T), 3, 300), np.int32)
    pts = [[0, 1], [2, 3]]
    chunk = dec.make_batch([{"tokens": toks[0, :10], "start": 0, "slot": 0, "page_table": pts[0]},
                            {"tokens": toks[1, :7], "start": 0, "slot": 1, "page_table": pts[1]}], T, 2, CCFG)
    step1 = dec.make_batch([{"tokens": toks[0, 10:11], "start": 10, "slot": 0, "page_table": pts[0]},
                            {"tokens": toks[1, 7:8], "start": 7, "slot": 1, "page_table": pts[1]}], T, 2, CCFG)
    return chunk, step1


def _run_extend(p, cfg, params, mesh=None):
    """[(logits, aux) per batch], final cache."""
    if mesh is None:
        f = jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, CCFG, all_logits=True, return_aux=True))
    else:
        from dsv41_jax.parallel import rules
        from dsv41_jax.parallel.plan import MeshPlan

        (ps, cs, bs), (lg, cs_out) = rules.step_shardings(cfg, CCFG, mesh, all_logits=True)
        par = MeshPlan.of(mesh)
        f = jax.jit(lambda p, s, b: dec.extend(p, s, b, cfg, CCFG, all_logits=True, return_aux=True, par=par),
                    in_shardings=(ps, cs, bs), out_shardings=(lg, cs_out, None))
    st = _fresh(cfg, params, mesh)
    outs = []
    for b in _batches():
        lg, st, aux = f(p, st, b)
        outs.append((np.asarray(lg), jax.device_get({k: aux[k] for k in ("topk", "experts", "layer_inputs")})))
    return outs, st


@pytest.fixture(scope="module")
def unrolled_extend(cfgs, params):
    return _run_extend(params, cfgs[1], params)


def _same_steps(got, ref, logit_atol=None):
    (o_s, st_s), (o_u, st_u) = got, ref
    for (lg_s, a_s), (lg_u, a_u) in zip(o_s, o_u):
        if logit_atol is None:
            np.testing.assert_array_equal(lg_s, lg_u)
        else:
            np.testing.assert_allclose(lg_s, lg_u, rtol=0, atol=logit_atol)
        for key in ("topk", "experts") + (("layer_inputs",) if logit_atol is None else ()):
            assert sorted(a_s[key]) == sorted(a_u[key]), key
            for lid in a_u[key]:
                np.testing.assert_array_equal(a_s[key][lid], a_u[key][lid], err_msg=f"{key} {lid}")
    assert jax.tree_util.tree_structure(st_s) == jax.tree_util.tree_structure(st_u)
    for a, b in zip(jax.tree_util.tree_leaves(st_s), jax.tree_util.tree_leaves(st_u)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_extend_scan_equals_unrolled(cfgs, params, unrolled_extend):
    """The cached step, scanned with load-time stacked params ≡ unrolled with canonical params: a ragged
    two-row prefill chunk and then one decode token per row (same [2, T] step); bitwise logits, layer
    inputs and every cache leaf (window rings written through the scan's stacked outputs), identical
    top-k and expert choices."""
    on, _ = cfgs
    stacked = layer_scan.prepare(params, on)
    assert layer_scan.is_stacked(stacked)
    _same_steps(_run_extend(stacked, on, params), unrolled_extend)


@pytest.mark.slow  # ~25 CPU-s: a third compile; scan and mesh are each covered in the default tier
def test_extend_scan_on_mesh(cfgs, params, unrolled_extend, cpu8):
    """The mesh path as the engine runs it: params sharded by the rules, then stacked (each layer's split
    kept, the layer axis replicated; the routed experts stay split over ep inside the scan), the step
    jitted with `rules.step_shardings` (tp 2 x ep 2). Same decisions and cache codes as the unrolled
    unsharded step; logits within test_sharding's tolerance (the tp all-reduce sums in another order)."""
    from jax.sharding import PartitionSpec as PS

    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh

    on, _ = cfgs
    mesh = make_mesh(2, 2, cfg=on, devices=cpu8[:4])
    sp = layer_scan.prepare(rules.shard_params(params, on, mesh), on)
    w1 = sp["layer_stacks"]["3"]["ffn"]["experts"]["w1"].weight
    assert w1.sharding.spec == PS(None, "ep", None, None)
    want = rules.step_shardings(on, CCFG, mesh)[0][0]
    assert want["layer_stacks"]["3"]["ffn"]["experts"]["w1"].weight.spec == w1.sharding.spec
    _same_steps(_run_extend(sp, on, params, mesh), unrolled_extend, logit_atol=1e-4)


def test_kernels_scanned_equal_unrolled(cfgs, params):
    """With the linear and mHC kernels (interpret mode, fp32 flow) a scanned run hands the kernels the run's
    stacks plus the layer (the weights `plan.StepPlan.in_place` names, tests/test_plan.py; a sliced operand of
    a Pallas call would be copied per layer by XLA — the launch count is a benchmark, docs/benchmarks.md), and
    the layers' exits stay deferred through the scan's carry: the scanned forward equals the unrolled one (the
    same kernel calls on the same values) within fp32 summation noise, with identical decisions."""
    impl = "xla,linear=pallas_interpret,mhc=pallas_interpret"
    on, off = (c.replace(act_dtype="float32", impl=impl) for c in cfgs)
    tokens = jax.random.randint(jax.random.key(5), (2, T), 3, 300, dtype=jnp.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "return_aux"))
    lg_s, aux_s = fwd(params, tokens, on, return_aux=True)
    lg_u, aux_u = fwd(params, tokens, off, return_aux=True)
    for key in ("topk", "cand", "experts"):
        for lid in aux_u[key]:
            np.testing.assert_array_equal(np.asarray(aux_s[key][lid]), np.asarray(aux_u[key][lid]), err_msg=f"{key} {lid}")
    np.testing.assert_allclose(np.asarray(lg_s), np.asarray(lg_u), rtol=0, atol=1e-5 * float(np.abs(lg_u).max()))


def test_one_token_step_writes_the_rings_in_the_window_codes_kernel(cfgs, params, unrolled_extend):
    """A plain one-token step with the attention kernels (interpret mode, fp32 flow): the window codes kernel
    writes every layer's codes into the rings itself — through a scanned run's carry too — and leaves nothing
    for `commit`; the step's logits and every cache leaf are bitwise those of writing them afterwards
    (`extend_uncommitted` + `commit`), except the rings' scratch row, which the padded third row wrote
    instead of dropping its codes. (The entry a token overwrites, position p − W, is invisible to it.)"""
    on = cfgs[0].replace(act_dtype="float32", impl="xla,attention=pallas_interpret")
    p = layer_scan.prepare(params, on)
    # The cache the step starts from: the unrolled exact-mode run's after its ragged chunk and one decode
    # token per row (positions 0-10 and 0-7; the cache's layout does not depend on the mode or the scan),
    # already computed for the scan tests: no compile of a chunk step here.
    st0 = unrolled_extend[1]
    toks = np.asarray(jax.random.randint(jax.random.key(8), (2,), 3, 300), np.int32)
    step = dec.make_batch([{"tokens": toks[:1], "start": 11, "slot": 0, "page_table": [0, 1]},
                           {"tokens": toks[1:], "start": 8, "slot": 1, "page_table": [2, 3]}], 1, 3, CCFG)

    def later(p, s, b):
        lg, st, pend, _ = dec.extend_uncommitted(p, s, b, on, CCFG)
        return lg, dec.commit(st, pend, b, b["n_new"], on)

    _, _, pend, _ = jax.eval_shape(lambda p, s, b: dec.extend_uncommitted(p, s, b, on, CCFG, keep_all=True), p, st0, step)
    assert all(c is None for c in pend.window)  # every layer wrote its rings itself, scanned ones too
    lg_now, st_now = jax.jit(lambda p, s, b: dec.extend(p, s, b, on, CCFG))(p, st0, step)
    lg_later, st_later = jax.jit(later)(p, st0, step)
    np.testing.assert_array_equal(np.asarray(lg_now), np.asarray(lg_later))
    scratch = CCFG.max_slots
    later = dict(jax.tree_util.tree_leaves_with_path(st_later))
    for path, a in jax.tree_util.tree_leaves_with_path(st_now):
        a, b = np.asarray(a).view(np.uint8), np.asarray(later[path]).view(np.uint8)
        if jax.tree_util.keystr(path).startswith("['window']"):
            a, b = a[:scratch], b[:scratch]
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    assert not np.array_equal(np.asarray(st_now["window"]["q"]).view(np.uint8)[:scratch],
                              np.asarray(st0["window"]["q"]).view(np.uint8)[:scratch])  # the step did write
