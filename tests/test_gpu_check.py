"""scripts/gpu_check.sh's pieces run on CPU, so a GPU run does not lose its minutes to the script:
the tests it selects exist, the decode benchmark's new parts (a flash-dimension cut's random weights in
the stored formats, kernel launches counted from compiled HLO) work, and (slow) the whole script's dry
run (``DRY_RUN=1``: tests collected, benchmarks at tiny sizes in interpret mode) exits 0.
No timings are asserted."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_selected_model_tests_exist():
    """The model-level step's -k selection names tests that exist (a rename would silently run none)."""
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    sel = text.split('-k "', 1)[1].split('"', 1)[0]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-o",
                        "addopts=", "tests/test_fastpath_attention.py", "tests/test_dspark.py",
                        "tests/test_prefix_cache.py", "-k", sel], cwd=ROOT, capture_output=True, text=True)
    got = {ln.split("::")[1].split("[")[0] for ln in r.stdout.splitlines() if "::" in ln}
    assert got == {"test_decode_pallas_equals_xla", "test_forward_pallas_equals_xla",
                   "test_greedy_speculation_equals_plain", "test_cached_prefix_equals_cold_exact"}, r.stdout[-2000:]


def test_kernel_launches_follow_loops_and_branches():
    """`aot_flash.kernel_launches`: a while with a known trip count counts its body per trip, a
    conditional its costliest branch; the per-opcode counts add up."""
    kl = _script("aot_flash").kernel_launches

    def f(x, w):
        y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
        return jax.lax.cond(y.sum() > 0, lambda: jnp.exp(y) * 2, lambda: y + 1)

    def count(n):
        return kl(jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((n, 16, 16))).compile().as_text())

    a, b = count(3), count(7)
    assert a["whiles_without_trip_count"] == b["whiles_without_trip_count"] == 0
    per_trip = (b["launches"] - a["launches"]) / 4
    assert per_trip >= 2 and per_trip == int(per_trip)  # the body's dot and tanh (at least) per trip
    assert a["launches"] - 3 * per_trip >= 2  # outside the loop: at least the predicate and one branch
    assert sum(a["by_opcode"].values()) == a["launches"]

    # a carry of seven arrays: XLA prints the while's tuple type with /*index=5*/ comments (the layer scan's
    # carry with a deferred mHC exit has them); its body must still count per trip
    def g(x, w):
        def body(c, wi):
            return tuple(jnp.tanh(ci @ wi) for ci in c), None
        return jax.lax.scan(body, tuple(x + i for i in range(7)), w)[0]

    def count_g(n):
        return kl(jax.jit(g).lower(jnp.ones((8, 16)), jnp.ones((n, 16, 16))).compile().as_text())

    hlo = jax.jit(g).lower(jnp.ones((8, 16)), jnp.ones((3, 16, 16))).compile().as_text()
    assert "/*index=5*/" in hlo
    ga, gb = count_g(3), count_g(7)
    assert (gb["launches"] - ga["launches"]) / 4 >= 7  # at least one kernel per carried array per trip


def test_random_stored_params_match_the_declared_tree(tiny_cfg):
    """`bench_decode.random_stored_params` (the flash cut's weights, made on the device) gives every
    declared leaf its shape and dtype, valid codes (no e4m3 / e8m0 NaN byte), token-map ids in range."""
    from dsv41_jax.model.params import param_shapes

    bd = _script("bench_decode")
    cfg = _script("aot_flash").keep_layers(tiny_cfg, [0, 1])
    got = bd.random_stored_params(cfg)
    want = param_shapes(cfg)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype in (jnp.float8_e4m3fn, jnp.float8_e8m0fnu):
            b = np.asarray(jax.lax.bitcast_convert_type(g, jnp.uint8))
            assert not ((b & 0x7F) == 0x7F).any() if g.dtype == jnp.float8_e4m3fn else (b < 255).all()
    tm = np.asarray(got["derived"]["engram_token_map"])
    assert tm.min() >= 0 and tm.max() < cfg.engram_compressed_vocab_size


