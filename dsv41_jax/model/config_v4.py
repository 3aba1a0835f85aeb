"""DeepSeek-V4 (the earlier Flash / Pro checkpoints) in `ModelConfig`: reading, writing, presets, refusal.

A V4 checkpoint (`model_type` ``deepseek_v4``) is read into the same `ModelConfig` as V4.1, with the
fields that declare V4's variants of the shared operations set (docs/design/v4.md has the table and
the mechanisms):

- ``model_family`` = ``"deepseek_v4"``;
- ``compress_ratios`` per layer: 0 = sliding only, ``csa_compress_ratio`` (4) = CSA (overlapping-window
  compressor with its own Lightning indexer), ``hca_compress_ratio`` (128) = HCA (every compressed
  entry); the draft stages' entries are 0;
- ``hash_layer_ids``: MoE layers routed by ``tid2eid[input_ids]``;
- ``mhc_variant`` ``"pre_mix"``, ``q_head_norm`` True, ``weight_block_size`` (128, 128),
  ``expert_dtype``, ``draft_kind`` ``"mtp"`` (original Flash / Pro) or ``"dspark"`` (0731 / 0813);
- RoPE: ``rope_theta`` for sliding layers, ``compress_rope_theta`` + ``rope_scaling`` (YaRN, or
  ``"default"`` = none) for compressed layers, as for V4.1.

Both spellings load: the release's ``config.json`` names (``compress_ratios``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``, ``quantization_config.weight_block_size``) and transformers'
``DeepseekV4Config`` names (``layer_types``, ``compress_rates``, ``mlp_layer_types``,
``partial_rotary_factor``, nested ``rope_parameters`` {main, compress}), including the legacy names
transformers folds in (``compress_rate_csa`` / ``compress_rate_hca``). The flat ``inference/config.json``
names of `config._ALIASES` map as for V4.1.

The model runs a V4 config's full-sequence forward (`model.v4`); the V4.1 layer plan does not apply to it:
`ModelConfig.layer_plan` raises `refusal` (V4.1's decode path is not V4's; missing: the mesh rules, the kernels) as
NotImplementedError, so V4.1's decode step for a V4 config fails there instead of running it as V4.1 (V4's own
step: `model.v4.decode`; its drafts: `model.v4.mtp`, `model.v4.dspark`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

V4_MODEL_TYPES = ("deepseek_v4",)
FAMILIES = ("deepseek_v41", "deepseek_v4")

# transformers' layer-type names <-> ours (configuration_deepseek_v4.py: DEEPSEEK_V4_LAYER_TYPES)
HF_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                  "heavily_compressed_attention": "hca"}
DEFAULT_CSA_RATIO, DEFAULT_HCA_RATIO = 4, 128  # transformers' default_compress_rates (paper m = 4, m' = 128)
DEFAULT_NUM_HASH_LAYERS = 3  # transformers' default_num_hash_layers; the released configs say 3 too

# The V4 variant fields of ModelConfig and their V4.1 values (a V4.1 config must keep these).
V41_VALUES = {
    "csa_compress_ratio": 0, "hca_compress_ratio": 0, "hash_layer_ids": (), "mhc_variant": "lagged",
    "q_head_norm": False, "weight_block_size": (32, 32), "expert_dtype": "fp4", "draft_kind": "dspark",
    "act_quant_block": 0, "kv_quant_block": 0, "index_fp4_block": 0, "release_order": "",
}
# The release's numerics (its inference/model.py + kernels, docs/design/v4.md "Numerics"): fp8 activations per 128
# along K in every fp8 / MXFP4 GEMM (`act_quant(x, block_size=128)`), fp8 KV entries per 64 of their non-RoPE
# channels, FP4 (power-of-two scales per 32) index queries and keys after a Hadamard rotation. A config.json whose
# quantization_config says ``activation_scheme: dynamic`` (the release's) gets them; 0 = not simulated
# (transformers' numerics, a plain checkpoint).
RELEASE_NUMERICS = {"act_quant_block": 128, "kv_quant_block": 64, "index_fp4_block": 32}
PLAIN_NUMERICS = {k: 0 for k in RELEASE_NUMERICS}
V4_ONLY_FIELDS = frozenset(V41_VALUES) | {"model_family"}

# Keys of V4 config.json files that carry nothing for us (beyond config._IGNORED_KEYS).
_IGNORED_V4_KEYS = {
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "mlp_bias", "return_dict",
    "output_hidden_states", "output_attentions", "chunk_size_feed_forward", "problem_type", "tokenizer_class",
    "layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor",
    "compress_rate_csa", "compress_rate_hca", "num_hash_layers", "n_hash_layers", "compress_ratios",
}


def is_v4_dict(d: dict) -> bool:
    """Whether a config.json dict is a DeepSeek-V4 one (its `model_type`, top level or text_config)."""
    text = d.get("text_config") or {}
    return d.get("model_type") in V4_MODEL_TYPES or text.get("model_type") in V4_MODEL_TYPES


# ------------------------------------------------------------------------------------------------ reading
def from_v4_dict(cls, d: dict, *, source: str):
    """A V4 ``config.json`` dict (release or transformers spelling) -> `ModelConfig` (``cls``)."""
    from dsv41_jax.model.config import _ALIASES, _FLAT_ROPE, _IGNORED_KEYS, ConfigError, _rope_from_dict

    d = dict(d)
    text = d.pop("text_config", None) or {}
    m = {**d, **text}
    m = {_ALIASES.get(k, k) if k not in ("n_hash_layers",) else k: v for k, v in m.items()}
    names = {f.name for f in dataclasses.fields(cls)} - V4_ONLY_FIELDS - {"name"}
    kw: dict[str, Any] = {"model_family": "deepseek_v4", "mhc_variant": "pre_mix", "q_head_norm": True}

    def bad(field, msg):
        raise ConfigError(f"{source}: {field}: {msg}")

    L = int(m.get("num_hidden_layers", 43))  # transformers' default (V4-Flash)
    head_dim = int(m.get("head_dim", 512))

    # --- attention kind per layer -> compress_ratios (target layers)
    rates = dict(m.get("compress_rates") or {})
    csa = int(m.get("compress_rate_csa", rates.get("compressed_sparse_attention", DEFAULT_CSA_RATIO)))
    hca = int(m.get("compress_rate_hca", rates.get("heavily_compressed_attention", DEFAULT_HCA_RATIO)))
    ratio_of = {"sliding": 0, "csa": csa, "hca": hca}
    raw_ratios = m.get("compress_ratios")
    if m.get("layer_types") is not None:
        kinds = []
        for t in m["layer_types"]:
            if t not in HF_LAYER_TYPES:
                bad("layer_types", f"entry {t!r} is not one of {sorted(HF_LAYER_TYPES)}")
            kinds.append(HF_LAYER_TYPES[t])
        if len(kinds) < L:
            bad("layer_types", f"has {len(kinds)} entries for num_hidden_layers = {L}")
        target = [ratio_of[k] for k in kinds[:L]]
    elif raw_ratios is not None:
        if not isinstance(raw_ratios, (list, tuple)) or len(raw_ratios) < L:
            bad("compress_ratios", f"must list at least num_hidden_layers = {L} ratios, got {raw_ratios!r}")
        target = [int(r) for r in raw_ratios[:L]]
        for i, r in enumerate(target):
            if r not in (0, csa, hca):
                bad("compress_ratios", f"layer {i} has ratio {r}; V4 layers are 0 (sliding), {csa} (CSA) or "
                    f"{hca} (HCA)")
        if any(int(r) != 0 for r in raw_ratios[L:]):
            bad("compress_ratios", f"the entries after the {L} layers (draft stages) must be 0, got "
                f"{list(raw_ratios[L:])}")
    else:
        # transformers' default schedule (configuration_deepseek_v4.py __post_init__): 2 HCA, then CSA on odd
        # positions of the rest, HCA on even ones
        target = [hca] * min(L, 2) + [csa if i % 2 else hca for i in range(max(L - 2, 0))]

    # --- hash-routed MoE layers
    if m.get("mlp_layer_types") is not None:
        types = list(m["mlp_layer_types"])
        for t in types:
            if t not in ("hash_moe", "moe"):
                bad("mlp_layer_types", f"entry {t!r} is not 'hash_moe' or 'moe'")
        hash_ids = tuple(i for i, t in enumerate(types[:L]) if t == "hash_moe")
    else:
        n_hash = m.get("num_hash_layers", m.get("n_hash_layers", DEFAULT_NUM_HASH_LAYERS))
        hash_ids = tuple(range(min(L, int(n_hash))))

    # --- draft: DSpark head (0731 / 0813: dspark_* keys) or MTP layers (original Flash / Pro)
    has_dspark = any(k.startswith("dspark_") for k in m)
    S = int(m.get("num_nextn_predict_layers", 1))
    if has_dspark and raw_ratios is not None and len(raw_ratios) > L:
        S = max(S, len(raw_ratios) - L)  # a DSpark head lists its stages in compress_ratios (docs/design/v4.md)
    kw["draft_kind"] = "dspark" if has_dspark else "mtp"
    kw["num_nextn_predict_layers"] = S
    kw["compress_ratios"] = tuple(target) + (0,) * S
    kw["csa_compress_ratio"], kw["hca_compress_ratio"] = csa, hca
    kw["hash_layer_ids"] = hash_ids

    # --- RoPE: rope_parameters {main, compress} (transformers) or rope_theta / compress_rope_theta / rope_scaling
    rp = m.get("rope_parameters")
    rope: dict[str, Any] = {}
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        if main.get("rope_type", "default") != "default":
            bad("rope_parameters.main.rope_type", f"= {main.get('rope_type')!r}; V4's sliding layers use plain RoPE")
        kw["rope_theta"] = float(main.get("rope_theta", m.get("rope_theta", 10000.0)))
        kw["compress_rope_theta"] = float(comp.get("rope_theta", m.get("compress_rope_theta", 160000.0)))
        for part in (main, comp):
            if "partial_rotary_factor" in part:
                m.setdefault("partial_rotary_factor", part["partial_rotary_factor"])
        rope = {k: v for k, v in comp.items() if k not in ("rope_theta", "partial_rotary_factor")}
        ctype = rope.get("rope_type", rope.get("type", "default"))
        if ctype == "yarn":
            # transformers derives YaRN's mscale when attention_factor is absent; the V4 reference applies none
            if float(rope.pop("attention_factor", -1.0)) != 1.0:
                bad("rope_parameters.compress.attention_factor", "must be 1.0: V4 scales no cos/sin by YaRN's mscale")
        elif ctype != "default":
            bad("rope_parameters.compress.rope_type", f"= {ctype!r}; V4 uses 'yarn' or 'default'")
    elif isinstance(rp, dict) and rp:
        rope = dict(rp)  # transformers' flat form: the YaRN parameters of the compressed layers
        rope.pop("attention_factor", None)
    elif m.get("rope_scaling"):
        rope = dict(m["rope_scaling"])
    for flat, ours in _FLAT_ROPE.items():
        if flat in m:
            rope[ours] = m[flat]
    if rope:
        rope.setdefault("rope_type", rope.pop("type", "default"))
        kw["rope_scaling"] = _rope_from_dict(rope)
    else:
        kw["rope_scaling"] = _rope_from_dict({"rope_type": "default"})
    if "qk_rope_head_dim" not in m and "partial_rotary_factor" in m:
        m["qk_rope_head_dim"] = int(head_dim * float(m["partial_rotary_factor"]))
    m.setdefault("qk_rope_head_dim", head_dim // 8)  # transformers' default_partial_rotary_factor 64 / 512

    # --- checkpoint number formats; the release's numerics where its activations are quantized on the fly
    qc = m.get("quantization_config")
    release = isinstance(qc, dict) and qc.get("activation_scheme") == "dynamic"
    if isinstance(qc, dict):
        kw["weight_block_size"] = tuple(int(x) for x in qc.get("weight_block_size", (128, 128)))
        kw["expert_dtype"] = str(m.get("expert_dtype", qc.get("expert_dtype", "fp4")))
    else:  # no quantization_config: plain (bf16 / fp32) weights, as transformers writes them (experts too:
        kw["weight_block_size"] = ()  # a release config's expert_dtype carried over names what is no longer stored)
        if m.get("expert_dtype", "bf16") != "bf16":
            log.info("%s: expert_dtype %r without a quantization_config: the experts are read as plain weights",
                     source, m["expert_dtype"])
        kw["expert_dtype"] = "bf16"

    eos = m.get("eos_token_id")
    if isinstance(eos, list):
        if len(eos) != 1:
            bad("eos_token_id", f"= {eos}: one end-of-sequence id is supported")
        m["eos_token_id"] = eos[0]

    # --- V4 has none of V4.1's source layers, Engram or candidate stage
    kw.update(kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=None,
              engram_layer_ids=(), engram_num_embeddings=())
    if not has_dspark:
        kw["dspark_target_layer_ids"] = ()
    else:  # the 0731 / 0813 head's stages route over the target's experts (their gates are [n_routed_experts, D], the
        # config has no dspark_n_* keys); keys saying otherwise are refused by `validate_family`
        default = {f.name: f.default for f in dataclasses.fields(cls)}
        for dk, tk in (("dspark_n_routed_experts", "n_routed_experts"),
                       ("dspark_num_experts_per_tok", "num_experts_per_tok")):
            if dk not in m:
                kw[dk] = int(m.get(tk, default[tk]))

    unknown = []
    for k, v in m.items():
        if k in kw or k in _IGNORED_V4_KEYS or k in _IGNORED_KEYS or k in ("rope_scaling",) or k in _FLAT_ROPE:
            continue
        if k in names:
            kw[k] = tuple(v) if isinstance(v, list) else v
        else:
            unknown.append(k)
    if unknown:
        log.info("%s: ignoring config keys this model does not use: %s", source, sorted(unknown))
    try:
        cfg = cls(name=os.path.basename(os.path.dirname(os.path.abspath(source))) or "custom", **kw)
    except TypeError as e:  # wrong value types in the file
        raise ConfigError(f"{source}: {e}") from e
    if release:
        try:
            return cfg.replace(**RELEASE_NUMERICS)
        except ConfigError as e:  # widths the release's blocks do not cut (a small test model): not its numerics
            log.warning("%s: activation_scheme 'dynamic', but the release's numerics do not fit this model (%s): "
                        "running it without the activation / KV / index quantization simulation", source, e)
    return cfg


# ------------------------------------------------------------------------------------------------ writing
def to_v4_dict(cfg) -> dict:
    """The release-style ``config.json`` of a V4 config (what `from_v4_dict` reads back unchanged)."""
    L, S = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hidden_act", "swiglu_limit", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_theta", "compress_rope_theta",
            "max_position_embeddings", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
            "moe_intermediate_size", "scoring_func", "topk_method", "norm_topk_prob", "routed_scaling_factor",
            "gate_temp", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
            "hc_sinkhorn_iters", "hc_eps", "num_nextn_predict_layers")
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    out.update({k: getattr(cfg, k) for k in keys})
    out["rope_scaling"] = cfg.rope_scaling.to_dict()
    # Both spellings: the release's (compress_ratios, num_hash_layers) and transformers' (layer_types,
    # compress_rates, mlp_layer_types), which transformers reads first and needs for ratios other than 4 / 128.
    out["compress_ratios"] = list(cfg.compress_ratios)
    hf_name = {v: k for k, v in HF_LAYER_TYPES.items()}
    out["layer_types"] = [hf_name[k] for k in attention_kinds(cfg)]
    out["compress_rates"] = {"compressed_sparse_attention": cfg.csa_compress_ratio,
                             "heavily_compressed_attention": cfg.hca_compress_ratio}
    if cfg.hash_layer_ids == tuple(range(len(cfg.hash_layer_ids))):
        out["num_hash_layers"] = len(cfg.hash_layer_ids)
    out["mlp_layer_types"] = ["hash_moe" if i in cfg.hash_layer_ids else "moe" for i in range(L)]
    if cfg.draft_kind == "dspark" and S:  # the release's four keys (the stages' experts are the target's)
        out.update(dspark_block_size=cfg.dspark_block_size, dspark_noise_token_id=cfg.dspark_noise_token_id,
                   dspark_target_layer_ids=list(cfg.dspark_target_layer_ids),
                   dspark_markov_rank=cfg.dspark_markov_rank)
    if cfg.weight_block_size:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": list(cfg.weight_block_size)}
        if release_numerics(cfg):  # the release's statement of its activation quantization (`from_v4_dict`)
            out["quantization_config"]["activation_scheme"] = "dynamic"
        out["expert_dtype"] = cfg.expert_dtype
    else:
        out["expert_dtype"] = cfg.expert_dtype
    out["torch_dtype"] = "bfloat16"
    return out


# ------------------------------------------------------------------------------------------------ checking
def attention_kinds(cfg) -> tuple:
    """Per target layer: "sliding" | "csa" | "hca" (V4), "window" | "compressed" (V4.1)."""
    L = cfg.num_hidden_layers
    if cfg.model_family == "deepseek_v41":
        return tuple("window" if r == 0 else "compressed" for r in cfg.compress_ratios[:L])
    kind = {0: "sliding", cfg.csa_compress_ratio: "csa", cfg.hca_compress_ratio: "hca"}
    return tuple(kind[r] for r in cfg.compress_ratios[:L])


def draft_kinds(cfg) -> tuple:
    """Per V4 draft layer (``compress_ratios[L:]``): "sliding" | "csa" | "hca" (the released MTP layer: sliding)."""
    L = cfg.num_hidden_layers
    kind = {0: "sliding", cfg.csa_compress_ratio: "csa", cfg.hca_compress_ratio: "hca"}
    return tuple(kind[r] for r in cfg.compress_ratios[L:L + cfg.num_nextn_predict_layers])


def validate_family(cfg, err) -> None:
    """The model_family rules: V4.1 keeps every V4 variant field at its V4.1 value; V4 its own checks."""
    if cfg.model_family not in FAMILIES:
        err("model_family", f"= {cfg.model_family!r}; known: {FAMILIES}")
    if cfg.model_family == "deepseek_v41":
        for f, v41 in V41_VALUES.items():
            if getattr(cfg, f) != v41:
                err(f, f"= {getattr(cfg, f)!r} is a DeepSeek-V4 variant (V4.1: {v41!r}); it needs "
                       "model_family 'deepseek_v4'")
        return
    L = cfg.num_hidden_layers
    csa, hca = cfg.csa_compress_ratio, cfg.hca_compress_ratio
    if csa < 1 or hca < 1 or csa == hca:
        err("csa_compress_ratio/hca_compress_ratio", f"= {csa}/{hca} must be distinct and >= 1")
    for i, r in enumerate(cfg.compress_ratios[:L]):
        if r not in (0, csa, hca):
            err("compress_ratios", f"layer {i} has ratio {r}; V4 layers are 0 (sliding), {csa} (CSA) or {hca} (HCA)")
    if list(cfg.hash_layer_ids) != sorted(set(cfg.hash_layer_ids)) or any(not 0 <= i < L for i in cfg.hash_layer_ids):
        err("hash_layer_ids", f"= {list(cfg.hash_layer_ids)} must be ascending target layers 0..{L - 1}")
    for f in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        if getattr(cfg, f):
            err(f, "V4 has no V4.1 source / Engram layers (every compressed V4 layer compresses for itself)")
    if cfg.candidate_source_layer_id is not None:
        err("candidate_source_layer_id", "V4 has no candidate stage")
    if cfg.mhc_variant not in ("lagged", "pre_mix"):
        err("mhc_variant", f"= {cfg.mhc_variant!r}; 'lagged' (V4.1) or 'pre_mix' (V4)")
    if cfg.draft_kind not in ("mtp", "dspark"):
        err("draft_kind", f"= {cfg.draft_kind!r}; 'mtp' or 'dspark'")
    if cfg.draft_kind == "dspark" and cfg.num_nextn_predict_layers:
        if any(r != 0 for r in cfg.compress_ratios[L:]):
            err("compress_ratios", "V4's DSpark stages are sliding-window layers (ratio 0)")
        for dk, tk in (("dspark_n_routed_experts", "n_routed_experts"),
                       ("dspark_num_experts_per_tok", "num_experts_per_tok")):
            if getattr(cfg, dk) != getattr(cfg, tk):
                err(dk, f"= {getattr(cfg, dk)}: V4's DSpark stages route over the target's experts ({tk} = "
                        f"{getattr(cfg, tk)})")
    if cfg.weight_block_size and (len(cfg.weight_block_size) != 2 or min(cfg.weight_block_size) < 1):
        err("weight_block_size", f"= {cfg.weight_block_size} must be two positive sizes (or empty: unquantized)")
    if cfg.expert_dtype not in ("fp4", "fp8", "bf16"):
        err("expert_dtype", f"= {cfg.expert_dtype!r}; 'fp4', 'fp8' or 'bf16'")
    validate_numerics(cfg, err)
    if cfg.release_order not in ("", "torch_cpu"):
        err("release_order", f"= {cfg.release_order!r}; '' (ours) or 'torch_cpu' (the release run by torch on CPU)")


def release_numerics(cfg) -> bool:
    """Whether `cfg` simulates the release's numerics (`RELEASE_NUMERICS`: all three blocks set)."""
    return all(getattr(cfg, k) for k in RELEASE_NUMERICS)


