"""The deterministic numerics mode (issue 38; `ModelConfig.deterministic`, the server's
--enable-deterministic-inference): the reference's bf16 dtype flow with every order-sensitive sum
accumulated in fp64 (model/numerics.py), a sampler whose sums are fp64 too, Pallas kernels refused.

What the mode promises, and where it is checked here:
* the switch itself: config field, dispatch ("auto" -> "xla", explicit Pallas refused), engine flag;
* the sampler: a row's tokens and logprobs do not depend on the other rows;
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import dispatch
from dsv41_jax.model.config import ConfigError, ModelConfig
from dsv41_jax.model.numerics import act_dtype, is_exact, mode_name
from dsv41_jax.serving import sampling as smp
from dsv41_jax.serving.engine_args import EngineArgs


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
