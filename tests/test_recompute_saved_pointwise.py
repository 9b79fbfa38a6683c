"""RecomputeSavedPointwise (``TVM_EVT_ENABLE=recompute_saved``): a kept pointwise chain of a smaller
tensor — a loss's float32 exp over bf16 logits — recomputed in the backward, not kept."""

import numpy as np
import tvm
from tvm import relax

from test_factor_pointwise_adjoints import _saved_producers
from tvm_evt.relax_passes._rewrite import flat_bindings, op_name
from tvm_evt.relax_passes.partition.recompute_saved_pointwise import RecomputeSavedPointwise
from _passes import assert_unchanged

N, V = 64, 96


def _softmax_step(dtype: str = "bfloat16") -> tvm.IRModule:
    """16-bit logits z = x w; e = exp(f32(z) - max) summed for the loss, and kept for the gradient
    e / s (the cross-entropy's softmax); a GEMM reads that gradient."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, 32), dtype))
    w = relax.Var("w", relax.TensorType((32, V), dtype))
    with bb.function("main_adjoint", [x, w]):
        with bb.dataflow():
            emit = bb.emit
            z = emit(relax.op.matmul(x, w))
            z32 = emit(relax.op.astype(z, "float32"))
            m = emit(relax.op.max(z32, axis=[1], keepdims=True))
            e = emit(relax.op.exp(relax.op.subtract(z32, m)))
            s = emit(relax.op.sum(e, axis=[1], keepdims=True))
            loss = bb.emit_output(relax.op.sum(relax.op.log(s)))
            p = emit(relax.op.divide(e, s))
            dz = emit(relax.op.astype(p, dtype))
            dw = bb.emit_output(relax.op.matmul(relax.op.permute_dims(x), dz))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dw])]))
    return bb.get()


def test_the_float32_exp_is_recomputed_from_the_bf16_logits():
    before = _softmax_step()
    assert _saved_producers(before["main_adjoint"], N * V) == ["relax.exp"]
    after = RecomputeSavedPointwise()(before)
    assert _saved_producers(after["main_adjoint"], N * V) == ["relax.matmul"]  # z, 2 bytes an element, not e's 4
    ops = [op_name(b.value) for b in flat_bindings(after["main_adjoint"])[0]]
    assert ops.count("relax.exp") == 2 and ops.count("relax.astype") == 3  # a copy of the chain


def test_a_chain_a_gemm_reads_after_the_loss_is_kept():
    """A GEMM partition's operand would be written again by the copy: no gain."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, 32), "bfloat16"))
    w = relax.Var("w", relax.TensorType((32, V), "bfloat16"))
    with bb.function("main_adjoint", [x, w]):
        with bb.dataflow():
            z = bb.emit(relax.op.matmul(x, w))
            e = bb.emit(relax.op.exp(relax.op.astype(z, "float32")))
            loss = bb.emit_output(relax.op.sum(e))
            dw = bb.emit_output(relax.op.matmul(relax.op.permute_dims(relax.op.astype(x, "float32")), e))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dw])]))
    before = bb.get()
    assert_unchanged(RecomputeSavedPointwise(), before)


def _run(mod: tvm.IRModule, *args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = vm["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
    return [out[0][0].numpy()] + [t.numpy() for t in out[1]]  # the loss, every gradient


def test_the_copies_compute_the_same_numbers():
    """The step before and after, built for the CPU in float16 (numpy has no bfloat16): equal bits."""
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((N, 32)).astype("float16"), rng.standard_normal((32, V)).astype("float16")]
    before = _softmax_step("float16")
    after = RecomputeSavedPointwise()(before)
    assert _saved_producers(after["main_adjoint"], N * V) == ["relax.matmul"]
    for want, got in zip(_run(before, *args), _run(after, *args)):
        np.testing.assert_array_equal(want, got)


def test_budgeted_only_rewrites_a_function_with_a_memory_budget_alone():
    """Off by default, the pass still runs where compile_training has a memory_budget."""
    from tvm_evt.relax_passes.partition.rematerialize import BUDGET_ATTR

    before = _softmax_step()
    assert_unchanged(RecomputeSavedPointwise(budgeted_only=True), before)
    budgeted = tvm.IRModule({"main_adjoint": before["main_adjoint"].with_attr(BUDGET_ATTR, 1 << 20)})
    after = RecomputeSavedPointwise(budgeted_only=True)(budgeted)
    assert _saved_producers(after["main_adjoint"], N * V) == ["relax.matmul"]