def validate_numerics(cfg, err) -> None:
    """The blocks of `RELEASE_NUMERICS` (0 = off): each divides the widths it cuts (the release asserts the same).
    act_quant_block: the inputs of the fp8 / MXFP4 GEMMs (hidden, q LoRA, the grouped output, the expert width);
    kv_quant_block: head_dim − rope width; index_fp4_block: index_head_dim, a power of two (the Hadamard)."""
    for f in RELEASE_NUMERICS:
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            err(f, f"= {v!r} must be an int >= 0 (0: not simulated)")
    a = cfg.act_quant_block
    if a:
        widths = {"hidden_size": cfg.hidden_size, "q_lora_rank": cfg.q_lora_rank,
                  "o_groups*o_lora_rank": cfg.o_groups * cfg.o_lora_rank, "moe_intermediate_size": cfg.moe_intermediate_size}
        bad = {k: w for k, w in widths.items() if w % a}
        if bad:
            err("act_quant_block", f"= {a} does not divide the GEMM inputs {bad}")
    k = cfg.kv_quant_block
    if k and (cfg.head_dim - cfg.qk_rope_head_dim) % k:
        err("kv_quant_block", f"= {k} does not divide the non-RoPE channels {cfg.head_dim - cfg.qk_rope_head_dim}")
    i, dI = cfg.index_fp4_block, cfg.index_head_dim
    if i and (dI % i or dI & (dI - 1)):
        err("index_fp4_block", f"= {i}: index_head_dim {dI} must be a multiple of it and a power of two (Hadamard)")


