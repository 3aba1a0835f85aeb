"""On-device sampling and speculative verification (dsv41_jax/serving/sampling.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.serving.sampling import (
    SamplingParams,
    SamplingParamsError,
    SamplingTensors,
    apply_penalties,
    greedy_verify,
    processed_probs,
    sample,
    sample_jit,
    seed_to_key_data,
    spec_verify,
    speculative_sample_verify,
    step_keys,
    stop_token_hit,
    target_verify_logits,
    update_counts,
)

EOS = 1

# jitted once here: eager (op-by-op) dispatch would dominate the test time
update_counts = jax.jit(update_counts)
apply_penalties = jax.jit(apply_penalties)
processed_probs = jax.jit(processed_probs)
greedy_verify = jax.jit(greedy_verify)
speculative_sample_verify = jax.jit(speculative_sample_verify)
target_verify_logits = jax.jit(target_verify_logits)
spec_verify = jax.jit(spec_verify)
step_keys = jax.jit(step_keys)
stop_token_hit = jax.jit(stop_token_hit)


# Compilation (threefry especially) dominates on CPU, so the tests share a few shapes: small batches
# are padded to SMALL_B slots, statistical checks use N rows over a vocabulary of VS (short
# distributions are padded with -inf logits, which also exercises masked logits).
SMALL_B, N, VS = 8, 4096, 16


def _tensors(params, V, pad_to=None, **kw):
    return SamplingTensors.from_params(params, V, pad_to, **kw)


def _run(logits, params, steps, pad_to=SMALL_B, **kw):
    """Sample once; logits [b, V] (np) and steps (b ints) are padded to ``pad_to`` rows."""
    logits = np.asarray(logits, np.float32)
    b, V = logits.shape
    B = max(b, pad_to or b)
    full = np.zeros((B, V), np.float32)
    full[:b] = logits
    st = np.zeros(B, np.int32)
    st[:b] = steps
    t = _tensors(params, V, B, **kw)
    tok, lp, top = sample_jit(jnp.asarray(full), t, jnp.asarray(st))
    return np.asarray(tok)[:b], np.asarray(lp)[:b], (np.asarray(top[0])[:b], np.asarray(top[1])[:b])


def _pad_row(row, V=VS):
    out = np.full(V, -np.inf, np.float32)
    out[: len(row)] = row
    return out


def _many(logits_row, params_fn, step=0):
    """N samples of one distribution (padded to VS), one row per seed (seed i for row i)."""
    logits = np.broadcast_to(_pad_row(logits_row), (N, VS))
    tok, _, _ = _run(logits, [params_fn(i) for i in range(N)], [step] * N)
    return tok


# --------------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------------

BAD = [
    ("n", dict(n=0)), ("temperature", dict(temperature=-0.5)), ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)), ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)), ("min_p", dict(min_p=1.5)), ("seed", dict(seed="x")),
    ("presence_penalty", dict(presence_penalty=2.5)), ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0.0)), ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[3])), ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("max_tokens", dict(max_tokens=0)), ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=10, max_tokens=5)), ("logprobs", dict(logprobs=-1)),
    ("ignore_eos", dict(ignore_eos="yes")),
]


@pytest.mark.parametrize("field,kw", BAD)
def test_validate_names_field(field, kw):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kw)
    assert isinstance(ei.value, SamplingParamsError) and ei.value.field == field
    assert field in str(ei.value)


def test_validate_engine_limits_and_normalisation():
    p = SamplingParams(stop="###", logprobs=5, top_k=0, seed=-3)
    assert p.stop == ["###"] and p.stop_token_ids == []
    with pytest.raises(SamplingParamsError) as ei:
        p.validate(max_logprobs=2)
    assert ei.value.field == "logprobs"
    with pytest.raises(SamplingParamsError) as ei:
        SamplingParams(stop_token_ids=[400]).validate(vocab_size=320)
    assert ei.value.field == "stop_token_ids"
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(stop_token_ids=[7]).all_stop_token_ids([EOS]) == [7, EOS]
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids([EOS]) == [7]


# --------------------------------------------------------------------------------------------------
# Greedy, top-k, top-p, min-p
# --------------------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax_ties_to_lower_id():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 64)).astype(np.float32)
    logits[3, [7, 11, 40]] = 100.0  # tie
    tok, _, _ = _run(logits, [SamplingParams(temperature=0, seed=i) for i in range(8)], [0] * 8)
    want = np.argmax(logits, axis=-1)
    assert want[3] == 7
    np.testing.assert_array_equal(tok, want)


def test_top_k_1_is_greedy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(N, VS)).astype(np.float32)
    tok, _, _ = _run(logits, [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(N)], [3] * N)
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    free, _, _ = _run(logits, [SamplingParams(temperature=1.5, seed=i) for i in range(N)], [3] * N)
    assert (free != np.argmax(logits, -1)).sum() > N // 2  # the check above is not vacuous


def test_top_p_small_keeps_only_top_token():
    row = np.log(np.array([0.3, 0.25, 0.25, 0.2], np.float32))
    tok = _many(row, lambda i: SamplingParams(top_p=0.01, seed=i))
    assert set(tok.tolist()) == {0}
    tok = _many(row, lambda i: SamplingParams(seed=i))
    assert len(set(tok.tolist())) == 4


def _probs(row, **kw):
    """The processed distribution of one row (padded to SMALL_B x VS, so one compilation serves all)."""
    t = _tensors([SamplingParams(**kw)], VS, SMALL_B)
    logits = np.zeros((SMALL_B, VS), np.float32)
    logits[0] = _pad_row(row)
    pr = np.asarray(processed_probs(jnp.asarray(logits), t, jnp.zeros(SMALL_B, jnp.int32)))[0]
    assert np.all(pr[len(row):] == 0)
    return pr[: len(row)]


def test_filtered_distribution_deterministic():
    p = np.array([0.5, 0.25, 0.15, 0.1])
    row = np.log(p).astype(np.float32)
    np.testing.assert_allclose(_probs(row), p, atol=1e-6)
    np.testing.assert_allclose(_probs(row, top_k=3), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=1e-6)
    np.testing.assert_allclose(_probs(row, top_p=0.7), [2 / 3, 1 / 3, 0, 0], atol=1e-6)
    np.testing.assert_allclose(_probs(row, top_p=0.8), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=1e-6)
    # top_p acts on the distribution renormalised after top_k: 0.5/0.9 + 0.25/0.9 = 0.833 >= 0.8
    np.testing.assert_allclose(_probs(row, top_k=3, top_p=0.8), [2 / 3, 1 / 3, 0, 0], atol=1e-6)
    # min_p: keep p >= min_p * p_max
    np.testing.assert_allclose(_probs(row, min_p=0.25), [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=1e-6)
    np.testing.assert_allclose(_probs(row, min_p=0.4), [2 / 3, 1 / 3, 0, 0], atol=1e-6)
    # temperature sharpens before filtering: p^2 normalised
    p2 = p ** 2 / (p ** 2).sum()
    np.testing.assert_allclose(_probs(row, temperature=0.5), p2, atol=1e-6)
    # greedy: one-hot
    np.testing.assert_allclose(_probs(row, temperature=0), [1, 0, 0, 0])
    # top_k ties: exactly k tokens, lower id first
    np.testing.assert_allclose(_probs(np.zeros(4, np.float32), top_k=2), [0.5, 0.5, 0, 0])


def _ref_filter(x, k, p, mp):
    """numpy float64 reference of top_k (stable) → top_p (tie-inclusive, renormalised) → min_p."""
    x = x.astype(np.float64).copy()
    V = len(x)
    if 0 < k < V:
        x[np.argsort(-x, kind="stable")[k:]] = -np.inf
    if p < 1:
        pr = np.exp(x - x.max())
        pr /= pr.sum()
        above = np.array([pr[x > v].sum() for v in x])
        keep = (above < p) | (x == x.max())
        x[~keep] = -np.inf
    if mp > 0:
        pr = np.exp(x - x.max())
        x[pr < mp] = -np.inf
    return np.isfinite(x)


def test_filter_matches_reference_on_both_paths():
    """Rows served by the top-CANDIDATES fast path and rows needing the exact bisection fallback
    (top_k > CANDIDATES, or a top_p set larger than CANDIDATES) against a numpy reference, and
    each row's result independent of the other rows."""
    from dsv41_jax.serving import sampling as S

    V, R = 512, 16
    assert V > S.CANDIDATES
    rng = np.random.default_rng(11)
    x = rng.normal(size=(R, V)) * 3
    x[0:4] = np.round(x[0:4] * 2) / 2  # many ties
    x[8:12] *= 0.05  # flat: top_p sets larger than CANDIDATES
    x = x.astype(np.float32)
    k = np.array([7, 1, 300, 0, 20, 0, 300, 400, 0, 300, 50, 0, 3, 260, 0, 256], np.int32)
    p = np.array([1, .9, 1, .5, .95, .99, .9, .8, .9, .95, 1, .7, .6, 1, .999, .97], np.float32)
    mp = np.array([0, 0, 0, 0, 0, 0.1, 0, 0, 0, 0, 0.3, 0, 0, 0, 0, 0.01], np.float32)
    filt = jax.jit(S._filter)
    got = np.isfinite(np.asarray(filt(jnp.asarray(x), jnp.asarray(k), jnp.asarray(p), jnp.asarray(mp))))
    for r in range(R):
        want = _ref_filter(x[r], k[r], p[r], mp[r])
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")
    assert got[8].sum() > S.CANDIDATES and got[2].sum() == 300  # the fallback paths were exercised
    # the fast rows alone (no row needs a fallback) give the same masks
    fast = np.array([0, 1, 3, 4, 5, 10, 12, 14, 15])
    k2, p2 = k.copy(), p.copy()
    slow = np.setdiff1d(np.arange(R), fast)
    k2[slow], p2[slow] = 0, 1.0
    got2 = np.isfinite(np.asarray(filt(jnp.asarray(x), jnp.asarray(k2), jnp.asarray(p2), jnp.asarray(mp))))
    np.testing.assert_array_equal(got2[fast], got[fast])


