"""Check a Pallas Triton kernel for a GPU target on a machine without one.

`capture_ttir` lowers a function for platform "cuda" (the Triton lowering assumes sm_90 when no GPU is
present: jax/_src/pallas/triton/pallas_call_registration.py) and returns the Triton IR of each
pallas_call, verified. JAX 0.12 no longer assumes a GPU: it reads the target from an abstract mesh's
`AbstractDevice` (jax/_src/pallas/triton/gpu_info.py `get_device_kind`), so `target_device` sets one
(an H200, sm_90) around the lowering wherever this JAX's `AbstractMesh` takes `abstract_device`.
`compile_ttir` runs Triton's own compiler (the `triton` package, in the
`[gpu]` extra) through TTGIR, LLVM, PTX and ptxas, and reads registers per thread, stack
(spill) bytes and shared memory back with cuobjdump. A kernel that fails here fails on the GPU too;
one that passes still needs the GPU for numerics and speed. Used by research/triton_offline_check.py
and the kernels' lowering tests. Private JAX APIs (checked on 0.10.2 and 0.12.0.1): the patch point is
`pallas_call_registration.lowering.lower_jaxpr_to_triton_module`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import jax

TARGET_DEVICE_KIND = "NVIDIA H200"  # sm_90, the GPU this project measures on


def target_device(device_kind: str = TARGET_DEVICE_KIND):
    """A context in which Pallas' Triton lowering targets `device_kind` without a GPU present.

    JAX 0.10 needs nothing (the lowering assumes sm_90 when no GPU is found); 0.12 raises "No supported
    GPU devices found" unless an abstract mesh names an abstract GPU device, which this sets (a 1-device
    mesh: the kernels take no mesh axes)."""
    try:
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
            device_kind=device_kind, num_cores=None, platform="gpu"))
    except (TypeError, AttributeError):  # JAX without abstract devices: the lowering assumes sm_90
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def capture_ttir(fn, *args) -> list:
    """Triton IR text of every pallas_call in `fn(*args)` lowered for "cuda" (each module verified)."""
    return [k["ttir"] for k in capture_kernels(fn, *args)]


def capture_kernels(fn, *args) -> list:
    """Like `capture_ttir`, with each kernel's launch parameters: a list of
    {"name", "ttir", "num_warps", "num_stages"}, one per pallas_call in `fn(*args)` lowered for "cuda".
    The launch parameters are read back from the lowered module's Triton custom calls (their backend
    config holds name, num_stages and num_warps), in the order the kernels were lowered."""
    import re

    from jax._src.pallas.triton import pallas_call_registration as reg

    ttirs = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def lower(*a, **k):
        r = orig(*a, **k)
        if not r.module.operation.verify():
            raise RuntimeError("Triton IR failed verification")
        ttirs.append(r.module.operation.get_asm())
        return r

    reg.lowering.lower_jaxpr_to_triton_module = lower
    try:
        with target_device():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    launches = re.findall(r'name = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(launches) != len(ttirs):
        raise RuntimeError(f"found {len(launches)} Triton launches for {len(ttirs)} lowered kernels")
    return [dict(name=n, num_stages=int(s), num_warps=int(w), ttir=t) for (n, s, w), t in zip(launches, ttirs)]


def compile_ttir(ttir: str, *, num_warps: int, num_stages: int, arch: int = 90) -> dict:
    """Compile Triton IR text to a cubin for sm_`arch`: {"regs", "stack" (spill bytes), "shared"}."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset
    try:
        import triton
    except ImportError as e:
        raise ImportError("compile_ttir needs the `triton` package: pip install -e '.[gpu]' (or pip install "
                          "triton on a CPU-only machine)") from e
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        k = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=num_warps, num_stages=num_stages))
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True,
                             check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(k.metadata.shared)}
