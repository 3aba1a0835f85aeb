"""DeepSeek-V4 configs in ModelConfig (docs/design/v4.md, issue 48): reading transformers' and the release's
config.json, presets, round trips, V4.1 unchanged, and the refusal to run V4 before model/ implements it.

The fixtures under tests/data/v4/ were written by transformers 5.25's `DeepseekV4Config(...).save_pretrained`
(hf_csa_hca_hash: explicit layer_types / compress_rates / mlp_layer_types / YaRN rope_parameters;
hf_legacy_kwargs: built from the legacy kwargs compress_ratios=[0, 4, 128, 4], num_hash_layers=1,
qk_rope_head_dim=16) or by hand in the release's config.json spelling (release_style). Expected values are
literals read off those files, not computed by config_v4.py.
"""

import dataclasses
import json
import os

import pytest

from dsv41_jax.model import ConfigError, ModelConfig, RopeScaling

DATA = os.path.join(os.path.dirname(__file__), "data", "v4")


def v4_fields(cfg):
    return {k: getattr(cfg, k) for k in ("model_family", "compress_ratios", "csa_compress_ratio", "hca_compress_ratio",
                                         "hash_layer_ids", "mhc_variant", "q_head_norm", "weight_block_size",
                                         "expert_dtype", "draft_kind", "num_nextn_predict_layers")}


def test_transformers_saved_csa_hca_hash_config():
    cfg = ModelConfig.from_pretrained(os.path.join(DATA, "hf_csa_hca_hash"))
    assert v4_fields(cfg) == {
        "model_family": "deepseek_v4", "compress_ratios": (0, 0, 4, 8, 4, 8, 0), "csa_compress_ratio": 4,
        "hca_compress_ratio": 8, "hash_layer_ids": (0, 1), "mhc_variant": "pre_mix", "q_head_norm": True,
        "weight_block_size": (), "expert_dtype": "bf16", "draft_kind": "mtp", "num_nextn_predict_layers": 1}
    assert cfg.attention_kinds == ("sliding", "sliding", "csa", "hca", "csa", "hca")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (
        320, 64, 6, 4, 64)
    assert (cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (16, 32, 2, 32)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (4, 32, 4, 8)
    assert (cfg.rms_norm_eps, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps) == (1e-6, 4, 20, 1e-6)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert cfg.rope_scaling == RopeScaling(type="yarn", factor=16.0, beta_fast=32.0, beta_slow=1.0,
                                           original_max_position_embeddings=256)
    assert (cfg.kv_source_layer_ids, cfg.index_source_layer_ids, cfg.engram_layer_ids) == ((), (), ())
    assert cfg.candidate_source_layer_id is None and cfg.name == "hf_csa_hca_hash"


def test_transformers_saved_legacy_kwargs_config():
    cfg = ModelConfig.from_pretrained(os.path.join(DATA, "hf_legacy_kwargs"))
    assert cfg.attention_kinds == ("sliding", "csa", "hca", "csa")
    assert (cfg.compress_ratios, cfg.hash_layer_ids, cfg.num_nextn_predict_layers) == ((0, 4, 128, 4), (0,), 0)
    assert cfg.qk_rope_head_dim == 16
    assert cfg.rope_scaling.type == "default"  # compressed layers without YaRN


def test_release_style_config():
    cfg = ModelConfig.from_pretrained(os.path.join(DATA, "release_style"))
    assert v4_fields(cfg) == {
        "model_family": "deepseek_v4", "compress_ratios": (0, 0, 4, 128, 4, 0), "csa_compress_ratio": 4,
        "hca_compress_ratio": 128, "hash_layer_ids": (0, 1), "mhc_variant": "pre_mix", "q_head_norm": True,
        "weight_block_size": (128, 128), "expert_dtype": "fp4", "draft_kind": "mtp", "num_nextn_predict_layers": 1}
    assert cfg.rope_scaling == RopeScaling()  # yarn 16 / 32 / 1 / 65536, the release's values
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.topk_method) == (10000.0, 160000.0, "noaux_tc")