def test_min_p_removes_low_probability_tokens_statistically():
    p = np.array([0.45, 0.3, 0.13, 0.12])
    row = np.log(p).astype(np.float32)
    n = N
    tok = _many(row, lambda i: SamplingParams(min_p=0.35, seed=i))  # threshold 0.1575
    counts = np.bincount(tok, minlength=4)
    assert counts[2] == 0 and counts[3] == 0
    assert abs(counts[0] / n - 0.6) < 0.03
    base = np.bincount(_many(row, lambda i: SamplingParams(seed=i)), minlength=4)
    assert base[2] > 300 and base[3] > 300  # without min_p they are frequent


def test_empirical_distribution_matches_processed():
    rng = np.random.default_rng(2)
    row = rng.normal(size=12).astype(np.float32) * 1.5
    kw = dict(temperature=0.8, top_k=6, top_p=0.95, min_p=0.05)
    want = _probs(row, **kw)
    tok = _many(row, lambda i: SamplingParams(seed=1000 + i, **kw), step=5)
    emp = np.bincount(tok, minlength=VS)[:12] / N
    assert np.all(emp[want == 0] == 0)
    assert 0.5 * np.abs(emp - want).sum() < 0.03


# --------------------------------------------------------------------------------------------------
# Seeds and keys
# --------------------------------------------------------------------------------------------------


