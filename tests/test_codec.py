"""`model.codec`: every form of each decoder (numpy, jnp, inside a Pallas kernel) equals the dtype's
own definition (ml_dtypes) on all 256 bytes, NaN positions included, and the encoders invert them.

The expected values come from ml_dtypes' casts, not from the codec, so a form that drifts (a kernel
that maps e4m3 0x7F to 480, an e8m0 decoder without the 255 -> NaN rule) fails here.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from dsv41_jax.model import codec, quant
from dsv41_jax.pallas.common import triton_params

BYTES = np.arange(256, dtype=np.uint8)
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _want(dtype):
    return BYTES.view(dtype).astype(np.float32)


def _assert_same(got, want, what):
    """Bitwise on every non-NaN entry (so ±0 count), and NaN exactly where `want` is NaN."""
    got = np.asarray(got, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32), err_msg=what)


def test_nan_rule_is_the_dtypes():
    """The one NaN rule, spelled out: e4m3 0x7F/0xFF and e8m0 0xFF, nothing else."""
    assert np.flatnonzero(np.isnan(_want(ml_dtypes.float8_e4m3fn))).tolist() == [0x7F, 0xFF]
    assert np.flatnonzero(np.isnan(_want(ml_dtypes.float8_e8m0fnu))).tolist() == [0xFF]
    assert _want(ml_dtypes.float8_e8m0fnu)[0] == np.float32(2.0**-127)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jnp"])
def test_decoders_every_byte(xp):
    _assert_same(codec.e4m3_decode(xp.asarray(BYTES), xp), _want(ml_dtypes.float8_e4m3fn), "e4m3")
    _assert_same(codec.e8m0_decode(xp.asarray(BYTES), xp), _want(ml_dtypes.float8_e8m0fnu), "e8m0")
    _assert_same(codec.e2m1_decode(xp.asarray(BYTES[:16]), xp), E2M1_VALUES, "e2m1")
    widened = np.asarray(codec.e2m1_to_e4m3(xp.asarray(BYTES[:16]), xp), np.uint8)
    _assert_same(widened.view(ml_dtypes.float8_e4m3fn).astype(np.float32), E2M1_VALUES, "e2m1 -> e4m3")


def test_host_and_jnp_array_forms():
    """The numpy lookup tables (`*_np`) and quant's jitted jnp forms, on typed and uint8 inputs."""
    _assert_same(codec.e4m3_to_f32_np(BYTES.view(codec.FP8)), _want(ml_dtypes.float8_e4m3fn), "e4m3 np")
    _assert_same(codec.e8m0_to_f32_np(BYTES), _want(ml_dtypes.float8_e8m0fnu), "e8m0 np")
    _assert_same(quant.e8m0_to_f32(jnp.asarray(BYTES.view(codec.E8M0))), _want(ml_dtypes.float8_e8m0fnu), "e8m0 jnp")
    pairs = np.stack([E2M1_VALUES[BYTES & 15], E2M1_VALUES[BYTES >> 4]], -1).reshape(2, 256)
    _assert_same(codec.unpack_fp4_np(BYTES.reshape(2, 128)), pairs, "fp4 np")
    _assert_same(quant.unpack_fp4(jnp.asarray(BYTES.reshape(2, 128))), pairs, "fp4 jnp")
    with pytest.raises(TypeError, match="float8_e8m0fnu or uint8"):
        codec.e8m0_to_f32_np(np.zeros(3, np.float32))


def _decode_kernel(b_ref, e4m3_ref, e8m0_ref, e2m1_ref):
    b = b_ref[...].astype(jnp.int32)  # as the kernels load stored codes: raw bytes widened to int32
    e4m3_ref[...] = codec.e4m3_decode(b, jnp)
    e8m0_ref[...] = codec.e8m0_decode(b, jnp)
    e2m1_ref[...] = codec.e2m1_decode(b & 15, jnp)


def test_decoders_inside_a_pallas_kernel(pallas_impl):
    """The in-kernel form (what sparse_attention, indexer_topk and engram_gather call) on all bytes."""
    out = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    call = pl.pallas_call(_decode_kernel, out_shape=(out, out, out), compiler_params=triton_params(),
                          interpret=pallas_impl == "pallas_interpret")
    e4m3, e8m0, e2m1 = call(jnp.asarray(BYTES.reshape(16, 16)))
    _assert_same(np.asarray(e4m3).ravel(), _want(ml_dtypes.float8_e4m3fn), "e4m3 in-kernel")
    _assert_same(np.asarray(e8m0).ravel(), _want(ml_dtypes.float8_e8m0fnu), "e8m0 in-kernel")
    _assert_same(np.asarray(e2m1).ravel(), E2M1_VALUES[BYTES & 15], "e2m1 in-kernel")


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jnp"])
def test_encoders_invert_the_decoders(xp):
    """round_e4m3 is the identity on every finite e4m3 value; e2m1_encode / pack_nibbles invert
    e2m1_decode / unpack_nibbles on every byte; e8m0_encode_pow2 inverts e8m0_decode on bytes 0..254."""
    finite = _want(ml_dtypes.float8_e4m3fn)[~np.isnan(_want(ml_dtypes.float8_e4m3fn))]
    _assert_same(codec.round_e4m3(xp.asarray(finite), xp), finite, "round_e4m3 on the grid")
    codes = codec.e2m1_encode(codec.e2m1_decode(codec.unpack_nibbles(xp.asarray(BYTES), xp), xp), xp)
    np.testing.assert_array_equal(np.asarray(codec.pack_nibbles(codes, xp)), BYTES)
    scales = codec.e8m0_decode(xp.asarray(BYTES[:255]), xp)
    np.testing.assert_array_equal(np.asarray(codec.e8m0_encode_pow2(scales, xp)), BYTES[:255])


def test_weight_quantizers_round_trip_through_the_host_decoders():
    """quantize (numpy form) -> decode (host tables) reproduces an on-grid weight exactly."""
    rng = np.random.default_rng(0)
    v = E2M1_VALUES[rng.integers(0, 16, (4, 64))] * np.float32(2.0 ** -3)
    v[:, ::32] = 6 * 2.0 ** -3  # every group's amax is 6·2^-3, so its scale is 2^-3
    packed, scale = codec.mxfp4_codes(v, np)
    assert scale.dtype == codec.E8M0 and (scale.view(np.uint8) == 124).all()
    got = codec.unpack_fp4_np(packed) * np.repeat(codec.e8m0_to_f32_np(scale), 32, axis=-1)
    _assert_same(got, v, "mxfp4 round trip")
