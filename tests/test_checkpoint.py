"""HF checkpoints in the release layout: the writer (scripts/make_checkpoint.py), its naming against
docs/design/spec.md §8 rules written out here from the config alone, and `load_params` from HF and Orbax directories
(round trip to bitwise-equal logits, byte-for-byte fp8/fp4, mesh placement, error reporting)."""

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, forward, init_params
from dsv41_jax.model import checkpoint as ck
from dsv41_jax.model.params import flatten_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "make_checkpoint.py")
ST_ITEMSIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "BF16": 2, "F32": 4}


def _run_writer_inprocess(*argv):
    spec = importlib.util.spec_from_file_location("make_checkpoint", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(list(argv))


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The writer CLI, run as users run it: 3 shards, seed 0."""
    out = str(tmp_path_factory.mktemp("ck") / "tiny_hf")
    r = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--out", out, "--seed", "0", "--shards", "3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    from dsv41_jax import convert

    out = str(tmp_path_factory.mktemp("ck") / "tiny_orbax")
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def fwd():
    return jax.jit(forward, static_argnames=("cfg",))


def raw_headers(d):
    """{name: (file, dtype str, shape, absolute begin, end)} parsed here with struct + json."""
    out = {}
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(d, fn), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h = json.loads(f.read(n))
        h.pop("__metadata__", None)
        for name, e in h.items():
            b, en = e["data_offsets"]
            out[name] = (fn, e["dtype"], list(e["shape"]), 8 + n + b, 8 + n + en)
    return out


def raw_bytes(d, hdr):
    fn, _, _, b, e = hdr
    with open(os.path.join(d, fn), "rb") as f:
        f.seek(b)
        return f.read(e - b)


# ------------------------------------------------------------------------------------------------
# docs/design/spec.md §8 naming rules, written out from the config fields (independent of params.py / the writer)
# ------------------------------------------------------------------------------------------------


def spec8_tensors(c: ModelConfig) -> dict:
    """{name: (safetensors dtype, shape)} that docs/design/spec.md §8 says the checkpoint of config `c` holds."""
    V, D, n = c.vocab_size, c.hidden_size, c.hc_mult
    mix = (2 + n) * n
    H, hd, ql, I = c.num_attention_heads, c.head_dim, c.q_lora_rank, c.moe_intermediate_size
    G, R = c.o_groups, c.o_lora_rank
    cd = lambda x: -(-x // 32)  # noqa: E731
    t: dict = {}

    def fp8(name, o, i):  # every fp8 .weight has an e8m0 .scale over 32x32 blocks
        t[name + ".weight"] = ("F8_E4M3", [o, i])
        t[name + ".scale"] = ("F8_E8M0", [cd(o), cd(i)])

    def bf16(name, *shape):
        t[name] = ("BF16", list(shape))

    def f32(name, *shape):
        t[name] = ("F32", list(shape))

    bf16("embed.weight", V, D)
    bf16("head.weight", V, D)
    bf16("norm.weight", D)

    def block(p, lid, E, target):
        bf16(p + "attn_norm.weight", D)
        bf16(p + "ffn_norm.weight", D)
        for s in ("attn", "ffn"):
            f32(p + f"hc_{s}_fn", mix, n * D)
            f32(p + f"hc_{s}_base", mix)
            f32(p + f"hc_{s}_scale", 3)  # pre, post, comb
        f32(p + "attn.attn_sink", H)
        fp8(p + "attn.wq_a", ql, D)
        bf16(p + "attn.q_norm.weight", ql)
        fp8(p + "attn.wq_b", H * hd, ql)
        fp8(p + "attn.wkv", hd, D)
        bf16(p + "attn.kv_norm.weight", hd)
        fp8(p + "attn.wo_a", G * R, H * hd // G)
        fp8(p + "attn.wo_b", D, G * R)
        if target:
            if lid in c.kv_source_layer_ids:
                bf16(p + "attn.compressor.wkv.weight", hd, D)
                bf16(p + "attn.compressor.norm.weight", hd)
                if c.compress_ratios[lid] > 1:  # "for ratio 2" (the only ratio > 1)
                    bf16(p + "attn.compressor.wgate.weight", hd, D)
                bf16(p + "attn.indexer.wk.weight", c.index_head_dim, hd)  # "at KV sources also"
                bf16(p + "attn.indexer.k_norm.weight", c.index_head_dim)
            if lid in c.index_source_layer_ids:
                fp8(p + "attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, ql)
                bf16(p + "attn.indexer.weights_proj.weight", c.index_n_heads, D)
            if lid in c.engram_layer_ids:
                rows = c.engram_num_embeddings[c.engram_layer_ids.index(lid)]
                t[p + "engram.embed.weight"] = ("F8_E4M3", [rows, c.engram_head_dim])
                t[p + "engram.embed.scale"] = ("F8_E8M0", [rows, c.engram_head_dim // 32])
                fp8(p + "engram.wkv", (n + 1) * D, (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim)
                bf16(p + "engram.q_weight", n, D)
                bf16(p + "engram.k_weight", n, D)
        bf16(p + "ffn.gate.weight", E, D)
        f32(p + "ffn.gate.bias", E)
        f32(p + "ffn.gate.bias_vl", E)
        for e in range(E):  # MXFP4: two e2m1 per byte, per-32 e8m0 scales along `in`
            for w, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
                t[p + f"ffn.experts.{e}.{w}.weight"] = ("U8", [o, i // 2])
                t[p + f"ffn.experts.{e}.{w}.scale"] = ("F8_E8M0", [o, i // 32])
        fp8(p + "ffn.shared_experts.w1", I, D)
        fp8(p + "ffn.shared_experts.w3", I, D)
        fp8(p + "ffn.shared_experts.w2", D, I)

    for lid in range(c.num_hidden_layers):
        block(f"layers.{lid}.", lid, c.n_routed_experts, True)
    S = c.num_nextn_predict_layers
    for s in range(S):
        block(f"mtp.{s}.", c.num_hidden_layers + s, c.dspark_n_routed_experts, False)
    if S:
        fp8("mtp.0.main_proj", D, len(c.dspark_target_layer_ids) * D)
        bf16("mtp.0.main_norm.weight", D)
        last = f"mtp.{S - 1}."
        bf16(last + "norm.weight", D)
        bf16(last + "markov_head.embed.weight", V, c.dspark_markov_rank)
        bf16(last + "markov_head.head.weight", V, c.dspark_markov_rank)
        bf16(last + "confidence_head.proj.weight", 1, D + c.dspark_markov_rank)
    return t


def test_index_matches_spec8_rules(hf_dir, cfg):
    want = spec8_tensors(ModelConfig.from_pretrained(hf_dir))
    with open(os.path.join(hf_dir, ck.INDEX_FILE)) as f:
        index = json.load(f)
    wm = index["weight_map"]
    hdrs = raw_headers(hf_dir)
    assert set(wm) == set(want), (sorted(set(wm) - set(want))[:10], sorted(set(want) - set(wm))[:10])
    assert set(hdrs) == set(wm)
    files = sorted(set(wm.values()))
    assert files == [f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)]
    total = 0
    for name, (dt, shape) in want.items():
        fn, hdt, hshape, b, e = hdrs[name]
        assert wm[name] == fn, name
        assert (hdt, hshape) == (dt, shape), (name, hdt, hshape, dt, shape)
        assert e - b == int(np.prod(shape)) * ST_ITEMSIZE[dt], name
        total += e - b
    assert index["metadata"]["total_size"] == total
    # the layer lists really put tensors where they say (and nowhere else)
    assert "layers.1.engram.embed.weight" in wm and "layers.0.engram.embed.weight" not in wm
    assert "layers.3.attn.compressor.wkv.weight" not in wm and "layers.6.attn.compressor.wgate.weight" not in wm
    assert "layers.8.attn.indexer.wq_b.weight" in wm and "layers.8.attn.indexer.wk.weight" not in wm
    assert "mtp.0.ffn.experts.3.w2.weight" in wm and "mtp.0.ffn.experts.4.w2.weight" not in wm
    assert not any(n.startswith("mtp.") and (".engram." in n or ".compressor." in n or ".indexer." in n) for n in wm)
    # config.json is the HF form and reads back as the same config
    with open(os.path.join(hf_dir, "config.json")) as f:
        hfc = json.load(f)
    assert hfc["model_type"] == "deepseek_v41" and hfc["text_config"]["model_type"] == "deepseek_v41_text"
    q = hfc["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"], q["scale_fmt"], q["expert_dtype"]) == (
        "fp8", [32, 32], "ue8m0", "fp4")
    assert ModelConfig.from_pretrained(hf_dir).replace(name="tiny") == cfg
    for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens.json"):
        assert os.path.isfile(os.path.join(hf_dir, fn))


def test_spec8_rules_agree_with_declarations_for_flash():
    """The flash layer lists give exactly docs/design/spec.md §8's names/shapes/dtypes (no files: 95,819 tensors)."""
    c = ModelConfig.preset("flash")
    want = spec8_tensors(c)
    got = {n: (ck.ST_NAME[s.dtype], list(s.shape)) for n, s in ck.expected_tensors(c).items()}
    assert got == want
    # docs/design/spec.md §8: 96,085 tensors in the release, the rest are vision tensors we skip
    assert len(got) == 95819
    assert want["layers.14.engram.wkv.weight"] == ("F8_E4M3", [25600, 6144])
    assert want["layers.0.ffn.experts.383.w1.scale"] == ("F8_E8M0", [2304, 160])
    assert want["layers.0.ffn.experts.0.w2.weight"] == ("U8", [5120, 1152])


def test_writer_values_are_sane(hf_dir):
    hdrs = raw_headers(hf_dir)
    # dense fp8: dequantized std ~ 1/sqrt(fan_in)
    w = np.frombuffer(raw_bytes(hf_dir, hdrs["layers.2.attn.wq_b.weight"]), ml_dtypes.float8_e4m3fn).reshape(256, 32)
    s = np.frombuffer(raw_bytes(hf_dir, hdrs["layers.2.attn.wq_b.scale"]), ml_dtypes.float8_e8m0fnu).reshape(8, 1)
    deq = w.astype(np.float32) * np.repeat(s.astype(np.float32), 32, axis=0)
    assert np.all(np.isfinite(deq)) and 0.5 / np.sqrt(32) < deq.std() < 2.0 / np.sqrt(32)
    assert np.abs(w.astype(np.float32)).max() <= 448 and np.abs(w.astype(np.float32)).max() > 224
    # MXFP4 expert: nibbles decode to the e2m1 grid, scales are powers of two
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    p = np.frombuffer(raw_bytes(hf_dir, hdrs["layers.0.ffn.experts.5.w1.weight"]), np.uint8).reshape(32, 32)
    sc = np.frombuffer(raw_bytes(hf_dir, hdrs["layers.0.ffn.experts.5.w1.scale"]), np.uint8).reshape(32, 2)
    scale = np.exp2(np.repeat(sc.astype(np.float32) - 127, 32, 1))  # e8m0: 2^(e-127)
    v = np.stack([grid[p & 15], grid[p >> 4]], -1).reshape(32, 64) * scale
    assert 0.5 / 8 < v.std() < 2.0 / 8
    for n in ("embed.weight", "layers.0.hc_attn_fn", "mtp.2.markov_head.head.weight"):
        dt = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}[hdrs[n][1]]
        x = np.frombuffer(raw_bytes(hf_dir, hdrs[n]), dt).astype(np.float32)
        assert np.all(np.isfinite(x)) and 0 < x.std() < 2


