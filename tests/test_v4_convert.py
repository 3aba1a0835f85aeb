"""`python -m dsv41_jax.convert` on a DeepSeek-V4 release directory (issue 48 item 3): a
``scripts/make_checkpoint.py --preset tiny-v4`` directory (fp8 128x128 blocks, MXFP4 experts, ``tid2eid``) converts
into the same Orbax layout V4.1's does; `load_params` of the result is bitwise the straight read of the source
(--dtype keep) or dequantizes to exactly its values (--dtype bf16); an interrupted conversion resumes to the same
files; the engine's greedy tokens are the straight read's; bad input is one line, exit 2, nothing written."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsv41_jax import convert
from dsv41_jax.model import ModelConfig, init_params, load_params
from dsv41_jax.model import checkpoint as ck
from dsv41_jax.model.params import flatten_names
from dsv41_jax.model.v4 import checkpoint as v4ck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The release-layout directory `scripts/make_checkpoint.py --preset tiny-v4` writes (seed 0, 2 shards)."""
    script = os.path.join(ROOT, "scripts", "make_checkpoint.py")
    spec = importlib.util.spec_from_file_location("make_checkpoint", script)
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    d = str(tmp_path_factory.mktemp("v4conv") / "hf")
    assert mk.main(["--preset", "tiny-v4", "--out", d]) == 0
    return d


@pytest.fixture(scope="module")
def converted(hf_dir):
    """Converted through the CLI (`python -m dsv41_jax.convert`, progress bar on): (out dir, stdout, stderr)."""
    out = os.path.join(os.path.dirname(hf_dir), "keep")
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.convert", "--hf-dir", hf_dir, "--out", out, "--verify"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out, r.stdout, r.stderr


@pytest.fixture(scope="module")
def straight(hf_dir):
    return flatten_names(load_params(hf_dir))


def _bits(a):
    return np.asarray(a).view(np.uint8)


