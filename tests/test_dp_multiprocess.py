"""Data-parallel attention over processes (issue 46, item 8): jax.distributed over loopback, 2 processes x 4
fake CPU devices = one dp=8 mesh; the decode step (`parallel.dp.rank_step` via `decode.jitted_extend`, the
MoE dispatched to the experts on all 8 devices with `--moe-a2a-backend all_to_all`, the Engram rows
gathered across ranks) run on `test_dp_attention`'s schedule equals the one-process 8-device run bit for
bit: every step's logits and every cache array (each rank's slot rows and pool pages), in the
deterministic mode. The slow tier does the same for DSpark (`dspark.extend_seeding` steps and a block
proposal, `test_dp_attention._dspark_run`) on dp=4 x tp=2. The default case costs ~33 s of CPU in all
(the reference compile and the two workers'), ~70 s wall on the loaded 2-core VM.

Each worker builds the same host inputs (parameters from the same key, the fresh cache, the schedule's
batches) and places them with `jax.make_array_from_callback` (each process fills its own devices' blocks:
a numpy argument cannot be handed to a step whose shardings span another process's devices); the outputs
are gathered to every process with `multihost_utils.process_allgather`. The reference is
`test_dp_attention._run` (memoized: in one pytest process its dp=8 compile is shared with that module).

`test_engine_two_processes_equal_one_process` does the same for the whole engine (`serving.multihost`):
process 0 runs `LLM` (the DP controller's 8 rank schedulers, routing, the output processor) and sends
each step's schedule to process 1, which only executes it; several concurrent requests (greedy and
seeded sampling with logprobs, a shared prompt served from the radix cache, n = 2 forks) give process 0
the tokens and logprobs, bit for bit, of one process with 8 devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import test_dp_attention as dpa

_WORKER = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"  # XLA_FLAGS from the test: 4 devices, the suite's compile settings
sys.path.insert(0, sys.argv[1])  # tests/: configs and test_dp_attention's schedule
from dsv41_jax.parallel.distributed import initialize
assert initialize()  # DSV41_COORDINATOR_ADDRESS / DSV41_NUM_PROCESSES / DSV41_PROCESS_ID
import functools
import jax, numpy as np
from jax.experimental import multihost_utils
import test_dp_attention as dpa
from dsv41_jax.model import decode as dec
from dsv41_jax.model import dspark
from dsv41_jax.model.params import init_params
from dsv41_jax.parallel import rules
from dsv41_jax.parallel.mesh import make_mesh
from dsv41_jax.parallel.plan import MeshPlan
assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4

def place(tree, shardings):  # host arrays onto global shardings: each process fills its own devices
    return jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i, x=np.asarray(x): x[i]), tree, shardings)

def gather(tree, prefix):  # every leaf to every process, as its bits (npz has no bf16 / fp8 dtypes)
    for j, leaf in enumerate(jax.tree_util.tree_leaves(tree)):
        x = multihost_utils.process_allgather(leaf, tiled=True)
        out[f"{prefix}.{j}"] = x.view(f"u{x.dtype.itemsize}")

cfg = dpa._mode_cfg(dpa.configs.mesh_micro(), "deterministic")
params = init_params(cfg, jax.random.key(0))
dp, tp = dpa.MESHES[sys.argv[3]]
ccfg = dpa._ccfg(dp)
mesh = make_mesh(tp=tp, dp=dp, cfg=cfg)
assert mesh.devices.flat[0].process_index != mesh.devices.flat[-1].process_index  # ranks on both processes
par = MeshPlan.of(mesh)
p = rules.shard_params(params, cfg, mesh)
host = dpa._fresh_state(cfg, ccfg, params, None)  # as the reference's, built on the host
bsh = rules.batch_shardings(mesh)
out = {}
if sys.argv[4] == "decode":  # test_dp_attention._run
    state = place(host, rules.cache_shardings(cfg, ccfg, mesh))
    step = dec.jitted_extend(cfg, ccfg, all_logits=True, par=par)
    for i, bt in enumerate(dpa._schedule(ccfg)):
        lg, state = step(p, state, place(bt, {k: bsh[k] for k in bt}))
        gather(lg, f"logits.{i}")
    assert all(leaf.sharding.spec[0] == "dp" for leaf in jax.tree_util.tree_leaves(state))
    gather(state, "state")
else:  # test_dp_attention._dspark_run: the seeding steps, then one proposal
    host = dspark.with_rings(host, cfg, ccfg)
    state = place(host, rules.state_shardings(host, mesh))

    def propose(params, state, batch, ccfg, par):
        return dspark.propose(params, state["dspark"], batch["anchor"], batch["start"], batch["slot"], cfg, ccfg,
                              par=par)

    seed = jax.jit(par.rank_step(functools.partial(dspark.extend_seeding, cfg=cfg), cfg, ccfg))
    sched = dpa._schedule(ccfg)
    for i, bt in enumerate(sched):
        lg, state = seed(p, state, place(bt, {k: bsh[k] for k in bt}))
        gather(lg, f"logits.{i}")
    last = sched[-1]
    pb = {"anchor": np.full((dpa.B,), 7, np.int32), "start": last["start"] + last["n_new"], "slot": last["slot"]}
    prop = jax.jit(par.rank_step(propose, cfg, ccfg))(p, state, place(pb, {k: bsh["slot"] for k in pb}))
    gather(state, "state")
    gather(prop, "proposal")
np.savez(sys.argv[2] + f".{jax.process_index()}.npz", **out)
"""