def test_step_key_is_fold_in_of_seed():
    for seed in (0, 7, 123456, 2**31 - 1):
        t = _tensors([SamplingParams(seed=seed)], 8, pad_to=2)
        k = step_keys(t, jnp.array([5, 0], jnp.int32))
        want = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 5)
        np.testing.assert_array_equal(jax.random.key_data(k[0]), jax.random.key_data(want))
    assert seed_to_key_data(2**40 + 3).tolist() == [2**8, 3]


def test_seed_reproducible_independent_of_batch_position_and_size():
    V = 64
    req = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    rng = np.random.default_rng(3)
    req_logits = [rng.normal(size=V).astype(np.float32) for _ in range(6)]
    others = [SamplingParams(temperature=1.0 + 0.1 * j, seed=50 + j, top_k=5) for j in range(7)]
    alone, batched = [], []
    for i, lg in enumerate(req_logits):
        tok, _, _ = _run(lg[None], [req], [i], pad_to=None)  # batch of 1
        alone.append(int(tok[0]))
        big = rng.normal(size=(8, V)).astype(np.float32)
        big[5] = lg
        params8 = others[:5] + [req] + others[5:]
        steps8 = [int(s) for s in rng.integers(0, 50, size=8)]
        steps8[5] = i
        tok8, _, _ = _run(big, params8, steps8)
        batched.append(int(tok8[5]))
    assert alone == batched


