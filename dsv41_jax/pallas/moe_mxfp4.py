"""Pallas kernel of the MoE seam: the grouped routed experts on their stored MXFP4 codes (docs/design/spec.md §6).

`kernel` takes the arguments of `moe.routed_slots` (plus ``interpret`` and tuning knobs) and returns
what it returns: the per-assignment outputs [N, k, D] (`ref_routed_slots` is that oracle, the "xla"
path). The (token, expert) assignments are sorted by expert exactly as the xla path sorts them
(`moe.sort_assignments`: groups = the distinct selected experts, at most min(N·k, E); for one token,
whose k experts are distinct, each assignment is its own group in slot order, with no sort), then two
``pallas_call``s run over (output tile, group):

1. **gate/up** (`_gate_up_kernel`, grid (I / block_n, G)): for the group's rows — the tokens'
   activations, gathered by token id and fp8-quantized (per 32, `common.fake_quant_fp8`) inside the kernel,
   one launch fewer than a quantized copy — g = x·w1ᵀ and u = x·w3ᵀ over
   K = D in chunks of block_k, each chunk of w1 / w3 read as packed e2m1 bytes + E8M0 scale bytes and
   decoded in registers (exact in bf16; the shared `model.codec` definitions); then the spec's expert
   activation: g, u rounded to `dt` and widened, u clamped to ±swiglu_limit, g ≤ swiglu_limit,
   a = silu(g)·u·routing weight → `dt`, and
   the fp8 activation quant of w2's input (per 32 along I) applied in the epilogue, so the
   intermediate written to HBM is already w2's operand (bf16: every fp8-quantized value is exact).
2. **down** (`_down_kernel`, grid (D / block_n2, G)): y = a·w2ᵀ over K = I, w2 decoded the same way,
   rounded to `dt`.

Each program holds one output tile of one expert and loops over the group's rows in blocks of
``block_m`` (a loop with a data-dependent trip count): at decode sizes (≤ block_m rows per expert) the
selected experts' weights and scales are read exactly once; at prefill once per block_m rows of the
group (the later reads mostly from L2). A group with no rows (an expert no token selected, or an
unused trailing group) skips its body (`pl.when`): it reads no weight and writes nothing, so
experts without tokens cost nothing but an empty program. The combine stays the xla path's
(`moe.unsort_slots`, `moe.combine_slots`: ascending expert id, left to right in fp32), so the kernel
and the xla path differ only inside each GEMM: fp32 summation order of exact products (bf16 operands,
fp32 accumulation — the products e4m3·2^k × e2m1·2^k are exact), below each GEMM's rounding to `dt`
(tests/test_pallas_moe.py states the tolerances). The exact / deterministic numerics modes (fp64
accumulation) have no kernel: the seam refuses them (`dispatch.refuse_kernel_in_f64_mode`).

Bytes moved (`costs.moe_bytes_moved`, declared to XLA as the ``pl.CostEstimate`` of each call with every group
non-empty): per non-empty group the expert's three packed weights + scales at stored width (w1, w3:
I·D/2 + I·D/32 bytes each; w2: D·I/2 + D·I/32), plus the activations (the N token rows in, the
bf16 intermediate out and in, the `dt` output), plus metadata. How many groups are non-empty depends on
the routing; `scripts/bench_decode.py --part b` evaluates the contract at the expected number of
distinct experts (the same expectation its ideal uses) and records the all-groups bound beside it.

Lowering: Pallas **Triton** (`common.triton_params`), like the other kernels here: the token rows are a
gather (``x_ref[toks, cols]``, one int-array indexer per load), which Triton lowers to a pointer
gather and Mosaic GPU cannot express on Hopper. No fp8 dtype reaches the kernel (E8M0 scales enter as
their uint8 bits); every in-kernel tensor has power-of-two sides (block sizes divide D and I:
``gcd`` with a power of two); rounding is integer arithmetic (the Triton lowering has no ``round``).
Interpret mode (``interpret=True``) runs the same bodies on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dsv41_jax.model import codec, dispatch, moe, weights
from dsv41_jax.model.numerics import is_exact
from dsv41_jax.pallas import common, costs

NAME = costs.MOE_NAME
_MIN_DOT = common.MIN_DOT


# ------------------------------------------------------------------------------------- reference


def ref_routed_slots(ex, xf, idx, w, cfg, dt, first_expert=0):
    """The oracle: the seam's "xla" grouped path (`moe.routed_slots`), [N, k, D]."""
    return moe.routed_slots(ex, xf, idx, w, cfg, dt, first_expert)


