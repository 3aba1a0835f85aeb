"""DeepSeek-V4's paged step (model/v4/decode.py) ≡ its forward in the exact mode, on micro-v4 (tests/configs.py:
tiny-v4 cut to one sliding hash-routed, one CSA and one HCA layer): two ragged rows, a prefill chunk, then chunks of
7 and single decode tokens (or token by token from the start): every decision (CSA top-k, experts) identical and the
logits to the last fp32 bits, with the compressor state carried across chunk boundaries that cut windows (CSA ratio
4, HCA ratio 8) anywhere. Measured on tiny-v4: bit for bit at XLA's default CPU flags; at the suite's -O0
(tests/conftest.py) the step's elementwise chains compile differently per chunk shape and the logits move by up to
~1.1e-6 (the exact mode is order-independent in its sums, not in XLA's fp32 transcendentals: numerics)."""

import functools

import jax
import numpy as np
import pytest

import configs

from dsv41_jax.model import forward, init_params
from dsv41_jax.model.cache import CacheConfig
from dsv41_jax.model.v4 import decode as dec4

CFG = configs.micro_v4().replace(act_dtype="exact")
CCFG = CacheConfig(page_size=16, num_pages=16, max_slots=2, max_pages_per_seq=6)
LENS = (72, 61)


@functools.lru_cache(maxsize=None)
def _setup():
    params = init_params(CFG, jax.random.key(0))
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, max(LENS))).astype(np.int32)
    logits, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(params, tokens, CFG, return_aux=True)
    return params, tokens, np.asarray(logits), jax.tree_util.tree_map(np.asarray, aux)


def _run_cached(params, tokens, chunks):
    """Feed each row its tokens in chunks of the sizes `chunks` (cycled); returns (logits [2, L, V], topk
    {layer: [2, L, k]}, experts {layer: [2, L, k]}) gathered at the real positions."""
    step = jax.jit(dec4.extend, static_argnames=("cfg", "ccfg", "return_aux"))
    state = dec4.init_state(CFG, CCFG)
    P = CCFG.max_pages_per_seq
    page_table = np.stack([1 + b * P + np.arange(P) for b in range(2)]).astype(np.int32)
    scratch = CCFG.max_slots
    done = [0, 0]
    logits = np.zeros((2, max(LENS), CFG.vocab_size), np.float32)
    dec = {"topk": {}, "experts": {}}
    k = 0
    while any(d < n for d, n in zip(done, LENS)):
        T = chunks[k] if k < len(chunks) else chunks[1 + (k - 1) % (len(chunks) - 1)]  # the first once, then cycle
        k += 1
        n_new = np.array([min(T, n - d) for d, n in zip(done, LENS)], np.int32)
        chunk = np.zeros((2, T), np.int32)
        for b in range(2):
            chunk[b, :n_new[b]] = tokens[b, done[b]:done[b] + n_new[b]]
        batch = {"tokens": chunk, "start": np.array(done, np.int32), "n_new": n_new,
                 "slot": np.array([b if n_new[b] else scratch for b in range(2)], np.int32), "page_table": page_table}
        lg, state, aux = step(params, state, batch, CFG, CCFG, return_aux=True)
        lg, aux = np.asarray(lg), jax.tree_util.tree_map(np.asarray, aux)
        for b in range(2):
            sl = slice(done[b], done[b] + n_new[b])
            logits[b, sl] = lg[b, :n_new[b]]
            for kind in dec:
                for lid, v in aux[kind].items():
                    out = dec[kind].setdefault(lid, np.full((2, max(LENS), v.shape[-1]), -7, np.int32))
                    out[b, sl] = v[b, :n_new[b]]
            done[b] += int(n_new[b])
    return logits, dec


@pytest.mark.parametrize("chunks", [(19, 7, 1, 1), (1, 1)], ids=["prefill-chunks-decode", "token-by-token"])
def test_cached_steps_equal_the_forward(chunks):
    params, tokens, ref_logits, ref = _setup()
    logits, dec = _run_cached(params, tokens, chunks)
    for b, n in enumerate(LENS):
        np.testing.assert_allclose(logits[b, :n], ref_logits[b, :n], atol=1e-5, rtol=0)
        for kind in dec:
            assert sorted(dec[kind]) == sorted(ref[kind]), kind
            for lid in dec[kind]:
                assert np.array_equal(dec[kind][lid][b, :n], ref[kind][lid][b, :n]), (kind, lid, b)


def test_cache_options_v4_lacks_are_refused():
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        dec4.init_state(CFG, CCFG.replace(kv_cache_dtype="fp8_e4m3"))
