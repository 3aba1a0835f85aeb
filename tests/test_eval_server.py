"""Evaluation against the live server (issue 16): tokenizer endpoints, prompt logprobs on
``/v1/completions`` (``echo`` + ``logprobs``), `scripts/eval_loglik.py` agreeing with the server, and
EleutherAI's lm-evaluation-harness itself (a test dependency) run offline on local JSONL tasks.

One server per module (``python -m dsv41_jax.serve`` in a subprocess serving `configs.micro` saved as a
release-layout checkpoint under the name "tiny" (tiny's tokenizer), chunk size 32 so the
70-token prompt spans three prefill chunks) in the exact numerics mode (``--dtype exact``: fp32
activations, fp64-accumulated matmuls), and the offline reference in the same mode:
`eval_loglik.score_sequences` (the jitted full forward, batches of 8 padded to 128 tokens: one
compiled shape). In that mode the paged chunked decode step and the full forward compute the same
activations whatever the batch and chunk shapes (order-independent sums), so every fp8 activation code
and every top-k choice agree and the logprobs differ only by the last rounding of the fp32
log-softmax: 1e-5 per token, 1e-4 per summed continuation, for every sequence. (In fp32 the two
orders part: a ~1e-7 difference can flip an fp8 code — on one CPU it moved a token by 1.2e-3 — so an
fp32 comparison could only hold "up to the first flip".) eval_loglik's engine backend (the server's
engine flags, in-process) equals the server within 1e-5 on every item.

``DSV41_LM_EVAL_CMD`` runs another lm-eval launcher (default ``python -m lm_eval`` of this
interpreter; ``pip install -e '.[test]'`` installs it).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
from servers import start_server, stop_server

from dsv41_jax.chat_format.encoding import encode_chat_request
from dsv41_jax.serving.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
CTX = 512
ENGINE_FLAGS = ["--dtype", "exact", "--max-running-requests", "4", "--batch-buckets", "4",
                "--chunked-prefill-size", "32", "--page-size", "32", "--context-length", str(CTX),
                "--max-total-tokens", "8192"]
TOK_TOL, ITEM_TOL, ENGINE_TOL = 1e-5, 1e-4, 1e-5
START_TIMEOUT = 400


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory, micro_dir):
    d = tmp_path_factory.mktemp("eval_server")
    cache = os.environ.get("DSV41_TEST_JAX_CACHE", str(d / "jax_cache"))
    flags = ["--model", micro_dir, "--served-model-name", "tiny", "--warmup-prompt-logprobs"] + ENGINE_FLAGS
    proc, base, logf = start_server(flags, d / "server.log", cache, timeout=START_TIMEOUT)
    yield {"base": base, "log": d / "server.log"}
    stop_server(proc, logf)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server["base"], timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def offline(micro_dir):
    """The eval_loglik script module and the server's checkpoint, loaded here, in the exact mode."""
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.model.checkpoint import load_params

    cfg = ModelConfig.from_pretrained(micro_dir).replace(act_dtype="exact")
    return _script("eval_loglik"), load_params(micro_dir, cfg), cfg, micro_dir


def _score(offline, seqs):
    mod, params, cfg, _ = offline
    return mod.score_sequences(params, cfg, seqs, batch_size=8, pad_multiple=128, progress=False)


def _bad(r, param=None):
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error" and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


# ------------------------------------------------------------------------------ tokenizer endpoints


def test_tokenizer_endpoints(http, tok):
    text = "Hello world, 12 apples."
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode(text) and r.json()["count"] == len(tok.encode(text))
    assert r.json()["max_model_len"] == CTX
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": True, "return_token_strs": True})
    assert r.json()["tokens"] == [tok.bos_token_id] + tok.encode(text)
    assert r.json()["token_strs"][0] == "<｜begin▁of▁sentence｜>"
    msgs = [{"role": "user", "content": "Hi there"}]
    r = http.post("/tokenize", json={"messages": msgs, "model": "tiny"})
    want = tok.encode(encode_chat_request({"messages": msgs}).prompt)
    assert r.json()["tokens"] == want and want[0] == tok.bos_token_id
    r = http.post("/detokenize", json={"tokens": tok.encode(text)})
    assert r.json() == {"prompt": text}
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert info["model_max_length"] == CTX and info["chat_template_name"] == "deepseek-v41"
    _bad(http.post("/tokenize", json={}), "prompt")
    _bad(http.post("/tokenize", json={"prompt": "a", "messages": msgs}), "prompt")
    _bad(http.post("/tokenize", json={"prompt": 5}), "prompt")
    _bad(http.post("/tokenize", json={"prompt": "a", "add_special_tokens": "yes"}), "add_special_tokens")
    _bad(http.post("/detokenize", json={"tokens": [1, "a"]}), "tokens")
    _bad(http.post("/detokenize", json={"tokens": [100000]}), "tokens")
    assert http.post("/tokenize", json={"prompt": "a", "model": "nope"}).status_code == 404


# ------------------------------------------------------------------------------ prompt logprobs