def test_writer_is_deterministic(hf_dir, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert _run_writer_inprocess("--preset", "tiny", "--out", a, "--seed", "0", "--shards", "3") == 0
    assert _run_writer_inprocess("--preset", "tiny", "--out", b, "--seed", "1", "--shards", "3") == 0
    for fn in sorted(os.listdir(hf_dir)):
        with open(os.path.join(hf_dir, fn), "rb") as f1, open(os.path.join(a, fn), "rb") as f2:
            assert f1.read() == f2.read(), fn
    with open(os.path.join(a, "model-00002-of-00003.safetensors"), "rb") as f1, \
            open(os.path.join(b, "model-00002-of-00003.safetensors"), "rb") as f2:
        assert f1.read() != f2.read()


def _bytes(x):
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def assert_trees_identical(a, b, ordered=True):
    fa, fb = flatten_names(a), flatten_names(b)
    assert (list(fa) == list(fb)) if ordered else (sorted(fa) == sorted(fb))
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype and x.shape == y.shape, (k, x.dtype, y.dtype, x.shape, y.shape)
        assert np.array_equal(_bytes(x), _bytes(y)), k


def test_init_params_written_then_loaded_is_identical(hf_dir, cfg, tmp_path):
    # the CLI's output (seed 0) is init_params(cfg, key(0))
    assert_trees_identical(ck.load_params(hf_dir, cfg), init_params(cfg, jax.random.key(0)))
    # another seed through the library writer, with the accepted variants: U8 scales, markov_w1/w2 names
    p = init_params(cfg, jax.random.key(7))
    d = str(tmp_path / "u8")
    ck.save_hf_checkpoint(p, cfg, d, shards=1, scale_format="u8", markov_names="w1_w2")
    hdrs = raw_headers(d)
    assert hdrs["layers.0.attn.wq_a.scale"][1] == "U8" and "mtp.2.markov_head.markov_w1.weight" in hdrs
    assert_trees_identical(ck.load_params(d, cfg), p)


def test_roundtrip_hf_and_orbax_logits_bitwise(hf_dir, orbax_dir, cfg, fwd):
    assert ck.checkpoint_kind(hf_dir) == "hf" and ck.checkpoint_kind(orbax_dir) == "orbax"
    p_hf = ck.load_params(hf_dir, cfg)
    p_ob = ck.load_params(orbax_dir, cfg)
    assert_trees_identical(p_hf, p_ob)
    tokens = (jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) * 37 + 5) % cfg.vocab_size
    la, lb = np.asarray(fwd(p_hf, tokens, cfg)), np.asarray(fwd(p_ob, tokens, cfg))
    assert np.all(np.isfinite(la)) and la.std() > 0
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))


