"""The engine and the server on a mesh (`--tp` / `--ep`): same greedy tokens / chat completion as
unsharded in the exact numerics mode, and impossible combinations refused at start-up (engine and
`serve.main`: clear message, exit 1).

Each engine compiles one extend shape (batch bucket 2, token bucket 8: prefill chunks and decode steps
share it) plus the sampling helpers; the engine equality test builds two engines in the exact mode and
is marked slow (the model-level sharded ≡ unsharded checks run in the default tier, tests/test_sharding.py).
The server test (default tier) keeps the compile count at one extend shape per server: one request at a
time, one-token prefill chunks (`--chunked-prefill-size 1`: every step is [1, 1]); the two servers start
side by side.
"""

import concurrent.futures
import os

import numpy as np
import pytest

from dsv41_jax.parallel.mesh import MeshError
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

KW = dict(model="tiny", page_size=8, context_length=32, max_running_requests=2, max_total_tokens=128,
          chunked_prefill_size=8, batch_buckets=[2], token_buckets=[8], decode_log_interval=1000)


def _greedy(eng, prompts, n):
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outs = {o.request_id: o for o in eng.run_until_done()}
    return [list(outs[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))]


_REF: dict = {}


@pytest.mark.slow  # engines in the exact mode: ~3 min each on 2 busy cores
@pytest.mark.parametrize("host_table", [False, True])
def test_tp2_ep2_engine_matches_unsharded(cpu8, tiny_cfg, tiny_params, host_table):
    cfg = tiny_cfg.replace(act_dtype="exact")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 300, 11).tolist(), rng.integers(3, 300, 6).tolist()]
    if "ref" not in _REF:
        _REF["ref"] = _greedy(Engine(EngineArgs(**KW), cfg=cfg, params=tiny_params), prompts, 5)
    ref = _REF["ref"]
    eng = Engine(EngineArgs(**KW, tp_size=2, ep_size=2, engram_host_table=host_table), cfg=cfg, params=tiny_params)
    assert dict(eng.runner.mesh.shape) == {"ep": 2, "tp": 2} and eng.runner.engram_host_table == host_table
    w = eng.params["layers"][3]["ffn"]["experts"]["w1"].weight
    assert w.sharding.spec[0] == "ep" and len(w.sharding.device_set) == 4
    got = _greedy(eng, prompts, 5)
    assert got == ref and all(len(t) == 5 for t in got)


def test_impossible_mesh_refused_at_startup(cpu8, tiny_cfg, capsys):
    with pytest.raises(MeshError, match="not divisible by tp"):
        Engine(EngineArgs(**KW, tp_size=3), cfg=tiny_cfg)
    with pytest.raises(MeshError, match="more expert shards than experts"):
        Engine(EngineArgs(**KW, ep_size=16), cfg=tiny_cfg)
    from dsv41_jax.serve import main

    assert main(["--model", "tiny", "--tp", "2", "--ep", "8", "--port", "18123"]) == 2
    assert "more expert shards than experts" in capsys.readouterr().err


# One [1, 1] extend shape per server (prompt fed a token per step), exact numerics (--dtype exact).
SERVE_FLAGS = ["--dtype", "exact", "--max-running-requests", "1", "--batch-buckets", "1",
               "--chunked-prefill-size", "1", "--page-size", "8", "--context-length", "32",
               "--max-total-tokens", "64", "--decode-log-interval", "1000"]


def _five_layer_checkpoint(tiny_cfg, out) -> str:
    """The tiny model cut to 5 layers (window, window + Engram, ratio-2 KV/index source, ratio-1 KV/index/
    candidate source, ratio-1 candidate re-scoring; no DSpark), random weights, written in the release
    layout: half the tiny model's compile time, and the server loads it with `load_params(..., mesh)`."""
    import jax

    from dsv41_jax.model import init_params
    from dsv41_jax.model.checkpoint import save_hf_checkpoint
    from dsv41_jax.model.config import _engram_rows

    cfg = tiny_cfg.replace(num_hidden_layers=5, compress_ratios=(0, 0, 2, 1, 1), kv_source_layer_ids=(2, 3),
                           index_source_layer_ids=(2, 3, 4), candidate_source_layer_id=3, engram_layer_ids=(1,),
                           engram_num_embeddings=tuple(_engram_rows((1,), tiny_cfg.engram_max_ngram_size,
                                                                    tiny_cfg.engram_n_heads,
                                                                    tiny_cfg.engram_vocab_size)),
                           num_nextn_predict_layers=0, dspark_target_layer_ids=())
    assert cfg.layer_plan(4).uses_candidates and cfg.layer_plan(1).is_engram
    save_hf_checkpoint(init_params(cfg, jax.random.key(3)), cfg, str(out))
    return str(out)

def test_server_tp2_ep2_chat_equals_unsharded(cpu8, tiny_cfg, tmp_path):
    """`python -m dsv41_jax.serve --tp 2 --ep 2` on 4 of the fake CPU devices (conftest's XLA_FLAGS are
    inherited) serves a greedy chat completion equal to the unsharded server's (--dtype exact): same
    text, same tokens (logprobs), same usage, same logprobs (2·LOGIT_ATOL = 0: bitwise, tests/test_sharding.py
    says why). The model is a 5-layer cut of tiny from a checkpoint directory, so
    the sharded server also loads it straight onto the mesh (`load_params(..., mesh)`)."""
    import httpx
    from test_server import start_server, stop_server
    from test_sharding import LOGIT_ATOL

    model = _five_layer_checkpoint(tiny_cfg, tmp_path / "ckpt")
    cache = os.environ.get("DSV41_TEST_JAX_CACHE") or str(tmp_path / "jax_cache")
    base_flags = ["--model", model, "--served-model-name", "cut5"] + SERVE_FLAGS
    runs = {"tp2ep2": base_flags + ["--tp", "2", "--ep", "2"], "unsharded": base_flags}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two start-ups (compiles) side by side
        futs = {k: pool.submit(start_server, f, tmp_path / f"{k}.log", cache) for k, f in runs.items()}
        servers = {k: f.result() for k, f in futs.items()}
    body = {"model": "cut5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    try:
        out = {k: httpx.post(base + "/v1/chat/completions", json=body, timeout=300).json()
               for k, (_, base, _) in servers.items()}
    finally:
        rcs = {k: stop_server(proc, logf) for k, (proc, _, logf) in servers.items()}
    logs = {k: (tmp_path / f"{k}.log").read_text() for k in runs}
    assert rcs == {"tp2ep2": 0, "unsharded": 0}, {k: v[-2000:] for k, v in logs.items()}
    assert "mesh: ep=2 x tp=2 over 4 cpu devices" in logs["tp2ep2"] and "mesh:" not in logs["unsharded"]
    a, b = out["tp2ep2"], out["unsharded"]
    assert "choices" in a and "choices" in b, (a, b)
    ca, cb = a["choices"][0], b["choices"][0]
    assert a["usage"] == b["usage"] and a["usage"]["completion_tokens"] == 6
    assert ca["message"] == cb["message"] and ca["finish_reason"] == cb["finish_reason"] == "length"
    la, lb = ca["logprobs"]["content"], cb["logprobs"]["content"]
    assert len(la) == len(lb) == 6
    for x, y in zip(la, lb):
        assert x["token"] == y["token"] and x["bytes"] == y["bytes"]
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        np.testing.assert_allclose([x["logprob"]] + [t["logprob"] for t in x["top_logprobs"]],
                                   [y["logprob"]] + [t["logprob"] for t in y["top_logprobs"]],
                                   rtol=0, atol=2 * LOGIT_ATOL)
