import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.split_reduction import SplitReduction, chunk


def _canonical(mod):
    return relax.transform.CanonicalizeBindings()(mod)


def test_loss_mean_of_everything_becomes_two_float32_sums():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((32, 512, 1024), "bfloat16")):
            with R.dataflow():
                y = R.mean(x)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((32, 512, 1024), "bfloat16")):
            with R.dataflow():
                a = R.astype(x, "float32")
                b = R.reshape(a, R.shape([16384, 1024]))
                c = R.sum(b, axis=[1])
                d = R.sum(c, axis=[0])
                e = R.divide(d, R.const(16777216.0, "float32"))
                y = R.astype(e, "bfloat16")
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_canonical(SplitReduction()(Before)), Expected)


def test_bias_gradient_column_sum_is_chunked_and_keepdims_restored():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32")):
            with R.dataflow():
                y = R.sum(x, axis=[0], keepdims=True)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32")):
            with R.dataflow():
                b = R.reshape(x, R.shape([128, 128, 1024]))
                c = R.sum(b, axis=[1])
                d = R.sum(c, axis=[0])
                y = R.reshape(d, R.shape([1, 1024]))
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(_canonical(SplitReduction()(Before)), Expected)


def test_row_reductions_short_reductions_and_many_outputs_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((16384, 1024), "float32"), s: R.Tensor((64, 8), "float32")):
            with R.dataflow():
                rows = R.sum(x, axis=[1])  # trailing axis: a block per row already
                small = R.max(s)  # 512 elements
                R.output(rows, small)
            return (rows, small)

    tvm.ir.assert_structural_equal(SplitReduction()(Before), Before)


def test_chunk_divides_the_reduced_extent():
    assert chunk(16777216, 1) == 1024
    assert chunk(16384, 1024) == 128
    assert chunk(16384, 4096) == 512
    assert chunk(1000, 1) is None  # below MIN_REDUCED
    assert chunk(16384, 65536) is None  # enough outputs
    c = chunk(3 * 7 * 4099, 2)  # awkward extent: still a divisor (or no split)
    assert c is None or (3 * 7 * 4099) % c == 0


@pytest.mark.parametrize("op,dtype,shape,axis,keepdims", [
    ("mean", "float32", (24, 512, 3), None, False),
    ("mean", "float16", (24, 512, 3), [0, 1], True),
    ("sum", "float16", (24, 512, 3), [0, 1], False),
    ("max", "float32", (6144, 5), [0], True),
    ("min", "float32", (24, 512, 3), None, True),
])
def test_split_reductions_compute_the_same_values(op, dtype, shape, axis, keepdims):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(getattr(relax.op, op)(x, axis=axis, keepdims=keepdims))
        bb.emit_func_output(out)
    mod = bb.get()
    split = SplitReduction()(mod)
    assert "R.reshape" in split.script(), "the reduction was expected to be split"
    data = np.random.default_rng().standard_normal(shape).astype(dtype)
    ex = tvm.compile(split, target=tvm.target.Target({"kind": "llvm"}))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(data)).numpy()
    ref = getattr(np, op)(data.astype("float64"), axis=None if axis is None else tuple(axis), keepdims=keepdims)
    tol = 2e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(got.astype("float64"), ref, rtol=tol, atol=tol * np.abs(ref).max())
