"""The deterministic numerics mode (issue 38; `ModelConfig.deterministic`, the server's
--enable-deterministic-inference): the reference's bf16 dtype flow with every order-sensitive sum
accumulated in fp64 (model/numerics.py), a sampler whose sums are fp64 too, Pallas kernels refused.

What the mode promises, and where it is checked here:
* the switch itself: config field, dispatch ("auto" -> "xla", explicit Pallas refused), engine flag;
* the sampler: a row's tokens and logprobs do not depend on the other rows;
* the engine (`det_eng`): mixed concurrent requests (ragged prompts, greedy and seeded sampling, n = 3
  forks, logprobs) under KV pressure (preemption + replay) give exactly the tokens and logprobs each
  sample gets alone, where the alone runs restore the radix cache's prefixes and run at batch 1 with
  their own prefill chunks. (The same run without the mode, measured: one sample's tokens diverge and
  7 of 8 samples' logprobs differ, by up to 2.9e-4 before the divergence.) The same with DSpark (verify
  windows accepting different lengths), and on tp = 2 x ep = 4 against the one-device engine; a HiCache
  round trip (evicted to the host tier, loaded back) equals the cold run;
* the server: concurrent requests (stream, n = 2, json_schema, seeded sampling) = each alone;
* the model: a forward's rows are independent of the batch; faithfulness against the bf16 reference;
* the benchmark plumbing that reports the mode's cost.
Cost: the engines compile micro's shapes once each (the server loads them from the run's compile cache).
"""

import concurrent.futures
import itertools
import json
import os

import httpx
import jax
import jax.numpy as jnp
from jax import monitoring
import numpy as np
import pytest

import configs
import parting
from servers import start_server, stop_server
from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import dispatch, forward
from dsv41_jax.model.config import ConfigError, ModelConfig
from dsv41_jax.model.numerics import act_dtype, is_exact, mode_name
from dsv41_jax.model.params import init_params
from dsv41_jax.serving import sampling as smp
from dsv41_jax.serving.engine import CacheLoads, Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams
from oracle_drafter import OracleDrafter


def test_config_field_and_mode(tiny_cfg):
    det = tiny_cfg.replace(deterministic=True)
    assert is_exact(det) and act_dtype(det) == jnp.bfloat16 and mode_name(det) == "bfloat16+deterministic"
    assert not is_exact(tiny_cfg) and mode_name(tiny_cfg) == "bfloat16"
    assert mode_name(tiny_cfg.replace(act_dtype="float32", deterministic=True)) == "exact"
    assert "deterministic" not in det.to_hf_dict()["text_config"]
    with pytest.raises(ConfigError, match="deterministic"):
        tiny_cfg.replace(deterministic="yes")


def test_dispatch_auto_is_xla_and_kernels_refused(tiny_cfg):
    # "auto" picks the attention kernel on a GPU, but never in the fp64-accumulating modes
    assert dispatch.resolve("auto", "attention", backend="gpu", f64=False) == "pallas"
    assert dispatch.resolve("auto", "attention", backend="gpu", f64=True) == "xla"
    assert dispatch.resolve("attention=pallas", "attention", backend="gpu", f64=True) == "pallas"  # refused at the seam
    det = tiny_cfg.replace(deterministic=True, impl="engram=pallas_interpret")
    with pytest.raises(dispatch.ImplError, match="deterministic"):
        dispatch.refuse_kernel_in_f64_mode(det, "engram", "pallas_interpret")
    with pytest.raises(ValueError, match="Pallas kernels for attention, indexer"):
        EngineArgs(enable_deterministic_inference=True, impl="xla,attention=pallas,indexer=pallas_interpret")
    with pytest.raises(ValueError, match="bounded-replay"):
        EngineArgs(enable_deterministic_inference=True, enable_decoder_swa_bounded_replay=True,
                   disable_radix_cache=True)
    args = EngineArgs(enable_deterministic_inference=True)
    assert args.fp64_accumulation and "--enable-deterministic-inference" in args.cli_flags()


