"""dsv41_jax: DeepSeek-V4.1 Flash inference in JAX/Pallas."""

__version__ = "0.1.0"