def test_different_seeds_differ():
    V = 64
    logits = np.zeros((8, V), np.float32)
    a = _run(logits, [SamplingParams(seed=1)] * 8, list(range(8)))[0]
    b = _run(logits, [SamplingParams(seed=2)] * 8, list(range(8)))[0]
    a2 = _run(logits, [SamplingParams(seed=1)] * 8, list(range(8)))[0]
    np.testing.assert_array_equal(a, a2)
    assert (a != b).sum() >= 5
    assert len(set(a.tolist())) > 4  # the step index changes the key


def test_n3_children_give_three_different_samples():
    parent = SamplingParams(n=3, seed=7, temperature=1.0)
    kids = parent.child_params()
    assert [k.seed for k in kids] == [7, 8, 9] and all(k.n == 1 for k in kids)
    V = 64
    logits = np.zeros((3, V), np.float32)
    seqs = [tuple(_run(logits, kids, [i] * 3)[0].tolist()) for i in range(6)]
    per_child = list(zip(*seqs))
    assert len(set(per_child)) == 3
    again = [tuple(_run(logits, parent.child_params(), [i] * 3)[0].tolist()) for i in range(6)]
    assert again == seqs
    # seed=None: each child its own random seed, fixed once resolved
    r = SamplingParams(n=2).child_params()[0].with_resolved_seed()
    assert isinstance(r.seed, int) and r.with_resolved_seed().seed == r.seed
    x = _run(np.zeros((1, V), np.float32), [r], [0])[0]
    y = _run(np.zeros((1, V), np.float32), [r], [0])[0]
    assert x[0] == y[0]


# --------------------------------------------------------------------------------------------------
# Penalties, min_tokens, EOS
# --------------------------------------------------------------------------------------------------


def test_presence_and_frequency_penalties():
    V, B = VS, SMALL_B

    def vec(**entries):
        out = np.zeros(V)
        for i, v in entries.items():
            out[int(i[1:])] = v
        return out

    t = _tensors([SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.5),
                  SamplingParams(presence_penalty=-0.5)], V, B, prompt_token_ids=[[2]] * 3)
    gen = np.full((B, 3), -1, np.int32)
    gen[:3] = [[3, 3, 5], [3, 3, 5], [3, -1, -1]]
    t = update_counts(t, jnp.asarray(gen))
    np.testing.assert_array_equal(np.asarray(t.output_counts)[0], vec(t3=2, t5=1))
    out = np.asarray(apply_penalties(jnp.zeros((B, V), jnp.float32), t))
    np.testing.assert_allclose(out[0], vec(t3=-0.5, t5=-0.5))  # once per seen token; prompt token 2 not
    np.testing.assert_allclose(out[1], vec(t3=-1.0, t5=-0.5))  # per occurrence
    np.testing.assert_allclose(out[2], vec(t3=0.5))  # negative encourages
    pr = np.asarray(processed_probs(jnp.zeros((B, V)), t, jnp.zeros(B, jnp.int32)))
    assert pr[0, 3] < 1 / V < pr[0, 0] and pr[1, 3] < pr[1, 5] < pr[1, 0] and pr[2, 3] > 1 / V


