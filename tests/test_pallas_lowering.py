"""Every Pallas kernel lowers to valid Triton IR for a CUDA target, on a machine without a GPU.

`offline.capture_kernels` lowers the call for platform "cuda" (Pallas' Triton lowering assumes sm_90
without a GPU) and verifies each kernel's Triton IR; a kernel that uses a primitive with no Triton
lowering rule, a non-power-of-two block or a bad dot shape fails here, not first on a GPU.
`research/triton_offline_check.py` goes further (Triton's compiler + ptxas: registers, spills;
docs/results/triton_offline_sm90.json). The attention kernel has its own lowering test in
test_pallas_attention.py. On a GPU the native kernel tests compile the kernels, which subsumes this.
"""

import functools

import jax
import pytest

from dsv41_jax.pallas.offline import capture_kernels

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="native kernel tests compile on this GPU")


@pytest.mark.parametrize("kind", ["dense", "source", "masked"])
def test_indexer_lowers_for_cuda(kind):
    from dsv41_jax.pallas import costs
    from dsv41_jax.pallas import indexer_topk as it

    args, kw = costs.indexer_bench_inputs(2, 512, 6, kind=kind)  # flash head shapes, verify window
    ks = capture_kernels(functools.partial(it.kernel, interpret=False, **kw), *args)
    names = [k["name"] for k in ks]
    assert any("select" in n for n in names) and len(ks) >= 2, names
    assert all("tt.load" in k["ttir"] for k in ks)


@pytest.mark.parametrize("mod_name,extra", [("engram", {"table_rows": 256}), ("mhc", {})])
def test_mix_kernels_lower_for_cuda(mod_name, extra):
    from dsv41_jax.pallas import costs

    bench_inputs = {"engram": costs.engram_bench_inputs, "mhc": costs.mhc_bench_inputs}[mod_name]
    for tokens in (1, 24):  # decode (split over D for mHC) and a verify-sized block
        for part, (kfn, _xla, args) in bench_inputs(tokens, seed=0, interpret=False, **extra).items():
            ks = capture_kernels(kfn, *args)
            assert ks, (mod_name, part)
            assert all(k["num_warps"] >= 1 and "tt.load" in k["ttir"] for k in ks), (mod_name, part)
