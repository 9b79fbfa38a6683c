"""MergeReducedAxes (relax_passes/lower/merge_reduced_axes.py): a reduction over a run of adjacent
axes as one over a merged axis of a reshape, which the column rule then schedules."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.lower.merge_reduced_axes import MergeReducedAxes


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 4, 4, 8), "float32")):
        with R.dataflow():
            pool = R.sum(x, axis=[1, 2], keepdims=True)  # a pool's H and W: merged
            flat = R.max(x, axis=[2, 1])  # the same run, in any order, without keepdims
            split = R.sum(x, axis=[0, 2])  # not adjacent: stays
            one = R.mean(x, axis=[1])  # one axis: stays
            R.output(pool, flat, split, one)
        return (pool, flat, split, one)


def test_adjacent_reduced_axes_become_one():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4, 4, 8), "float32")):
            with R.dataflow():
                x1 = R.reshape(x, R.shape([2, 16, 8]))
                s1 = R.sum(x1, axis=[1], keepdims=True)
                pool = R.reshape(s1, R.shape([2, 1, 1, 8]))
                x2 = R.reshape(x, R.shape([2, 16, 8]))
                flat = R.max(x2, axis=[1])
                split = R.sum(x, axis=[0, 2])
                one = R.mean(x, axis=[1])
                R.output(pool, flat, split, one)
            return (pool, flat, split, one)

    tvm.ir.assert_structural_equal(MergeReducedAxes()(Before), Expected)


def test_numbers_stay_and_the_column_rule_takes_the_pool():
    """The same results on llvm; on CUDA the pool's sum is one reduction iterator, which
    ``ColumnReduction`` schedules (vector loads, row groups across threadIdx.y)."""
    rng = np.random.default_rng(0)
    x = tvm.runtime.tensor(rng.standard_normal((2, 4, 4, 8)).astype("float32"))
    llvm = tvm.target.Target({"kind": "llvm"})
    runs = [relax.VirtualMachine(tvm.compile(mod, target=llvm), tvm.cpu())["main"](x)
            for mod in (Before, MergeReducedAxes()(Before))]
    for a, b in zip(*runs):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-6)

    from tvm_evt.relax_passes.lower.column_reduction import ColumnReduction

    @I.ir_module
    class Pool:
        @R.function
        def main(x: R.Tensor((128, 7, 7, 1280), "float32")):
            with R.dataflow():
                s = R.sum(x, axis=[1, 2], keepdims=True)
                R.output(s)
            return s

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})

    def column_rule_takes(mod) -> bool:
        mod = relax.transform.LegalizeOps()(mod)  # the reshapes are PrimFuncs of their own (views, built)
        funcs = [f for gv, f in mod.functions_items() if gv.name_hint == "sum"]
        assert len(funcs) == 1
        return ColumnReduction().apply(funcs[0], cuda, False) is not None

    assert not column_rule_takes(Pool)  # two reduction iterators: DLight's Reduction took it
    assert column_rule_takes(MergeReducedAxes()(Pool))
