"""SelectInDepthwiseDgrad: a clamp's gradient select after a depthwise input gradient done by its kernel."""

import json

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.select_in_depthwise_dgrad import SelectInDepthwiseDgrad, mask_tree
from tvm_evt.relax_passes.ops import conv_op
from tvm_evt.relax_passes.ops import depthwise_conv_op as dwc

N, H, C, R = 2, 9, 8, 3
G = conv_op.Geometry((1, 1, 1, 1), (1, 1), (1, 1))
WHERE = tvm.ir.Op.get("relax.where")


def _module(mask="relu6", other=0.0, also_return_dx=False, second_source=False):
    """main(dy, w, y[, z]) = where(mask(y), depthwise_conv2d_dgrad(dy, w), other)."""
    f32 = "float32"
    dy = relax.Var("dy", relax.TensorType((N, H, H, C), f32))
    w = relax.Var("w", relax.TensorType((C, R, R, 1), f32))
    y = relax.Var("y", relax.TensorType((N, H, H, C), f32))
    z = relax.Var("z", relax.TensorType((N, H, H, C), f32))
    bb = relax.BlockBuilder()
    with bb.function("main", [dy, w, y, z]):
        with bb.dataflow():
            dx = bb.emit(dwc.depthwise_conv2d_dgrad(dy, w, G, (N, H, H, C)))
            low = bb.emit(relax.op.greater(y, relax.const(0.0, f32)))
            if mask == "relu6":
                high = bb.emit(relax.op.less(z if second_source else y, relax.const(6.0, f32)))
                keep = bb.emit(relax.op.logical_and(low, high))
            else:
                keep = low
            out = bb.emit(relax.op.where(keep, dx, relax.const(other, f32)))
            gv = bb.emit_output(relax.Tuple([out, dx]) if also_return_dx else out)
        bb.emit_func_output(gv)
    return bb.get()


def _selected_calls(mod):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and e.op == tvm.ir.Op.get("relax.call_tir") else None)
    return [json.loads(str(mod[c.args[0]].attrs[dwc.DEPTHWISE_ATTR])) for c in found]


def _run(mod, args):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


@pytest.mark.parametrize("mask", ["relu6", "relu"])
def test_the_select_becomes_the_dgrad_kernels_and_the_numbers_stay(mask):
    before = _module(mask)
    after = SelectInDepthwiseDgrad()(before)
    ops = []
    relax.analysis.post_order_visit(after["main"].body, lambda e: ops.append(e.op) if isinstance(e, relax.Call) else None)
    assert WHERE not in ops and tvm.ir.Op.get(dwc.DGRAD) not in ops
    (spec,) = _selected_calls(relax.transform.LegalizeOps()(after))
    want = (["logical_and", ["greater", 0.0], ["less", 6.0]] if mask == "relu6" else ["greater", 0.0])
    assert spec["select"] == {"dtype": "float32", "mask": want}
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((N, H, H, C), "float32"), rng.standard_normal((C, R, R, 1), "float32"),
            rng.uniform(-2, 8, (N, H, H, C)).astype("float32"), rng.standard_normal((N, H, H, C), "float32")]
    np.testing.assert_array_equal(_run(after, args), _run(before, args))


@pytest.mark.parametrize("case", [dict(other=1.0), dict(also_return_dx=True), dict(second_source=True)])
def test_selects_the_kernel_cannot_take_are_left_alone(case):
    """A select to a non-zero value, a dgrad something else reads too, a mask of two tensors."""
    before = _module(**case)
    tvm.ir.assert_structural_equal(SelectInDepthwiseDgrad()(before), before)


def test_mask_tree_reads_comparisons_with_constants_of_one_tensor():
    func = _module()["main"]
    bound = {b.var: b.value for b in func.body.blocks[0].bindings}
    where = next(v for v in bound.values() if isinstance(v, relax.Call) and v.op == WHERE)
    y, tree = mask_tree(where.args[0], bound)
    assert y.same_as(func.params[2]) and tree == ["logical_and", ["greater", 0.0], ["less", 6.0]]
    func = _module(second_source=True)["main"]
    bound = {b.var: b.value for b in func.body.blocks[0].bindings}
    where = next(v for v in bound.values() if isinstance(v, relax.Call) and v.op == WHERE)
    assert mask_tree(where.args[0], bound) is None
