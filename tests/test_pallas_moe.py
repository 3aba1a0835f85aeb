"""The grouped MXFP4 MoE kernel (dsv41_jax/pallas/moe_mxfp4.py) against the seam's "xla" grouped path
(`moe.routed_slots`), natively on a GPU and in interpret mode elsewhere (`pallas_impl`).

Both compute the same per-element arithmetic — the same fp8 quantization of each GEMM input, the same
exact products (bf16-exact operands), the same roundings of each GEMM output and of the activation —
and differ only in the fp32 summation order inside each expert GEMM. So:

* **bitwise** on "order-free" experts: every output row of w1 / w3 / w2 has at most two nonzero e2m1
  codes (at random columns, under random per-32 scales), so each GEMM sum has at most two nonzero
  terms and every summation order gives the same fp32 sum. Everything else (which rows, which expert,
  which tile and K chunk, the scale decode, the clamps, silu, the fp8 quant of w2's input, the
  routing weight, the combine) is exercised and must match bit for bit, in the bf16 and fp32 flows;
* **within a stated tolerance** on dense random experts: fp32 flow within 1e-5·max|y| (summation order
  only; an fp8 code flip of w2's input would show as ~1e-3·max), bf16 flow within 4 bf16 ulps of
  max|y| (a 1-ulp difference of a GEMM output can move the output a few ulps) — the bounds of the xla
  path against the reference (tests/test_fastpath_ops.py).

The exact and deterministic numerics modes have no kernel: the seam refuses them (fp64 accumulation).

Shapes (interpret mode is slow, so the default run keeps grids tiny): hidden 320 and intermediate 288
(5·64 and 9·32: the odd factors of flash's 5120 and 2304, so several output tiles and K chunks that are
not a power of two in number), 8 experts; B = 1 (two of eight experts get no token) and 64 (top-6:
groups of many rows, more than one row block); one token whose slots are partly on experts held elsewhere
(the sort-free one-token path); every token on one expert (top-1, the last expert;
and top-6 all on the same six); top-6 of 384 routed over a stack holding 8 of them (`first_expert`:
most assignments belong to no held expert); experts stacked by the layer scan. At flash's widths
(5120 / 2304, 8 experts, top-6) the `slow` cases run B = 1 and 64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.model import ModelConfig, dispatch, moe, quant
from dsv41_jax.model.weights import Mxfp4, Stacked
from dsv41_jax.pallas import common, costs
from dsv41_jax.pallas import moe_mxfp4 as mk
from dsv41_jax.parallel.plan import MeshPlan

BF16 = jnp.dtype(jnp.bfloat16)
NARROW = (320, 288)  # hidden, intermediate
FLASH = (5120, 2304)


def _experts(rng, E, D, I, order_free):
    """Stacked routed experts in the stored format: packed e2m1 uint8 [E, out, in/2] and E8M0 scales
    [E, out, in/32] (2^-5 .. 2^0). order_free: at most two nonzero codes per output row."""
    def mx(o, i):
        if order_free:
            codes = np.zeros((E, o, i), np.uint8)
            cols = np.argsort(rng.random((E, o, i)), axis=-1)[..., :2]
            np.put_along_axis(codes, cols, rng.integers(1, 16, (E, o, 2)).astype(np.uint8), axis=-1)
            codes[codes == 8] = 9  # -0 is not a nonzero
            packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        else:
            packed = rng.integers(0, 256, (E, o, i // 2)).astype(np.uint8)
        sb = rng.integers(122, 128, (E, o, i // 32)).astype(np.uint8)
        return Mxfp4(weight=jnp.asarray(packed), scale=jax.lax.bitcast_convert_type(jnp.asarray(sb), quant.E8M0))

    return {"w1": mx(I, D), "w3": mx(I, D), "w2": mx(D, I)}


def _routing(rng, N, k, E_total, case):
    if case == "one_expert_top1":
        return np.full((N, 1), E_total - 1, np.int32)
    if case == "same_six":
        return np.tile(rng.permutation(E_total)[:k], (N, 1)).astype(np.int32)
    return np.stack([rng.permutation(E_total)[:k] for _ in range(N)]).astype(np.int32)


_CFG = {m: ModelConfig.preset("tiny").replace(act_dtype=m) for m in ("bfloat16", "float32", "exact")}
_xla = jax.jit(lambda ex, x, idx, w, first, mode, dt: moe.routed_slots(ex, x, idx, w, _CFG[mode], dt, first),
               static_argnums=(5, 6))


@functools.cache
def _kern(impl):
    """One jitted kernel per impl for the module: cases of one shape (e.g. the bitwise N = 64 / top-6 cases and
    the dense ones, the two one-token cases) share its compiled program (`first` is traced)."""
    return jax.jit(lambda ex, x, idx, w, first, mode, dt: mk.kernel(
        ex, x, idx, w, _CFG[mode], dt, first, interpret=impl == "pallas_interpret"), static_argnums=(5, 6))


def _case(seed, widths, E, N, k, route, order_free, E_total=None):
    rng = np.random.default_rng(seed)
    D, I = widths
    ex = _experts(rng, E, D, I, order_free)
    x = rng.standard_normal((N, D)).astype(np.float32) * 2.0
    idx = _routing(rng, N, k, E_total or E, route)
    w = rng.random(idx.shape).astype(np.float32) + 0.1
    return ex, jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w)


def _run(impl, ex, x, idx, w, mode, first=0, oracle="device"):
    """(kernel, oracle) outputs as fp32 numpy; the oracle is the xla path (`moe.routed_slots`) on the
    kernel's device, or with ``oracle="host"`` on the host CPU. Natively each has one known way of parting
    from the kernel, both measured on an H200 (jax 0.11.2):
    * the device's XLA at flash's widths (K = 5120): its GEMM does not round once (1.5 % of the outputs
      parted on order-free experts, whose GEMM sums have at most two terms: the spec's single fp32
      accumulation and single rounding fix every bit), so the flash-width test takes the host;
    * the host's XLA in the fp32 flow: its silu differs from the GPU's by an fp32 ulp (a few outputs 1 ulp
      apart, e.g. 3 of 122,880 in "b64_top6"), so the other tests take the device's XLA, whose
      elementwise functions are the kernel's. In interpret mode both oracles are the host."""
    dt = BF16 if mode == "bfloat16" else jnp.dtype(jnp.float32)
    xin = x.astype(dt)
    got = _kern(impl)(ex, xin, idx, w, first, mode, dt)
    args = (ex, xin, idx, w) if oracle == "device" else jax.device_put((ex, xin, idx, w), jax.devices("cpu")[0])
    want = _xla(*args, first, mode, dt)
    assert got.dtype == want.dtype == dt and got.shape == want.shape == (x.shape[0], idx.shape[1], x.shape[1])
    return np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))


