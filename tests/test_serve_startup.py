"""Start-up refusals of ``python -m dsv41_jax.serve`` as a user meets them (issue 49): each is one
``error: ...`` line and exit status 2, before the model loads or anything compiles, with no traceback
and no JAX noise. Each run stops before the compile, so the file takes seconds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from servers import free_port, serve_cmd, user_env

from dsv41_jax.serve import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(flags, **env_extra) -> subprocess.CompletedProcess:
    env = user_env()
    env.pop("JAX_PLATFORMS", None)  # as a user's shell has it: JAX probes its backends
    env.update(env_extra)
    return subprocess.run(serve_cmd() + ["--model", "tiny"] + flags, capture_output=True, text=True, timeout=300,
                          env=env)


def _refused(r: subprocess.CompletedProcess) -> str:
    """The one error line of a refused start (status 2, no traceback, nothing after it)."""
    assert r.returncode == 2, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), r.stderr[-3000:]
    assert "Unable to initialize backend" not in out, out[-3000:]  # JAX's INFO lines about tpu / proxy
    return last


def test_port_in_use_is_refused_before_loading():
    """It used to compile for ~40 s, log "serving ... on http://...", then die with uvicorn's raw
    "[Errno 98] address already in use" (status 3)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve(["--port", str(port)])
    line = _refused(r)
    assert f"127.0.0.1:{port}" in line and "in use" in line and "--port" in line, line
    assert "engine:" not in r.stderr and "serving" not in r.stderr  # nothing was loaded


def test_mesh_larger_than_the_devices_names_the_cpu_flag():
    """--tp-size 2 on a one-device CPU: a traceback came first; now one line with the XLA_FLAGS hint."""
    line = _refused(_serve(["--tp-size", "2", "--port", str(free_port())], JAX_PLATFORMS="cpu"))
    assert "tp=2 x ep=1 needs 2 devices, only 1" in line, line
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in line, line


def test_served_model_name_help_names_the_real_default():
    """The default model is nano, not tiny: the help said "(default: 'tiny' or the model directory's name)"."""
    (action,) = [a for a in build_parser()._actions if "--served-model-name" in a.option_strings]
    assert "'nano'" in action.help and "default: 'tiny'" not in action.help, action.help


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt") / "tiny-v4"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_checkpoint.py"), "--preset", "tiny-v4",
                    "--out", str(ckpt)], check=True, capture_output=True, timeout=300)
    return str(ckpt)


def test_v4_checkpoint_passes_the_start_up_checks(v4_ckpt):
    """A DeepSeek-V4 checkpoint is served (issue 48; tests/test_v4_server.py drives the app on one): the start-up
    no longer refuses it — here it gets as far as the port check, which comes after the checkpoint's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _serve(["--model", v4_ckpt, "--port", str(port)], JAX_PLATFORMS="cpu")
    line = _refused(r)
    assert f"127.0.0.1:{port}" in line and "in use" in line, line
    assert "DeepSeek-V4" not in r.stderr


def test_v4_with_what_it_lacks_is_one_line(v4_ckpt):
    """What V4 serving does not do (DSPARK on a checkpoint whose draft is an MTP layer, a quantized KV cache) is
    refused in one line before anything loads."""
    r = _serve(["--model", v4_ckpt, "--speculative-algorithm", "DSPARK", "--port", str(free_port())],
               JAX_PLATFORMS="cpu")
    line = _refused(r)
    assert line.startswith("error: DeepSeek-V4 checkpoint: not supported with --speculative-algorithm DSPARK"), line
    assert "engine:" not in r.stderr  # refused before the engine started
    assert "draft is an MTP layer" in line, line
    line = _refused(_serve(["--model", v4_ckpt, "--kv-cache-dtype", "fp8_e4m3", "--port", str(free_port())],
                           JAX_PLATFORMS="cpu"))
    assert "DeepSeek-V4 checkpoint: not supported with --kv-cache-dtype fp8_e4m3" in line, line


def test_unreadable_model_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    line = _refused(_serve(["--model", str(tmp_path), "--port", str(free_port())], JAX_PLATFORMS="cpu"))
    assert str(tmp_path) in line, line
