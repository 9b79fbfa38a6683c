"""CancelTransposes: a ``permute_dims`` of a ``permute_dims`` that restores the original axis order
is the original tensor.

    y = permute_dims(x, [0, 2, 1, 3])
    z = permute_dims(y, [0, 2, 1, 3])      ->   z = x

Such pairs appear where a pass changes the layout a kernel reads or writes (``OffloadAttention``'s
[B, S, H, D] flash-attention operands) and hands the old layout back to the graph around it; ``y``
is left to dead-code elimination.  ``y`` may reach ``z`` through a tuple built in the same
function (``t = (y, w); z = permute_dims(t[0], ...)``) or a reshape to its own shape.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import static_shape

PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
RESHAPE = tvm.ir.Op.get("relax.reshape")


def _axes(call: relax.Call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return list(reversed(range(ndim))) if axes is None else [int(a) for a in axes]


def bound_value(mutator: PyExprMutator, expr: relax.Expr) -> relax.Expr:
    """What `expr` is bound to in the function `mutator` is building, looking through vars, items
    of tuples built there and reshapes to the shape they already have (autodiff wraps the output
    gradient of transformers' GPT-2 attention in one: ``reshape(permute_dims(g), its own
    shape)``)."""
    while True:
        value = mutator.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        if value is None:
            return expr
        if isinstance(value, relax.TupleGetItem):
            tup = bound_value(mutator, value.tuple_value)
            if isinstance(tup, relax.Tuple):
                expr = tup.fields[value.index]
                continue
        if isinstance(value, relax.Var):
            expr = value
            continue
        if _identity_reshape(value):
            expr = value.args[0]
            continue
        return value


def _identity_reshape(value: relax.Expr) -> bool:
    if not (isinstance(value, relax.Call) and value.op == RESHAPE):
        return False
    shape = static_shape(value.args[0])
    return shape is not None and shape == static_shape(value)


@mutator
class _Canceller(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != PERMUTE_DIMS or not isinstance(call.args[0], relax.Var):
            return call
        inner = bound_value(self, call.args[0])
        if not (isinstance(inner, relax.Call) and inner.op == PERMUTE_DIMS):
            return call
        ndim = getattr(call.args[0].ty, "ndim", -1)
        if ndim < 0:
            return call
        outer_axes, inner_axes = _axes(call, ndim), _axes(inner, ndim)
        if [inner_axes[a] for a in outer_axes] == list(range(ndim)):
            return inner.args[0]
        return call


@tvm.transform.module_pass(opt_level=0, name="CancelTransposes")
class CancelTransposes:
    """Replace ``permute_dims(permute_dims(x, p), q)`` by ``x`` where ``p`` then ``q`` is the identity."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        canceller = _Canceller(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and not (func.attrs and "Codegen" in func.attrs):
                canceller.builder_.update_func(gv, canceller.visit_expr(func))
        return relax.transform.DeadCodeElimination()(canceller.builder_.get())