def test_echo_prompt_logprobs_match_forward(server, http, tok, offline):
    """The server's first echo + logprobs request (several chunks, a one-token chunk too): prompt
    logprobs equal to the offline scorer's, and served without compiling on first use
    (--warmup-prompt-logprobs compiled the variant in the warm-up; issue 37: 55 s for nano)."""
    assert "(+ prompt logprobs)" in server["log"].read_text()
    rng = np.random.default_rng(16)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (70, 5, 33, 2)]  # 70: three chunks of 32
    k = 2
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1, "logprobs": k,
                                           "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ref = _score(offline, [(p[:1], p[1:]) for p in prompts])
    for p, c, (_, _, want) in zip(prompts, body["choices"], ref):
        lp = c["logprobs"]
        n = len(p)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) \
            == n + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:n], want, atol=TOK_TOL, rtol=0)
        for j in range(1, n + 1):
            top = lp["top_logprobs"][j]
            assert isinstance(top, dict) and 1 <= len(top) <= k + 1
            assert max(top.values()) >= lp["token_logprobs"][j] - 1e-6
        offs = lp["text_offset"]
        assert offs[0] == 0 and all(b >= a for a, b in zip(offs, offs[1:]))
        assert c["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert "compiles on first use" not in server["log"].read_text()


def test_echo_string_prompt_and_max_tokens_zero(http, tok, offline):
    text = "The white fox walked to the forest"
    ids = tok.encode(text)
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == text and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids)  # the prompt as tokenized, no BOS added
    assert "".join(lp["tokens"]) == text and lp["text_offset"][-1] == len(text) - len(lp["tokens"][-1])
    (_, _, want), = _score(offline, [(ids[:1], ids[1:])])
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=TOK_TOL, rtol=0)
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])  # logprobs=0: the token itself
    assert r.json()["usage"]["completion_tokens"] == 0
    # add_special_tokens: the BOS is part of the scored prompt
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0,
                                           "add_special_tokens": True})
    assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == len(ids) + 1
    # echo without logprobs and max_tokens=0: the prompt back, nothing generated
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == text and r.json()["choices"][0]["logprobs"] is None


def test_bad_requests(http):
    base = {"prompt": [[5, 6, 7]], "max_tokens": 1, "echo": True, "logprobs": 1}
    _bad(http.post("/v1/completions", json={**base, "n": 2}), "n")
    _bad(http.post("/v1/completions", json={**base, "logprobs": 21}), "logprobs")
    _bad(http.post("/v1/completions", json={**base, "stream": True}), "stream")
    _bad(http.post("/v1/completions", json={**base, "echo": False, "max_tokens": 0}), "max_tokens")
    e = _bad(http.post("/v1/completions", json={**base, "prompt": [[5] * (CTX + 10)], "max_tokens": 0}))
    assert e["code"] == "context_length_exceeded" and str(CTX) in e["message"]
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------------------ eval_loglik vs server


@pytest.fixture(scope="module")
def loglik_result(offline, tmp_path_factory):
    """eval_loglik.py --backend engine with the server's engine flags (its exact numerics)."""
    mod = offline[0]
    out = tmp_path_factory.mktemp("loglik") / "r.json"
    res = mod.main(["--data", os.path.join(DATA, "mc_sample.jsonl"), "--backend", "engine", "--out", str(out),
                    "--model", offline[3], *ENGINE_FLAGS])
    assert json.loads(out.read_text())["items"] == 20
    return res


@pytest.fixture(scope="module")
def loglik_forward(offline):
    """eval_loglik.py --backend forward (the full forward, batches of 8 padded to 128: one shape)."""
    return offline[0].main(["--data", os.path.join(DATA, "mc_sample.jsonl"), "--model", offline[3],
                            "--dtype", "exact", "--batch-size", "8", "--pad-multiple", "128"])


def test_eval_loglik_agrees_with_server(http, loglik_result, loglik_forward):
    assert loglik_result["items"] == loglik_forward["items"] == 20
    assert loglik_result["sequences"] == loglik_forward["sequences"] == 75
    assert loglik_forward["num_compilations"] == 1
    fwd = loglik_forward["items_detail"]
    correct, diffs = 0, []
    for rec in loglik_result["items_detail"]:
        ctx = rec["context_ids"]
        prompts = [ctx + cont for cont in rec["continuation_ids"]]
        # exactly lm-eval's request (token ids, max_tokens 1, logprobs 1, echo)
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 1, "logprobs": 1,
                                               "echo": True, "temperature": 0, "seed": 1234})
        assert r.status_code == 200, r.text
        server_ll = [sum(c["logprobs"]["token_logprobs"][len(ctx):-1]) for c in
                     sorted(r.json()["choices"], key=lambda c: c["index"])]
        np.testing.assert_allclose(server_ll, rec["loglik"], atol=ENGINE_TOL, rtol=0)
        assert int(np.argmax(server_ll)) == rec["pred"]
        assert fwd[rec["index"]]["continuation_ids"] == rec["continuation_ids"]
        diffs += [abs(a - b) for a, b in zip(server_ll, fwd[rec["index"]]["loglik"])]
        correct += int(int(np.argmax(server_ll)) == rec["answer"])
    assert correct / 20 == loglik_result["acc"]
    assert len(diffs) == 75 and max(diffs) <= ITEM_TOL, (max(diffs), float(np.median(diffs)))


