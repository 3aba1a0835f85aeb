"""The forward's and the decode step's layers are pure functions of their trace-time state: an
attention sublayer returns the stores it writes (``ctx``), the cache it updates (``st``), what `commit`
needs (``pend``) and its aux record as new values, and leaves every dict passed in as it was.

Only traced (`jax.eval_shape`), never compiled: the dicts are Python objects at trace time, which is
where an in-place write would happen. One tiny layer that owns all three roles (compressed-KV source,
index-key owner, index source) exercises every write.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.model import cache as kvc
from dsv41_jax.model import decode as dec
from dsv41_jax.model import layer_scan
from dsv41_jax.model import transformer as tr
from dsv41_jax.model.numerics import act_dtype
from dsv41_jax.model.plan import StepPlan

CCFG = kvc.CacheConfig(page_size=8, num_pages=9, max_slots=2, max_pages_per_seq=4)


def _snapshot(tree):
    """Python containers of `tree` (dicts / lists, nested) with the leaves replaced by their ids."""
    if dataclasses.is_dataclass(tree):  # `plan.Pending`: frozen, but its dicts could be written
        return {f.name: _snapshot(getattr(tree, f.name)) for f in dataclasses.fields(tree)}
    if isinstance(tree, dict):
        return {k: _snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_snapshot(v) for v in tree]
    return id(tree)


@pytest.fixture(scope="module")
def source_layer(tiny_cfg):
    for i in range(tiny_cfg.num_hidden_layers):
        plan = tiny_cfg.layer_plan(i)
        if plan.is_kv_source and plan.is_index_source and plan.key_owner == i:
            return i, plan
    pytest.fail("tiny has no layer that is its own kv source, key owner and index source")


def test_attention_full_returns_its_writes(tiny_cfg, tiny_params, source_layer):
    i, plan = source_layer
    cfg, dt = tiny_cfg, act_dtype(tiny_cfg)
    p = layer_scan.layer_params(tiny_params, i, cfg)["attn"]
    B, T = 2, 16
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = {"comp": {}, "keys": {}, "topk": {}, "cand": None}
    before = copy.deepcopy(ctx)

    def run(x):
        y, ctx_out, rec = tr.attention_full(StepPlan.of(cfg, None, (B, T)), p, x, positions, plan, ctx, cfg, dt)
        assert ctx == before, "attention_full modified the ctx it was given"
        assert {i} <= set(ctx_out["comp"]) and {i} <= set(ctx_out["keys"]) and {i} <= set(ctx_out["topk"])
        assert set(rec) == ({"topk", "cand"} if plan.is_candidate_source else {"topk"})
        return y

    jax.eval_shape(run, jax.ShapeDtypeStruct((B, T, cfg.hidden_size), dt))
    aux = tr.new_aux()
    aux2 = tr.record(aux, i, {"experts": jnp.zeros(1)})
    assert aux == tr.new_aux() and list(aux2["experts"]) == [i]


def test_attention_cached_returns_its_writes(tiny_cfg, tiny_params, source_layer):
    i, plan = source_layer
    cfg, dt = tiny_cfg, act_dtype(tiny_cfg)
    p = layer_scan.layer_params(tiny_params, i, cfg)["attn"]
    B, T = 2, 8
    state = jax.eval_shape(lambda: kvc.init_cache(cfg, CCFG))
    batch = {"tokens": jnp.zeros((B, T), jnp.int32), "start": jnp.array([0, 3], jnp.int32),
             "n_new": jnp.array([T, 5], jnp.int32), "slot": jnp.arange(B, dtype=jnp.int32),
             "page_table": jnp.arange(B * 4, dtype=jnp.int32).reshape(B, 4)}

    def run(st, x):
        st_before = _snapshot(st)
        _, _, positions, valid, st, pend, _ = dec._step_setup(st, batch, cfg, restore=True)
        ctx = {"topk": {}, "cand": None}
        pend_before, ctx_before = _snapshot(pend), _snapshot(ctx)
        step = StepPlan.of(cfg, None, (B, T), CCFG.kv_cache_dtype)
        y, (st2, ctx2, rec, pend2) = dec.attention_cached(step, p, x, plan, st, ctx, batch, positions, valid, cfg, CCFG,
                                                          dt, pend)
        assert (_snapshot(st), _snapshot(ctx), _snapshot(pend)) == (st_before, ctx_before, pend_before), \
            "attention_cached modified a dict it was given"
        key = str(i)
        assert st2["comp"][key] is not st["comp"][key] and st2["ikeys"][key] is not st["ikeys"][key]
        assert pend2.window[i] is not None and key in pend2.restore and i in ctx2["topk"] and "topk" in rec
        return y

    jax.eval_shape(run, state, jax.ShapeDtypeStruct((B, T, cfg.hidden_size), dt))