# (seed, widths, experts, tokens, top-k, routing, first_expert, experts routed over)
CASES = {
    "b1_empty_experts": (1, NARROW, 8, 1, 6, "random", 0, None),
    "b64_top6": (2, NARROW, 8, 64, 6, "random", 0, None),
    "one_expert_top1": (3, NARROW, 8, 64, 1, "one_expert_top1", 0, None),
    "same_six": (4, NARROW, 8, 5, 6, "same_six", 0, None),
    "top6_of_384_hold_8": (5, NARROW, 8, 64, 6, "random", 16, 384),
    "b1_hold_8_of_24": (14, NARROW, 8, 1, 6, "random", 8, 24),  # one token: no sort; some slots not held
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_bitwise_on_order_free_experts(pallas_impl, name):
    seed, widths, E, N, k, route, first, e_total = CASES[name]
    ex, x, idx, w = _case(seed, widths, E, N, k, route, True, e_total)
    local = np.asarray(idx) - first
    held = (local >= 0) & (local < E)
    counts = np.bincount(local[held], minlength=E)
    if name == "b1_empty_experts":
        assert (counts == 0).sum() == 2
    if name == "top6_of_384_hold_8":
        assert 0 < held.sum() < held.size // 4  # most assignments go to experts not held here
    if name == "b1_hold_8_of_24":
        assert 0 < held.sum() < held.size
    for mode in ("bfloat16", "float32"):
        got, want = _run(pallas_impl, ex, x, idx, w, mode, first)
        assert np.abs(want).max() > 0
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {mode}")
        assert (got[~held] == 0).all()  # slots of experts not held are exact zeros


@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_kernel_dense_experts_within_tolerance(pallas_impl, mode):
    ex, x, idx, w = _case(7, NARROW, 8, 64, 6, "random", False)
    got, want = _run(pallas_impl, ex, x, idx, w, mode)
    m = np.abs(want).max()
    if mode == "float32":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * m)
    else:
        ulp = 2.0 ** (np.floor(np.log2(m)) - 7)
        assert np.abs(got - want).max() <= 4 * ulp


