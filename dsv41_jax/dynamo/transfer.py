"""Moving a prefilled request's state between Dynamo workers: NIXL (UCX) READs of host memory.

Prefill/decode disaggregation (`worker`): the prefill worker's engine exports the request's state
(`serving.handover.PrefilledState`, packed to one ``uint8`` buffer and a JSON manifest); the buffer
stays in the prefill worker's memory, registered with its NIXL agent, and a *descriptor* (the
agent's name and metadata, the buffer's address and size, the request's key) travels with the
manifest in Dynamo's ``disaggregated_params`` through the frontend to the decode worker. The decode
worker's agent loads the prefill agent's metadata, READs the buffer into its own registered memory
(one UCX transfer, no copy through Dynamo's request plane) and the READ's notification tells the
prefill side the bytes are gone: it deregisters and drops the buffer. An offer nobody reads (the
decode side failed, or never came) is dropped after ``ttl`` seconds.

Failures are errors, never silence: a NIXL error, a READ that does not complete within the timeout
(prefill worker gone) or a descriptor that does not parse raise `TransferError`; the decode worker
ends the request with it (the client sees an error status or a stream error event).

`StateTransport` is the seam: `NixlTransport` is the one implementation (host memory, ``DRAM``
segments; device memory would need a JAX array's device pointer registered as ``VRAM``, which the
CPU machines this was built on do not have). Dynamo's own ``dynamo.nixl_connect`` helper imports
torch, so the agent is driven through ``nixl._api`` directly. NIXL is part of the ``[dynamo]``
extra (``scripts/install_dynamo.sh``).
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from typing import Optional, Protocol

import numpy as np

log = logging.getLogger("dsv41_jax.dynamo.transfer")

__all__ = ["NixlTransport", "StateTransport", "TransferError"]


class TransferError(RuntimeError):
    """Moving a request's state failed (NIXL error, timeout, bad descriptor)."""


class StateTransport(Protocol):
    """Prefill side: `offer` a buffer (returns a JSON-able descriptor), `poll` releases read or expired
    offers. Decode side: `fetch` a descriptor's bytes (raises `TransferError`)."""

    def offer(self, key: str, buf: np.ndarray) -> dict: ...

    def fetch(self, desc: dict, timeout: float) -> np.ndarray: ...

    def poll(self) -> None: ...

    def close(self) -> None: ...


