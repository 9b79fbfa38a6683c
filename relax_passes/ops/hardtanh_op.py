"""``tvm_evt.hardtanh(x, min, max)``: torch's hardtanh (ReLU6 is hardtanh(0, 6)), whose gradient
reads its output.

The values are ``relax.clip``'s, which is also its legalisation.  The gradient is torch's
``hardtanh_backward``: dy where ``min < x < max``, else 0.  Strictly inside the bounds ``x`` and the
output are equal, and nowhere else is the output strictly inside, so the rule tests the output::

    dx = where(min < y < max, dy, 0)

``relax.clip``'s rule (torch.clamp's, ``min <= x <= max``) needs ``x``, which the backward then
keeps beside ``y``, the next layer's saved input: in MobileNetV2 every ReLU6's input (a batch
norm's output) stayed alive until its backward, a second read for ``FuseOps`` to leave unfused.
The importer makes ``aten.hardtanh`` this op and leaves ``aten.clamp`` a ``clip``, whose
inclusive bounds need the input.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.relax.op.grad import no_grad
from tvm.relax.utils import convert_to_expr

from ..training.gradient_rules import register_op

OP = "tvm_evt.hardtanh"


def hardtanh(x: relax.Expr, lo: float, hi: float) -> relax.Call:
    return relax.Call(tvm.ir.Op.get(OP), [x, convert_to_expr(float(lo)), convert_to_expr(float(hi))])


def bounds(call: relax.Call) -> tuple[float, float]:
    lo, hi = (float(a.value) for a in call.args[1:])  # FloatImm arguments, as relax.clip's
    if not lo < hi:
        raise ValueError(f"{OP}: min {lo} must be below max {hi}")
    return lo, hi


def _infer(call: relax.Call, _bb) -> relax.TensorType:
    bounds(call)
    return call.args[0].ty


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    lo, hi = bounds(call)
    return R.clip(call.args[0], lo, hi)


def hardtanh_grad(orig_var, orig_call, output_grad, ctx):
    lo, hi = bounds(orig_call)
    dtype = str(orig_var.ty.dtype)
    inside = R.logical_and(R.greater(orig_var, relax.const(lo, dtype)), R.less(orig_var, relax.const(hi, dtype)))
    return [R.where(inside, output_grad, relax.const(0.0, dtype)), no_grad(orig_call.args[1]),
            no_grad(orig_call.args[2])]


register_op(OP, "torch's hardtanh (clip) whose gradient reads its output", _infer, _legalize, hardtanh_grad)
