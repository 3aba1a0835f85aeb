"""Shared fixtures: the tiny config and its random parameters (built once per session), and the 8
host CPU devices the mesh tests use.

The device count is forced here, before JAX initializes its backends, whatever ``XLA_FLAGS`` the
shell had: the other flags are kept and only ``--xla_force_host_platform_device_count`` is set to 8.
A test that needs the devices takes the ``cpu8`` fixture, which fails (never skips) without them.

One persistent JAX compilation cache per test run, shared by the xdist workers and the servers the tests
start: the first process to compile a (config, shape) writes it and every other process reads it. The
directory is fresh for each run (created by the first process, i.e. the xdist controller, whose
environment the workers inherit, and removed when it exits), so a run never depends on a previous one.
``DSV41_TEST_JAX_CACHE=DIR`` uses (and keeps) DIR instead; ``DSV41_TEST_JAX_CACHE=none`` turns the cache off
in the test processes and in the servers they start (to measure the suite without it).

XLA's CPU backend compiles the test programs at -O0 with its MLIR fusion emitters off
(`_with_test_opt_level` says why and when not); ``DSV41_TEST_XLA_OPT=default`` runs the suite on XLA's
defaults instead. The header pytest prints names the choice.

``DSV41_TEST_COMPILE_LOG=PATH`` (for work on the suite's time): each test process appends one JSON line
per (test, event, function) to ``PATH.<worker>`` with the seconds JAX spent tracing, lowering and
compiling (a persistent-cache load counts as a compile) in that test, from `jax.monitoring` events.
"""

import atexit
import json
import os
import shutil
import tempfile
from collections import OrderedDict

from xdist.scheduler import LoadFileScheduling

N_HOST_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"
OPT_ENV = "DSV41_TEST_XLA_OPT"


def _with_host_devices(flags: str, n: int) -> str:
    kept = [f for f in flags.split() if not f.startswith(_FLAG + "=") and f != _FLAG]
    return " ".join(kept + [f"{_FLAG}={n}"])


def _accelerator_plugin() -> str | None:
    """The name of an installed GPU/TPU PJRT plugin (jax_plugins.*), without initializing JAX."""
    import pkgutil

    try:
        import jax_plugins
    except ImportError:
        return None
    return next((m.name for m in pkgutil.iter_modules(jax_plugins.__path__)), None)


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows ``flag`` (XLA aborts a process whose XLA_FLAGS name an unknown one):
    a CPU backend brought up in a subprocess with XLA_FLAGS=flag (~2 s; once per run, in the first
    process: the xdist workers inherit the choice in XLA_FLAGS)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        r = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                           capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0