def test_flat_names_and_dspark_head(tmp_path):
    """The flat inference/config.json names map as for V4.1; dspark_* keys make the draft a DSpark head whose
    stages are the compress_ratios entries past the target layers."""
    d = json.load(open(os.path.join(DATA, "release_style", "config.json")))
    for hf, flat in (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_hash_layers", "n_hash_layers"),
                     ("sliding_window", "window_size"), ("scoring_func", "score_func")):
        d[flat] = d.pop(hf)
    # the release's four dspark_* keys (Flash-0731: num_nextn_predict_layers 1, the stages in compress_ratios)
    d.update(compress_ratios=[0, 0, 4, 128, 4, 0, 0, 0], dspark_block_size=3, dspark_target_layer_ids=[2, 3, 4],
             dspark_noise_token_id=7, dspark_markov_rank=16)
    p = tmp_path / "m" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(d))
    cfg = ModelConfig.from_pretrained(str(p.parent))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.hash_layer_ids, cfg.sliding_window) == (64, 5, (0, 1), 8)
    assert (cfg.draft_kind, cfg.num_nextn_predict_layers, cfg.dspark_target_layer_ids) == ("dspark", 3, (2, 3, 4))
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 0, 0, 0)
    # the stages route over the target's experts; a file saying otherwise is refused
    assert (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok) == (8, 2)
    p.write_text(json.dumps(dict(d, dspark_n_routed_experts=4)))
    with pytest.raises(ConfigError, match="dspark_n_routed_experts"):
        ModelConfig.from_pretrained(str(p.parent))


@pytest.mark.parametrize("src", ["tiny-v4", "flash-v4", "pro-v4", "hf_csa_hca_hash", "hf_legacy_kwargs",
                                 "release_style"])
def test_v4_round_trip(src):
    cfg = ModelConfig.from_pretrained(src if src.endswith(("-v4",)) else os.path.join(DATA, src))
    d = cfg.to_hf_dict()
    assert (d["model_type"], d["architectures"]) == ("deepseek_v4", ["DeepseekV4ForCausalLM"])
    back = ModelConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg


def test_v41_configs_carry_no_v4_fields():
    """V4.1's config.json is unchanged: no V4 field written, a V4 key in a V4.1 file is not read."""
    for name in ("flash", "tiny"):
        cfg = ModelConfig.preset(name)
        text = cfg.to_hf_dict()["text_config"]
        assert not {"model_family", "hash_layer_ids", "mhc_variant", "draft_kind", "weight_block_size"} & set(text)
        assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg
        assert cfg.attention_kinds == tuple("window" if r == 0 else "compressed"
                                            for r in cfg.compress_ratios[:cfg.num_hidden_layers])
    d = ModelConfig.preset("tiny").to_hf_dict()
    d["text_config"]["mhc_variant"] = "pre_mix"
    assert ModelConfig.from_dict(d).mhc_variant == "lagged"


def test_flash_v4_and_pro_v4_shapes():
    f = ModelConfig.preset("flash-v4")
    assert (f.vocab_size, f.hidden_size, f.num_hidden_layers, f.num_attention_heads, f.head_dim, f.qk_rope_head_dim) == (
        129280, 4096, 43, 64, 512, 64)
    assert (f.q_lora_rank, f.o_groups, f.o_lora_rank, f.n_routed_experts, f.num_experts_per_tok) == (1024, 8, 1024, 256, 6)
    assert (f.moe_intermediate_size, f.routed_scaling_factor, f.index_n_heads, f.index_topk) == (2048, 1.5, 64, 512)
    assert f.compress_ratios == (0, 0) + (4, 128) * 20 + (4, 0) and len(f.compress_ratios) == 44
    assert (f.hash_layer_ids, f.rms_norm_eps, f.weight_block_size, f.draft_kind) == ((0, 1, 2), 1e-6, (128, 128), "mtp")
    p = ModelConfig.preset("pro-v4")
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.q_lora_rank, p.o_groups) == (
        7168, 61, 128, 1536, 16)
    assert (p.n_routed_experts, p.moe_intermediate_size, p.routed_scaling_factor, p.index_topk) == (384, 3072, 2.5, 1024)
    assert p.attention_kinds[:5] == ("hca", "hca", "csa", "hca", "csa") and p.attention_kinds[-1] == "csa"
    assert p.compress_ratios[61:] == (0,)
    t = ModelConfig.preset("tiny-v4")
    assert t.attention_kinds == ("sliding", "sliding", "csa", "hca", "csa", "hca") and t.hash_layer_ids == (0, 1)
    assert t.n_routed_experts == 8 and t.num_experts_per_tok == 2 and t.num_nextn_predict_layers == 1