def test_fp8_fp4_bytes_survive_conversion(hf_dir, orbax_dir):
    """Every F8_E4M3 / U8 / F8_E8M0 tensor of the shards is byte-for-byte in the Orbax arrays."""
    import tensorstore as ts

    hdrs = raw_headers(hf_dir)
    opened = {}
    n = 0
    for name, h in hdrs.items():
        if h[1] not in ("F8_E4M3", "U8", "F8_E8M0"):
            continue
        parts = name.split(".")
        expert = None
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            expert = int(parts[i + 1])
            parts = parts[: i + 1] + parts[i + 2:]
        arr_name = ".".join(parts)
        if arr_name not in opened:
            opened[arr_name] = ts.open({"driver": "zarr", "kvstore": {
                "driver": "file", "path": os.path.join(orbax_dir, "params", arr_name)}}, open=True).result()
        a = opened[arr_name]
        x = np.asarray((a if expert is None else a[expert]).read().result())
        assert x.dtype.name == {"F8_E4M3": "float8_e4m3fn", "U8": "uint8", "F8_E8M0": "float8_e8m0fnu"}[h[1]]
        assert list(x.shape) == h[2]
        assert x.tobytes() == raw_bytes(hf_dir, h), name
        n += 1
    assert n > 700


def test_orbax_dir_is_a_standard_orbax_checkpoint(hf_dir, orbax_dir, cfg):
    import orbax.checkpoint as ocp

    from dsv41_jax.model.params import children, is_node, param_shapes

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    def checkpoint_only(tree):  # drop what load_params derives (token map, load-time bf16 copies)
        tree.pop("derived")
        for lp in tree["layers"] + tree["mtp"]:
            lp["attn"]["wo_a"] = dataclasses.replace(lp["attn"]["wo_a"], bf16=None)
        return tree

    def plain(node):  # the typed nodes (`weights.Fp8` ...) as the dicts a reader without our types restores into
        got = [(k, plain(v)) for k, v in children(node)]
        return node if not is_node(node) else [v for _, v in got] if isinstance(node, list) else dict(got)

    target = plain(checkpoint_only(param_shapes(cfg)))
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=dev), target)
    restored = ocp.StandardCheckpointer().restore(os.path.join(orbax_dir, "params"), target)
    p = checkpoint_only(ck.load_params(hf_dir, cfg))
    assert_trees_identical(p, restored, ordered=False)
    with open(os.path.join(orbax_dir, ck.META_FILE)) as f:
        meta = json.load(f)
    assert meta["storage"] == "keep" and meta["mesh"]["tp"] == 1 and meta["source"]["tensors"] == 990


