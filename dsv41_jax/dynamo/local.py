"""A local Dynamo deployment: our frontend and N workers on this machine, no etcd / NATS.

    python -m dsv41_jax.dynamo.local --workers 2 --port 8000 -- --model nano     # Ctrl-C stops them all
    python -m dsv41_jax.dynamo.local --prefill-workers 1 --workers 1 -- --model nano   # prefill + decode

`LocalDeployment` starts and stops the processes (scripts/dynamo_local.sh, tests/test_dynamo.py and
scripts/bench_dynamo.py use it): every process gets file discovery in a fresh directory, the tcp request
plane, the zmq event plane and 127.0.0.1 for every address Dynamo would otherwise pick from the network
interfaces; worker i serves its counters on its system port (``POST /engine/control/stats``). Logs go to
one file per process in ``log_dir``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

__all__ = ["LocalDeployment", "main", "system_ports"]

LOCAL_ENV = {"DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
             "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
             "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1"}


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def system_ports(n: int, start: Optional[int] = None) -> list:
    """n free ports below 32768 (Dynamo reads DYN_SYSTEM_PORT as a signed 16-bit value)."""
    out = []
    for port in range(start or 20000 + os.getpid() % 10000, 32768):
        if _free(port):
            out.append(port)
            if len(out) == n:
                return out
    raise RuntimeError("no free ports below 32768")


class LocalDeployment:
    """Processes of one local deployment. ``env``: the environment they start from (default: this
    process's); ``log_dir``: where their logs go (default: a fresh temporary directory)."""

    def __init__(self, *, env: Optional[dict] = None, log_dir: Optional[str] = None, python: str = sys.executable):
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="dsv41-dynamo-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.env.update(LOCAL_ENV)
        self.env["DYN_FILE_KV"] = os.path.join(self.log_dir, "discovery")  # its own: no other deployment's workers
        self.python = python
        self.procs: dict = {}  # name -> (Popen, log path, log file)
        self.worker_ports: dict = {}  # worker name -> system port
        self.frontend_url: Optional[str] = None

    def _spawn(self, name: str, args: list, extra_env: Optional[dict] = None) -> subprocess.Popen:
        path = os.path.join(self.log_dir, f"{name}.log")
        f = open(path, "w")
        p = subprocess.Popen([self.python, "-m", *args], stdout=f, stderr=subprocess.STDOUT,
                             env={**self.env, **(extra_env or {})})
        self.procs[name] = (p, path, f)
        return p

    def start_worker(self, name: str, engine_flags: list, system_port: Optional[int] = None) -> int:
        taken = list(self.worker_ports.values())
        port = system_port or system_ports(1, start=max(taken) + 1 if taken else None)[0]
        self._spawn(name, ["dsv41_jax.dynamo", *engine_flags], {"DYN_SYSTEM_PORT": str(port)})
        self.worker_ports[name] = port
        return port

    def start_frontend(self, port: int, router_mode: str = "kv", extra: Optional[list] = None) -> str:
        self._spawn("frontend", ["dsv41_jax.dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                                 "--router-mode", router_mode, *(extra or [])])
        self.frontend_url = f"http://127.0.0.1:{port}"
        return self.frontend_url

    def stop(self, name: str, timeout: float = 60) -> int:
        """SIGTERM, wait (kill after ``timeout``), close the log; returns the exit code."""
        p = self.procs[name][0]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        return self._reap(name, timeout)

    def _reap(self, name: str, timeout: float) -> int:
        p, _, f = self.procs.pop(name)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        f.close()
        self.worker_ports.pop(name, None)
        return p.returncode

    def stop_all(self, timeout: float = 60) -> None:
        """SIGTERM to every process at once (each drains for Dynamo's grace period side by side), then wait."""
        for p, _, _ in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name in list(self.procs)[::-1]:
            self._reap(name, timeout)

    def wait(self, pred, what: str, timeout: float = 900) -> None:
        """Until pred() is true; raises RuntimeError (with the log's tail) if a process exits first."""
        t0 = time.time()
        while True:
            for name, (p, path, _) in self.procs.items():
                if p.poll() is not None:
                    with open(path) as f:
                        tail = f.read()[-4000:]
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}:\n{tail}")
            try:
                if pred():
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.time() - t0 > timeout:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (logs: {self.log_dir})")
            time.sleep(0.5)

    def wait_ready(self, model: Optional[str] = None, timeout: float = 900) -> None:
        """Every worker ready and registered with the frontend (and ``model`` listed)."""
        for name, port in self.worker_ports.items():
            self.wait(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"] == "ready",
                      f"{name} to be ready", timeout)

        def registered():
            h = httpx.get(self.frontend_url + "/health", timeout=2).json()
            ids = {i["instance_id"] for i in h.get("instances", []) if i.get("endpoint") == "generate"}
            names = [m["id"] for m in httpx.get(self.frontend_url + "/v1/models", timeout=2).json()["data"]]
            return len(ids) == len(self.worker_ports) and (model is None or model in names)

        self.wait(registered, "the frontend to see every worker", timeout)

    def stats(self, name: str) -> dict:
        """A worker's own counters (`worker` engine_control "stats")."""
        r = httpx.post(f"http://127.0.0.1:{self.worker_ports[name]}/engine/control/stats", json={}, timeout=60)
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "ok":
            raise RuntimeError(f"{name} stats: {body}")
        return body["stats"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41_jax.dynamo.local",
                                 description="Our Dynamo frontend and N aggregated (or P prefill + N decode) workers "
                                             "on this machine (no etcd / "
                                             "NATS); the arguments after -- are the workers' engine flags. Ctrl-C "
                                             "stops every process.")
    ap.add_argument("--workers", type=int, default=2,
                    help="aggregated workers; with --prefill-workers: decode workers")
    ap.add_argument("--prefill-workers", type=int, default=0,
                    help="prefill workers (prefill/decode disaggregation: --workers are then decode workers; the "
                         "request's state moves from prefill to decode worker through NIXL)")
    ap.add_argument("--port", type=int, default=8000, help="the frontend's HTTP port")
    ap.add_argument("--router-mode", default="kv", choices=("kv", "round-robin", "random"))
    ap.add_argument("--log-dir", default=None, help="one log per process (default: a temporary directory)")
    ap.add_argument("engine_flags", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    flags = a.engine_flags[1:] if a.engine_flags[:1] == ["--"] else a.engine_flags
    if a.workers < 1 or a.prefill_workers < 0:
        ap.error("--workers must be >= 1 and --prefill-workers >= 0")
    d = LocalDeployment(log_dir=a.log_dir)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        if a.prefill_workers:
            for i in range(a.prefill_workers):
                d.start_worker(f"prefill{i}", [*flags, "--disaggregation-mode", "prefill"])
            for i in range(a.workers):
                d.start_worker(f"decode{i}", [*flags, "--disaggregation-mode", "decode"])
            layout = f"{a.prefill_workers} prefill + {a.workers} decode worker(s)"
        else:
            for i in range(a.workers):
                d.start_worker(f"worker{i}", flags)
            layout = f"{a.workers} worker(s)"
        url = d.start_frontend(a.port, a.router_mode)
        print(f"frontend {url}/v1 (router: {a.router_mode}), {layout} starting; logs in {d.log_dir}", flush=True)
        d.wait_ready()
        print(f"ready: {', '.join(f'{n} (stats: POST 127.0.0.1:{p}/engine/control/stats)' for n, p in d.worker_ports.items())}",
              flush=True)
        while not stop and all(p.poll() is None for p, _, _ in d.procs.values()):
            time.sleep(1)
        if not stop:
            print(f"a process exited; see {d.log_dir}", file=sys.stderr)
            return 1
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        d.stop_all()


if __name__ == "__main__":
    sys.exit(main())
