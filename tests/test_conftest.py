"""The test processes' XLA settings (tests/conftest.py): 8 host devices whatever XLA_FLAGS the shell had,
and XLA's CPU backend at -O0 with its fusion emitters off, its HLO verifier skipped and one LLVM module
per compile unless asked otherwise (`conftest._with_test_opt_level`)."""

import os

import pytest

import conftest
import goldens
import xla_flags
from xla_flags import OPT_FLAG, opt_level_flag


def test_this_run_compiles_as_chosen():
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=8" in flags
    levels = [f for f in flags if f.split("=", 1)[0] == OPT_FLAG]
    assert len(levels) <= 1 and opt_level_flag(os.environ["XLA_FLAGS"]) == (levels[0] if levels else None)
    if os.environ.get(conftest.OPT_ENV, "0") == "0" and not conftest._accelerator_plugin():
        assert levels, flags  # the default choice is applied ...
    assert (goldens.machine().endswith(xla_flags.describe(os.environ["XLA_FLAGS"])) if levels
            else "xla -O" not in goldens.machine())  # ... and a golden records it


def test_opt_level_choice(monkeypatch):
    monkeypatch.setattr(conftest, "_accelerator_plugin", lambda: None)
    monkeypatch.setattr(conftest, "_xla_accepts", lambda flag: True)
    monkeypatch.delenv(conftest.OPT_ENV, raising=False)
    only = ["--xla_disable_hlo_passes=hlo-verifier", "--xla_cpu_parallel_codegen_split_count=1"]
    assert list(xla_flags.COMPILE_ONLY_FLAGS) == only
    flags, why = conftest._with_test_opt_level("--a=1")
    assert flags.split() == ["--a=1", "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"] + only
    assert "-O0" in why and "fusion emitters off" in why and "HLO verifier skipped" in why and "one LLVM module" in why
    # the shell's own emitter, pass and split choices are kept (and the level still added)
    flags, why = conftest._with_test_opt_level("--xla_cpu_use_fusion_emitters=true")
    assert flags.split() == ["--xla_cpu_use_fusion_emitters=true", "--xla_backend_optimization_level=0"] + only
    flags, why = conftest._with_test_opt_level("--xla_disable_hlo_passes=foo --xla_cpu_parallel_codegen_split_count=4")
    assert flags.split() == ["--xla_disable_hlo_passes=foo", "--xla_cpu_parallel_codegen_split_count=4",
                             "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
    assert "verifier" not in why
    # an XLA that knows none of them gets -O0 alone, and the header says so; one that knows only some
    # (the joint probe fails, then each is asked alone) gets those
    monkeypatch.setattr(conftest, "_xla_accepts", lambda flag: False)
    flags, why = conftest._with_test_opt_level("--a=1")
    assert flags.split() == ["--a=1", "--xla_backend_optimization_level=0"] and "does not know" in why
    monkeypatch.setattr(conftest, "_xla_accepts", lambda flag: " " not in flag and "split" not in flag)
    flags, why = conftest._with_test_opt_level("--a=1")
    assert flags.split() == ["--a=1", "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                             only[0]] and "one LLVM module" not in why
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
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
    assert goldens.machine() == base + " | xla -O0 | cpu fusion emitters off"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
    assert goldens.machine() == base + " | cpu fusion emitters on"
    # the compile-only settings produce the same executables: not part of the identity
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 " + " ".join(xla_flags.COMPILE_ONLY_FLAGS))
    assert goldens.machine() == base + " | xla -O0"


def test_servers_keep_the_compile_speed_flags(monkeypatch):
    """A user-like server environment keeps the suite's level, emitter and compile-only choices, nothing else
    of XLA_FLAGS."""
    import servers

    only = " ".join(xla_flags.COMPILE_ONLY_FLAGS)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                    f"--xla_cpu_use_fusion_emitters=false {only} --xla_dump_to=/tmp/x")
    assert servers.user_env()["XLA_FLAGS"] == f"--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false {only}"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert "XLA_FLAGS" not in servers.user_env()


def test_the_emitter_probe_asks_xla():
    """`_xla_accepts` brings XLA up in a subprocess: it accepts a flag every XLA knows and refuses a made-up
    one (on which XLA aborts the process)."""
    assert conftest._xla_accepts(f"{OPT_FLAG}=0")
    assert not conftest._xla_accepts("--xla_cpu_no_such_flag_for_the_test=1")
    assert not conftest._xla_accepts(f"{OPT_FLAG}=0 --xla_cpu_no_such_flag_for_the_test=1")  # one unknown: refused


def test_the_scheduler_starts_the_heaviest_files_first():
    """README's command runs files on two workers (--dist loadfile); `conftest.HeaviestFirst` hands them out by their
    recorded seconds (tests/data/file_seconds.json), heaviest first, where xdist's own order (by test count) would
    leave the few-test, many-second files for last. A file with no record counts as the median."""
    import json
    import pathlib
    import subprocess
    import sys

    seconds = {"tests/a.py": 5, "tests/b.py": 50, "tests/c.py": 1}
    assert conftest.heaviest_first(["tests/a.py", "tests/new.py", "tests/b.py", "tests/c.py"], seconds) == [
        "tests/b.py", "tests/a.py", "tests/new.py", "tests/c.py"]

    class Node:  # what the scheduler asks of a worker
        def __init__(self):
            self.sent = []

        def send_runtest_some(self, indexes):
            self.sent.append(indexes)

    sched = conftest.HeaviestFirst.__new__(conftest.HeaviestFirst)  # the queue as xdist's `schedule` leaves it
    recorded = json.loads(pathlib.Path(conftest.FILE_SECONDS).read_text())
    light, heavy = min(recorded, key=recorded.get), max(recorded, key=recorded.get)
    collection = [f"{light}::test_1", f"{light}::test_2", f"{heavy}::test_1"]
    from collections import OrderedDict

    sched.workqueue = OrderedDict([(light, {collection[0]: False, collection[1]: False}), (heavy, {collection[2]: False})])
    node = Node()
    sched.assigned_work, sched.registered_collections = {}, {node: collection}
    sched._assign_work_unit(node)
    assert node.sent == [[2]] and list(sched.assigned_work[node]) == [heavy]
    # the recorded files exist (a renamed file would lose its weight), and the table is the script's output format
    root = pathlib.Path(conftest.__file__).resolve().parent.parent
    assert all((root / f).is_file() for f in recorded), sorted(f for f in recorded if not (root / f).is_file())
    out = subprocess.run([sys.executable, str(root / "scripts" / "file_seconds.py"), "-"], capture_output=True,
                         text=True, input="12.50s call     tests/x.py::test_a\n0.40s setup    tests/x.py::test_b\n"
                                          "3.00s teardown tests/y.py::C::test_c[1]\n")
    assert out.returncode == 0 and json.loads(out.stdout) == {"tests/x.py": 13, "tests/y.py": 3}, out.stderr
    bad = subprocess.run([sys.executable, str(root / "scripts" / "file_seconds.py"), "-"], capture_output=True,
                         text=True, input="nothing here\n")
    assert bad.returncode == 2 and "no durations" in bad.stderr
