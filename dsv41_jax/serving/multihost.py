"""Engine-level multi-process serving (issue 46, item 8): one leader schedules, the followers execute.

With ``jax.distributed`` up (`parallel.distributed`: ``--dist-init-addr`` / ``--nnodes`` / ``--node-rank``)
every process holds its devices' share of one global mesh, and every jitted step is a collective over
all of them: each process must run the same device calls in the same order. As in SGLang (rank 0's
scheduler broadcasts its batch) and vLLM (the driver's ``SchedulerOutput`` to every worker), process 0,
the **leader**, runs the whole engine — tokenizer, scheduler / DP controller, output processor, server
— and, before it executes a step, sends the step's frozen `messages.Schedule` to the **followers**; a
follower runs only `Runner.execute` on what it receives (`follow`), until the leader's `STOP` (its
shutdown). The step's results (tokens, logprobs, accept lengths) are gathered inside the step onto
every device (`runner._gather_to_all`), so the leader reads them as a one-process engine does; the
followers drop theirs.

The channel (`StepChannel`) is a TCP connection per follower (`multiprocessing.connection`: HMAC
challenge with a random key, then length-prefixed pickles of the schedule). Chosen over
``multihost_utils.broadcast_one_to_all`` per step because that is itself a device collective queued
behind the previous step: a follower could read the schedule only once the device finished the step
before (its host work serialized after the device, no overlap), and it needs a fixed-size buffer (a
size header, then a padded payload compiled per size). The socket keeps the control plane off the
accelerators and lets followers enqueue step k while step k−1 computes. The address, port and key are
handed out once at start-up with ``broadcast_one_to_all`` (every process already trusts that channel),
so no extra flag or port needs configuring. A schedule is a few hundred bytes per row (ints, tuples,
an occasional constraint mask); pickle handles the frozen dataclasses as they are, and only the
authenticated leader can send.

What cannot run over processes is refused at start-up (`refuse`, one line) or per request: HiCache
(its host tier lives in the leader's memory), DSpark / MTP speculation, the expert-distribution
recorder, the Engram host table, SWA bounded replay, prefill/decode handover, and a run without a mesh
spanning the processes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
from multiprocessing.connection import Client, Listener
from typing import Optional

from dsv41_jax.serving.request import EngineError

__all__ = ["STOP", "StepChannel", "follow", "process_count", "refuse"]

log = logging.getLogger("dsv41_jax.multihost")

STOP = "stop"  # the leader's shutdown message
_HELLO = 512  # bytes of the start-up broadcast (json: host, port, key)


def process_count() -> int:
    """`jax.process_count()` (1 without jax.distributed)."""
    import jax

    return jax.process_count()


def refuse(args) -> None:
    """EngineError, one line, naming every flag a multi-process engine does not run (module doc)."""
    from dsv41_jax.parallel.host_table import host_table_requested

    n = process_count()
    no = []
    if args.tp_size == 1 and args.ep_size == 1 and args.dp_size == 1:
        no.append("no mesh (give --dp-size with --enable-dp-attention, --tp-size or --ep-size: the mesh must "
                  "span every process's devices)")
    if args.enable_hierarchical_cache:
        no.append("--enable-hierarchical-cache (its host tier would live in the leader's memory only)")
    if args.speculative_algorithm is not None:
        no.append(f"--speculative-algorithm {args.speculative_algorithm}")
    if args.expert_distribution_recorder:
        no.append("--expert-distribution-recorder")
    if host_table_requested(args.engram_host_table):
        no.append("--engram-host-table")
    if args.enable_decoder_swa_bounded_replay:
        no.append("--enable-decoder-swa-bounded-replay")
    if no:
        raise EngineError(f"{n} processes (jax.distributed): not supported with " + "; ".join(no))


class StepChannel:
    """Leader → followers: the step messages (module doc). ``is_leader``: process 0 (it `send`s);
    a follower `recv`s. Build it with `connect` on every process at the same point of start-up."""

    def __init__(self, is_leader: bool, conns: list):
        self.is_leader = is_leader
        self._conns = conns
        self.closed = False

    @classmethod
    def connect(cls, host: Optional[str] = None) -> "StepChannel":
        """Collective (every process calls it, in the same order as its other device calls): the leader
        listens on ``host`` (default: this machine's name; loopback when the coordinator is local),
        broadcasts its address and a fresh key, and accepts one connection per follower."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        leader = jax.process_index() == 0
        listener = None
        hello = np.zeros((_HELLO,), np.uint8)
        if leader:
            key = os.urandom(32)
            listener = Listener((host or _default_host(), 0), authkey=key)
            addr = listener.address
            raw = json.dumps({"host": addr[0], "port": addr[1], "key": key.hex()}).encode()
            hello[:len(raw)] = np.frombuffer(raw, np.uint8)
        got = np.asarray(multihost_utils.broadcast_one_to_all(hello))
        info = json.loads(bytes(got).rstrip(b"\0"))
        key = bytes.fromhex(info["key"])
        if leader:
            conns = [listener.accept() for _ in range(jax.process_count() - 1)]
            listener.close()
            log.info("multi-process engine: leader, %d follower(s) connected on %s:%d", len(conns), info["host"],
                     info["port"])
            return cls(True, conns)
        conn = Client((info["host"], info["port"]), authkey=key)
        log.info("multi-process engine: follower %d of %d, executing the leader's steps (%s:%d)",
                 jax.process_index(), jax.process_count(), info["host"], info["port"])
        return cls(False, [conn])

    def send(self, msg) -> None:
        """Leader: ``msg`` (a `messages.Schedule` or `STOP`) to every follower."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self._conns:
            c.send_bytes(data)

    def recv(self):
        """Follower: the next message (EOFError when the leader is gone)."""
        return pickle.loads(self._conns[0].recv_bytes())

    def close(self) -> None:
        """Leader: `STOP` to the followers, then close (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.is_leader:
            try:
                self.send(STOP)
            except OSError as e:  # a follower already gone: nothing to stop there
                log.warning("multi-process engine: stop message not delivered: %s", e)
        for c in self._conns:
            c.close()


def _default_host() -> str:
    """Where the leader listens: the coordinator's host when it was given (`parallel.distributed`), else
    this machine's name."""
    from dsv41_jax.parallel import distributed

    addr = distributed.coordinator_address()
    if addr:
        return addr.rsplit(":", 1)[0].strip("[]")
    return socket.gethostname()


def follow(runner) -> int:
    """A follower's loop: execute each schedule the leader sends until `STOP`. Returns the number of
    schedules executed; EngineError if the leader went away without stopping."""
    ch = runner.channel
    if ch is None or ch.is_leader:
        raise EngineError("follow: this process is not a follower of a multi-process engine")
    n = 0
    while True:
        try:
            msg = ch.recv()
        except (EOFError, OSError) as e:
            raise EngineError(f"multi-process engine: the leader's channel closed without a stop message "
                              f"after {n} steps ({type(e).__name__})") from None
        if isinstance(msg, str) and msg == STOP:
            break
        runner.execute(msg)
        n += 1
    ch.close()
    log.info("multi-process engine: the leader stopped; %d steps executed", n)
    return n
