import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.lower.split_to_slices import SplitToSlices, piece_bounds


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 9, 3), "float32")):
        with R.dataflow():
            parts = R.split(x, 3, axis=1)
            a = parts[0]
            b = R.add(parts[1], parts[2])
            y = R.multiply(a, b)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((4, 9, 3), "float32")):
        with R.dataflow():
            s0 = R.strided_slice(x, [1], [0], [3])
            s1 = R.strided_slice(x, [1], [3], [6])
            s2 = R.strided_slice(x, [1], [6], [9])
            b = R.add(s1, s2)
            y = R.multiply(s0, b)
            R.output(y)
        return y


def _run(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def test_split_becomes_one_slice_per_piece_read_directly():
    after = SplitToSlices()(Before)
    tvm.ir.assert_structural_equal(after, Expected)
    x = np.random.default_rng().standard_normal((4, 9, 3)).astype("float32")
    np.testing.assert_array_equal(_run(after, x), _run(Before, x))


@pytest.mark.parametrize("extent,arg,want", [
    (9, 3, [(0, 3), (3, 6), (6, 9)]),
    (10, [2, 5], [(0, 2), (2, 5), (5, 10)]),
    (6, [2, 2, 6], [(0, 2), (2, 2), (2, 6), (6, 6)]),  # empty pieces
    (6, [4, 2], None),  # unsorted cuts: left alone
    (10, 3, None),  # uneven sections: left alone
])
def test_piece_bounds(extent, arg, want):
    assert piece_bounds(extent, arg) == want
    if want is not None:
        assert [b - a for a, b in want] == [p.shape[0] for p in np.split(np.arange(extent), arg)]


def test_col2im_of_a_3x3_convolution_is_one_kernel(monkeypatch):
    """ResNet's 3x3 NHWC convolution: the gradient of its im2col (concat's split, then a pad per
    tap and the sum) fuses into one gather kernel reading the column gradient; before, the split
    was one kernel writing 9 pieces and four taps were padded in kernels of their own."""
    from tvm_evt import models, pipeline, tuning

    monkeypatch.setenv(pipeline.DISABLE_ENV, "implicit_conv")  # the im2col route (on by default: kernels)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    _, graph = tuning.training_graph(models.ZOO["resnet_basic"](), "bf16")
    fused = tuning.tir_module(graph.mod, cuda)
    names = [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not [n for n in names if "split" in n]
    # the taps' squeezes (expand_dims' gradient) all in one kernel: conv2's col2im (conv1 reads
    # the model's input, which has no gradient)
    col2im = [n for n in names if "squeeze" in n]
    assert len(col2im) == 1 and col2im[0].count("squeeze") == 9, col2im
