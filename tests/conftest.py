"""Shared fixtures: the tiny config and its random parameters (built once per session)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

from dsv41_jax.model import ModelConfig, init_params  # noqa: E402


@pytest.fixture(scope="session")
def tiny_cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session")
def tiny_cfg32(tiny_cfg):
    return tiny_cfg.replace(act_dtype="float32")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0))