# ------------------------------------------------------------------------------ lm-evaluation-harness

MC_TASK = """task: dsv41_mc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc_sample.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """task: dsv41_gen_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen_sample.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _lm_eval(args, tmp, timeout=400):
    cmd = os.environ.get("DSV41_LM_EVAL_CMD", f"{sys.executable} -m lm_eval").split()
    if not os.environ.get("DSV41_LM_EVAL_CMD") and importlib.util.find_spec("lm_eval") is None:
        pytest.fail("lm-eval is a test dependency: pip install -e '.[test]'")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf"),
               TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    return p


def _samples(out_dir, task):
    files = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return [json.loads(line) for line in f if line.strip()]


def _results(out_dir):
    files = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return json.load(f)["results"]


def test_lm_eval_harness(server, tmp_path, loglik_result):
    """lm-eval 0.4.13 itself, offline, local JSONL tasks: local-completions (multiple choice through
    echo + logprobs with the server's own tokenizer, found by the `auto` backend via /tokenizer_info,
    and a generative task) and local-chat-completions (the generative task); every request answered,
    and lm-eval's acc / acc_norm equal eval_loglik.py's."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_TASK.format(data=DATA))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=DATA))
    base = server["base"]
    out1 = tmp_path / "out_completions"
    p = _lm_eval(["--model", "local-completions", "--model_args",
                  f"base_url={base}/v1/completions,model=tiny,num_concurrent=2,max_retries=1",
                  "--tasks", "dsv41_mc_local,dsv41_gen_local", "--include_path", str(tasks),
                  "--output_path", str(out1), "--log_samples"], tmp_path)
    assert "Using remote tokenizer" in p.stderr + p.stdout  # the `auto` backend found /tokenizer_info
    mc = _samples(out1, "dsv41_mc_local")
    assert len(mc) == 20
    for s in mc:  # every choice scored: (loglikelihood, is_greedy) with a finite loglikelihood
        assert len(s["filtered_resps"]) == len(s["doc"]["choices"])
        assert all(np.isfinite(float(r[0])) for r in s["filtered_resps"])
    res = _results(out1)
    assert res["dsv41_mc_local"]["acc,none"] == pytest.approx(loglik_result["acc"])
    assert res["dsv41_mc_local"]["acc_norm,none"] == pytest.approx(loglik_result["acc_norm"])
    gen = _samples(out1, "dsv41_gen_local")
    assert len(gen) == 4 and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert "exact_match,none" in res["dsv41_gen_local"]

    out2 = tmp_path / "out_chat"
    _lm_eval(["--model", "local-chat-completions", "--model_args",
              f"base_url={base}/v1/chat/completions,model=tiny,max_retries=1", "--apply_chat_template",
              "--tasks", "dsv41_gen_local", "--include_path", str(tasks), "--output_path", str(out2),
              "--log_samples"], tmp_path)
    gen = _samples(out2, "dsv41_gen_local")
    assert len(gen) == 4 and all(isinstance(s["resps"][0][0], str) for s in gen)
    assert "exact_match,none" in _results(out2)["dsv41_gen_local"]


def test_bench_multiturn_against_the_server(server, tmp_path):
    """scripts/bench_multiturn.py against the live server (issue 15): the cached turns resume from
    the previous turn's points; the first turns share only the system prompt, so the second
    conversation resumes from the first's last chunk end inside it (hits from the first repeat) and
    makes a branch point at its last page boundary, where the third resumes; the cold
    controls (a number in front of the system prompt) reuse nothing. TTFTs are reported, not asserted
    (timing)."""
    bench = _script("bench_multiturn")
    out = tmp_path / "mt.json"
    rc = bench.main(["--base-url", server["base"], "--conversations", "3", "--turns", "2", "--system-words", "25",
                     "--user-words", "4", "--max-tokens", "3", "--output-json", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    s, recs = rep["summary"], rep["records"]
    first = s["first_turn_cached_tokens"]
    page = int(ENGINE_FLAGS[ENGINE_FLAGS.index("--page-size") + 1])
    n_sys = s["first_turn_prompt_tokens"][0]
    assert first[0] == 0  # cold; the second resumes from a chunk end of the first, the third from a page boundary
    assert page <= first[1] <= first[2] < n_sys and first[1] % page == 0 and first[2] % page == 0
    assert all(r["cached_tokens"] > 0 for r in recs if r["kind"] == "cached")
    assert all(r["cached_tokens"] == 0 for r in recs if r["kind"] == "cold")
    assert 0 < s["hit_rate_cached_turns"] <= 1 and s["ttft_cached_median_s"] > 0
