"""FoldConstants (relax_passes/graph/fold_constants.py): what TVM's FoldConstant makes of a
function, legalizing only the calls of its constant cone (issue #40: FoldConstant legalized
ResNet-50's 8075 calls to fold two, 9.5-14 s of a 2-core machine)."""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import op as R

from tvm_evt.relax_passes.graph.fold_constants import FoldConstants, constant_cone


def _module(layers: int) -> tvm.IRModule:
    """A cross-entropy head's constants (``arange`` over the classes, a cast of 0.0, a sum of the
    two) next to `layers` elementwise ops on the input, some reading the folded values; the
    cast's output is a dataflow block's output var (folded, not substituted at its uses)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            classes = bb.emit(R.astype(R.arange(0, 8, 1, dtype="int64"), "float32"))
            zero = bb.emit_output(R.astype(relax.const(0.0, "float32"), "bfloat16"))
            offset = bb.emit(R.add(classes, relax.const(1.0, "float32")))
            bb.emit(R.multiply(offset, offset))  # folds, then unused
            y = x
            for i in range(layers):
                y = bb.emit(R.add(y, offset) if i % 2 else R.multiply(y, relax.const(0.5, "float32")))
            out = bb.emit_output(R.maximum(y, R.astype(zero, "float32")))
        bb.emit_func_output(relax.Tuple([out, zero]))
    return bb.get()


def test_equals_fold_constant():
    mod = _module(6)
    cone, outside = constant_cone(mod["main"])
    assert len(cone) == 6 and not outside  # arange, its cast, the cast of 0.0, the sum, the square, zero as float32
    folded = relax.transform.FoldConstant()(mod)
    assert not tvm_ffi.structural_equal(folded, mod)  # something folded
    tvm.ir.assert_structural_equal(FoldConstants()(mod), folded)


def _outside_dataflow() -> relax.Function:
    """A function with a foldable binding outside a dataflow block (an offloaded attention's zeros)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8,), "float32"))
    with bb.function("outside", [x]):
        ones = bb.emit(R.ones((8,), "float32"))
        out = bb.emit(R.add(x, ones))
        bb.emit_func_output(out)
    return bb.get()["outside"]


def test_a_foldable_binding_outside_dataflow_gets_fold_constant_as_it_is():
    mod = tvm.IRModule({tvm.ir.GlobalVar("main"): _outside_dataflow()})
    assert constant_cone(mod["main"])[1]
    tvm.ir.assert_structural_equal(FoldConstants()(mod), relax.transform.FoldConstant()(mod))


def test_a_function_with_a_foldable_binding_outside_dataflow_leaves_the_others_to_the_cone():
    """TVM's pass runs on that function alone: the deep graph beside it is not legalized."""
    deep = _module(100)
    mod = tvm.IRModule({**dict(deep.functions_items()), tvm.ir.GlobalVar("outside"): _outside_dataflow()})
    tvm.ir.assert_structural_equal(FoldConstants()(mod), relax.transform.FoldConstant()(mod))
    assert _legalized(FoldConstants(), mod) <= 5 + 2  # the deep graph's cone, the small function's two calls


def _legalized(pass_, mod) -> int:
    """The calls `pass_` legalizes to TIR (``BlockBuilder.call_te``) on `mod`."""
    count = 0
    original = relax.BlockBuilder.call_te

    def counting(self, *args, **kwargs):
        nonlocal count
        count += 1
        return original(self, *args, **kwargs)

    relax.BlockBuilder.call_te = counting
    try:
        pass_(mod)
    finally:
        relax.BlockBuilder.call_te = original
    return count


def test_legalizes_the_constant_cone_not_the_graph():
    """FoldConstant legalizes every call of the graph; FoldConstants the cone's, at any depth."""
    small, deep = _module(10), _module(100)
    assert _legalized(relax.transform.FoldConstant(), deep) >= 100
    assert _legalized(FoldConstants(), small) == _legalized(FoldConstants(), deep) <= 5