# ------------------------------------------------------------------------------- in-kernel numerics


def _decode_mxfp4(packed, scale):
    """MXFP4 codes -> values, exact: packed bytes as uint16 pairs [n, c/4] (little-endian: the low byte is
    the even byte; in each byte the low nibble is the even element), E8M0 bytes uint8 [n, c/32] -> fp32
    [n, c] (the shared `model.codec` definitions, in-kernel form)."""
    pairs = packed.astype(jnp.int32)
    n, m = pairs.shape
    by = jnp.stack([pairs & 0xFF, pairs >> 8], axis=-1).reshape(n, 2 * m)  # the bytes, in order
    codes = codec.unpack_nibbles(by, jnp)
    return codec.e2m1_decode(codes, jnp) * common.expand(codec.e8m0_decode(scale, jnp), 32)


# ------------------------------------------------------------------------------------------ kernels


def _group_rows(gstart_ref, gsize_ref, g, bm, body, one_token: bool = False):
    """Run body(r0, live) over the row blocks of group g (skipped when it has no rows): r0 the first
    sorted row of the block, live bool [bm] the rows that belong to the group. one_token: each group is
    one assignment in slot order (row g, at most one row; `kernel`'s one-token case: no gstart_ref);
    gsize_ref None there: every group has its row (the router's outputs, every expert held)."""
    if gsize_ref is None:
        body(g, lax.iota(jnp.int32, bm) < 1)
        return
    n = gsize_ref[g]

    @pl.when(n > 0)
    def _():
        if one_token:
            body(g, g + lax.iota(jnp.int32, bm) < g + n)
            return
        s0 = gstart_ref[g]

        def block(rb, carry):
            r0 = s0 + rb * bm
            body(r0, r0 + lax.iota(jnp.int32, bm) < s0 + n)
            return carry

        lax.fori_loop(0, lax.div(n + bm - 1, bm), block, 0)


def _meta_refs(refs, c):
    """(gexp, gstart or None, gsize or None, layer) refs and the rest: the one-token case has no group starts,
    and no group sizes either when every group has its one row (c["all_rows"])."""
    if c["one_token"] and c["all_rows"]:
        return (refs[0], None, None, refs[1]), refs[2:]
    if c["one_token"]:
        return (refs[0], None, refs[1], refs[2]), refs[3:]
    return tuple(refs[:4]), refs[4:]