def test_repetition_penalty_as_vllm():
    logits = jnp.array([[2.0, -2.0, 2.0, -2.0, 1.0, -1.0]])
    t = _tensors([SamplingParams(repetition_penalty=2.0)], 6, prompt_token_ids=[[0, 1]],
                 output_token_ids=[[4, 5]])
    out = np.asarray(apply_penalties(logits, t))[0]
    np.testing.assert_allclose(out, [1.0, -4.0, 2.0, -2.0, 0.5, -2.0])
    t = _tensors([SamplingParams(repetition_penalty=2.0)], 6)
    np.testing.assert_allclose(np.asarray(apply_penalties(logits, t))[0], np.asarray(logits)[0])


def test_penalties_change_greedy_output():
    V, B = 64, SMALL_B
    logits = np.zeros((B, V), np.float32)
    logits[:, 3], logits[:, 4] = 1.0, 0.9
    logits = jnp.asarray(logits)
    for kw in (dict(presence_penalty=0.5), dict(frequency_penalty=0.2), dict(repetition_penalty=1.5)):
        t = _tensors([SamplingParams(temperature=0, **kw)], V, B)
        assert int(sample_jit(logits, t, jnp.zeros(B, jnp.int32))[0][0]) == 3
        t = update_counts(t, jnp.full(B, 3))
        assert int(sample_jit(logits, t, jnp.ones(B, jnp.int32))[0][0]) == 4, kw
    t = update_counts(_tensors([SamplingParams(temperature=0)], V, B), jnp.full(B, 3))
    assert int(sample_jit(logits, t, jnp.ones(B, jnp.int32))[0][0]) == 3


def test_update_counts_ignores_padding():
    t = _tensors([SamplingParams()], 5, pad_to=2)
    t = update_counts(t, jnp.array([[2, 2, -1], [1, 1, 1]]))
    t = update_counts(t, jnp.array([4, 4]), valid=jnp.array([False, True]))
    np.testing.assert_array_equal(np.asarray(t.output_counts), [[0, 0, 2, 0, 0], [0] * 5])


def test_min_tokens_blocks_eos_and_stop_ids():
    V = 64
    logits = np.zeros((1, V), np.float32)
    logits[0, EOS] = 20.0
    logits[0, 4] = 10.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4])
    got = [int(_run(logits, [p], [i], eos_token_ids=[EOS])[0][0]) for i in range(5)]
    assert got[:3] == [0, 0, 0] and got[3:] == [EOS, EOS]  # blocked: best of the rest, lowest id
    # sampled rows too: no stop token before min_tokens over many seeds
    row = np.zeros(VS, np.float32)
    row[EOS] = 3.0
    tok = _run(np.broadcast_to(row, (N, VS)), [SamplingParams(min_tokens=2, seed=i) for i in range(N)],
               [1] * N, eos_token_ids=[EOS])[0]
    assert EOS not in tok.tolist()
    tok = _run(np.broadcast_to(row, (N, VS)), [SamplingParams(min_tokens=2, seed=i) for i in range(N)],
               [2] * N, eos_token_ids=[EOS])[0]
    assert (tok == EOS).sum() > N // 3
    # ignore_eos: EOS is not a stop token, hence neither masked nor reported
    ign = [SamplingParams(temperature=0, min_tokens=3, ignore_eos=True), SamplingParams()]
    assert int(_run(logits, ign[:1], [0], eos_token_ids=[EOS])[0][0]) == EOS
    t = _tensors(ign, V, eos_token_ids=[EOS])
    np.testing.assert_array_equal(np.asarray(stop_token_hit(t, jnp.array([EOS, EOS]))), [False, True])


# --------------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------------


