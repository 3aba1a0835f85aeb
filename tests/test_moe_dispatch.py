"""Token-dispatch expert parallelism (`parallel.moe_dispatch`) on the 8 host CPU devices: the routed
experts with tokens split over devices and dispatched to their experts equal the one-device grouped
path (`moe._routed_grouped`) BITWISE in the exact and the deterministic modes — over 8 devices (tokens
and experts over "dp") and over a 4 x 2 ("dp", "tp") mesh (tokens over dp, experts over all 8) —
for random, skewed (every token of a device to the same experts: the worst-case buffer), tied /
duplicated and all-padding routings, N not dividing the devices, several dense rounds, and a
prefill-size chunk. The ragged backend: its offsets bookkeeping against an all-gather rendering of
`ragged_all_to_all`'s documented semantics (XLA:CPU cannot run the op), its refusal on CPU, and its
compile for the compile-only H200 target where JAX's CUDA plugin is installed.

Shapes are tiny (the tiny config's layer-3 experts, hidden 64, 8 experts, top-2) and each test keeps
one token count so that its cases share one compiled program.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from dsv41_jax.model import moe
from dsv41_jax.model.weights import Stacked
from dsv41_jax.parallel import moe_dispatch as md
from dsv41_jax.parallel.plan import MeshPlan

SEED = 46
N = 16  # 2 rows per device on 8 devices


@pytest.fixture(scope="module")
def ex(tiny_params):
    return tiny_params["layers"][3]["ffn"]["experts"]


def _mode(tiny_cfg, mode):
    """(cfg, activation dtype) of a numerics mode."""
    if mode == "exact":
        return tiny_cfg.replace(act_dtype="exact"), jnp.float32
    return tiny_cfg.replace(deterministic=True), jnp.bfloat16


def _meshes(cpu8, name):
    """(mesh, token_axes, expert_axes) of a layout."""
    if name == "dp8":
        return Mesh(np.array(cpu8), ("dp",)), "dp", "dp"
    if name == "dp4":  # 2 experts per device: a token's both slots can go to one device
        return Mesh(np.array(cpu8[:4]), ("dp",)), "dp", "dp"
    if name == "dp4xtp2":  # DP attention with tp inside each rank; experts over all devices
        return Mesh(np.array(cpu8).reshape(4, 2), ("dp", "tp")), "dp", ("dp", "tp")
    if name == "rep4x2":  # tokens replicated (today's layout), experts over both axes: each device takes 1/8
        return Mesh(np.array(cpu8).reshape(4, 2), ("dp", "tp")), None, ("dp", "tp")
    raise KeyError(name)


def _routings(n, E, k, rng, D=64):
    """{case: (xf [n, D], idx int32 [n, k], w fp32 [n, k])} over n tokens (tiny's hidden size D)."""
    x = rng.standard_normal((n, D))
    rand = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    # skewed: every token of every device picks the same experts (all to device 0 and 1 on dp8): the worst case
    skew = np.tile(np.arange(k, dtype=np.int32)[::-1], (n, 1))
    # ties: identical tokens with identical routing and weights, and rows whose k slots name one expert twice
    tie_x = np.repeat(x[:1], n, axis=0)
    ties = np.tile(np.array([5, 2], np.int32)[:k], (n, 1))
    ties[::3] = 7
    tie_w = np.full((n, k), 0.5, np.float32)
    # a device with zero real tokens: its rows are padding (zeros), routed as the gate routes zeros (one expert)
    pad_x = x.copy()
    pad_x[2:4] = 0.0
    pad = rand.copy()
    pad[2:4] = np.array([3, 4], np.int32)[:k]
    return {"random": (x, rand, w), "skewed": (x, skew, w), "ties": (tie_x, ties, tie_w), "padding": (pad_x, pad, w)}


def _ref(ex, cfg, dt):
    return jax.jit(lambda e, x, i, w: moe._routed_grouped(e, x, i, w, cfg, dt))


def _dispatched(ex, cfg, dt, mesh, tok, exp, backend="all_to_all", capacity=None, valid=False):
    f = jax.jit(lambda e, x, i, w, v: md.routed_experts_dispatch(
        e, x, i, w, cfg, dt, mesh, backend=backend, token_axes=tok, expert_axes=exp, capacity=capacity,
        valid=v if valid else None))
    return lambda e, x, i, w, v=None: f(e, x, i, w, v)


def _check(got, want, what):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32), err_msg=what)