def test_converted_keep_loads_bitwise_as_the_straight_read(hf_dir, converted, straight):
    out, stdout, stderr = converted
    assert "convert:" in stderr and "verified: 585 items" in stdout  # progress bar; 585 source tensors read back
    with open(os.path.join(out, ck.META_FILE)) as f:
        meta = json.load(f)
    assert (meta["model_family"], meta["storage"], meta["mesh"]["tp"], meta["mesh"]["ep"]) == ("deepseek_v4", "keep",
                                                                                                 1, 1)
    arrays = meta["arrays"]
    wq_b = ModelConfig.preset("tiny-v4")
    assert arrays["layers.2.attn.wq_b.scale"]["dtype"] == "float8_e8m0fnu"  # one scale per 128x128 block
    assert arrays["layers.2.attn.wq_b.scale"]["shape"] == [-(-wq_b.num_attention_heads * wq_b.head_dim // 128),
                                                           -(-wq_b.q_lora_rank // 128)]
    assert arrays["layers.0.ffn.gate.tid2eid"]["dtype"] == "int32"
    assert arrays["layers.0.ffn.experts.w1.weight"]["shape"][0] == 8  # stacked from one tensor per expert
    assert ck.checkpoint_kind(out) == "orbax" and ModelConfig.from_pretrained(out) == ModelConfig.from_pretrained(
        hf_dir)
    got = flatten_names(load_params(out))
    assert list(got) == list(straight)
    for n, a in straight.items():
        b = got[n]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), n
        assert np.array_equal(_bits(b), _bits(a)), n


def test_bf16_storage_dequantizes_exactly(hf_dir, straight, tmp_path, capsys):
    """--dtype bf16: every fp8 (128x128 blocks) and MXFP4 pair stored dequantized, re-quantized at load to pairs
    that dequantize to exactly the source's values (stated tolerance 0); every other leaf bitwise."""
    out = str(tmp_path / "bf16")
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--dtype", "bf16", "--quiet", "--verify"]) == 0
    assert "verified:" in capsys.readouterr().out
    with open(os.path.join(out, ck.META_FILE)) as f:
        arrays = json.load(f)["arrays"]
    assert "layers.0.attn.wq_a.scale" not in arrays and arrays["layers.0.attn.wq_a.weight"]["dtype"] == "bfloat16"
    assert arrays["layers.0.ffn.experts.w2.weight"]["shape"] == [8, 64, 32]  # [E, out, in] dequantized
    cfg = ModelConfig.from_pretrained(hf_dir)
    got = flatten_names(load_params(out))
    assert list(got) == list(straight)
    pairs = v4ck.quant_pairs(cfg, v4ck.declare_params(cfg))
    assert {k for k, *_ in pairs.values()} == {"fp8", "mxfp4"}
    for w, (kind, s, _, block) in pairs.items():
        if kind == "fp8":
            x = ck.dequant_fp8_block_np(np.asarray(straight[w]), np.asarray(straight[s]), 0, block)
            y = ck.dequant_fp8_block_np(np.asarray(got[w]), np.asarray(got[s]), 0, block)
        else:
            x = ck.dequant_mxfp4_np(np.asarray(straight[w]), np.asarray(straight[s]))
            y = ck.dequant_mxfp4_np(np.asarray(got[w]), np.asarray(got[s]))
        assert np.array_equal(x, y), w
    scales = {v[1] for v in pairs.values()}
    for n, a in straight.items():
        if n not in pairs and n not in scales:
            assert got[n].dtype == a.dtype and np.array_equal(_bits(got[n]), _bits(a)), n


def test_interrupted_conversion_resumes_to_the_same_files(hf_dir, converted, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "resumed")
    real, count = convert._Durability.maybe_sync, [0]

    def interrupt_after_100(self, force=False):
        real(self, force)
        if not force:
            count[0] += 1
            if count[0] == 100:
                raise KeyboardInterrupt

    monkeypatch.setattr(convert._Durability, "maybe_sync", interrupt_after_100)
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--quiet"]) == 130
    assert "rerun with --resume" in capsys.readouterr().err and not os.path.exists(out)
    monkeypatch.setattr(convert._Durability, "maybe_sync", real)
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--quiet", "--resume", "--dtype", "bf16"]) == 2
    assert "differs in: storage" in capsys.readouterr().err
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--quiet", "--resume"]) == 0
    io = capsys.readouterr()
    assert "resuming: 100 of 585 tensors" in io.err and "written now: 485" in io.out
    files = {}
    for d in (converted[0], out):
        files[d] = {}
        for root, _, fns in os.walk(d):
            for fn in fns:
                with open(os.path.join(root, fn), "rb") as f:
                    files[d][os.path.relpath(os.path.join(root, fn), d)] = f.read()
    a, b = files[converted[0]], files[out]
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == [os.path.join("params", "_CHECKPOINT_METADATA")]  # timestamps only


def test_engine_greedy_tokens_equal_the_straight_reads(hf_dir, converted):
    """The serving path (`Engine` over `parallel.plan.load_params`) on the converted directory and on the release
    directory: the same greedy tokens."""
    from dsv41_jax.serving.engine import Engine
    from dsv41_jax.serving.engine_args import EngineArgs
    from dsv41_jax.serving.sampling import SamplingParams

    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 320, 11)]
    toks = []
    for d in (hf_dir, converted[0]):
        # tests/test_v4_engine.py's engine shapes: the run's persistent compile cache holds its programs
        eng = Engine(EngineArgs(model=d, dtype="exact", page_size=8, max_total_tokens=256, context_length=64,
                                max_running_requests=2, chunked_prefill_size=16, batch_buckets=[2],
                                token_buckets=[16], skip_server_warmup=True, decode_log_interval=1000))
        eng.add_request("r", prompt_token_ids=prompt, sampling_params=SamplingParams(temperature=0, max_tokens=6))
        (o,) = eng.run_until_done()
        assert o.error is None
        toks.append(list(o.outputs[0].token_ids))
    assert len(toks[0]) == 6 and toks[0] == toks[1]


