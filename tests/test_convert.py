"""`python -m dsv41_jax.convert`: faults are refused before anything is written, a killed conversion
resumes to the same checkpoint, --dtype bf16 is exact, --tp/--ep set the layout, and peak memory is
bounded by the largest tensor, not the checkpoint."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax import convert
from dsv41_jax.model import ModelConfig, forward, init_params
from dsv41_jax.model import checkpoint as ck
from dsv41_jax.model.params import flatten_names, param_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "JAX_PLATFORMS": "cpu"}


def cli(*args, env=None, wait=True):
    cmd = [sys.executable, "-m", "dsv41_jax.convert", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def finish(p):
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def hf_dir(cfg, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("conv") / "hf")
    ck.save_hf_checkpoint(init_params(cfg, jax.random.key(3)), cfg, d, shards=3)
    return d


def _rewrite_shard(d, fn, mutate):
    """Rewrite shard `fn` of `d` after `mutate(tensors)`; the index is left as it was."""
    from safetensors.numpy import save_file

    path = os.path.join(d, fn)
    hdr, meta = ck.read_safetensors_header(path)
    tensors = {n: ck.read_tensor(e) for n, e in hdr.items()}
    mutate(tensors)
    os.remove(path)
    save_file(tensors, path, metadata=meta)


def _where(d, name):
    with open(os.path.join(d, ck.INDEX_FILE)) as f:
        return json.load(f)["weight_map"][name]


# ------------------------------------------------------------------------------------------------
# faults: non-zero exit, a message naming the tensor and file, nothing published
# ------------------------------------------------------------------------------------------------

FAULTS = ["truncated", "missing", "shape", "dtype", "config"]  # through the CLI in subprocesses
MORE_FAULTS = ["tokenizer", "bad_config_json", "not_a_checkpoint"]  # through convert.main in-process


@pytest.fixture(scope="module")
def fault_runs(hf_dir, tmp_path_factory):
    """Each fault's directory, converted by the CLI; all subprocesses run concurrently."""
    base = tmp_path_factory.mktemp("faults")
    procs = {}
    expect = {}
    for fault in FAULTS:
        d = _fault_dir(hf_dir, str(base / fault), fault, expect)
        out = str(base / f"{fault}_out")
        procs[fault] = (cli("--hf-dir", d, "--out", out, wait=False), out)
    return {k: (finish(p), out, expect[k]) for k, (p, out) in procs.items()}


def _fault_dir(hf_dir, d, fault, expect):
    shutil.copytree(hf_dir, d)
    if fault == "truncated":
        name = "layers.9.ffn.experts.3.w2.weight"
        fn = _where(d, name)
        p = os.path.join(d, fn)
        os.truncate(p, os.path.getsize(p) - 1000)
        expect[fault] = [fn, "data ends at byte", "truncated shard"]
    elif fault == "missing":
        name = "layers.6.attn.indexer.wk.weight"
        fn = _where(d, name)
        _rewrite_shard(d, fn, lambda t: t.pop(name))
        expect[fault] = [name, fn, "missing", "expected shape [32, 64] dtype BF16"]
    elif fault == "shape":
        name = "layers.2.attn.wq_a.scale"
        fn = _where(d, name)
        _rewrite_shard(d, fn, lambda t: t.__setitem__(name, np.zeros((1, 3), ml_dtypes.float8_e8m0fnu)))
        expect[fault] = [name, fn, "found shape [1, 3]", "expected shape [1, 2] dtype F8_E8M0"]
    elif fault == "dtype":
        name = "layers.4.attn.wkv.weight"
        fn = _where(d, name)
        _rewrite_shard(d, fn, lambda t: t.__setitem__(name, t[name].astype(ml_dtypes.bfloat16)))
        expect[fault] = [name, fn, "found dtype BF16", "expected shape [64, 64] dtype F8_E4M3"]
    elif fault == "config":  # config.json from a model with a wider MoE than the tensors
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["text_config"]["moe_intermediate_size"] = 64
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        name = "layers.0.ffn.experts.0.w1.weight"
        expect[fault] = [name, _where(d, name), "found shape [32, 32]; expected shape [64, 32] dtype U8",
                         "is config.json this model's?"]
    elif fault == "tokenizer":
        os.remove(os.path.join(d, "tokenizer.json"))
        expect[fault] = ["tokenizer.json"]
    elif fault == "bad_config_json":
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write("{not json")
        expect[fault] = ["config.json", "not valid JSON"]
    elif fault == "not_a_checkpoint":
        for fn in os.listdir(d):
            if fn.endswith(".safetensors"):
                os.remove(os.path.join(d, fn))
        os.remove(os.path.join(d, ck.INDEX_FILE))
        expect[fault] = ["neither an HF checkpoint"]
    return d


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_is_refused_before_writing(fault, fault_runs):
    (rc, out, err), out_dir, expect = fault_runs[fault]
    assert rc == 2, (rc, err)
    for s in expect:
        assert s in err, (s, err)
    assert "nothing was written" in err
    assert not os.path.exists(out_dir)
    assert not os.path.exists(convert.temp_dir_for(out_dir))


