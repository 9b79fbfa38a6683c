"""NarrowBeforeLayout: casts to bf16 after layout ops move in front of them."""

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.graph.narrow_before_layout import NarrowBeforeLayout

X = (2, 8, 6, 6)  # NCHW


def _module(narrow_first: bool, other_reader: bool = False):
    """ResNet's input: NHWC for a 1x1 convolution (reshape) and a stride-2 shortcut (slice,
    reshape), each cast to bf16 (or, `narrow_first`, the expected form); `other_reader`: the
    transpose is also returned in float32."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(X, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            emit = bb.emit
            src = emit(relax.op.astype(x, "bfloat16")) if narrow_first else x
            p = emit(relax.op.permute_dims(src, [0, 2, 3, 1]))
            a = emit(relax.op.reshape(p, (72, 8)))
            a = a if narrow_first else emit(relax.op.astype(a, "bfloat16"))
            s = emit(relax.op.strided_slice(p, [1, 2], [0, 0], [6, 6], [2, 2]))
            s = emit(relax.op.reshape(s, (18, 8)))
            s = s if narrow_first else emit(relax.op.astype(s, "bfloat16"))
            gv = bb.emit_output(relax.Tuple([a, s] + ([p] if other_reader else [])))
        bb.emit_func_output(gv)
    return bb.get()


def _bindings(mod):
    """(op, dtype, shape, the earlier bindings it reads by position) of each binding of main."""
    out, pos = [], {}
    for i, b in enumerate(mod["main"].body.blocks[0].bindings):
        v = b.value
        reads = [pos.get(a) for a in getattr(v, "args", getattr(v, "fields", []))
                 if isinstance(a, relax.Var)]
        op = v.op.name if isinstance(v, relax.Call) else type(v).__name__
        ty = b.var.ty
        out.append((op, str(getattr(ty, "dtype", "")), str(getattr(ty, "shape", "")), reads))
        pos[b.var] = i
    return out


def test_cast_moves_in_front_of_every_layout_chain():
    assert _bindings(NarrowBeforeLayout()(_module(False))) == _bindings(_module(True))


def test_left_alone_when_the_float32_layout_value_is_read_otherwise():
    before = _module(False, other_reader=True)
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(before), before)


def test_numbers_are_unchanged():
    import ml_dtypes

    x = np.random.default_rng().standard_normal(X).astype("float32")

    def run(mod):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        return [t.numpy().astype("float32") for t in vm["main"](tvm.runtime.tensor(x))]

    want, got = run(_module(False)), run(NarrowBeforeLayout()(_module(False)))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    nhwc = x.transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(got[0], nhwc.reshape(72, 8).astype(ml_dtypes.bfloat16).astype("float32"))


def test_a_transpose_read_by_one_cast_is_left_alone():
    """FuseOps fuses transpose + cast into one kernel anyway; cast first, the transpose would move
    into the cast's readers (an im2col gather) and break their vector loads."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(X, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            gv = bb.emit_output(bb.emit(relax.op.astype(p, "bfloat16")))
        bb.emit_func_output(gv)
    before = bb.get()
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(before), before)


def _linear(cast_first: bool, other_reader: bool = False):
    """A linear layer's float32 weight W [out, in], transposed and cast for the matmul (or,
    `cast_first`, the expected form); `other_reader`: the bf16 W^T is also returned."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "bfloat16"))
    w = relax.Var("w", relax.TensorType((8, 16), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            if cast_first:
                wt = bb.emit(relax.op.permute_dims(bb.emit(relax.op.astype(w, "bfloat16")), [1, 0]))
            else:
                wt = bb.emit(relax.op.astype(bb.emit(relax.op.permute_dims(w, [1, 0])), "bfloat16"))
            y = bb.emit(relax.op.matmul(x, wt))
            gv = bb.emit_output(relax.Tuple([y, wt]) if other_reader else y)
        bb.emit_func_output(gv)
    return bb.get()


def test_a_weight_transpose_read_by_matmuls_is_cast_first():
    """Only matmuls read the cast: the transpose then sits right before them, where the EVT
    codegen reads it as the operand's layout, and the cast kernel writes W as it is."""
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(_linear(False)), _linear(True))


def test_a_weight_transpose_read_by_something_else_is_left_alone():
    before = _linear(False, other_reader=True)
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(before), before)


XL = (2, 6, 6, 8)  # NHWC: a channels-last input


