"""DeepSeek-V4's release numerics (`config_v4.RELEASE_NUMERICS`, `model.v4.numerics`, `quant.hadamard`) against
plain numpy references written here from the release's definitions (docs/design/v4.md "Numerics"); tiny shapes.

Tolerances: the quantizers are exact (bit-equal to the numpy rule); the Hadamard rotation is fp32 butterflies
against a float64 matrix product (<= 1e-6 relative); the GEMM input rule is exact on its fake-quantized values.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, quant
from dsv41_jax.model.config import ConfigError
from dsv41_jax.model.config_v4 import RELEASE_NUMERICS, release_numerics
from dsv41_jax.model.v4 import numerics as num4
from dsv41_jax.model.weights import Fp8

E4M3 = np.array(sorted({0.0} | {2.0 ** (e - 7) * (1 + m / 8) for e in range(1, 16) for m in range(8)
                              if not (e == 15 and m == 7)} | {m * 2.0 ** -9 for m in range(1, 8)}))
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rne(v, grid, even):
    """Nearest grid magnitude of |v|, ties to the entry whose `even`(index) holds; sign kept."""
    a = np.abs(v)[..., None]
    d = np.abs(grid - a)
    best = d.min(-1, keepdims=True)
    cand = np.where(d == best, np.arange(len(grid)), 10 ** 6)
    pick = np.where((cand < 10 ** 6) & even(np.arange(len(grid))), cand, 10 ** 6).min(-1)
    pick = np.where(pick == 10 ** 6, cand.min(-1), pick)
    return np.copysign(grid[pick], v)


def _pow2_ceil(s):
    return 2.0 ** np.ceil(np.log2(s.astype(np.float64)))


def ref_fp8(x, block):
    """The release's act_quant(x, block, "ue8m0", inplace=True): amax floor 1e-4, s = 2^ceil(log2(amax/448)),
    e4m3 round-to-nearest-even of x / s, times s."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    s = _pow2_ceil(np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-4) / 448)
    # e4m3 ties go to the grid value with the even mantissa
    mant_even = np.array([(int(round(g / 2.0 ** (np.floor(np.log2(g)) - 3))) % 2 == 0) if g >= 2 ** -6 else
                          (int(round(g * 512)) % 2 == 0) for g in E4M3[1:]], bool)
    q = _rne(np.clip(xb / s, -448, 448), E4M3, lambda i: np.concatenate([[True], mant_even])[i])
    return (q * s).reshape(x.shape)


