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
  7 of 8 samples' logprobs differ, by up to 2.9e-4 before the divergence.)
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from dsv41_jax.model import dispatch
from dsv41_jax.model.config import ConfigError, ModelConfig
from dsv41_jax.model.numerics import act_dtype, is_exact, mode_name
from dsv41_jax.serving import sampling as smp
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams


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
    assert dispatch._resolve("auto", "attention", "gpu", False) == "pallas"
    assert dispatch._resolve("auto", "attention", "gpu", True) == "xla"
    assert dispatch._resolve("attention=pallas", "attention", "gpu", True) == "pallas"  # refused at the seam
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
# One engine in the mode (micro: every mechanism of a step in 3 layers), two batch buckets and two token
# buckets, so a request alone runs in other compiled shapes (batch 1) and other prefill chunks than in a
# mixed batch (batch 4, chunks split by the shared 16-token budget), and an 8-page pool that a mixed run
# overflows (preemption, replay) while any request alone fits. The radix cache is on.
POOL = 128
KW = dict(model="tiny", page_size=16, context_length=64, max_running_requests=4, max_total_tokens=POOL,
          chunked_prefill_size=16, batch_buckets=[1, 4], token_buckets=[1, 16], decode_log_interval=1000,
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