def test_kernel_reads_a_layer_of_a_scanned_stack(pallas_impl):
    """Inside a layer scan the experts arrive as the run's stacks [n, E, ...] (scales as uint8 bits)
    plus the layer index: the kernel reads that layer's experts in place."""
    ex0, x, idx, w = _case(8, NARROW, 8, 3, 6, "random", True)
    ex1 = _case(9, NARROW, 8, 3, 6, "random", True)[0]
    run = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), ex0, ex1)
    run = {n: Mxfp4(weight=v.weight, scale=jax.lax.bitcast_convert_type(v.scale, jnp.uint8)) for n, v in run.items()}
    for layer, ex in ((0, ex0), (1, ex1)):
        stacked = Stacked(run, jnp.int32(layer))
        got, _ = _run(pallas_impl, stacked, x, idx, w, "bfloat16")
        _, want = _run(pallas_impl, ex, x, idx, w, "bfloat16")
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("n_tok", [1, 64])
def test_kernel_at_flash_widths(pallas_impl, n_tok):
    """Flash's hidden / intermediate widths, 8 experts, top-6 (B = 1 leaves two experts empty)."""
    ex, x, idx, w = _case(10 + n_tok, FLASH, 8, n_tok, 6, "random", True)
    got, want = _run(pallas_impl, ex, x, idx, w, "bfloat16", oracle="host")
    np.testing.assert_array_equal(got, want)
    ex, x, idx, w = _case(20 + n_tok, FLASH, 8, n_tok, 6, "random", False)
    got, want = _run(pallas_impl, ex, x, idx, w, "bfloat16", oracle="host")
    assert np.abs(got - want).max() <= 4 * 2.0 ** (np.floor(np.log2(np.abs(want).max())) - 7)


