"""The kernels of the decode step's fusions (o_proj, window_codes, moe_route, quant_linear's dual / gated /
normed+rope / combine variants, mHC's exit+enter with the norm) compiled offline for sm_90 at flash's decode
shapes (one token): registers, spill (stack) bytes and shared memory per kernel, as JSON lines. Needs Triton
(the CPU install's jax-triton brings it); no GPU.

    python research/triton_offline_fusions.py > docs/results/triton_offline_sm90_fusions.jsonl
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.model import ModelConfig, quant, moe
from dsv41_jax.model.rope import rope_freqs
from dsv41_jax.pallas.offline import capture_kernels, compile_ttir
from dsv41_jax.pallas import o_proj as op, window_codes as wc, moe_route as mr, quant_linear as ql, mhc_mix as mm
sds = jax.ShapeDtypeStruct
BF = jnp.bfloat16
c = ModelConfig.preset("flash")
fr = rope_freqs(c.qk_rope_head_dim, c.rope_theta)
def fp8w(n, k):
    return {"weight": sds((n, k), quant.FP8), "scale": sds((n // 32, k // 32), quant.E8M0)}
G, R, H, hd, I = c.o_groups, c.o_lora_rank, c.num_attention_heads, c.head_dim, c.o_group_in
parts = {"acc": sds((11, 1, 1, H, hd), jnp.float32), "m": sds((11, 1, 1, H), jnp.float32), "l": sds((11, 1, 1, H), jnp.float32)}
cases = {
 "o_proj_s11": (lambda o, w, p, s: op.kernel(o, w, p, fr, G, R, BF, sink=s), (parts, fp8w(G * R, I), sds((1, 1), jnp.int32), sds((H,), jnp.float32))),
 "window_codes": (lambda y, w, p: wc.kernel(y, w, p, fr, 1e-6, BF), (sds((1, hd), BF), sds((hd,), BF), sds((1,), jnp.int32))),
 "moe_route": (lambda lg, b: mr.kernel(lg, b, 6, c), (sds((1, 384), jnp.float32), sds((384,), jnp.float32))),
 "dual": (lambda x, a, b: ql.kernel_dual(x, a, b, "fp8", BF), (sds((1, 5120), BF), fp8w(1280, 5120), fp8w(512, 5120))),
 "gated": (lambda x, p: ql.kernel(x, p, "fp8", BF, p_up=p, act=lambda g, u: moe._swiglu_act(g, u, None, 10.0, BF)), (sds((1, 5120), BF), fp8w(2048, 5120))),
 "normed_rope": (lambda x, p, w, pos: ql.kernel(x, p, "fp8", BF, norm=(w, 1e-6), rope=(pos, fr, 512)), (sds((1, 1280), BF), fp8w(32768, 1280), sds((1280,), BF), sds((1,), jnp.int32))),
 "combine": (lambda x, p, ys, o: ql.kernel(x, p, "fp8", BF, combine=(ys, o, 6)), (sds((1, 2048), BF), fp8w(5120, 2048), sds((22, 5120), BF), sds((1, 8), jnp.int32))),
}
n, D = c.hc_mult, c.hidden_size
mix = (2 + n) * n
kw = dict(norm_eps=1e-6, hc_eps=1e-6, iters=20, dt=BF)
cases["mhc_exit_enter"] = (lambda y, h, po, co, pp, fn, b, s, w: mm.exit_enter(y, h, po, co, pp, fn, b, s, norm_weight=w, **kw),
    (sds((1, D), BF), sds((1, n, D), BF), sds((1, n), jnp.float32), sds((1, n, n), jnp.float32), sds((1, n), jnp.float32), sds((mix, n * D), jnp.float32), sds((mix,), jnp.float32), sds((3,), jnp.float32), sds((D,), BF)))
for name, (fn, args) in cases.items():
    for k in capture_kernels(fn, *args):
        t0 = time.time()
        try:
            res = compile_ttir(k["ttir"], num_warps=k["num_warps"], num_stages=k["num_stages"], arch=90)
        except Exception as e:
            res = {"error": repr(e)[:300]}
        print(json.dumps({"case": name, "kernel": k["name"], "num_warps": k["num_warps"], **res, "s": round(time.time() - t0, 1)}), flush=True)