def test_logprobs_raw_and_processed():
    rng = np.random.default_rng(4)
    B = SMALL_B
    logits = rng.normal(size=(B, 64)).astype(np.float32)
    params = [SamplingParams(temperature=0.5, presence_penalty=1.0, seed=1),
              SamplingParams(temperature=0), SamplingParams(top_k=1, seed=3)]
    t = update_counts(_tensors(params, 64, B), jnp.asarray(np.argmax(logits, -1)))
    tok, lp, (ids, vals) = sample_jit(jnp.asarray(logits), t, jnp.ones(B, jnp.int32))  # K = 20
    raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    assert ids.shape == (B, 20)
    np.testing.assert_allclose(np.asarray(lp), raw[np.arange(B), np.asarray(tok)], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-raw, -1, kind="stable")[:, :20])
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-raw, -1)[:, :20], rtol=1e-5)
    _, lp2, (_, vals2) = sample_jit(jnp.asarray(logits), t, jnp.ones(B, jnp.int32), max_logprobs=2,
                                    logprobs_mode="processed")
    assert vals2.shape == (B, 2)
    assert abs(float(lp2[2])) < 1e-6 and float(vals2[2, 1]) == -np.inf  # top_k=1: all mass on one token
    assert float(lp2[0]) != pytest.approx(float(lp[0]))


# --------------------------------------------------------------------------------------------------
# jit: one compilation per batch shape
# --------------------------------------------------------------------------------------------------


def test_sample_compiles_once_for_fixed_shape():
    traces = []

    def f(logits, t, steps):
        traces.append(1)
        return sample(logits, t, steps)

    jf = jax.jit(f)
    V, B = 40, 4
    rng = np.random.default_rng(5)
    batches = [
        [SamplingParams(temperature=0)],
        [SamplingParams(seed=3, top_k=5, presence_penalty=0.3), SamplingParams(top_p=0.5), None],
        [SamplingParams(min_p=0.2, repetition_penalty=1.3, stop_token_ids=[5], min_tokens=2)] * 4,
    ]
    t = None
    for i, params in enumerate(batches):
        t = _tensors(params, V, pad_to=B, prompt_token_ids=[[1, 2]] * len(params), eos_token_ids=[EOS])
        out = jf(jnp.asarray(rng.normal(size=(B, V)), jnp.float32), t, jnp.full(B, i, jnp.int32))
        t = update_counts(t, out[0])
    t = t.update_slots([1, 3], [SamplingParams(seed=9), None], prompt_token_ids=[[4], None])
    jf(jnp.asarray(rng.normal(size=(B, V)), jnp.float32), t, jnp.arange(B, dtype=jnp.int32))
    assert len(traces) == 1


def test_update_slots_equals_from_params():
    V = 12
    a = [SamplingParams(seed=1, top_k=3), SamplingParams(seed=2, presence_penalty=1.0), None]
    b = [SamplingParams(seed=5, temperature=0.3, stop_token_ids=[4]), a[1], SamplingParams(seed=6)]
    kw_a = dict(prompt_token_ids=[[1], [2], None], eos_token_ids=[EOS])
    t = _tensors(a, V, **kw_a).update_slots([0, 2], [b[0], b[2]], prompt_token_ids=[[3], [7, 8]],
                                            output_token_ids=[[5, 5], None], eos_token_ids=[EOS])
    want = _tensors(b, V, prompt_token_ids=[[3], [2], [7, 8]], output_token_ids=[[5, 5], [], []],
                    eos_token_ids=[EOS])
    for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------------------------------
# Speculative verification
# --------------------------------------------------------------------------------------------------


def _onehot_logits(targets, V=10):
    targets = np.asarray(targets)
    out = np.zeros(targets.shape + (V,), np.float32)
    np.put_along_axis(out, targets[..., None], 5.0, axis=-1)
    return jnp.asarray(out)


