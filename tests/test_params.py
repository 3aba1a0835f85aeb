"""Parameter declarations (docs/design/spec.md §6 dtypes, §8 names/shapes): init, abstract shapes, byte total,
logical axes and mesh shardings.

Shapes, dtypes and the flash byte total are written out here from docs/design/spec.md §1/§6/§8, not taken from
params.py's declarations.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41_jax.model import ModelConfig, declare_params, init_params, logical_axes, mesh_shardings, \
    param_shapes, param_stats
from dsv41_jax.model.params import flatten_names

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def flash():
    return ModelConfig.preset("flash")


@pytest.fixture(scope="module")
def params0(tiny):
    return init_params(tiny, jax.random.key(0))


@pytest.fixture(scope="module")
def tiny_names(tiny):
    return flatten_names(declare_params(tiny))


def cdiv(a, b):
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# independent numpy dequantizers
# ------------------------------------------------------------------------------------------------


def e8m0_np(s):
    b = np.asarray(s).view(np.uint8).astype(np.int64)
    return np.ldexp(1.0, b - 127)


def dequant_fp8_block_np(w, s):
    o, i = w.shape
    sc = np.repeat(np.repeat(e8m0_np(s), 32, 0), 32, 1)[:o, :i]
    return np.asarray(w).astype(np.float64) * sc


def dequant_mxfp4_np(packed, s):
    b = np.asarray(packed)
    lut = np.concatenate([GRID, -GRID])
    v = np.empty(b.shape[:-1] + (2 * b.shape[-1],))
    v[..., 0::2] = lut[b & 0xF]
    v[..., 1::2] = lut[b >> 4]
    return v * np.repeat(e8m0_np(s), 32, axis=-1)


# ------------------------------------------------------------------------------------------------
# init_params(tiny): shapes, dtypes, values
# ------------------------------------------------------------------------------------------------


def test_init_leaves_match_param_shapes(tiny, params0):
    abstract = param_shapes(tiny)
    got = flatten_names(params0)
    want = flatten_names(abstract)
    assert set(got) == set(want)
    for name, sds in want.items():
        assert isinstance(sds, jax.ShapeDtypeStruct), name
        a = got[name]
        assert isinstance(a, jax.Array), name
        assert a.shape == sds.shape and a.dtype == sds.dtype, (name, a.shape, a.dtype, sds.shape, sds.dtype)
    # same tree structure (not only the same names)
    assert jax.tree_util.tree_structure(params0) == jax.tree_util.tree_structure(abstract)


def test_tiny_dtypes_per_spec(tiny, tiny_names):
    n = tiny_names
    D, I, E = tiny.hidden_size, tiny.moe_intermediate_size, tiny.n_routed_experts

    def dt(name):
        return np.dtype(n[name].dtype)

    def sh(name):
        return tuple(n[name].shape)

    # dense fp8 + e8m0 32x32 block scales, shape [ceil(out/32), ceil(in/32)]
    for L in range(tiny.num_hidden_layers):
        for w, (o, i) in {"attn.wq_a": (32, 64), "attn.wq_b": (4 * 64, 32), "attn.wkv": (64, 64),
                          "attn.wo_a": (2 * 32, 4 * 64 // 2), "attn.wo_b": (64, 2 * 32),
                          "ffn.shared_experts.w1": (I, D), "ffn.shared_experts.w3": (I, D),
                          "ffn.shared_experts.w2": (D, I)}.items():
            base = f"layers.{L}.{w}"
            assert dt(base + ".weight") == FP8 and sh(base + ".weight") == (o, i), base
            assert dt(base + ".scale") == E8M0 and sh(base + ".scale") == (cdiv(o, 32), cdiv(i, 32)), base
        # routed experts: uint8 [E, out, in/2] + e8m0 [E, out, in/32]
        for w, (o, i) in {"w1": (I, D), "w3": (I, D), "w2": (D, I)}.items():
            base = f"layers.{L}.ffn.experts.{w}"
            assert dt(base + ".weight") == U8 and sh(base + ".weight") == (E, o, i // 2)
            assert dt(base + ".scale") == E8M0 and sh(base + ".scale") == (E, o, i // 32)
        # fp32: hc_*, attn_sink, gate bias
        for s in ("attn", "ffn"):
            assert dt(f"layers.{L}.hc_{s}_fn") == F32 and sh(f"layers.{L}.hc_{s}_fn") == (24, 4 * D)
            assert dt(f"layers.{L}.hc_{s}_base") == F32 and sh(f"layers.{L}.hc_{s}_base") == (24,)
            assert dt(f"layers.{L}.hc_{s}_scale") == F32 and sh(f"layers.{L}.hc_{s}_scale") == (3,)
        assert dt(f"layers.{L}.attn.attn_sink") == F32 and sh(f"layers.{L}.attn.attn_sink") == (4,)
        assert dt(f"layers.{L}.ffn.gate.bias") == F32 and sh(f"layers.{L}.ffn.gate.bias") == (E,)
        # bf16: norms, gate weight
        for nm in ("attn_norm", "ffn_norm", "attn.q_norm", "attn.kv_norm"):
            assert dt(f"layers.{L}.{nm}.weight") == BF16
        assert dt(f"layers.{L}.ffn.gate.weight") == BF16 and sh(f"layers.{L}.ffn.gate.weight") == (E, D)
    # bf16: compressor, indexer wk / weights_proj / k_norm, embed, head, norm; indexer wq_b is fp8
    for L in (2, 4, 6):
        for nm in ("attn.compressor.wkv.weight", "attn.compressor.norm.weight", "attn.indexer.wk.weight",
                   "attn.indexer.k_norm.weight"):
            assert dt(f"layers.{L}.{nm}") == BF16, (L, nm)
        assert sh(f"layers.{L}.attn.compressor.wkv.weight") == (64, 64)
        assert sh(f"layers.{L}.attn.indexer.wk.weight") == (32, 64)
    for L in (2, 4):
        assert dt(f"layers.{L}.attn.compressor.wgate.weight") == BF16
    for L in (2, 4, 6, 8):
        assert dt(f"layers.{L}.attn.indexer.weights_proj.weight") == BF16
        assert sh(f"layers.{L}.attn.indexer.weights_proj.weight") == (4, 64)
        assert dt(f"layers.{L}.attn.indexer.wq_b.weight") == FP8
        assert sh(f"layers.{L}.attn.indexer.wq_b.weight") == (4 * 32, 32)
        assert sh(f"layers.{L}.attn.indexer.wq_b.scale") == (4, 1)
    for nm in ("embed.weight", "head.weight"):
        assert dt(nm) == BF16 and sh(nm) == (320, 64)
    assert dt("norm.weight") == BF16
    # Engram: fp8 table with per-32 scales, fp8 wkv, bf16 q/k weights
    for L, rows in ((1, 384), (4, 552)):
        assert dt(f"layers.{L}.engram.embed.weight") == FP8 and sh(f"layers.{L}.engram.embed.weight") == (rows, 32)
        assert dt(f"layers.{L}.engram.embed.scale") == E8M0 and sh(f"layers.{L}.engram.embed.scale") == (rows, 1)
        assert dt(f"layers.{L}.engram.wkv.weight") == FP8 and sh(f"layers.{L}.engram.wkv.weight") == (5 * 64, 192)
        assert sh(f"layers.{L}.engram.wkv.scale") == (10, 6)
        assert dt(f"layers.{L}.engram.q_weight") == BF16 and sh(f"layers.{L}.engram.q_weight") == (4, 64)
        assert dt(f"layers.{L}.engram.k_weight") == BF16
    # every fp8 .weight has an e8m0 .scale
    for name, p in n.items():
        if np.dtype(p.dtype) in (FP8, U8):
            assert np.dtype(n[name[: -len("weight")] + "scale"].dtype) == E8M0, name


def test_tiny_checkpoint_names(tiny, tiny_names):
    n = set(tiny_names)
    L = tiny.num_hidden_layers
    for name in n:
        assert not name.startswith("model."), name
    assert {"embed.weight", "head.weight", "norm.weight"} <= n
    ratio2_sources, kv_sources, index_sources, engram = {2, 4}, {2, 4, 6}, {2, 4, 6, 8}, {1, 4}
    key_owners = kv_sources & index_sources
    always = ["attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
              "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "attn.attn_sink", "attn.wq_a.weight",
              "attn.wq_a.scale", "attn.q_norm.weight", "attn.wq_b.weight", "attn.wq_b.scale",
              "attn.wkv.weight", "attn.wkv.scale", "attn.kv_norm.weight", "attn.wo_a.weight",
              "attn.wo_a.scale", "attn.wo_b.weight", "attn.wo_b.scale", "ffn.gate.weight", "ffn.gate.bias",
              "ffn.experts.w1.weight", "ffn.experts.w1.scale", "ffn.experts.w2.weight",
              "ffn.experts.w3.scale", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.scale",
              "ffn.shared_experts.w3.weight"]
    blocks = [f"layers.{i}." for i in range(L)] + [f"mtp.{s}." for s in range(3)]
    for b in blocks:
        for a in always:
            assert b + a in n, b + a
    for i in range(L):
        b = f"layers.{i}."
        assert (b + "attn.compressor.wgate.weight" in n) == (i in ratio2_sources), i
        assert (b + "attn.compressor.wkv.weight" in n) == (i in kv_sources), i
        assert (b + "attn.compressor.norm.weight" in n) == (i in kv_sources), i
        assert (b + "attn.indexer.wk.weight" in n) == (i in key_owners), i
        assert (b + "attn.indexer.k_norm.weight" in n) == (i in key_owners), i
        assert (b + "attn.indexer.wq_b.weight" in n) == (i in index_sources), i
        assert (b + "attn.indexer.weights_proj.weight" in n) == (i in index_sources), i
        has_engram = any(x.startswith(b + "engram.") for x in n)
        assert has_engram == (i in engram), i
        if i in engram:
            for e in ("engram.embed.weight", "engram.embed.scale", "engram.wkv.weight", "engram.wkv.scale",
                      "engram.q_weight", "engram.k_weight"):
                assert b + e in n
    # DSpark stages: no compressor / indexer / engram; stage-specific extras
    for s in range(3):
        b = f"mtp.{s}."
        assert not any(x.startswith(b + "attn.compressor") or x.startswith(b + "attn.indexer")
                       or x.startswith(b + "engram") for x in n), s
        assert (b + "main_proj.weight" in n) == (s == 0) and (b + "main_proj.scale" in n) == (s == 0)
        assert (b + "main_norm.weight" in n) == (s == 0)
        assert (b + "norm.weight" in n) == (s == 2)
        assert (b + "confidence_head.proj.weight" in n) == (s == 2)
        assert any(x.startswith(b + "markov_head.") for x in n) == (s == 2)
    assert tiny_names["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    assert tiny_names["mtp.2.confidence_head.proj.weight"].shape == (1, 64 + 16)
    mk = sorted(x for x in n if x.startswith("mtp.2.markov_head."))
    assert mk and all(tiny_names[x].shape == (320, 16) for x in mk)
    assert tiny_names["mtp.0.ffn.experts.w1.weight"].shape == (4, 32, 32)  # dspark_n_routed_experts
    # nothing outside layers / mtp / globals (and the derived, non-checkpoint token map)
    tops = {x.split(".")[0] for x in n}
    assert tops <= {"embed", "head", "norm", "layers", "mtp", "derived"}, tops


def test_init_values_are_sane(tiny, params0):
    decl = flatten_names(declare_params(tiny))
    p = flatten_names(params0)
    # dense fp8: dequantized finite, std near the declared std, scales are powers of two
    for name in ("layers.0.attn.wq_a", "layers.3.attn.wq_b", "layers.5.attn.wo_a", "layers.2.attn.wo_b",
                 "layers.7.ffn.shared_experts.w2", "mtp.0.main_proj", "layers.4.engram.wkv"):
        w = dequant_fp8_block_np(np.asarray(p[name + ".weight"]), np.asarray(p[name + ".scale"]))
        assert np.isfinite(w).all(), name
        want = decl[name + ".weight"].std
        assert want > 0 and abs(w.std() / want - 1) < 0.1, (name, w.std(), want)
        assert abs(w.mean()) < 0.1 * want, name
    # MXFP4 experts
    for name in ("layers.0.ffn.experts.w1", "layers.9.ffn.experts.w2", "mtp.1.ffn.experts.w3"):
        w = dequant_mxfp4_np(np.asarray(p[name + ".weight"]), np.asarray(p[name + ".scale"]))
        assert np.isfinite(w).all()
        want = decl[name + ".weight"].std
        assert abs(w.std() / want - 1) < 0.15, (name, w.std(), want)
        assert len(np.unique(w)) >= 10  # not degenerate (grid values x a few scales)
    # Engram table rows: per-32 scales along each row
    for L in (1, 4):
        q = np.asarray(p[f"layers.{L}.engram.embed.weight"]).astype(np.float64)
        s = np.repeat(e8m0_np(np.asarray(p[f"layers.{L}.engram.embed.scale"])), 32, axis=1)
        t = q * s
        assert np.isfinite(t).all() and abs(t.std() / decl[f"layers.{L}.engram.embed.weight"].std - 1) < 0.1
    # plain leaves
    for name, leaf in p.items():
        a = np.asarray(leaf)
        if a.dtype.kind == "f" or a.dtype in (BF16,):
            assert np.isfinite(a.astype(np.float32)).all(), name
    assert (np.asarray(p["layers.0.attn_norm.weight"]).astype(np.float32) == 1).all()
    assert (np.asarray(p["norm.weight"]).astype(np.float32) == 1).all()
    emb = np.asarray(p["embed.weight"]).astype(np.float32)
    assert 0.8 < emb.std() < 1.2
    hc = np.asarray(p["layers.3.hc_attn_fn"])
    assert hc.dtype == np.float32 and abs(hc.std() * math.sqrt(4 * 64) - 1) < 0.1
    # the derived Engram token map: ids in [0, compressed vocab)
    tm = np.asarray(params0["derived"]["engram_token_map"])
    assert tm.dtype == np.int32 and tm.shape == (320,)
    assert tm.min() >= 0 and tm.max() == tiny.engram_compressed_vocab_size - 1


def test_init_is_deterministic_and_key_dependent(tiny, params0):
    again = flatten_names(init_params(tiny, jax.random.key(0)))
    other = flatten_names(init_params(tiny, jax.random.key(1)))
    decl = flatten_names(declare_params(tiny))
    base = flatten_names(params0)
    n_random = 0
    for name, a in base.items():
        a = np.asarray(a)
        np.testing.assert_array_equal(np.asarray(again[name]).view(np.uint8), a.view(np.uint8), err_msg=name)
        if decl[name].init in ("normal", "normal_one", "hc_base", "hc_scale", "fp8", "mxfp4", "fp8_rows"):
            n_random += 1
            assert not np.array_equal(np.asarray(other[name]).view(np.uint8), a.view(np.uint8)), name
    assert n_random > 100
    # different tensors get different streams (no two same-shape random tensors are identical)
    assert not np.array_equal(np.asarray(base["layers.2.attn.wq_a.weight"]).view(np.uint8),
                              np.asarray(base["layers.3.attn.wq_a.weight"]).view(np.uint8))


# ------------------------------------------------------------------------------------------------
# flash: abstract shapes and the byte total
# ------------------------------------------------------------------------------------------------


def test_flash_param_shapes_abstract_and_spec_shapes(flash):
    # abstract: 509 GB of declarations, every leaf a ShapeDtypeStruct (a real array here would be
    # an allocation); no count of live arrays, which other tests' garbage makes vary
    shapes = param_shapes(flash)
    leaves = jax.tree_util.tree_leaves(shapes)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) and not isinstance(x, jax.Array) for x in leaves)
    n = flatten_names(shapes)

    def chk(name, shape, dtype):
        assert name in n, name
        assert tuple(n[name].shape) == shape and np.dtype(n[name].dtype) == dtype, \
            (name, n[name].shape, n[name].dtype, shape, dtype)

    chk("embed.weight", (129280, 5120), BF16)
    chk("head.weight", (129280, 5120), BF16)
    chk("norm.weight", (5120,), BF16)
    for L in (0, 2, 20, 39):
        b = f"layers.{L}."
        chk(b + "attn.attn_sink", (64,), F32)
        chk(b + "attn.wq_a.weight", (1280, 5120), FP8)
        chk(b + "attn.wq_a.scale", (40, 160), E8M0)
        chk(b + "attn.wq_b.weight", (32768, 1280), FP8)
        chk(b + "attn.wq_b.scale", (1024, 40), E8M0)
        chk(b + "attn.wkv.weight", (512, 5120), FP8)
        chk(b + "attn.wo_a.weight", (8192, 4096), FP8)
        chk(b + "attn.wo_a.scale", (256, 128), E8M0)
        chk(b + "attn.wo_b.weight", (5120, 8192), FP8)
        chk(b + "attn.wo_b.scale", (160, 256), E8M0)
        chk(b + "hc_attn_fn", (24, 20480), F32)
        chk(b + "hc_ffn_base", (24,), F32)
        chk(b + "hc_ffn_scale", (3,), F32)
        chk(b + "ffn.gate.weight", (384, 5120), BF16)
        chk(b + "ffn.gate.bias", (384,), F32)
        chk(b + "ffn.experts.w1.weight", (384, 2304, 2560), U8)  # docs/design/spec.md §6: w1/w3 [2304, 2560] per expert
        chk(b + "ffn.experts.w1.scale", (384, 2304, 160), E8M0)
        chk(b + "ffn.experts.w3.weight", (384, 2304, 2560), U8)
        chk(b + "ffn.experts.w2.weight", (384, 5120, 1152), U8)
        chk(b + "ffn.experts.w2.scale", (384, 5120, 72), E8M0)
        chk(b + "ffn.shared_experts.w1.weight", (2304, 5120), FP8)
        chk(b + "ffn.shared_experts.w2.weight", (5120, 2304), FP8)
        chk(b + "ffn.shared_experts.w2.scale", (160, 72), E8M0)
    for L in (2, 8, 14, 20, 24, 36):
        chk(f"layers.{L}.attn.indexer.wq_b.weight", (4096, 1280), FP8)
        chk(f"layers.{L}.attn.indexer.wq_b.scale", (128, 40), E8M0)
        chk(f"layers.{L}.attn.indexer.weights_proj.weight", (32, 5120), BF16)
    for L in (2, 8, 14, 20):
        chk(f"layers.{L}.attn.indexer.wk.weight", (128, 512), BF16)
        chk(f"layers.{L}.attn.indexer.k_norm.weight", (128,), BF16)
        chk(f"layers.{L}.attn.compressor.wkv.weight", (512, 5120), BF16)
    for L in (2, 8, 14):
        chk(f"layers.{L}.attn.compressor.wgate.weight", (512, 5120), BF16)
    assert "layers.20.attn.compressor.wgate.weight" not in n
    assert "layers.24.attn.indexer.wk.weight" not in n
    for L, rows in ((1, 384006168), (14, 384016682)):
        chk(f"layers.{L}.engram.embed.weight", (rows, 256), FP8)
        chk(f"layers.{L}.engram.embed.scale", (rows, 8), E8M0)
        chk(f"layers.{L}.engram.wkv.weight", (25600, 6144), FP8)
        chk(f"layers.{L}.engram.wkv.scale", (800, 192), E8M0)
        chk(f"layers.{L}.engram.q_weight", (4, 5120), BF16)
        chk(f"layers.{L}.engram.k_weight", (4, 5120), BF16)
    assert not any(x.startswith("layers.2.engram") for x in n)
    for s in range(3):
        chk(f"mtp.{s}.ffn.experts.w1.weight", (128, 2304, 2560), U8)
        chk(f"mtp.{s}.ffn.gate.weight", (128, 5120), BF16)
        chk(f"mtp.{s}.attn.wq_b.weight", (32768, 1280), FP8)
    chk("mtp.0.main_proj.weight", (5120, 15360), FP8)
    chk("mtp.0.main_proj.scale", (160, 480), E8M0)
    chk("mtp.0.main_norm.weight", (5120,), BF16)
    chk("mtp.2.norm.weight", (5120,), BF16)
    chk("mtp.2.confidence_head.proj.weight", (1, 5120 + 256), BF16)
    mk = [x for x in n if x.startswith("mtp.2.markov_head.")]
    assert len(mk) == 2 and all(tuple(n[x].shape) == (129280, 256) for x in mk)


def flash_bytes_by_hand():
    """The checkpoint's bytes from docs/design/spec.md §1/§6/§8, per dtype: {dtype name: bytes}."""
    V, D, H, hd, qr, G, R = 129280, 5120, 64, 512, 1280, 8, 1024
    I, nhc, mix = 2304, 4, 24
    acc = {"float8_e4m3fn": 0, "float8_e8m0fnu": 0, "bfloat16": 0, "float32": 0, "uint8": 0}

    def fp8(o, i):  # e4m3 weight + e8m0 32x32 block scale
        acc["float8_e4m3fn"] += o * i
        acc["float8_e8m0fnu"] += cdiv(o, 32) * cdiv(i, 32)

    def bf16(nel):
        acc["bfloat16"] += 2 * nel

    def f32(nel):
        acc["float32"] += 4 * nel

    def mxfp4(E, o, i):  # packed e2m1 (2 per byte) + e8m0 per 32 along in
        acc["uint8"] += E * o * i // 2
        acc["float8_e8m0fnu"] += E * o * i // 32

    def block(E):
        bf16(D + D)                                   # attn_norm, ffn_norm
        f32(2 * (mix * nhc * D + mix + 3))            # hc_{attn,ffn}_{fn,base,scale}
        f32(H)                                        # attn_sink
        fp8(qr, D); bf16(qr)                          # wq_a, q_norm
        fp8(H * hd, qr)                               # wq_b
        fp8(hd, D); bf16(hd)                          # wkv, kv_norm
        fp8(G * R, H * hd // G)                       # wo_a [8192, 4096]
        fp8(D, G * R)                                 # wo_b
        bf16(E * D); f32(E); f32(E)                   # gate weight, bias, bias_vl
        mxfp4(E, I, D); mxfp4(E, I, D); mxfp4(E, D, I)  # routed w1, w3, w2
        fp8(I, D); fp8(I, D); fp8(D, I)               # shared expert

    bf16(V * D) ; bf16(V * D); bf16(D)                # embed, head, norm
    for layer in range(40):
        block(384)
        if layer in (2, 8, 14, 20):                   # KV sources: compressor + index keys
            bf16(hd * D); bf16(hd)                    # compressor wkv, norm
            if layer != 20:
                bf16(hd * D)                          # ratio-2 wgate
            bf16(128 * hd); bf16(128)                 # indexer wk, k_norm
        if layer in (2, 8, 14, 20, 24, 28, 32, 36):   # index sources
            fp8(32 * 128, qr)                         # indexer wq_b
            bf16(32 * D)                              # weights_proj
    for rows in (384006168, 384016682):               # engram layers 1 and 14
        acc["float8_e4m3fn"] += rows * 256
        acc["float8_e8m0fnu"] += rows * 256 // 32
        fp8(nhc * D + D, 3 * 8 * 256)                 # engram.wkv [25600, 6144]
        bf16(2 * nhc * D)                             # q_weight, k_weight
    for stage in range(3):                            # DSpark
        block(128)
    fp8(D, 3 * D); bf16(D)                            # mtp.0.main_proj, main_norm
    bf16(D)                                           # mtp.2.norm
    bf16(2 * V * 256)                                 # mtp.2.markov_head (embed + head)
    bf16(D + 256)                                     # mtp.2.confidence_head.proj
    return acc


def test_flash_byte_total(flash):
    hand = flash_bytes_by_hand()
    total = sum(hand.values())
    stats = param_stats(flash)
    assert stats["bytes"] == total, (stats["bytes"], total)
    assert {k: v for k, v in stats["bytes_by_dtype"].items() if v} == hand
    real = 510_286_023_000  # docs/design/spec.md §8, includes vision tensors (well under 1%)
    assert abs(total - real) / real < 0.01, total / real
    assert total < real
    # parameter count: MXFP4 bytes hold two parameters each, scales are not parameters
    params = (hand["float8_e4m3fn"] + hand["bfloat16"] // 2 + hand["float32"] // 4 + 2 * hand["uint8"])
    assert stats["params"] == params
    # tensors: stacked experts count one per expert (the file has 96,085 incl. vision tensors)
    assert 0.99 * 96085 < stats["tensors"] <= 96085


def test_tiny_stats_consistent(tiny):
    stats = param_stats(tiny)
    names = flatten_names(param_shapes(tiny))
    # checkpoint tensors only: not the derived tables, not the load-time bf16 copies of wo_a
    total = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for k, s in names.items()
                if not k.startswith("derived.") and not k.endswith(".wo_a.bf16"))
    assert stats["bytes"] == total == sum(stats["bytes_by_dtype"].values())


# ------------------------------------------------------------------------------------------------
# logical axes and mesh shardings
# ------------------------------------------------------------------------------------------------


def test_logical_axes_rank(tiny, flash):
    from dsv41_jax.model.params import DEFAULT_LOGICAL_RULES

    known = {k for k, _ in DEFAULT_LOGICAL_RULES}
    for cfg in (tiny, flash):
        is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
        axes = jax.tree_util.tree_leaves(logical_axes(cfg), is_leaf=is_axes)
        shapes = jax.tree_util.tree_leaves(param_shapes(cfg))
        assert jax.tree_util.tree_structure(logical_axes(cfg), is_leaf=is_axes) == \
            jax.tree_util.tree_structure(param_shapes(cfg))
        for ax, sds in zip(axes, shapes):
            assert len(ax) == len(sds.shape), (ax, sds)
            assert all(a is None or a in known for a in ax), ax


def test_mesh_shardings_one_device(tiny, params0):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("tp", "ep"))
    sh = mesh_shardings(tiny, mesh)
    flat = flatten_names(sh)
    assert all(isinstance(s, NamedSharding) for s in flat.values())

    def spec(name):
        s = tuple(flat[name].spec)
        return s + (None,) * (len(flatten_names(param_shapes(tiny))[name].shape) - len(s))

    # logical rules: vocab/heads/o_in/mlp/engram_rows -> tp, experts -> ep, rest replicated
    assert spec("embed.weight") == ("tp", None)
    assert spec("head.weight") == ("tp", None)
    assert spec("layers.2.attn.wq_b.weight") == ("tp", None)
    assert spec("layers.2.attn.wo_b.weight") == (None, "tp")
    assert spec("layers.2.attn.wq_a.weight") == (None, None)
    assert spec("layers.2.attn.attn_sink") == ("tp",)
    assert spec("layers.2.ffn.experts.w1.weight") == ("ep", None, None)
    assert spec("layers.2.ffn.experts.w2.scale") == ("ep", None, None)
    assert spec("layers.2.ffn.gate.weight") == ("ep", None)
    assert spec("layers.2.ffn.shared_experts.w1.weight") == ("tp", None)
    assert spec("layers.2.ffn.shared_experts.w2.weight") == (None, "tp")
    assert spec("layers.1.engram.embed.weight") == ("tp", None)
    assert spec("layers.0.hc_attn_fn") == (None, None)
    # a scale is sharded like its weight
    assert spec("layers.2.attn.wq_b.scale") == ("tp", None)
    # placing the params with them works
    placed = jax.device_put(params0, sh)
    a = flatten_names(placed)["layers.2.attn.wq_b.weight"]
    assert a.sharding == flat["layers.2.attn.wq_b.weight"]


