"""Where two runs of one computation (a fast path and its plain-jnp reference) first part, and whether that first
parting is an fp8 rounding-tie flip.

Two fp32 runs whose ops differ only in summation order agree to ~1e-7 relative until one of them crosses a rounding
boundary the other does not: an fp8 code of an activation (the model's activation quantization, `codec.
fp8_act_codes`: e4m3 codes of x / 2^e per block of 32, 2^e from the block's amax) lands on the other side of a tie
between two codes. One code then moves by a whole fp8 quantum, and everything downstream of it parts by far more
than the paths' summation-order difference. Such a parting is only the test's to accept when it is that event: one
code, of an element within a tiny margin of the tie (`Flip.margin`), with both runs within tolerance before it. A
kernel bug parts by more than the tolerance (no flip needed), or flips codes away from any tie, or many.

`first_parting` walks the two runs' recorded quantities in run order and returns the first that parts (beyond its
tolerance, or, for an fp8-quantized activation, by a code); `fp8_flips` lists the codes two activations differ in,
each with its tie and margin.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from dsv41_jax.model import codec

# Every finite e4m3 value, ascending: two codes are neighbours when no value lies strictly between them.
_E4M3 = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
_E4M3 = _E4M3[np.isfinite(_E4M3)]


@dataclasses.dataclass
class Flip:
    """One fp8 code two activations differ in. index: the element's index; want / got: its values in the two runs;
    codes: (want's, got's) on the scaled e4m3 grid (x / 2^e); tie: the boundary between them in x's units (None when
    the codes are not neighbours, or the block's scales differ); margin: |want − tie| / the block's amax (the
    reference's distance to the tie relative to what the block's scale is made from; inf without a tie)."""

    index: tuple
    want: float
    got: float
    codes: tuple
    tie: float | None
    margin: float

    def __str__(self):
        tie = "no tie (not neighbouring codes, or another scale)" if self.tie is None else \
            f"tie {self.tie:.9g}, reference {self.want - self.tie:+.3g} from it (margin {self.margin:.3g} of the " \
            f"block's amax), fast path {self.got - self.tie:+.3g}"
        return f"element {self.index}: reference {self.want!r}, fast path {self.got!r}, codes {self.codes}: {tie}"


def fp8_flips(got, want, block: int = 32) -> list:
    """The fp8 activation codes (`codec.fp8_act_codes`, blocks of `block` along the last axis) in which `got` and
    `want` [..., K] differ: a list of `Flip`, by index. A block whose scale exponent differs counts each of its
    differing codes, without a tie."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    yg, eg = codec.fp8_act_codes(got, np, block)
    yw, ew = codec.fp8_act_codes(want, np, block)
    yg, yw = yg.reshape(got.shape), yw.reshape(want.shape)
    same_scale = np.repeat(eg == ew, block, axis=-1)
    amax = np.repeat(np.abs(want.reshape(*want.shape[:-1], -1, block)).max(-1), block, axis=-1)
    out = []
    for idx in zip(*np.nonzero((yg != yw) | ~same_scale)):
        cw, cg = float(yw[idx]), float(yg[idx])
        lo, hi = min(cw, cg), max(cw, cg)
        tie = None
        if same_scale[idx] and cw != cg and not ((_E4M3 > lo) & (_E4M3 < hi)).any():
            tie = (lo + hi) / 2 * 2.0 ** float(ew[idx[:-1] + (idx[-1] // block,)])  # exact: a power-of-two scale
        margin = np.inf if tie is None else abs(float(want[idx]) - tie) / float(amax[idx])
        out.append(Flip(tuple(int(i) for i in idx), float(want[idx]), float(got[idx]), (cw, cg), tie, margin))
    return out


def parted_rows(got, want, tol) -> list:
    """The rows (leading axis) of `got` and `want` that differ somewhere by more than `tol` (absolute)."""
    d = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).reshape(len(got), -1).max(-1)
    return np.flatnonzero(d > tol).tolist()


@dataclasses.dataclass
class Parting:
    """Where two runs first part: the step's key, the quantity's name, the rows (tokens) that part; `flips` when the
    quantity is an fp8-quantized activation within tolerance whose codes differ (tokens: the flipped rows)."""

    step: object
    name: object
    tokens: list
    flips: list = dataclasses.field(default_factory=list)


def first_parting(steps, fp8_block: int = 32):
    """Walk two runs in run order and return the first `Parting`, or None if they never part.

    steps: iterable of (step key, quantities), the quantities in the order the step computes them, each
    (name, got [T, ...], want [T, ...], tol, fp8) over the step's T tokens: it parts where a row differs by more than
    tol (absolute); with fp8 (an activation the step fp8-quantizes per `fp8_block` along its last axis) it also parts,
    within tol, where its fp8 codes differ (`fp8_flips`)."""
    for key, quantities in steps:
        for name, got, want, tol, fp8 in quantities:
            rows = parted_rows(got, want, tol)
            if rows:
                return Parting(key, name, rows)
            if fp8:
                flips = fp8_flips(got, want, fp8_block)
                if flips:
                    return Parting(key, name, sorted({f.index[0] for f in flips}), flips)
    return None


def bf16_tie_parts(got, want, unrounded, slack_ulps: int = 1) -> list:
    """The elements where two bf16 results of one fp32 computation differ *other than* at a bf16 rounding tie.

    A compiler may contract a multiply-add into an FMA in one program and not in another (jax 0.12's XLA:CPU does so
    in some interpret-mode kernels at -O0); the fp32 sums then differ by an fp32 ulp or so, which moves the bf16
    result only where the sum lies on (or within `slack_ulps` fp32 ulps of) the midpoint between two bf16 values.
    got, want: the two bf16 results (any float array); unrounded: the computation's fp32 value before rounding
    (evaluated without contraction, e.g. in numpy). Returns the indices (tuples) where got != want and the two are
    not neighbouring bf16 values straddling a midpoint within the slack of `unrounded`: empty when the results are
    bitwise equal or part only at ties."""
    g = np.asarray(got, np.float32)
    w = np.asarray(want, np.float32)
    u = np.asarray(unrounded, np.float32)
    bad = []
    for idx in zip(*np.nonzero(g != w)):
        lo, hi = sorted((float(g[idx]), float(w[idx])))
        lo16 = np.asarray(lo, ml_dtypes.bfloat16)
        neighbours = float(np.nextafter(lo16, np.asarray(np.inf, ml_dtypes.bfloat16))) == hi
        mid = np.float32((lo + hi) / 2)  # exact: a bf16 midpoint has 9 significant bits
        ulp = np.spacing(np.abs(mid)).astype(np.float32)
        if not (neighbours and abs(float(u[idx]) - float(mid)) <= slack_ulps * float(ulp)):
            bad.append(tuple(int(i) for i in idx))
    return bad


def bf16_ulps(got, want):
    """|got − want| in bf16 ulps of `want`, elementwise (both bf16-valued; fp32 arrays): 1.0 for neighbours of the
    same binade, 0 where equal."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 2.0 ** -126))) - 7)
    return np.abs(g - w) / ulp


def first_position_parting(got, want):
    """Where two runs' recorded per-layer activations first part, position first: got / want {layer: [T, ...]} (one
    row's, e.g. a forward's aux "layer_inputs" row). Returns None if equal everywhere, else (t, layer, diffs): the
    first position t at which some layer differs, the first such layer, and its differing elements there as
    [(index within the position, bf16 ulps of want)]."""
    first = None
    for layer in sorted(want):
        g, w = np.asarray(got[layer], np.float32), np.asarray(want[layer], np.float32)
        rows = np.flatnonzero((g != w).reshape(len(w), -1).any(-1))
        if len(rows) and (first is None or rows[0] < first[0]):
            first = (int(rows[0]), layer)
    if first is None:
        return None
    t, layer = first
    g, w = np.asarray(got[layer], np.float32)[t], np.asarray(want[layer], np.float32)[t]
    u = bf16_ulps(g, w)
    return t, layer, [(tuple(int(i) for i in idx), float(u[idx])) for idx in zip(*np.nonzero(g != w))]