def _with_test_opt_level(flags: str) -> tuple[str, str]:
    """(XLA_FLAGS, what was chosen): XLA's CPU backend at -O0 with its MLIR fusion emitters off, for the
    test processes.

    Why: compiling is most of the suite's time on a 2-core CPU machine.
    * -O0 (LLVM unoptimized) compiles a tiny-sized program in ~0.6x the time (measured: the whole suite
      18 min 54 s -> 13 min 01 s, seed 51 vs 52), while the tiny programs run ~2x slower, which shows
      only in the execution-heavy files (test_preemption: 45 -> 58 s in those runs).
    * At -O0, ``--xla_cpu_use_fusion_emitters=false`` (XLA:CPU's elemental IR emitters instead of the
      MLIR fusion pipeline) cuts XLA's compile time by another third (in-process backend compile 566 ->
      374 s, test time 1,172 -> 927 s over the two workers; micro's forward 2.7 -> 1.7 s; tiny's extend
      about level) with run times unchanged. (At XLA's default level the same flag made compiles 2x
      slower: LLVM then optimizes the larger IR.) It is added only when XLA knows it (`_xla_accepts`).
    * ``--xla_disable_hlo_passes=hlo-verifier`` and ``--xla_cpu_parallel_codegen_split_count=1``
      (`xla_flags.COMPILE_ONLY_FLAGS`): the HLO verifier's invariant checks (~10 % of a compile's samples in
      `perf`) skipped, and the LLVM module code-generated whole, not split and cloned for threads that the
      two busy workers cannot give it. The same executables (bit for bit), in less CPU time: mini's extend
      compiled in 6.0 -> 4.4 s of CPU (Intel Xeon VM); test_fastpath_attention + test_decode +
      test_fastpath_ops on two workers 124.8 -> 109.8 s, 3 min 37 s -> 3 min 09 s of user CPU. (Timed by
      the wall clock of one compile on an idle machine, the split's threads had hidden this.) Each is
      added only where XLA knows it and the shell did not set that flag.
    The HLO XLA optimizes is the same up to fusion decisions; what changes is the machine code: LLVM no
    longer contracts a*b+c into FMAs and a fusion's chain is written out differently, so fp32 results can
    differ in the last bit from the default build (an exact-mode golden records the settings it was made
    at: `goldens.machine`). Every relation the suite checks holds both ways.
    Not applied when XLA_FLAGS already names the level, when ``DSV41_TEST_XLA_OPT=default`` (XLA's
    defaults, i.e. what serving on a CPU compiles), or when an accelerator plugin is installed (the GPU
    machine runs the kernels natively at its default)."""
    if opt_level_flag(flags):
        return flags, "as XLA_FLAGS set it"
    choice = os.environ.get(OPT_ENV, "0").strip().lower()
    if choice not in ("0", "default"):
        raise pytest.UsageError(f"{OPT_ENV}={choice!r}: expected 0 (the default) or 'default'")
    if choice == "default":
        return flags, f"XLA's default ({OPT_ENV}=default)"
    plugin = _accelerator_plugin()
    if plugin:
        return flags, f"XLA's default (accelerator plugin {plugin} installed)"
    add, why = [f"{OPT_FLAG}=0"], "-O0 for the CPU backend"
    # the flags this XLA must know (it aborts on an unknown one), each left out where the shell set its own
    emitters = f"{EMITTERS_FLAG}=false"
    wanted = [f for f in (emitters, *COMPILE_ONLY_FLAGS) if not last_flag(flags, f.split("=", 1)[0])]
    known = wanted if wanted and _xla_accepts(" ".join(wanted)) else [f for f in wanted if _xla_accepts(f)]
    if last_flag(flags, EMITTERS_FLAG):
        why += ", fusion emitters as XLA_FLAGS set them"
    elif emitters in known:
        why += ", its fusion emitters off"
    else:
        why += f" (this XLA does not know {EMITTERS_FLAG}: its fusion emitters stay on)"
    only = [COMPILE_ONLY[f] for f in COMPILE_ONLY_FLAGS if f in known]
    if only:
        why += ", " + " and ".join(only)
    add += [f for f in wanted if f in known]
    return " ".join(flags.split() + add), f"{why} ({OPT_ENV}=default: XLA's defaults)"


import pytest  # noqa: E402
from xla_flags import COMPILE_ONLY, COMPILE_ONLY_FLAGS, EMITTERS_FLAG, OPT_FLAG, last_flag, opt_level_flag  # noqa: E402

os.environ["XLA_FLAGS"], XLA_OPT_CHOICE = _with_test_opt_level(
    _with_host_devices(os.environ.get("XLA_FLAGS", ""), N_HOST_DEVICES))

import jax  # noqa: E402

CACHE_ENV = "DSV41_TEST_JAX_CACHE"
# Compiles shorter than this are not written (eager ops' few-ms compiles cost more to store than to redo). At
# -O0 the engine's helper programs and small kernels compile in 0.2-1 s and recur in module after module:
# 0.2 s (instead of 1.0) took the engine / LLM / DSpark / prefix-cache / scripts files from 187 and 182 s
# to 173 s in one process (0.0: 177 s).
CACHE_MIN_COMPILE_S = 0.2


def _run_compile_cache() -> str:
    """The run's shared cache directory ("none": off). Called at import, before anything compiles."""
    d = os.environ.get(CACHE_ENV)
    if not d:
        d = tempfile.mkdtemp(prefix="dsv41_test_jax_cache_")
        os.environ[CACHE_ENV] = d  # inherited by the xdist workers and by the servers' environments
        atexit.register(shutil.rmtree, d, True)
    if d.lower() != "none":
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_S)
    return d


RUN_COMPILE_CACHE = _run_compile_cache()

COMPILE_LOG_ENV = "DSV41_TEST_COMPILE_LOG"
_compile_log: dict = {}  # (test id, event, function) -> [count, seconds]
_current_test = ["<collection>"]


def _on_duration(event: str, secs: float, **kw) -> None:
    if event.startswith("/jax/core/compile/"):
        rec = _compile_log.setdefault((_current_test[0], event.rsplit("/", 1)[-1], kw.get("fun_name", "?")), [0, 0.0])
        rec[0] += 1
        rec[1] += secs


if os.environ.get(COMPILE_LOG_ENV):
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_report_header(config):
    return [f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}: compile settings {XLA_OPT_CHOICE}",
            f"compile cache: {RUN_COMPILE_CACHE}"]


