"""The engine on a mesh (`--tp` / `--ep`): same greedy tokens as unsharded in the exact numerics mode,
and impossible combinations refused at start-up (engine and `serve.main`: clear message, exit 1).

Each engine compiles one extend shape (batch bucket 2, token bucket 8: prefill chunks and decode steps
share it) plus the sampling helpers; the equality test builds two engines in the exact mode and is
marked slow (the model-level sharded ≡ unsharded checks run in the default tier, tests/test_sharding.py).
"""

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
    assert dict(eng.mesh.shape) == {"ep": 2, "tp": 2} and eng.engram_host_table == host_table
    w = eng.params["layers"][3]["ffn"]["experts"]["w1"]["weight"]
    assert w.sharding.spec[0] == "ep" and len(w.sharding.device_set) == 4
    got = _greedy(eng, prompts, 5)
    assert got == ref and all(len(t) == 5 for t in got)


def test_impossible_mesh_refused_at_startup(cpu8, tiny_cfg, capsys):
    with pytest.raises(MeshError, match="not divisible by tp"):
        Engine(EngineArgs(**KW, tp_size=3), cfg=tiny_cfg)
    with pytest.raises(MeshError, match="more expert shards than experts"):
        Engine(EngineArgs(**KW, ep_size=16), cfg=tiny_cfg)
    from dsv41_jax.serve import main

    assert main(["--model", "tiny", "--tp", "2", "--ep", "8", "--port", "18123"]) == 1
    assert "more expert shards than experts" in capsys.readouterr().err
