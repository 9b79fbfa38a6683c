"""Compile work that must grow linearly with a model's depth (issue #39: BERT-Large's 24 layers did
not compile in 500 s), counted, not timed: the expressions the passes walk to find who reads a
var, and the optimizer update kernels TVM compiles."""
from __future__ import annotations

import json
import sys

import pytest
import tvm
from tvm import relax

from tvm_evt import models, optim
from tvm_evt.relax_passes._rewrite import binding_uses, flat_bindings, has_call, sub_expressions
from tvm_evt.relax_passes.training import optimizer_update
from tvm_evt.training import hopper_target
from tvm_evt.tuning import training_graph

pytest.importorskip("transformers")


def _step(layers: int) -> tvm.IRModule:
    """The bf16 AdamW training module of transformers' BertForMaskedLM at `layers` (hidden 64), as
    ``compile_training`` builds it for an sm_90a GPU (in place)."""
    _, graph = training_graph(models.hf_bert_mlm(layers=layers), "bf16", optim.AdamW(lr=1e-4), hopper_target())
    return graph.mod


@pytest.fixture(scope="module")
def steps() -> dict:
    return {layers: _step(layers) for layers in (5, 10)}  # 90 and 170 parameters


def _relevant(exprs) -> list:
    return [e for e in exprs if isinstance(e, (relax.Var, relax.Call, tvm.ir.GlobalVar))]


def test_sub_expressions_are_what_post_order_visit_reaches_but_annotations(steps):
    """The vars, calls and functions each binding refers to, in the same order (what the passes
    look for); only the shapes inside type annotations are left out."""
    for _, func in steps[5].functions_items():
        if not isinstance(func, relax.Function):
            continue
        for b in flat_bindings(func)[0]:
            visited = []
            relax.analysis.post_order_visit(b.value, visited.append)
            assert _relevant(sub_expressions(b.value)) == _relevant(visited), b.var.name


def _python_calls(fn, *args) -> int:
    """The Python and builtin calls ``fn(*args)`` makes: its work, whatever it walks with."""
    count = 0

    def note(_frame, event, _arg):
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(note)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count


def _tuple_reader(n: int) -> relax.Function:
    """A function that reads the n items of an n-tuple (as a training step reads an optimizer's
    new parameters, or a backward's gradients)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("f", [x]):
        with bb.dataflow():
            whole = bb.emit(relax.Tuple([bb.emit(relax.op.add(x, relax.const(float(i)))) for i in range(n)]))
            items = [bb.emit(relax.TupleGetItem(whole, i)) for i in range(n)]
            out = bb.emit_output(relax.Tuple(items))
        bb.emit_func_output(out)
    return bb.get()["f"]


@pytest.mark.parametrize("helper", [binding_uses, lambda func: has_call(func.body, tvm.ir.Op.get("relax.nn.conv2d"))],
                         ids=["binding_uses", "has_call"])
def test_reading_an_n_tuple_is_linear_in_n(helper):
    """Who reads each var (``binding_uses``, 14 passes) and whether a function calls an op
    (``has_call``): the same work a binding with 100 and 400 items.  post_order_visit walks a
    tuple-typed var's field shapes at each reference, n^2 in all: BERT-Large's step, whose AdamW update
    returned its ~1200 new tensors in one tuple, spent 13.0 s in FuseLayerNormBackward at 24 layers
    (2.5 s with ``sub_expressions``)."""
    per_binding = {}
    for n in (100, 400):
        func = _tuple_reader(n)
        per_binding[n] = _python_calls(helper, func) / len(flat_bindings(func)[0])
    assert per_binding[400] <= 1.05 * per_binding[100], per_binding


def test_update_kernels_do_not_grow_with_depth(steps):
    """One update call a layer, and the same three PrimFuncs (embeddings, a layer, the last norm and
    the head) at 5 and 10 layers, none over MAX_KERNEL_PARAMS parameters: TVM took 101 s to compile
    the one kernel of BERT-Large's 24 layers, quadratic in their number of parameters."""
    inplace = tvm.ir.Op.get("relax.call_tir_inplace")
    kernels = {}
    for layers, mod in steps.items():
        calls = [e for e in sub_expressions(mod["train_step"].body) if isinstance(e, relax.Call) and e.op == inplace
                 and optimizer_update.OPTIMIZER_ATTR in mod[e.args[0]].attrs]
        assert len(calls) == layers + 2
        specs = {str(mod[e.args[0]].attrs[optimizer_update.PARAMS_ATTR]) for e in calls}
        assert all(len(json.loads(s)) <= optimizer_update.MAX_KERNEL_PARAMS for s in specs)
        kernels[layers] = sorted(specs)
    assert kernels[5] == kernels[10] and len(kernels[10]) == 3