FILE_SECONDS = os.path.join(os.path.dirname(__file__), "data", "file_seconds.json")


def heaviest_first(files, seconds: dict) -> list:
    """`files` (test file node ids) ordered by their recorded seconds, heaviest first; a file with no record
    counts as the median of the recorded ones (a new file may be heavy); ties keep their given order."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 0
    return sorted(files, key=lambda f: -seconds.get(f, default))


class HeaviestFirst(LoadFileScheduling):
    """xdist's file scheduling (``--dist loadfile``, README's test command) with the heaviest files first. xdist's own
    order is by the number of tests in a file, which puts the few-test, many-second files (live servers, meshes,
    DSpark engines) last: one worker then runs the last of them while the other idles. The seconds come from a
    --durations run (tests/data/file_seconds.json, `scripts/file_seconds.py`); only their order matters."""

    def _assign_work_unit(self, node):
        if not getattr(self, "_ordered", False):  # the first assignment: the queue is complete
            with open(FILE_SECONDS) as f:
                seconds = json.load(f)
            self.workqueue = OrderedDict((s, self.workqueue[s]) for s in heaviest_first(self.workqueue, seconds))
            self._ordered = True
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)  # known only where xdist is loaded (not under -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None
    return HeaviestFirst(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_test[0] = item.nodeid
    yield


def pytest_sessionfinish(session):
    path = os.environ.get(COMPILE_LOG_ENV)
    if not path or not _compile_log:
        return
    import json

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{path}.{worker}", "a") as f:
        for (test, event, fun), (n, secs) in sorted(_compile_log.items()):
            f.write(json.dumps({"test": test, "event": event, "fun": fun, "n": n, "secs": round(secs, 4)}) + "\n")

from dsv41_jax.model import ModelConfig, init_params  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test module, drop JAX's in-memory caches of compiled programs and traces.

    A worker runs many modules in turn, each with its own jitted steps (module-level functions keep their
    executables alive); without this a worker grew past 10 GB over a run and two of them could exhaust a
    24 GB machine. A later module that needs the same program gets it from the run's persistent
    compilation cache (a load, not a compile)."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def cpu8():
    """The 8 host CPU devices (conftest forces them); fails if JAX came up with fewer (e.g. its
    backends were initialized before this conftest ran)."""
    devs = jax.devices("cpu")
    assert len(devs) >= N_HOST_DEVICES, (
        f"expected {N_HOST_DEVICES} host CPU devices, JAX has {len(devs)} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r});"
        " was JAX initialized before tests/conftest.py set the flag?")
    return devs[:N_HOST_DEVICES]


@pytest.fixture(scope="session")
def tiny_cfg():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session")
def tiny_cfg32(tiny_cfg):
    return tiny_cfg.replace(act_dtype="float32")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory):
    """`configs.micro` (tiny's sizes and tokenizer, every mechanism of a step in 3 layers) saved in the
    release layout, for the tests that load a small model with ``--model DIR`` (servers, scripts)."""
    import configs

    return configs.write_checkpoint(configs.micro(), tmp_path_factory.mktemp("micro_ckpt"))


@pytest.fixture(scope="session")
def mini_cfg():
    """`configs.mini`: tiny's mechanisms in 6 layers, for the relational tests (A ≡ B on the same model)."""
    import configs

    return configs.mini()


@pytest.fixture(scope="session")
def mini_cfg32(mini_cfg):
    return mini_cfg.replace(act_dtype="float32")


@pytest.fixture(scope="session")
def mini_params(mini_cfg):
    return init_params(mini_cfg, jax.random.key(0))


@pytest.fixture
def drop_kernels(monkeypatch):
    """drop(op): take every kernel of `op` out of the dispatch registry for one test (how a missing
    kernel is refused); the registry and the resolution cache are restored after it."""
    from dsv41_jax.model import dispatch

    def drop(op: str) -> None:
        monkeypatch.setattr(dispatch, "_REGISTRY", {k: v for k, v in dispatch.registry().items() if k[0] != op})
        dispatch.resolve.cache_clear()

    yield drop
    dispatch.resolve.cache_clear()


@pytest.fixture(scope="session")
def pallas_impl():
    """"pallas" on a GPU, "pallas_interpret" elsewhere (the same kernel body through the HLO interpreter):
    every kernel test is written once and runs natively where it can."""
    return "pallas" if jax.default_backend() == "gpu" else "pallas_interpret"
