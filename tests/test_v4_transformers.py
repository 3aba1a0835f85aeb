"""DeepSeek-V4 configs against Hugging Face transformers' `DeepseekV4Config` (the `v4check` marker, outside the
default run; needs the `v4check` extra: torch + transformers >= 5.8). They fail, never skip, without it.

transformers reads the config.json our V4 presets write (`ModelConfig.to_hf_dict`) and the fixtures under
tests/data/v4/ into the same attention schedule, hash-routed layers, compression ratios, rope width, MTP
count and RoPE parameters as `ModelConfig.from_pretrained` does; and our forward (model/v4) equals its
`DeepseekV4ForCausalLM` on tiny random models it saves (`test_forward_matches_transformers`, recorded in
docs/benchmarks.md).
"""

import json
import os

import pytest

from dsv41_jax.model import ModelConfig

pytestmark = pytest.mark.v4check

DATA = os.path.join(os.path.dirname(__file__), "data", "v4")
HF_KIND = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def _theirs(directory):
    from transformers import DeepseekV4Config

    c = DeepseekV4Config.from_pretrained(directory)
    comp = c.rope_parameters["compress"]
    return {"kinds": tuple(HF_KIND[t] for t in c.layer_types),
            "hash": tuple(i for i, t in enumerate(c.mlp_layer_types) if t == "hash_moe"),
            "rates": (c.compress_rates["compressed_sparse_attention"], c.compress_rates["heavily_compressed_attention"]),
            "rd": c.qk_rope_head_dim, "mtp": c.num_nextn_predict_layers, "eps": c.rms_norm_eps,
            "rope": (c.rope_parameters["main"]["rope_theta"], comp["rope_theta"], comp["rope_type"]),
            "yarn": (comp.get("factor"), comp.get("original_max_position_embeddings"), comp.get("attention_factor"))}


def _ours(cfg):
    rs = cfg.rope_scaling
    return {"kinds": cfg.attention_kinds, "hash": cfg.hash_layer_ids,
            "rates": (cfg.csa_compress_ratio, cfg.hca_compress_ratio), "rd": cfg.qk_rope_head_dim,
            "mtp": cfg.num_nextn_predict_layers, "eps": cfg.rms_norm_eps,
            "rope": (cfg.rope_theta, cfg.compress_rope_theta, rs.type),
            "yarn": (rs.factor, rs.original_max_position_embeddings, 1.0) if rs.type == "yarn" else (None, None, None)}


@pytest.mark.parametrize("preset", ["tiny-v4", "flash-v4", "pro-v4"])
def test_transformers_reads_our_v4_config(preset, tmp_path):
    cfg = ModelConfig.preset(preset)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert _theirs(str(tmp_path)) == _ours(cfg)


@pytest.mark.parametrize("fixture", ["hf_csa_hca_hash", "hf_legacy_kwargs", "release_style"])
def test_transformers_and_we_read_the_fixtures_alike(fixture):
    d = os.path.join(DATA, fixture)
    assert _theirs(d) == _ours(ModelConfig.from_pretrained(d))


