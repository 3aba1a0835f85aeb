"""Small configs shared by tests that need the model's machinery but not tiny's whole layout."""

from dsv41_jax.model.config import ModelConfig, _engram_rows


def mini() -> ModelConfig:
    """tiny cut to 6 layers that keep every mechanism of tiny's layout once, for the relational tests
    (decode ≡ forward, xla ≡ reference, Pallas ≡ xla, scan ≡ unrolled; the goldens stay on tiny): 0 window
    only; 1 ratio-2 KV + index source with Engram; 2 reads 1's store and reuses its top-k; 3 ratio-1 KV +
    index source = candidate source; 4 re-scores 3's keys inside the candidate blocks; 5 reuses 4's
    top-k; 3 DSpark stages reading layers 3-5. Its forward compiles in ~0.64x tiny's time."""
    return ModelConfig.preset("tiny").replace(
        num_hidden_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0, 0), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3, engram_layer_ids=(1,),
        engram_num_embeddings=tuple(_engram_rows((1,), 4, 2, 50)), dspark_target_layer_ids=(3, 4, 5),
        name="mini")


def micro() -> ModelConfig:
    """tiny cut to 3 layers (window-only, ratio-2 source, ratio-1 source + candidate source, Engram at 1)
    and 1 DSpark stage: every mechanism of a step, at a third of tiny's compile time."""
    return ModelConfig.preset("tiny").replace(
        num_hidden_layers=3, compress_ratios=(0, 2, 1, 0), kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2), candidate_source_layer_id=2, engram_layer_ids=(1,),
        engram_num_embeddings=tuple(_engram_rows((1,), 4, 2, 50)), num_nextn_predict_layers=1,
        dspark_target_layer_ids=(2,), name="micro")


def quad() -> ModelConfig:
    """`micro` plus a 4th layer that re-scores layer 2's keys inside its candidate blocks (ratio 1, reading
    2's store: tiny's layer 8, mini's 4), so every mechanism an attention / indexer kernel is handed in
    tiny's layout (window-only, ratio-2 and ratio-1 compressed attention, index sources that own keys, the
    candidate source and a candidate-masked re-score) runs once, in 4 layers. What it leaves out of mini
    is model plumbing that hands a kernel nothing new (a layer reusing another's top-k, 3 DSpark stages):
    for the fast path ≡ reference / Pallas ≡ xla relations (tests/test_fastpath_attention.py)."""
    return micro().replace(
        num_hidden_layers=4, compress_ratios=(0, 2, 1, 1, 0), index_source_layer_ids=(1, 2, 3), name="quad")


def e64() -> ModelConfig:
    """`micro` with 64 routed experts, top-6: decode-sized steps route fewer assignments than there are
    experts, so the grouped MoE gathers only the selected ones and most experts get no token. The
    layers are micro's (every attention mechanism once): what this config is for is the MoE."""
    return micro().replace(n_routed_experts=64, num_experts_per_tok=6, name="e64")


def write_checkpoint(cfg: ModelConfig, path) -> str:
    """`cfg`'s random parameters (seed 0) saved in the release layout at `path` (tiny's tokenizer files),
    for tests that serve a small config through `--model DIR`; returns the directory as a string."""
    import jax

    from dsv41_jax.model.checkpoint import save_hf_checkpoint
    from dsv41_jax.model.params import init_params

    save_hf_checkpoint(init_params(cfg, jax.random.key(0)), cfg, str(path), shards=1)
    return str(path)


def mesh_micro() -> ModelConfig:
    """`micro` with 8 draft experts (tiny's draft has 4), so that every mesh of the 8 fake CPU devices the
    engine accepts (ep up to 8) also splits the DSpark draft's experts: the serving-on-a-mesh tests."""
    return micro().replace(dspark_n_routed_experts=8, name="mesh_micro")


def micro_v4() -> ModelConfig:
    """tiny-v4 cut to 3 layers that keep each V4 mechanism once, for the relational tests (paged step ≡ forward,
    mesh / dp ≡ one device, MTP greedy ≡ plain greedy; the goldens, the torch / transformers references, checkpoint
    round trips and preset shapes stay on tiny-v4): 0 sliding-window attention with hash-routed MoE (tid2eid), 1 CSA
    (ratio 4, the Lightning indexer) and 2 HCA (ratio 8), both with learned routing; tiny-v4's MTP layer (sliding)."""
    return ModelConfig.preset("tiny-v4").replace(
        num_hidden_layers=3, compress_ratios=(0, 4, 8, 0), hash_layer_ids=(0,), name="micro-v4")


def micro_v4_dspark() -> ModelConfig:
    """`micro_v4` with tiny-v4-dspark's head (`config_v4.with_dspark`: 3 sliding stages, block 3, Markov rank 16), its
    features from the last three target layers' outputs: all of micro-v4's (0, 1, 2), as tiny-v4-dspark's 3..5."""
    from dsv41_jax.model.config_v4 import with_dspark

    return with_dspark(micro_v4())
