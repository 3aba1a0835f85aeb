"""Which Pallas Triton-lowering features compile natively here (one short probe per feature).

Run on a GPU machine (`python research/gpu_smoke.py`); on CPU it runs everything in interpret mode.
Prints one line per probe: OK / FAIL with the error's first line. Meant for a first run on a new GPU machine.
"""

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, ".")
from dsv41_jax.pallas.common import triton_params  # noqa: E402

INTERP = jax.default_backend() != "gpu"
print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices()[0].device_kind, "interpret", INTERP)


def call(kernel, out_shape, *args, grid=(1,), **kw):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=INTERP,
                          compiler_params=triton_params(num_warps=4, num_stages=1), **kw)(*args)


def probe(name):
    def deco(fn):
        t = time.time()
        try:
            fn()
            print(f"OK    {name} ({time.time() - t:.1f}s)")
        except Exception as e:  # noqa: BLE001 - a probe reports, never stops the run
            msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            print(f"FAIL  {name}: {type(e).__name__}: {msg}")
            traceback.print_exc(limit=3, file=sys.stdout)
        return fn
    return deco


rng = np.random.default_rng(0)
pool = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
idx = jnp.asarray(rng.integers(0, 64, 16), jnp.int32)


@probe("int-array gather x_ref[idx] (page-table style)")
def _():
    def k(idx_ref, pool_ref, o_ref):
        i = idx_ref[...]
        o_ref[...] = pool_ref[i, :]
    out = call(k, jax.ShapeDtypeStruct((16, 32), jnp.float32), idx, pool)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pool)[np.asarray(idx)])


@probe("scalar load + dynamic row slice pool_ref[pl.ds(r, 1)]")
def _():
    def k(idx_ref, pool_ref, o_ref):
        r = idx_ref[3]
        o_ref[...] = pool_ref[pl.ds(r, 1), :]
    out = call(k, jax.ShapeDtypeStruct((1, 32), jnp.float32), idx, pool)
    np.testing.assert_array_equal(np.asarray(out)[0], np.asarray(pool)[int(idx[3])])


@probe("fp8 e4m3 ref load -> f32")
def _():
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float8_e4m3fn)
    def k(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((16, 32), jnp.float32), x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x.astype(jnp.float32)))


@probe("uint8 bit ops + bitcast int32->f32 (e8m0 / e2m1 decode)")
def _():
    e = jnp.asarray(rng.integers(100, 140, (16, 32)), jnp.uint8)
    def k(e_ref, o_ref):
        v = e_ref[...].astype(jnp.int32)
        lo = v & 15
        hi = jax.lax.shift_right_logical(v, 4)
        f = jax.lax.bitcast_convert_type(jax.lax.shift_left(v, 23), jnp.float32)
        o_ref[...] = f + (lo - hi).astype(jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((16, 32), jnp.float32), e)
    v = np.asarray(e).astype(np.int32)
    ref = (v << 23).view(np.float32) + ((v & 15) - (v >> 4)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out), ref)


@probe("bf16 dot with f32 accumulation (16x32 @ 32x16)")
def _():
    a = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    def k(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((16, 16), jnp.float32), a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(a, np.float32) @ np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


@probe("fori_loop with trip count from a loaded scalar + online max")
def _():
    n = jnp.asarray([3], jnp.int32)
    def k(n_ref, pool_ref, o_ref):
        def body(i, m):
            return jnp.maximum(m, pool_ref[pl.ds(i * 16, 16), :])
        o_ref[...] = jax.lax.fori_loop(0, n_ref[0], body, jnp.full((16, 32), -jnp.inf, jnp.float32))
    out = call(k, jax.ShapeDtypeStruct((16, 32), jnp.float32), n, pool)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pool)[:48].reshape(3, 16, 32).max(0))


@probe("cumsum + max/sum reductions + where in kernel")
def _():
    x = jnp.asarray(rng.integers(0, 3, (16, 32)), jnp.int32)
    def k(x_ref, o_ref, s_ref):
        v = x_ref[...]
        o_ref[...] = jnp.cumsum(v, axis=1)
        s_ref[...] = jnp.where(jnp.max(v, axis=1) > 1, jnp.sum(v, axis=1), -1)
    o, s = call(k, (jax.ShapeDtypeStruct((16, 32), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.int32)), x)
    xn = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(o), np.cumsum(xn, 1))
    np.testing.assert_array_equal(np.asarray(s), np.where(xn.max(1) > 1, xn.sum(1), -1))


