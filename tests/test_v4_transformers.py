"""DeepSeek-V4 configs against Hugging Face transformers' `DeepseekV4Config` (the `v4check` marker, outside the
default run; needs the `v4check` extra: torch + transformers >= 5.8). They fail, never skip, without it.

transformers reads the config.json our V4 presets write (`ModelConfig.to_hf_dict`) and the fixtures under
tests/data/v4/ into the same attention schedule, hash-routed layers, compression ratios, rope width, MTP
count and RoPE parameters as `ModelConfig.from_pretrained` does.
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
