"""DeepSeek-V4 with data-parallel attention (`--enable-dp-attention --dp-size D`, issue 46 for V4's state) on the 8
host CPU devices (`cpu8`): micro-v4 (tests/configs.py: tiny-v4 cut to a sliding hash-routed, a CSA and an HCA
layer) in the exact numerics mode.

The engine on a [dp=4, tp=1] mesh — each rank's requests, window rings, CSA / HCA / indexer compressor projections
and pool pages in its own block (split over "dp" by `parallel.rules.DP_RULES`), one step program per rank
(`parallel.dp`), the MoE (hash-routed layers included: the table read on the rank's own token ids) reached by
all_to_all token dispatch — serves 8 concurrent mixed requests (greedy and seeded sampling with top-2 logprobs, a
shared 24-token prefix, ragged prompts, n = 2) and then a second turn that hits a rank's radix cache: each request
gets exactly the tokens and logprobs of the one-device engine (bitwise). dp=2 x tp=2 (heads over tp inside a rank,
the dispatch splitting a rank's rows over its tp devices) under ``-m slow``.

Plus: the reference MoE (plain experts, a hash-table row naming one expert twice) dispatched over a dp mesh ≡ one
device bitwise (`v4.moe.fold_repeats`); the dp step of a checkpoint without its MTP layer lowers; the refusals that
remain (speculation with dp, the forward on a dp mesh outside a rank's program).

Compile budget: the one-device engine with test_v4_mesh's / test_v4_engine's settings (its programs shared through
the suite's compilation cache) and one dp engine (one batch bucket, token buckets 1 and 16).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs

from dsv41_jax.model import forward, init_params
from dsv41_jax.model.v4 import moe as moe4
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import make_mesh
from dsv41_jax.parallel.plan import MeshPlan
from dsv41_jax.serving.engine import Engine, EngineError
from dsv41_jax.serving.sampling import SamplingParams

CFG = configs.micro_v4().replace(act_dtype="exact")
# 2 rows per rank: the one-device engine's batch (test_v4_engine's KW). The exact mode's fp32 elementwise chains
# depend on a program's row count at the last ulp (docs/design/serving.md): one device at 4 rows parts from 2 rows by
# up to 4.8e-7 in the logprobs (tokens equal), and dp=2 x tp=2 at 4 rows per rank by exactly the same amounts
# (measured on tiny-v4).
ROWS_PER_RANK = 2
DP_KW = dict(model="tiny", page_size=8, max_total_tokens=768, context_length=64, chunked_prefill_size=16,
             token_buckets=[16], skip_server_warmup=True, decode_log_interval=1000, enable_dp_attention=True)


@functools.lru_cache(maxsize=None)
def _params():
    return init_params(CFG, jax.random.key(0))


def _workload():
    """(prompts, sampling params): 3 prompts sharing a 24-token prefix (cutting CSA and HCA windows after it), 5
    ragged others; odd requests greedy, even ones seeded nucleus sampling, one n = 2; all with top-2 logprobs."""
    rng = np.random.default_rng(48)
    system = rng.integers(0, CFG.vocab_size, 24).tolist()
    prompts = [system + rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 11, 2)]
    prompts += [rng.integers(0, CFG.vocab_size, n).tolist() for n in (37, 9, 21, 3, 14)]
    sps = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=2) if i % 2 else
           SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=7, logprobs=2) for i in range(len(prompts))]
    sps[4] = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, logprobs=2)
    return prompts, sps


def _run(eng, prompts, sps, tag):
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"{tag}{i}", prompt_token_ids=p, sampling_params=sp)
    outs = {o.request_id: o for o in eng.run_until_done() if o.finished}
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


def _session(eng):
    """The workload together, then a second turn of the first conversation (its prompt + answer + 3 tokens): every
    request's [(tokens, logprobs, top_logprobs)] per completion, and the second turn's cached prompt tokens."""
    prompts, sps = _workload()
    outs = _run(eng, prompts, sps, "w")
    turn2 = prompts[0] + list(outs[0].outputs[0].token_ids) + [5, 6, 7]
    (t2,) = _run(eng, [turn2], [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)], "t")
    res = [[(c.token_ids, c.logprobs, c.top_logprobs) for c in o.outputs] for o in outs + [t2]]
    return res, t2.num_cached_tokens


@functools.lru_cache(maxsize=None)
def _one_device():
    from test_v4_engine import KW

    return _session(Engine(cfg=CFG, params=_params(), **KW))


def _check_dp(dp, tp):
    ref, _ = _one_device()
    rows = ROWS_PER_RANK * dp
    eng = Engine(cfg=CFG, params=_params(), dp_size=dp, tp_size=tp, max_running_requests=rows, batch_buckets=[rows],
                 **DP_KW)
    r = eng.runner
    assert r.model_step.family == "deepseek_v4" and dict(r.mesh.shape) == {"dp": dp, "tp": tp}
    assert r.par.moe_a2a_backend == "all_to_all"
    # V4's per-layer request state in rank blocks over "dp": rings, CSA / HCA projections, pools, index keys
    for leaf in (r.state["window"][0], r.state["partial"]["1"]["proj"]["kv"], r.state["partial"]["1"]["iproj"]["kv"],
                 r.state["comp"]["2"], r.state["ikeys"]["1"]):  # CSA layer 1 (its indexer's too), HCA layer 2
        assert leaf.sharding.spec[0] == "dp", leaf.sharding
    assert r.params["layers"][0]["ffn"]["experts"]["w1"].weight.sharding.spec[0] == (("dp", "tp") if tp > 1 else "dp")
    before = list(eng.scheduler.assigned)
    got, cached = _session(eng)
    assert got == ref
    assert len(got) == 9 and all(len(t) for c in got for t, _, _ in c)
    assert cached >= 24, cached  # the second turn restored a snapshot from its rank's radix cache
    assert sum(n > b for n, b in zip(eng.scheduler.assigned, before)) >= 2  # ranks other than one served requests


def test_engine_dp4_equals_one_device(cpu8):
    """--enable-dp-attention --dp-size 4 (micro-v4, exact mode): each of 9 mixed requests (greedy, seeded sampling, n
    = 2, a shared prefix, a radix-cache hit) gets the one-device engine's tokens and logprobs bit for bit."""
    _check_dp(4, 1)