def _channels_last(form: str, whole: str = "reshape"):
    """ResNet's channels-last input, read by a 1x1 convolution (`whole`: through a reshape, or
    "direct"ly as a cast, or "none": no whole read) and by a stride-2 shortcut's slice and reshape,
    each cast to bf16. `form` "before", or "expected": one cast, which the slice reads."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(XL, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            emit = bb.emit
            out = []
            xl = emit(relax.op.astype(x, "bfloat16")) if form == "expected" and whole != "none" else None
            if whole == "reshape":
                a = emit(relax.op.reshape(xl if xl is not None else x, (72, 8)))
                out.append(a if xl is not None else emit(relax.op.astype(a, "bfloat16")))
            elif whole == "direct":
                out.append(xl if xl is not None else emit(relax.op.astype(x, "bfloat16")))
            s = emit(relax.op.strided_slice(xl if xl is not None else x, [1, 2], [0, 0], [6, 6], [2, 2]))
            s = emit(relax.op.reshape(s, (18, 8)))
            out.append(s if xl is not None else emit(relax.op.astype(s, "bfloat16")))
            gv = bb.emit_output(relax.Tuple(out))
        bb.emit_func_output(gv)
    return bb.get()


@pytest.mark.parametrize("whole", ["reshape", "direct"])
def test_a_slice_of_a_value_cast_whole_anyway_reads_the_narrow_copy(whole):
    """The slice reads the bf16 copy the other reader makes (ResNet-50's stride-2 shortcut read
    its float32 input a second time), and both share one cast."""
    after = NarrowBeforeLayout()(_channels_last("before", whole))
    assert _bindings(after) == _bindings(_channels_last("expected", whole))
    assert [op for op, *_ in _bindings(after)].count("relax.astype") == 1


def test_a_slice_alone_keeps_its_cast_after_it():
    """Cast first, a lone slice would cast more than it reads."""
    before = _channels_last("before", "none")
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(before), before)


@pytest.mark.parametrize("whole", ["reshape", "direct"])
def test_a_sliced_narrow_copy_gives_the_same_numbers(whole):
    x = np.random.default_rng().standard_normal(XL).astype("float32")

    def run(mod):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        return [t.numpy().astype("float32") for t in vm["main"](tvm.runtime.tensor(x))]

    before = _channels_last("before", whole)
    for w, g in zip(run(before), run(NarrowBeforeLayout()(before))):
        np.testing.assert_array_equal(g, w)


def _split_linear(cast_first: bool):
    """A slice of a fused weight W [2 * out, in] (SplitFusedProjection's piece of a QKV weight),
    transposed and cast for the matmul; `cast_first`: the expected form, the slice cast and its
    transpose left to the matmul."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 16), "bfloat16"))
    w = relax.Var("w", relax.TensorType((16, 16), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            piece = bb.emit(relax.op.strided_slice(w, [0], [8], [16]))
            if cast_first:
                wt = bb.emit(relax.op.permute_dims(bb.emit(relax.op.astype(piece, "bfloat16")), [1, 0]))
            else:
                wt = bb.emit(relax.op.astype(bb.emit(relax.op.permute_dims(piece, [1, 0])), "bfloat16"))
            gv = bb.emit_output(bb.emit(relax.op.matmul(x, wt)))
        bb.emit_func_output(gv)
    return bb.get()


def test_a_weight_slice_transposed_for_matmuls_is_cast_first():
    """GPT-2's split QKV weight: the cast kernel reads the slice and writes it as it is (a
    transposing cast kernel ran at 0.6 TB/s on H100), and the matmul reads the transpose as the
    operand's layout."""
    tvm.ir.assert_structural_equal(NarrowBeforeLayout()(_split_linear(False)), _split_linear(True))


def test_a_moved_cast_that_leaves_its_block_stays_a_block_output():
    """Where the cast is the block's output (a value crossing a cut of a data-parallel step's
    segments), the narrow layout value that replaces it is bound as the output: a dataflow var
    returned from the function would be ill-formed (the partitioner drops what it takes for an
    unread value; the VM build then fails on an undefined var)."""
    def module(narrow_first: bool):
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType(X, "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                src = bb.emit(relax.op.astype(x, "bfloat16")) if narrow_first else x
                p = bb.emit(relax.op.permute_dims(src, [0, 2, 3, 1]))
                if narrow_first:
                    out = bb.emit_output(relax.op.reshape(p, (72, 8)))
                else:
                    out = bb.emit_output(relax.op.astype(bb.emit(relax.op.reshape(p, (72, 8))), "bfloat16"))
            bb.emit_func_output(out)
        return bb.get()

    after = NarrowBeforeLayout()(module(False))
    tvm.ir.assert_structural_equal(after, module(True))
    assert not isinstance(after["main"].body.body, relax.DataflowVar)
