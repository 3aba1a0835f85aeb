"""The warm-up's log line tells compiled programs from programs loaded from the persistent compilation
cache: `engine.CacheLoads` counts JAX's cache hits. Checked in a subprocess with its own empty cache
directory (the run's shared cache and in-memory caches stay out of it): the first compile of a program
is not a load, the same program traced again by a new `jit` is one."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from dsv41_jax.serving.engine import CacheLoads

    def fresh():  # a new function object each time: a new trace, so the in-memory caches miss
        return jax.jit(lambda x: jnp.tanh(x) * 3.0 + 0.5)

    x = jnp.ones(7)
    with CacheLoads() as cold:
        fresh()(x).block_until_ready()
    with CacheLoads() as warm:
        fresh()(x).block_until_ready()
    fresh()(x).block_until_ready()  # outside the context: not counted by either
    print(json.dumps([cold.count, warm.count]))
""")


def test_cache_loads_counts_persistent_cache_hits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, 1]
