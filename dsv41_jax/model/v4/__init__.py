"""DeepSeek-V4 (the earlier Flash / Pro checkpoints) beside V4.1: its variants of the shared operations.

docs/design/v4.md has the difference table and the mechanisms. Each module here is a V4 variant that
calls the shared op it varies (nothing of V4.1 is copied):

* `linear` — V4's weight kinds on the shared matmul kinds: plain (bf16 / fp32, as transformers saves them)
  or fp8 with ``weight_block_size`` blocks (`quant.dequantize_fp8_block`'s ``block``), MXFP4 experts
  through `model.linear.mxfp4`; in the release numerics the linear kernel with V4's blocks;
* `compressor` — every CSA / HCA layer's own compressor: the learned position bias ``ape`` on the scores and
  (CSA) overlapping windows, pooled by the shared `compressor.pool_groups`;
* `attention` — the attention sublayer of sliding / CSA / HCA layers: per-head q RMS norm (``q_head_norm``),
  CSA's Lightning indexer on its own keys (V4.1's indexer seam `indexer.topk`), the shared `attention.attend`
  (window + compressed entries + sink; the paged step: V4.1's seam `attention.sparse_attention`);
* `moe` — hash routing (``tid2eid[input_ids]``) as the index source of the shared `moe.route`; experts and
  the shared expert by the shared `moe.swiglu_expert`;
* `mhc` — the pre-mix ordering (each sublayer collapsed with its own pre) on the shared `mhc.hc_mixes` /
  `hc_pre` / `sublayer_exit`, and the model-level ``hc_head`` collapse;
* `numerics` — the release's quantization simulation (fp8 GEMM inputs, fp8 KV, Hadamard + FP4 index q / k, the bf16
  head norm), each hook a no-op while its ``config_v4.RELEASE_NUMERICS`` block is 0;
* `params` — the declaration (release tensor names) and random init; `checkpoint` — reading a V4 directory
  (the release names and what transformers' ``save_pretrained`` writes);
* `transformer` — the full-sequence reference forward; `decode` — the paged incremental step (prefill chunks
  and decode tokens) with V4's per-layer compressor state, ≡ the forward in the exact mode;
* `mtp` — the original releases' MTP draft layer (``draft_kind`` "mtp": V4's layer on mixed embedding / target
  streams, its own hc_head), reference and paged; `dspark` — the DSpark head of Flash-0731 / Pro-0813
  (``draft_kind`` "dspark": V4.1's block proposal, `model.dspark`, on V4 layers fed by the target layers'
  outputs); `speculative` — model-level greedy decoding, plain and with MTP or DSpark speculation verified by
  `decode.extend` (== plain greedy in the exact mode).

The engine runs `decode` through `serving.model_step.V4Step`, MTP through `serving.mtp_speculative` and the DSpark
head through `serving.v4_dspark_speculative`, on one device or a tp x ep mesh (the forward, `decode`, `mtp` and `dspark`
take a `parallel.plan.MeshPlan`; V4's tensors in the one rules table, `parallel.rules`; docs/design/v4.md "Mesh").
Pallas kernels: V4.1's grouped MXFP4 experts kernel (moe op), mHC enter / exit kernels (mhc op), sparse-attention
and index kernels (attention and indexer ops), and in the release numerics its fused fp8 / MXFP4 GEMM kernel with
V4's blocks declared (linear op), through the one dispatch (`v4.moe`, `v4.mhc`, `v4.attention.seam_impl`,
`v4.linear.kernel_impl`). Not here yet (refused in one line where reached, `config_v4.refusal` /
`v4.transformer.kernel_refusal` / `V4Step.refuse`): data-parallel attention, the engram kernel, the linear kernel
outside the release numerics (docs/design/v4.md "Kernels").
"""
