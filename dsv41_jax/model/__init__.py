"""DeepSeek-V4.1 Flash model: config → params → reference forward."""

from dsv41_jax.model.checkpoint import CheckpointError, checkpoint_kind, load_model, load_params
from dsv41_jax.model.config import ConfigError, LayerPlan, ModelConfig, RopeScaling
from dsv41_jax.model.decode import generate
from dsv41_jax.model.params import (declare_params, engram_token_map_for, init_params, logical_axes,
                                    mesh_shardings, param_shapes, param_stats)
from dsv41_jax.model.transformer import forward

__all__ = [
    "ConfigError", "LayerPlan", "ModelConfig", "RopeScaling", "declare_params", "engram_token_map_for",
    "init_params", "logical_axes", "mesh_shardings", "param_shapes", "param_stats", "forward",
    "CheckpointError", "checkpoint_kind", "load_model", "load_params", "generate",
]
