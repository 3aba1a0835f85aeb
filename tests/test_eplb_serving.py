"""Redundant experts (EPLB) in the engine (issue 46 item 7): ``--expert-distribution-recorder`` counts what the
routing did (equal to a count of the model's own routing of the same tokens) and writes the distribution file;
an engine restarted with ``--ep-num-redundant-experts R --init-expert-location`` of that file places the copies,
expands the experts, and gives the same tokens and logprobs bit for bit (--dtype exact) as without copies; the
step with the recorder off is the plain step itself; the server's record / dump endpoints; every refusal.

8 fake CPU devices, `configs.mesh_micro` (3 layers, 8 experts, top-2) on an ep 4 mesh, one batch bucket and one-token
chunks (one extend shape per engine); the three engines share the mesh, cfg and cache layout.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

import configs
from dsv41_jax.model.params import init_params
from dsv41_jax.model.transformer import forward
from dsv41_jax.parallel import eplb
from dsv41_jax.parallel import plan as mesh_plan
from dsv41_jax.serving.engine import Engine, EngineError
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

KW = dict(model="tiny", page_size=8, context_length=48, max_running_requests=2, max_total_tokens=192,
          chunked_prefill_size=1, batch_buckets=[2], decode_log_interval=1000, skip_server_warmup=True,
          disable_radix_cache=True, ep_size=4)
R = 4
N_NEW = 5
_rng = np.random.default_rng(46)
PROMPTS = [_rng.integers(3, 300, n).tolist() for n in (7, 4, 9)]


@pytest.fixture(scope="module")
def cfg():
    return configs.mesh_micro().replace(act_dtype="exact")


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.key(0))


def _run(eng):
    """Every prompt at once (greedy, and one seeded sample), run to the end: {rid: (tokens, logprobs)}."""
    for i, p in enumerate(PROMPTS):
        sp = SamplingParams(temperature=0.0 if i != 1 else 0.8, seed=7, max_tokens=N_NEW, ignore_eos=True, logprobs=2)
        eng.add_request(f"r{i}", p, sp)
    outs = {o.request_id: o.outputs[0] for o in eng.run_until_done() if o.finished}
    return {rid: (list(c.token_ids), [float(v).hex() for v in c.logprobs],
                  [[(int(t), float(v).hex()) for t, v in top] for top in c.top_logprobs]) for rid, c in outs.items()}


@pytest.fixture(scope="module")
def recorded(cfg, params, cpu8, tmp_path_factory):
    """The recorder's engine (ep 4, no copies) after one run: (engine, its outputs, the dumped file)."""
    path = str(tmp_path_factory.mktemp("eplb") / "dist.json")
    eng = Engine(EngineArgs(**KW, expert_distribution_recorder=True, expert_distribution_recorder_file=path),
                 cfg=cfg, params=params)
    out = _run(eng)
    info = eng.dump_expert_distribution_record()
    assert info["path"] == os.path.abspath(path) and os.path.isfile(path)
    frozen = path + ".run1.json"  # this run's file (the endpoint test writes `path` again)
    shutil.copy(path, frozen)
    return eng, out, frozen


@pytest.fixture(scope="module")
def plain(cfg, params, cpu8):
    eng = Engine(EngineArgs(**KW), cfg=cfg, params=params)
    return eng, _run(eng)


@pytest.fixture(scope="module")
def routing(recorded, cfg, params):
    """(the tokens each request fed the model: its prompt and its generated tokens but the last, the reference
    forward's routing of them {layer: int32 [3, T, k]}): one padded batch (causal: the padding after a row's
    tokens changes none of them)."""
    fed = [p + recorded[1][f"r{i}"][0][:-1] for i, p in enumerate(PROMPTS)]
    rows = np.zeros((len(fed), max(map(len, fed))), np.int32)
    for b, f in enumerate(fed):
        rows[b, :len(f)] = f
    _, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(params, rows, cfg, return_aux=True)
    return fed, {lid: np.asarray(ex) for lid, ex in aux["experts"].items()}


def test_recorder_counts_what_the_routing_did(recorded, routing, cfg):
    """The file holds, per MoE layer, the (token, expert) assignments of every token the engine fed the model,
    counted here from the reference forward's own routing (`transformer.forward`, return_aux) of those tokens."""
    got = eplb.load_distribution(recorded[2])
    fed, experts = routing
    want = {lid: np.zeros(cfg.n_routed_experts, np.int64) for lid in range(cfg.num_hidden_layers)}
    for lid, ex in experts.items():
        for b, f in enumerate(fed):
            np.add.at(want[lid], ex[b, :len(f)].reshape(-1), 1)
    assert sorted(got) == sorted(want)
    for lid in want:
        np.testing.assert_array_equal(got[lid], want[lid], err_msg=f"layer {lid}")
    n_fed = sum(len(p) + N_NEW - 1 for p in PROMPTS)
    assert all(int(v.sum()) == n_fed * cfg.num_experts_per_tok for v in got.values())