# the engine test's workload (shared by the workers and the one-process reference)
ENGINE_KW = dict(model="tiny", page_size=16, context_length=64, max_running_requests=16, max_total_tokens=1024,
                 chunked_prefill_size=16, batch_buckets=[16], token_buckets=[16], decode_log_interval=1000,
                 enable_dp_attention=True, dp_size=8, enable_deterministic_inference=True)


def engine_workload():
    """(prompts, sampling params): 6 requests, two sharing a 20-token prefix, greedy and seeded sampling with
    top-2 logprobs, one n = 2; a few tokens each."""
    from dsv41_jax.serving.sampling import SamplingParams

    rng = np.random.default_rng(55)
    shared = rng.integers(3, 300, 20).tolist()
    prompts = [shared + [7, 9], shared + [11]] + [rng.integers(3, 300, int(n)).tolist() for n in (5, 17, 2, 9)]
    sps = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2) if i % 2 else
           SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=4, ignore_eos=True, logprobs=2)
           for i in range(len(prompts))]
    sps[3] = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=3, ignore_eos=True, logprobs=2)
    return prompts, sps


def engine_outputs(llm) -> dict:
    """{name: array} of every sample's tokens, logprobs and top-2 logprobs after `generate` on the workload
    (the shared prompt's second request runs after the first, so it hits the radix cache)."""
    prompts, sps = engine_workload()
    outs = llm.generate(prompts[:1], sps[:1]) + llm.generate(prompts[1:], sps[1:])
    got = {}
    for i, o in enumerate(outs):
        for c in o.outputs:
            got[f"{i}.{c.index}.tokens"] = np.asarray(c.token_ids, np.int64)
            got[f"{i}.{c.index}.lp"] = np.asarray(c.logprobs, np.float32)
            got[f"{i}.{c.index}.top_ids"] = np.asarray([[j for j, _ in t] for t in c.top_logprobs], np.int64)
            got[f"{i}.{c.index}.top_lp"] = np.asarray([[v for _, v in t] for t in c.top_logprobs], np.float32)
    got["cached_tokens"] = np.asarray([o.num_cached_tokens or 0 for o in outs], np.int64)
    return got


_ENGINE_WORKER = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])
from dsv41_jax.parallel.distributed import initialize
assert initialize()
import jax, numpy as np
import configs
import test_dp_multiprocess as t
from dsv41_jax import LLM
assert jax.process_count() == 2 and len(jax.devices()) == 8
llm = LLM(**t.ENGINE_KW, cfg=configs.mesh_micro())  # process 1: executes process 0's steps, returns when it stops
if jax.process_index() == 0:
    out = t.engine_outputs(llm)
    llm.shutdown()
    np.savez(sys.argv[2], **out)
