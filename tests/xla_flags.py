"""Reading XLA_FLAGS: the one place the test helpers find the backend optimization level in it (conftest
sets it, goldens record it, servers pass it on)."""

from __future__ import annotations

OPT_FLAG = "--xla_backend_optimization_level"


def opt_level_flag(flags: str) -> str | None:
    """The last ``--xla_backend_optimization_level=N`` token of an XLA_FLAGS string (XLA keeps the last),
    or None when it names no level."""
    found = [f for f in flags.split() if f.split("=", 1)[0] == OPT_FLAG]
    return found[-1] if found else None