def refusal(cfg) -> str:
    """Why the V4.1 machinery cannot run this V4 config: what model/ runs of it (the full-sequence forward,
    `v4.transformer`) and what it lacks. Raised by `ModelConfig.layer_plan`, which every cached / paged path asks
    first, so those fail there instead of running V4 as V4.1."""
    kinds = attention_kinds(cfg)
    csa = [i for i, k in enumerate(kinds) if k == "csa"]
    hca = [i for i, k in enumerate(kinds) if k == "hca"]
    missing = [f"V4.1's paged decode step and cache (`model.decode` / `cache.init_cache`; V4's own step with its per-layer "
               f"compressor state, CSA layers {csa} and HCA layers {hca}, is `model.v4.decode.extend`, which the engine "
               f"runs through `serving.model_step.V4Step`)"]
    missing.append("the mesh rules and the Pallas kernels for V4")
    return (f"DeepSeek-V4 config {cfg.name!r} (model_family {cfg.model_family!r}): model.forward and "
            f"model.v4.decode.extend run it (CSA / HCA attention, hash-routed MoE, pre-mix mHC with hc_head, per-head q "
            f"norm, fp8 {'x'.join(map(str, cfg.weight_block_size)) or 'plain'} weights), but not the V4.1 layer "
            f"plan; missing: {'; '.join(missing)} (docs/design/v4.md, issue 48)")


