"""Reading XLA_FLAGS: the one place the test helpers find the compile-speed settings in it (conftest sets
them, goldens record them, servers pass them on): XLA's backend optimization level, whether XLA:CPU
emits fusions with its MLIR fusion emitters, and two settings that change only what a compile costs, not
the program it produces (`COMPILE_ONLY_FLAGS`)."""

from __future__ import annotations

OPT_FLAG = "--xla_backend_optimization_level"
EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
DISABLE_PASSES_FLAG = "--xla_disable_hlo_passes"
SPLIT_FLAG = "--xla_cpu_parallel_codegen_split_count"
# The HLO verifier (an invariant check XLA runs after its passes: it changes nothing) skipped, and the LLVM
# module code-generated whole instead of split into parts for threads (the split's cloning costs CPU time,
# and the suite's two workers keep both cores busy anyway). The executables are the same: checked bit for
# bit on 97 output arrays (micro's forward in bf16 / fp32 / exact, mini's cached-path scenario and its
# forward with every kernel in interpret-mode Pallas), so goldens do not record them (`describe`).
COMPILE_ONLY = {f"{DISABLE_PASSES_FLAG}=hlo-verifier": "the HLO verifier skipped", f"{SPLIT_FLAG}=1": "one LLVM module"}
COMPILE_ONLY_FLAGS = tuple(COMPILE_ONLY)


def last_flag(flags: str, name: str) -> str | None:
    """The last ``name=VALUE`` token of an XLA_FLAGS string (XLA keeps the last), or None without one."""
    found = [f for f in flags.split() if f.split("=", 1)[0] == name]
    return found[-1] if found else None


def opt_level_flag(flags: str) -> str | None:
    """The last ``--xla_backend_optimization_level=N`` token of an XLA_FLAGS string, or None when it names
    no level."""
    return last_flag(flags, OPT_FLAG)


def compile_speed_flags(flags: str) -> list:
    """The level, fusion-emitter and compile-only tokens of an XLA_FLAGS string (the last of each, in that
    order): what the suite chose for every process it compiles in."""
    names = (OPT_FLAG, EMITTERS_FLAG) + tuple(f.split("=", 1)[0] for f in COMPILE_ONLY_FLAGS)
    return [f for f in (last_flag(flags, n) for n in names) if f]


def describe(flags: str) -> str:
    """The compile-speed settings in words for a golden's machine identity: "" for XLA's defaults, else
    e.g. " | xla -O0 | cpu fusion emitters off" (the `COMPILE_ONLY_FLAGS` leave the program as it is and
    are not named)."""
    out = ""
    level = opt_level_flag(flags)
    if level:
        out += f" | xla -O{level.split('=', 1)[1]}"
    emitters = last_flag(flags, EMITTERS_FLAG)
    if emitters:
        on = emitters.split("=", 1)[1].strip().lower() not in ("false", "0")
        out += f" | cpu fusion emitters {'on' if on else 'off'}"
    return out
