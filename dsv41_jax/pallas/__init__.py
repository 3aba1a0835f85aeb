"""The Pallas kernels (docs/design/architecture.md, "Dispatch").

Importing this package imports every kernel module, and each registers its (op, variant) entries — kernel,
reference, `supports` predicate — in `dsv41_jax.model.dispatch`'s registry (`dispatch.register`). The model
never imports this package at import time: `dispatch` imports it the first time a kernel implementation is
resolved. `common` holds what more than one kernel shares; `costs` the benchmark inputs and bytes-moved
contracts; `offline` the Triton-IR capture for checks without a GPU.
"""

from dsv41_jax.pallas import (  # noqa: F401  (each registers its kernels)
    engram_gather,
    indexer_topk,
    mhc_mix,
    moe_mxfp4,
    moe_route,
    o_proj,
    quant_linear,
    sparse_attention,
    window_codes,
)