# ------------------------------------------------------------------------------------------------ presets
def tiny_v4(cls):
    """Small V4 config for tests: 2 sliding, 2 CSA (ratio 4) and 2 HCA (ratio 8) layers, 2 hash-routed MoE
    layers, 8 experts top-2, one MTP layer; tiny's tokenizer size (320). HCA's ratio is 8, not 128, so
    test sequences (64+ tokens) close several HCA windows."""
    return cls(
        model_family="deepseek_v4", vocab_size=320, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, rms_norm_eps=1e-6,
        max_position_embeddings=4096, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        sliding_window=8, compress_ratios=(0, 0, 4, 8, 4, 8, 0), csa_compress_ratio=4, hca_compress_ratio=8,
        index_n_heads=4, index_head_dim=32, index_topk=4, hash_layer_ids=(0, 1), mhc_variant="pre_mix",
        q_head_norm=True, weight_block_size=(128, 128), expert_dtype="fp4", draft_kind="mtp",
        num_nextn_predict_layers=1, kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=None,
        engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(), name="tiny-v4")


def with_dspark(cfg, block_size: int = 3, markov_rank: int = 16, noise_token_id=None):
    """`cfg` (a V4 config) with a DSpark head in place of its MTP layer, laid out as Flash-0731 / Pro-0813's
    (docs/design/v4.md "MTP and the DSpark head"): three sliding-window stages (``compress_ratios`` + [0, 0, 0]),
    features from the last three target layers' outputs, the target's experts; block size, Markov rank and noise
    token as given (the release: 5, 256, 128799; default noise id: the last token of the vocabulary)."""
    L = cfg.num_hidden_layers
    return cfg.replace(
        draft_kind="dspark", num_nextn_predict_layers=3, compress_ratios=tuple(cfg.compress_ratios[:L]) + (0, 0, 0),
        dspark_target_layer_ids=tuple(range(max(L - 3, 0), L)), dspark_block_size=block_size,
        dspark_markov_rank=markov_rank,
        dspark_noise_token_id=cfg.vocab_size - 1 if noise_token_id is None else int(noise_token_id),
        dspark_n_routed_experts=cfg.n_routed_experts, dspark_num_experts_per_tok=cfg.num_experts_per_tok,
        name=f"{cfg.name}-dspark")


