"""RecomputeElementwise: a copy of a cheap value before each kernel-fusable reader."""

import tvm
from tvm import relax

from tvm_evt.relax_passes.recompute_elementwise import RecomputeElementwise, recompute_pays

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


def _sum_of_two(readers: int):
    """s = a + b of two float32 tensors (8 bytes read for 4 made), read by `readers` kernels."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((N, C), "float32"))
    b = relax.Var("b", relax.TensorType((N, C), "float32"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(a, b))
            ops = [lambda v: SUM(v, [0]), relax.op.exp, relax.op.sqrt, relax.op.negative][:readers]
            outs = [bb.emit(op(s)) for op in ops]
            gv = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(gv)
    return bb.get()


def test_values_that_read_more_than_they_hold_are_left_alone():
    """Four readers of a + b: recomputed, 4 x 8 bytes an element; written once and read back,
    8 + 4 + 4 x 4 -- fewer."""
    before = _sum_of_two(4)
    tvm.ir.assert_structural_equal(RecomputeElementwise()(before), before)


def test_values_that_read_more_than_they_hold_are_recomputed_by_two_readers():
    """Two readers of a + b: recomputed, 2 x 8 bytes an element; written once, 8 + 4 + 2 x 4."""
    after = RecomputeElementwise()(_sum_of_two(2))
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == ["relax.add", "relax.sum", "relax.add", "relax.exp"]


def test_recompute_pays_weighs_the_bytes_of_each_choice():
    s = _sum_of_two(1)["main"].body.blocks[0].bindings[0]
    assert recompute_pays(s.value, s.var, readers=3, others=False)  # 3 x 8 <= 8 + 4 + 3 x 4
    assert not recompute_pays(s.value, s.var, readers=4, others=False)  # 4 x 8 > 8 + 4 + 4 x 4
    assert not recompute_pays(s.value, s.var, readers=2, others=True)  # written anyway: 8 > 4


def test_a_reader_that_is_an_output_of_the_dataflow_block_keeps_its_var():
    """A reader rebuilt over the copies is bound to its own var: a sum the function returns
    (a bias gradient) stays an output of the dataflow block."""
    bb = relax.BlockBuilder()
    x16, m = _params()
    with bb.function("main", [x16, m]):
        with bb.dataflow():
            c = bb.emit(relax.op.subtract(bb.emit(relax.op.astype(x16, "float32")), m))
            s = bb.emit_output(SUM(c, [0]))
            d = bb.emit_output(relax.op.multiply(c, relax.const(2.0, "float32")))
        bb.emit_func_output(relax.Tuple([s, d]))
    after = RecomputeElementwise()(bb.get())
    outputs = [b.var for b in after["main"].body.blocks[0].bindings if not isinstance(b.var, relax.DataflowVar)]
    assert len(outputs) == 2 and all(o.same_as(r) for o, r in zip(outputs, after["main"].body.body.fields))
    assert [b.value.op.name for b in after["main"].body.blocks[0].bindings] == [
        "relax.astype", "relax.subtract", "relax.sum", "relax.astype", "relax.subtract", "relax.multiply"]