@pytest.mark.parametrize("name", ["tiny-v4", "flash-v4"])
def test_v4_is_refused_where_it_would_run(name):
    """V4 params are declared and sized (model.v4), but the V4.1 layer plan — which every cached / paged path
    asks first — raises, naming what is missing; V4 is never run as V4.1."""
    from dsv41_jax.model.params import param_shapes, param_stats

    cfg = ModelConfig.preset(name)
    assert len(param_shapes(cfg)["layers"]) == cfg.num_hidden_layers and param_stats(cfg)["bytes"] > 0
    with pytest.raises(NotImplementedError, match=r"paged decode step.*serving.model_step.V4Step"):
        cfg.layer_plans()


def _v4_file(**over):
    d = json.load(open(os.path.join(DATA, "hf_csa_hca_hash", "config.json")))
    d.update(over)
    return d


@pytest.mark.parametrize("over, field", [
    ({"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense"] * 6}, "mlp_layer_types"),
    ({"layer_types": None, "compress_ratios": [0, 0, 4, 16, 4, 8, 0]}, "compress_ratios"),
    ({"eos_token_id": [1, 2]}, "eos_token_id"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_bad_v4_config_names_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(_v4_file(**over))


def test_yarn_without_attention_factor_is_refused():
    """transformers derives YaRN's mscale when attention_factor is absent; V4 applies none: refuse, not guess."""
    d = _v4_file()
    del d["rope_parameters"]["compress"]["attention_factor"]
    with pytest.raises(ConfigError, match="attention_factor"):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("over, field", [
    ({"hash_layer_ids": (0,)}, "hash_layer_ids"), ({"mhc_variant": "pre_mix"}, "mhc_variant"),
    ({"q_head_norm": True}, "q_head_norm"), ({"model_family": "deepseek_v5"}, "model_family"),
])
def test_v4_variant_fields_refused_on_v41(over, field):
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(ModelConfig.preset("tiny"), **over)


def test_v4_validation():
    t = ModelConfig.preset("tiny-v4")
    with pytest.raises(ConfigError, match="compress_ratios"):
        t.replace(compress_ratios=(0, 0, 4, 16, 4, 8, 0))
    with pytest.raises(ConfigError, match="kv_source_layer_ids"):
        t.replace(kv_source_layer_ids=(2,))
    with pytest.raises(ConfigError, match="hash_layer_ids"):
        t.replace(hash_layer_ids=(1, 0))
    with pytest.raises(ConfigError, match="rope_scaling.type"):
        t.replace(rope_scaling=RopeScaling(type="linear"))


def test_legacy_rate_keys_and_default_schedule():
    """transformers' legacy top-level compress_rate_csa / compress_rate_hca fold into the ratios; with neither
    layer_types nor compress_ratios, transformers' default schedule (2 HCA, then HCA / CSA alternating)."""
    d = json.load(open(os.path.join(DATA, "release_style", "config.json")))
    d.update(compress_rate_hca=64, compress_ratios=[0, 0, 4, 64, 4, 0])
    cfg = ModelConfig.from_dict(d)
    assert (cfg.hca_compress_ratio, cfg.attention_kinds[3], cfg.compress_ratios) == (64, "hca", (0, 0, 4, 64, 4, 0))
    del d["compress_ratios"], d["compress_rate_hca"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.attention_kinds == ("hca", "hca", "hca", "csa", "hca")