def test_round_trip_with_copies_is_bitwise(recorded, plain, cfg, params, caplog):
    """Restarted with R = 4 copies placed from the recorded file: the same tokens and logprobs as without copies
    (and as the recording engine: the recorder changes no output); the experts are stored as E + R physical ones
    and the start-up log says what was chosen."""
    _, rec_out, path = recorded
    _, plain_out = plain
    with caplog.at_level("INFO", logger="dsv41_jax.engine"):
        eng = Engine(EngineArgs(**KW, ep_num_redundant_experts=R, init_expert_location=path), cfg=cfg, params=params)
    loc = eng.runner.par.expert_location
    assert loc is not None and loc.num_redundant == R and loc.num_devices == 4
    assert sum(max(p.copies) > 1 for _, p in loc.layers) == cfg.num_hidden_layers
    for lid, p in loc.layers:  # the hottest expert of every layer got a copy
        assert p.copies[int(np.argmax(eplb.load_distribution(path)[lid]))] > 1
    E = cfg.n_routed_experts
    shapes = {a.shape[0] for a in jax.tree_util.tree_leaves(eng.runner.params["layers"]) if a.ndim >= 3 and
              a.shape[0] in (E, E + R)}
    assert E + R in shapes
    assert f"R={R} copies placed from {path}" in caplog.text and "expected max/mean tokens per device" in caplog.text
    out = _run(eng)
    assert out == plain_out
    assert rec_out == plain_out
    assert len({tuple(t) for t, *_ in out.values()}) == len(PROMPTS)


def test_step_unchanged_without_the_recorder(plain, recorded, cfg):
    """Without the flag the runner runs the plain jitted step itself (the very function, so the same program);
    with it, the recording step, which adds only the counts output."""
    eng, _ = plain
    r = eng.runner
    assert r.expert_recorder is None
    assert r._extend is mesh_plan.jitted_extend(cfg, r.ccfg, False, r.mesh, r.engram_host_table)
    assert recorded[0].runner._extend is not r._extend


def test_recorder_start_stop_and_endpoints(recorded, plain):
    """stop keeps the counts and records no more, start clears them, dump writes the file (and shutdown does);
    through the server's endpoints (SGLang's names), and a 400 from an engine started without the recorder."""
    from fastapi.testclient import TestClient

    from dsv41_jax.serving.async_engine import AsyncEngine
    from dsv41_jax.serving.server import ServerConfig, build_app

    eng = recorded[0]
    path = eng.runner.expert_recorder.path
    conf = ServerConfig(model_name="tiny", context_length=48, vocab_size=320)
    ae = AsyncEngine(eng, start=False)
    c = TestClient(build_app(ae, eng.tokenizer, conf))
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert c.post("/stop_expert_distribution_record").json() == {"recording": False}
    eng.add_request("x", PROMPTS[0], sp)
    eng.run_until_done()
    r = c.post("/dump_expert_distribution_record").json()
    assert r["path"] == os.path.abspath(path) and r["assignments"] == sum(
        int(v.sum()) for v in eplb.load_distribution(path).values())
    assert r["assignments"] == sum(len(p) + N_NEW - 1 for p in PROMPTS) * 2 * 3  # the fixture's run alone
    assert c.post("/start_expert_distribution_record").json() == {"recording": True}
    assert c.post("/dump_expert_distribution_record").json()["assignments"] == 0
    eng.add_request("y", PROMPTS[1], sp)
    eng.run_until_done()
    ae.shutdown()  # writes the file at shutdown
    got = eplb.load_distribution(path)
    assert all(int(v.sum()) == (len(PROMPTS[1]) + 1) * 2 for v in got.values())  # prompt + 1 fed token, top-2
    c2 = TestClient(build_app(AsyncEngine(plain[0], start=False), eng.tokenizer, conf))
    r = c2.post("/dump_expert_distribution_record")
    assert r.status_code == 400 and "--expert-distribution-recorder" in r.json()["error"]["message"]


def test_dp_recording_step_counts_per_rank(cfg, params, routing, cpu8):
    """On a data-parallel mesh (dp 2, each rank's program routes its own rows) the recording step's counts come out
    per rank, [D, L, E]: rank r's are the routing of its own rows' real tokens (the reference forward's)."""
    from dsv41_jax.model import cache as kvc
    from dsv41_jax.model import decode as dec
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh
    from dsv41_jax.serving.experts import jitted_extend_recording

    mesh = make_mesh(dp=2, cfg=cfg)
    ccfg = kvc.CacheConfig(page_size=8, num_pages=8, max_slots=2, max_pages_per_seq=1, retrieval_block=4, dp=2)
    state = rules.init_cache(cfg, ccfg, mesh)
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    state = jax.device_put(kvc.reset_slots(state, np.arange(kvc.slot_rows(ccfg)), pad),
                           rules.cache_shardings(cfg, ccfg, mesh))
    toks = [PROMPTS[0][:4], PROMPTS[2][:3]]  # one row per rank, the second shorter than the chunk
    rows = [{"tokens": t, "start": 0, "slot": kvc.rank_slots(ccfg, r)[0], "page_table": [kvc.rank_pages(ccfg, r)[1]]}
            for r, t in enumerate(toks)]
    step = jitted_extend_recording(cfg, ccfg, False, mesh_plan.MeshPlan.of(mesh))
    _, _, counts = step(rules.shard_params(params, cfg, mesh), state, dec.pack_rows(rows, 4, 2, ccfg))
    counts = np.asarray(counts)
    assert counts.shape == (2, cfg.num_hidden_layers, cfg.n_routed_experts)
    experts = routing[1]  # (the requests' first tokens are their prompts': rows 0 and 2 of the reference batch)
    for r, (b, t) in enumerate(zip((0, 2), toks)):
        for lid in range(cfg.num_hidden_layers):
            want = np.bincount(experts[lid][b, :len(t)].reshape(-1), minlength=cfg.n_routed_experts)
            np.testing.assert_array_equal(counts[r, lid], want, err_msg=f"rank {r} layer {lid}")


