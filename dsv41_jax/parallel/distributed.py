"""Multi-host start-up: `jax.distributed` initialization from flags or environment.

Every entry point that may span several processes (the server, the AOT script) calls
`add_distributed_args(parser)` and, before it touches a device, `initialize_from(args)`:

  --coordinator-address HOST:PORT   (SGLang's --dist-init-addr; env DSV41_COORDINATOR_ADDRESS)
  --num-processes N                 (SGLang's --nnodes; env DSV41_NUM_PROCESSES)
  --process-id I                    (SGLang's --node-rank; env DSV41_PROCESS_ID)

Nothing given: a single process, nothing is initialized. All three (or a cluster JAX detects by
itself, e.g. SLURM, with ``--coordinator-address auto``): ``jax.distributed.initialize`` runs once, and
`jax.devices()` is then global, so `mesh.make_mesh` spans every process (it refuses a mesh that would
leave a process's devices out). On CPU, cross-process collectives use gloo. Each process must load the
same parameters (`rules.shard_params` builds the global arrays from each process's host copy).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_coordinator: list = []  # the coordinator address `initialize` used (None for 'auto'), once it ran

_ENV = {"coordinator_address": "DSV41_COORDINATOR_ADDRESS", "num_processes": "DSV41_NUM_PROCESSES",
        "process_id": "DSV41_PROCESS_ID"}


def add_distributed_args(parser) -> None:
    g = parser.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator-address", "--dist-init-addr", dest="coordinator_address", default=None,
                   help="HOST:PORT of process 0's coordinator ('auto': let JAX detect the cluster); "
                        "env DSV41_COORDINATOR_ADDRESS; unset: single process")
    g.add_argument("--num-processes", "--nnodes", dest="num_processes", type=int, default=None,
                   help="processes in the job; env DSV41_NUM_PROCESSES")
    g.add_argument("--process-id", "--node-rank", dest="process_id", type=int, default=None,
                   help="this process's index (0: the leader, which schedules and serves HTTP; the others "
                        "execute its steps); env DSV41_PROCESS_ID")


def settings(coordinator_address=None, num_processes=None, process_id=None) -> dict:
    """The resolved settings (flags over env); {} for a single process. Raises ValueError if partial."""
    vals = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    for k, env in _ENV.items():
        if vals[k] is None and os.environ.get(env, "").strip():
            v = os.environ[env].strip()
            vals[k] = v if k == "coordinator_address" else int(v)
    if vals["coordinator_address"] is None:
        if vals["num_processes"] is not None or vals["process_id"] is not None:
            raise ValueError("--num-processes / --process-id need --coordinator-address (or "
                             "DSV41_COORDINATOR_ADDRESS)")
        return {}
    if vals["coordinator_address"] == "auto":
        return {"coordinator_address": None, "num_processes": vals["num_processes"], "process_id": vals["process_id"]}
    if vals["num_processes"] is None or vals["process_id"] is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id (or their DSV41_* env)")
    if not 0 <= vals["process_id"] < vals["num_processes"]:
        raise ValueError(f"--process-id {vals['process_id']} is outside 0..{vals['num_processes'] - 1}")
    return vals


def initialize(coordinator_address=None, num_processes=None, process_id=None) -> bool:
    """`jax.distributed.initialize` with `settings(...)`; False (nothing done) for a single process."""
    s = settings(coordinator_address, num_processes, process_id)
    if not s:
        return False
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 - older/newer JAX without the option: its default applies
            log.info("jax_cpu_collectives_implementation not settable; using JAX's default")
    jax.distributed.initialize(**{k: v for k, v in s.items() if v is not None})
    _coordinator[:] = [s["coordinator_address"]]
    log.info("jax.distributed: process %d of %d, %d global / %d local devices", jax.process_index(),
             jax.process_count(), len(jax.devices()), len(jax.local_devices()))
    return True


def coordinator_address():
    """HOST:PORT `initialize` joined (None: single process, or the cluster JAX detected by itself)."""
    return _coordinator[0] if _coordinator else None


def initialize_from(args) -> bool:
    """`initialize` from an argparse namespace built with `add_distributed_args`."""
    return initialize(getattr(args, "coordinator_address", None), getattr(args, "num_processes", None),
                      getattr(args, "process_id", None))