def test_greedy_verify_hand_cases():
    target = [[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [4, 4, 4, 4]]
    draft = [[5, 6, 7], [5, 6, 7], [9, 2, 3], [4, 4, 0]]
    n, toks = greedy_verify(jnp.array(draft), _onehot_logits(target))
    np.testing.assert_array_equal(np.asarray(n), [3, 1, 0, 2])
    np.testing.assert_array_equal(np.asarray(toks), [[5, 6, 7, 8], [5, 9, -1, -1], [1, -1, -1, -1],
                                                     [4, 4, 4, -1]])


def _chi2(counts, p):
    n = counts.sum()
    m = p > 0
    assert counts[~m].sum() == 0
    e = n * p[m]
    return float(((counts[m] - e) ** 2 / e).sum())


SPEC_V, SPEC_G, SPEC_N = 5, 3, 20000  # one shape for all speculative_sample_verify calls (one compile)
SPEC_KEYS = np.stack([seed_to_key_data(s) for s in range(SPEC_N)])


def _ssv(draft, q, p):
    n, t = speculative_sample_verify(jnp.asarray(draft, jnp.int32), jnp.asarray(q, jnp.float32),
                                     jnp.asarray(p, jnp.float32), jnp.asarray(SPEC_KEYS))
    return np.asarray(n), np.asarray(t)


def test_speculative_sample_verify_is_lossless():
    V, G, N = SPEC_V, SPEC_G, SPEC_N
    rng = np.random.default_rng(6)
    p = rng.dirichlet(np.ones(V) * 2, size=G + 1).astype(np.float32)  # [G+1, V], context-free target
    q = rng.dirichlet(np.ones(V) * 2, size=G).astype(np.float32)
    draft = np.stack([rng.choice(V, size=N, p=q[j] / q[j].sum()) for j in range(G)], 1).astype(np.int32)
    n_acc, toks = _ssv(draft, np.broadcast_to(q, (N, G, V)), np.broadcast_to(p, (N, G + 1, V)))
    # acceptance of the first draft: sum_x min(p, q)
    assert abs((n_acc >= 1).mean() - np.minimum(p[0], q[0]).sum()) < 0.01
    # committed layout: accepted drafts, one extra token, -1 after
    for r in range(50):
        k = n_acc[r]
        assert (toks[r, :k] == draft[r, :k]).all() and toks[r, k] >= 0 and (toks[r, k + 1:] == -1).all()
    # position j's token, given it is emitted, is distributed as p_j (df = 4: chi2 0.9999 quantile 23.5)
    for j in range(G + 1):
        sel = n_acc >= j
        assert sel.sum() > 2000
        counts = np.bincount(toks[sel, j], minlength=V)
        assert _chi2(counts, p[j] / p[j].sum()) < 23.5, j
        # the draft's own distribution is rejected by the same test (the check has power)
        if j < G:
            assert _chi2(np.bincount(draft[sel, j], minlength=V), p[j] / p[j].sum()) > 100
    # greedy (one-hot) draft proposals are also verified losslessly
    d = np.broadcast_to(np.argmax(q, -1).astype(np.int32), (N, G))
    n1, t1 = _ssv(d, np.asarray(jax.nn.one_hot(d, V)), np.broadcast_to(p, (N, G + 1, V)))
    assert _chi2(np.bincount(t1[:, 0], minlength=V), p[0] / p[0].sum()) < 23.5
    sel = n1 >= 1
    assert _chi2(np.bincount(t1[sel, 1], minlength=V), p[1] / p[1].sum()) < 23.5


def test_speculative_sample_verify_edge_cases():
    V, G, N = SPEC_V, SPEC_G, SPEC_N
    p = np.tile(np.array([0.1, 0.2, 0.3, 0.25, 0.15], np.float32), (N, G + 1, 1))
    draft = np.tile(np.array([[2, 3, 1]], np.int32), (N, 1))
    n, toks = _ssv(draft, p[:, :G], p)  # q == p: always accept, bonus from p
    assert (n == G).all() and (toks[:, :G] == draft).all()
    assert _chi2(np.bincount(toks[:, G], minlength=V), p[0, 0]) < 23.5
    q = np.zeros((N, G, V), np.float32)
    q[..., 0] = 1.0
    p0 = p.copy()
    p0[..., 0] = 0.0  # disjoint: q only on token 0, p never
    n, toks = _ssv(np.zeros((N, G), np.int32), q, p0)
    assert (n == 0).all() and (toks[:, 0] > 0).all() and (toks[:, 1:] == -1).all()


def test_target_verify_logits_equal_sequential_penalties():
    V, G, B = 9, 3, 3
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(B, G + 1, V)).astype(np.float32) * 2
    draft = np.array([[3, 3, 5], [1, 2, 1], [0, 4, 4]], np.int32)
    params = [SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.7),
              SamplingParams(repetition_penalty=0.6, min_tokens=2, stop_token_ids=[2]),
              SamplingParams(frequency_penalty=-0.5)]
    t = _tensors(params, V, prompt_token_ids=[[1], [0, 8], []], output_token_ids=[[3], [], [4]])
    steps = jnp.array([0, 0, 4], jnp.int32)
    got = np.asarray(target_verify_logits(jnp.asarray(logits), jnp.asarray(draft), t, steps))
    tj = t
    for j in range(G + 1):
        want = np.asarray(apply_penalties(jnp.asarray(logits[:, j]), tj))
        block = (np.asarray(steps) + j < np.asarray(t.min_tokens))[:, None] & np.asarray(t.stop_mask)
        want = np.where(block, -np.inf, want)
        np.testing.assert_allclose(got[:, j], want, rtol=1e-6, err_msg=f"row {j}")
        if j < G:
            tj = update_counts(tj, jnp.asarray(draft[:, j]))