def tiny_v4_dspark(cls):
    """tiny-v4 with a DSpark head (`with_dspark`: 3 stages on target layers 3..5, block 3, Markov rank 16) — a tiny
    Flash-0731-style model."""
    return with_dspark(tiny_v4(cls))


def flash_v4(cls):
    """DeepSeek-V4-Flash (original, MTP draft), shapes only. Sources: transformers 5.25
    `DeepseekV4Config` defaults (vocab 129280, hidden 4096, 43 layers, 64 heads x 512, q_lora 1024,
    o_groups 8 x 1024, 256 experts top-6 x 2048, scaling 1.5, index 64 x 128 top-512, window 128, hc 4 /
    20 / 1e-6, eps 1e-6, rope 10000 / 160000, 3 hash layers, 1 MTP layer, rope dim 64); the layer schedule
    [0, 0] + [4, 128] x 20 + [4] (+ [0] for the MTP layer), YaRN (16, 32, 1, 65536) and fp8 128x128 /
    fp4 experts as transcribed from the release config.json by several third-party repositories
    (docs/design/v4.md: not checked against the file itself)."""
    return cls(
        model_family="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, rms_norm_eps=1e-6,
        n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, routed_scaling_factor=1.5,
        sliding_window=128, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0), csa_compress_ratio=4,
        hca_compress_ratio=128, index_n_heads=64, index_head_dim=128, index_topk=512, hash_layer_ids=(0, 1, 2),
        mhc_variant="pre_mix", q_head_norm=True, weight_block_size=(128, 128), expert_dtype="fp4", draft_kind="mtp",
        num_nextn_predict_layers=1, kv_source_layer_ids=(), index_source_layer_ids=(), candidate_source_layer_id=None,
        engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(), name="flash-v4", **RELEASE_NUMERICS)


