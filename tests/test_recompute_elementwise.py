"""RecomputeElementwise: a copy of a cheap value before each kernel-fusable reader."""

import tvm
from tvm import relax

from tvm_evt.relax_passes.recompute_elementwise import RecomputeElementwise

N, C = 512, 256
SUM = relax.op.sum


def _params():
    return (relax.Var("x16", relax.TensorType((N, C), "bfloat16")),
            relax.Var("m", relax.TensorType((1, C), "float32")))


def _centred(c_is_output: bool = False):
    """A batch norm gradient's shape of reads: x32 = astype(x16) summed, and c = x32 - m read by
    a sum of squares and by an elementwise tail (and, `c_is_output`, returned)."""
    bb = relax.BlockBuilder()
    x16, m = _params()
    with bb.function("main", [x16, m]):
        with bb.dataflow():
            emit = bb.emit
            x32 = emit(relax.op.astype(x16, "float32"))
            c = emit(relax.op.subtract(x32, m))
            s1 = emit(SUM(x32, [0]))
            sq = emit(relax.op.multiply(c, c))
            s2 = emit(SUM(sq, [0]))
            d = emit(relax.op.multiply(c, relax.const(2.0, "float32")))
            gv = bb.emit_output(relax.Tuple([s1, s2, d] + ([c] if c_is_output else [])))
        bb.emit_func_output(gv)
    return bb.get()


def test_each_reader_recomputes_the_chain():
    bb = relax.BlockBuilder()
    x16, m = _params()
    with bb.function("main", [x16, m]):
        with bb.dataflow():
            emit = bb.emit
            s1 = emit(SUM(emit(relax.op.astype(x16, "float32")), [0]))
            cb = emit(relax.op.subtract(emit(relax.op.astype(x16, "float32")), m))
            s2 = emit(SUM(emit(relax.op.multiply(cb, cb)), [0]))
            cc = emit(relax.op.subtract(emit(relax.op.astype(x16, "float32")), m))
            d = emit(relax.op.multiply(cc, relax.const(2.0, "float32")))
            gv = bb.emit_output(relax.Tuple([s1, s2, d]))
        bb.emit_func_output(gv)
    tvm.ir.assert_structural_equal(RecomputeElementwise()(_centred()), bb.get())


def test_a_returned_value_keeps_its_binding_for_the_output():
    after = RecomputeElementwise()(_centred(c_is_output=True))
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    # c stays (returned) with its own x32 copy; the three fusable readers recompute c or x32
    assert ops.count("relax.subtract") == 3 and ops.count("relax.astype") == 4


def test_values_that_read_more_than_they_hold_are_left_alone():
    """a + b of two float32 tensors reads 8 bytes an element to make 4: reading it back is cheaper."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((N, C), "float32"))
    b = relax.Var("b", relax.TensorType((N, C), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(a, b))
            gv = bb.emit_output(relax.Tuple([bb.emit(SUM(s, [0])), bb.emit(relax.op.exp(s))]))
        bb.emit_func_output(gv)
    before = bb.get()
    tvm.ir.assert_structural_equal(RecomputeElementwise()(before), before)
