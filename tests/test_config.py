"""ModelConfig (docs/design/spec.md §1): presets, HF / legacy / flat config.json loading, validation, layer plans.

Expected values are written out here from docs/design/spec.md §1/§3/§4 (flash) or as literals (tiny and the
custom configs), never read from config.py's own tables.
"""

import dataclasses
import json
import math
import os

import pytest

from dsv41_jax.model import ConfigError, ModelConfig, RopeScaling
from dsv41_jax.model.config_v4 import V4_ONLY_FIELDS


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def primes_rule_rows(layer_ids, max_ngram, n_heads, vocab):
    """docs/design/spec.md §5 table sizes, written independently: per layer, per order 2..max_ngram, per head the
    next prime above `current` never used anywhere; `current` restarts at vocab - 1 per (layer, order)."""
    used, rows = set(), []
    for _ in layer_ids:
        total = 0
        for _order in range(2, max_ngram + 1):
            cur = vocab - 1
            for _h in range(n_heads):
                p = cur + 1
                while not _is_prime(p) or p in used:
                    p += 1
                used.add(p)
                cur = p
                total += p
        rows.append(total)
    return rows


def fields_of(cfg):
    """All fields except our runtime `name` (from_pretrained names configs after their directory)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "name"}


def assert_same_config(got, want):
    g, w = fields_of(got), fields_of(want)
    diff = {k: (g[k], w[k]) for k in w if g[k] != w[k]}
    assert not diff, f"fields differ (got, want): {diff}"


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return path


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def flash():
    return ModelConfig.preset("flash")


# ------------------------------------------------------------------------------------------------
# flash preset = docs/design/spec.md §1
# ------------------------------------------------------------------------------------------------


def test_flash_preset_matches_spec(flash):
    c = flash
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (129280, 5120, 40)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.qk_rope_head_dim) == (64, 1, 512, 64)
    assert c.q_lora_rank == 1280 and c.o_groups == 8 and c.o_lora_rank == 1024
    assert c.hidden_act == "silu" and c.swiglu_limit == 10.0
    assert c.rms_norm_eps == 1e-20
    assert c.tie_word_embeddings is False
    # RoPE
    assert c.rope_theta == 10000 and c.compress_rope_theta == 160000
    rs = c.rope_scaling
    assert (rs.type, rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_position_embeddings) == \
        ("yarn", 16, 32, 1, 65536)
    assert c.max_position_embeddings == 1_048_576
    # MoE
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size) == \
        (384, 6, 1, 2304)
    assert c.scoring_func == "sqrtsoftplus" and c.topk_method == "noaux_tc"
    assert c.norm_topk_prob is True and c.routed_scaling_factor == 1.5 and c.gate_temp == 1.0
    # attention layout: 0-1 -> 0, 2-19 -> 2, 20-39 -> 1, 40-42 (DSpark) -> 0
    assert c.sliding_window == 128
    assert len(c.compress_ratios) == 43
    for i, r in enumerate(c.compress_ratios):
        want = 0 if i <= 1 else 2 if i <= 19 else 1 if i <= 39 else 0
        assert r == want, f"compress_ratios[{i}] = {r}, SPEC says {want}"
    assert tuple(c.kv_source_layer_ids) == (2, 8, 14, 20)
    assert tuple(c.index_source_layer_ids) == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    # mHC
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    # Engram
    assert tuple(c.engram_layer_ids) == (1, 14)
    assert tuple(c.engram_num_embeddings) == (384006168, 384016682)
    assert (c.engram_max_ngram_size, c.engram_vocab_size, c.engram_n_heads, c.engram_head_dim) == \
        (4, 16_000_000, 8, 256)
    assert c.engram_pad_token_id == 2 and c.engram_compressed_vocab_size == 99092
    # DSpark
    assert (c.num_nextn_predict_layers, c.dspark_block_size, c.dspark_noise_token_id) == (3, 5, 128799)
    assert tuple(c.dspark_target_layer_ids) == (37, 38, 39)
    assert (c.dspark_markov_rank, c.dspark_n_routed_experts, c.dspark_num_experts_per_tok) == (256, 128, 3)
    # derived widths
    assert c.o_group_in == 64 * 512 // 8 == 4096
    assert c.hc_mix_dim == (2 + 4) * 4 == 24
    assert c.hc_mult * c.hidden_size == 20480
    assert c.engram_in_dim == 3 * 8 * 256 == 6144
    assert c.num_layers_total == 43


def test_flash_engram_rows_follow_primes_rule(flash):
    """SPEC's engram_num_embeddings for flash are exactly the primes rule (independent prime search)."""
    assert primes_rule_rows((1, 14), 4, 8, 16_000_000) == [384006168, 384016682]
    assert list(flash.engram_num_embeddings) == [384006168, 384016682]