@pytest.mark.slow
def test_engine_dp2_tp2_equals_one_device(cpu8):
    """The same on dp=2 x tp=2: heads over tp inside each rank, the experts over all 4 devices."""
    _check_dp(2, 2)


def test_dispatched_reference_moe_is_bitwise(cpu8):
    """`v4.moe.routed` with the reference (plain experts) and the tokens dispatched over a [dp=4, tp=2] mesh (experts
    over all 8 devices) ≡ one device bitwise, with hash-table rows naming one expert twice: the repeated slot's
    weight folded into its first (`fold_repeats`), as the one-device reference sums them."""
    from test_v4_mesh import check_reference_moe_bitwise

    idx, w, par = check_reference_moe_bitwise(lambda cfg: make_mesh(2, 1, dp=4, cfg=cfg))
    assert par.moe_a2a_backend == "all_to_all"
    folded = np.asarray(moe4.fold_repeats(idx, w))
    assert folded[1, 1] == 0 and folded[1, 0] == np.float32(w[1, 0] + w[1, 1]) and folded[0, 1] == w[0, 1]


def test_what_dp_does_not_run_is_refused(cpu8):
    """One line each: MTP / DSpark speculation with --dp-size > 1, the full-sequence forward on a dp mesh (outside a
    rank's program, where only the paged step runs)."""
    from test_v4_engine import KW

    with pytest.raises(EngineError, match="not supported with --speculative-algorithm EAGLE with --dp-size 2"):
        Engine(cfg=CFG, params=_params(), dp_size=2, enable_dp_attention=True, speculative_algorithm="EAGLE",
               speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3, **KW)
    mesh = make_mesh(2, 1, dp=2, cfg=CFG)
    with pytest.raises(NotImplementedError, match="on a data-parallel mesh: only the paged step"):
        forward(_params(), np.zeros((2, 8), np.int32), CFG, par=MeshPlan.of(mesh))


def test_dp_step_lowers_without_the_mtp_layer(cpu8):
    """A V4 checkpoint without its MTP layer (transformers' `save_pretrained`: params["mtp"] = []) on a dp mesh: the
    rank program's parameter specs follow the params as given (`parallel.dp`), so the step lowers (traced only)."""
    from dsv41_jax.model.cache import CacheConfig
    from dsv41_jax.model.v4 import decode as dec4

    mesh = make_mesh(1, 1, dp=2, cfg=CFG)
    ccfg = CacheConfig(page_size=8, num_pages=8, max_slots=2, max_pages_per_seq=2, dp=2)
    params = dict(rules.param_shapes(CFG, mesh), mtp=[])
    state = jax.eval_shape(lambda: rules.zero_cache(CFG, ccfg))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    batch = {"tokens": i32(2, 4), "start": i32(2), "n_new": i32(2), "slot": i32(2), "page_table": i32(2, 2)}
    text = dec4.jitted_extend(CFG, ccfg, False, MeshPlan.of(mesh)).lower(params, state, batch).as_text()
    assert "all_to_all" in text  # the MoE dispatched