@pytest.mark.parametrize("fault", MORE_FAULTS)
def test_more_faults_are_refused_before_writing(fault, hf_dir, tmp_path, capsys):
    expect = {}
    d = _fault_dir(hf_dir, str(tmp_path / fault), fault, expect)
    out = str(tmp_path / "out")
    assert convert.main(["--hf-dir", d, "--out", out]) == 2
    err = capsys.readouterr().err
    for s in expect[fault] + ["nothing was written"]:
        assert s in err, (s, err)
    assert not os.path.exists(out) and not os.path.exists(convert.temp_dir_for(out))


def test_help_explains_every_flag():
    rc, out, err = cli("--help")
    assert rc == 0
    for flag in ("--hf-dir", "--out", "--tp", "--ep", "--dtype", "keep", "bf16", "--resume", "--overwrite",
                 "--verify", "--quiet", "Exit status"):
        assert flag in out, flag


# ------------------------------------------------------------------------------------------------
# kill midway, resume
# ------------------------------------------------------------------------------------------------


def _tree_files(d):
    out = {}
    for root, _, files in os.walk(d):
        for fn in files:
            p = os.path.join(root, fn)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


# The killed run: `convert.main` in a child process whose per-tensor durability hook (called once per
# tensor, right after its manifest line is flushed) SIGKILLs the process after N tensors.
_KILLED_AFTER = """
import os, signal, sys
from dsv41_jax import convert
n, real, count = int(sys.argv[1]), convert._Durability.maybe_sync, [0]
def maybe_sync(self, force=False):
    real(self, force)
    if not force:
        count[0] += 1
        if count[0] >= n:
            os.kill(os.getpid(), signal.SIGKILL)
convert._Durability.maybe_sync = maybe_sync
sys.exit(convert.main(sys.argv[2:]))
"""


