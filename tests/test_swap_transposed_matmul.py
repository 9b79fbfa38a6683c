"""SwapTransposedMatmul: (a b)^T -> b^T a^T when the product is read by the transpose alone."""
import numpy as np
import tvm
from tvm import relax

from tvm_evt.relax_passes.graph.fold_layout import FoldLayoutIntoMatmul
from tvm_evt.relax_passes.graph.swap_transposed_matmul import SwapTransposedMatmul

T, IN, OUT = 12, 16, 8


def _weight_grad(swapped: bool, other_reader: bool = False, widen: bool = False):
    """dW of y = x W^T as autodiff writes it, (x^T dy)^T (or, `swapped`, dy^T x); `widen`: in
    bf16, cast to float32 before the transpose (mixed precision)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((T, IN), "bfloat16"))
    dy = relax.Var("dy", relax.TensorType((T, OUT), "bfloat16"))
    out_dtype = None if widen else "float32"
    cast = (lambda v: bb.emit(relax.op.astype(v, "float32"))) if widen else (lambda v: v)
    with bb.function("main", [x, dy]):
        with bb.dataflow():
            if swapped:
                dw = cast(bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(dy, [1, 0])), x, out_dtype=out_dtype)))
                out = dw
            else:
                xt = bb.emit(relax.op.permute_dims(x, [1, 0]))
                dwt = cast(bb.emit(relax.op.matmul(xt, dy, out_dtype=out_dtype)))
                dw = bb.emit(relax.op.permute_dims(dwt, [1, 0]))
                out = relax.Tuple([dw, dwt]) if other_reader else dw
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def _passes(mod):
    mod = FoldLayoutIntoMatmul()(SwapTransposedMatmul()(mod))
    return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))


def test_weight_gradient_needs_no_transpose():
    tvm.ir.assert_structural_equal(_passes(_weight_grad(False)), _passes(_weight_grad(True)))


def test_product_read_elsewhere_is_left_alone():
    before = _weight_grad(False, other_reader=True)
    tvm.ir.assert_structural_equal(SwapTransposedMatmul()(before), before)


def test_numbers_are_unchanged():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(T, IN)).astype("float32")
    dy = rng.normal(size=(T, OUT)).astype("float32")

    def run(mod):
        mod = relax.transform.LegalizeOps()(mod)
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        args = [tvm.runtime.tensor(a.astype("float32")).numpy() for a in (x, dy)]
        import ml_dtypes
        return vm["main"](*[tvm.runtime.tensor(a.astype(ml_dtypes.bfloat16)) for a in args]).numpy()

    want, got = run(_weight_grad(False)), run(_passes(_weight_grad(False)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, dy.astype("float64").T @ x.astype("float64"), rtol=2e-2, atol=2e-2)


def test_through_the_widening_cast():
    """Mixed precision: the bf16 product is cast to float32 before the transpose."""
    tvm.ir.assert_structural_equal(_passes(_weight_grad(False, widen=True)), _passes(_weight_grad(True, widen=True)))


def _weight_grad_handed_on(swapped: bool):
    """The float32 dW as an in-place step's dataflow block hands it to the update after the block:
    a block output, read outside it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((T, IN), "bfloat16"))
    dy = relax.Var("dy", relax.TensorType((T, OUT), "bfloat16"))
    with bb.function("main", [x, dy]):
        with bb.dataflow():
            if swapped:
                dw = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(dy, [1, 0])), x))
            else:
                dw = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0])), dy))
            dw = bb.emit_output(relax.op.permute_dims(bb.emit(relax.op.astype(dw, "float32")), [1, 0])
                                if not swapped else relax.op.astype(dw, "float32"))
        out = bb.emit(relax.op.multiply(dw, relax.const(2.0, "float32")))  # the update, after the block
        bb.emit_func_output(out)
    return bb.get()


def test_gradient_handed_on_after_the_block_stays_a_block_output():
    after = SwapTransposedMatmul()(_weight_grad_handed_on(False))
    relax.analysis.well_formed(after)  # raises on a dataflow var read outside its block (as before the fix)
    tvm.ir.assert_structural_equal(_passes(after), _passes(_weight_grad_handed_on(True)))


def _weight_grad_outside_dataflow(swapped: bool):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((T, IN), "bfloat16"))
    dy = relax.Var("dy", relax.TensorType((T, OUT), "bfloat16"))
    with bb.function("main", [x, dy]):
        if swapped:
            dw = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(dy, [1, 0])), x, out_dtype="float32"))
        else:
            dwt = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(x, [1, 0])), dy, out_dtype="float32"))
            dw = bb.emit(relax.op.permute_dims(dwt, [1, 0]))
        bb.emit_func_output(dw)
    return bb.get()


def test_swaps_outside_a_dataflow_block():
    after = SwapTransposedMatmul()(_weight_grad_outside_dataflow(False))
    relax.analysis.well_formed(after)
    tvm.ir.assert_structural_equal(_passes(after), _passes(_weight_grad_outside_dataflow(True)))