def flash_v4_0731(cls):
    """DeepSeek-V4-Flash-0731 (Flash with the bundled DSpark head), shapes only: flash-v4 with `with_dspark`'s head
    at the release's values (block 5, Markov rank 256, noise token 128799, target layers 40-42; 46 compress_ratios),
    as read from a copy of its config.json and shard headers (docs/design/v4.md "MTP and the DSpark head")."""
    return with_dspark(flash_v4(cls), block_size=5, markov_rank=256, noise_token_id=128799).replace(
        name="flash-v4-0731")


def pro_v4(cls):
    """DeepSeek-V4-Pro (original, MTP draft), shapes only. Sources: transformers 5.25 (128 heads x 512,
    o_groups 16 x 1024, hidden 7168 in `DeepseekV4GroupedLinear`'s docstring); 61 layers, q_lora 1536,
    384 experts top-6 x 3072, scaling 2.5, index top-1024, 3 hash layers and the schedule [128, 128] +
    (4 on even, 128 on odd layers 2..60) as transcribed from the release config.json by third-party
    repositories (docs/design/v4.md: not checked against the file; transformers' own default schedule
    puts CSA on the odd layers instead)."""
    ratios = (128, 128) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 61))
    return flash_v4(cls).replace(
        hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5, index_topk=1024,
        compress_ratios=ratios + (0,), name="pro-v4")


def pro_v4_0813(cls):
    """DeepSeek-V4-Pro-0813 (Pro with the bundled DSpark head), shapes only: pro-v4 with `with_dspark`'s head at the
    release's values (block 5, Markov rank 512 — Flash-0731's is 256 —, noise token 128799, target layers 58-60;
    64 compress_ratios), as a third party's pinned record of its config.json and tensor inventory lists them
    (docs/design/v4.md "MTP and the DSpark head")."""
    return with_dspark(pro_v4(cls), block_size=5, markov_rank=512, noise_token_id=128799).replace(name="pro-v4-0813")


PRESETS = {"tiny-v4": tiny_v4, "tiny-v4-dspark": tiny_v4_dspark, "flash-v4": flash_v4,
           "flash-v4-0731": flash_v4_0731, "pro-v4": pro_v4, "pro-v4-0813": pro_v4_0813}