def test_wo_a_dequantized_once_at_load(hf_dir, orbax_dir, cfg):
    """docs/design/spec.md §3: wo_a is fp8 + scale in the file and bf16 in the loaded params (both checkpoint kinds),
    the exact dequantization of the pair, which stays loaded for the reference path."""
    for path in (hf_dir, orbax_dir):
        p = ck.load_params(path, cfg)
        for lp in p["layers"] + p["mtp"]:
            wa = lp["attn"]["wo_a"]
            assert wa.bf16.dtype == jnp.bfloat16 and wa.weight.dtype == jnp.float8_e4m3fn
            want = ck.dequant_fp8_block_np(np.asarray(wa.weight), np.asarray(wa.scale))
            np.testing.assert_array_equal(np.asarray(wa.bf16.astype(jnp.float32)), want)
    assert "layers.0.attn.wo_a.bf16" not in ck.expected_tensors(cfg)  # never written to a file


@pytest.mark.parametrize("kind", ["hf", "orbax"])
def test_load_onto_mesh(kind, hf_dir, orbax_dir, cfg, cpu8, monkeypatch):
    """`parallel.plan.load_params(..., mesh)` puts every leaf straight onto its `parallel.rules` sharding: each device
    gets only its own block, cut on the host (`jax.make_array_from_callback`); no leaf goes whole onto a
    device first (jax.device_put is never called), and the values are the unsharded load's."""
    from dsv41_jax.parallel import plan, rules
    from dsv41_jax.parallel.mesh import make_mesh

    mesh = make_mesh(tp=2, ep=4, cfg=cfg)
    blocks: list = []  # (global shape, sharding, [block shapes handed to devices])
    real = jax.make_array_from_callback

    def spy(shape, sharding, cb, *a, **k):
        got: list = []
        blocks.append((tuple(shape), sharding, got))

        def recording(idx):
            block = cb(idx)
            got.append(np.shape(block))
            return block

        return real(shape, sharding, recording, *a, **k)

    def no_device_put(*a, **k):
        raise AssertionError("load_params(..., mesh) must not device_put a whole leaf")

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    monkeypatch.setattr(jax, "device_put", no_device_put)
    p = plan.load_params(hf_dir if kind == "hf" else orbax_dir, cfg, mesh)
    monkeypatch.undo()
    want = flatten_names(rules.param_shardings(cfg, mesh))
    got = flatten_names(p)
    assert set(got) == set(want) and len(blocks) == len(got)
    for k, x in got.items():
        assert x.sharding.is_equivalent_to(want[k], x.ndim), k
    assert got["layers.0.ffn.experts.w1.weight"].sharding.spec[0] == "ep"
    assert got["embed.weight"].sharding.spec[0] == "tp"
    assert got["layers.1.engram.embed.weight"].sharding.spec[0] == ("ep", "tp")
    assert got["layers.2.attn.wo_a.bf16"].sharding.spec[0] == "tp"  # the derived copy too
    split = 0
    for shape, sh, got_blocks in blocks:
        assert got_blocks and set(got_blocks) == {sh.shard_shape(shape)}, (shape, sh, got_blocks)
        split += sh.shard_shape(shape) != shape
    assert split >= len(blocks) // 4  # most leaves are small and replicated; the big ones are split
    assert_trees_identical(p, ck.load_params(hf_dir, cfg))
    # the host Engram table: the tables stay numpy `HostTable`s, never placed; the rest as above
    from dsv41_jax.parallel.host_table import HostTable

    h = plan.load_params(hf_dir, cfg, mesh, engram_host_table=True)
    t = h["layers"][1]["engram"]["embed"]
    assert isinstance(t, HostTable)
    np.testing.assert_array_equal(t.weight.view(np.uint8),
                                  np.asarray(got["layers.1.engram.embed.weight"]).view(np.uint8))
    assert h["layers"][2]["attn"]["wq_b"].weight.sharding.is_equivalent_to(want["layers.2.attn.wq_b.weight"], 2)