def _flash_args(N: int, k: int = 6):
    """Abstract kernel arguments (nothing allocated): flash's 384 experts of (5120, 2304), N tokens, top-k."""
    (D, I), E, sds = FLASH, 384, jax.ShapeDtypeStruct
    ex = {n: Mxfp4(weight=sds((E, o, i // 2), jnp.uint8), scale=sds((E, o, i // 32), quant.E8M0))
          for n, o, i in (("w1", I, D), ("w3", I, D), ("w2", D, I))}
    return ex, sds((N, D), BF16), sds((N, k), jnp.int32), sds((N, k), jnp.float32)


def _kernel_bf16(ex, x, idx, w):
    return mk.kernel(ex, x, idx, w, _CFG["bfloat16"], BF16)


def _flash_calls(N: int, k: int = 6):
    """(jaxpr, its two pallas_call equations) of the kernel traced at `_flash_args`."""
    jaxpr = jax.make_jaxpr(_kernel_bf16)(*_flash_args(N, k)).jaxpr
    return jaxpr, [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]


def test_packed_weights_enter_as_byte_pairs_and_wrapping_offsets_are_refused():
    """The packed e2m1 weights reach the kernel as uint16 byte pairs (half the elements: Triton's int32
    offsets cannot wrap below 2^32 bytes), the scales as bytes; an operand that would still wrap (an
    element offset past 2^31 - 1 in at most 2^32 bytes) is refused, not read from a wrapped address."""
    D, I, E = *FLASH, 384
    sds = jax.ShapeDtypeStruct
    up, down = _flash_calls(N=4)[1]
    avals = [v.aval for v in up.invars[-4:]] + [v.aval for v in down.invars[-2:]]
    assert [(a.shape, a.dtype) for a in avals] == [((E * I, D // 4), jnp.uint16), ((E * I, D // 32), jnp.uint8)] * 2 \
        + [((E * D, I // 4), jnp.uint16), ((E * D, I // 32), jnp.uint8)]
    assert max(a.size for a in avals) < 2**31 < 384 * I * D // 2  # one layer's w1 as bytes would wrap
    common.check_offsets(sds((2**31,), jnp.uint8))  # offsets up to 2^31 - 1
    common.check_offsets(sds((2**31,), jnp.uint16))  # 2^32 bytes, the same
    common.check_offsets(sds((2**31 + 1,), jnp.uint16))  # over 2^32 bytes: the lowering's int64 offsets
    with pytest.raises(NotImplementedError, match="wrapping int32 offsets"):
        common.check_offsets(sds((2**31 + 1,), jnp.uint8))


@pytest.mark.slow
def test_experts_past_the_2gib_byte_read_their_own_weights(pallas_impl):
    """Natively, flash's 384 experts in one stack (w1: 2.26 GB): tokens routed to the last experts
    (past byte 2^31 of w1 and w2) and to the first ones give bitwise the outputs of the same kernel run
    on a stack of just those experts. Before the byte-pair operands this read wrapped addresses."""
    if pallas_impl != "pallas":
        pytest.skip("native only: a 7.2 GB expert stack in interpret mode would take hours")
    ex, x, _, w = costs.moe_bench_inputs(4, seed=3)
    ids = np.array([[383, 382, 0, 370, 1, 375], [379, 2, 381, 3, 366, 380], [0, 1, 2, 3, 383, 382],
                    [370, 371, 372, 373, 374, 375]], np.int32)
    uniq = np.unique(ids)
    small = jax.tree_util.tree_map(lambda a: a[jnp.asarray(uniq)], ex)
    kern = jax.jit(lambda ex, x, idx, w: mk.kernel(ex, x, idx, w, _CFG["bfloat16"], BF16))
    got = kern(ex, x, jnp.asarray(ids), w)
    want = kern(small, x, jnp.asarray(np.searchsorted(uniq, ids).astype(np.int32)), w)
    assert np.abs(np.asarray(want.astype(jnp.float32))).max() > 0
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_in_kernel_fp8_quant_is_quants_bitwise():
    """The gate/up epilogue's fp8 activation quant (integer rounding: no round primitive in Triton)
    equals `quant.fake_quant_fp8` bit for bit, on values built to hit its edges: exact e4m3 ties
    (odd and even codes), ±0, the subnormal range, block maxima at powers of two and at the 1e-4
    floor, and random normals over many binades."""
    rng = np.random.default_rng(12)
    ties = (np.arange(8, 16) + 0.5) * 2.0 ** rng.integers(-9, 5, 8)  # between two e4m3 codes
    rows = [np.concatenate([ties, -ties, [0.0, -0.0], 2.0 ** -np.arange(6, 18), [448.0, 2.0 ** -8]]),
            rng.standard_normal(32) * 2.0 ** rng.integers(-20, 10, 32),
            np.full(32, 3e-5) * rng.choice([-1, 1], 32),
            np.full(32, 2.0 ** 7)]
    a = np.stack([np.resize(r, 64) for r in rows * 4]).astype(np.float32)  # [16, 64]
    got = jax.jit(common.fake_quant_fp8)(jnp.asarray(a))
    want = quant.fake_quant_fp8(jnp.asarray(a), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


# ------------------------------------------------------------------------------------------- seam

def test_seam_runs_the_kernel_and_refuses_the_exact_mode(pallas_impl, tiny_cfg, tiny_params):
    """moe.moe with moe=<kernel> equals moe=xla on tiny's first layer (fp32 flow, summation order only),
    same routing, for 10 tokens and for one (the kernel's one-token case; with the linear kernel too: the
    router kernel and the combine in w2's epilogue); the exact / deterministic modes are refused with a clear
    error."""
    p = tiny_params["layers"][0]["ffn"]
    x = jnp.asarray(np.random.default_rng(11).standard_normal((2, 5, tiny_cfg.hidden_size)), jnp.float32)
    k = tiny_cfg.num_experts_per_tok
    f = jax.jit(lambda p, x, cfg: moe.moe(p, x, k, cfg, jnp.float32, return_routing=True), static_argnums=2)
    cfg32 = tiny_cfg.replace(act_dtype="float32")
    got, (gi, _) = f(p, x, cfg32.replace(impl=f"xla,moe={pallas_impl}"))
    want, (wi, _) = f(p, x, cfg32.replace(impl="xla"))
    np.testing.assert_array_equal(np.asarray(gi), np.asarray(wi))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    # one token (decode at B = 1): the kernel's sort-free case, every expert held (no zero-fill select)
    got, (gi, _) = f(p, x[:1, :1], cfg32.replace(impl=f"xla,moe={pallas_impl}"))
    want, (wi, _) = f(p, x[:1, :1], cfg32.replace(impl="xla"))
    np.testing.assert_array_equal(np.asarray(gi), np.asarray(wi))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    # and with the linear kernel too: the router kernel's outputs feed the experts' kernel, whose slots the shared
    # expert's w2 kernel sums (`moe.moe`'s fused form); equal to moe=xla within the same tolerance, the same routing
    both = cfg32.replace(impl=f"xla,moe={pallas_impl},linear={pallas_impl}")
    got, (gi, _) = f(p, x[:1, :1], both)
    np.testing.assert_array_equal(np.asarray(gi), np.asarray(wi))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    assert dispatch.kernel("moe", pallas_impl) is mk.kernel
    for mode in (dict(act_dtype="exact"), dict(deterministic=True)):
        with pytest.raises(dispatch.ImplError, match="accumulates in fp64"):
            f(p, x, tiny_cfg.replace(impl=f"xla,moe={pallas_impl}", **mode))


def test_kernel_runs_expert_parallel_bitwise_as_on_one_device(tiny_cfg, tiny_params, cpu8):
    """On an ep mesh (2 and 4 expert shards of the 8 fake CPU devices) the kernel runs per shard, as the
    xla path does (`collectives.routed_experts`, first_expert = the shard's first id): bitwise the
    kernel's result on one device, bf16 and fp32 flows. (Interpret mode: the mesh is of CPU devices.)"""
    p = tiny_params["layers"][0]["ffn"]
    x = jnp.asarray(np.random.default_rng(13).standard_normal((3, 5, tiny_cfg.hidden_size)), jnp.float32)
    k = tiny_cfg.num_experts_per_tok
    for act in ("float32", "bfloat16"):
        cfg = tiny_cfg.replace(act_dtype=act, impl="xla,moe=pallas_interpret")
        dt = jnp.dtype(act)
        want = jax.jit(lambda p, x: moe.moe(p, x.astype(dt), k, cfg, dt))(p, x)
        for ep in (2, 4):
            par = MeshPlan(jax.sharding.Mesh(np.array(cpu8[:ep]).reshape(1, ep), ("tp", "ep")))
            got = jax.jit(lambda p, x: moe.moe(p, x.astype(dt), k, cfg, dt, par=par))(p, x)
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                          err_msg=f"ep={ep} {act}")


def test_auto_picks_the_kernel_on_a_gpu_as_measured():
    assert dispatch.GPU_AUTO["moe"] == "pallas" and dispatch.resolve("auto", "moe", backend="gpu") == "pallas"
    assert dispatch.resolve("auto", "moe", backend="cpu") == "xla"
    # the fp64-accumulating modes keep the jnp path under auto (the kernel accumulates in fp32)
    assert dispatch.resolve("auto", "moe", backend="gpu", f64=True) == "xla"


# --------------------------------------------------------------------------------------- contract

def test_cost_estimate_is_the_bytes_moved_contract():
    """Each pallas_call declares `costs.moe_bytes_moved` (every group non-empty) as its cost estimate, and
    `costs.moe_call_geometry` recovers the contract's arguments from the call's name and operand shapes — what
    scripts/bench_decode.py reads. Flash widths, 384 experts, B = 64: each selected expert's weights
    at stored width (packed + scales, 17.7 MiB for the three) once per non-empty group."""
    D, I, E, N, k = *FLASH, 384, 64, 6
    jaxpr, calls = _flash_calls(N)
    assert [c.params["name"].rsplit("_m", 1)[0] for c in calls] == ["moe_mxfp4_gate_up", "moe_mxfp4_down"]
    per_expert = 0
    for c in calls:
        geo = costs.moe_call_geometry(c.params["name"], [v.aval for v in c.invars], c.params["out_avals"])
        assert (geo["A"], geo["D"], geo["I"], geo["G"]) == (N * k, D, I, min(N * k, E))
        part = geo.pop("part")
        assert c.params["cost_estimate"].bytes_accessed == int(costs.moe_bytes_moved(part, **geo))
        per_expert += costs.moe_bytes_moved(part, **geo, n_active=1) - costs.moe_bytes_moved(part, **geo, n_active=0)
    assert per_expert == 3 * (I * D // 2 + I * D // 32)  # = 17.7 MiB: stored width, read once
    assert costs.moe_call_geometry("sparse_attention_h64", [], []) is None
    # scripts/bench_decode.py counts the two calls by this contract at the expected number of distinct
    # experts 64 tokens select (top-6 of 384: 243.8), the same expectation as its ideal
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("bench_decode", pathlib.Path(__file__).parents[1] / "scripts" /
                                                  "bench_decode.py")
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    acc = bd.count_matmuls(jaxpr, routing=(E, k))
    active = bd.expected_distinct(E, k, N)
    assert 243 < active < 244 and acc["kernel_calls"] == 2 and acc["n_matmuls"] == 0
    want = 0
    for c in calls:
        geo = costs.moe_call_geometry(c.params["name"], [v.aval for v in c.invars], c.params["out_avals"])
        want += costs.moe_bytes_moved(geo.pop("part"), **geo, n_active=active)
    assert acc["bytes"] == want and acc["flops"] == 2 * N * k * 3 * D * I


def test_tuning_candidates_lower_to_triton_for_cuda():
    """Every tiling `scripts/bench_kernels.py` times on a GPU (`TUNING_CANDIDATES`, the first the default)
    is accepted at flash's widths and lowers to verified Triton IR for sm_90 (so a GPU run spends no
    time on a candidate that cannot compile); its names record the tiling."""
    if jax.default_backend() == "gpu":
        pytest.skip("the GPU benchmark compiles the candidates on the GPU")
    from dsv41_jax.pallas.offline import capture_kernels

    assert mk.TUNING_CANDIDATES[0] == dict(block_n=64, block_n2=64, block_k=128, block_k2=128, num_warps=4,
                                           num_stages=2)
    assert mk._plan(6, 6, *FLASH, None, None, None, None, None) == dict(bm=16, bn=64, bn2=64, bk=128, bk2=128)
    for kn in mk.TUNING_CANDIDATES[1:]:
        ks = capture_kernels(lambda *a, kn=kn: mk.kernel(*a, _CFG["bfloat16"], BF16, **kn), *_flash_args(1))
        assert [kk["name"] for kk in ks] == [f"moe_mxfp4_gate_up_m16_n{kn['block_n']}_k{kn['block_k']}",
                                             f"moe_mxfp4_down_m16_n{kn['block_n2']}_k{kn['block_k2']}"]
        assert all("tt.dot" in kk["ttir"] for kk in ks)


def test_lowers_to_triton_for_cuda_without_a_gpu():
    """Both calls lower to verified Triton IR for sm_90 at flash shapes, decode (B = 1) and prefill
    (4096 tokens: 64-row blocks)."""
    if jax.default_backend() == "gpu":
        pytest.skip("the native tests compile the kernel on this GPU")
    from dsv41_jax.pallas.offline import capture_kernels

    for n_tok, bm in ((1, 16), (4096, 64)):
        ks = capture_kernels(_kernel_bf16, *_flash_args(n_tok))
        assert [kk["name"] for kk in ks] == [f"moe_mxfp4_gate_up_m{bm}_n64_k128", f"moe_mxfp4_down_m{bm}_n64_k128"]
        assert all("tt.dot" in kk["ttir"] and "tt.load" in kk["ttir"] for kk in ks)


def test_distinct_argsort_is_the_stable_argsort():
    """The kernel path's sort-free combine order (`moe._distinct_argsort`) is `argsort(stable)` on rows of
    distinct ids — top-6 of 384 in random order, ascending, descending, and k = 1 — so the combine adds the
    same slots in the same order as the xla path's."""
    from dsv41_jax.model import moe

    rng = np.random.default_rng(8)
    rows = [rng.choice(384, 6, replace=False) for _ in range(64)] + [np.arange(6), np.arange(6)[::-1] * 50]
    for idx in (np.stack(rows).astype(np.int32), rng.choice(384, (5, 1)).astype(np.int32)):
        got = np.asarray(moe._distinct_argsort(jnp.asarray(idx)))
        np.testing.assert_array_equal(got, np.argsort(idx, axis=1, kind="stable"))


@pytest.mark.parametrize("N, E, k", [(1, 384, 6), (5, 384, 6), (17, 64, 4)], ids=["flash-1tok", "flash-5tok", "17tok"])
def test_router_kernel_is_moe_route(pallas_impl, N, E, k):
    """The router kernel (`pallas/moe_route.py`: scores, top-k, weights in one launch) equals `moe.route`'s
    selection bit for bit: the same experts in the same order (ties to the lower id: two experts with equal
    scores in row 0), the same weights (normalized, scaled), softplus's linear branch (a logit past 20), E not a
    power of two (384, padded to 512 with −inf); the combine's order (the stable argsort of the ids); the padded
    lanes past k hold 0; a stacked bias (layer 1 of 2)."""
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.pallas import moe_route as mr

    cfg = ModelConfig.preset("flash")
    rng = np.random.default_rng(N + E)
    lg = rng.standard_normal((N, E)).astype(np.float32) * 3
    b = (rng.standard_normal(E) * 0.1).astype(np.float32)
    lg[0, 10] = lg[0, 20] = 40.0  # (above the last row's 30 when N = 1)
    b[10] = b[20] = 0.5  # a tie at the top of row 0
    lg[-1, 3] = 30.0
    interp = pallas_impl == "pallas_interpret"
    idx, w, order = mr.kernel(jnp.asarray(lg), jnp.asarray(b), k, cfg, interpret=interp)
    ri, rw = mr.ref_route(jnp.asarray(lg), jnp.asarray(b), k, cfg)
    np.testing.assert_array_equal(np.asarray(order[:, :k]), np.argsort(np.asarray(ri), axis=1, kind="stable"))
    assert idx.shape == w.shape == (N, max(2, 1 << (k - 1).bit_length())) and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx[:, :k]), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(w[:, :k]), np.asarray(rw))
    assert list(np.asarray(ri[0, :2])) == [10, 20] and (np.asarray(w[:, k:]) == 0).all()
    si, sw, _ = mr.kernel(jnp.asarray(lg), jnp.stack([jnp.zeros(E), jnp.asarray(b)]), k, cfg, layer=jnp.int32(1),
                          interpret=interp)
    np.testing.assert_array_equal(np.asarray(si), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(sw), np.asarray(w))


def test_one_token_moe_takes_the_fused_combine(pallas_impl, tiny_cfg, tiny_params):
    """With the moe and linear kernels at one token, the plan runs the fused form (`StepPlan.combine_in_w2`: the
    experts' raw slots summed in ascending expert id as the shared expert's w2 kernel's epilogue); it equals the
    unfused form (the same kernels, the sum in XLA after w2) bit for bit (test_pallas_linear checks the epilogue
    against combine_slots)."""
    import dataclasses

    from dsv41_jax.model.plan import StepPlan

    p = tiny_params["layers"][0]["ffn"]
    x = jnp.asarray(np.random.default_rng(12).standard_normal((1, 1, tiny_cfg.hidden_size)), jnp.bfloat16)
    cfg = tiny_cfg.replace(impl=f"xla,moe={pallas_impl},linear={pallas_impl}")
    step = StepPlan.of(cfg, None, (1, 1))
    assert step.combine_in_w2 and step.router_kernel
    fused = moe.moe(p, x, tiny_cfg.num_experts_per_tok, cfg, jnp.bfloat16, step=step)
    apart = moe.moe(p, x, tiny_cfg.num_experts_per_tok, cfg, jnp.bfloat16,
                    step=dataclasses.replace(step, combine_in_w2=False))
    np.testing.assert_array_equal(np.asarray(fused.astype(jnp.float32)), np.asarray(apart.astype(jnp.float32)))


def test_router_kernel_lowers_to_triton_for_cuda():
    if jax.default_backend() == "gpu":
        pytest.skip("offline lowering is for machines without a GPU; here test_router_kernel_is_moe_route compiles it "
                    "natively at flash's shapes")
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.pallas import moe_route as mr
    from dsv41_jax.pallas.offline import capture_kernels

    cfg = ModelConfig.preset("flash")
    for n in (1, 64):
        ks = capture_kernels(lambda lg, b: mr.kernel(lg, b, 6, cfg), jax.ShapeDtypeStruct((n, 384), jnp.float32),
                             jax.ShapeDtypeStruct((384,), jnp.float32))
        assert [k["name"] for k in ks] == ["moe_route"] and "tt.store" in ks[0]["ttir"]