def test_spec_verify_mixed_batch():
    V, G = 10, 3
    target = [[5, 6, 7, 8], [2, 3, 4, 5], [1, 2, 3, 4]]
    logits = _onehot_logits(target, V)
    draft = jnp.array([[5, 6, 0], [2, 3, 4], [1, 2, 3]], jnp.int32)
    q = jax.nn.one_hot(draft, V)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, seed=3),
              SamplingParams(temperature=0, presence_penalty=2.0)]
    t = _tensors(params, V, output_token_ids=[[], [], [2]])
    n, toks = spec_verify(draft, q, logits, t, jnp.zeros(3, jnp.int32))
    # row 2: token 2 was generated and is penalised at row 1 (5 - 2 = 3: still the argmax)
    np.testing.assert_array_equal(np.asarray(n), [2, 3, 3])
    np.testing.assert_array_equal(np.asarray(toks), [[5, 6, 7, -1], [2, 3, 4, 5], [1, 2, 3, 4]])
    n, toks = spec_verify(draft, q, logits * 0.3, t, jnp.zeros(3, jnp.int32))
    assert int(n[2]) == 1 and int(toks[2, 1]) == 0  # 1.5 - 2 < 0: argmax moves to id 0


def test_deterministic_log_softmax_does_not_depend_on_the_batch_split(cpu8):
    """The deterministic sampler's log-softmax of a [16, V] batch on one device equals the same batch split over
    8 devices ([2, V] each, a dp mesh's sampling step) bit for bit. Before `numerics.exp_f32` rounded with a
    reduce-precision, XLA:CPU gave the one-device normaliser sum to a library fusion that dropped the fp32
    rounding of the fp64 exps: row 3 here (a constrained row: few allowed tokens) parted by 1 ulp."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dsv41_jax.serving import sampling as smp

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((16, 512)) * 3).astype(np.float32)
    allowed = np.ones((16, 512), bool)
    allowed[3] = False
    allowed[3, rng.integers(0, 512, rng.integers(1, 40))] = True
    f = jax.jit(lambda x, a: smp.log_softmax(jnp.where(a, x, -jnp.inf), True))
    mesh = jax.make_mesh((8,), ("dp",))
    split = f(jax.device_put(logits, NamedSharding(mesh, PartitionSpec("dp"))), allowed)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(f(logits, allowed)))