@pytest.mark.parametrize("layout,mode", [("dp8", "exact"), ("dp4xtp2", "exact"), ("dp4xtp2", "deterministic"),
                                         ("rep4x2", "exact")])
def test_dispatch_equals_one_device(cpu8, tiny_cfg, ex, layout, mode):
    cfg, dt = _mode(tiny_cfg, mode)
    mesh, tok, exp = _meshes(cpu8, layout)
    ref, got = _ref(ex, cfg, dt), _dispatched(ex, cfg, dt, mesh, tok, exp)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for case, (x, idx, w) in _routings(N, E, k, np.random.default_rng(SEED)).items():
        x = jnp.asarray(x, dt)
        want = ref(ex, x, idx, w)
        assert np.any(np.asarray(want) != 0), case
        _check(got(ex, x, idx, w), want, f"{layout} {mode} {case}")


def test_uneven_rows_and_padding_mask(cpu8, tiny_cfg, ex):
    """N = 13 on 4 x 2 devices (rows padded, dropped after); rows marked not valid are not dispatched
    and give zeros (a rank with no work still takes part in the collectives)."""
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp4xtp2")
    x, idx, w = _routings(13, cfg.n_routed_experts, cfg.num_experts_per_tok, np.random.default_rng(SEED))["random"]
    x = jnp.asarray(x, dt)
    want = np.asarray(_ref(ex, cfg, dt)(ex, x, idx, w))
    valid = np.ones(13, bool)
    valid[4:8] = False  # the second rank's rows (rows 4..7 of 16 padded rows): no real token there
    got = np.asarray(_dispatched(ex, cfg, dt, mesh, tok, exp, valid=True)(ex, x, idx, w, valid))
    _check(got[valid], want[valid], "valid rows")
    assert not np.any(got[~valid])


