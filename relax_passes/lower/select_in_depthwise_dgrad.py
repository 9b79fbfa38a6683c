"""SelectInDepthwiseDgrad: a clamp's gradient mask applied by the depthwise input gradient's kernel.

The gradient of a ReLU, ReLU6 or hardtanh before a depthwise convolution keeps the convolution's
input gradient where the activation's output lies inside its range, else 0::

    dx = tvm_evt.depthwise_conv2d_dgrad(dy, w, geometry, x_shape)
    dz = where(logical_and(greater(y, 0), less(y, 6)), dx, 0)

The depthwise kernel is opaque to ``FuseOps``, so the select ran as a kernel of its own, reading
``dx`` and ``y`` and writing ``dz``: MobileNetV2 (torchvision, batch 128, H200) ran 18 of them a
step, 0.71 ms.  Here such a ``where`` whose ``dx`` nothing else reads becomes one call of the
depthwise input gradient that rounds each sum and keeps it where the mask holds
(``depthwise_conv_op.selected_dgrad``): the kernel reads ``y`` beside ``dy`` and writes ``dz``, and
``dx`` is never stored.  The mask is a tree over one tensor ``y`` of ``dx``'s shape:
comparisons with one-element constants of ``y``'s dtype, joined by ``logical_and`` /
``logical_or``.  The numbers are the same: the select is applied to the rounded sum, as before.
On an H200, MobileNetV2's seven depthwise shapes at batch 128 (bf16) take 0.616 ms as one kernel
each against 1.035 as the two, with equal results (``docs/bench/h200-2026-12-01d/depthwise-select/``).

CUDA route, before ``LegalizeOps`` (which would legalize the depthwise call by itself).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import depthwise_conv_op
from .._rewrite import (MASK_COMPARISONS, MASK_CONNECTIVES, bind_as, binding_uses, flat_bindings, mutate_step_functions,
                        static_shape)

WHERE = tvm.ir.Op.get("relax.where")
DGRAD = tvm.ir.Op.get(depthwise_conv_op.DGRAD)
COMPARISONS = {tvm.ir.Op.get(f"relax.{name}"): name for name in MASK_COMPARISONS}
CONNECTIVES = {tvm.ir.Op.get(f"relax.{name}"): name for name in MASK_CONNECTIVES}


def _scalar(expr: relax.Expr, dtype: str) -> float | None:
    """The value of a one-element constant of `dtype`, else None."""
    if isinstance(expr, tvm.ir.GenericConst) and str(expr.value.dtype) == dtype and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(-1)[0])
    return None


def mask_tree(expr: relax.Expr, bound: dict):
    """(the tensor ``y``, the ``depthwise_conv_op.mask_value`` tree) of a mask `expr` computed by
    comparisons of one ``y`` with one-element constants of its dtype and connectives of them
    (seen through `bound`: var -> bound value), else None."""
    call = bound.get(expr)
    if not isinstance(call, relax.Call) or len(call.args) != 2:
        return None
    if call.op in CONNECTIVES:
        left, right = (mask_tree(a, bound) for a in call.args)
        if left is None or right is None or not left[0].same_as(right[0]):
            return None
        return left[0], [CONNECTIVES[call.op], left[1], right[1]]
    if call.op in COMPARISONS and isinstance(call.args[0], relax.Var):
        value = _scalar(call.args[1], str(call.args[0].ty.dtype))
        return None if value is None else (call.args[0], [COMPARISONS[call.op], value])
    return None


@mutator
class _Selector(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.bound: dict = {}
        self.uses: dict = {}

    def prime(self, func: relax.Function) -> None:
        self.bound = {b.var: b.value for b in flat_bindings(func)[0]}
        self.uses = binding_uses(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if isinstance(value, relax.Call) and value.op == WHERE:
            cond, kept, other = value.args
            dgrad = self.bound.get(kept)
            found = mask_tree(cond, self.bound)
            if (isinstance(dgrad, relax.Call) and dgrad.op == DGRAD and len(self.uses.get(kept, ())) == 1
                    and _scalar(other, str(kept.ty.dtype)) == 0.0 and found is not None
                    and static_shape(found[0]) == static_shape(kept)):
                y, tree = found
                call = relax.Call(dgrad.op, [self.visit_expr(a) for a in dgrad.args], dgrad.attrs)
                out = depthwise_conv_op.selected_dgrad(self.builder_, call, self.visit_expr(y), tree)
                self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, out))
                return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="SelectInDepthwiseDgrad")
class SelectInDepthwiseDgrad:
    """A clamp's gradient select done by the depthwise input gradient's kernel (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        selector = _Selector(mod)
        return mutate_step_functions(selector, mod, before_each=selector.prime)
