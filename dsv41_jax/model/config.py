"""Model configuration for DeepSeek-V4.1 Flash (docs/design/spec.md §1).

`ModelConfig` holds every field of the HF release's ``config.json`` under its real (HF) name, plus
five runtime fields that are ours (`act_dtype`, `deterministic`, `impl`, `layer_scan`, `name`). It is a frozen, hashable dataclass
so it can be a static argument of ``jax.jit``. Layer lists are tuples.

Nothing about the layer layout is hard-coded outside the two presets: everything downstream asks the
config (`layer_plan`) which layer owns which store.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
TINY_DIR = os.path.join(ASSET_DIR, "tiny")
NANO_DIR = os.path.join(ASSET_DIR, "nano")  # nano's tokenizer (scripts/make_nano_tokenizer.py) and checkpoint

def resolve_model(model: str) -> str:
    """A model name as the CLIs / `LLM` take it -> what the loaders take: ``"nano"`` is the trained
    checkpoint bundled in the package (its directory, `NANO_DIR`); ``"tiny"`` (random weights, built
    in memory) and directories are returned as they are. A directory named like these in the working
    directory wins, as a path should. Raises ValueError if nano's checkpoint is not installed."""
    if model != "nano" or os.path.isdir(model):
        return model
    if not os.path.isfile(os.path.join(NANO_DIR, "config.json")):
        raise ValueError(f"--model nano: the trained nano checkpoint is not in this install ({NANO_DIR} has no "
                         "config.json); rebuild it with scripts/train_nano.py and scripts/eval_nano.py --run ... "
                         f"--export-dir {NANO_DIR}, or use --model tiny")
    return NANO_DIR


MODEL_TYPES = ("deepseek_v41", "deepseek_v4.1", "deepseek_v41_text")


