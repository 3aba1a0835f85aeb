"""Our DeepSeek-V4 forward and MTP layer against the ``inference/model.py`` of a release copy, on CPU (issue 48).

The copy (see research/v4_release_check.py for where it came from and how it is brought into a scratch folder) is
third-party: its model.py is DeepSeek's with debug additions, and its kernel.py is a pure-torch re-implementation
of the release's TileLang kernels (``act_quant``, ``fp4_act_quant``, ``sparse_attn``, ``hc_split_sinkhorn``, ...).
So this is *not* the must-show "in the checkpoint's own numerics": the release simulates fp8 activations, fp8 KV
(non-RoPE channels, blocks of 64) and FP4 + Hadamard index keys / queries, none of which our V4 path simulates.
It runs both sides unquantized in fp32 instead (the simulation calls replaced by identities: the Hadamard rotation
of both index q and k leaves their dot products unchanged), which checks the structure — every mechanism and the
MTP layer, which transformers does not build — against a second implementation.

    python research/v4_release_forward.py --ref /tmp/v4ref     # needs torch (CPU) beside our package

Prints one JSON line per comparison (max |Δ logits| over every position, both rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def _release(ref: str):
    sys.path.insert(0, os.path.join(ref, "inference"))
    import torch
    import torch.nn.functional as F

    import model as R  # the copy's inference/model.py (imports its kernel.py)

    def no_quant(*a, **k):  # in-place simulations become no-ops (only in-place calls are on the plain-weight path)
        return None

    R.act_quant = no_quant
    R.fp4_act_quant = no_quant
    R.rotate_activation = lambda x: x
    R.ParallelHead.get_logits = lambda self, x: F.linear(x.float(), self.weight)  # every position, not the last
    return torch, R


def _args(R, cfg, T):
    rs = cfg.rope_scaling
    yarn = rs.type == "yarn"
    return R.ModelArgs(
        max_batch_size=2, max_seq_len=T, dtype="bf16", scale_fmt=None, expert_dtype=None, scale_dtype="fp32",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="scratch folder holding the copy's inference/")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import jax

    from dsv41_jax.model import ModelConfig, forward, init_params
    from dsv41_jax.model.v4 import mtp
    from dsv41_jax.model.v4.checkpoint import file_tensors

    torch, R = _release(args.ref)
    torch.set_default_dtype(torch.float32)
    # tiny-v4 with plain weights, 16 index heads (4 give exact ties: docs/benchmarks.md), fp32 arithmetic
    cfg = ModelConfig.preset("tiny-v4").replace(weight_block_size=(), expert_dtype="bf16", index_n_heads=16,
                                                act_dtype="float32")
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree_util.tree_map(lambda a: a.astype(np.float32) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
                                    else a, params)
    T = args.tokens
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (2, T + 1)).astype(np.int32)

    model = R.Transformer(_args(R, cfg, T)).float()
    sd = {k: torch.from_numpy(np.array(v)) for k, v in file_tensors(params, cfg).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith(("kv_cache", "kv_state", "score_state", "freqs_cis"))
               and not m.startswith(("mtp.0.embed.", "mtp.0.head."))]  # the MTP's shared embed / head modules
    if missing or unexpected:
        print(json.dumps({"error": "state dict mismatch", "missing": missing[:10], "unexpected": unexpected[:10]}))
        return 1

    ids = torch.from_numpy(tokens[:, :T].astype(np.int64))
    with torch.inference_mode():
        h = model.embed(ids).unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)
        for layer in model.layers:
            h = layer(h, 0, ids)
        ref_logits = model.head(h, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.norm).numpy()
        ref_mtp = model.mtp[0](h, 0, torch.from_numpy(tokens[:, 1:].astype(np.int64))).numpy()

    logits, aux = forward(params, tokens[:, :T], cfg, return_aux=True)
    ours_mtp = mtp.forward(params, aux["streams"], tokens[:, 1:], cfg)
    scale = float(np.abs(ref_logits).max())
    for what, a, b in (("forward logits", logits, ref_logits), ("MTP logits", ours_mtp, ref_mtp)):
        d = np.abs(np.asarray(a) - b)
        first = [int(np.argmax(d[r].max(-1) > 1e-3)) if (d[r] > 1e-3).any() else None for r in range(2)]
        same_argmax = float((np.asarray(a).argmax(-1) == b.argmax(-1)).mean())
        print(json.dumps({"compare": what, "config": "tiny-v4 plain fp32, 16 index heads", "rows": 2, "tokens": T,
                          "max_abs_diff": float(d.max()), "logit_scale": scale,
                          "first_position_over_1e-3": first, "argmax_agreement": same_argmax}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
