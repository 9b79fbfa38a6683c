"""SinkRecomputedValues: in a function with a memory budget or copies, a recomputed copy that FuseOps left
high in the backward moves down to its first reader, and a reader that frees more than it
allocates moves up to its operands."""

import tvm
from tvm import relax

from tvm_evt.relax_passes._rewrite import flat_bindings
from tvm_evt.relax_passes.lower.sink_recomputed_values import SinkRecomputedValues
from tvm_evt.relax_passes.partition.rematerialize import BUDGET_ATTR, COPY_SUFFIX, estimate_peak


def _step(budget: bool, copy: bool = True) -> tvm.IRModule:
    """The backward as FuseOps may order it: the copy right after the loss, its reader last but
    one, and the sum that frees ``d`` at the end (`copy=False`: ``a_remat`` named as no copy)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, 256), "float32"))
    with bb.function("train_step", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.exp(x), name_hint="a")
            loss = bb.emit_output(relax.op.sum(a), name_hint="loss")
            c = bb.emit(relax.op.exp(x), name_hint=f"a{COPY_SUFFIX}" if copy else "c")
            d = bb.emit(relax.op.multiply(x, x), name_hint="d")
            e = bb.emit(relax.op.add(x, x), name_hint="e")
            f = bb.emit(relax.op.add(e, e), name_hint="f")
            g = bb.emit_output(relax.op.multiply(c, f), name_hint="g")
            h = bb.emit_output(relax.op.sum(d, axis=[0]), name_hint="h")
        bb.emit_func_output(relax.Tuple([relax.Tuple([loss]), relax.Tuple([g, h])]))
    mod = bb.get()
    return tvm.IRModule({"train_step": mod["train_step"].with_attr(BUDGET_ATTR, 1 << 30)}) if budget else mod


def _order(mod: tvm.IRModule) -> list:
    return [b.var.name for b in flat_bindings(mod["train_step"])[0]]


def test_the_copy_moves_to_its_reader_and_the_freeing_sum_to_its_operand():
    before = _step(budget=True)
    assert _order(before) == ["a", "loss", "a_remat", "d", "e", "f", "g", "h"]
    peak = estimate_peak(before["train_step"])
    after = SinkRecomputedValues()(before)
    assert _order(after) == ["a", "loss", "d", "h", "e", "f", "a_remat", "g"]
    assert estimate_peak(after["train_step"]) < peak
    relax.analysis.well_formed(after)  # raises where a type is missing: the reordered body is normalised


def test_a_function_without_a_budget_or_copies_is_left_as_it_is():
    before = _step(budget=False, copy=False)
    order = _order(before)  # (the pass may change its input: compare with what it was)
    assert _order(SinkRecomputedValues()(before)) == order == ["a", "loss", "c", "d", "e", "f", "g", "h"]


def test_copies_move_without_a_budget_too():
    """RecomputeActivationsInBackward's copies are made without a budget."""
    after = SinkRecomputedValues()(_step(budget=False))
    assert _order(after) == ["a", "loss", "d", "h", "e", "f", "a_remat", "g"]