def test_default_schedule_matches(tmp_path):
    """A config.json with neither layer_types nor compress_ratios: both read transformers' default schedule."""
    d = json.load(open(os.path.join(DATA, "release_style", "config.json")))
    del d["compress_ratios"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert _theirs(str(tmp_path)) == _ours(ModelConfig.from_pretrained(str(tmp_path)))


# ------------------------------------------------------------------------------------------ the forward
# Our V4 forward against transformers' DeepseekV4ForCausalLM on tiny random configs it saves with
# save_pretrained: our loader reads that directory, and in the float32 mode (no quantization simulation, as
# transformers) the logits agree to 1e-4 and the discrete decisions (CSA top-k, experts) are identical.

# Both use 16 index heads: a score Σ_h w_h · ReLU(q_h · k) is exactly 0 when every head's q·k ≤ 0 (1/16 of the
# entries with tiny-v4's 4 heads), and such exact ties break differently (ours: the lower entry, as V4.1;
# torch.topk: not specified) — measured with 4 heads: a tied pick first at position 42 (tiny-v4) and 30 (alt).
FORWARD_CONFIGS = {
    # tiny-v4: 2 sliding, CSA (ratio 4) at 2 and 4, HCA (ratio 8) at 3 and 5, hash-routed 0-1, 8 experts top-2,
    # YaRN on the compressed layers
    "tiny-v4": {"index_n_heads": 16},
    # another schedule: CSA first, HCA ratio 16, 3 hash layers, 16 experts top-3, top-6 indexer, plain RoPE on the
    # compressed layers, 2 streams, window 12
    "tiny-v4-alt": {"compress_ratios": (4, 16, 4, 0, 16, 4, 0), "hca_compress_ratio": 16, "hash_layer_ids": (0, 1, 2),
                    "n_routed_experts": 16, "num_experts_per_tok": 3, "index_topk": 6, "hc_mult": 2, "index_n_heads": 16,
                    "sliding_window": 12, "rope_scaling": {"type": "default"}},
}
SEQ = (2, 80)  # 2 sequences of 80 tokens


def _randomize(model, seed):
    """transformers initializes sinks / ape / biases / hc bases to zeros, tid2eid to expert 0 and the linears at std
    0.02: give every tensor a random value of a useful size, and tid2eid k distinct experts per token."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name or leaf in ("scale", "hc_scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # sinks, position_bias (2-D, above), hc bases
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                V, k = b.shape
                E = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _theirs_forward(directory, tokens):
    """transformers' logits [B, T, V] and decisions: {"topk": {layer: [B, T, k] sorted, −1 first}, "experts":
    {layer: [B, T, k] sorted}} of the saved model."""
    import numpy as np
    import torch
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    got = {"topk": {}, "experts": {}}
    B, T = tokens.shape
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.register_forward_hook(lambda m, a, out, i=i: got["topk"].__setitem__(i, out.numpy()))
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out, i=i: got["experts"].__setitem__(i, out[2].reshape(B, T, -1).numpy()))
    with torch.no_grad():
        logits = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    return logits, {kind: {i: np.sort(v, axis=-1) for i, v in d.items()} for kind, d in got.items()}


def _first_difference(ours, theirs, T):
    """The first position where any decision differs (T: none) and where."""
    import numpy as np

    first, where = T, None
    for kind in ("topk", "experts"):
        assert sorted(ours[kind]) == sorted(theirs[kind]), kind
        for i in ours[kind]:
            a, b = np.sort(np.asarray(ours[kind][i]), axis=-1), theirs[kind][i]
            if a.shape[-1] != b.shape[-1]:
                return 0, (kind, i, "k", a.shape, b.shape)
            bad = np.nonzero(np.any(a != b, axis=(0, 2)))[0]
            if bad.size and bad[0] < first:
                first, where = int(bad[0]), (kind, i)
    return first, where


@pytest.mark.parametrize("name", sorted(FORWARD_CONFIGS))
def test_forward_matches_transformers(name, tmp_path):
    import jax
    import numpy as np
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dsv41_jax.model import RopeScaling, forward, load_params

    over = dict(FORWARD_CONFIGS[name])
    if "rope_scaling" in over:
        over["rope_scaling"] = RopeScaling(**over["rope_scaling"])
    ours = ModelConfig.preset("tiny-v4").replace(weight_block_size=(), expert_dtype="bf16", **over)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(ours.to_hf_dict()))
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config.from_pretrained(str(src))).float()
    _randomize(model, seed=1)
    out = tmp_path / "saved"
    model.save_pretrained(str(out))

    cfg = ModelConfig.from_pretrained(str(out)).replace(act_dtype="float32")
    assert (cfg.attention_kinds, cfg.hash_layer_ids, cfg.n_routed_experts) == (
        ours.attention_kinds, ours.hash_layer_ids, ours.n_routed_experts)
    params = load_params(str(out), cfg)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, SEQ).astype(np.int32)
    logits, aux = jax.jit(forward, static_argnames=("cfg", "return_aux"))(params, tokens, cfg, return_aux=True)
    ref_logits, ref = _theirs_forward(str(out), tokens)

    first, where = _first_difference({"topk": aux["topk"], "experts": aux["experts"]}, ref, SEQ[1])
    err = float(np.max(np.abs(np.asarray(logits)[:, :first] - ref_logits[:, :first])))
    print(f"{name}: max |logits - transformers| = {err:.2e} over positions < {first}; first decision difference: "
          f"{where or 'none'}; logits scale {float(np.abs(ref_logits).max()):.2f}")
    assert first >= 32, f"a decision differs at position {first}: {where}"
    assert err <= 1e-4
