"""Scoped row tiles of the xla matmuls (`dsv41_jax.model.tiling`, issue 10: decode-step temporaries).

* the policy: which backends scope, how many tiles a weight gets;
* tiles change no arithmetic: every xla matmul kind (fp8 / MXFP4 at decode and prefill sizes, the
  fp32 kind, grouped wo_a, grouped MoE) gives the same results with the weights split into several
  scoped tiles as with one plain dot — the same products and K-sums per output; only the order in
  which the backend's dot sums them may change with the tile width, so fp32 outputs agree to a few
  fp32 ulps of the sum's magnitude and bf16 outputs to one bf16 ulp (bitwise in practice);
* the mechanism holds on this XLA: a chain of fp8 linears compiled on CPU keeps at most about one
  tile's widened copy alive when scoped, and every weight's copy at once when not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import linear, quant, tiling
from dsv41_jax.model import moe as moe_mod
from dsv41_jax.model.weights import Fp8, Mxfp4


def test_policy_tiles():
    assert tiling.n_tiles(4096, 4096, backend="gpu") == 0  # never scoped off CPU
    assert tiling.n_tiles(64, 64, backend="cpu") == 0  # small: a plain dot
    # flash's head (129280 x 5120, widened to fp32: 2.5 GiB) -> tiles of <= TILE_BYTES dividing the rows
    nt = tiling.n_tiles(129280, 5120, backend="cpu")
    assert 129280 % nt == 0 and 129280 // nt * 5120 * 4 <= tiling.TILE_BYTES
    assert tiling.n_tiles(129280, 5120, backend="cpu") >= 20
    # 32-row scale blocks stay whole: wq_b 32768 x 1280 fp8
    nt = tiling.n_tiles(32768, 1280, align=32, backend="cpu")
    assert (32768 // nt) % 32 == 0 and 32768 // nt * 1280 * 4 <= tiling.TILE_BYTES
    # a weight just above the scoping floor gets one scoped tile
    assert tiling.n_tiles(1024, 1024, backend="cpu") == 1


@pytest.fixture
def small_tiles(monkeypatch):
    """Make the test weights (a few hundred KiB widened) scoped in several tiles on CPU."""
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 2**12)
    monkeypatch.setattr(tiling, "TILE_BYTES", 2**14)


def _weights(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-2, 2, (n, 1)))
    wq, ws = quant.quantize_fp8_block(jnp.asarray(w))
    pk, ps = quant.quantize_mxfp4(jnp.asarray(w))
    return {"fp8": Fp8(weight=wq, scale=ws), "mxfp4": Mxfp4(weight=pk, scale=ps), "bf16": jnp.asarray(w, jnp.bfloat16)}


def _run_all(cfg, x1, x24, W, o, pa):
    """Every xla matmul kind, traced fresh (the tile policy is read at trace time)."""
    out = {}
    for kind in ("fp8", "mxfp4"):
        for name, x in (("m1", x1), ("m24", x24)):
            out[f"{kind}_{name}"] = jax.jit(lambda x, p, kind=kind: getattr(linear, kind)(x, p, cfg, jnp.bfloat16))(
                x, W[kind])
    out["f32_bf16"] = jax.jit(lambda x, w: linear.f32(x, w, cfg))(x1.astype(jnp.bfloat16), W["bf16"])
    out["f32_f32"] = jax.jit(lambda x, w: linear.f32(x, w, cfg))(x24, W["bf16"])
    out["wo_a"] = jax.jit(lambda o, p: linear.wo_a(o, p, cfg, jnp.bfloat16))(o, pa)
    return {k: np.asarray(v.astype(jnp.float32)) for k, v in out.items()}


def test_tiles_change_no_number(tiny_cfg, small_tiles, monkeypatch):
    cfg = tiny_cfg.replace(impl="xla")
    rng = np.random.default_rng(3)
    W = _weights(rng, 256, 128)  # fp8: 8 scale-block rows -> several 32-row tiles
    x1 = jnp.asarray(rng.standard_normal((1, 128)), jnp.float32)
    x24 = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    # wo_a: G = o_groups = 2 groups of R = o_lora_rank = 32 rows x I = o_group_in = 128.
    G, R, I = cfg.o_groups, cfg.o_lora_rank, cfg.o_group_in
    wa = rng.standard_normal((G * R, I)).astype(np.float32)
    qa, sa = quant.quantize_fp8_block(jnp.asarray(wa))
    pa = Fp8(weight=qa, scale=sa)
    o = jnp.asarray(rng.standard_normal((2, 3, G, I)), jnp.bfloat16)
    assert tiling.n_tiles(256, 128, align=32) > 1 and tiling.n_tiles(G, R * I) == G
    tiled = _run_all(cfg, x1, x24, W, o, pa)
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 2**40)  # now: plain dots
    plain = _run_all(cfg, x1, x24, W, o, pa)
    for k in plain:
        assert np.abs(plain[k]).max() > 0, k
        scale = np.abs(plain[k]).max()
        if k.startswith("f32"):  # fp32 out: summation order only (K = 128 terms)
            np.testing.assert_allclose(tiled[k], plain[k], rtol=0, atol=128 * 2.0**-23 * scale, err_msg=k)
        else:  # bf16 out: at most one bf16 ulp where an fp32 sum straddles a rounding boundary
            ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(plain[k]), 2.0**-126))) - 7)
            assert np.all(np.abs(tiled[k] - plain[k]) <= ulp), k
            assert np.mean(tiled[k] != plain[k]) <= 0.01, k


def test_tiles_change_no_number_moe(small_tiles, monkeypatch):
    """Grouped MXFP4 (selected experts gathered per tile; rows with no expert-group and empty groups)."""
    rng = np.random.default_rng(5)
    E, N, K, A = 8, 96, 64, 6
    w = rng.standard_normal((E, N, K)).astype(np.float32)
    pk, ps = quant.quantize_mxfp4(jnp.asarray(w.reshape(E * N, K)))
    pk, ps = pk.reshape(E, N, K // 2), ps.reshape(E, N, K // 32)
    xs = jnp.asarray(rng.standard_normal((A, K)), jnp.float32)
    gexp = jnp.asarray([1, 4, 6, 0, 0, 0], jnp.int32)  # 3 selected experts, 3 empty trailing groups
    sizes = jnp.asarray([2, 0, 4, 0, 0, 0], jnp.int32)  # includes an empty group in the middle

    def run():
        f = jax.jit(lambda xs, pk, ps, g, s: moe_mod._grouped_mxfp4(xs, pk, ps, g, s, jnp.bfloat16, False))
        return np.asarray(f(xs, pk, ps, gexp, sizes).astype(jnp.float32))

    assert tiling.n_tiles(N, 6 * K) > 1
    tiled = run()
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 2**40)
    plain = run()
    assert np.abs(plain).max() > 0
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(plain), 2.0**-126))) - 7)
    assert np.all(np.abs(tiled - plain) <= ulp) and np.mean(tiled != plain) <= 0.01


def test_scoping_bounds_cpu_temporaries(tiny_cfg, monkeypatch):
    """Four fp8 linears in a chain (2 MiB widened each), compiled abstractly on CPU: unscoped, XLA
    keeps every widened weight alive at once; scoped in 1 MiB tiles, about one tile."""
    assert jax.default_backend() == "cpu"
    cfg = tiny_cfg.replace(impl="xla")
    n = 512
    ws = [Fp8(weight=jax.ShapeDtypeStruct((n, n), quant.FP8), scale=jax.ShapeDtypeStruct((n // 32, n // 32), quant.E8M0))
          for _ in range(4)]
    x = jax.ShapeDtypeStruct((1, n), jnp.float32)

    def chain(x, ws):
        for p in ws:
            x = linear.fp8(x, p, cfg, jnp.float32) + x
        return x

    def temp():
        return jax.jit(lambda x, ws: chain(x, ws)).lower(x, ws).compile().memory_analysis().temp_size_in_bytes

    widened = n * n * 4
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 2**40)
    plain = temp()
    monkeypatch.setattr(tiling, "MIN_SCOPED_BYTES", 2**16)
    monkeypatch.setattr(tiling, "TILE_BYTES", widened // 2)
    scoped = temp()
    assert plain >= 4 * widened
    assert scoped <= 0.75 * widened