class NixlTransport:
    """One NIXL agent (UCX backend) of one worker; every agent call is serialized by a lock (the agent
    runs without NIXL's own thread synchronization). ``ttl``: seconds an unread offer is kept.

    Progress: NIXL's own progress thread polls UCX without sleeping, a whole core per agent even when
    idle (measured on a 2-core VM: 0.9 s user + 4.0 s sys in 5 s of idling), so the agent runs without
    it and a thread of ours calls `poll` every ``progress_interval`` seconds instead (UCX progresses in
    the agent's calls: this side's share of a READ another agent makes of our memory, the READs'
    notifications): ~1 % of a core idle, a READ of 256 KiB in 1-40 ms. The decode side's `fetch`
    progresses its own READ (`check_xfer_state` every 0.5 ms while it is in flight)."""

    def __init__(self, name: Optional[str] = None, *, ttl: float = 120.0, progress_interval: float = 0.005):
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name or f"dsv41-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ttl = float(ttl)
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise TransferError("NIXL has no UCX backend here (nixl-cu12's UCX plugin did not load)")
        self._lock = threading.Lock()
        self._offers: dict = {}  # key -> (buffer, registration, time offered)
        self.offered = self.released = self.expired = 0
        self.bytes_offered = self.bytes_fetched = 0
        self.fetches = self.fetch_failures = 0
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, args=(float(progress_interval),),
                                          name=f"nixl-progress-{self.name}", daemon=True)
        self._progress.start()

    def _progress_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 (keep progressing; a broken agent shows in fetch / the stats)
                log.error("NIXL progress: %s", e)

    # ------------------------------------------------------------------------------------ prefill side
    def offer(self, key: str, buf: np.ndarray) -> dict:
        """Keep ``buf`` (uint8, 1-D) readable by other agents until its READ's notification (``key``) or
        ``ttl``; returns the descriptor the decode side needs."""
        buf = np.ascontiguousarray(buf, np.uint8)
        if buf.ndim != 1 or buf.nbytes == 0:
            raise ValueError("offer: a non-empty 1-D uint8 buffer")
        with self._lock:
            if key in self._offers:
                raise ValueError(f"offer: key {key!r} is already offered")
            reg = self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            self._offers[key] = (buf, reg, time.monotonic())
            meta = self.agent.get_agent_metadata()  # (after registering: it carries the new region)
        self.offered += 1
        self.bytes_offered += buf.nbytes
        return {"agent": self.name, "metadata": base64.b64encode(meta).decode(), "addr": int(buf.ctypes.data),
                "nbytes": int(buf.nbytes), "key": key}

    def poll(self) -> None:
        """Release the offers whose READ completed (their notification arrived) or that expired."""
        with self._lock:
            notifs = self.agent.get_new_notifs()
            for msgs in notifs.values():
                for m in msgs:
                    key = m.decode(errors="replace")
                    if key in self._offers:
                        self._release(key)
                        self.released += 1
            now = time.monotonic()
            for key in [k for k, (_, _, t) in self._offers.items() if now - t > self.ttl]:
                log.warning("state transfer %s: not read within %.0fs; released", key, self.ttl)
                self._release(key)
                self.expired += 1

    def _release(self, key: str) -> None:
        _, reg, _ = self._offers.pop(key)
        self.agent.deregister_memory(reg)

    @property
    def pending(self) -> int:
        """Offers not read (nor expired) yet."""
        return len(self._offers)

    # ------------------------------------------------------------------------------------ decode side
    def fetch(self, desc: dict, timeout: float) -> np.ndarray:
        """READ the buffer ``desc`` describes into local memory (blocking; call it off the event loop).
        Raises `TransferError` on a NIXL error or after ``timeout`` seconds."""
        try:
            meta = base64.b64decode(desc["metadata"])
            addr, nbytes, key = int(desc["addr"]), int(desc["nbytes"]), str(desc["key"])
            agent = str(desc["agent"])
        except (KeyError, TypeError, ValueError) as e:
            self.fetch_failures += 1
            raise TransferError(f"bad transfer descriptor ({type(e).__name__}: {e})") from None
        self.fetches += 1
        out = np.empty(nbytes, np.uint8)
        reg = handle = None
        remote = None
        t0 = time.monotonic()
        try:
            with self._lock:
                remote = self.agent.add_remote_agent(meta)
                remote = remote.decode() if isinstance(remote, bytes) else remote
                if remote != agent:
                    raise TransferError(f"transfer descriptor names agent {agent!r}, its metadata {remote!r}")
                reg = self.agent.register_memory([(out.ctypes.data, nbytes, 0, "")], "DRAM")
                local = self.agent.get_xfer_descs([(out.ctypes.data, nbytes, 0)], "DRAM")
                far = self.agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
                handle = self.agent.initialize_xfer("READ", local, far, remote, key.encode())
                state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() - t0 > timeout:
                    raise TransferError(f"state transfer {key}: not done after {timeout:.0f}s (prefill worker gone?)")
                time.sleep(0.0005)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"state transfer {key}: NIXL reported {state}")
        except TransferError:
            self.fetch_failures += 1
            self._forget(remote)
            raise
        except Exception as e:  # noqa: BLE001 (NIXL's errors: nixlNotFoundError, nixlBackendError, ...)
            self.fetch_failures += 1
            self._forget(remote)
            raise TransferError(f"state transfer {key}: {type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                if handle is not None:
                    try:
                        self.agent.release_xfer_handle(handle)
                    except Exception as e:  # noqa: BLE001 (a handle of a failed transfer may not release)
                        log.warning("state transfer %s: releasing the transfer handle: %s", key, e)
                if reg is not None:
                    self.agent.deregister_memory(reg)
        self.bytes_fetched += nbytes
        return out

    def _forget(self, remote: Optional[str]) -> None:
        """After a failure: drop the remote agent (a restarted prefill worker reconnects afresh)."""
        if remote is None:
            return
        with self._lock:
            try:
                self.agent.remove_remote_agent(remote)
            except Exception:  # noqa: BLE001
                pass

    def stats(self) -> dict:
        return {"transfer_offers_pending": self.pending, "transfer_offered": self.offered,
                "transfer_released": self.released, "transfer_expired": self.expired,
                "transfer_bytes_offered": self.bytes_offered, "transfer_fetches": self.fetches,
                "transfer_fetch_failures": self.fetch_failures, "transfer_bytes_fetched": self.bytes_fetched}

    def close(self) -> None:
        self._stop.set()
        self._progress.join()
        with self._lock:
            for key in list(self._offers):
                self._release(key)