def test_load_without_cfg_and_load_model(orbax_dir, hf_dir, cfg):
    c, p = ck.load_model(orbax_dir)
    assert c.replace(name="tiny") == cfg
    assert_trees_identical(p, ck.load_params(hf_dir))


def _rewrite_shard(d, fn, mutate, update_index=True):
    from safetensors.numpy import save_file

    path = os.path.join(d, fn)
    hdr, meta = ck.read_safetensors_header(path)
    tensors = {n: ck.read_tensor(e) for n, e in hdr.items()}
    mutate(tensors)
    os.remove(path)
    save_file(tensors, path, metadata=meta)
    if not update_index:
        return
    with open(os.path.join(d, ck.INDEX_FILE)) as f:
        index = json.load(f)
    wm = {n: f_ for n, f_ in index["weight_map"].items() if f_ != fn or n in tensors}
    wm.update({n: fn for n in tensors})
    index["weight_map"] = wm
    with open(os.path.join(d, ck.INDEX_FILE), "w") as f:
        json.dump(index, f)


def test_loader_errors_name_tensor_file_and_expectation(hf_dir, cfg, tmp_path):
    hdrs = raw_headers(hf_dir)
    d = str(tmp_path / "bad")
    shutil.copytree(hf_dir, d)
    name = "layers.3.attn.wq_b.weight"
    fn = hdrs[name][0]
    _rewrite_shard(d, fn, lambda t: t.pop(name), update_index=False)  # the index still points at fn
    with pytest.raises(ck.CheckpointError) as ei:
        ck.load_params(d, cfg)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert f"{name}: missing from {fn}" in msg and "expected shape [256, 32] dtype F8_E4M3" in msg
    _rewrite_shard(d, fn, lambda t: None)  # now also gone from the index
    with pytest.raises(ck.CheckpointError, match=rf"{name}: missing from all 3 shards .* expected shape"):
        ck.load_params(d, cfg)
    # wrong shape / dtype
    shutil.rmtree(d)
    shutil.copytree(hf_dir, d)
    n2 = "layers.5.ffn.experts.2.w3.scale"
    fn2 = hdrs[n2][0]

    def mut(t):
        t[name if hdrs[name][0] == fn2 else n2] = np.zeros((32, 3), ml_dtypes.float8_e8m0fnu)

    _rewrite_shard(d, fn2, mut)
    with pytest.raises(ck.CheckpointError, match=r"found shape \[32, 3\]; expected shape \[32, 2\]"):
        ck.load_params(d, cfg)


