"""Sharded execution: the device mesh (`mesh`), the one table from logical axes to mesh axes and every
sharding derived from it (`rules`), and the `shard_map`'d collectives the model calls when it runs on
a mesh (`collectives`: expert-parallel MoE, row-sharded table gathers), handed to the model as one
`plan.MeshPlan` (with the mesh entry points `plan.jitted_extend` / `plan.load_params`).

This package sits above `dsv41_jax.model` (it imports the model; the model never imports it) and
below `dsv41_jax.serving` (never imported here); tests/test_import_graph.py checks both.
"""
