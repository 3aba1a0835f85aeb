"""The implementation switch (model/dispatch.py): parsing, resolution, clear errors."""

import pytest

from dsv41_jax.model import ModelConfig
from dsv41_jax.model import dispatch as D
from dsv41_jax.model.config import ConfigError


def test_parse_single_and_per_op():
    assert D.parse_impl("xla") == {op: "xla" for op in D.OPS}
    got = D.parse_impl("reference, moe=xla ,attention=auto")
    assert got["moe"] == "xla" and got["attention"] == "auto"
    assert all(got[op] == "reference" for op in D.OPS if op not in ("moe", "attention"))
    assert D.parse_impl("moe=reference")["linear"] == "auto"  # no bare default: auto


@pytest.mark.parametrize("spec, words", [
    ("fast", "unknown implementation 'fast'"),
    ("moe=xla,moe=reference", "given twice"),
    ("mlp=xla", "unknown op 'mlp'"),
    ("xla,,moe=xla", "empty item"),
    ("", "non-empty"),
])
def test_parse_errors_name_the_problem(spec, words):
    with pytest.raises(D.ImplError, match=words):
        D.parse_impl(spec)


def test_resolve_auto_is_xla_without_kernels_and_pallas_is_a_clear_error(drop_kernels):
    assert D.resolve("auto", "moe") == "xla"
    assert D.resolve("reference", "indexer") == "reference"
    # every op has a kernel today; an op without one (its registry entries removed) is a clear error
    drop_kernels("linear")
    for name in ("pallas", "pallas_interpret"):
        with pytest.raises(D.ImplError, match="no Pallas kernel"):
            D.resolve(f"xla,linear={name}", "linear")
        with pytest.raises(D.ImplError, match="no Pallas kernel 'o_proj' for op 'linear'"):
            D.kernel("linear", name, "o_proj")
    with pytest.raises(D.ImplError, match="unknown op"):
        D.resolve("xla", "mlp")


def test_config_field_is_static_and_validated(tiny_cfg):
    assert tiny_cfg.impl == "auto"
    ref = tiny_cfg.replace(impl="reference")
    assert ref != tiny_cfg and hash(ref) != hash(tiny_cfg)  # part of the jit cache key
    assert D.resolve(ref, "attention") == "reference"
    with pytest.raises(ConfigError, match="impl"):
        tiny_cfg.replace(impl="fastest")
    assert "impl" not in ModelConfig.preset("tiny").to_hf_dict()["text_config"]


def test_auto_on_gpu_picks_the_kernels_measured_faster():
    """On a GPU "auto" follows `GPU_AUTO` (measured on an H200: attention and the indexer run their
    kernels, Engram stays on XLA; mHC runs its kernel, XLA's unrolled Sinkhorn being too slow to compile
    on a GPU and its loop ~3x the launches; the MoE kernel, 1.4-4.5x the xla path at decode sizes); an explicit
    "pallas" still runs every kernel; off-GPU "auto" is xla."""
    assert {op: D.resolve("auto", op, backend="gpu") for op, _ in D.registry()} == {
        "attention": "pallas", "indexer": "pallas", "engram": "xla", "mhc": "pallas", "moe": "pallas",
        "linear": "xla"}  # linear: its kernel has not been timed on a GPU yet
    assert all(D.resolve("pallas", op, backend="gpu") == "pallas" for op, _ in D.registry())
    assert all(D.resolve("auto", op, backend="cpu") == "xla" for op in D.OPS)


# ------------------------------------------------------------------------------------------- registry

# every kernel the model's seams call, by (op, variant): the registry must hold exactly these
SEAMS = {("attention", "kernel"), ("attention", "window_codes"), ("indexer", "kernel"), ("engram", "kernel"),
         ("mhc", "kernel"), ("mhc", "sublayer_exit"), ("mhc", "sublayer_exit_enter"), ("moe", "kernel"),
         ("moe", "route"), ("linear", "kernel"), ("linear", "kernel_dual"), ("linear", "o_proj")}


def test_registry_holds_every_seams_kernel_and_each_ops_default():
    reg = D.registry()
    assert set(reg) == SEAMS
    assert all(D.kernel_available(op) for op in D.OPS)
    with pytest.raises(D.ImplError, match="not a Pallas implementation"):
        D.kernel("moe", "xla")
    with pytest.raises(D.ImplError, match=r"no Pallas kernel 'exit' for op 'mhc' \(registered: kernel, "):
        D.kernel("mhc", "pallas", "exit")
    with pytest.raises(D.ImplError, match="unknown op"):
        D.register("mlp", "kernel", kernel=len, reference=len, supports=len)
    entry = reg[("moe", "kernel")]
    with pytest.raises(D.ImplError, match="registered already"):  # two kernels cannot answer one seam
        D.register("moe", "kernel", kernel=len, reference=entry.reference, supports=entry.supports)
    assert D.registry()[("moe", "kernel")] is entry


def _required(sig):
    return [n for n, p in sig.parameters.items() if p.default is p.empty and p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize("key", sorted(SEAMS), ids=lambda k: "/".join(k))
def test_registry_entry_has_a_reference_and_a_supports_predicate(key, tiny_cfg):
    """Each entry: the kernel takes ``interpret``; its reference is another function that takes the kernel's
    arguments (every argument the reference needs is the kernel's, positional ones at the same place); its
    `supports` accepts the tiny and flash configs and refuses the exact / deterministic numerics, whose fp64
    sums the kernels do not do. (That each kernel equals its reference is tests/test_pallas_*.py's.)"""
    import inspect

    e = D.registry()[key]
    assert (e.op, e.variant) == key and D.kernel(key[0], "pallas_interpret", key[1]) is e.kernel
    assert e.reference is not e.kernel and e.reference.__module__.startswith("dsv41_jax.")
    ks, rs = inspect.signature(e.kernel), inspect.signature(e.reference)
    assert "interpret" in ks.parameters
    kpos = [n for n, p in ks.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    for i, name in enumerate(_required(rs)):
        assert name in ks.parameters, (key, name)
        if rs.parameters[name].kind is rs.parameters[name].POSITIONAL_OR_KEYWORD:
            assert kpos[i] == name, (key, kpos, list(rs.parameters))
    flash = ModelConfig.preset("flash")
    assert e.supports(tiny_cfg) and e.supports(flash) and D.supports(*key, tiny_cfg)
    assert not e.supports(tiny_cfg.replace(act_dtype="exact")) and not e.supports(flash.replace(deterministic=True))


def test_loading_the_kernels_does_not_retrace_what_was_traced_before():
    """A function jitted and run before the kernel registry is first loaded (parameter init, the engine's
    helpers, a warm-up's precompiled steps: the registry loads inside the first step's trace) is not traced
    again after it: importing Pallas adds config states to every trace's cache key on jax >= 0.12, so
    model/dispatch.py imports it up front. In a fresh interpreter, since this one has loaded it already."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from dsv41_jax.model import dispatch
        traces = []
        f = jax.jit(lambda x: (traces.append(1), x + 1)[1])
        f(jnp.zeros(3))
        dispatch.registry()  # the first load: imports dsv41_jax.pallas and its kernels
        f(jnp.zeros(3))
        print(len(traces))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1", f"traced {out.stdout.split()[-1]} times (once expected)"