def test_killed_conversion_resumes_to_the_same_checkpoint(hf_dir, tmp_path, capsys):
    ref, killed = str(tmp_path / "ref"), str(tmp_path / "killed")
    p_kill = subprocess.Popen([sys.executable, "-c", _KILLED_AFTER, "400", "--hf-dir", hf_dir, "--out", killed,
                               "--quiet"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    assert convert.main(["--hf-dir", hf_dir, "--out", ref, "--quiet"]) == 0  # uninterrupted, meanwhile
    assert "verified:" not in capsys.readouterr().out  # no read-back without --verify
    rc, _, err = finish(p_kill)
    assert rc == -9, (rc, err)  # SIGKILLed after 400 tensors
    tmp = convert.temp_dir_for(killed)
    assert not os.path.exists(killed) and os.path.isdir(tmp)
    with open(os.path.join(tmp, convert.MANIFEST_TMP)) as f:
        assert len(f.readlines()) == 400
    capsys.readouterr()
    # a plain rerun refuses to clobber it; a rerun with other settings refuses to mix them
    assert convert.main(["--hf-dir", hf_dir, "--out", killed, "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err and os.path.isdir(tmp)
    assert convert.main(["--hf-dir", hf_dir, "--out", killed, "--quiet", "--resume", "--dtype", "bf16"]) == 2
    assert "differs in: storage" in capsys.readouterr().err
    # simulate a torn manifest tail (an OS crash mid-line): that tensor is simply redone
    with open(os.path.join(tmp, convert.MANIFEST_TMP), "a") as f:
        f.write('{"key": "layers.9.ffn.experts.0.w1.wei')
    assert convert.main(["--hf-dir", hf_dir, "--out", killed, "--resume", "--verify"]) == 0
    io = capsys.readouterr()
    assert "resuming: 400 of 990 tensors" in io.err
    assert "resumed (already done): 400" in io.out and "written now: 590" in io.out
    assert "convert:" in io.err and "B/s" in io.err  # the progress bar
    assert not os.path.exists(tmp)
    a, b = _tree_files(ref), _tree_files(killed)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k] != b[k]]
    assert differ == [os.path.join("params", "_CHECKPOINT_METADATA")]  # orbax's timestamps only
    # --out now exists: refused without --overwrite
    assert convert.main(["--hf-dir", hf_dir, "--out", killed, "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# --dtype bf16, --tp/--ep
# ------------------------------------------------------------------------------------------------


def test_bf16_conversion_and_mesh_layout(hf_dir, cfg, tmp_path, capsys):
    """bf16 storage is lossless for these formats (e4m3·2^k and e2m1·2^k are bf16 values), so the stated
    tolerance is zero: the re-quantized weights dequantize to exactly the packed ones, and the logits
    are bitwise equal to those of the packed checkpoint."""
    out = str(tmp_path / "bf16")
    assert convert.main(["--hf-dir", hf_dir, "--out", out, "--dtype", "bf16", "--tp", "2", "--ep", "4",
                         "--quiet", "--verify"]) == 0
    # --verify says what it checked: every item written, read back
    printed = capsys.readouterr().out
    written = re.search(r"written now: (\d+) items", printed)
    assert written and f"verified: {written.group(1)} items (" in printed and "every CRC-32 matches" in printed
    with open(os.path.join(out, ck.META_FILE)) as f:
        meta = json.load(f)
    assert meta["storage"] == "bf16" and (meta["mesh"]["tp"], meta["mesh"]["ep"]) == (2, 4)
    arrays = meta["arrays"]
    assert set(meta["bytes_by_dtype"]) == {"bfloat16", "float32"}
    assert "layers.0.attn.wq_a.scale" not in arrays
    w1 = arrays["layers.0.ffn.experts.w1.weight"]
    assert (w1["shape"], w1["dtype"], w1["chunks"], w1["partition_spec"]) == (
        [8, 32, 64], "bfloat16", [1, 32, 64], ["ep", None, None])
    assert arrays["embed.weight"]["chunks"] == [160, 64] and arrays["embed.weight"]["partition_spec"] == ["tp", None]
    with open(os.path.join(out, "params", "embed.weight", ".zarray")) as f:
        assert json.load(f)["chunks"] == [160, 64]

    p_hf = ck.load_params(hf_dir, cfg)
    p_bf = ck.load_params(out, cfg)
    a, b = flatten_names(p_hf), flatten_names(p_bf)
    assert list(a) == list(b)
    pairs = ck.quant_pairs(cfg)
    deq = {"fp8": lambda q, s: ck.dequant_fp8_block_np(q, s), "fp8_rows": ck.dequant_fp8_rows_np,
           "mxfp4": ck.dequant_mxfp4_np}
    for name, (kind, sname, _) in pairs.items():
        x = deq[kind](np.asarray(a[name]), np.asarray(a[sname]))
        y = deq[kind](np.asarray(b[name]), np.asarray(b[sname]))
        assert np.array_equal(x, y), name
    for name in a:
        if name not in pairs and name not in {v[1] for v in pairs.values()}:
            assert np.array_equal(np.asarray(a[name]).view(np.uint8), np.asarray(b[name]).view(np.uint8)), name
    fwd = jax.jit(forward, static_argnames=("cfg",))
    tokens = (jnp.arange(2 * 24, dtype=jnp.int32).reshape(2, 24) * 29 + 3) % cfg.vocab_size
    la, lb = np.asarray(fwd(p_hf, tokens, cfg)), np.asarray(fwd(p_bf, tokens, cfg))
    assert np.all(np.isfinite(la))
    np.testing.assert_allclose(lb, la, rtol=0, atol=0)  # stated tolerance: 0 (exact)


def test_flat_reference_config_and_vision_tensors(hf_dir, cfg, tmp_path, capsys):
    """An HF dir with only inference/config.json (flat names) and extra vision tensors converts; the output
    gets an HF config.json and the vision tensors are skipped with one line."""
    d = str(tmp_path / "flat")
    shutil.copytree(hf_dir, d)
    hf = cfg.to_hf_dict()["text_config"]
    flat = {("dim" if k == "hidden_size" else "n_layers" if k == "num_hidden_layers" else k): v for k, v in hf.items()}
    os.makedirs(os.path.join(d, "inference"))
    with open(os.path.join(d, "inference", "config.json"), "w") as f:
        json.dump(flat, f)
    os.remove(os.path.join(d, "config.json"))
    _rewrite_shard(d, "model-00001-of-00003.safetensors",
                   lambda t: t.update({"vision.patch_embed.weight": np.ones((4, 4), ml_dtypes.bfloat16),
                                       "image_newline": np.ones((4,), ml_dtypes.bfloat16)}))
    out = str(tmp_path / "flat_out")
    assert convert.main(["--hf-dir", d, "--out", out, "--quiet"]) == 0
    io = capsys.readouterr()
    assert "skipping 2 vision tensors" in io.err and "2 vision" in io.out
    assert ModelConfig.from_pretrained(out).replace(name="tiny") == cfg
    with open(os.path.join(out, ck.META_FILE)) as f:
        assert json.load(f)["source"]["skipped_vision"] == 2


def test_progress_fallback_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    p = convert.Progress(3 << 20, 0, True)
    assert p.bar is None
    p.update(1 << 20)
    p.update(2 << 20)
    p.close()
    err = capsys.readouterr().err
    assert "3.0 MiB / 3.0 MiB" in err and "ETA" in err


# ------------------------------------------------------------------------------------------------
# peak memory
# ------------------------------------------------------------------------------------------------

# The probe measures its own peak resident set: the kernel's high-water mark (VmHWM, what getrusage's
# ru_maxrss reports for a process that did not inherit one) reset to the current RSS after the imports
# (/proc/self/clear_refs "5"), so neither import transients nor the parent's RSS, which a child started
# by vfork/exec inherits in ru_maxrss, count. Falls back to ru_maxrss where clear_refs is unavailable.
MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    import jax, numpy, tensorstore, tokenizers, tqdm, flax.linen
    jax.devices()
    from dsv41_jax import convert
    from dsv41_jax.model import checkpoint, engram_tables, params

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        how, base, peak = "VmHWM", status("VmRSS"), lambda: status("VmHWM")
    except OSError:
        how, base, peak = "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, \
            lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc = convert.main(sys.argv[1:])
    print(json.dumps({"rc": rc, "how": how, "base_kib": base, "peak_kib": peak()}))
""")
FIXED_OVERHEAD = 128 << 20  # bytes beyond 2x the largest tensor (tensorstore buffers, allocator slack)


def test_peak_memory_of_converting_a_few_hundred_mb(tmp_path):
    """~320 MB checkpoint (tiny with a 480k vocabulary and three 1.8M-row Engram tables): the converter's
    peak RSS above its post-import baseline stays under 2x the largest tensor + a fixed overhead, which
    is less than the checkpoint itself (so loading it whole would fail)."""
    from dsv41_jax.model.config import _engram_rows

    ids, ev = (1, 4, 7), 300_000
    big = ModelConfig.preset("tiny").replace(vocab_size=480_000, engram_layer_ids=ids, engram_vocab_size=ev,
                                             engram_num_embeddings=tuple(_engram_rows(ids, 4, 2, ev)))
    # random bytes in every tensor's dtype: the converter copies bytes, their values do not matter here
    g = np.random.default_rng(0)
    leaves = flatten_names(param_shapes(big))
    leaves.pop("derived.engram_token_map")

    def rnd(s):
        n = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        return g.integers(0, 256, n, dtype=np.uint8).view(s.dtype).reshape(s.shape)

    params = jax.tree.map(rnd, param_shapes(big))
    d = str(tmp_path / "big")
    ck.save_hf_checkpoint(params, big, d, shards=4)
    del params
    specs = ck.expected_tensors(big).values()
    total = sum(s.nbytes for s in specs)
    largest = max(s.nbytes for s in specs)
    bound = 2 * largest + FIXED_OVERHEAD
    assert 250e6 < total and bound < total  # the bound is below the checkpoint size: the test discriminates
    probe = str(tmp_path / "probe.py")
    with open(probe, "w") as f:
        f.write(MEMORY_PROBE)
    r = subprocess.run([sys.executable, probe, "--hf-dir", d, "--out", str(tmp_path / "big_out"), "--quiet"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0
    delta = (res["peak_kib"] - res["base_kib"]) * 1024
    print(f"checkpoint {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB, "
          f"conversion peak above baseline {delta / 2**20:.0f} MiB ({res['how']}; bound {bound / 2**20:.0f} MiB)")
    assert delta > 16 << 20, res  # the probe really measured the conversion
    assert delta < bound, (delta, bound)
    # and the output is complete
    with open(os.path.join(tmp_path, "big_out", ck.META_FILE)) as f:
        assert json.load(f)["source"]["bytes"] == total