@pytest.mark.parametrize("capacity", [1, 3])
def test_several_dense_rounds(cpu8, tiny_cfg, ex, capacity):
    """A buffer smaller than the worst case: skewed routing (on 4 devices, every assignment of every device
    to device 0: 8 rows) takes several rounds (as many as the most loaded destination needs: 8 and 3),
    nothing is dropped."""
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp4")
    A = (N // 4) * cfg.num_experts_per_tok
    assert md.capacity_for(A, 4, capacity) == capacity < A
    ref, got = _ref(ex, cfg, dt), _dispatched(ex, cfg, dt, mesh, tok, exp, capacity=capacity)
    for case, (x, idx, w) in _routings(N, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                       np.random.default_rng(SEED + 1)).items():
        x = jnp.asarray(x, dt)
        _check(got(ex, x, idx, w), ref(ex, x, idx, w), f"capacity {capacity} {case}")


def test_prefill_chunk_default_buffer(cpu8, tiny_cfg, ex):
    """A prefill-size chunk (160 tokens per device on 4 devices, 320 assignments): the default buffer is 256
    rows per destination (not the worst case), so the skewed chunk (all 320 to device 0) runs two rounds;
    bitwise one device."""
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp4")
    n = 4 * 160
    A = 160 * cfg.num_experts_per_tok
    assert md.capacity_for(A, 4) == md.MIN_CAPACITY < A
    ref, got = _ref(ex, cfg, dt), _dispatched(ex, cfg, dt, mesh, tok, exp)
    routings = _routings(n, cfg.n_routed_experts, cfg.num_experts_per_tok, np.random.default_rng(SEED + 2))
    for case in ("skewed", "random"):
        x, idx, w = routings[case]
        x = jnp.asarray(x, dt)
        _check(got(ex, x, idx, w), ref(ex, x, idx, w), case)


def test_layer_scan_stacks(cpu8, tiny_cfg, tiny_params, ex):
    """Experts given as a scan run's stacks [n, E, ...] with the layer (`weights.Stacked`; scales stored as
    uint8, `layer_scan.storage_dtype`): only that layer's experts are read, bitwise the plain layer."""
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp8")
    other = tiny_params["layers"][2]["ffn"]["experts"]

    def stack(a, b):
        a, b = (jax.lax.bitcast_convert_type(t, jnp.uint8) if t.dtype != jnp.uint8 else t for t in (a, b))
        return jnp.stack([a, b])

    stacked = Stacked(jax.tree_util.tree_map(stack, other, ex), jnp.int32(1))
    x, idx, w = _routings(N, cfg.n_routed_experts, cfg.num_experts_per_tok, np.random.default_rng(SEED + 4))["random"]
    x = jnp.asarray(x, dt)
    _check(_dispatched(stacked, cfg, dt, mesh, tok, exp)(stacked, x, idx, w), _ref(ex, cfg, dt)(ex, x, idx, w), "stacks")


def test_plan_runs_the_model_moe_dispatched(cpu8, tiny_cfg, tiny_params):
    """`moe.moe` through `MeshPlan(mesh, "all_to_all")` on today's ("ep", "tp") mesh (tokens replicated:
    each device dispatches its share, then an all-gather) ≡ one device, exact mode; the default plan
    keeps the psum."""
    cfg, dt = _mode(tiny_cfg, "exact")
    p = tiny_params["layers"][3]["ffn"]
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((2, 5, cfg.hidden_size)), dt)
    k = cfg.num_experts_per_tok
    want = jax.jit(lambda p, x: moe.moe(p, x, k, cfg, dt))(p, x)
    mesh = Mesh(np.array(cpu8).reshape(4, 2), ("ep", "tp"))
    assert MeshPlan.of(mesh).moe_a2a_backend == "none"
    par = MeshPlan.of(MeshPlan.of(mesh), "all_to_all")
    assert par == MeshPlan(mesh, "all_to_all") and MeshPlan.of(par) is par
    got = jax.jit(lambda p, x: moe.moe(p, x, k, cfg, dt, par=par))(p, x)
    _check(got, want, "moe via MeshPlan all_to_all")


@pytest.mark.slow  # two whole-model compiles
def test_forward_dispatched_equals_one_device(cpu8):
    """The whole forward (micro, exact mode) on an ep=4 x tp=2 mesh with every MoE layer dispatched
    (`MeshPlan(mesh, "all_to_all")`) ≡ unsharded: same experts chosen, bitwise logits."""
    import configs
    from dsv41_jax.model.params import init_params
    from dsv41_jax.model.transformer import forward
    from dsv41_jax.parallel import rules
    from dsv41_jax.parallel.mesh import make_mesh

    cfg = configs.micro().replace(act_dtype="exact")
    params = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(SEED).integers(3, 300, (2, 7)).astype(np.int32)
    fwd = jax.jit(forward, static_argnames=("cfg", "return_aux", "par"))
    want, want_aux = fwd(params, tokens, cfg=cfg, return_aux=True, par=None)
    mesh = make_mesh(2, 4, cfg=cfg)
    got, aux = fwd(rules.shard_params(params, cfg, mesh), tokens, cfg=cfg, return_aux=True,
                   par=MeshPlan(mesh, "all_to_all"))
    for L in want_aux["experts"]:
        np.testing.assert_array_equal(np.asarray(aux["experts"][L]), np.asarray(want_aux["experts"][L]))
    _check(got, want, "forward logits")


