"""Every serving feature on a TP/EP mesh (8 fake CPU devices): the radix prefix cache (its snapshot pool
placed by the cache's rules), the HiCache host tier, DSpark (draft rings placed by the rules, the
verify-then-commit step on the mesh) and DSpark with the Engram host table give the greedy tokens of
single-device plain decoding in the exact numerics mode, with prefix hits from the first repeat.

The engine matrix: {tp=2 × ep=4, ep=8 with the Engram host table} × {DSpark on, off} × {radix cache with
HiCache on, off}; the server (slow: three servers) with DSpark, the radix cache and HiCache on either mesh
answers like the unsharded plain server. Compile cost is kept down: `configs.mesh_micro` (3 layers, one DSpark stage), one-token
prefill chunks and one batch bucket (one extend shape per engine), the radix on / off engines of a cell
built on the same cfg / ccfg / mesh so they share every compiled step (the prefix cache adds only its
small copy programs); the single-device reference is computed once per module.
"""

import json
import os

import jax
import numpy as np
import pytest

import configs
from dsv41_jax.model.params import init_params
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

KW = dict(model="tiny", page_size=8, context_length=48, max_running_requests=2, max_total_tokens=192,
          chunked_prefill_size=1, batch_buckets=[2], decode_log_interval=1000, skip_server_warmup=True)
MESHES = {"tp2_ep4": dict(tp_size=2, ep_size=4), "ep8_host_table": dict(ep_size=8, engram_host_table=True)}
N_NEW = 6
_rng = np.random.default_rng(11)
SYSTEM = _rng.integers(3, 300, 13).tolist()  # a page (8) and then some: the point at 8 is shared
PROMPTS = [SYSTEM + _rng.integers(3, 300, 3).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def cfg():
    return configs.mesh_micro().replace(act_dtype="exact")


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.key(0))


def _run(eng, evict_to_host: bool = False):
    """The prompts one after another (each the first repeat of the system prompt for the next); with
    ``evict_to_host`` every cached state is moved to the host tier before the third, which then loads
    its point back. Returns [(tokens, cached_tokens)]."""
    out = []
    for i, p in enumerate(PROMPTS):
        if evict_to_host and i == 2:
            eng.step()  # dispatches the last snapshot saves (an entry spills only once its save ran)
            eng.prefix_cache.evict(eng.allocator.capacity)
        eng.add_request(f"m{i}", p, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
        (o,) = [o for o in eng.run_until_done() if o.finished]
        out.append((list(o.outputs[0].token_ids), o.num_cached_tokens))
    eng.allocator.check_invariants()
    return out


def _more(eng):
    """The other request kinds, all at once: an n = 2 greedy request (prompt shared by forking), a
    constrained one (no multiple of 3, `test_engine_dspark.NotMod3`: with DSpark its drafts are walked
    through the grammar first) and a sampled one (seeded). Returns their token lists."""
    from test_engine_dspark import NotMod3

    reqs = [("n2", PROMPTS[0][:9] + [7, 7], SamplingParams(temperature=0.0, n=2, max_tokens=N_NEW, ignore_eos=True), None),
            ("con", PROMPTS[1][:6], SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True),
             NotMod3(eng.vocab_size)),
            ("smp", PROMPTS[2][:7], SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=N_NEW,
                                                  ignore_eos=True), None)]
    for rid, p, sp, con in reqs:
        eng.add_request(rid, p, sp, constraint=con)
    outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
    return [[list(c.token_ids) for c in outs[rid].outputs] for rid, *_ in reqs]


@pytest.fixture(scope="module")
def ref_engine(cfg, params):
    return Engine(EngineArgs(**KW, disable_radix_cache=True), cfg=cfg, params=params)


@pytest.fixture(scope="module")
def ref(ref_engine):
    return [t for t, _ in _run(ref_engine)]


