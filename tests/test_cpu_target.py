"""The llvm target every CPU build goes through (tvm_evt.training.as_target)."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.relax import op as R

from tvm_evt.training import LLVM_OPTIONS, as_target, cpu_target


def _silu_weighted_sum(shape):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    w = relax.Var("w", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(R.sum(R.multiply(R.nn.silu(x), w))))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("shape", [(4, 5, 2), (4, 2, 5)])
def test_slp_vectorizer_bug_is_avoided(shape):
    """The shapes on which LLVM's SLP vectorizer breaks module verification build and compute
    the right sum through the project's target; a plain llvm target still fails on them (when
    it stops failing, the TVM wheel's LLVM is fixed and LLVM_OPTIONS can go)."""
    mod = _silu_weighted_sum(shape)
    with pytest.raises(tvm.error.InternalError, match="does not dominate all uses"):
        tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(shape).astype("float32") for _ in range(2))
    vm = relax.VirtualMachine(tvm.compile(mod, target=as_target("llvm")), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    x64 = x.astype("float64")
    want = (x64 / (1 + np.exp(-x64)) * w).sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "given",
    ["llvm", {"kind": "llvm"}, {"kind": "llvm", "mcpu": "x86-64"}, {"kind": "llvm", "cl-opt": ["-unroll-count=2"]}],
    ids=["tag", "dict", "mcpu", "own-cl-opt"],
)
def test_llvm_targets_get_the_options_and_keep_their_own(given):
    target = as_target(given)
    options = [str(o) for o in target.attrs["cl-opt"]]
    assert all(o in options for o in LLVM_OPTIONS)
    if isinstance(given, dict):
        assert target.kind.name == given["kind"]
        assert all(str(target.attrs[k]) == v for k, v in given.items() if k not in ("kind", "cl-opt"))
        assert all(o in options for o in given.get("cl-opt", []))
    assert as_target(target).same_as(target)  # already complete: returned as is


def test_cuda_targets_are_left_alone():
    target = as_target({"kind": "cuda", "arch": "sm_90a"})
    assert "cl-opt" not in target.attrs and str(target.attrs["arch"]) == "sm_90a"


def test_cpu_target_is_the_default_without_a_gpu():
    if tvm.cuda(0).exist:
        pytest.skip("a CUDA GPU is visible")
    assert as_target(None).kind.name == "llvm"
    assert as_target(None).attrs["cl-opt"] == as_target(cpu_target()).attrs["cl-opt"]
