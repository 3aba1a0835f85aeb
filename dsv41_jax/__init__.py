"""dsv41_jax: DeepSeek-V4.1 Flash inference in JAX/Pallas."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineArgs"]


def __getattr__(name):  # lazy: `import dsv41_jax` stays light (no jax import)
    if name == "LLM":
        from dsv41_jax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from dsv41_jax.serving.sampling import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from dsv41_jax.serving.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'dsv41_jax' has no attribute {name!r}")
