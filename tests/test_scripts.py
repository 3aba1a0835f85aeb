"""scripts/bench_offline.py, scripts/eval_ppl.py and scripts/eval_chat.py on tiny with the bundled
samples (issue 5 items 5 and 6). Run in-process with the engine arguments of tests/test_engine.py,
so the compiled steps are shared within a session."""

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
ENGINE_FLAGS = ["--dtype", "float32", "--page-size", "16", "--context-length", "128", "--max-running-requests", "8",
                "--max-total-tokens", "1024", "--chunked-prefill-size", "16", "--batch-buckets", "8",
                "--token-buckets", "16"]


def _script(name, folder="scripts"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_offline(tmp_path, micro_dir):
    out = tmp_path / "bench.json"
    rep = _script("bench_offline").main(["--batch-sizes", "1,2,8", "--input-len", "12", "--output-len", "6",
                                         "--out", str(out), "--log-level", "WARNING", "--model", micro_dir]
                                        + ENGINE_FLAGS)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(rep))
    assert [r["batch_size"] for r in data["results"]] == [1, 2, 8]
    for r in data["results"]:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["mean_decode_step_ms"] > 0
    assert data["compilations_during_runs"] == 0 and data["num_compilations"] > 0
    assert data["compile_time_s"] > 0  # the batch sizes were compiled before the timed runs
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_bench_offline_runs_its_largest_batch_as_one_cohort(tmp_path, micro_dir):
    """Without --max-total-tokens the script sizes the KV pool so every request of the largest batch is
    admitted at once, after the smaller batch's run: its decode steps are output_len - 1. (A pool of
    exactly 4 x one page, as the script sized it before, ran 3 requests, then the 4th: 10 steps.) Its
    own small shapes (batch 4, chunks of 16): one page of 16 tokens per request."""
    mod = _script("bench_offline")
    flags = ["--dtype", "float32", "--page-size", "16", "--context-length", "128", "--max-running-requests", "4",
             "--chunked-prefill-size", "16", "--batch-buckets", "4", "--token-buckets", "16"]
    rep = mod.main(["--batch-sizes", "1,4", "--input-len", "10", "--output-len", "6", "--out", str(tmp_path / "b.json"),
                    "--log-level", "WARNING", "--model", micro_dir] + flags)
    assert rep["engine_args"]["max_total_tokens"] == mod.pool_tokens(4, 10, 6, 16) > 4 * 16
    assert [(r["batch_size"], r["decode_steps"]) for r in rep["results"]] == [(1, 5), (4, 5)]


@pytest.fixture(scope="module")
def ppl_mod():
    return _script("eval_ppl")


def test_eval_ppl_text_deterministic(tmp_path, ppl_mod, micro_dir):
    argv = ["--data", os.path.join(DATA, "ppl_sample.txt"), "--seq-len", "32", "--batch-size", "4", "--dtype",
            "float32", "--no-progress", "--model", micro_dir]
    a = ppl_mod.main(argv + ["--out", str(tmp_path / "a.json")])
    b = ppl_mod.main(argv + ["--max-batches", "100"])
    assert a["tokens"] == b["tokens"] > 500 and a["nll_per_token"] == b["nll_per_token"]
    assert math.isfinite(a["ppl"]) and a["ppl"] > 1
    assert a["num_compilations"] == 1  # one shape for every batch (the last one padded)
    assert json.loads((tmp_path / "a.json").read_text())["ppl"] == a["ppl"]
    # packing: every window but the last has seq_len scored targets minus the BOS tokens it contains
    docs = ppl_mod.read_documents(os.path.join(DATA, "ppl_sample.txt"))
    from dsv41_jax.serving.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    n_tokens = sum(1 + len(tok.encode(d)) for d in docs)
    assert n_tokens - a["windows"] - len(docs) <= a["tokens"] <= n_tokens - a["windows"]


def test_eval_ppl_jsonl_on_a_mesh(ppl_mod, cpu8, micro_dir):
    argv = ["--data", os.path.join(DATA, "ppl_sample.jsonl"), "--seq-len", "32", "--batch-size", "4", "--dtype",
            "float32", "--no-progress", "--model", micro_dir]
    a = ppl_mod.main(argv)
    m = ppl_mod.main(argv + ["--mesh", "data=2"])
    assert a["tokens"] == m["tokens"] and abs(a["nll_per_token"] - m["nll_per_token"]) < 1e-4


def test_eval_chat(tmp_path, micro_dir):
    out = tmp_path / "chat.json"
    res = _script("eval_chat").main(["--data", os.path.join(DATA, "chat_qa.jsonl"), "--thinking", "both",
                                     "--max-tokens", "8", "--details", "--out", str(out), "--model", micro_dir]
                                    + ENGINE_FLAGS)
    assert set(res["modes"]) == {"chat", "thinking"}
    for mode in res["modes"].values():
        assert mode["n"] == 8 and mode["accuracy"] == sum(r["correct"] for r in mode["records"]) / 8
        assert 0 < mode["mean_completion_tokens"] <= 8 and mode["mean_prompt_tokens"] > 10
        assert len(mode["records"]) == 8
    assert res["modes"]["thinking"]["mean_prompt_tokens"] > res["modes"]["chat"]["mean_prompt_tokens"]
    assert json.loads(out.read_text())["modes"]["chat"]["n"] == 8
    ec = _script("eval_chat")
    assert ec.normalize(' "Paris." ') == "paris"


def test_bench_compile_refuses_unknown_cases(capsys):
    """research/bench_compile.py: an unknown program or variant is a usage error (exit 2) naming the
    known ones, before anything compiles (its measurements are the script's to make, not a test's)."""
    mod = _script("bench_compile", "research")
    for argv, known in ((["--programs", "forward,nope"], "forward, extend"), (["--variants", "fused"], "loop, unrolled")):
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2
        assert known in capsys.readouterr().err


def test_step_hlo_counts_every_instruction_once(micro_dir):
    """scripts/step_hlo.py (docs/benchmarks.md, "Test suite"): micro's exact decode step [1, 1], compiled; every
    optimized HLO instruction counted once by opcode and once by function, the fp8 activation quant among the
    functions (micro's linears quantize their inputs); bad shapes are refused before anything compiles."""
    mod = _script("step_hlo")
    out = mod.main(["--model", micro_dir, "--dtype", "exact", "--batch", "1", "--tokens", "1", "--top", "3"])
    n = out["instructions"]
    assert n > 1000 and sum(out["by_opcode"].values()) == n == sum(out["by_function"].values())
    assert out["by_function"].get("act_quant_fp8", 0) > 0 and "(step body)" in out["by_function"]
    hlo = ('HloModule m\nENTRY e {\n  p = f32[2]{0} parameter(0)\n'
           '  a = f32[2]{0} add(p, p), metadata={op_name="jit(extend)/jit(act_quant_fp8)/add"}\n'
           '  ROOT m = f32[2]{0} multiply(a, p), metadata={op_name="jit(extend)/mul"}\n}\n')
    assert mod.census(hlo) == {"instructions": 3, "by_opcode": {"parameter": 1, "add": 1, "multiply": 1},
                               "by_function": {"(no op_name)": 1, "act_quant_fp8": 1, "(step body)": 1}}
    with pytest.raises(SystemExit, match="must be >= 1"):
        mod.main(["--model", micro_dir, "--tokens", "0"])
    with pytest.raises(SystemExit, match="step_hlo: dtype: must be one of"):
        mod.main(["--model", micro_dir, "--dtype", "fp3"])