def test_sampler_rows_independent_of_the_batch():
    """deterministic=True: each row of a 16-row batch (greedy, temperature, top-k, top-p, seeded)
    samples the same token with the same logprobs, bit for bit, as that row alone."""
    V = 4096
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, V)).astype(np.float32) * 4)
    ps = [smp.SamplingParams(temperature=0.8 if i % 2 else 0.0, top_p=0.9 if i % 3 else 1.0,
                             top_k=50 if i % 4 == 1 else -1, seed=i, logprobs=5) for i in range(16)]

    def run(rows):
        t = smp.SamplingTensors.from_params([ps[i] for i in rows], V)
        out = smp.sample_jit(x[np.asarray(rows)], t, jnp.full((len(rows),), 3, jnp.int32), max_logprobs=5,
                             deterministic=True)
        return jax.tree.map(np.asarray, out)

    full = run(list(range(16)))
    for i in (0, 1, 5, 14):
        for a, b in zip(jax.tree.leaves(run([i])), jax.tree.leaves(full)):
            np.testing.assert_array_equal(a[0], b[i])
    # the fp64 normaliser is the same log-softmax to fp32 rounding
    ref = jax.nn.log_softmax(x, axis=-1)
    np.testing.assert_allclose(np.asarray(smp.log_softmax(x, True)), np.asarray(ref), atol=2e-6, rtol=0)


# ------------------------------------------------------------------------------------------------ engine
# One engine in the mode (micro: every mechanism of a step in 3 layers), two batch buckets (one token
# bucket: prefill chunks and decode steps share [B, 16]), so a request alone runs in another compiled shape
# (batch 1) and other prefill chunks than in a mixed batch (batch 4, chunks split by the shared 16-token
# budget), and an 8-page pool that a mixed run
# overflows (preemption, replay) while any request alone fits. The radix cache is on.
POOL = 128
KW = dict(model="tiny", page_size=16, context_length=64, max_running_requests=4, max_total_tokens=POOL,
          chunked_prefill_size=16, batch_buckets=[1, 4], token_buckets=[16], decode_log_interval=1000,
          enable_deterministic_inference=True)
_ids = itertools.count()


def _mixed():
    """Ragged prompts (two sharing a 20-token prefix), greedy and seeded sampled rows, n = 2, logprobs."""
    rng = np.random.default_rng(38)
    prompts = [rng.integers(3, 300, int(n)).tolist() for n in (5, 37, 12, 23, 40, 9)]
    prompts[5] = prompts[4][:20] + prompts[5]
    sps = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=2),
           # n = 3 forks of 12 + 36 tokens: 9 pages of the 8-page pool, so the samples preempt each other
           SamplingParams(temperature=1.0, top_k=20, seed=8, n=3, max_tokens=36, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.7, seed=9, max_tokens=10, ignore_eos=True, logprobs=2,
                          presence_penalty=0.5),
           SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)]
    return prompts, sps


def _run(eng, prompts, sps):
    rids = [f"d{next(_ids)}" for _ in prompts]
    for rid, p, sp in zip(rids, prompts, sps):
        eng.add_request(rid, p, sp)
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert eng.allocator.free_pages == eng.allocator.capacity
    return [outs[r] for r in rids]


def _result(out):
    """Everything a client gets per sample: tokens, logprobs, top logprobs (exact floats)."""
    return [(c.token_ids, c.logprobs, c.top_logprobs) for c in out.outputs]


def _alone(eng, prompts, sps):
    """Each sample run by itself: a request with n > 1 as its n = 1 children (seeds seed + j)."""
    return [sum((_result(_run(eng, [p], [c])[0]) for c in sp.child_params()), []) for p, sp in zip(prompts, sps)]


@pytest.fixture(scope="module")
def det_eng():
    return Engine(EngineArgs(**KW), cfg=configs.micro())  # random weights, seed 0


@pytest.fixture(scope="module")
def mixed_ref(det_eng):
    """The mixed set run together on a cold cache (preempting), then each sample alone (cache hits)."""
    prompts, sps = _mixed()
    det_eng.prefix_cache.clear_cache()
    p0 = det_eng.metrics["num_preemptions"]
    together = _run(det_eng, prompts, sps)
    preempted = det_eng.metrics["num_preemptions"] - p0
    p1, c1 = det_eng.metrics["num_preemptions"], det_eng.metrics["cached_prompt_tokens"]
    alone = _alone(det_eng, prompts, sps)
    assert det_eng.metrics["num_preemptions"] == p1  # alone, every sample fits the pool
    return prompts, sps, [_result(o) for o in together], alone, preempted, det_eng.metrics["cached_prompt_tokens"] - c1