def test_flash_layer_plan_matches_spec(flash):
    P = [flash.layer_plan(i) for i in range(43)]
    assert len(flash.layer_plans()) == 43
    for i in range(43):
        p = P[i]
        assert p.layer_id == i
        assert p.is_dspark == (i >= 40)
        assert p.is_engram == (i in (1, 14))
        assert p.yarn == (2 <= i <= 39)  # ratio > 0 uses compress_rope_theta with YaRN
        assert p.is_kv_source == (i in (2, 8, 14, 20))
        assert p.is_index_source == (i in (2, 8, 14, 20, 24, 28, 32, 36))
        assert p.is_candidate_source == (i == 20)
        if i < 2 or i >= 40:
            assert p.compress_ratio == 0 and p.kv_source is None and p.index_source is None
            assert not p.uses_candidates and p.key_owner is None
            continue
        # docs/design/spec.md §3: 3-7 read layer 2's store, 9-13 read 8's, 15-19 read 14's, 21-39 read 20's
        assert p.kv_source == (2 if i < 8 else 8 if i < 14 else 14 if i < 20 else 20)
        # docs/design/spec.md §4: latest index source at or before the layer (3-7 use 2's, 21-23 use 20's, 25-27 24's)
        assert p.index_source == max(s for s in (2, 8, 14, 20, 24, 28, 32, 36) if s <= i)
        if p.is_index_source:
            # keys only at KV sources; 24, 28, 32, 36 re-score layer 20's keys inside candidate blocks
            assert p.key_owner == (i if i in (2, 8, 14, 20) else 20)
            assert p.uses_candidates == (i > 20)
        else:
            assert p.key_owner is None and not p.uses_candidates
    assert flash.key_owner_ids == (2, 8, 14, 20)


# ------------------------------------------------------------------------------------------------
# tiny preset: every mechanism of docs/design/spec.md §1's list
# ------------------------------------------------------------------------------------------------


def test_tiny_exercises_every_mechanism(tiny):
    c = tiny
    L, S = c.num_hidden_layers, c.num_nextn_predict_layers
    plans = [c.layer_plan(i) for i in range(L + S)]
    target = plans[:L]
    # >= 2 window-only layers
    assert sum(p.compress_ratio == 0 for p in target) >= 2
    # Engram before the first KV source and one later
    first_src = min(p.layer_id for p in target if p.is_kv_source)
    eng = [p.layer_id for p in target if p.is_engram]
    assert any(e < first_src for e in eng) and any(e > first_src for e in eng)
    assert tuple(eng) == tuple(c.engram_layer_ids)
    # ratio-2 KV sources, each with a consumer layer after it that reads its store
    r2 = [p.layer_id for p in target if p.is_kv_source and p.compress_ratio == 2]
    assert r2
    for s in r2:
        assert any(p.layer_id > s and not p.is_kv_source and p.kv_source == s for p in target), s
    # a ratio-1 KV source that is the candidate source
    cand = [p for p in target if p.is_candidate_source]
    assert len(cand) == 1 and cand[0].is_kv_source and cand[0].compress_ratio == 1
    assert cand[0].layer_id == c.candidate_source_layer_id
    # index sources owning keys, and index sources re-scoring the candidate source's keys
    owners = [p for p in target if p.is_index_source and p.key_owner == p.layer_id]
    assert owners and all(p.is_kv_source for p in owners)
    rescore = [p for p in target if p.is_index_source and p.key_owner != p.layer_id]
    assert rescore
    for p in rescore:
        assert not p.is_kv_source and p.key_owner == c.candidate_source_layer_id and p.uses_candidates
        assert p.layer_id > c.candidate_source_layer_id
    # only index sources after the candidate source mask to candidates
    for p in target:
        assert p.uses_candidates == (p.is_index_source and p.layer_id > c.candidate_source_layer_id), p
    # consumers reusing a top-k computed by an earlier index source
    assert any(p.compress_ratio > 0 and not p.is_index_source and p.index_source < p.layer_id for p in target)
    # small window, index top-k and candidate set (selection must really drop positions)
    assert c.sliding_window < 32
    assert c.index_topk <= 8
    assert c.candidate_topk_blocks * c.candidate_block_size <= 8
    # several experts, top-k > 1 (target and DSpark)
    assert c.n_routed_experts > c.num_experts_per_tok > 1
    assert c.dspark_n_routed_experts > c.dspark_num_experts_per_tok > 1
    # all 3 DSpark stages, window only, targets are target layers
    assert S == 3
    assert all(p.is_dspark and p.compress_ratio == 0 and not p.is_engram for p in plans[L:])
    assert all(0 <= t < L for t in c.dspark_target_layer_ids)
    # engram sizes obey the primes rule
    assert list(c.engram_num_embeddings) == primes_rule_rows(
        c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)


