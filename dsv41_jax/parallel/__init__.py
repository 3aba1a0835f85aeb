"""Sharded execution: the device mesh (`mesh`), the one table from logical axes to mesh axes and every
sharding derived from it (`rules`), and the `shard_map`'d collectives the model calls when it runs on
a mesh (`collectives`: expert-parallel MoE, row-sharded table gathers).

Nothing here imports `dsv41_jax.serving`; `dsv41_jax.model` imports this package lazily, only when a
mesh is passed.
"""