def test_engine_mixed_equals_alone(det_eng, mixed_ref):
    """Batch 4 vs batch 1, other prefill chunks, preemption and replay, radix-cache restores, n = 2
    forks, seeded sampling: every sample's tokens and logprobs are the same bits."""
    prompts, sps, together, alone, preempted, cached = mixed_ref
    assert det_eng.cfg.deterministic and preempted > 0 and cached > 0  # the alone runs restored cached prefixes
    assert together == alone
    assert len({tuple(r[0]) for r in together[2]}) == 3 and all(len(r[1]) == len(r[0]) for t in together for r in t)
    again = _run(det_eng, prompts, sps)  # mixed once more, every prompt now cached
    assert [_result(o) for o in again] == alone


def test_dspark_mixed_equals_plain_alone(det_eng, mixed_ref):
    """DSpark on (γ = 3, micro's one stage; batch bucket 4, 16-token chunks), the mixed set without
    logprobs, all greedy but one seeded sampled row: the greedy rows speculate, with an oracle draft (a
    test drafter, tests/oracle_drafter.py) proposing their tokens
    with a wrong one at a per-row, per-step position, so rows of one verify window accept different
    lengths; the sampled row decodes plainly in this mode (`Scheduler._may_speculate`: its draws would
    depend on when the batch let it speculate). Every sample's tokens are the plain engine's alone."""
    prompts, sps, *_ = mixed_ref
    sps = [sp if i == 1 else SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True)
           for i, sp in enumerate(sps)]
    ref = [[r[0] for r in a] for a in _alone(det_eng, prompts, sps)]
    eng = Engine(EngineArgs(**dict(KW, speculative_algorithm="DSPARK", batch_buckets=[4], token_buckets=[16])),
                 cfg=configs.micro())
    g = eng.spec_gamma
    assert g == 3 and eng.cfg.deterministic
    rids = [f"s{next(_ids)}" for _ in prompts]
    launches = []

    def oracle(L):
        launches.append(L)
        out = np.full((len(L.rows), g), -1, np.int32)
        for b, r in enumerate(L.rows):
            i = rids.index(r.req_id)
            n = r.step
            want = ref[i][r.index][n:n + g]
            out[b, :len(want)] = want
            k = (n + i + len(launches)) % (g + 1)  # the first wrong draft (k = γ: all right)
            if k < len(want):
                out[b, k] = (want[k] + 1) % eng.vocab_size
        return out

    eng.runner.speculator = drafter = OracleDrafter(eng.runner.speculator, oracle)
    for rid, p, sp in zip(rids, prompts, sps):
        eng.add_request(rid, p, sp.replace(logprobs=None))
    outs = {o.request_id: o for o in eng.run_until_done()}
    assert [[c.token_ids for c in outs[r].outputs] for r in rids] == ref
    accepts = drafter.accepts()
    assert any(len(set(a)) > 1 for a in accepts), accepts  # rows accepting different lengths in one step
    assert len({n for a in accepts for n in a}) >= 3
    assert {rids.index(r.req_id) for L in launches for r in L.rows} == {i for i, sp in enumerate(sps)
                                                                                 if sp.temperature == 0}


def test_hicache_round_trip_equals_cold(det_eng):
    """HiCache in the mode: a first turn's cached states (pages and snapshot rows) are evicted to the host
    tier, the next turns (prompt + answer + 2 tokens, greedy and seeded sampling, logprobs) load them back
    onto fresh device pages, and every sample's tokens and logprobs are the cold run's, bit for bit
    (measured without the mode: one sample's logprobs 2.4e-7 apart). The engine has `det_eng`'s shapes
    and weights, so it runs its compiled steps."""
    eng = Engine(EngineArgs(**dict(KW, enable_hierarchical_cache=True)), cfg=configs.micro(),
                 params=det_eng.runner.params)
    a, c = eng.allocator, eng.prefix_cache
    rng = np.random.default_rng(41)
    sps = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)]
    firsts = [rng.integers(3, 300, n).tolist() for n in (18, 33, 9)]
    outs = _run(eng, firsts, sps)
    eng.step()  # dispatches the last snapshot saves (an entry is spilled only once its save ran)
    c.evict(a.capacity)
    assert not c.entries and c.spills > 0 and a.free_pages == a.capacity
    seconds = [p + list(o.outputs[0].token_ids) + rng.integers(3, 300, 2).tolist() for p, o in zip(firsts, outs)]
    warm = _run(eng, seconds, sps)
    assert c.host_hits == len(seconds) and all(o.num_cached_tokens > 0 for o in warm)
    c.clear_cache()
    cold = _run(eng, seconds, sps)
    assert [o.num_cached_tokens for o in cold] == [0] * len(seconds)
    assert [_result(o) for o in warm] == [_result(o) for o in cold]