class ConfigError(ValueError):
    """A config value that the model cannot run with. The message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of the HF config (YaRN; used only by layers with compress_ratio > 0)."""

    type: str = "yarn"
    factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer (target layer or DSpark stage) reads and writes.

    Attributes:
      layer_id: index in ``compress_ratios`` (DSpark stage s is ``num_hidden_layers + s``).
      compress_ratio: 0 = window only; r > 0 = also reads compressed slots ``p // r``.
      is_kv_source: runs a compressor and writes the compressed store (and index keys).
      kv_source: the layer whose compressed store this layer reads (latest KV source <= layer_id).
      is_index_source: runs an indexer (computes its own top-k).
      index_source: the index source whose top-k this layer uses (itself if it is one).
      key_owner: for an index source, the KV source whose index keys it scores.
      uses_candidates: index source after the candidate source: masks scores to candidate blocks.
      is_candidate_source: computes the level-1 candidate blocks.
      is_engram: applies Engram before its attention sublayer.
      yarn: whether RoPE uses compress_rope_theta with YaRN (compress_ratio > 0).
      is_dspark: a DSpark (MTP) stage.
    """

    layer_id: int
    compress_ratio: int
    is_kv_source: bool
    kv_source: Optional[int]
    is_index_source: bool
    index_source: Optional[int]
    key_owner: Optional[int]
    uses_candidates: bool
    is_candidate_source: bool
    is_engram: bool
    yarn: bool
    is_dspark: bool


# Legacy names (old -> new) and the flat `inference/config.json` names (flat -> HF).
_ALIASES = {
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    # flat inference/config.json
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "n_activated_experts": "num_experts_per_tok",
    "moe_inter_dim": "moe_intermediate_size",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "norm_eps": "rms_norm_eps",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "max_seq_len": "max_position_embeddings",
    # flat config spellings of other fields (same meaning, different word order)
    "n_hash_layers": "_ignored_n_hash_layers",
}
_FLAT_ROPE = {
    "rope_factor": "factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_seq_len": "original_max_position_embeddings",
}
# Keys of HF/flat configs that carry no information for this model (or are documented as unused).
_IGNORED_KEYS = {
    "architectures", "model_type", "text_config", "vision_config", "quantization_config",
    "transformers_version", "torch_dtype", "dtype", "auto_map", "use_cache", "initializer_range",
    "attention_bias", "attention_dropout", "pad_token_id", "image_token_id", "_name_or_path",
    "topk_group", "n_group", "first_k_dense_replace", "num_key_value_heads_per_group",
    "ep_size", "moe_layer_freq", "max_batch_size", "_ignored_n_hash_layers", "expert_dtype",
    "scale_fmt", "vision_start_token_id", "vision_end_token_id", "image_newline_token_id",
}


@dataclass(frozen=True)
class ModelConfig:
    """Every field of docs/design/spec.md §1 under its HF name; see the `flash` preset for the real values."""

    # --- sizes
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    # --- RoPE
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    # --- MoE
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    # --- attention layout
    sliding_window: int = 128
    compress_ratios: tuple = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple = (2, 8, 14, 20)
    index_source_layer_ids: tuple = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: Optional[int] = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # --- mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram
    engram_layer_ids: tuple = (1, 14)
    engram_num_embeddings: tuple = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16_000_000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # --- DSpark (bundled speculative draft, stored as mtp.*)
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- DeepSeek-V4 variants (docs/design/v4.md; read from a `deepseek_v4` config.json by config_v4.py).
    # The defaults are V4.1's: a V4.1 config never sets them (validate() keeps them at these values).
    model_family: str = "deepseek_v41"  # "deepseek_v4": the earlier V4 Flash / Pro checkpoints
    csa_compress_ratio: int = 0  # V4: the compress_ratios value of CSA layers (4); 0 = none (V4.1)
    hca_compress_ratio: int = 0  # V4: the compress_ratios value of HCA layers (128); 0 = none (V4.1)
    hash_layer_ids: tuple = ()  # V4: MoE layers that route by tid2eid[input_ids] instead of the gate's top-k
    mhc_variant: str = "lagged"  # "lagged" (V4.1: pre from the previous sublayer) | "pre_mix" (V4: own pre, hc_head)
    q_head_norm: bool = False  # V4: an unweighted RMSNorm of each query head after wq_b
    weight_block_size: tuple = (32, 32)  # fp8 dense weight blocks (V4: 128x128); () = unquantized weights
    expert_dtype: str = "fp4"  # routed experts in the checkpoint: "fp4" (MXFP4), "fp8" or "bf16"
    draft_kind: str = "dspark"  # what the num_nextn_predict_layers draft stages are: "dspark" | "mtp" (V4 original)
    # V4's release numerics (docs/design/v4.md "Numerics"; `config_v4.RELEASE_NUMERICS`): 0 = not simulated. The
    # fp8 activation block of every fp8 / MXFP4 GEMM input (release 128), the fp8 block of the KV entries' non-RoPE
    # channels (64), the FP4 block of the Hadamard-rotated index queries / keys (32). V4.1's are fixed (spec §6).
    act_quant_block: int = 0
    kv_quant_block: int = 0
    index_fp4_block: int = 0
    # V4 research only (`model.v4.torch_order`): "torch_cpu" computes mHC, RMSNorm and RoPE in the order torch
    # evaluates the release's inference/model.py on an x86 CPU (research/v4_release_forward.py); "" = our own order
    release_order: str = ""
    # --- ours (not in the HF file)
    # "bfloat16" = the reference dtype flow; "float32" = fp32 activations; "exact" = fp32 activations with
    # fp64-accumulated matmuls, for equivalence tests (model/numerics.py)
    act_dtype: str = "bfloat16"
    # The deterministic numerics mode (model/numerics.py): every order-sensitive sum accumulated so that its
    # result does not depend on batch, chunking, mesh or tiling, with `act_dtype`'s roundings kept (with
    # "bfloat16": the reference dtype flow, reproducible; the server's --enable-deterministic-inference).
    deterministic: bool = False
    # Which implementation each op with a fast path runs (`dispatch.parse_impl`): "auto", one of
    # "reference" | "xla" | "pallas" | "pallas_interpret", or "xla,moe=reference"-style per-op items.
    impl: str = "auto"
    # Run each run of >= 2 plan-identical layers as one lax.scan (`layer_scan`; compile time); False =
    # the unrolled Python loop over layers, the reference the scan is tested against.
    layer_scan: bool = True
    name: str = field(default="custom", compare=False)  # a label only: equal models compare equal

    # ------------------------------------------------------------------ construction
    def __post_init__(self):
        for f in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                  "engram_layer_ids", "engram_num_embeddings", "dspark_target_layer_ids", "hash_layer_ids",
                  "weight_block_size"):
            v = getattr(self, f)
            if not isinstance(v, tuple):
                object.__setattr__(self, f, tuple(int(x) for x in v))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _rope_from_dict(self.rope_scaling))
        self.validate()

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """``"flash"``: the real V4.1 Flash values. ``"tiny"``: a small config with every mechanism.
        ``"nano"``: tiny's layout at a trainable width (scripts/train_nano.py). ``"tiny-v4"`` / ``"flash-v4"`` /
        ``"pro-v4"``: DeepSeek-V4 layouts (config_v4.py), which the model refuses to run until V4 is implemented."""
        from dsv41_jax.model import config_v4

        if name in config_v4.PRESETS:
            return config_v4.PRESETS[name](cls)
        if name == "flash":
            return cls(name="flash")
        if name == "tiny":
            return _tiny()
        if name == "nano":
            return _nano()
        raise ConfigError(f"unknown preset {name!r}; known presets: 'flash', 'tiny', 'nano', "
                          f"{', '.join(repr(p) for p in config_v4.PRESETS)}")

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "<dict>") -> "ModelConfig":
        """Build from an HF ``config.json`` dict (top level + text_config) or a flat reference dict; a
        ``deepseek_v4`` one goes to `config_v4.from_v4_dict`."""
        from dsv41_jax.model import config_v4

        if config_v4.is_v4_dict(d):
            return config_v4.from_v4_dict(cls, d, source=source)
        d = dict(d)
        mt = d.get("model_type")
        if mt is not None and mt not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {mt!r} is not one of {MODEL_TYPES}")
        text = d.pop("text_config", None) or {}
        tmt = text.get("model_type")
        if tmt is not None and tmt not in MODEL_TYPES:
            raise ConfigError(f"{source}: text_config.model_type {tmt!r} is not one of {MODEL_TYPES}")
        merged = {**d, **text}  # text_config wins over the top level
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        rope: dict[str, Any] = {}
        unknown = []
        for k, v in merged.items():
            if k in _FLAT_ROPE:
                rope[_FLAT_ROPE[k]] = v
                continue
            if k == "rope_scaling":
                if v:
                    rope.update(v)
                continue
            key = _ALIASES.get(k, k)
            if key in names and key not in ("name",) and key not in config_v4.V4_ONLY_FIELDS:
                kw[key] = v
            elif key not in _IGNORED_KEYS:
                unknown.append(k)
        if unknown:
            log.info("%s: ignoring config keys this model does not use: %s", source, sorted(unknown))
        if rope:
            kw["rope_scaling"] = _rope_from_dict(rope)
        if "num_nextn_predict_layers" not in kw and "compress_ratios" in kw:
            kw["num_nextn_predict_layers"] = len(kw["compress_ratios"]) - kw.get("num_hidden_layers", 40)
        if kw.get("candidate_source_layer_id", 0) is not None and kw.get("candidate_source_layer_id", 0) < 0:
            kw["candidate_source_layer_id"] = None
        for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                  "engram_num_embeddings", "dspark_target_layer_ids"):
            if k in kw:
                if not isinstance(kw[k], (list, tuple)):
                    raise ConfigError(f"{source}: {k} must be a list of integers, got {kw[k]!r}")
                kw[k] = tuple(int(x) for x in kw[k])
        try:
            return cls(name=os.path.basename(os.path.dirname(os.path.abspath(source))) or "custom", **kw)
        except TypeError as e:  # wrong value types in the file
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read a model directory (HF ``config.json`` or flat ``inference/config.json``) or a json file.

        ``"tiny"`` / ``"flash"`` name the presets, ``"nano"`` the bundled trained checkpoint (`resolve_model`).
        """
        from dsv41_jax.model import config_v4

        if path in ("tiny", "flash") or path in config_v4.PRESETS:
            return cls.preset(path)
        path = resolve_model(path)
        if os.path.isdir(path):
            for cand in ("config.json", os.path.join("inference", "config.json")):
                p = os.path.join(path, cand)
                if os.path.isfile(p):
                    path = p
                    break
            else:
                raise ConfigError(f"{path}: no config.json or inference/config.json in this directory")
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such config file or model directory")
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(d, source=path)

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` form (top level with ``text_config`` and ``quantization_config``); a V4
        config gets the release-style V4 file (`config_v4.to_v4_dict`)."""
        from dsv41_jax.model import config_v4

        if self.model_family != "deepseek_v41":
            return config_v4.to_v4_dict(self)
        text = {}
        for f in dataclasses.fields(self):
            if f.name in ("act_dtype", "deterministic", "impl", "layer_scan", "name") or f.name in config_v4.V4_ONLY_FIELDS:
                continue
            v = getattr(self, f.name)
            if isinstance(v, RopeScaling):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            text[f.name] = v
        text["model_type"] = "deepseek_v41_text"
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "quantization_config": {
                "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4",
            },
            "text_config": text,
            "vision_config": {},
            "torch_dtype": "bfloat16",
        }

    # ------------------------------------------------------------------ derived
    @property
    def num_layers_total(self) -> int:
        """Target layers plus DSpark stages (= len(compress_ratios))."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def o_group_in(self) -> int:
        """Input width of one wo_a group: H·head_dim / o_groups (4096 for flash)."""
        return self.num_attention_heads * self.head_dim // self.o_groups

    @property
    def engram_in_dim(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim

    @property
    def key_owner_ids(self) -> tuple:
        """KV sources that are also index sources own index keys."""
        return tuple(i for i in self.kv_source_layer_ids if i in self.index_source_layer_ids)

    @property
    def attention_kinds(self) -> tuple:
        """Per target layer: "window" | "compressed" (V4.1), "sliding" | "csa" | "hca" (V4)."""
        from dsv41_jax.model.config_v4 import attention_kinds

        return attention_kinds(self)

    def layer_plan(self, layer_id: int) -> LayerPlan:
        """What layer ``layer_id`` reads and writes. Raises NotImplementedError for a config the model cannot
        run (a DeepSeek-V4 one): every params / forward / decode builder asks this first."""
        return _layer_plans(self)[layer_id]

    def layer_plans(self) -> tuple:
        return _layer_plans(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def err(fieldname, msg):
            raise ConfigError(f"{fieldname}: {msg}")

        L, S = self.num_hidden_layers, self.num_nextn_predict_layers
        from dsv41_jax.model.config_v4 import validate_family

        validate_family(self, err)
        v41 = self.model_family == "deepseek_v41"
        if L < 1:
            err("num_hidden_layers", f"must be >= 1, got {L}")
        if S < 0:
            err("num_nextn_predict_layers", f"must be >= 0, got {S}")
        if len(self.compress_ratios) != L + S:
            err("compress_ratios", f"has {len(self.compress_ratios)} entries; it needs one per layer plus one "
                f"per DSpark stage = num_hidden_layers + num_nextn_predict_layers = {L} + {S} = {L + S}")
        for i, r in enumerate(self.compress_ratios):
            if r < 0:
                err("compress_ratios", f"entry {i} is {r}; ratios are >= 0")
            if i >= L and r != 0:
                err("compress_ratios", f"entry {i} (DSpark stage {i - L}) is {r}; DSpark stages are window-only (0)")
        for fname, width in (("hidden_size", self.hidden_size), ("q_lora_rank", self.q_lora_rank),
                             ("head_dim", self.head_dim), ("moe_intermediate_size", self.moe_intermediate_size),
                             ("o_groups*o_lora_rank", self.o_groups * self.o_lora_rank),
                             ("(engram_max_ngram_size-1)*engram_n_heads*engram_head_dim", self.engram_in_dim),
                             ("len(dspark_target_layer_ids)*hidden_size",
                              len(self.dspark_target_layer_ids) * self.hidden_size)):
            if width % 32:
                err(fname, f"= {width} is the input width of a quantized matmul and must be a multiple of 32")
        if self.head_dim % 16:
            err("head_dim", f"= {self.head_dim} must be a multiple of 16")
        if self.index_head_dim % 32:
            err("index_head_dim", f"= {self.index_head_dim} must be a multiple of 32")
        if self.engram_layer_ids and self.engram_head_dim % 32:
            err("engram_head_dim", f"= {self.engram_head_dim} must be a multiple of 32")
        rd = self.qk_rope_head_dim
        if rd % 2 or rd <= 0:
            err("qk_rope_head_dim", f"= {rd} must be even and positive")
        if rd > self.index_head_dim:
            err("qk_rope_head_dim", f"= {rd} must be <= index_head_dim = {self.index_head_dim}")
        if rd > self.head_dim:
            err("qk_rope_head_dim", f"= {rd} must be <= head_dim = {self.head_dim}")
        if self.num_key_value_heads != 1:
            err("num_key_value_heads", f"= {self.num_key_value_heads}; V4.1 has one latent KV head")
        if self.num_attention_heads % self.o_groups:
            err("o_groups", f"= {self.o_groups} must divide num_attention_heads = {self.num_attention_heads}")
        if self.n_shared_experts != 1:
            err("n_shared_experts", f"= {self.n_shared_experts}; V4.1 has exactly 1 shared expert")
        if self.scoring_func != "sqrtsoftplus":
            err("scoring_func", f"= {self.scoring_func!r}; only 'sqrtsoftplus' (V4.1) is implemented")
        if self.hidden_act != "silu":
            err("hidden_act", f"= {self.hidden_act!r}; only 'silu' is implemented")
        if not (1 <= self.num_experts_per_tok <= self.n_routed_experts):
            err("num_experts_per_tok", f"= {self.num_experts_per_tok} must be in [1, n_routed_experts]")
        if S and not (1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts):
            err("dspark_num_experts_per_tok", f"= {self.dspark_num_experts_per_tok} must be in "
                f"[1, dspark_n_routed_experts = {self.dspark_n_routed_experts}]")
        if self.gate_temp <= 0:
            err("gate_temp", f"= {self.gate_temp} must be > 0")
        if self.sliding_window < 1:
            err("sliding_window", f"= {self.sliding_window} must be >= 1")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            err("hc_mult/hc_sinkhorn_iters", "must be >= 1")
        if self.rope_scaling.type != "yarn" and (v41 or self.rope_scaling.type != "default"):
            err("rope_scaling.type", f"= {self.rope_scaling.type!r}; only 'yarn' is implemented"
                + ("" if v41 else " (and 'default', no YaRN, for V4)"))
        if self.index_topk < 1:
            err("index_topk", f"= {self.index_topk} must be >= 1")
        if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
            err("candidate_block_size/candidate_topk_blocks", "must be >= 1")
        if self.act_dtype not in ("bfloat16", "float32", "exact"):
            err("act_dtype", f"= {self.act_dtype!r}; use 'bfloat16' (reference numerics), 'float32' or 'exact' "
                             f"(fp64-accumulated matmuls, for equivalence tests)")
        if not isinstance(self.deterministic, bool):
            err("deterministic", f"= {self.deterministic!r} must be a bool")
        if not isinstance(self.layer_scan, bool):
            err("layer_scan", f"= {self.layer_scan!r} must be a bool")
        from dsv41_jax.model.dispatch import ImplError, parse_impl

        try:
            parse_impl(self.impl)
        except ImplError as e:
            err("impl", str(e))

        def check_ids(fname, ids, *, sorted_unique=True):
            for i in ids:
                if not 0 <= i < L:
                    err(fname, f"layer id {i} is outside the target layers 0..{L - 1}")
            if sorted_unique and list(ids) != sorted(set(ids)):
                err(fname, f"= {list(ids)} must be strictly ascending")

        check_ids("kv_source_layer_ids", self.kv_source_layer_ids)
        check_ids("index_source_layer_ids", self.index_source_layer_ids)
        check_ids("engram_layer_ids", self.engram_layer_ids)
        check_ids("dspark_target_layer_ids", self.dspark_target_layer_ids)
        for i in self.kv_source_layer_ids:
            if self.compress_ratios[i] == 0:
                err("kv_source_layer_ids", f"layer {i} is a KV source but its compress_ratio is 0")
        for i in self.index_source_layer_ids:
            if self.compress_ratios[i] == 0:
                err("index_source_layer_ids", f"layer {i} is an index source but its compress_ratio is 0")
            owners = [k for k in self.key_owner_ids if k <= i]
            if not owners:
                err("index_source_layer_ids", f"index source {i} has no key owner (a KV source that is also an "
                    f"index source) at or before it; key owners are {list(self.key_owner_ids)}")
            if self.compress_ratios[owners[-1]] != self.compress_ratios[i]:
                err("index_source_layer_ids", f"index source {i} (ratio {self.compress_ratios[i]}) would score the "
                    f"keys of layer {owners[-1]} (ratio {self.compress_ratios[owners[-1]]}); ratios must match")
        for i in range(L if v41 else 0):  # V4 has no sources: each compressed layer compresses for itself
            r = self.compress_ratios[i]
            if r == 0:
                continue
            srcs = [k for k in self.kv_source_layer_ids if k <= i]
            if not srcs:
                err("kv_source_layer_ids", f"layer {i} has compress_ratio {r} but no KV source at or before it")
            if self.compress_ratios[srcs[-1]] != r:
                err("compress_ratios", f"layer {i} has ratio {r} but its KV source (layer {srcs[-1]}) has ratio "
                    f"{self.compress_ratios[srcs[-1]]}")
            if not [k for k in self.index_source_layer_ids if k <= i]:
                err("index_source_layer_ids", f"layer {i} has compress_ratio {r} but no index source at or before it")
        c = self.candidate_source_layer_id
        if c is not None:
            if c not in self.key_owner_ids:
                err("candidate_source_layer_id", f"= {c} must be a KV source that is also an index source "
                    f"(key owners: {list(self.key_owner_ids)})")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            err("engram_num_embeddings", f"has {len(self.engram_num_embeddings)} entries for "
                f"{len(self.engram_layer_ids)} engram_layer_ids")
        if self.engram_layer_ids:
            if self.engram_max_ngram_size < 2:
                err("engram_max_ngram_size", f"= {self.engram_max_ngram_size} must be >= 2")
            if not 0 <= self.engram_pad_token_id < self.vocab_size:
                err("engram_pad_token_id", f"= {self.engram_pad_token_id} is outside the vocabulary")
            want = _engram_rows(self.engram_layer_ids, self.engram_max_ngram_size, self.engram_n_heads,
                                self.engram_vocab_size)
            for lid, got, exp in zip(self.engram_layer_ids, self.engram_num_embeddings, want):
                if got != exp:
                    err("engram_num_embeddings", f"layer {lid} has {got} rows but the primes rule (engram_vocab_size="
                        f"{self.engram_vocab_size}, {self.engram_n_heads} heads, orders 2..{self.engram_max_ngram_size})"
                        f" gives {exp}")
        if S and self.draft_kind == "dspark":
            if len(self.dspark_target_layer_ids) < 1:
                err("dspark_target_layer_ids", "needs at least one layer when DSpark stages exist")
            if self.dspark_block_size < 1:
                err("dspark_block_size", f"= {self.dspark_block_size} must be >= 1")
            if not 0 <= self.dspark_noise_token_id < self.vocab_size:
                err("dspark_noise_token_id", f"= {self.dspark_noise_token_id} is outside the vocabulary")


def _rope_from_dict(d: dict) -> RopeScaling:
    d = dict(d)
    if "rope_type" in d and "type" not in d:
        d["type"] = d.pop("rope_type")
    d.pop("rope_type", None)
    d.pop("mscale", None)
    d.pop("mscale_all_dim", None)
    known = {f.name for f in dataclasses.fields(RopeScaling)}
    extra = set(d) - known
    if extra:
        log.info("rope_scaling: ignoring %s", sorted(extra))
    return RopeScaling(**{k: v for k, v in d.items() if k in known})


def _engram_rows(layer_ids, max_ngram, n_heads, vocab) -> list:
    from dsv41_jax.model.engram_tables import engram_primes  # local: keeps config import light

    primes = engram_primes(tuple(layer_ids), max_ngram, n_heads, vocab)
    return [sum(sum(p) for p in primes[lid]) for lid in layer_ids]


@functools.lru_cache(maxsize=64)
def _layer_plans(cfg: ModelConfig) -> tuple:
    if cfg.model_family != "deepseek_v41":
        from dsv41_jax.model.config_v4 import refusal

        raise NotImplementedError(refusal(cfg))
    plans = []
    L = cfg.num_hidden_layers
    for i in range(cfg.num_layers_total):
        r = cfg.compress_ratios[i]
        dspark = i >= L
        if dspark or r == 0:
            plans.append(LayerPlan(i, r, False, None, False, None, None, False, False,
                                   (not dspark) and i in cfg.engram_layer_ids, False, dspark))
            continue
        kv_src = max(k for k in cfg.kv_source_layer_ids if k <= i)
        idx_src = max(k for k in cfg.index_source_layer_ids if k <= i)
        is_idx = i in cfg.index_source_layer_ids
        owner = max(k for k in cfg.key_owner_ids if k <= i) if is_idx else None
        c = cfg.candidate_source_layer_id
        plans.append(LayerPlan(
            layer_id=i, compress_ratio=r, is_kv_source=i in cfg.kv_source_layer_ids, kv_source=kv_src,
            is_index_source=is_idx, index_source=idx_src, key_owner=owner,
            uses_candidates=is_idx and c is not None and i > c, is_candidate_source=(c == i),
            is_engram=i in cfg.engram_layer_ids, yarn=True, is_dspark=False))
    return tuple(plans)


def _tiny() -> ModelConfig:
    """Small config that exercises every mechanism (docs/design/spec.md §1's list).

    10 layers + 3 DSpark stages: 0-1 window only; 2-5 ratio 2 with KV sources 2 and 4 (3 and 5 consume);
    6-9 ratio 1 with KV source 6 = candidate source; index sources 2, 4, 6 own keys, 8 re-scores 6's keys
    inside the candidate blocks; 3, 5, 7, 9 reuse a top-k. Engram at 1 (before the first source) and 4.
    """
    special = _special_ids(TINY_DIR)
    return ModelConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=10, num_attention_heads=4, head_dim=64,
        qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=32, max_position_embeddings=4096,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        sliding_window=8, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layer_ids=(2, 4, 6), index_source_layer_ids=(2, 4, 6, 8), index_n_heads=4,
        index_head_dim=32, index_topk=4, candidate_source_layer_id=6, candidate_topk_blocks=3,
        candidate_block_size=2,
        engram_layer_ids=(1, 4), engram_num_embeddings=tuple(_engram_rows((1, 4), 4, 2, 50)),
        engram_max_ngram_size=4, engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32,
        engram_pad_token_id=special.get("pad", 2),
        engram_compressed_vocab_size=_compressed_vocab(TINY_DIR),
        num_nextn_predict_layers=3, dspark_block_size=3, dspark_noise_token_id=special.get("system", 313),
        dspark_target_layer_ids=(7, 8, 9), dspark_markov_rank=16, dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2, name="tiny",
    )


def _nano() -> ModelConfig:
    """The trained toy (scripts/train_nano.py): tiny's layer layout, wider, with its own tokenizer.

    Every mechanism is present as in tiny (window-only layers 0-1, ratio-2 sources 2/4, ratio-1
    source 6 = candidate source, index sources 2/4/6/8 with 8 re-scoring, Engram at 1 and 4, MoE,
    mHC, 3 DSpark stages). The retrieval budgets (index_topk, candidate blocks) cover every slot of a
    training sequence (<= 256 tokens): the indexers get no gradient through their discrete top-k, so
    at training lengths they select everything and the attention learns over full context.
    The tokenizer is nano's word-level one (assets/nano, 771 ids; vocab_size rounds it up to 800, a
    multiple of the 32-row fp8 blocks), which sets the special ids and Engram's compressed vocabulary.
    """
    special = _special_ids(NANO_DIR)
    return _tiny().replace(
        vocab_size=800, hidden_size=128, num_attention_heads=4, head_dim=64, q_lora_rank=64, o_groups=2,
        o_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=32,
        index_topk=256, candidate_topk_blocks=32, candidate_block_size=8, dspark_block_size=5,
        dspark_markov_rank=32, engram_pad_token_id=special.get("pad", 2),
        engram_compressed_vocab_size=_compressed_vocab(NANO_DIR),
        dspark_noise_token_id=special.get("system", 764), name="nano")


def preset_tokenizer_dir(cfg: "ModelConfig") -> str:
    """The bundled tokenizer directory a preset's random init uses (nano's for "nano", else tiny's)."""
    return NANO_DIR if cfg.name == "nano" else TINY_DIR


@functools.lru_cache(maxsize=None)
def _special_ids(directory: str) -> dict:
    p = os.path.join(directory, "special_tokens.json")
    if not os.path.isfile(p):
        return {}
    with open(p, encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def _compressed_vocab(directory: str) -> int:
    from dsv41_jax.model.engram_tables import load_engram_token_map

    _, count = load_engram_token_map(os.path.join(directory, "tokenizer.json"))
    return int(count)

