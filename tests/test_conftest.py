"""The test processes' XLA settings (tests/conftest.py): 8 host devices whatever XLA_FLAGS the shell had,
and XLA's CPU backend at -O0 unless asked otherwise (`conftest._with_test_opt_level`)."""

import os

import pytest

import conftest
import goldens
from xla_flags import OPT_FLAG, opt_level_flag


def test_this_run_compiles_as_chosen():
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=8" in flags
    levels = [f for f in flags if f.split("=", 1)[0] == OPT_FLAG]
    assert len(levels) <= 1 and opt_level_flag(os.environ["XLA_FLAGS"]) == (levels[0] if levels else None)
    if os.environ.get(conftest.OPT_ENV, "0") == "0" and not conftest._accelerator_plugin():
        assert levels, flags  # the default choice is applied ...
    assert (goldens.machine().endswith("| xla -O" + levels[0].split("=")[1]) if levels
            else "xla -O" not in goldens.machine())  # ... and a golden records it


def test_opt_level_choice(monkeypatch):
    monkeypatch.setattr(conftest, "_accelerator_plugin", lambda: None)
    monkeypatch.delenv(conftest.OPT_ENV, raising=False)
    flags, why = conftest._with_test_opt_level("--a=1")
    assert flags.split() == ["--a=1", "--xla_backend_optimization_level=0"] and "-O0" in why
    # the shell's own level is kept, whatever DSV41_TEST_XLA_OPT says
    monkeypatch.setenv(conftest.OPT_ENV, "default")
    assert conftest._with_test_opt_level("--xla_backend_optimization_level=2")[0] == "--xla_backend_optimization_level=2"
    assert conftest._with_test_opt_level("--a=1")[0] == "--a=1"  # XLA's default
    monkeypatch.setenv(conftest.OPT_ENV, "O3")
    with pytest.raises(pytest.UsageError, match=conftest.OPT_ENV):
        conftest._with_test_opt_level("")
    monkeypatch.delenv(conftest.OPT_ENV)
    monkeypatch.setattr(conftest, "_accelerator_plugin", lambda: "xla_cuda12")
    flags, why = conftest._with_test_opt_level("")
    assert flags == "" and "xla_cuda12" in why


def test_golden_identity_names_the_level(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    base = goldens.machine()
    assert "xla -O" not in base
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --x=1")
    assert goldens.machine() == base + " | xla -O0"