def test_tiny_literal_values(tiny):
    """Pin the tiny layout (tests elsewhere are written against it)."""
    assert tuple(tiny.compress_ratios) == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)
    assert tuple(tiny.kv_source_layer_ids) == (2, 4, 6)
    assert tuple(tiny.index_source_layer_ids) == (2, 4, 6, 8)
    assert tiny.candidate_source_layer_id == 6
    assert tuple(tiny.engram_layer_ids) == (1, 4)
    # primes above 49: layer 1: (53, 59) + (61, 67) + (71, 73) = 384; layer 4: (79, 83) + (89, 97) + (101, 103)
    assert tuple(tiny.engram_num_embeddings) == (384, 552)


def test_preset_unknown_name():
    with pytest.raises(ConfigError):
        ModelConfig.preset("huge")


# ------------------------------------------------------------------------------------------------
# loading config.json files
# ------------------------------------------------------------------------------------------------

# A custom config (tiny layout) in which every field also differs from the flash defaults where it
# can, so a field that is not read (falling back to the default) shows up as a difference.
CUSTOM_TEXT = {
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 10, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32,
    "o_groups": 2, "o_lora_rank": 32, "hidden_act": "silu", "swiglu_limit": 7.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "bos_token_id": 3, "eos_token_id": 4,
    "rope_theta": 5000.0, "compress_rope_theta": 80000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                     "original_max_position_embeddings": 1024},
    "max_position_embeddings": 4096,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": False,
    "routed_scaling_factor": 2.5, "gate_temp": 0.5,
    "sliding_window": 8, "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 4, 6], "index_source_layer_ids": [2, 4, 6, 8],
    "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3, "candidate_block_size": 2,
    "hc_mult": 2, "hc_sinkhorn_iters": 10, "hc_eps": 1e-5,
    "engram_layer_ids": [1, 4], "engram_num_embeddings": [384, 552], "engram_max_ngram_size": 4,
    "engram_vocab_size": 50, "engram_n_heads": 2, "engram_head_dim": 32, "engram_pad_token_id": 5,
    "engram_compressed_vocab_size": 262,
    "num_nextn_predict_layers": 3, "dspark_block_size": 3, "dspark_noise_token_id": 313,
    "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 16, "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


@pytest.fixture(scope="module")
def custom_expected(tiny):
    return tiny.replace(
        swiglu_limit=7.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=3, eos_token_id=4,
        rope_theta=5000.0, compress_rope_theta=80000.0,
        rope_scaling=RopeScaling(type="yarn", factor=4.0, beta_fast=16.0, beta_slow=2.0,
                                 original_max_position_embeddings=1024),
        norm_topk_prob=False, routed_scaling_factor=2.5, gate_temp=0.5,
        hc_mult=2, hc_sinkhorn_iters=10, hc_eps=1e-5, engram_pad_token_id=5)


