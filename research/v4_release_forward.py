"""Our DeepSeek-V4 forward and MTP layer against the ``inference/model.py`` of a release copy, on CPU (issue 48).

The copy (see research/v4_release_check.py for where it came from and how it is brought into a scratch folder) is
third-party: its model.py is DeepSeek's with debug additions, and its kernel.py is a pure-torch re-implementation
of the release's TileLang kernels (kept as ``kernel_tilelang.py``). Two comparisons:

``--numerics release`` (default; the must-show "in the checkpoint's own numerics"): both sides simulate what the
release computes — fp8 128x128-block weights, MXFP4 routed experts, bf16 activations, fp8 activations per 128
along K into every fp8 / MXFP4 GEMM, fp8 KV entries (non-RoPE channels, blocks of 64), Hadamard + FP4 (blocks
of 32) index queries and keys. Ours: `ModelConfig` with `config_v4.RELEASE_NUMERICS` in the bf16 flow. Theirs:
model.py built as ``generate.py`` builds it (default dtype bf16, ``dtype="fp8"``, ``scale_fmt="ue8m0"``,
``expert_dtype="fp4"``), weights from our tree (wo_a dequantized to bf16 as the release's convert.py does), with
four of kernel.py's functions replaced by torch renderings of the TileLang originals, because the stand-ins do
not compute what the kernels compute:

* ``act_quant(..., inplace=True)`` / ``fp4_act_quant(..., inplace=True)``: kernel.py scales and clamps but never
  casts to fp8 / fp4 (an identity); the kernels cast (``T.Cast(FP8 / FP4, ...)``: round to nearest even) and
  take the scale as 2^ceil(log2(amax · (1/448))) from the bits (``fast_round_scale``).
* ``sparse_attn``: kernel.py normalizes fp32 probabilities; the kernel runs an online softmax over blocks of 64
  picks whose numerator multiplies bf16-rounded probabilities (``acc_s_cast``), the sink added to the fp32
  denominator only.
* ``hadamard_transform`` (``rotate_activation``): kernel.py's fallback is a bf16 matmul then a bf16 scale (two
  roundings); the release requires ``fast_hadamard_transform``, fp32 inside, one rounding.

The fp8 / fp4 GEMMs (fp32 dequantized matmuls, bf16 out) and the Sinkhorn split are kernel.py's (the kernels'
arithmetic up to the fp32 summation order).

``--order torch_cpu`` (default): ours with ``release_order="torch_cpu"`` (`model.v4.torch_order`: mHC's mixes,
hc_pre / hc_post / hc_head, every RMSNorm and RoPE in the order torch + MKL evaluate model.py on an AVX-512 CPU),
and the attention evaluated
exactly on both sides (ours `attention.attend` at the deterministic level; here ``sparse_attn_exact``, the same
arithmetic in fp64): fp32 ulps that cross a bf16 midpoint before an fp8 quantizer otherwise part the two sides
within a few positions. ``--order xla``: ours in our own order, the ``sparse_attn`` rendering above.

Per position the script records both sides' logits and every discrete decision — each CSA layer's index top-k
set per row and position, each MoE layer's routed-expert set — finds the first position where any decision
differs (its layer, the entries swapped and the release's score margin between them) and reports the largest
logits difference before it.

``--numerics plain``: both sides unquantized in fp32 (the copy's simulation calls replaced by identities: the
Hadamard rotation of both index q and k leaves their dot products unchanged), which checks the structure — every
mechanism and the MTP layer, which transformers does not build — against a second implementation.

    PYTHONPATH=$PWD:<venv with torch>/site-packages python research/v4_release_forward.py --ref /tmp/v4ref
    PYTHONPATH=$PWD:<venv with torch>/site-packages python research/v4_release_forward.py --ref /tmp/v4ref --numerics plain

Prints one JSON line per comparison; ``--out FILE`` also writes the per-position record (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


# ----------------------------------------------------------------------------------------------- the release side
def _pow2_ceil(torch, s):
    """2^ceil(log2 s) of positive normal fp32 `s` from the bits (the kernels' ``fast_log2_ceil`` / ``fast_pow2``)."""
    bits = s.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)