# ------------------------------------------------------------------------------------------ refusals


def test_flag_refusals(tmp_path):
    """What EngineArgs refuses before anything loads (one ValueError line each)."""
    f = tmp_path / "d.json"
    eplb.save_distribution(str(f), {0: np.arange(8)})
    for kw, msg in (({"expert_distribution_recorder_file": str(f)}, "no effect without --expert-distribution"),
                    ({"expert_distribution_recorder": True, "speculative_algorithm": "DSPARK"},
                     "not implemented with --speculative-algorithm DSPARK"),
                    ({"expert_distribution_recorder": True, "enable_decoder_swa_bounded_replay": True,
                      "disable_radix_cache": True}, "not implemented with --enable-decoder-swa-bounded-replay"),
                    ({"expert_distribution_recorder": True,
                      "expert_distribution_recorder_file": str(tmp_path / "no" / "x.json")}, "does not exist")):
        with pytest.raises(ValueError, match=msg):
            EngineArgs(model="tiny", **kw)


@pytest.mark.parametrize("case", ["indivisible", "too_many", "layers", "experts", "malformed"])
def test_engine_refuses_impossible_placements(cfg, params, cpu8, tmp_path, case):
    """Refused by the engine before any weight is read (EngineError, one line): E + R not dividing the expert
    devices, more copies than the devices can hold apart, a file whose layers or expert counts are not the
    model's, a file that is not a distribution."""
    f = str(tmp_path / "d.json")
    E, L = cfg.n_routed_experts, cfg.num_hidden_layers
    dist = {lid: np.arange(1, E + 1) for lid in range(L)}
    kw = dict(KW, ep_num_redundant_experts=R, init_expert_location=f)
    if case == "indivisible":
        kw["ep_num_redundant_experts"], msg = 3, "do not divide evenly over 4 devices"
    elif case == "too_many":
        kw.update(ep_size=2, ep_num_redundant_experts=10)
        msg = "more copies than the 2 devices can hold apart"
    elif case == "layers":
        dist, msg = {0: dist[0]}, "the model has MoE layers 0..2"
    elif case == "experts":
        dist, msg = {lid: np.arange(16) for lid in range(L)}, "16 experts per layer, the model has 8"
    if case == "malformed":
        with open(f, "w") as fh:
            fh.write("{not json")
        msg = "--init-expert-location"
    else:
        eplb.save_distribution(f, dist)
    with pytest.raises(EngineError, match=msg) as e:
        Engine(EngineArgs(**kw), cfg=cfg, params=params)
    assert "\n" not in str(e.value)


def test_cli_refuses_a_bad_distribution_file_in_one_line(tmp_path):
    """python -m dsv41_jax.serve with a file that is not a distribution: one ``error:`` line, exit 2."""
    from servers import free_port
    from test_serve_startup import _refused, _serve

    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"format": "something else"}))
    r = _serve(["--ep-size", "4", "--ep-num-redundant-experts", "4", "--init-expert-location", str(f), "--port",
                str(free_port())], JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    line = _refused(r)
    assert "not an expert distribution" in line and str(f) in line, line


def test_help_says_where_the_distribution_goes():
    import argparse

    text = EngineArgs.add_cli_args(argparse.ArgumentParser()).format_help()
    assert "expert_distribution.json" in text and "/dump_expert_distribution_record" in " ".join(text.split())
    assert "refused at start-up" not in " ".join(text.split()).split("--ep-num-redundant-experts")[1][:400]



@pytest.mark.slow
def test_dspark_with_copies_is_bitwise(cfg, params, cpu8, tmp_path):
    """DSpark (seeding and verify steps on the mesh plan carrying the placement; the draft's own experts are not
    copied) with R = 4 copies: the tokens and logprobs of DSpark without copies (two more DSpark compiles: slow)."""
    f = str(tmp_path / "d.json")
    rng = np.random.default_rng(3)
    eplb.save_distribution(f, {lid: rng.zipf(1.5, cfg.n_routed_experts) for lid in range(cfg.num_hidden_layers)})
    kw = dict(KW, speculative_algorithm="DSPARK")
    outs = [_run(Engine(EngineArgs(**kw, **extra), cfg=cfg, params=params))
            for extra in ({}, dict(ep_num_redundant_experts=R, init_expert_location=f))]
    assert outs[0] == outs[1]