def test_mesh_shardings_replicate_where_not_divisible(tiny):
    from jax.sharding import AbstractMesh

    mesh = AbstractMesh((3, 8), ("tp", "ep"))
    flat = flatten_names(mesh_shardings(tiny, mesh))
    shapes = flatten_names(param_shapes(tiny))

    def spec(name):
        s = tuple(flat[name].spec)
        return s + (None,) * (len(shapes[name].shape) - len(s))

    # vocab 320 and wq_b's 256 rows are not multiples of 3 -> replicated; engram rows 384 and 552 are
    assert spec("embed.weight") == (None, None)
    assert spec("layers.2.attn.wq_b.weight") == (None, None)
    assert spec("layers.1.engram.embed.weight") == ("tp", None)
    assert spec("layers.4.engram.embed.weight") == ("tp", None)
    # 8 target experts divide ep=8; the 4 DSpark experts do not
    assert spec("layers.0.ffn.experts.w1.weight") == ("ep", None, None)
    assert spec("mtp.0.ffn.experts.w1.weight") == (None, None, None)
    # every sharded dim divides its mesh axis
    for name, s in flat.items():
        for dim, ax in zip(shapes[name].shape, spec(name)):
            if ax is not None:
                assert dim % mesh.shape[ax] == 0, (name, dim, ax)
