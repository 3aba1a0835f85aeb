"""tests/parting.py, the first-parting helper the kernel tests share: fp8 flips with their ties and margins, and the
walk to the first parting (numpy only)."""

import numpy as np

import parting

S = 2.0 ** -7  # the scale of a block whose amax is 3.5 (= 448 · 2^-7)
TIE = (0.025390625 + 0.02734375) / 2 * S  # between the e4m3 neighbours 13 · 2^-9 and 14 · 2^-9 (times S)


def _block(v):
    x = np.zeros((2, 32), np.float32)
    x[:, 0] = 3.5  # the blocks' amax: scale 2^-7
    x[1, 5] = v
    return x


def test_a_flip_at_a_tie_has_its_tie_and_margin():
    up, down = np.nextafter(np.float32(TIE), np.float32(1)), np.nextafter(np.float32(TIE), np.float32(0))
    (f,) = parting.fp8_flips(_block(down), _block(up))
    assert f.index == (1, 5) and f.codes == (0.02734375, 0.025390625) and f.tie == TIE
    assert f.margin == (float(up) - TIE) / 3.5 and 0 < f.margin < 1e-11
    assert "tie" in str(f) and parting.fp8_flips(_block(up), _block(up)) == []


def test_codes_that_are_not_neighbours_or_another_scale_have_no_tie():
    (f,) = parting.fp8_flips(_block(TIE - 3 * 2.0 ** -9 * S), _block(TIE + 2.0 ** -12 * S))
    assert f.tie is None and f.margin == np.inf
    big = _block(TIE)
    big[1, 0] = 3.6  # amax past 448 · 2^-7: scale 2^-6, the block's small codes change
    flips = parting.fp8_flips(big, _block(TIE))
    assert flips and all(f.tie is None and f.index[0] == 1 for f in flips)


def test_first_parting_walks_in_order_by_tolerance_then_codes():
    a = np.ones((3, 4), np.float32)
    b = a.copy()
    b[2, 1] += 1e-3
    steps = [("s0", [("x", a, a, 0.0, False)]), ("s1", [("y", a, b, 1e-4, False), ("z", a, a + 1, 1e-4, False)])]
    p = parting.first_parting(steps)
    assert (p.step, p.name, p.tokens, p.flips) == ("s1", "y", [2], [])
    assert parting.first_parting([("s", [("y", a, b, 2e-3, False)])]) is None  # within tol
    lo, hi = _block(np.float32(TIE) * (1 - 1e-6)), _block(np.float32(TIE) * (1 + 1e-6))
    p = parting.first_parting([("s", [("q", lo, hi, 1e-5, False)]), ("t", [("q", lo, hi, 1e-5, True)])])
    assert (p.step, p.name, p.tokens, len(p.flips)) == ("t", "q", [1], 1)


def test_bf16_results_may_part_only_at_a_rounding_tie():
    """bf16_tie_parts accepts two neighbouring bf16 results whose fp32 value sits on their midpoint (an FMA moved it
    across), and reports a difference away from any tie, one of two bf16 ulps, and any difference at all of results
    whose fp32 value is not near a midpoint."""
    lo = np.float32(1.0)
    hi = np.float32(1.0 + 2.0 ** -7)                    # the next bf16 above 1
    mid = np.float32(1.0 + 2.0 ** -8)                   # their midpoint, exact in fp32
    far = np.float32(1.0 + 2.0 ** -10)                  # a quarter of the way: rounds to lo whatever the FMA
    two = np.float32(1.0 + 2.0 ** -6)                   # two bf16 ulps above lo
    got = np.array([lo, lo, lo, 3.0], np.float32)
    want = np.array([hi, hi, two, 3.0], np.float32)
    unrounded = np.array([mid + np.spacing(mid), far, mid, 3.0], np.float32)
    assert parting.bf16_tie_parts(got, want, unrounded) == [(1,), (2,)]
    assert parting.bf16_tie_parts(got, got, unrounded) == []
    assert parting.bf16_tie_parts(got[:1], want[:1], unrounded[:1], slack_ulps=0) == [(0,)]


def test_first_position_parting_orders_by_position_then_layer():
    """The earliest position at which any layer parts, the lower layer on a tie, with each differing element's
    distance in bf16 ulps; None for equal runs."""
    want = {0: np.ones((4, 2, 3), np.float32), 1: np.ones((4, 2, 3), np.float32), 2: np.ones((4, 2, 3), np.float32)}
    got = {k: v.copy() for k, v in want.items()}
    assert parting.first_position_parting(got, want) is None
    got[2][1, 0, 2] = 1.0 + 2.0 ** -7     # one bf16 ulp, position 1, layer 2
    got[1][1, 1, 0] = 1.0 + 2.0 ** -5     # four ulps, position 1, layer 1: the same position, a lower layer
    got[0][3, 0, 0] = 0.5                 # a later position
    assert parting.first_position_parting(got, want) == (1, 1, [((1, 0), 4.0)])
    assert parting.bf16_ulps(np.float32(1.0 + 2.0 ** -7), np.float32(1.0)) == 1.0