@pytest.fixture(scope="module")
def ref_more(ref_engine):
    return _more(ref_engine)


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_matrix_equals_single_device(cpu8, cfg, params, ref, ref_more, mesh, dspark):
    """One cell of the matrix, radix + HiCache on and off on the same compiled steps: greedy tokens equal
    single-device plain decoding; with the cache the second request resumes from the first's chunk-end
    point (8) and the third from a host-tier copy (evicted to the host, loaded back on the mesh). With the
    cache on, an n = 2 request and a constrained one give the single-device tokens (and without DSpark a
    seeded sampled one)."""
    extra = dict(MESHES[mesh], speculative_algorithm="DSPARK" if dspark else None)
    placed = params
    for radix in (True, False):
        cache = dict(enable_hierarchical_cache=True) if radix else dict(disable_radix_cache=True)
        # the radix-off engine takes the radix-on engine's placed parameters: the same values, and with the
        # Engram host table the same `HostTable` objects, which the compiled steps' cache keys hold (by
        # identity), so it runs the steps the first engine compiled instead of compiling its own
        eng = Engine(EngineArgs(**KW, **extra, **cache), cfg=cfg, params=placed)
        placed = eng.runner.params
        assert eng.runner.mesh is not None and eng.runner.engram_host_table == (mesh == "ep8_host_table")
        got = _run(eng, evict_to_host=radix)
        assert [t for t, _ in got] == ref
        if radix:
            assert [c for _, c in got] == [0, 8, 8]
            assert eng.prefix_cache.host_hits == 1 and eng.prefix_cache.spills > 0
            # the snapshot pool is placed by the cache's rules (replicated over the mesh, as the cache)
            assert all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(eng.runner.snaps))
            more = _more(eng)
            # (a sampled row's draws differ with DSpark by design — speculative sampling keeps the
            # distribution, not the stream — so it is compared in the plain cells only)
            assert (more[:2] == ref_more[:2]) if dspark else (more == ref_more)
        else:
            assert [c for _, c in got] == [0, 0, 0]
        if dspark:
            assert eng.stats()["spec_verify_steps"] > 0
            rings = eng.runner.state["dspark"]
            assert all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(rings))
        mem = eng.runner.memory_by_device
        assert len(mem) == 8 and all(m["params"] > 0 and m["kv"] > 0 for m in mem.values())
        assert all((m["snapshots"] > 0) == radix and (m["draft_params"] > 0) == dspark for m in mem.values())


def test_exact_logprobs_on_the_mesh_equal_single_device(cpu8, cfg, params, ref_engine):
    """Issue 49: ``--dtype exact`` alone (no deterministic mode) promises results independent of the mesh;
    on tp=2 × ep=4 with DSpark and the radix cache + HiCache, the logprobs and top logprobs of the
    requests that hit the prefix cache parted from the single-device plain engine's by one fp32 ulp (the
    sampler's vocabulary sums were fp32, in whatever order XLA's program for each mesh gave them). Exact
    mode now sums them in fp64, as the deterministic mode does: the same bits."""
    def go(eng):
        out = []
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"lp{i}", p, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=2))
            (o,) = [o for o in eng.run_until_done() if o.finished]
            c = o.outputs[0]
            out.append((list(c.token_ids), list(c.logprobs), [list(map(tuple, t)) for t in c.top_logprobs],
                        o.num_cached_tokens))
        return out

    want = go(ref_engine)
    got = go(Engine(EngineArgs(**KW, **MESHES["tp2_ep4"], speculative_algorithm="DSPARK",
                               enable_hierarchical_cache=True), cfg=cfg, params=params))
    assert [g[3] for g in got] == [0, 8, 8] and [w[3] for w in want] == [0, 0, 0]
    assert [g[:3] for g in got] == [w[:3] for w in want]


@pytest.mark.slow  # a smaller pool and the all-logits step: their own compiles on the mesh and on one device
def test_mesh_preemption_and_prompt_logprobs_equal_single_device(cpu8, cfg, params):
    """tp=2 × ep=4 with DSpark and the radix cache: two requests that do not fit the pool together (one is
    preempted and resumes) and a prompt-logprobs request give the single-device plain engine's tokens,
    and the prompt logprobs (exact numerics: the same bits)."""
    # (the deterministic sampler too: its vocabulary sums in fp64, else a prompt logprob may differ in its
    # last fp32 bit between the programs XLA builds for one device and for the mesh — seen: 1 ulp)
    kw = dict(KW, max_total_tokens=64, context_length=40, enable_deterministic_inference=True)
    long = [PROMPTS[0] + PROMPTS[1][:6], PROMPTS[1] + PROMPTS[2][:6]]

    def go(eng):
        for i, p in enumerate(long):
            eng.add_request(f"L{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        eng.add_request("plp", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2,
                                                          ignore_eos=True))
        outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
        return ([list(outs[f"L{i}"].outputs[0].token_ids) for i in range(2)] + [list(outs["plp"].outputs[0].token_ids)],
                outs["plp"].prompt_logprobs, eng.metrics["num_preemptions"])

    want = go(Engine(EngineArgs(**kw, disable_radix_cache=True), cfg=cfg, params=params))
    got = go(Engine(EngineArgs(**kw, tp_size=2, ep_size=4, speculative_algorithm="DSPARK"), cfg=cfg, params=params))
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] > 0 and want[2] > 0  # the pool really was short on both