def test_custom_expected_differs_from_flash_defaults(custom_expected):
    """Sanity of the test data: nearly every field differs from the dataclass defaults (= flash)."""
    same = [k for k, v in fields_of(custom_expected).items() if v == getattr(ModelConfig.preset("flash"), k)]
    # fields that cannot differ (single allowed value) or are ours
    assert set(same) <= {"num_key_value_heads", "hidden_act", "scoring_func", "topk_method", "n_shared_experts",
                         "engram_max_ngram_size", "num_nextn_predict_layers", "act_dtype", "deterministic", "impl",
                         "layer_scan"} | V4_ONLY_FIELDS, same  # the DeepSeek-V4 variant fields: a V4.1 config keeps
    # their V4.1 values (test_config_v4.py)


def test_from_pretrained_hf_config_text_config_wins(tmp_path, custom_expected):
    top = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "vision_config": {"model_type": "whatever", "hidden_size": 1152},
        "torch_dtype": "bfloat16", "transformers_version": "4.57.0",
        # conflicting top-level values: text_config must win
        "hidden_size": 4096, "sliding_window": 64, "rope_scaling": {"type": "yarn", "factor": 40.0},
        "compress_ratios": [0] * 43,
    }
    text = dict(CUSTOM_TEXT, model_type="deepseek_v41_text")
    # a few fields only at the top level
    for k in ("vocab_size", "bos_token_id", "eos_token_id", "dspark_noise_token_id"):
        top[k] = text.pop(k)
    top["text_config"] = text
    d = tmp_path / "model"
    write_json(str(d / "config.json"), top)
    assert_same_config(ModelConfig.from_pretrained(str(d)), custom_expected)
    # the file path itself works too
    assert_same_config(ModelConfig.from_pretrained(str(d / "config.json")), custom_expected)


def test_from_pretrained_old_model_type_spelling(tmp_path, custom_expected):
    cfg = dict(CUSTOM_TEXT, model_type="deepseek_v4.1", architectures=["DeepseekV41ForCausalLM"])
    p = write_json(str(tmp_path / "old" / "config.json"), cfg)
    assert_same_config(ModelConfig.from_pretrained(p), custom_expected)


def test_from_pretrained_legacy_aliases(tmp_path, custom_expected):
    legacy = {"kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
              "candidate_source_layer_id": "candidate_source_layer", "engram_pad_token_id": "engram_pad_id",
              "dspark_num_experts_per_tok": "dspark_n_activated_experts"}
    text = {legacy.get(k, k): v for k, v in CUSTOM_TEXT.items()}
    for new in legacy:
        assert new not in text
    cfg = {"model_type": "deepseek_v41", "text_config": dict(text, model_type="deepseek_v41_text")}
    p = write_json(str(tmp_path / "legacy" / "config.json"), cfg)
    assert_same_config(ModelConfig.from_pretrained(p), custom_expected)


def test_from_pretrained_flat_inference_config(tmp_path, custom_expected):
    flat_names = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                  "qk_rope_head_dim": "rope_head_dim", "num_experts_per_tok": "n_activated_experts",
                  "moe_intermediate_size": "moe_inter_dim", "scoring_func": "score_func",
                  "routed_scaling_factor": "route_scale", "sliding_window": "window_size",
                  "rms_norm_eps": "norm_eps", "num_nextn_predict_layers": "n_mtp_layers"}
    flat = {flat_names.get(k, k): v for k, v in CUSTOM_TEXT.items() if k != "rope_scaling"}
    flat.update(rope_factor=4.0, beta_fast=16.0, beta_slow=2.0, original_seq_len=1024)
    for hf in flat_names:
        assert hf not in flat
    d = tmp_path / "ref"
    write_json(str(d / "inference" / "config.json"), flat)  # no top-level config.json in the directory
    assert_same_config(ModelConfig.from_pretrained(str(d)), custom_expected)