@pytest.mark.parametrize("host_table", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_mesh_tp2_ep4_equals_one_device(cpu8, mixed_ref, host_table):
    """On 8 fake CPU devices, tp = 2 x ep = 4 (and the Engram table on the host: slow tier), one batch
    bucket of 4 and 16-token steps (radix cache off on a mesh): the mixed set gives the one-device
    engine's results alone, tokens and logprobs bit for bit; the run compiles (or loads) no program after
    the warm-up (it did — extend, the sampler — while the first launches saw other input shardings than
    the later ones)."""
    prompts, sps, _, alone, *_ = mixed_ref
    eng = Engine(EngineArgs(**dict(KW, tp_size=2, ep_size=4, engram_host_table=host_table, batch_buckets=[4],
                                   token_buckets=[16])), cfg=configs.micro())
    assert dict(eng.runner.mesh.shape) == {"ep": 4, "tp": 2} and eng.runner.engram_host_table == host_table
    built = []  # XLA compiles (or persistent-cache loads) during the run: none, the warm-up built them all

    def on_duration(event, secs, **kw):
        if event.endswith("backend_compile_duration"):
            built.append(kw.get("fun_name", "?"))

    def on_event(event, **kw):
        if event == CacheLoads.EVENT:
            built.append("cache load")

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    try:
        assert [_result(o) for o in _run(eng, prompts, sps)] == alone
    finally:
        monitoring.unregister_event_duration_listener(on_duration)
        monitoring.unregister_event_listener(on_event)
    assert built == []


# ------------------------------------------------------------------------------------------- the model
T = 40  # the decode tests' length (tests/test_decode.py): crosses the window, groups, blocks, index_topk
CCFG = kvc.CacheConfig(page_size=8, num_pages=24, max_slots=4, max_pages_per_seq=6)
FWD = jax.jit(forward, static_argnames=("cfg", "return_aux"))


@pytest.fixture(scope="module")
def seqs():
    """The decode tests' prompt (key 11) and three more of its kind."""
    return np.stack([np.asarray(jax.random.randint(jax.random.key(s), (T,), 3, 300), np.int32)
                     for s in (11, 12, 13, 14)])


def test_forward_independent_of_batch(seqs):
    """micro in the mode: each row of a [4, 40] forward equals the row alone, bit for bit (prefill chunks
    and decode steps against one another: the engine tests). Before RMSNorm and the softmaxes ran in fp64
    in this mode, a batch of 6 and a batch of 1 parted at layer 1's compressor: XLA:CPU evaluated an fp32
    step differently per fusion (so per batch shape), 1 ulp, which a bf16 rounding made 4 bf16 ulps and
    then a top-k choice."""
    cfg = configs.micro().replace(impl="xla", deterministic=True)  # the faithfulness test's config
    params = init_params(cfg, jax.random.key(0))
    # with the aux outputs, as the faithfulness test calls it: the [1, 40] forward is compiled once for both
    full = np.asarray(FWD(params, jnp.asarray(seqs), cfg, return_aux=True)[0])
    for r in (0, 3):
        np.testing.assert_array_equal(np.asarray(FWD(params, jnp.asarray(seqs[r:r + 1]), cfg, return_aux=True)[0])[0],
                                      full[r])


def _first_flip(aux, ref, row, t_aux=None):
    """First position whose top-k slot sets or experts differ from the reference's (T if none)."""
    for t in range(T):
        a = {k: {l: v[row if t_aux is None else 0, t if t_aux is None else 0] for l, v in aux[k].items()}
             for k in ("topk", "experts")} if t_aux is None else t_aux[t]
        same = all(sorted(x[x >= 0].tolist()) == sorted(ref["topk"][l][row, t][ref["topk"][l][row, t] >= 0].tolist())
                   for l, x in a["topk"].items())
        same &= all(x.tolist() == ref["experts"][l][row, t].tolist() for l, x in a["experts"].items())
        if not same:
            return t
    return T


def test_faithful_to_the_bf16_reference(seqs):
    """Against `impl="reference"` in bf16 (the full forward, each prompt alone): where the experts or index
    slots first differ from the reference's, for the bf16 mode as served (one-token decode steps, "xla")
    and for this mode (its forward, which is its served path bit for bit: the tests above). The issue's
    criterion: the same decisions at every position before the first flip (what "first flip" means), and
    this mode's first flip no earlier than the bf16 mode's, on every prompt.

    Measured (micro; keys 11-18, 40 = never): bf16 as served 27, 40, 40, 40, 11, 40, 40, 40; this mode
    the same. (Before its fp32 chains were rounded op for op as the reference's compiled chains round —
    `numerics.round_f32`, attention's num · fp32(1 / denom) — it flipped at 19 on key 11: layer 0's
    attention output at position 17, whose exact value lies 0.04 fp32 ulp above a bf16 midpoint, rounded
    the other way, and at 19 layer 2's indexer took slot 2 for slot 5.) Where this mode still parts from
    the reference by bf16 ulps, it is the reference's own fp32 summation order, bf16 roundings XLA drops
    inside the reference's fusions (key 11's flip at 27: a slot-9 index score that ties slot 6 in the
    reference, 1 bf16 ulp above it by the spec's step roundings) and XLA's fp32 exp / rsqrt / Sinkhorn,
    none of which an order-independent evaluation reproduces (numerics module doc).

    That reference is XLA's compile of it, and XLA versions sum differently: this mode is bit for bit the same
    on jax 0.10.2 and 0.12.1 (its sums are order-independent), the reference is not. On jax 0.12.1 it parts
    from its 0.10.2 self by one bf16 ulp at rounding ties — layer 0's attention output at position 17 (the tie
    above, now rounded down: 0.3515625 for 0.35351562), the attention's mHC exit at positions 4 and 17, layer 1's
    Engram output at position 14 — and on key 11 its decisions then part from this mode's at 19 (the served
    bf16 mode, compiled by the same XLA, still at 27). So where this mode flips first, the test requires
    the flip to come after a parting of the two runs' layer inputs that is a rounding tie, not an error: at
    most 4 elements at the first parting position, each one bf16 ulp (`parting.first_position_parting`;
    measured on 0.12.1: layer 1, position 14, 3 elements of 1 ulp). A wrong decision, or an activation off by
    more than a tie, still fails."""
    cfg = configs.micro()
    params = init_params(cfg, jax.random.key(0))
    bf = cfg.replace(impl="xla")
    step = jax.jit(lambda p, s, b: dec.extend(p, s, b, bf, CCFG, all_logits=True, return_aux=True))
    pad = int(np.asarray(params["derived"]["engram_token_map"])[cfg.engram_pad_token_id])
    flips = []
    for seq in seqs:
        ref, det = (jax.tree.map(np.asarray, FWD(params, jnp.asarray(seq[None]), c, return_aux=True)[1])
                    for c in (cfg.replace(impl="reference"), cfg.replace(impl="xla", deterministic=True)))
        st = kvc.reset_slots(kvc.init_cache(bf, CCFG), np.arange(CCFG.max_slots + 1), pad)
        alloc = kvc.PageAllocator(CCFG.num_pages, CCFG.page_size, CCFG.max_pages_per_seq)
        served = []
        for t in range(T):
            alloc.ensure("r", t + 1)
            b = dec.make_batch([{"tokens": [int(seq[t])], "start": t, "slot": 0, "page_table": alloc.pages("r")}],
                               1, 1, CCFG)
            _, st, aux = step(params, st, b)
            served.append({k: {l: np.asarray(v)[0, 0] for l, v in aux[k].items()} for k in ("topk", "experts")})
        flips.append((_first_flip(None, ref, 0, served), _first_flip(det, ref, 0),
                      parting.first_position_parting({l: v[0] for l, v in det["layer_inputs"].items()},
                                                     {l: v[0] for l, v in ref["layer_inputs"].items()})))
    assert all(b > 0 and d > 0 for b, d, _ in flips), flips  # (served bf16, this mode, first parting) per prompt
    for b, d, part in flips:
        if d < b:  # this mode's decisions part first: only after a rounding tie of the activations (docstring)
            assert part is not None and part[0] < d, flips
            assert len(part[2]) <= 4 and all(u == 1.0 for _, u in part[2]), flips


# ------------------------------------------------------------------------------------------- the cost
def test_bench_decode_reports_the_cost():
    """scripts/bench_decode.py --numerics bfloat16,deterministic (plumbing, no compile): the modes map to
    configs, and the cost pairs each bf16 case with its deterministic twin. The numbers come from running
    the script (docs/benchmarks.md)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "bench_decode", pathlib.Path(__file__).parents[1] / "scripts" / "bench_decode.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    tiny = ModelConfig.preset("tiny")
    assert mode_name(bd._with_numerics(tiny, "deterministic")) == "bfloat16+deterministic"
    assert mode_name(bd._with_numerics(tiny.replace(deterministic=True), "bfloat16")) == "bfloat16"
    cases = [{"impl": "xla", "batch": b, "max_context": 1024, "context": 64, "numerics": m, "step_ms": ms}
             for b, m, ms in ((1, "bfloat16", 2.0), (1, "bfloat16+deterministic", 3.0), (16, "bfloat16", 4.0))]
    assert bd.deterministic_cost(cases) == [{"impl": "xla", "batch": 1, "max_context": 1024, "context": 64,
                                             "bf16_ms": 2.0, "deterministic_ms": 3.0, "step_ratio": 1.5}]


# ------------------------------------------------------------------------------------------- the server
SERVE_FLAGS = ["--page-size", "16", "--context-length", "64", "--max-running-requests", "4", "--max-total-tokens",
               "128", "--chunked-prefill-size", "16", "--batch-buckets", "1,4", "--token-buckets", "16",
               "--decode-log-interval", "1000", "--enable-deterministic-inference"]  # `KW`'s shapes: compiled once
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"], "additionalProperties": False}


def _server_requests(n: int = 6):
    """n requests cycling through six kinds: greedy, seeded top-p, n = 2 sampling, streamed (token prompts of
    ragged lengths, logprobs), a json_schema chat and a seeded chat."""
    rng = np.random.default_rng(39)
    msg = [{"role": "user", "content": "Say something"}]
    out = []
    for i in range(n):
        ids = rng.integers(3, 300, int(rng.integers(3, 40))).tolist()
        kind = [
            ("/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 2}),
            ("/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7 + i,
                                 "logprobs": 2}),
            ("/v1/completions", {"prompt": ids, "max_tokens": 10, "temperature": 1.0, "seed": 8 + i, "n": 2,
                                 "logprobs": 2}),
            ("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1, "stream": True}),
            ("/v1/chat/completions", {"messages": msg, "max_tokens": 12, "temperature": 0, "logprobs": True,
                                      "top_logprobs": 2, "response_format": {"type": "json_schema",
                                                                             "json_schema": {"schema": SCHEMA}}}),
            ("/v1/chat/completions", {"messages": msg, "max_tokens": 8, "temperature": 0.7, "seed": 9 + i,
                                      "logprobs": True}),
        ][i % 6]
        out.append(kind)
    return out


def _answer(client, path, body):
    """What a client reads from one request: its choices (index, text / message, logprobs, finish)."""
    body = dict(body, model="micro")
    if not body.get("stream"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return [{k: v for k, v in c.items()} for c in r.json()["choices"]]
    out = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:])["choices"]
    return out


def _server_mixed_vs_alone(tmp_path, micro_dir, n):
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(tmp_path / "jax_cache")
    proc, base, logf = start_server(["--model", micro_dir, "--served-model-name", "micro"] + SERVE_FLAGS,
                                    tmp_path / "s.log", cache)
    reqs = _server_requests(n)
    try:
        with httpx.Client(base_url=base, timeout=600) as c:
            with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
                together = list(pool.map(lambda r: _answer(c, *r), reqs))
            alone = [_answer(c, *r) for r in reqs]
    finally:
        rc = stop_server(proc, logf)
    log = (tmp_path / "s.log").read_text()
    assert rc == 0 and "deterministic inference ON" in log, log[-2000:]
    assert together == alone
    assert json.loads(together[4][0]["message"]["content"])["a"] in ("x", "yy")
    assert len({c["text"] for c in together[2]}) == 2


def test_server_mixed_concurrent_equals_alone(tmp_path, micro_dir):
    """`serve --enable-deterministic-inference` (logged at start-up): six concurrent requests — ragged token
    prompts, greedy, seeded top-p and n = 2 sampling, a streamed one, a json_schema chat, logprobs — each
    answer equals the same request sent alone afterwards (text, tokens' logprobs, top logprobs, exact)."""
    _server_mixed_vs_alone(tmp_path, micro_dir, 6)


@pytest.mark.slow  # the same with 32 requests (the default version above has every kind once)
def test_server_32_mixed_concurrent_equals_alone(tmp_path, micro_dir):
    _server_mixed_vs_alone(tmp_path, micro_dir, 32)