@pytest.mark.slow
def test_dry_run(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_decode.json").read_text())
    case = doc["cases"][0]
    assert case["kernel_launches"] > 0 and case["weight_bytes_per_step"] > 0 and case["frac_copy_bandwidth"] > 0
    moe = json.loads((tmp_path / "bench_moe.json").read_text())
    assert [r["op"] for r in moe["records"]] == ["linear", "moe"] and moe["records"][1]["max_diff"] == 0.0
    assert {c["impl"] for c in doc["cases"]} == {"auto", "auto,linear=pallas_interpret"}


def test_kernel_table_reads_an_xla_gpu_dump(tmp_path):
    """`aot_flash.kernel_table` on a miniature dump in the formats jaxlib 0.10.2's GPU compiler writes (a
    thunk sequence with a command buffer and a while body; the optimized HLO's stack-frame tables): the
    kernels in order with their loop depth, thread blocks and innermost non-wrapper source frame (a
    wrapper's when it is the only one)."""
    (tmp_path / "module_0001.jit_extend.thunk_sequence_after_thunk_passes.txt").write_text(
        "000: kCommandBuffer [source       | next=118 (1)] \n"
        "    001: kCustomKernel [source        | next=003 (2) ] input_reduce_fusion_7 grid: [20, 2, 1] threads: "
        "[256, 1, 1]  shared_memory: 0 bytes\n"
        "118: kWhile         [prev=000 (1) | next=000 (1)]   \n"
        "condition:\n"
        "    119: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  "
        "shared_memory: 0 bytes\n"
        "  body:\n"
        "    000: kCommandBuffer      [source       | next=000 (2)] \n"
        "        120: kCustomKernel [source       | next=121 (1)] quant_linear_fp8_m16_n64_k256__7 grid: [20, 1, 1] "
        "threads: [128, 1, 1]  shared_memory: 58368 bytes\n"
        "        121: kCopy [source | sink] kCopy\n"
        "000: kCommandBuffer [prev=118 (1) | sink        ] \n"
        "    130: kCustomKernel [source | sink] sort_80_1 grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes\n"
        "    131: kCustomKernel [source | sink] input_reduce_fusion_9 grid: [1, 1, 1] threads: [32, 1, 1]  "
        "shared_memory: 0 bytes\n")
    (tmp_path / "module_0001.jit_extend.sm_9.0a_gpu_after_optimizations.txt").write_text(
        "HloModule jit_extend\n\nFileNames\n1 \"/x/dsv41_jax/model/quant.py\"\n2 \"/x/dsv41_jax/model/numerics.py\"\n"
        "3 \"/x/dsv41_jax/model/moe.py\"\n\nFunctionNames\n1 \"act_quant_fp8\"\n2 \"mean_f32\"\n3 \"route\"\n\n"
        "FileLocations\n1 {file_name_id=1 function_name_id=1 line=270 end_line=270 column=1 end_column=2}\n"
        "2 {file_name_id=2 function_name_id=2 line=162 end_line=162 column=1 end_column=2}\n"
        "3 {file_name_id=3 function_name_id=3 line=53 end_line=53 column=1 end_column=2}\n\n"
        "StackFrames\n1 {file_location_id=1 parent_frame_id=1}\n2 {file_location_id=2 parent_frame_id=1}\n"
        "3 {file_location_id=3 parent_frame_id=3}\n4 {file_location_id=2 parent_frame_id=4}\n\n"
        "ENTRY %main {\n"
        "  %input_reduce_fusion.7 = f32[20]{0} fusion(%p), kind=kInput, calls=%fused_reduce.7, "
        "metadata={op_name=\"jit(extend)/reduce_max\" stack_frame_id=2}\n"
        "  %sort.80.1 = s32[6]{0} sort(%q), metadata={op_name=\"jit(extend)/sort\" stack_frame_id=3}\n"
        "  %input_reduce_fusion.9 = f32[] fusion(%r), kind=kInput, calls=%fused_reduce.9, "
        "metadata={op_name=\"jit(extend)/reduce_sum\" stack_frame_id=4}\n}\n")
    aot = _script("aot_flash")
    assert aot.hlo_module_name("HloModule jit__lambda, is_scheduled=true, entry_computation_layout={}") == "jit__lambda"
    # another module's dump beside the step's (the step is the module named by its compiled text): not read
    (tmp_path / "module_0002.jit__lambda.sm_9.0a_gpu_after_optimizations.txt").write_text("HloModule jit__lambda\n")
    rows = aot.kernel_table(str(tmp_path), "jit_extend")
    assert rows == [
        {"loop": 0, "blocks": 40, "kernel": "input_reduce_fusion_7", "source": "quant.act_quant_fp8:270"},
        {"loop": 1, "blocks": 1, "kernel": "loop_compare_fusion", "source": ""},
        {"loop": 1, "blocks": 20, "kernel": "quant_linear_fp8_m16_n64_k256__7", "source": ""},
        {"loop": 1, "blocks": 0, "kernel": "kCopy", "source": ""},
        {"loop": 0, "blocks": 1, "kernel": "sort_80_1", "source": "moe.route:53"},
        {"loop": 0, "blocks": 1, "kernel": "input_reduce_fusion_9", "source": "numerics.mean_f32:162"}]
    assert _script("aot_flash").kernel_sources(rows) == {
        "quant.act_quant_fp8": 1, "loop_compare_fusion": 1, "quant_linear_fp8_m16_n64_k256": 1, "kCopy": 1,
        "moe.route": 1, "numerics.mean_f32": 1}


def test_aot_flash_jaxpr_hash_traces_auto_as_on_a_gpu(tmp_path):
    """`aot_flash.py --jaxpr-hash gpu` (trace only, no CUDA plugin): "auto" resolves as on a GPU (`dispatch.GPU_AUTO`),
    so its program is the one of the same kernels spelled out; the hash is what scripts/step_jaxprs.py --gpu-cells
    compares across commits for the launch-count cells. (Specs no other test traces on the CPU backend: the step
    plan is cached per config.)"""
    aot = _script("aot_flash")

    def h(impl):
        out = tmp_path / "r.json"
        assert aot.main(["--config", "tiny", "--batch", "1", "--context", "64", "--jaxpr-hash", "gpu", "--impl", impl,
                         "--out", str(out)]) == 0
        return json.loads(out.read_text())["jaxpr_sha256"]

    assert h("auto,engram=xla") == h("xla,attention=pallas,indexer=pallas,mhc=pallas,moe=pallas")
