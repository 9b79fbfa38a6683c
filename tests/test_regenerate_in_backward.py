"""RegenerateInBackward: a dropout keep mask (a value generated from the step's seed alone) is
generated again in the backward instead of kept across the forward; a cast of a weight, which
reads more than it keeps, is kept."""

import copy

import torch
import tvm
from tvm import relax

import tvm_evt
from tvm_evt import models, pipeline
from tvm_evt.relax_passes._rewrite import COPY_SUFFIX
from tvm_evt.relax_passes.partition.regenerate_in_backward import RegenerateInBackward
from tvm_evt.relax_passes.training.lower_dropout import keep_mask_function

from _torch_ref import rel_err
from _passes import assert_unchanged

N, D = 8, 16
RATE = 0.1


def _dropout_step(regenerated: bool) -> tvm.IRModule:
    """x -> keep = mask(seed) -> y = where(keep, x, 0) * s, loss = sum(y * w); the backward
    dx = where(keep, dloss * w, 0) * s as the gradient rule writes it, and dw = sum(y).  With
    `regenerated`, the mask is generated again just before the backward's where."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, D), "float32"))
    w = relax.Var("w", relax.TensorType((D,), "float32"))
    seed = relax.Var("rng_seed", relax.TensorType((2,), "uint32"))
    scale, zero = relax.const(1.0 / (1.0 - RATE), "float32"), relax.const(0.0, "float32")
    keep_fn = keep_mask_function(bb, [N, D], RATE)

    def mask():
        return relax.call_tir(keep_fn, [seed, relax.const(0, "uint32")], relax.TensorType((N, D), "bool"))

    with bb.function("main_adjoint", [x, w, seed]):
        with bb.dataflow():
            keep = bb.emit(mask(), name_hint="keep")
            y = bb.emit(relax.op.multiply(relax.op.where(keep, x, zero), scale), name_hint="y")
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, w)), name_hint="loss")
            dy = bb.emit(relax.op.broadcast_to(w, (N, D)), name_hint="dy")
            if regenerated:
                keep = bb.emit(mask(), name_hint=f"keep{COPY_SUFFIX}")
            dx = bb.emit_output(relax.op.multiply(relax.op.where(keep, dy, zero), scale), name_hint="dx")
            dw = bb.emit_output(relax.op.sum(y, axis=[0]), name_hint="dw")
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dx, dw])]))
    return bb.get()


def test_a_keep_mask_is_generated_again_before_its_first_backward_reader():
    after = RegenerateInBackward()(_dropout_step(regenerated=False))
    tvm.ir.assert_structural_equal(after, _dropout_step(regenerated=True))


def test_a_cast_of_a_weight_is_kept():
    """The weight's float32 cast reads twice the bytes it keeps: generating it again would move more
    than keeping it saves, so the step stays as it is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, D), "bfloat16"))
    w = relax.Var("w", relax.TensorType((D, D), "float32"))
    with bb.function("main_adjoint", [x, w]):
        with bb.dataflow():
            wb = bb.emit(relax.op.astype(w, "bfloat16"))
            z = bb.emit(relax.op.matmul(x, wb))
            loss = bb.emit_output(relax.op.sum(z))
            dx = bb.emit_output(relax.op.matmul(relax.op.ones_like(z), relax.op.permute_dims(wb)))
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([dx])]))
    before = bb.get()
    assert_unchanged(RegenerateInBackward(), before)


def _bert(monkeypatch, regenerate: bool):
    monkeypatch.setenv(pipeline.DISABLE_ENV if not regenerate else pipeline.ENABLE_ENV, "regenerate")
    torch.manual_seed(0)
    entry = models.ZOO["bert_tiny"]()  # dropout 0.1 after the embeddings, attention output and FFN
    inputs = entry.example_inputs()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), inputs, loss_fn=entry.loss_fn, target={"kind": "llvm"},
                                    optimizer=tvm_evt.optim.SGD(lr=0.1))
    return step, inputs


def test_the_step_with_regenerated_masks_keeps_none_and_trains_as_before(monkeypatch):
    on, inputs = _bert(monkeypatch, True)
    with monkeypatch.context() as m:
        off, _ = _bert(m, False)
    # the masks the forward kept are gone from the step it built
    masks = lambda step: [s for s in step.memory_report()["saved_activations"]  # noqa: E731
                          if s["dtype"] == "bool" and s["op"].startswith("dropout_keep")]
    assert len(masks(off)) >= 3 and masks(on) == []
    # the same masks: equal losses and parameters, step after step (dropout on: a new mask each step)
    for _ in range(3):
        assert float(on(*inputs)) == float(off(*inputs))
    p_on, p_off = on.parameters(), off.parameters()
    assert all(rel_err(p_on[n], p_off[n]) <= 1e-6 for n in p_off)


def test_a_function_with_a_memory_budget_is_left_to_rematerialize():
    from tvm_evt.relax_passes.partition.rematerialize import BUDGET_ATTR

    before = _dropout_step(regenerated=False)
    before["main_adjoint"] = before["main_adjoint"].with_attr(BUDGET_ATTR, 1 << 20)
    assert_unchanged(RegenerateInBackward(), before)
