"""Starting and stopping `python -m dsv41_jax.serve` for the live-server tests (one launcher for all)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from xla_flags import compile_speed_flags

START_TIMEOUT = 900  # a hang guard: a cold start takes ~40 s idle, ~5 min on a loaded 2-core VM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd() -> list:
    # DSV41_TEST_SERVE_CMD points the tests at another launcher of the same CLI
    return os.environ.get("DSV41_TEST_SERVE_CMD", f"{sys.executable} -m dsv41_jax.serve").split()


def user_env() -> dict:
    """This process's environment as a user's shell would have it: no ``DSV41_*`` test settings and none
    of the test session's XLA_FLAGS (its 8 host CPU devices) but the compile-speed settings the suite
    picks for every process it compiles in (conftest: on the CPU, -O0 and the fusion emitters off, which
    only change how long a compile takes and the last fp32 bit, and `xla_flags.COMPILE_ONLY_FLAGS`, which
    change only how long it takes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_") and k != "XLA_FLAGS"}
    keep = compile_speed_flags(os.environ.get("XLA_FLAGS", ""))
    if keep:
        env["XLA_FLAGS"] = " ".join(keep)
    return env


def start_server(flags, log_path, cache_dir, env_extra=None, *, env=None, cwd=None, timeout=START_TIMEOUT):
    """(proc, base URL, log file) of a server started with `flags` (plus a free --port), once /health
    answers 200. env: the whole environment (default: this process's); cache_dir: its
    JAX_COMPILATION_CACHE_DIR ("none": none); env_extra: added on top. Raises RuntimeError with the
    log's tail if the server exits or is not healthy within `timeout` seconds."""
    port = free_port()
    env = dict(os.environ if env is None else env)
    if str(cache_dir).lower() == "none":  # DSV41_TEST_JAX_CACHE=none: no persistent cache (conftest)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")
    env.update(env_extra or {})
    logf = open(log_path, "w")
    proc = subprocess.Popen(serve_cmd() + list(flags) + ["--port", str(port)], stdout=logf,
                            stderr=subprocess.STDOUT, env=env, cwd=cwd)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            logf.close()
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"server did not start:\n{open(log_path).read()[-4000:]}")
        time.sleep(0.5)
    return proc, base, logf


def stop_server(proc, logf, timeout=60):
    """SIGTERM, wait (kill after `timeout`), close the log; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    else:
        rc = proc.returncode
    logf.close()
    return rc
