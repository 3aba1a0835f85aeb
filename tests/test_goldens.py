"""`tests/goldens.py`: bit for bit on the recording machine, decisions exact and floats within a few
ulp elsewhere, and it fails on anything more."""

import numpy as np
import pytest

import goldens


def _golden(tmp_path, cpu=None):
    arrays = {"topk": np.array([[0, 3, -1]], np.int32), "logits": np.array([1.5, -0.25], np.float32)}
    p = tmp_path / "g.npz"
    if cpu is None:
        goldens.save(p, **arrays)
    else:
        np.savez_compressed(p, cpu=np.asarray(cpu), **arrays)
    return p, arrays


def test_same_machine_is_bit_for_bit(tmp_path):
    p, a = _golden(tmp_path)
    assert goldens.load(p)[1] == goldens.machine()
    goldens.assert_matches(a, p)
    nudged = dict(a, logits=np.nextafter(a["logits"], np.float32(9)))
    with pytest.raises(AssertionError):
        goldens.assert_matches(nudged, p)


def test_other_machine_allows_ulps_not_more(tmp_path):
    p, a = _golden(tmp_path, cpu="another CPU | jaxlib 0")
    goldens.assert_matches(dict(a, logits=a["logits"] + np.float32(4.8e-7)), p)
    with pytest.raises(AssertionError, match="above"):
        goldens.assert_matches(dict(a, logits=a["logits"] + np.float32(1e-4)), p)
    with pytest.raises(AssertionError):  # a decision differs: never tolerated
        goldens.assert_matches(dict(a, topk=np.array([[0, 2, -1]], np.int32)), p)
    with pytest.raises(AssertionError):
        goldens.assert_matches({"logits": a["logits"]}, p)
