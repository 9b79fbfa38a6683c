"""RecomputeElementwise: a copy of a cheap value before each kernel-fusable reader."""

import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.recompute_elementwise import RecomputeElementwise, recompute_pays

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


def _statistics_module(body):
    """main(x [N, C], s [1, C], v [1, C]) returning the fields `body(emit, x, s, v)` gives."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, C), "float32"))
    s = relax.Var("s", relax.TensorType((1, C), "float32"))
    v = relax.Var("v", relax.TensorType((1, C), "float32"))
    with bb.function("main", [x, s, v]):
        with bb.dataflow():
            gv = bb.emit_output(relax.Tuple(body(bb.emit, x, s, v)))
        bb.emit_func_output(gv)
    return bb.get()


def _mean(emit, s):
    return emit(relax.op.divide(s, relax.const(float(N), "float32")))


def _rstd(emit, v):
    root = emit(relax.op.sqrt(emit(relax.op.add(v, relax.const(1e-5, "float32")))))
    return emit(relax.op.divide(relax.const(1.0, "float32"), root))


def _statistics(rstd_is_output: bool = False):
    """A batch norm's per-channel statistics read by two kernels over [N, C]: mean = s / N and
    rstd = 1 / sqrt(v + eps), each small ([1, C]), each read by both the normalization and a
    second elementwise tail (and, `rstd_is_output`, returned: saved for the backward pass)."""
    def body(emit, x, s, v):
        mean, rstd = _mean(emit, s), _rstd(emit, v)
        y = emit(relax.op.multiply(emit(relax.op.subtract(x, mean)), rstd))
        z = emit(relax.op.multiply(emit(relax.op.add(x, mean)), rstd))
        return [y, z] + ([rstd] if rstd_is_output else [])

    return _statistics_module(body)


def test_small_statistics_are_recomputed_by_each_reader_so_their_kernels_go():
    """Below MIN_ELEMENTS the bytes do not matter but a kernel launch does: where every reader of
    a small value can take a copy, each does (sqrt included), and the value's own kernel goes."""
    def body(emit, x, s, v):
        y = emit(relax.op.multiply(emit(relax.op.subtract(x, _mean(emit, s))), _rstd(emit, v)))
        z = emit(relax.op.multiply(emit(relax.op.add(x, _mean(emit, s))), _rstd(emit, v)))
        return [y, z]

    tvm.ir.assert_structural_equal(RecomputeElementwise(statistics=True)(_statistics()), _statistics_module(body))
    # off by default (pipeline.OPTIONAL["recompute_statistics"]): the statistics keep their kernels
    tvm.ir.assert_structural_equal(RecomputeElementwise()(_statistics()), _statistics())


def test_a_small_value_another_reader_keeps_is_not_copied():
    """rstd is also returned, so its kernel stays: copies would only add work.  The chain under it
    (v + eps, its sqrt) has rstd as its one reader and is left alone too; mean still goes."""
    after = RecomputeElementwise(statistics=True)(_statistics(rstd_is_output=True))
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops.count("relax.sqrt") == 1 and ops.count("relax.divide") == 3  # one rstd, two means


def test_recomputed_statistics_compute_the_same_values():
    import numpy as np

    before = _statistics(rstd_is_output=True)
    after = RecomputeElementwise(statistics=True)(_statistics())
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((N, C)).astype("float32"), rng.standard_normal((1, C)).astype("float32"),
            rng.random((1, C)).astype("float32")]
    dev = tvm.cpu()
    outs = []
    for mod in (before, after):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), dev)
        res = vm["main"](*[tvm.runtime.tensor(a, dev) for a in args])
        outs.append([res[i].numpy() for i in range(2)])
    mean = args[1] / N
    rstd = 1.0 / np.sqrt(args[2] + 1e-5)
    for got in outs:
        np.testing.assert_allclose(got[0], (args[0] - mean) * rstd, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1], (args[0] + mean) * rstd, rtol=1e-5, atol=1e-5)


def _sliced_logits():
    """A padded GEMM's [N, C + 7] output sliced back to [N, C] and cast to float32 for a row max
    and an exp (a loss over a padded vocabulary)."""
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType((N, C + 7), "bfloat16"))
    with bb.function("main", [z]):
        with bb.dataflow():
            emit = bb.emit
            s = emit(relax.op.strided_slice(z, axes=[1], begin=[0], end=[C]))
            x32 = emit(relax.op.astype(s, "float32"))
            mx = emit(relax.op.max(x32, axis=[1], keepdims=True))
            e = emit(relax.op.exp(relax.op.subtract(x32, mx)))
            gv = bb.emit_output(relax.Tuple([mx, e]))
        bb.emit_func_output(gv)
    return bb.get()


def test_a_slice_is_recomputed_with_the_cast_that_reads_it():
    """Each reader of the cast gets its own cast and its own slice: no kernel copies the slice."""
    after = RecomputeElementwise()(_sliced_logits())
    bindings = after["main"].body.blocks[0].bindings
    ops = [b.value.op.name for b in bindings if isinstance(b.value, relax.Call)]
    assert ops.count("relax.strided_slice") == 2 and ops.count("relax.astype") == 2, ops
    readers = {b.value.args[0] for b in bindings if isinstance(b.value, relax.Call)
               and b.value.op.name == "relax.astype"}
    assert len(readers) == 2  # one slice per cast
    assert recompute_pays(_sliced_logits()["main"].body.blocks[0].bindings[0].value,
                          _sliced_logits()["main"].body.blocks[0].bindings[0].var, 1, others=False)


def test_a_sigmoid_read_by_two_kernels_is_recomputed_in_each():
    """SiLU's gradient: sigmoid(x) read by a column sum and by an elementwise pass; each computes
    it from x (an exp and a division) instead of reading it back."""
    x = relax.Var("x", relax.TensorType((N, C), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            s = bb.emit(relax.op.sigmoid(x))
            total = bb.emit(SUM(bb.emit(relax.op.multiply(s, x)), [0]))
            d = bb.emit(relax.op.subtract(relax.const(1.0, "bfloat16"), s))
            gv = bb.emit_output(relax.Tuple([total, d]))
        bb.emit_func_output(gv)
    before = bb.get()
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            total = bb.emit(SUM(bb.emit(relax.op.multiply(bb.emit(relax.op.sigmoid(x)), x)), [0]))
            d = bb.emit(relax.op.subtract(relax.const(1.0, "bfloat16"), bb.emit(relax.op.sigmoid(x))))
            gv = bb.emit_output(relax.Tuple([total, d]))
        bb.emit_func_output(gv)
    tvm.ir.assert_structural_equal(RecomputeElementwise(sigmoid=True)(before), bb.get())
    # without (TVM_EVT_DISABLE=recompute_sigmoid): written once and read back
    tvm.ir.assert_structural_equal(RecomputeElementwise()(before), before)
