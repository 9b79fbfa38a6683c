import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.graph.accumulate_in_float32 import AccumulateInFloat32


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4096, 8), "bfloat16"), y: R.Tensor((4096, 8), "float32")):
        with R.dataflow():
            a = R.sum(x, axis=[0], keepdims=False)
            b = R.mean(x, axis=[0, 1], keepdims=True)
            c = R.sum(y, axis=[0], keepdims=False)  # already fp32: left alone
            R.output(a, b, c)
        return (a, b, c)


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4096, 8), "bfloat16"), y: R.Tensor((4096, 8), "float32")):
        with R.dataflow():
            wide = R.astype(x, "float32")
            a = R.astype(R.sum(wide, axis=[0], keepdims=False), "bfloat16")
            wide1 = R.astype(x, "float32")
            b = R.astype(R.mean(wide1, axis=[0, 1], keepdims=True), "bfloat16")
            c = R.sum(y, axis=[0], keepdims=False)
            R.output(a, b, c)
        return (a, b, c)


def test_low_precision_reductions_read_their_input_widened():
    after = relax.transform.CanonicalizeBindings()(AccumulateInFloat32()(Before))
    expected = relax.transform.CanonicalizeBindings()(relax.transform.Normalize()(Expected))
    tvm.ir.assert_structural_equal(after, expected)


def test_a_long_bf16_sum_is_exact_after_widening():
    """TVM legalizes a bf16 sum with a bf16 accumulator: 4096 ones add up to 256 without the pass."""
    import torch

    ones = torch.ones(4096, 8, dtype=torch.bfloat16)
    y = torch.zeros(4096, 8)
    target = tvm.target.Target({"kind": "llvm"})

    def run(mod):
        vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
        out = vm["main"](tvm.runtime.from_dlpack(ones), tvm.runtime.from_dlpack(y))
        return torch.from_dlpack(out[0]).float().numpy()

    assert run(Before)[0] == 256.0  # the failure this pass exists for
    np.testing.assert_array_equal(run(AccumulateInFloat32()(Before)), np.full(8, 4096.0))