def test_kernel_slots_dispatched(cpu8, tiny_cfg, tiny_params, pallas_impl):
    """The MXFP4 kernel as the per-device computation (`slots=`, through `moe.moe`), fp32 flow: bitwise
    the kernel on one device. (Interpret mode on CPU devices.)"""
    cfg = tiny_cfg.replace(act_dtype="float32", impl=f"xla,moe={pallas_impl}")
    p = tiny_params["layers"][0]["ffn"]
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((2, 4, cfg.hidden_size)), jnp.float32)
    k = cfg.num_experts_per_tok
    want = jax.jit(lambda p, x: moe.moe(p, x, k, cfg, jnp.float32))(p, x)
    par = MeshPlan(Mesh(np.array(cpu8[:4]).reshape(4, 1), ("ep", "tp")), "all_to_all")
    got = jax.jit(lambda p, x: moe.moe(p, x, k, cfg, jnp.float32, par=par))(p, x)
    _check(got, want, "kernel slots")


# ------------------------------------------------------------------------------------------ ragged


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes):
    """`jax.lax.ragged_all_to_all`'s documented semantics through all-gathers (runs on XLA:CPU): sender s
    writes operand_s[input_offsets_s[me] : + send_sizes_s[me]] at output[output_offsets_s[me]:] here."""
    ops, io, ss, oo = (jax.lax.all_gather(t, axes) for t in (operand, input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axes)
    rows = operand.shape[0]
    j = jnp.arange(rows)
    for s in range(ops.shape[0]):
        ok = j < ss[s, me]
        dst = jnp.where(ok, oo[s, me] + j, output.shape[0])
        output = output.at[dst].set(ops[s, jnp.clip(io[s, me] + j, 0, rows - 1)], mode="drop")
    del recv_sizes  # implied by the senders' sizes (the op checks they agree)
    return output


def test_ragged_bookkeeping_emulated(cpu8, tiny_cfg, ex, monkeypatch):
    """The ragged backend's offsets (send, receive, and back) with the collective rendered by its
    documented semantics: bitwise one device on 4 x 2, random and skewed routings, padding mask."""
    monkeypatch.setattr(md, "ragged_all_to_all", _emulated_ragged_all_to_all)
    monkeypatch.setattr(md, "RAGGED_UNSUPPORTED", ())
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp4xtp2")
    ref, got = _ref(ex, cfg, dt), _dispatched(ex, cfg, dt, mesh, tok, exp, backend="ragged", valid=True)
    valid = np.ones(N, bool)
    valid[6:8] = False
    for case, (x, idx, w) in _routings(N, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                       np.random.default_rng(SEED + 3)).items():
        x = jnp.asarray(x, dt)
        out = np.asarray(got(ex, x, idx, w, valid))
        _check(out[valid], np.asarray(ref(ex, x, idx, w))[valid], f"ragged {case}")
        assert not np.any(out[~valid])


def test_refusals(cpu8, tiny_cfg, ex):
    cfg, dt = _mode(tiny_cfg, "exact")
    mesh, tok, exp = _meshes(cpu8, "dp8")
    x = jnp.zeros((8, cfg.hidden_size), dt)
    idx = jnp.zeros((8, 2), jnp.int32)
    w = jnp.ones((8, 2), jnp.float32)
    with pytest.raises(ValueError, match="ragged: XLA:CPU cannot run ragged_all_to_all"):
        md.routed_experts_dispatch(ex, x, idx, w, cfg, dt, mesh, backend="ragged", token_axes=tok, expert_axes=exp)
    with pytest.raises(ValueError, match="'deepep': unknown backend; expected one of none, all_to_all, ragged"):
        md.routed_experts_dispatch(ex, x, idx, w, cfg, dt, mesh, backend="deepep", token_axes=tok, expert_axes=exp)
    with pytest.raises(ValueError, match="unknown backend"):
        MeshPlan(mesh, "deepep")
    six = Mesh(np.array(cpu8[:6]), ("dp",))
    with pytest.raises(ValueError, match="8 routed experts do not split evenly over dp=6"):
        md.routed_experts_dispatch(ex, x, idx, w, cfg, dt, six, token_axes="dp", expert_axes="dp")
    with pytest.raises(ValueError, match="mesh axis 'ep' is not in this mesh"):
        md.routed_experts_dispatch(ex, x, idx, w, cfg, dt, mesh, token_axes="dp", expert_axes="ep")
    with pytest.raises(ValueError, match="no expert axis"):
        MeshPlan(Mesh(np.array(cpu8[:2]), ("tp",)), "all_to_all").routed_experts(ex, x, idx, w, cfg, dt)


def _plugin_dir():
    """A directory holding JAX's CUDA PJRT plugin (``jax_plugins/xla_cuda12``), from this environment or
    ``DSV41_CUDA_PLUGIN_PATH`` (a ``pip install --target`` of jax-cuda12-plugin / -pjrt), else None."""
    import importlib.util

    extra = os.environ.get("DSV41_CUDA_PLUGIN_PATH")
    if extra and os.path.isdir(os.path.join(extra, "jax_plugins", "xla_cuda12")):
        return extra
    try:
        return "" if importlib.util.find_spec("jax_plugins.xla_cuda12") else None
    except ModuleNotFoundError:
        return None


def _gpu_target_env():
    """(repository root, environment) for a script compiling for compile-only CUDA devices: JAX on the CPU with
    the CUDA plugin on the path; skips the test where the plugin is not installed (not a project dependency)."""
    plugin = _plugin_dir()
    if plugin is None:
        pytest.skip("JAX's CUDA PJRT plugin is not installed (pip install jax-cuda12-plugin==<jax version>)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root, dict(os.environ, JAX_PLATFORMS="cpu",
                      PYTHONPATH=os.pathsep.join(p for p in (plugin, root, os.environ.get("PYTHONPATH", "")) if p))


def test_ragged_compiles_for_h200(tmp_path):
    """scripts/aot_moe_dispatch.py: the ragged backend lowered and compiled for 8 compile-only H200
    devices (XLA's GPU compiler, no GPU needed), its HLO holding ragged all-to-alls. Needs JAX's CUDA
    plugin (not a project dependency: skipped without it)."""
    root, env = _gpu_target_env()
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "aot_moe_dispatch.py"), "--gpu-target",
                        os.path.join(root, "scripts", "gpu_specs", "h200.txtpb"), "--devices", "8",
                        "--backend", "ragged", "--json", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["target"] == "cuda NVIDIA H200" and rep["devices"] == 8
    # x, local ids and weights out, the outputs back; plus the counts matrix's all-gather
    assert rep["hlo_ops"] == {"ragged-all-to-all": 4, "all-gather": 1}