def _gate_up_kernel(*refs, c):
    """Program (tile j of I, group g): act[rows, j-tile] = fq8(dt(silu(min(g, L))·clamp(u, ±L)·w)).

    refs: gexp, gstart, gsize, layer, tok, wts (the sorted rows' tokens and routing weights, padded), x,
    w1, s1, w3, s3, act; in the one-token case (c["one_token"]) gexp, gsize, layer, wts (the k slots'
    weights, unpadded), x, w1, s1, w3, s3, act: every row's token is token 0."""
    (gexp_ref, gstart_ref, gsize_ref, layer_ref), rest = _meta_refs(refs, c)
    if c["one_token"]:
        tok_ref, (wts_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, act_ref) = None, rest
    else:
        tok_ref, wts_ref, x_ref, w1_ref, s1_ref, w3_ref, s3_ref, act_ref = rest
    j, g = pl.program_id(0), pl.program_id(1)
    bm, bn, bk, dt, lim = c["bm"], c["bn"], c["bk"], c["dt"], c["limit"]
    row0 = (layer_ref[0] * c["E"] + gexp_ref[g]) * c["I"] + j * bn  # the tile's first weight row

    def weight(w_ref, s_ref, kc):
        return _decode_mxfp4(w_ref[pl.ds(row0, bn), pl.ds(kc * (bk // 4), bk // 4)],
                             s_ref[pl.ds(row0, bn), pl.ds(kc * (bk // 32), bk // 32)]).astype(jnp.bfloat16)

    def rows(r0, live):
        if c["one_token"]:
            toks = jnp.zeros((bm,), jnp.int32)
            wts = wts_ref[jnp.minimum(r0 + lax.iota(jnp.int32, bm), c["A"] - 1)]  # clamped: in bounds
        else:
            toks = tok_ref[pl.ds(r0, bm)]
            wts = wts_ref[pl.ds(r0, bm)]

        def kstep(kc, acc):
            # [bm, bk]: the rows' tokens, gathered, and fp8-quantized here per 32 (the spec's quant of the
            # GEMM input, bitwise `quant.fake_quant_fp8`; exact in bf16): no quantized copy of x is written
            xb = common.fake_quant_fp8(x_ref[toks, pl.ds(kc * bk, bk)].astype(jnp.float32)).astype(jnp.bfloat16)
            return acc[0] + common.dot_nt(xb, weight(w1_ref, s1_ref, kc)), acc[1] + common.dot_nt(xb, weight(w3_ref, s3_ref, kc))

        z = jnp.zeros((bm, bn), jnp.float32)
        gg, uu = lax.fori_loop(0, c["D"] // bk, kstep, (z, z))
        gg = jnp.minimum(gg.astype(dt).astype(jnp.float32), lim)  # GEMM outputs rounded to dt, widened
        uu = jnp.clip(uu.astype(dt).astype(jnp.float32), -lim, lim)
        a = (jax.nn.silu(gg) * uu * wts[:, None]).astype(dt).astype(jnp.float32)
        pltriton.store(act_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], common.fake_quant_fp8(a).astype(act_ref.dtype),
                       mask=live[:, None])

    _group_rows(gstart_ref, gsize_ref, g, bm, rows, c["one_token"])


def _down_kernel(*refs, c):
    """Program (tile j of D, group g): y[rows, j-tile] = dt(act[rows] · w2[e, j-tile]ᵀ).
    refs: the metadata refs as `_gate_up_kernel`'s (`_meta_refs`), then act, w2, s2, y."""
    (gexp_ref, gstart_ref, gsize_ref, layer_ref), (act_ref, w2_ref, s2_ref, y_ref) = _meta_refs(refs, c)
    j, g = pl.program_id(0), pl.program_id(1)
    bm, bn, bk = c["bm"], c["bn"], c["bk"]
    row0 = (layer_ref[0] * c["E"] + gexp_ref[g]) * c["D"] + j * bn

    def rows(r0, live):
        def kstep(kc, acc):
            w = _decode_mxfp4(w2_ref[pl.ds(row0, bn), pl.ds(kc * (bk // 4), bk // 4)],
                              s2_ref[pl.ds(row0, bn), pl.ds(kc * (bk // 32), bk // 32)]).astype(jnp.bfloat16)
            return acc + common.dot_nt(act_ref[pl.ds(r0, bm), pl.ds(kc * bk, bk)], w)

        acc = lax.fori_loop(0, c["I"] // bk, kstep, jnp.zeros((bm, bn), jnp.float32))
        pltriton.store(y_ref.at[pl.ds(r0, bm), pl.ds(j * bn, bn)], acc.astype(y_ref.dtype), mask=live[:, None])

    _group_rows(gstart_ref, gsize_ref, g, bm, rows, c["one_token"])


# The alternatives worth timing on a GPU (`scripts/bench_kernels.py --ops moe` times each at 1 and 64
# tokens; the first is the default tiling). On the H200 the default read 270 GB/s at 1 token and 626 at
# 64 (8 % / 18 % of a copy): each gate/up program streams a 64-row weight tile through 40 K chunks one at a
# time, so wider tiles, deeper K chunks and more pipeline stages are the candidates.
TUNING_CANDIDATES = (
    dict(block_n=64, block_n2=64, block_k=128, block_k2=128, num_warps=4, num_stages=2),  # the default
    dict(block_n=64, block_n2=64, block_k=128, block_k2=128, num_warps=4, num_stages=4),
    dict(block_n=64, block_n2=64, block_k=256, block_k2=256, num_warps=4, num_stages=3),
    dict(block_n=128, block_n2=128, block_k=128, block_k2=128, num_warps=8, num_stages=3),
    dict(block_n=128, block_n2=128, block_k=256, block_k2=256, num_warps=8, num_stages=3),
    dict(block_n=32, block_n2=32, block_k=256, block_k2=256, num_warps=4, num_stages=4),
)


# ------------------------------------------------------------------------------------------- entry


def _plan(A: int, G: int, D: int, I: int, block_m, block_n, block_n2, block_k, block_k2) -> dict:
    """Static block sizes. Defaults: block_m from the mean rows per group (16 at decode, up to 64);
    64-wide output tiles, 128-deep K chunks, each cut to the largest power of two dividing its dim."""
    if block_m is None:
        block_m = min(64, max(_MIN_DOT, common.next_pow2(-(-A // max(G, 1)))))
    p = dict(bm=block_m, bn=block_n or math.gcd(I, 64), bn2=block_n2 or math.gcd(D, 64),
             bk=block_k or math.gcd(D, 128), bk2=block_k2 or math.gcd(I, 128))
    for k, v, dim in (("block_m", p["bm"], None), ("block_n", p["bn"], I), ("block_n2", p["bn2"], D),
                      ("block_k", p["bk"], D), ("block_k2", p["bk2"], I)):
        lo = _MIN_DOT if k in ("block_m", "block_n2") else 32  # I tiles and K chunks hold whole 32-blocks
        if v < lo or v & (v - 1) or (dim is not None and dim % v):
            raise ValueError(f"moe_mxfp4: {k}={v} must be a power of two >= {lo}"
                             + (f" dividing {dim}" if dim is not None else ""))
    return p


def supports(cfg, mode: str = "auto") -> bool:
    """Whether `kernel` runs `cfg`: the fp32 numerics and expert dims its default tiles divide (`_plan`)."""
    if is_exact(cfg):
        return False
    try:
        _plan(1, 1, cfg.hidden_size, cfg.moe_intermediate_size, None, None, None, None, None)
    except ValueError:
        return False
    return True


def kernel(ex, xf, idx, w, cfg, dt, first_expert=0, *, interpret: bool = False, block_m: int | None = None,
           block_n: int | None = None, block_n2: int | None = None, block_k: int | None = None,
           block_k2: int | None = None, num_warps: int = 4, num_stages: int = 2, padded=None, raw: bool = False):
    """The grouped routed experts (arguments and result of `moe.routed_slots`): [N, k, D] in `dt`.

    ex: the layer's stacked experts {w1, w3, w2: `weights.Mxfp4` (uint8 [E, out, in/2], E8M0 [E, out, in/32])}
    (or a `weights.Stacked` of a layer run's stacks [n, E, ...] and the layer); xf [N, D] (bf16 | fp32);
    idx int32 [N, k] global expert ids; w fp32 [N, k] routing weights; first_expert: the global id of
    ex's expert 0. Knobs (static): block_m rows per block, block_n / block_n2 output tile of gate/up (I)
    / down (D), block_k / block_k2 K chunk of gate/up (D) / down (I), num_warps / num_stages (Triton).
    padded: (idx, w) as the router kernel returns them ([N, kp], `route`: idx / w are their first k lanes):
    with one token and every expert here, the kernel reads its groups' experts and weights from them as
    they are (no metadata to compute: one XLA launch fewer); raw (with padded): return the down output as the
    kernel wrote it, [A + block_m, D] in slot order (the rows past A unwritten), for a consumer kernel that
    reads the slots itself (a slice before it would be a copy).
    """
    if is_exact(cfg):
        raise NotImplementedError("moe_mxfp4 kernel: the exact / deterministic numerics modes accumulate in fp64, "
                                  "which this kernel does not; run the moe op with impl 'xla' or 'reference'")
    dt = jnp.dtype(dt)
    ex, layer = weights.split(ex)
    N, D = xf.shape
    k = idx.shape[1]
    A = N * k
    E, I = ex["w1"].weight.shape[-3], ex["w1"].weight.shape[-2]
    if A == 0:
        return jnp.zeros((N, k, D), dt)
    one = N == 1
    everything = isinstance(first_expert, int) and first_expert == 0 and E == cfg.n_routed_experts  # all held
    if one:
        # One token (decode at batch 1): its k experts are distinct (top-k), so each assignment is its own
        # group, in slot order (group g is row g, token 0): no sort, no unsort, no group starts or token
        # ids to make (about ten small launches per layer fewer), and every group computes what the sorted
        # group of its expert would, bit for bit.
        if everything and padded is not None:  # the router kernel's outputs as they are; every group has its row
            held, order = None, None
            gexp, sizes = padded[0].reshape(-1), None  # one row per group: no sizes (a broadcast launch fewer)
        else:
            local = idx.reshape(A).astype(jnp.int32) - first_expert
            held = (local >= 0) & (local < E)
            gexp, sizes, order = jnp.where(held, local, 0), held.astype(jnp.int32), None
    else:
        order, held, gexp, sizes = moe.sort_assignments(idx, E, first_expert)
    G = A if sizes is None else sizes.shape[0]  # (A with one token: gexp / wts may be longer, the router's lanes)
    if gexp is None:
        gexp = jnp.arange(G, dtype=jnp.int32)
    p = _plan(A, G, D, I, block_m, block_n, block_n2, block_k, block_k2)
    bm = p["bm"]
    a_pad = A + bm  # every row block of every group lies inside the padded rows
    wts = w.reshape(A).astype(jnp.float32) if not (one and held is None) else padded[1].reshape(-1)
    lay = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    if one:
        meta, rows_in = [gexp] + ([] if sizes is None else [sizes.astype(jnp.int32)]) + [lay], [wts]
    else:
        meta = [gexp, (jnp.cumsum(sizes) - sizes).astype(jnp.int32), sizes.astype(jnp.int32), lay]
        rows_in = [jnp.pad(order // k, (0, bm)), jnp.pad(jnp.take(wts, order), (0, bm))]
    wt = {n: (common.flat(ex[n].weight, pairs=True, kernel=NAME), common.flat(ex[n].scale, kernel=NAME))
          for n in ("w1", "w3", "w2")}
    c = dict(E=E, D=D, I=I, A=A, dt=dt, limit=float(cfg.swiglu_limit), one_token=one, all_rows=sizes is None)
    params = common.triton_params(num_warps=num_warps, num_stages=num_stages)
    common.log_choice(NAME, interpret, block_m=bm, block_n=p["bn"], block_n2=p["bn2"], block_k=p["bk"],
                      block_k2=p["bk2"], num_warps=num_warps)
    tag = f"m{bm}_n{p['bn']}_k{p['bk']}"

    def whole(a):
        return pl.BlockSpec(a.shape, lambda j, g, nd=a.ndim: (0,) * nd)

    def cost(part, out_itemsize, flops):
        return pl.CostEstimate(flops=int(flops), transcendentals=A * I if part == "gate_up" else 0,
                               bytes_accessed=int(costs.moe_bytes_moved(part, A=A, N=N, D=D, I=I, G=G,
                                                              out_itemsize=out_itemsize,
                                                              x_itemsize=xf.dtype.itemsize)))

    ins = meta + rows_in + [xf, *wt["w1"], *wt["w3"]]
    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, c=dict(c, bm=bm, bn=p["bn"], bk=p["bk"])),
        grid=(I // p["bn"], G), in_specs=[whole(a) for a in ins], out_specs=whole(jax.ShapeDtypeStruct((a_pad, I), dt)),
        out_shape=jax.ShapeDtypeStruct((a_pad, I), jnp.bfloat16), interpret=interpret, compiler_params=params,
        cost_estimate=cost("gate_up", 0, 4 * A * D * I), name=f"{NAME}_gate_up_{tag}")(*ins)
    ins = meta + [act, *wt["w2"]]
    y = pl.pallas_call(
        functools.partial(_down_kernel, c=dict(c, bm=bm, bn=p["bn2"], bk=p["bk2"])),
        grid=(D // p["bn2"], G), in_specs=[whole(a) for a in ins],
        out_specs=whole(jax.ShapeDtypeStruct((a_pad, D), dt)), out_shape=jax.ShapeDtypeStruct((a_pad, D), dt),
        interpret=interpret, compiler_params=params, cost_estimate=cost("down", dt.itemsize, 2 * A * D * I),
        name=f"{NAME}_down_m{bm}_n{p['bn2']}_k{p['bk2']}")(*ins)
    if raw:
        if held is not None:
            raise ValueError("moe_mxfp4: raw output is for one token with every expert here and the router's padded "
                             "outputs")
        return y
    if one:  # slot order already; a slot of an expert not held is never written: exact zeros
        if everything:
            return y[:A].reshape(N, k, D)  # every expert is here: every slot was written
        return jnp.where(held[:, None], y[:A], jnp.zeros((), y.dtype)).reshape(N, k, D)
    return moe.unsort_slots(y[:A], order, held, N, k)


dispatch.register("moe", "kernel", kernel=kernel, reference=moe.routed_slots, supports=supports)