def test_flat_score_func_is_read(tmp_path):
    """score_func really maps to scoring_func: an unsupported value is rejected, naming the field."""
    flat = dict(CUSTOM_TEXT, score_func="softmax")
    flat.pop("scoring_func")
    p = write_json(str(tmp_path / "f" / "config.json"), flat)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(p)
    assert "scoring_func" in str(e.value)


def test_real_flash_hf_config_loads_as_flash(tmp_path, flash):
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
        "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "tie_word_embeddings": False,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "n_routed_experts": 384, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
        "dspark_num_experts_per_tok": 3,
    }
    top = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
           "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
           "vision_config": {}}
    p = write_json(str(tmp_path / "flash" / "config.json"), top)
    assert_same_config(ModelConfig.from_pretrained(p), flash)


def test_to_hf_dict_round_trip(custom_expected, tiny, flash):
    for cfg in (custom_expected, tiny, flash):
        d = cfg.to_hf_dict()
        assert d["model_type"] == "deepseek_v41" and d["architectures"] == ["DeepseekV41ForCausalLM"]
        assert d["quantization_config"]["weight_block_size"] == [32, 32]
        assert d["text_config"]["model_type"] == "deepseek_v41_text"
        json.dumps(d)  # plain JSON
        assert_same_config(ModelConfig.from_dict(json.loads(json.dumps(d))), cfg)


def test_unknown_model_type_is_rejected(tmp_path):
    for bad in ({"model_type": "llama", **CUSTOM_TEXT},
                {"model_type": "deepseek_v41", "text_config": {"model_type": "qwen3", **CUSTOM_TEXT}}):
        p = write_json(str(tmp_path / "bad" / "config.json"), bad)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_pretrained(p)
        assert "model_type" in str(e.value)
    with pytest.raises(ConfigError):
        ModelConfig.from_dict({"model_type": "deepseek_v3", **CUSTOM_TEXT})


