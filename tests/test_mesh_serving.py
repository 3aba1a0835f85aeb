"""Every serving feature on a TP/EP mesh (8 fake CPU devices): the radix prefix cache (its snapshot pool
placed by the cache's rules), the HiCache host tier, DSpark (draft rings placed by the rules, the
verify-then-commit step on the mesh) and DSpark with the Engram host table give the greedy tokens of
single-device plain decoding in the exact numerics mode, with prefix hits from the first repeat.

The engine matrix: {tp=2 × ep=4, ep=8 with the Engram host table} × {DSpark on, off} × {radix cache with
HiCache on, off}. Compile cost is kept down: `configs.mesh_micro` (3 layers, one DSpark stage), one-token
prefill chunks and one batch bucket (one extend shape per engine), the radix on / off engines of a cell
built on the same cfg / ccfg / mesh so they share every compiled step (the prefix cache adds only its
small copy programs); the single-device reference is computed once per module.
"""

import jax
import numpy as np
import pytest

import configs
from dsv41_jax.model.params import init_params
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.engine_args import EngineArgs
from dsv41_jax.serving.sampling import SamplingParams

KW = dict(model="tiny", page_size=8, context_length=48, max_running_requests=2, max_total_tokens=192,
          chunked_prefill_size=1, batch_buckets=[2], decode_log_interval=1000, skip_server_warmup=True)
MESHES = {"tp2_ep4": dict(tp_size=2, ep_size=4), "ep8_host_table": dict(ep_size=8, engram_host_table=True)}
N_NEW = 6
_rng = np.random.default_rng(11)
SYSTEM = _rng.integers(3, 300, 13).tolist()  # a page (8) and then some: the point at 8 is shared
PROMPTS = [SYSTEM + _rng.integers(3, 300, 3).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def cfg():
    return configs.mesh_micro().replace(act_dtype="exact")


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.key(0))


def _run(eng, evict_to_host: bool = False):
    """The prompts one after another (each the first repeat of the system prompt for the next); with
    ``evict_to_host`` every cached state is moved to the host tier before the third, which then loads
    its point back. Returns [(tokens, cached_tokens)]."""
    out = []
    for i, p in enumerate(PROMPTS):
        if evict_to_host and i == 2:
            eng.step()  # dispatches the last snapshot saves (an entry spills only once its save ran)
            eng.prefix_cache.evict(eng.allocator.capacity)
        eng.add_request(f"m{i}", p, SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
        (o,) = [o for o in eng.run_until_done() if o.finished]
        out.append((list(o.outputs[0].token_ids), o.num_cached_tokens))
    eng.allocator.check_invariants()
    return out


@pytest.fixture(scope="module")
def ref(cfg, params):
    eng = Engine(EngineArgs(**KW, disable_radix_cache=True), cfg=cfg, params=params)
    return [t for t, _ in _run(eng)]


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_mesh_matrix_equals_single_device(cpu8, cfg, params, ref, mesh, dspark):
    """One cell of the matrix, radix + HiCache on and off on the same compiled steps: greedy tokens equal
    single-device plain decoding; with the cache the second request resumes from the first's chunk-end
    point (8) and the third from a host-tier copy (evicted to the host, loaded back on the mesh)."""
    extra = dict(MESHES[mesh], speculative_algorithm="DSPARK" if dspark else None)
    for radix in (True, False):
        cache = dict(enable_hierarchical_cache=True) if radix else dict(disable_radix_cache=True)
        eng = Engine(EngineArgs(**KW, **extra, **cache), cfg=cfg, params=params)
        assert eng.mesh is not None and eng.engram_host_table == (mesh == "ep8_host_table")
        got = _run(eng, evict_to_host=radix)
        assert [t for t, _ in got] == ref
        if radix:
            assert [c for _, c in got] == [0, 8, 8]
            assert eng.prefix_cache.host_hits == 1 and eng.prefix_cache.spills > 0
            # the snapshot pool is placed by the cache's rules (replicated over the mesh, as the cache)
            assert all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(eng.runner.snaps))
        else:
            assert [c for _, c in got] == [0, 0, 0]
        if dspark:
            assert eng.stats()["spec_verify_steps"] > 0
            rings = eng.runner.state["dspark"]
            assert all(len(x.sharding.device_set) == 8 for x in jax.tree_util.tree_leaves(rings))
        mem = eng.runner.memory_by_device
        assert len(mem) == 8 and all(m["params"] > 0 and m["kv"] > 0 for m in mem.values())
        assert all((m["snapshots"] > 0) == radix and (m["draft_params"] > 0) == dspark for m in mem.values())