def _round_e2m1(torch, v):
    """fp32 (clamped to ±6) -> the nearest e2m1 value, ties to the even code (CUDA's round-to-nearest cast)."""
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)  # torch.round: half to even


def _tilelang_kernels(torch, K, order: str = "", win: int = 0):
    """Torch renderings of the TileLang kernels that kernel.py's stand-ins do not reproduce (module doc)."""
    f32 = torch.float32
    inv448, inv6 = torch.tensor(1 / 448.0, dtype=f32), torch.tensor(1 / 6.0, dtype=f32)

    def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=f32, inplace=False):
        xb = x.float().unflatten(-1, (-1, block_size))
        s = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4) * inv448
        if scale_fmt is not None:
            s = _pow2_ceil(torch, s)
        q = (xb / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        if inplace:
            x.copy_((q.float() * s).flatten(-2).to(x.dtype))
            return x
        s = s.squeeze(-1)
        return q.flatten(-2), (s.to(torch.float8_e8m0fnu) if scale_dtype == torch.float8_e8m0fnu else s)

    def fp4_act_quant(x, block_size=32, inplace=True):
        assert inplace
        xb = x.float().unflatten(-1, (-1, block_size))
        s = _pow2_ceil(torch, xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126) * inv6)
        x.copy_((_round_e2m1(torch, (xb / s).clamp(-6.0, 6.0)) * s).flatten(-2).to(x.dtype))
        return x

    def hadamard_transform(x, scale=1.0):
        d = x.size(-1)
        H = torch.ones(1, 1, dtype=f32)
        while H.size(0) < d:
            H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
        return (torch.matmul(x.float(), H) * scale).to(x.dtype)

    def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale, block=64):
        b, s, h, d = q.shape
        qf = q.float()
        m = torch.full((b, s, h), -float("inf"))
        den = torch.zeros(b, s, h)
        acc = torch.zeros(b, s, h, d)
        for t0 in range(0, topk_idxs.size(-1), block):
            idx = topk_idxs[..., t0:t0 + block].long()
            valid = idx != -1
            sel = torch.gather(kv.unsqueeze(1).expand(b, s, -1, d), 2,
                               idx.clamp_min(0).unsqueeze(-1).expand(*idx.shape, d)).float()
            sel = torch.where(valid.unsqueeze(-1), sel, 0.0)
            sc = torch.einsum("bshd,bskd->bshk", qf, sel) * softmax_scale
            sc = sc.masked_fill(~valid.unsqueeze(2), -float("inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            corr = torch.exp(m - m_new)
            p = torch.exp(sc - m_new.unsqueeze(-1))
            den = den * corr + p.sum(-1)
            acc = acc * corr.unsqueeze(-1) + torch.einsum("bshk,bskd->bshd", p.to(torch.bfloat16).float(), sel)
            m = m_new
        den = den + torch.exp(attn_sink.float().view(1, 1, h) - m)
        return (acc / den.unsqueeze(-1)).to(q.dtype)

    def sparse_attn_exact(q, kv, attn_sink, topk_idxs, softmax_scale):
        """The kernel's formula with every sum exact (fp64) and rounded once, exps correctly rounded, each fp32 step
        rounded: the window picks (the first ``win`` columns) and the compressed ones summed apart and added, the
        output num · fp32(1 / den) — our `attention.attend` at the deterministic level (``--order torch_cpu``)."""
        f64 = torch.float64
        r = lambda t: t.to(f32).to(f64)  # noqa: E731
        b, s, h, d = q.shape
        idx = topk_idxs.long()
        valid = idx != -1
        sel = torch.gather(kv.unsqueeze(1).expand(b, s, -1, d), 2,
                           idx.clamp_min(0).unsqueeze(-1).expand(*idx.shape, d)).to(f64)
        sel = torch.where(valid.unsqueeze(-1), sel, 0.0)
        sc = r(r(torch.einsum("bshd,bskd->bshk", q.to(f64), sel)) * r(torch.tensor(softmax_scale, dtype=f32)))
        sc = sc.masked_fill(~valid.unsqueeze(2), -float("inf"))
        m = sc.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        p = r(torch.exp(r(sc - m)))
        w = min(win, idx.size(-1))
        sink = r(torch.exp(r(attn_sink.to(f64).view(1, 1, h) - m[..., 0])))
        den = r(r(r(p[..., :w].sum(-1)) + r(p[..., w:].sum(-1))) + sink)
        pb = p.to(torch.bfloat16).to(f64)
        num = r(r(torch.einsum("bshk,bskd->bshd", pb[..., :w], sel[:, :, :w])) +
                r(torch.einsum("bshk,bskd->bshd", pb[..., w:], sel[:, :, w:])))
        return r(num * r(1.0 / den).unsqueeze(-1)).to(f32).to(q.dtype)

    K.hadamard_transform = hadamard_transform  # what rotate_activation imports when fast_hadamard_transform is absent
    return {"act_quant": act_quant, "fp4_act_quant": fp4_act_quant,
            "sparse_attn": sparse_attn_exact if order == "torch_cpu" else sparse_attn}


def _release(ref: str, numerics: str, order: str = "", win: int = 0):
    sys.path.insert(0, os.path.join(ref, "inference"))
    import torch
    import torch.nn.functional as F

    import kernel as K  # the copy's kernel.py
    import model as R  # the copy's inference/model.py (imports kernel.py)

    if numerics == "plain":
        def no_quant(*a, **k):  # in-place simulations become no-ops (only in-place calls are on the plain-weight path)
            return None

        R.act_quant = no_quant
        R.fp4_act_quant = no_quant
        R.rotate_activation = lambda x: x
    else:
        for name, fn in _tilelang_kernels(torch, K, order, win).items():
            setattr(R, name, fn)
    R.ParallelHead.get_logits = lambda self, x: F.linear(x.float(), self.weight)  # every position, not the last
    return torch, R


def _args(R, cfg, T, numerics: str):
    rs = cfg.rope_scaling
    yarn = rs.type == "yarn"
    fmt = (dict(dtype="bf16", scale_fmt=None, expert_dtype=None, scale_dtype="fp32") if numerics == "plain" else
           dict(dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", scale_dtype="fp8"))  # generate.py + config.json
    return R.ModelArgs(
        max_batch_size=2, max_seq_len=T, **fmt,
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, moe_inter_dim=cfg.moe_intermediate_size,
        n_layers=cfg.num_hidden_layers, n_hash_layers=len(cfg.hash_layer_ids), n_mtp_layers=1,
        n_heads=cfg.num_attention_heads, n_routed_experts=cfg.n_routed_experts, n_shared_experts=1,
        n_activated_experts=cfg.num_experts_per_tok, score_func="sqrtsoftplus", route_scale=cfg.routed_scaling_factor,
        swiglu_limit=cfg.swiglu_limit, q_lora_rank=cfg.q_lora_rank, head_dim=cfg.head_dim,
        rope_head_dim=cfg.qk_rope_head_dim, norm_eps=cfg.rms_norm_eps, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, window_size=cfg.sliding_window, compress_ratios=tuple(cfg.compress_ratios),
        compress_rope_theta=cfg.compress_rope_theta, original_seq_len=rs.original_max_position_embeddings if yarn else 0,
        rope_theta=cfg.rope_theta, rope_factor=rs.factor if yarn else 1.0, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps)


def _torch_tensor(torch, a):
    """numpy (incl. ml_dtypes bf16 / fp8 / e8m0) -> torch, bit for bit."""
    views = {"bfloat16": (np.int16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
             "float8_e8m0fnu": (np.uint8, torch.float8_e8m0fnu)}
    if a.dtype.name in views:
        raw, dt = views[a.dtype.name]
        return torch.from_numpy(np.ascontiguousarray(a).view(raw)).view(dt)
    return torch.from_numpy(np.ascontiguousarray(a))


def _load(torch, model, tensors, numerics: str):
    """Our release-named tensors into model.py's modules, in their dtypes (wo_a dequantized to bf16 as the release's
    convert.py does; MXFP4 bytes viewed as float4_e2m1fn_x2), then each quantized Linear's ``weight.scale`` re-linked.
    Returns the names model.py has and we did not give (buffers and the MTP's shared embed / head excluded)."""
    from dsv41_jax.model import codec

    want = model.state_dict()
    sd = {}
    for k, a in tensors.items():
        if k.endswith("wo_a.scale"):
            continue
        if k.endswith("wo_a.weight") and a.dtype.name == "float8_e4m3fn":
            s = tensors[k[:-len("weight")] + "scale"]
            w = codec.e4m3_to_f32_np(a) * np.repeat(np.repeat(codec.e8m0_to_f32_np(s), 128, 0), 128, 1)[
                :a.shape[0], :a.shape[1]]
            a = w.astype(np.float32)  # exact in bf16 (4 significant bits)
        t = _torch_tensor(torch, a)
        w = want.get(k)
        if w is not None and w.dtype == torch.float4_e2m1fn_x2:
            t = t.view(torch.float4_e2m1fn_x2)
        elif w is not None and t.dtype != w.dtype:
            t = t.to(w.dtype)
        sd[k] = t
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    for mod in model.modules():
        if getattr(mod, "scale", None) is not None and hasattr(mod, "weight"):
            mod.weight.scale = mod.scale
    missing = [m for m in missing if not m.endswith(("kv_cache", "kv_state", "score_state", "freqs_cis"))
               and not m.startswith(("mtp.0.embed.", "mtp.0.head."))]
    return missing, unexpected


def _record_decisions(torch, R, model):
    """Wrap each Indexer (prefill) and Gate to record their picks (and the index scores) per layer."""
    rec = {"topk": {}, "iscore": {}, "experts": {}, "escore": {}}
    for i, layer in enumerate(model.layers):
        ind = getattr(layer.attn, "indexer", None)
        if ind is not None:
            def fwd(x, qr, start_pos, offset, self=ind, i=i):
                assert start_pos == 0
                bsz, seqlen, _ = x.size()
                ratio, rd = self.compress_ratio, self.rope_head_dim
                if self.compressor.kv_cache is None:
                    self.compressor.kv_cache = self.kv_cache
                    self.compressor.freqs_cis = self.freqs_cis
                q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))
                R.apply_rotary_emb(q[..., -rd:], self.freqs_cis[:seqlen])
                q = R.rotate_activation(q)
                R.fp4_act_quant(q, R.fp4_block_size, True)
                self.compressor(x, start_pos)
                weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)
                score = torch.einsum("bshd,btd->bsht", q, self.kv_cache[:bsz, :seqlen // ratio])
                score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=2)
                mask = torch.arange(seqlen // ratio).repeat(seqlen, 1) >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio
                score = score + torch.where(mask, float("-inf"), 0)
                idx = score.topk(min(self.index_topk, seqlen // ratio), dim=-1)[1]
                idx = torch.where(idx >= torch.arange(1, seqlen + 1).unsqueeze(1) // ratio, -1, idx)
                rec["topk"][i], rec["iscore"][i] = idx.numpy(), score.float().numpy()
                return torch.where(idx < 0, -1, idx + offset)  # model.py's Indexer.forward, its scores kept
            ind.forward = fwd
        gate = layer.ffn.gate

        def gfwd(x, input_ids=None, self=gate, orig=gate.forward, i=i):
            w, idx = orig(x, input_ids)
            s = F_softplus(torch, R.linear(x.float(), self.weight.float()))
            rec["experts"][i] = idx.numpy()
            rec["escore"][i] = (s + self.bias if self.bias is not None else s).float().numpy()
            return w, idx
        gate.forward = gfwd
    return rec


def F_softplus(torch, z):
    return torch.nn.functional.softplus(z).sqrt()


# ----------------------------------------------------------------------------------------------- comparison
def _first_flip(ours, theirs, B, T):
    """The first position (over both rows) where a decision differs: {pos, row, layer, kind, ours, theirs} or None."""
    best = None
    for kind in ("topk", "experts"):
        for L, a in ours[kind].items():
            b = theirs[kind][L].reshape(a.shape[0], a.shape[1], -1)
            for r in range(B):
                for t in range(T):
                    sa = sorted(int(v) for v in a[r, t] if v >= 0)
                    sb = sorted(int(v) for v in b[r, t] if v >= 0)
                    if sa != sb:
                        if best is None or (t, r) < (best["pos"], best["row"]):
                            best = {"pos": t, "row": r, "layer": int(L), "kind": kind, "ours": sa, "theirs": sb}
                        break
    return best


def _margin(flip, rec):
    """The release's score gap between the entries the two sides disagree on (its own scores at that decision)."""
    sc = (rec["iscore"] if flip["kind"] == "topk" else rec["escore"])[flip["layer"]]
    sc = sc.reshape(-1, *sc.shape[-2:]) if flip["kind"] == "topk" else sc.reshape(2, -1, sc.shape[-1])
    row = sc[flip["row"], flip["pos"]]
    only_ours = sorted(set(flip["ours"]) - set(flip["theirs"]))
    only_theirs = sorted(set(flip["theirs"]) - set(flip["ours"]))
    return {"only_ours": only_ours, "only_theirs": only_theirs,
            "release_scores_only_ours": [float(row[j]) for j in only_ours],
            "release_scores_only_theirs": [float(row[j]) for j in only_theirs]}


def _config(numerics: str):
    from dsv41_jax.model import ModelConfig
    from dsv41_jax.model.config_v4 import RELEASE_NUMERICS

    base = ModelConfig.preset("tiny-v4")
    if numerics == "plain":  # plain fp32 weights, 16 index heads (4 give exact ties: docs/benchmarks.md)
        return base.replace(weight_block_size=(), expert_dtype="bf16", index_n_heads=16, act_dtype="float32")
    # tiny-v4's layout at widths the release's blocks cut (128-wide GEMM inputs, 64 non-RoPE KV channels, 128-wide
    # index heads as the release's); fp8 128x128 weights, MXFP4 experts, the bf16 flow
    return base.replace(hidden_size=128, q_lora_rank=128, head_dim=128, qk_rope_head_dim=64, o_lora_rank=128,
                        moe_intermediate_size=128, index_head_dim=128, index_n_heads=16, weight_block_size=(128, 128),
                        expert_dtype="fp4", act_dtype="bfloat16", **RELEASE_NUMERICS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="scratch folder holding the copy's inference/")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--numerics", choices=("release", "plain"), default="release")
    ap.add_argument("--order", choices=("torch_cpu", "xla"), default="torch_cpu",
                    help="release numerics: ours with release_order 'torch_cpu' (mHC, RoPE in torch's CPU order; "
                         "attention exact on both sides) or in our own XLA order (the kernels' renderings in torch's)")
    ap.add_argument("--deterministic", action="store_true", help="ours in the deterministic mode (fp64 sums)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the per-position record here (JSON)")
    args = ap.parse_args(argv)
    # our bf16 flow as written: XLA may otherwise keep fp32 between fused ops where the program rounds to bf16
    # (its default --xla_allow_excess_precision), which the release's eager torch never does
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
    import jax

    from dsv41_jax.model import forward, init_params
    from dsv41_jax.model.v4 import mtp
    from dsv41_jax.model.v4.checkpoint import file_tensors

    order = "" if args.numerics == "plain" or args.order == "xla" else "torch_cpu"
    cfg = _config(args.numerics).replace(deterministic=args.deterministic, release_order=order)
    torch, R = _release(args.ref, args.numerics, order, cfg.sliding_window)
    params = init_params(cfg, jax.random.key(args.seed))
    if args.numerics == "plain":
        params = jax.tree_util.tree_map(
            lambda a: a.astype(np.float32) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a, params)
    T = args.tokens
    tokens = np.random.default_rng(7 + args.seed).integers(0, cfg.vocab_size, (2, T + 1)).astype(np.int32)

    torch.set_default_dtype(torch.float32 if args.numerics == "plain" else torch.bfloat16)  # generate.py: bf16
    model = R.Transformer(_args(R, cfg, T, args.numerics))
    if args.numerics == "plain":
        model = model.float()
    missing, unexpected = _load(torch, model, file_tensors(params, cfg), args.numerics)
    if missing or unexpected:
        print(json.dumps({"error": "state dict mismatch", "missing": missing[:10], "unexpected": unexpected[:10]}))
        return 1
    rec = _record_decisions(torch, R, model)

    ids = torch.from_numpy(tokens[:, :T].astype(np.int64))
    with torch.inference_mode():
        h = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
        for layer in model.layers:
            h = layer(h, 0, ids)
        ref_logits = model.head(h, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.norm).float().numpy()
        ref_mtp = model.mtp[0](h, 0, torch.from_numpy(tokens[:, 1:].astype(np.int64))).float().numpy()

    # jitted as served (op-by-op dispatch rounds some fp32 chains differently: measured, one bf16 ulp in an mHC
    # collapse at position 4 that the fp8 quantizers after it turn into a visible difference)
    logits, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(params, tokens[:, :T], cfg, return_aux=True)
    ours_mtp = mtp.forward(params, aux["streams"], tokens[:, 1:], cfg)
    logits, ours_mtp = np.asarray(logits), np.asarray(ours_mtp)
    ours = {"topk": {int(k): np.asarray(v) for k, v in aux["topk"].items()},
            "experts": {int(k): np.asarray(v) for k, v in aux["experts"].items()}}
    theirs = {"topk": rec["topk"], "experts": rec["experts"]}
    flip = _first_flip(ours, theirs, 2, T)
    scale = float(np.abs(ref_logits).max())
    label = (f"tiny-v4 layout, {cfg.hidden_size} wide, release numerics (fp8 128x128 weights, MXFP4 experts, fp8 "
             f"acts / 128, fp8 KV / 64, Hadamard + FP4 index / 32, bf16 flow, order {order or 'xla'}"
             f"{', deterministic' if args.deterministic else ''})"
             if args.numerics == "release" else "tiny-v4 plain fp32, 16 index heads")
    per_pos = np.abs(logits - ref_logits).max(-1)  # [2, T]
    out = {"compare": "forward logits", "config": label, "rows": 2, "tokens": T, "seed": args.seed,
           "max_abs_diff": float(per_pos.max()), "logit_scale": scale,
           "argmax_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
           "decisions": {"csa_layers": sorted(ours["topk"]), "moe_layers": sorted(ours["experts"])}}
    if flip is None:
        out["first_flip"] = None
    else:
        out["first_flip"] = dict(flip, **_margin(flip, rec))
        out["max_abs_diff_before_flip"] = float(per_pos[:, :flip["pos"]].max()) if flip["pos"] else None
    print(json.dumps(out))
    d = np.abs(ours_mtp - ref_mtp)
    stop = T if flip is None else flip["pos"]
    print(json.dumps({"compare": "MTP logits", "config": label, "max_abs_diff": float(d.max()),
                      "max_abs_diff_before_flip": float(d[:, :stop].max()) if stop else None,
                      "argmax_agreement": float((ours_mtp.argmax(-1) == ref_mtp.argmax(-1)).mean())}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": out, "logits_diff_per_position": per_pos.tolist(),
                       "decisions": {k: {str(L): {"ours": ours[k][L].tolist(), "release": theirs[k][L].tolist()}
                                         for L in ours[k]} for k in ours}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