def test_loader_reports_unknown_and_skips_vision(hf_dir, cfg, tmp_path, caplog):
    d = str(tmp_path / "extra")
    shutil.copytree(hf_dir, d)

    def add(t):
        t["vision.blocks.0.attn.qkv.weight"] = np.ones((4, 4), ml_dtypes.bfloat16)
        t["aligner.proj.weight"] = np.ones((2, 4), ml_dtypes.bfloat16)
        t["image_newline"] = np.ones((4,), ml_dtypes.bfloat16)
        t["layers.0.ffn.mystery.weight"] = np.ones((3,), np.float32)

    _rewrite_shard(d, "model-00001-of-00003.safetensors", add)
    with caplog.at_level(logging.INFO, logger="dsv41_jax.model.checkpoint"):
        p = ck.load_params(d, cfg)
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "layers.0.ffn.mystery.weight" in warns[0].getMessage()
    assert "vision" not in warns[0].getMessage()
    vis = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(vis) == 1 and "3 vision tensors" in vis[0].getMessage()
    assert_trees_identical(p, ck.load_params(hf_dir, cfg))


def test_checkpoint_kind_rejects_other_dirs(tmp_path):
    with pytest.raises(ck.CheckpointError, match="neither an HF checkpoint"):
        ck.checkpoint_kind(str(tmp_path))
    with pytest.raises(ck.CheckpointError, match="not a directory"):
        ck.checkpoint_kind(str(tmp_path / "nope"))


def test_numpy_dequant_matches_quant_module():
    from dsv41_jax.model import quant, quant_np

    g = np.random.default_rng(0)
    w = g.standard_normal((70, 96), np.float32)
    q, s = quant_np.quantize_fp8_block_np(w)
    ref = np.asarray(quant.dequantize_fp8_block(jnp.asarray(q), jnp.asarray(s)))
    assert np.array_equal(ck.dequant_fp8_block_np(q, s), ref)
    assert np.array_equal(ck.dequant_fp8_block_np(q[32:64], s, 32), ref[32:64])
    we = g.standard_normal((3, 40, 64), np.float32)
    pq, ps = quant_np.quantize_mxfp4_np(we)
    ref = np.stack([np.asarray(quant.dequantize_mxfp4(jnp.asarray(pq[e]), jnp.asarray(ps[e]))) for e in range(3)])
    assert np.array_equal(ck.dequant_mxfp4_np(pq, ps), ref)
    # bf16 holds every dequantized value exactly, so re-quantizing reproduces the values
    for kind, (a, b), deq in (("fp8", (q, s), ck.dequant_fp8_block_np), ("mxfp4", (pq, ps), ck.dequant_mxfp4_np)):
        f = deq(a, b)
        assert np.array_equal(f.astype(ml_dtypes.bfloat16).astype(np.float32), f)
        assert np.array_equal(deq(*ck.requantize_np(kind, f.astype(ml_dtypes.bfloat16))), f)