def test_ragged_dp_step_compiles_for_h200(tmp_path):
    """scripts/aot_flash.py --dp 8 --moe-a2a-backend ragged: the data-parallel decode step (one program per
    rank, `parallel.dp`) of a one-layer flash cut at B = 64, lowered and compiled for 8 compile-only H200
    devices, its MoE dispatching through ragged all-to-alls (activations, ids, weights out; outputs back)
    and the n x n counts all-gathered. ~25 s of XLA's GPU compiler; skipped without JAX's CUDA plugin."""
    root, env = _gpu_target_env()
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "aot_flash.py"), "--dp", "8",
                        "--moe-a2a-backend", "ragged", "--gpu-target", os.path.join(root, "scripts", "gpu_specs",
                                                                                    "h200.txtpb"),
                        "--keep-layers", "0", "--impl", "xla", "--batch", "64", "--context", "4096",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["target"] == "cuda NVIDIA H200" and rep["devices"] == 8 and rep["dp"] == 8
    ops = rep["kernel_launches"]["by_opcode"]
    assert ops["ragged-all-to-all-start"] == 4 and ops["all-gather-start"] == 1
    assert rep["collective_bytes"]["ragged-all-to-all"] > 0 and "all-reduce" not in rep["collective_bytes"]


def test_aot_flash_refuses_ragged_on_cpu(cpu8, capsys):
    """aot_flash --dp 8 --moe-a2a-backend ragged on fake CPU devices: one line, exit 2, before tracing
    (never silently another backend)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("aot_flash", os.path.join(root, "scripts", "aot_flash.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dp", "8", "--moe-a2a-backend", "ragged", "--keep-layers", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: --moe-a2a-backend ragged: XLA:CPU cannot run ragged_all_to_all" in err and "--gpu-target" in err


# ------------------------------------------------------------------------------------------ sizing


def _script():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("aot_moe_dispatch", os.path.join(root, "scripts", "aot_moe_dispatch.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compiled_dense_bytes_match_the_prediction(cpu8):
    """scripts/aot_moe_dispatch.py on the 8 fake CPU devices (tiny shapes, all_to_all, fp32 activations:
    XLA:CPU widens a bf16 all-to-all to fp32): the compiled HLO's all-to-all result bytes are
    `moe_collective_bytes`'s per-layer figure."""
    import argparse

    mod = _script()
    rep = mod.run(argparse.Namespace(config="tiny", dtype="float32", devices=8, gpu_target=None, backend="all_to_all",
                                     tokens_per_device=4))
    assert rep["target"] == "cpu" and rep["hlo_ops"] == {"all-to-all": 4}
    assert rep["hlo_result_bytes"]["all-to-all"] == rep["predicted_bytes_per_layer"] > 0
    count, nbytes = mod.hlo_collectives("%a = ((s32[8,4]{1,0}), s32[8,4]{1,0}) all-to-all-start(%x), c\n"
                                        "%b = bf16[2,3]{1,0} ragged-all-to-all(%y), c\n"
                                        "%c = (f32[1]{0}, f32[1]{0}, /*index=2*/f32[2]{0}) all-to-all(%z), c")
    assert count == {"all-to-all": 2, "ragged-all-to-all": 1}
    assert nbytes == {"all-to-all": 128 + 16, "ragged-all-to-all": 12}