def test_transformers_names_and_widened_dtypes_convert_as_read(tmp_path):
    """A directory as transformers-style writers leave it (``model.embed_tokens`` / ``lm_head`` names, one
    ``model.safetensors``, no ``mtp.*``, U8 scales, floats in f16, ``tid2eid`` as int64): the converter keeps what
    the straight read keeps (f16 as fp32, int64 as int32, no MTP layer), bitwise."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from dsv41_jax.model.config import TINY_DIR

    cfg = ModelConfig.preset("tiny-v4")
    tensors = v4ck.file_tensors(dict(init_params(cfg, jax.random.key(2)), mtp=[]), cfg, "u8")
    renames = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight"}
    out = {}
    for n, a in tensors.items():
        a = a.astype(np.float16) if a.dtype == ml_dtypes.bfloat16 else a.astype(np.int64) if a.dtype == np.int32 else a
        out[renames.get(n, n)] = a
    d = str(tmp_path / "tf")
    os.makedirs(d)
    save_file(out, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f)
    shutil.copy(os.path.join(TINY_DIR, "tokenizer.json"), d)
    assert convert.main(["--hf-dir", d, "--out", str(tmp_path / "out"), "--quiet", "--verify"]) == 0
    a, b = flatten_names(load_params(d)), flatten_names(load_params(str(tmp_path / "out")))
    assert list(a) == list(b) and not any(n.startswith("mtp.") for n in a)
    assert a["layers.0.attn_norm.weight"].dtype == np.float32 and a["layers.0.ffn.gate.tid2eid"].dtype == np.int32
    for n in a:
        assert b[n].dtype == a[n].dtype and np.array_equal(_bits(b[n]), _bits(a[n])), n


def test_converted_for_a_mesh_records_v4_specs_and_loads_onto_it(cpu8, hf_dir, straight, tmp_path):
    """``--tp 2 --ep 4``: the recorded partition specs are V4's mesh rules (`v4.params.partition_specs`: q heads
    over tp, routed experts over ep, ``tid2eid`` replicated), and the directory loads straight onto a tp=2 x ep=4
    mesh with every leaf on its rule's sharding and the straight read's bits."""
    from dsv41_jax.model.v4.params import partition_specs
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh
    from dsv41_jax.parallel.plan import load_params as load_on_mesh

    out = str(tmp_path / "tp2ep4")
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--tp", "2", "--ep", "4", "--quiet"]) == 0
    with open(os.path.join(out, ck.META_FILE)) as f:
        arrays = json.load(f)["arrays"]
    cfg = ModelConfig.from_pretrained(out)
    want = {n: convert._json_spec(s) for n, s in partition_specs(cfg, 2, 4).items()}
    assert {n: a["partition_spec"] for n, a in arrays.items()} == {n: want[n] for n in arrays}
    assert arrays["layers.0.ffn.experts.w1.weight"]["partition_spec"][0] == "ep"
    assert arrays["layers.2.attn.wq_b.weight"]["partition_spec"][0] == "tp"
    assert arrays["layers.0.ffn.gate.tid2eid"]["partition_spec"] == [None, None]
    mesh = make_mesh(2, 4, cfg=cfg)
    got = load_on_mesh(out, cfg, mesh)
    shardings = rules.param_shardings(cfg, mesh)
    for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(shardings)):
        assert a.sharding.is_equivalent_to(s, a.ndim), jax.tree_util.keystr(path)
    for n, a in flatten_names(got).items():
        assert np.array_equal(_bits(a), _bits(straight[n])), n


# ------------------------------------------------------------------------------------------------ bad input


def _rewrite(d, mutate):
    """Rewrite the shard holding the tensors `mutate` changes (the index is left as it was)."""
    from safetensors.numpy import save_file

    with open(os.path.join(d, ck.INDEX_FILE)) as f:
        fn = json.load(f)["weight_map"]["layers.1.attn.wkv.weight"]
    hdr, meta = ck.read_safetensors_header(os.path.join(d, fn))
    t = {n: ck.read_tensor(e) for n, e in hdr.items()}
    mutate(t)
    save_file(t, os.path.join(d, fn), metadata=meta)


def _fault(hf_dir, d, fault):
    """A faulty copy of `hf_dir` at `d` and the strings its one-line error must hold."""
    if fault == "not_a_checkpoint":
        os.makedirs(d)
        return d, ["neither an HF checkpoint"]
    shutil.copytree(hf_dir, d)
    if fault == "missing":
        _rewrite(d, lambda t: t.pop("layers.1.attn.wkv.weight"))
        return d, ["layers.1.attn.wkv.weight: missing", "expected shape [64, 64] dtype float8_e4m3fn"]
    if fault == "dtype":
        _rewrite(d, lambda t: t.__setitem__("layers.1.attn.wkv.weight", t["layers.1.attn.wkv.weight"].astype(
            np.float32)))
        return d, ["layers.1.attn.wkv.weight", "dtype F32, expected float8_e4m3fn"]
    if fault == "config":  # a V4 config.json of a model with a wider MoE than the tensors
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["moe_intermediate_size"] *= 2
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        return d, ["tensor problem(s)", "is config.json this model's?", "expected [64, 32]"]
    raise AssertionError(fault)


@pytest.mark.parametrize("fault", ["not_a_checkpoint", "missing", "dtype", "config"])
def test_bad_input_is_one_line_exit_2_nothing_written(fault, hf_dir, tmp_path, capsys):
    d, expect = _fault(hf_dir, str(tmp_path / "in"), fault)
    out = str(tmp_path / "out")
    assert convert.main(["--hf-dir", d, "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1] == "nothing was written.", err
    for s in expect:
        assert s in lines[0], (s, err)
    assert not os.path.exists(out) and not os.path.exists(convert.temp_dir_for(out))


def test_help_mentions_v4():
    text = " ".join(convert.build_parser().format_help().split())
    assert "DeepSeek-V4 (Flash / Pro) release directory" in text


def test_a_converted_dir_read_with_another_family_or_missing_arrays_is_refused(converted, tmp_path):
    out = converted[0]
    with pytest.raises(ck.CheckpointError, match="converted from a deepseek_v4 checkpoint, but the config is "
                                                 "deepseek_v41"):
        load_params(out, ModelConfig.preset("tiny"))
    d = str(tmp_path / "broken")
    shutil.copytree(out, d)
    shutil.rmtree(os.path.join(d, "params", "layers.3.attn.compressor.ape"))
    with pytest.raises(ck.CheckpointError, match=r"layers\.3\.attn\.compressor\.ape: missing from"):
        load_params(d)
