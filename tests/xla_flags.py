"""Reading XLA_FLAGS: the one place the test helpers find the compile-speed settings in it (conftest sets
them, goldens record them, servers pass them on): XLA's backend optimization level and whether XLA:CPU
emits fusions with its MLIR fusion emitters."""

from __future__ import annotations

OPT_FLAG = "--xla_backend_optimization_level"
EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"


def last_flag(flags: str, name: str) -> str | None:
    """The last ``name=VALUE`` token of an XLA_FLAGS string (XLA keeps the last), or None without one."""
    found = [f for f in flags.split() if f.split("=", 1)[0] == name]
    return found[-1] if found else None


def opt_level_flag(flags: str) -> str | None:
    """The last ``--xla_backend_optimization_level=N`` token of an XLA_FLAGS string, or None when it names
    no level."""
    return last_flag(flags, OPT_FLAG)


def compile_speed_flags(flags: str) -> list:
    """The level and fusion-emitter tokens of an XLA_FLAGS string (the last of each, in that order): what
    the suite chose for every process it compiles in."""
    return [f for f in (opt_level_flag(flags), last_flag(flags, EMITTERS_FLAG)) if f]


def describe(flags: str) -> str:
    """The compile-speed settings in words for a golden's machine identity: "" for XLA's defaults, else
    e.g. " | xla -O0 | cpu fusion emitters off"."""
    out = ""
    level = opt_level_flag(flags)
    if level:
        out += f" | xla -O{level.split('=', 1)[1]}"
    emitters = last_flag(flags, EMITTERS_FLAG)
    if emitters:
        on = emitters.split("=", 1)[1].strip().lower() not in ("false", "0")
        out += f" | cpu fusion emitters {'on' if on else 'off'}"
    return out
