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