# ------------------------------------------------------------------------------------------- server

# --dtype exact makes the model and the sampler's vocabulary sums (fp64) order-independent; with
# --enable-deterministic-inference too, the deterministic mode's numerics are checked on the mesh as well
SERVE_FLAGS = ["--served-model-name", "mm", "--dtype", "exact", "--enable-deterministic-inference", "--max-running-requests", "2", "--batch-buckets", "2",
               "--chunked-prefill-size", "1", "--page-size", "8", "--context-length", "48", "--max-total-tokens", "192",
               "--decode-log-interval", "1000", "--enable-metrics"]
MESH_SERVERS = {"tp2_ep4": ["--tp", "2", "--ep", "4"], "ep8_host_table": ["--ep", "8", "--engram-host-table"]}


def _metric(base: str, name: str):
    import httpx

    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def _conversation(base: str) -> list:
    """What a user sends, one request at a time: the shared-system-prompt requests (greedy, no logprobs:
    rows that speculate) and a three-turn conversation (each turn resends the previous prompt and
    answer, with top-2 logprobs: rows that decode plainly). Returns each answer (text, tokens' logprobs,
    top logprobs, cached tokens)."""
    import httpx

    out = []

    def ask(prompt, logprobs):
        body = {"model": "mm", "prompt": prompt, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}
        if logprobs:
            body["logprobs"] = 2
        r = httpx.post(base + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        j = r.json()
        c = j["choices"][0]
        lp = c.get("logprobs") or {}
        out.append((c["text"], lp.get("token_logprobs"), lp.get("top_logprobs"),
                    j["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return c["text"]

    for p in PROMPTS:
        ask(p, False)
    turn = list(PROMPTS[0][:10]) + [17, 18, 19]
    for t in range(3):
        ask(turn, True)
        r = httpx.post(base + "/tokenize", json={"model": "mm", "prompt": out[-1][0]}, timeout=60)
        assert r.status_code == 200, r.text
        turn = turn + r.json()["tokens"] + [40 + t, 41 + t]
    return out


@pytest.mark.slow  # three servers, each compiling its steps (~2 CPU-min each on 2 cores)
@pytest.mark.parametrize("mesh", list(MESH_SERVERS))
def test_server_mesh_dspark_radix_hicache_equals_unsharded_plain(cpu8, cfg, tmp_path_factory, mesh):
    """`serve --tp 2 --ep 4` / `--ep 8 --engram-host-table` with DSpark, the radix cache and HiCache answer
    the shared-system-prompt requests and a multi-turn conversation exactly as the unsharded plain server
    (--disable-radix-cache), both in the exact and deterministic numerics: same text, same logprobs and top
    logprobs bit for bit; cached_tokens > 0 from the second
    request on; the accept-length metric is exported. The checkpoint is `configs.mesh_micro`'s (seed 0:
    the engine matrix's parameters, so the servers load its compiled programs from the run's cache)."""
    from servers import start_server, stop_server

    root = tmp_path_factory.getbasetemp() / "mesh_serving"
    root.mkdir(exist_ok=True)
    ckpt = root / "ckpt"
    if not ckpt.exists():
        configs.write_checkpoint(configs.mesh_micro(), ckpt)
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(root / "jax_cache")
    base_flags = ["--model", str(ckpt)] + SERVE_FLAGS
    ref_file = root / "plain.json"
    if not ref_file.exists():
        proc, base, logf = start_server(base_flags + ["--disable-radix-cache"], root / "plain.log", cache)
        try:
            ref = _conversation(base)
        finally:
            assert stop_server(proc, logf) == 0
        ref_file.write_text(json.dumps(ref))
    ref = [tuple(r) for r in json.loads(ref_file.read_text())]
    flags = base_flags + MESH_SERVERS[mesh] + ["--speculative-algorithm", "DSPARK", "--enable-hierarchical-cache"]
    proc, base, logf = start_server(flags, root / f"{mesh}.log", cache)
    try:
        got = [tuple(r) for r in _conversation(base)]
        accept_len = _metric(base, "dsv41:spec_accept_length")
        spec_steps = _metric(base, "dsv41:spec_verify_steps_total")
    finally:
        rc = stop_server(proc, logf)
    log = (root / f"{mesh}.log").read_text()
    assert rc == 0, log[-3000:]
    assert "memory on" in log and "prefix-cache snapshot pool" in log
    assert [g[:3] for g in got] == [r[:3] for r in ref]
    assert all(r[3] == 0 for r in ref)
    cached = [g[3] for g in got]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert accept_len is not None and accept_len >= 1.0 and spec_steps > 0  # DSpark rows ran