@probe("grid + BlockSpec + program_id + masked store of a row")
def _():
    def k(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[...] = x_ref[...] * (i + 1).astype(jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((64, 32), jnp.float32), pool, grid=(4,),
               in_specs=[pl.BlockSpec((16, 32), lambda i: (i, 0))], out_specs=pl.BlockSpec((16, 32), lambda i: (i, 0)))
    ref = np.asarray(pool).reshape(4, 16, 32) * np.arange(1, 5, dtype=np.float32)[:, None, None]
    np.testing.assert_array_equal(np.asarray(out), ref.reshape(64, 32))


@probe("argmax / argmin along axis in kernel")
def _():
    def k(x_ref, o_ref):
        o_ref[...] = jnp.argmax(x_ref[...], axis=1).astype(jnp.int32)
    out = call(k, jax.ShapeDtypeStruct((64,), jnp.int32), pool)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(pool).argmax(1))


@probe("pltriton.load with mask and other (1-D ref)")
def _():
    from jax.experimental.pallas import triton as pltriton
    def k(x_ref, o_ref):
        m = jnp.arange(32) < 20
        o_ref[...] = pltriton.load(x_ref, mask=m, other=-1.0)
    x = pool[0]
    out = call(k, jax.ShapeDtypeStruct((32,), jnp.float32), x)
    ref = np.where(np.arange(32) < 20, np.asarray(x), -1.0)
    np.testing.assert_array_equal(np.asarray(out), ref)


@probe("atomic_add to a scalar slot (histogram)")
def _():
    from jax.experimental.pallas import triton as pltriton
    def k(x_ref, _init_ref, o_ref):
        i = pl.program_id(0)
        pltriton.atomic_add(o_ref, pl.ds(x_ref[i], 1), jnp.ones((1,), jnp.int32))
    x = jnp.asarray(rng.integers(0, 16, 64), jnp.int32)
    out = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((16,), jnp.int32), grid=(64,), interpret=INTERP,
                         compiler_params=triton_params(num_warps=1, num_stages=1),
                         input_output_aliases={1: 0})(x, jnp.zeros((16,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.bincount(np.asarray(x), minlength=16))


@probe("dot with M=4 rows (Triton needs >=16?)")
def _():
    a = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
    def k(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((4, 16), jnp.float32), a, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(a, np.float32) @ np.asarray(b, np.float32), rtol=1e-2, atol=1e-2)


@probe("exp / sigmoid / rsqrt / sqrt / bf16 round-trip / broadcast 2D")
def _():
    def k(x_ref, o_ref):
        v = x_ref[...]
        r = jnp.exp(v - jnp.max(v, axis=1, keepdims=True)) + jax.nn.sigmoid(v) + jax.lax.rsqrt(v * v + 1.0)
        r = r + jnp.sqrt(jnp.abs(v))
        o_ref[...] = r.astype(jnp.bfloat16).astype(jnp.float32)
    out = call(k, jax.ShapeDtypeStruct((64, 32), jnp.float32), pool)
    v = np.asarray(pool, np.float64)
    ref = np.exp(v - v.max(1, keepdims=True)) + 1 / (1 + np.exp(-v)) + 1 / np.sqrt(v * v + 1) + np.sqrt(np.abs(v))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-2)


@probe("flash-size block: [64, 512] f32 acc += [64,64]bf16 @ [64,512]bf16 over 8 steps")
def _():
    q = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((512, 512)), jnp.bfloat16)
    def k(q_ref, kv_ref, o_ref):
        def body(i, acc):
            kb = kv_ref[pl.ds(i * 64, 64), :]
            s = jnp.dot(q_ref[...], kb.T, preferred_element_type=jnp.float32)  # [64, 64]
            return acc + jnp.dot(s.astype(jnp.bfloat16), kb, preferred_element_type=jnp.float32)
        o_ref[...] = jax.lax.fori_loop(0, 8, body, jnp.zeros((64, 512), jnp.float32))
    out = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((64, 512), jnp.float32), grid=(1,), interpret=INTERP,
                         compiler_params=triton_params(num_warps=8, num_stages=2))(q, kv)
    assert np.isfinite(np.asarray(out)).all()


@probe("import dsv41_jax.model + tiny forward jit")
def _():
    from dsv41_jax.model import ModelConfig, forward, init_params
    cfg = ModelConfig.preset("tiny")
    p = init_params(cfg, jax.random.key(0))
    lg = jax.jit(forward, static_argnames=("cfg",))(p, jnp.ones((1, 8), jnp.int32), cfg)
    assert np.isfinite(np.asarray(lg)).all()