def ref_fp4(x, block):
    """The release's fp4_act_quant(x, block, inplace=True): amax floor 6·2^-126, s = 2^ceil(log2(amax/6)),
    e2m1 round-to-nearest-even (ties to the even code) of x / s, times s."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    s = _pow2_ceil(np.maximum(np.abs(xb).max(-1, keepdims=True), 6 * 2.0 ** -126) / 6)
    q = _rne(np.clip(xb / s, -6, 6), E2M1, lambda i: i % 2 == 0)
    return (q * s).reshape(x.shape)


def sylvester(d):
    H = np.ones((1, 1))
    while H.shape[0] < d:
        H = np.block([[H, H], [H, -H]])
    return H


def _bf16(a):
    return np.array(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_hadamard_matches_sylvester(d):
    x = np.random.default_rng(d).standard_normal((3, d)).astype(np.float32)
    got = np.asarray(quant.hadamard(jnp.asarray(x), out_dtype=jnp.float32))
    want = x.astype(np.float64) @ sylvester(d) * d ** -0.5
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # orthonormal: the rotation of both operands keeps dot products; twice is the identity (to fp32 rounding)
    np.testing.assert_allclose(np.asarray(quant.hadamard(jnp.asarray(got), out_dtype=jnp.float32)), x, atol=1e-5)


def test_hadamard_zero_and_bad_width():
    assert not np.asarray(quant.hadamard(jnp.zeros((2, 16), jnp.bfloat16))).any()
    assert quant.hadamard(jnp.zeros((2, 16), jnp.bfloat16)).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="power of two"):
        quant.hadamard(jnp.zeros((2, 12)))


def _cfg(**kw):
    """A V4 config whose widths the release's blocks cut (tiny-v4's layout, 128 wide)."""
    return ModelConfig.preset("tiny-v4").replace(
        hidden_size=128, q_lora_rank=128, head_dim=128, qk_rope_head_dim=64, o_lora_rank=128, moe_intermediate_size=128,
        index_head_dim=128, **{**RELEASE_NUMERICS, **kw})


def test_kv_entries_quantize_only_the_non_rope_channels():
    cfg = _cfg()
    rng = np.random.default_rng(1)
    kv = _bf16(rng.standard_normal((2, 3, 128)) * 3)
    kv[0, 0, :64] = 0.0  # an all-zero block: amax floored, stays zero
    kv[0, 1, :64] = [58.0, 62.0] * 32  # scale 2^-2: 232 and 248, e4m3 ties -> 224 and 256 (even mantissas)
    got = np.asarray(num4.kv_entries(jnp.asarray(kv, jnp.bfloat16), cfg, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got[..., :64], ref_fp8(kv[..., :64], 64))
    np.testing.assert_array_equal(got[..., 64:], kv[..., 64:])  # RoPE channels kept
    assert not got[0, 0, :64].any()
    np.testing.assert_array_equal(got[0, 1, :4], [56.0, 64.0, 56.0, 64.0])
    off = num4.kv_entries(jnp.asarray(kv), cfg.replace(kv_quant_block=0), jnp.float32)
    np.testing.assert_array_equal(np.asarray(off), kv)


def test_index_rotated_is_hadamard_then_fp4():
    cfg = _cfg()
    rng = np.random.default_rng(2)
    x = _bf16(rng.standard_normal((2, 5, 4, 128)))
    x[0, 0, 0] = 0.0  # zero head: zero blocks
    got = np.asarray(num4.index_rotated(jnp.asarray(x, jnp.bfloat16), cfg, jnp.bfloat16).astype(jnp.float32))
    rot = _bf16(x.astype(np.float64) @ sylvester(128) * 128 ** -0.5)
    np.testing.assert_array_equal(got, ref_fp4(rot, 32))
    assert not got[0, 0, 0].any()
    # e2m1 ties go to the even code: 0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4 (block amax 6: scale 1)
    t = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, np.float32)
    np.testing.assert_array_equal(np.asarray(quant.fake_quant_fp4_pow2(jnp.asarray(t), block=32)), ref_fp4(t, 32))


def test_gemm_input_fp8_per_act_block_and_only_for_quantized_weights():
    cfg = _cfg()
    rng = np.random.default_rng(3)
    x = _bf16(rng.standard_normal((3, 256)) * np.r_[np.full(128, 0.01), np.full(128, 20.0)])  # two scales
    p = Fp8(weight=None, scale=None)
    got = np.asarray(num4.gemm_input(jnp.asarray(x, jnp.bfloat16), p, cfg))
    np.testing.assert_array_equal(got, ref_fp8(x, 128))
    assert num4.gemm_input(x, {"weight": None}, cfg) is x  # plain weights: F.linear on the input as it is
    assert num4.gemm_input(x, p, cfg.replace(act_quant_block=0)) is x
    with pytest.raises(ValueError, match="multiple"):  # a ragged K: refused, as the release asserts
        num4.gemm_input(jnp.zeros((2, 96)), p, cfg)


def test_head_rms_bf16_steps():
    cfg = _cfg()
    q = _bf16(np.random.default_rng(4).standard_normal((2, 3, 128)) * 5)
    got = np.asarray(num4.head_rms(jnp.asarray(q, jnp.bfloat16), cfg, jnp.bfloat16).astype(jnp.float32))
    ms = _bf16(np.mean(_bf16(q * q).astype(np.float64), -1, keepdims=True))
    want = _bf16(q * _bf16(1 / np.sqrt(_bf16(ms + 1e-6).astype(np.float64))))
    np.testing.assert_allclose(got, want, rtol=2 ** -7)  # rsqrt of XLA's fp32 may sit 1 bf16 ulp off
    assert (got == want).mean() > 0.95


def test_release_numerics_config():
    pro = ModelConfig.preset("pro-v4")
    assert release_numerics(pro) and release_numerics(ModelConfig.preset("flash-v4"))
    assert not release_numerics(ModelConfig.preset("tiny-v4"))
    for bad in ({"act_quant_block": 96}, {"kv_quant_block": 48}, {"index_fp4_block": 48}, {"act_quant_block": -1}):
        with pytest.raises(ConfigError):
            _cfg(**bad)
    with pytest.raises(ConfigError, match="V4 variant"):
        ModelConfig.preset("tiny").replace(act_quant_block=128)
    d = pro.to_hf_dict()
    assert d["quantization_config"]["activation_scheme"] == "dynamic"
    assert ModelConfig.from_dict(d) == pro
    plain = ModelConfig.from_dict(_cfg(**{k: 0 for k in RELEASE_NUMERICS}).to_hf_dict())
    assert not release_numerics(plain)


# ---------------------------------------------------------------------------- release_order "torch_cpu" (research)
# Values recorded from torch 2.13 on an AVX-512 CPU (x86-64 glibc): inputs where torch's result is not the correctly
# rounded one, so each check fails for an fp64-rounded stand-in. (input bits, torch's output bits)
TORCH_SIGMOID = [(3226291041, 1025457270), (3232335000, 1000549118), (1071072409, 1062721546),
                 (1054911936, 1058776197)]
GLIBC_COS = [(1065913719, 1056391289), (1093333927, 3197941898), (1066870855, 1052940664)]
GLIBC_SIN = [(1046894018, 1046767046), (1051507221, 1051293722), (1055752157, 1055199948)]


def _bits(v):
    return np.asarray(v, np.uint32).view(np.float32)


def _f64(fn, *xs):
    from dsv41_jax.model.numerics import x64_scope

    with x64_scope():
        args = [jnp.asarray(np.asarray(x, np.float32)).astype(jnp.float64) for x in xs]
        return np.asarray(fn(*args)).astype(np.float32)


def test_torch_order_transcendentals_match_recorded_torch():
    from dsv41_jax.model.v4 import torch_order as to

    x, want = (_bits([a for a, _ in TORCH_SIGMOID]), _bits([b for _, b in TORCH_SIGMOID]))
    assert (_f64(to.sigmoid, x) == want).all()
    assert ((1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32) != want).all()  # not the rounded one
    for table, k in ((GLIBC_SIN, 0), (GLIBC_COS, 1)):
        a, want = _bits([p for p, _ in table]), _bits([q for _, q in table])
        assert (_f64(lambda t: to._sin_cos(t.astype(jnp.float32))[k], a) == want).all()


def test_torch_order_sums_and_gemm_orders():
    """row_sum: 8-lane vectors, 4 accumulators, lanes left to right; linear: K blocks of 192, sequential FMA chains
    (numpy renderings of the documented orders, with inputs on which other orders differ)."""
    from dsv41_jax.model.v4 import torch_order as to

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 512)) ** 2).astype(np.float32)
    v = x.reshape(16, 16, 4, 8)  # [row, i, k (accumulator), lane]
    acc = v[:, 0]
    for i in range(1, 16):
        acc = (acc + v[:, i]).astype(np.float32)
    p = acc[:, 0]
    for k in range(1, 4):
        p = (p + acc[:, k]).astype(np.float32)
    want = p[:, 0]
    for lane in range(1, 8):
        want = (want + p[:, lane]).astype(np.float32)
    got = _f64(to.row_sum, x)
    assert (got == want).all() and (got != np.cumsum(x, -1, dtype=np.float32)[:, -1]).any()
    xs = rng.standard_normal((3, 400)).astype(np.float32)
    w = (rng.standard_normal((5, 400)) * 0.05).astype(np.float32)
    out = None
    for k0 in range(0, 400, 192):
        part = np.zeros((3, 5), np.float32)
        for k in range(k0, min(400, k0 + 192)):
            part = (part.astype(np.float64) + xs[:, None, k].astype(np.float64) * w[None, :, k]).astype(np.float32)
        out = part if out is None else (out + part).astype(np.float32)
    got = _f64(to.linear, xs, w)
    assert (got == out).all() and (got != (xs.astype(np.float64) @ w.T).astype(np.float32)).any()
    w4 = w[:4]  # a 4-wide output: 4 accumulators over k mod 4, no FMA, (a0 + a2) + (a1 + a3)
    acc = np.zeros((3, 4, 4), np.float32)
    for k in range(0, 400, 4):
        acc = (acc + (xs[:, None, k:k + 4] * w4[None, :, k:k + 4]).astype(np.float32)).astype(np.float32)
    want4 = ((acc[..., 0] + acc[..., 2]).astype(np.float32) + (acc[..., 1] + acc[..., 3]).astype(np.float32))
    got4 = _f64(to.linear, xs, w4)
    assert (got4 == want4.astype(np.float32)).all() and (got4 != got[:, :4]).any()


def test_rope_freqs_exact_pow():
    """`rope_freqs(exact_pow=True)`: base^e correctly rounded (torch's CPU power); numpy's fp32 power (the default,
    unchanged) differs in 6 of the 32 compress-theta frequencies."""
    from dsv41_jax.model.rope import rope_freqs

    e = np.arange(0, 64, 2, dtype=np.float32) / np.float32(64)
    want = (np.float32(1) / (np.float64(160000.0) ** e.astype(np.float64)).astype(np.float32)).astype(np.float32)
    assert (rope_freqs(64, 160000.0, exact_pow=True) == want).all()
    assert np.flatnonzero(rope_freqs(64, 160000.0) != want).tolist() == [3, 6, 10, 14, 23, 28]


def test_release_order_is_v4_only_and_checked():
    with pytest.raises(ConfigError, match="release_order"):
        ModelConfig.preset("tiny").replace(release_order="torch_cpu").validate()
    with pytest.raises(ConfigError, match="release_order"):
        ModelConfig.preset("tiny-v4").replace(release_order="gpu").validate()
    ModelConfig.preset("tiny-v4").replace(release_order="torch_cpu").validate()
