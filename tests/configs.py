"""Small configs shared by tests that need the model's machinery but not tiny's whole layout."""

from dsv41_jax.model.config import ModelConfig, _engram_rows


def micro() -> ModelConfig:
    """tiny cut to 3 layers (window-only, ratio-2 source, ratio-1 source + candidate source, Engram at 1)
    and 1 DSpark stage: every mechanism of a step, at a third of tiny's compile time."""
    return ModelConfig.preset("tiny").replace(
        num_hidden_layers=3, compress_ratios=(0, 2, 1, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2), candidate_source_layer_id=2, engram_layer_ids=(1,),
        engram_num_embeddings=tuple(_engram_rows((1,), 4, 2, 50)), num_nextn_predict_layers=1,
        dspark_target_layer_ids=(2,), name="micro")


def e64() -> ModelConfig:
    """`micro` with 64 routed experts, top-6: decode-sized steps route fewer assignments than there are
    experts, so the grouped MoE gathers only the selected ones and most experts get no token. The
    layers are micro's (every attention mechanism once): what this config is for is the MoE."""
    return micro().replace(n_routed_experts=64, num_experts_per_tok=6, name="e64")