def test_bad_json_and_missing_files(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 64,', encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_pretrained(str(d))
    assert "config.json" in str(e.value)
    (d / "config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError):
        ModelConfig.from_pretrained(str(d))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError):
        ModelConfig.from_pretrained(str(empty))
    with pytest.raises(ConfigError):
        ModelConfig.from_pretrained(str(tmp_path / "nope" / "config.json"))


# ------------------------------------------------------------------------------------------------
# validation: one case per rule; each must raise ConfigError whose message names the field
# ------------------------------------------------------------------------------------------------

R = (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0)  # tiny's ratios

VALIDATION_CASES = {
    # compress_ratios has num_hidden_layers + num_nextn_predict_layers entries
    "ratios_too_short": (dict(compress_ratios=R[:-1]), ("compress_ratios",)),
    "ratios_too_long": (dict(compress_ratios=R + (0,)), ("compress_ratios",)),
    "ratios_vs_layers": (dict(num_hidden_layers=9), ("compress_ratios",)),
    # DSpark stages are window-only
    "dspark_ratio_nonzero": (dict(compress_ratios=R[:11] + (1, 0)), ("compress_ratios",)),
    # layer 1 compressed but the first KV source is layer 2
    "no_kv_source_before": (dict(compress_ratios=(0, 2) + R[2:]), ("kv_source_layer_ids", "compress_ratios")),
    # layer 3 has ratio 1 but reads layer 2's ratio-2 store
    "kv_source_ratio_mismatch": (dict(compress_ratios=(0, 0, 2, 1) + R[4:]), ("compress_ratios",)),
    # index source 3 precedes every key owner (4, 6)
    "index_source_without_key_owner": (dict(index_source_layer_ids=(3, 4, 6, 8)), ("index_source_layer_ids",)),
    # layers 2 and 3 are compressed but the first index source is 4
    "compressed_layer_without_index_source": (dict(index_source_layer_ids=(4, 6, 8)), ("index_source_layer_ids",)),
    # quantized-matmul input widths must be multiples of 32
    "hidden_size_width": (dict(hidden_size=48), ("hidden_size",)),
    "q_lora_rank_width": (dict(q_lora_rank=48), ("q_lora_rank",)),
    "moe_intermediate_width": (dict(moe_intermediate_size=40), ("moe_intermediate_size",)),
    "o_groups_x_o_lora_rank_width": (dict(o_lora_rank=20), ("o_lora_rank",)),
    "engram_width": (dict(engram_head_dim=8), ("engram_head_dim",)),  # 3*2*8 = 48
    "head_dim_16": (dict(head_dim=72), ("head_dim",)),
    "index_head_dim_32": (dict(index_head_dim=48), ("index_head_dim",)),
    "engram_head_dim_32": (dict(engram_head_dim=48), ("engram_head_dim",)),  # width 288 = 9*32 is fine
    "odd_rope_dim": (dict(qk_rope_head_dim=15), ("qk_rope_head_dim",)),
    "rope_dim_gt_index_head_dim": (dict(qk_rope_head_dim=64, index_head_dim=32), ("qk_rope_head_dim",)),
    # engram_num_embeddings must be the sum of the layer's primes
    "engram_rows_wrong": (dict(engram_num_embeddings=(384, 553)), ("engram_num_embeddings",)),
    "engram_rows_vocab_changed": (dict(engram_vocab_size=60), ("engram_num_embeddings",)),
    "engram_rows_count": (dict(engram_num_embeddings=(384,)), ("engram_num_embeddings",)),
    "n_shared_experts": (dict(n_shared_experts=2), ("n_shared_experts",)),
    # candidate source must own keys (KV source and index source)
    "candidate_not_key_owner": (dict(candidate_source_layer_id=7), ("candidate_source_layer_id",)),
    "candidate_ratio2_consumer": (dict(candidate_source_layer_id=3), ("candidate_source_layer_id",)),
}


@pytest.mark.parametrize("case", sorted(VALIDATION_CASES))
def test_validation_rule(tiny, case):
    kw, fields = VALIDATION_CASES[case]
    with pytest.raises(ConfigError) as e:
        tiny.replace(**kw)
    msg = str(e.value)
    head = msg.split(":", 1)[0]
    assert any(f in head for f in fields), f"message does not start with {fields}: {msg!r}"


def test_validation_accepts_the_presets_and_equivalent_variants(tiny):
    tiny.validate()
    ModelConfig.preset("flash").validate()
    # a legal variant: without a candidate source, no layer masks to candidates
    v = tiny.replace(candidate_source_layer_id=None)
    assert not any(p.uses_candidates or p.is_candidate_source for p in v.layer_plans())
    # consistent engram change (rows recomputed by the primes rule) is accepted
    rows = primes_rule_rows((1, 4), 4, 2, 60)
    tiny.replace(engram_vocab_size=60, engram_num_embeddings=tuple(rows))


def test_rank_blocks_partition_slots_and_pages():
    """dp rank blocks: dp=1 is the single-rank layout; dp>1 gives disjoint contiguous blocks, each with its
    own scratch row (last) and null page (first), and totals that do not divide are refused."""
    from dsv41_jax.model import cache as kvc
    one = kvc.CacheConfig(max_slots=8, num_pages=16)
    assert kvc.slot_rows(one) == 9 and list(kvc.rank_slots(one, 0)) == list(range(8))
    assert kvc.scratch_slot(one) == 8 and kvc.rank_pages(one, 0) == range(0, 16)
    four = kvc.CacheConfig(max_slots=8, num_pages=16, dp=4)
    assert kvc.slot_rows(four) == 12
    seen = []
    for r in range(4):
        rows = list(kvc.rank_slots(four, r)) + [kvc.scratch_slot(four, r)]
        assert rows == list(range(3 * r, 3 * r + 3))
        assert kvc.rank_pages(four, r) == range(4 * r, 4 * r + 4)
        seen += rows
    assert sorted(seen) == list(range(12))
    cfg = ModelConfig.preset("tiny")
    for bad, msg in ((dict(max_slots=6, num_pages=16, dp=4), "max_slots"),
                     (dict(max_slots=8, num_pages=18, dp=4), "num_pages"),
                     (dict(max_slots=8, num_pages=4, dp=4), "fewer than 2 pages"),
                     (dict(dp=0), "dp")):
        with pytest.raises(ValueError, match=msg):
            kvc.CacheConfig(**{"page_size": 64, **bad}).validate(cfg)