def test_moe_collective_bytes(tiny_cfg):
    """Bytes per device and step from shapes (tiny's hidden size, top-k and layer count; bf16 flow unless said)."""
    D, k, L = tiny_cfg.hidden_size, tiny_cfg.num_experts_per_tok, tiny_cfg.num_hidden_layers
    t, n = 4, 8
    A = t * k
    none = md.moe_collective_bytes(tiny_cfg, t, n, "none")
    assert none["per_layer"] == t * n * k * D * 2 and none["total"] == L * none["per_layer"]
    dense = md.moe_collective_bytes(tiny_cfg, t, n, "all_to_all")  # decode size: worst-case buffer, one round
    assert dense["rounds"] == 1
    assert dense["dispatch"] == L * n * A * (D * 2 + 8) and dense["combine"] == L * n * A * D * 2
    rag = md.moe_collective_bytes(tiny_cfg, t, n, "ragged")
    assert rag["per_layer"] == A * (D * 2 + 8) + n * n * 4 + A * D * 2
    small = md.moe_collective_bytes(tiny_cfg, t, n, "all_to_all", capacity=3)
    assert small["rounds"] == 3 and small["per_layer"] == 3 * n * 3 * (2 * D * 2 + 8)
    ex32 = md.moe_collective_bytes(tiny_cfg.replace(act_dtype="exact"), t, n, "none")
    assert ex32["per_layer"] == 2 * none["per_layer"]  # fp32 activations
    # at prefill size the dense buffer is 2x the balanced load (256 rows minimum), not the worst case
    assert md.moe_collective_bytes(tiny_cfg, 1024, n, "all_to_all")["rounds"] == 4  # 2048 rows / 512
    with pytest.raises(ValueError, match="unknown backend"):
        md.moe_collective_bytes(tiny_cfg, t, n, "nccl")
