"""Comparing against the recorded exact-mode goldens (`tests/data/*.npz`).

The exact mode makes a result independent of summation order and batch shape, not of the machine: what
is left in fp32 (elementwise chains that LLVM may contract into FMAs depending on how XLA fused them,
the few short fp32 sums) can differ in the last bit between CPUs. Measured (eighth session): the goldens
recorded on an AMD EPYC and recomputed on an Intel Xeon with AVX-512 part by at most 4.8e-7 in the
logits (1-2 ulp; 78 % of the elements), every discrete decision (top-k slots, candidate blocks,
experts) identical; and on one CPU the jitted exact forward and the same forward run op by op
(`jax.disable_jit`, nothing fused) already part by 1 ulp from layer 0 on.

So a golden records the machine it was made on (``cpu``: the CPU model and jaxlib version) and is
compared:

* on that machine: every array bit for bit;
* elsewhere: integer / boolean arrays (the discrete decisions) bit for bit, float arrays within
  `CROSS_CPU_ATOL` (about 8 fp32 ulp at the logits' magnitude; a change to the model's code moves them
  by orders of magnitude more, an fp8 activation code flip alone by ~1e-2).
"""

from __future__ import annotations

import platform

import numpy as np

import xla_flags

CROSS_CPU_ATOL = 4e-6


def machine() -> str:
    """This process's CPU model and jaxlib version, e.g. 'Intel(R) Xeon(R) Processor | jaxlib 0.10.2', and
    the compile-speed settings XLA_FLAGS has (the test suite runs XLA:CPU at -O0 with its fusion emitters
    off, conftest; `xla_flags.describe`): the level decides whether LLVM contracts fp32 a*b+c into FMAs,
    and the emitters how a fusion's elementwise chain is written out, either of which moves the last bit
    like another CPU."""
    import os

    import jaxlib

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    who = f"{model} | jaxlib {jaxlib.__version__}"
    return who + xla_flags.describe(os.environ.get("XLA_FLAGS", ""))


def save(path, **arrays) -> None:
    """Write a golden with this machine's identity beside the arrays."""
    np.savez_compressed(path, cpu=np.asarray(machine()), **arrays)


def load(path) -> tuple[dict, str]:
    """(arrays, the machine they were recorded on)."""
    g = np.load(path)
    return {k: g[k] for k in g.files if k != "cpu"}, str(g["cpu"]) if "cpu" in g.files else "?"


def assert_matches(got: dict, path) -> None:
    """`got` equals the golden at `path`: bit for bit on the recording machine, else as the module doc says."""
    want, where = load(path)
    assert sorted(got) == sorted(want)
    same_machine = where == machine()
    worst = {}
    for k in sorted(want):
        g, w = np.asarray(got[k]), want[k]
        if same_machine or not np.issubdtype(w.dtype, np.floating):
            np.testing.assert_array_equal(g, w, err_msg=f"{k} (golden from {where})")
        else:
            assert g.shape == w.shape, k
            worst[k] = float(np.abs(g.astype(np.float64) - w).max()) if w.size else 0.0
    bad = {k: d for k, d in worst.items() if not d <= CROSS_CPU_ATOL}
    assert not bad, (f"golden recorded on {where!r}, this is {machine()!r}: |Δ| above {CROSS_CPU_ATOL} in "
                     f"{bad} (decisions identical)")