def test_orbax_loader_errors(orbax_dir, cfg, tmp_path):
    d = str(tmp_path / "ob")
    shutil.copytree(orbax_dir, d)
    shutil.rmtree(os.path.join(d, "params", "layers.3.attn.wq_b.weight"))
    with pytest.raises(ck.CheckpointError, match=r"layers\.3\.attn\.wq_b\.weight: missing from .*params; "
                                                 r"expected shape \[256, 32\] dtype float8_e4m3fn"):
        ck.load_params(d, cfg)
    with pytest.raises(ck.CheckpointError, match="converted with another config"):
        ck.load_params(orbax_dir, cfg.replace(moe_intermediate_size=64))


def test_tiny_name_loads_the_seed0_checkpoint(hf_dir, cfg):
    assert_trees_identical(ck.load_params("tiny"), ck.load_params(hf_dir, cfg), ordered=False)


def test_generate_accepts_either_directory(micro_dir, tmp_path):
    """Issue 4 item 4: what takes a model path accepts an HF or a converted directory (cfg read from it).
    On the session's micro checkpoint (release layout, 3 layers), converted here: the property is the
    loader's, and a micro step compiles in a third of tiny's time."""
    from dsv41_jax import convert
    from dsv41_jax.model.decode import generate

    ob = str(tmp_path / "micro_orbax")
    assert convert.main(["--hf-dir", micro_dir, "--out", ob, "--quiet"]) == 0
    assert ck.checkpoint_kind(micro_dir) == "hf" and ck.checkpoint_kind(ob) == "orbax"
    # chunk_size=1: the prompt goes through the one-token step too, so one decode shape compiles, not two
    a = generate(micro_dir, None, [[5, 6, 7]], 3, chunk_size=1)
    b = generate(ob, None, [[5, 6, 7]], 3, chunk_size=1)
    assert a == b and len(a[0]) == 3


def test_text_only_release_checkpoint_loads_and_runs(hf_dir, cfg, fwd, tmp_path, caplog):
    """Issue 9 item 5: a release without vision tensors (no ``ffn.gate.bias_vl`` in any layer or DSpark
    stage: docs/design/spec.md §8 says it is read for image tokens only) loads from HF and from Orbax, with zeros in
    its place, and gives the same logits and tokens as the full checkpoint."""
    from dsv41_jax import convert

    full = ck.load_params(hf_dir, cfg)
    d = str(tmp_path / "text_only")
    assert _run_writer_inprocess("--preset", "tiny", "--out", d, "--seed", "0", "--shards", "2", "--text-only") == 0
    names = set(raw_headers(d))
    assert not any(n.endswith("bias_vl") for n in names)
    assert any(n.endswith("ffn.gate.bias") for n in names) and any(n.startswith("mtp.") for n in names)
    with caplog.at_level(logging.INFO, logger="dsv41_jax.model.checkpoint"):
        p = ck.load_params(d, cfg)
    assert any("vision-only tensors absent" in r.getMessage() for r in caplog.records)
    vl = [v for k, v in flatten_names(p).items() if k.endswith("bias_vl")]
    assert len(vl) == cfg.num_hidden_layers + len(p["mtp"])  # every layer and DSpark stage
    assert all(np.asarray(v).dtype == np.float32 and not np.asarray(v).any() for v in vl)
    # the roundtrip test's shape: the module's jitted forward is compiled once for both
    tokens = (jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) * 37 + 5) % cfg.vocab_size
    la, lb = np.asarray(fwd(full, tokens, cfg)), np.asarray(fwd(p, tokens, cfg))
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    ob = str(tmp_path / "text_only_orbax")
    assert convert.main(["--hf-dir", d, "--out", ob, "--quiet"]) == 0
    assert_trees_identical(ck.load_params(ob, cfg), p)
    # a present bias_vl is still read (not dropped)
    marked = jax.tree_util.tree_map(lambda x: x, full)
    marked["layers"][0]["ffn"]["gate"]["bias_vl"] = jnp.full_like(full["layers"][0]["ffn"]["gate"]["bias_vl"], 0.5)
    d2 = str(tmp_path / "with_vl")
    ck.save_hf_checkpoint(marked, cfg, d2, shards=1)
    assert float(ck.load_params(d2, cfg)["layers"][0]["ffn"]["gate"]["bias_vl"][0]) == 0.5