else:
    assert llm.is_follower
    try:
        llm.generate([[5, 6]])
        raise SystemExit("a follower took a request")
    except ValueError as e:
        assert "process 0" in str(e), e
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(worker: str, args: list, timeout: float = 600) -> None:
    """`worker` (python source) in 2 processes x 4 CPU devices joined by jax.distributed over loopback, with
    this process's XLA compile settings (`xla_flags.compile_speed_flags`: fp32 results depend on the XLA
    level, so workers and reference must compile alike); asserts both exit 0 (their log tail if not).

    Both workers compile every program themselves (no persistent cache here). Tried and dropped: the run's cache
    with ``jax_share_binary_between_hosts`` (process 0 compiles, process 1 waits for the executable in the
    jax.distributed key-value store) deadlocks on CPU: the two processes compute different cache keys for the
    same global program (seen for process_allgather's ``jit__identity_fn`` on jax 0.10.2), so process 1 waits on
    a key process 0 never writes while process 0 waits in the collective."""
    from xla_flags import compile_speed_flags

    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = compile_speed_flags(os.environ.get("XLA_FLAGS", "")) + ["--xla_force_host_platform_device_count=4"]
    procs = []
    for pid in range(2):
        env = dict(os.environ, PYTHONPATH=root, DSV41_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   DSV41_NUM_PROCESSES="2", DSV41_PROCESS_ID=str(pid), XLA_FLAGS=" ".join(flags))
        procs.append(subprocess.Popen([sys.executable, "-c", worker, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, (p, lg) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {pid}:\n{lg[-3000:]}"


def _bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


@pytest.mark.parametrize("layout,what", [("dp8", "decode"),
                                         # two more compiles per process (seeding, proposal): the slow tier
                                         pytest.param("dp4xtp2", "dspark", marks=pytest.mark.slow)])
def test_two_processes_equal_one_process(cpu8, tmp_path, layout, what):
    """The dp step over 2 processes x 4 devices == the same mesh in one process x 8 devices, bitwise: the
    decode steps (dp=8) or DSpark's seeding steps and a block proposal (dp=4 x tp=2) (module doc)."""
    from dsv41_jax.parallel.mesh import make_mesh

    cfg = dpa._mode_cfg(dpa.configs.mesh_micro(), "deterministic")
    params = dpa.init_params(cfg, jax.random.key(0))
    dp, tp = dpa.MESHES[layout]
    mesh = make_mesh(tp=tp, dp=dp, cfg=cfg)
    if what == "decode":
        ref_logits, ref_state, _ = dpa._run(cfg, params, dpa._ccfg(dp), mesh)
        ref = {"state": ref_state}
    else:
        ref_logits, ref_state, ref_prop = dpa._dspark_run(cfg, params, dpa._ccfg(dp), mesh)
        ref = {"state": ref_state, "proposal": ref_prop}
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    run_workers(_WORKER, [tests_dir, str(tmp_path / "out"), layout, what])
    want = {f"logits.{i}.0": _bits(lg) for i, lg in enumerate(ref_logits)}
    names = {}
    for prefix, tree in ref.items():
        for j, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            want[f"{prefix}.{j}"] = _bits(leaf)
            names[f"{prefix}.{j}"] = prefix + jax.tree_util.keystr(path)
    for pid in range(2):
        got = np.load(tmp_path / f"out.{pid}.npz")
        assert sorted(got.files) == sorted(want)
        for k, w in want.items():
            np.testing.assert_array_equal(got[k], w, err_msg=f"process {pid}: {names.get(k, k)}")
    assert np.abs(ref_logits[0][0]).max() > 0  # the real rows ran the model


def test_engine_two_processes_equal_one_process(cpu8, tmp_path):
    """`LLM` over 2 processes x 4 devices (process 0 schedules, process 1 executes its broadcast schedules) ==
    `LLM` in one process x 8 devices, bitwise: tokens, logprobs, top logprobs, cached tokens (module doc)."""
    import configs
    from dsv41_jax import LLM

    ref = engine_outputs(LLM(**ENGINE_KW, cfg=configs.mesh_micro()))
    assert ref["cached_tokens"][1] > 0  # the shared prompt's second request hit the radix cache
    run_workers(_ENGINE_WORKER, [os.path.dirname(os.path.abspath(__file__)), str(tmp_path / "engine.npz")])
    got = np.load(tmp_path / "engine.npz")
    assert sorted(got.files) == sorted(ref)
    for k, w in ref.items():
        np.testing.assert_array_equal(_bits(got[k]), _bits(w), err_msg=k)


def test_multiprocess_flags_and_refusals(monkeypatch):
    """SGLang's multi-node spellings parse to the jax.distributed settings; what a multi-process engine cannot
    run is refused in one line naming each flag (before any weight is read: `Runner._configure`)."""
    from dsv41_jax.serve import build_parser
    from dsv41_jax.serving import multihost
    from dsv41_jax.serving.engine_args import EngineArgs
    from dsv41_jax.serving.request import EngineError

    a = build_parser().parse_args(["--dist-init-addr", "h:1", "--nnodes", "2", "--node-rank", "1"])
    assert (a.coordinator_address, a.num_processes, a.process_id) == ("h:1", 2, 1)
    monkeypatch.setattr(multihost, "process_count", lambda: 2)
    multihost.refuse(EngineArgs(model="tiny", ep_size=2))  # a mesh, nothing else: runs
    with pytest.raises(EngineError, match=r"^2 processes .*no mesh.*--enable-hierarchical-cache.*DSPARK"):
        multihost.refuse(EngineArgs(model="tiny", enable_hierarchical_cache=True, speculative_algorithm="DSPARK"))


_MISMATCH_WORKER = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[1])
from dsv41_jax.parallel.distributed import initialize
assert initialize()
import jax, configs
import test_dp_multiprocess as t
from dsv41_jax import LLM
kw = dict(t.ENGINE_KW, skip_server_warmup=True, max_total_tokens=1024 * (1 + jax.process_index()))
try:
    LLM(**kw, cfg=configs.mesh_micro())
    raise SystemExit("processes with other KV pools were not refused")
except ValueError as e:
    open(sys.argv[2] + f".{jax.process_index()}", "w").write(str(e))
"""


def test_processes_with_other_flags_are_refused(tmp_path):
    """Processes that plan other KV pools (here --max-total-tokens) are refused on every process in one line,
    before their caches' collectives could abort on mismatched sizes."""
    run_workers(_MISMATCH_WORKER, [os.path.dirname(os.path.abspath(__file__)), str(tmp_path / "err")])
    for pid in range(2):
        msg = (tmp_path / f"err.{pid}").read_text()
        assert msg.startswith("2 processes planned different engines") and "\n" not in msg, msg
