"""The step plan (issue 47 item 1, `model/plan.py`): each fused form is chosen in one place, from the config,
the mesh and the step's shape, and the two records one operation leaves for a later one are pytrees.

Nothing here compiles: the plan is Python, and the pytrees are checked by flattening and tracing. What the fused
forms compute is tested where they run: tests/test_layer_scan.py (the rings written in the kernel, a scanned
run's in-place weights), test_pallas_* (each fused kernel against its plain form).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dsv41_jax.model import ModelConfig, layer_scan
from dsv41_jax.model.dispatch import ImplError
from dsv41_jax.model.plan import DeferredExit, Pending, StepPlan

K = "pallas_interpret"
ALL = f"xla,attention={K},mhc={K},moe={K},linear={K}"


class _Mesh:  # what StepPlan.of reads of a mesh plan
    def __init__(self, size):
        self.size = size


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.preset("tiny").replace(act_dtype="float32", impl=ALL)


def test_plain_impls_have_no_fused_form(cfg):
    step = StepPlan.of(cfg.replace(impl="xla"), None, (1, 1), "auto", keep_all=True)
    fused = [f.name for f in dataclasses.fields(step) if f.type in ("bool", bool) and f.name != "fused_boundary"]
    assert "attend_kernel" in fused
    assert not any(getattr(step, f) for f in fused), step
    assert step.fused_boundary  # exit + enter as one call is the plain form's sequence too (one device)
    assert step.in_place(cfg.replace(impl="xla"), 0) == ()


def test_kernels_fuse_at_one_token(cfg):
    step = StepPlan.of(cfg, None, (1, 1), "auto", keep_all=True)
    assert (step.window_codes_kernel, step.ring_now, step.linear_kernel, step.attend_partials, step.router_kernel,
            step.combine_in_w2, step.mhc_kernel, step.fused_boundary) == (True,) * 8


@pytest.mark.parametrize("shape, mode, keep_all, want", [
    ((3, 1), "auto", True, True),     # a batch of one-token rows still writes the rings in the kernel
    ((1, 4), "auto", True, False),    # a chunk: the rings are written at commit, for the kept tokens only
    ((1, 1), "auto", False, False),   # a speculative / DSpark step keeps a prefix: commit writes
    ((1, 1), None, True, False),      # the full forward: no cache
])
def test_rings_are_written_in_the_step_only_where_every_token_is_kept(cfg, shape, mode, keep_all, want):
    assert StepPlan.of(cfg, None, shape, mode, keep_all=keep_all).ring_now is want


def test_window_codec_and_numerics_decide_the_window_codes_kernel(cfg):
    assert not StepPlan.of(cfg, None, (1, 1), "bfloat16", keep_all=True).window_codes_kernel  # bf16 codes
    assert not StepPlan.of(cfg.replace(impl="xla"), None, (1, 1), "auto").window_codes_kernel


def test_combine_in_w2_at_one_token_only(cfg):
    assert StepPlan.of(cfg, None, (1, 1)).combine_in_w2
    assert not StepPlan.of(cfg, None, (2, 1)).combine_in_w2
    assert not StepPlan.of(cfg.replace(impl=f"xla,moe={K}"), None, (1, 1)).combine_in_w2  # w2 not on the kernel


def test_a_mesh_keeps_the_boundary_apart_and_the_one_device_kernels_off(cfg):
    step = StepPlan.of(cfg.replace(impl=f"xla,attention={K},mhc={K},moe={K}"), _Mesh(4), (1, 1), "auto")
    assert not (step.fused_boundary or step.linear_kernel or step.attend_partials or step.router_kernel
                or step.combine_in_w2)
    assert step.mhc_kernel and step.window_codes_kernel  # these run per device
    with pytest.raises(ImplError, match="quant_linear kernels run on one device, not on a mesh of 4"):
        StepPlan.of(cfg, _Mesh(4), (1, 1), "auto")  # an explicit linear kernel: refused once, when the plan is built


def test_the_plan_is_built_once(cfg):
    assert StepPlan.of(cfg, None, (1, 1), "auto", keep_all=True) is StepPlan.of(cfg, None, (1, 1), "auto", keep_all=True)
    assert StepPlan.of(cfg, None, (1, 1), "auto", keep_all=True) == StepPlan.of(cfg, None, (1, 1), "auto", True)
    hash(StepPlan.of(cfg, None, (1, 1)))  # static under jit


def test_in_place_names_each_kernels_weights():
    """A layer-scan run hands a kernel the run's stacks of exactly the weights that kernel reads."""
    from tests.test_layer_scan import tiny_runs_cfg

    on = tiny_runs_cfg(act_dtype="float32")
    first = next(f for f, n in layer_scan.layer_runs(on) if n > 1 and on.layer_plan(f).compress_ratio)
    hc = {(f"hc_{s}_{leaf}",) for s in ("attn", "ffn") for leaf in ("fn", "base", "scale")}
    norms = {("attn_norm", "weight"), ("ffn_norm", "weight")}
    assert set(StepPlan.of(on.replace(impl=f"xla,mhc={K}")).in_place(on, first)) == hc | norms
    assert set(StepPlan.of(on.replace(impl=f"xla,attention={K}")).in_place(on, first)) == {("attn", "kv_norm", "weight")}
    lin = set(StepPlan.of(on.replace(impl=f"xla,linear={K}")).in_place(on, first))
    assert {("attn", "wq_a"), ("attn", "wq_b"), ("attn", "wkv"), ("attn", "wo_b"), ("attn", "q_norm", "weight"),
            ("attn", "wo_a"), ("attn", "attn_sink"), ("ffn", "shared_experts", "w2")} <= lin
    assert not any("experts" in p for p in lin)  # the routed experts: gathered per (layer, expert) by the MoE
    assert set(StepPlan.of(on.replace(impl=f"xla,moe={K}")).in_place(on, first)) == {("ffn", "gate", "bias")}
    assert StepPlan.of(on.replace(impl=f"xla,moe={K}"), _Mesh(2)).in_place(on, first) == ()


def test_deferred_exit_and_pending_are_pytrees():
    d = DeferredExit(jnp.zeros((1, 2, 3)), jnp.ones((1, 3)), jnp.zeros((1, 2)), jnp.zeros((1, 2, 2)))
    out = jax.jit(lambda d: jax.tree_util.tree_map(lambda a: a + 1, d))(d)
    assert isinstance(out, DeferredExit) and float(out.y[0, 0]) == 2.0
    p = Pending(positions=jnp.zeros((1, 1), jnp.int32), window=(None, None), partial={}, restore=None)
    q = p.with_window(1, {"q": jnp.ones((1, 1, 4))})
    assert p.window == (None, None) and q.window[0] is None and q.window[1]["q"].shape == (1, 1, 4)
    assert len(jax.tree_util.tree_leaves(q)) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.window = ()
