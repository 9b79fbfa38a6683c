"""EliminateMaskedFillGradient: drop the gradient's mask of a ``-inf`` fill that feeds a softmax.

A causal (or padding) mask fills the attention scores with ``-inf`` before the softmax::

    M = where(c, -inf, S);   P = softmax(M, axis=-1)

and its gradient masks the softmax gradient the same way: ``dS = where(c, 0, dM)``.  But
``dM = P ∘ (dP - D)`` (softmax's gradient, after `EliminateSoftmaxBackwardReduction`) and ``P``
is exactly 0 wherever ``c`` holds (``exp(-inf) = 0``), so the ``where`` changes nothing: ``dS = dM``.
Behind the ``dP`` GEMM that ``where`` is one more epilogue load (the bool mask, broadcast over
batch and heads) and a select per element.  On H100 GPT-2 medium's dS partition (256 x 1024 x
1024 x 64) went from 1.62 to 1.51 ms without it; most of that kernel's time is elsewhere in its
epilogue (its plain GEMM takes 0.24 ms).

The result differs only where the forward is already not finite: a fully masked row makes ``P``
NaN (and the loss with it), and an infinite ``dP`` times a zero ``P`` is NaN where the mask
wrote 0.  Matched on the bindings of each Relax function::

    g = where(c, 0, z)                  # the zero a scalar
    z = cast*(multiply(a, b))           # a or b: cast*(softmax(cast*(where(c, -inf, S)), axis=-1))

with the same ``c``; ``g`` becomes ``z``.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, scalar_value, static_shape

WHERE = tvm.ir.Op.get("relax.where")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
ASTYPE = tvm.ir.Op.get("relax.astype")


def _through_casts(bound: dict, expr: relax.Expr) -> relax.Expr:
    """`expr`'s producer chain followed through ``astype`` and var-to-var bindings."""
    while isinstance(expr, relax.Var) and expr in bound:
        value = bound[expr]
        if isinstance(value, relax.Var) or isinstance(value, relax.Call) and value.op == ASTYPE:
            expr = value if isinstance(value, relax.Var) else value.args[0]
        else:
            break
    return expr


def _call(bound: dict, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
    value = bound.get(expr) if isinstance(expr, relax.Var) else expr
    return value if isinstance(value, relax.Call) and value.op == op else None


def _softmax_of_filled(bound: dict, expr: relax.Expr, mask: relax.Expr) -> bool:
    """Is `expr` (through casts) ``softmax(where(mask, -inf, S), axis=-1)``?"""
    sm = _call(bound, _through_casts(bound, expr), SOFTMAX)
    if sm is None:
        return False
    shape = static_shape(sm)
    if shape is None or int(sm.attrs.axis) % len(shape) != len(shape) - 1:
        return False
    fill = _call(bound, _through_casts(bound, sm.args[0]), WHERE)
    if fill is None or not fill.args[0].same_as(mask):
        return False
    value = scalar_value(bound, fill.args[1])
    return value is not None and math.isinf(value) and value < 0


def redundant_masks(func: relax.Function) -> dict:
    """``{g: z}`` for each ``g = where(c, 0, z)`` of `func` the module docstring describes."""
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    found = {}
    for g, value in bound.items():
        if not (isinstance(value, relax.Call) and value.op == WHERE):
            continue
        mask, zero, z = value.args
        if scalar_value(bound, zero) != 0.0 or static_shape(z) != static_shape(value):
            continue
        prod = _call(bound, _through_casts(bound, z), MULTIPLY)
        if isinstance(z, relax.DataflowVar) and not isinstance(g, relax.DataflowVar):
            continue  # a dataflow block's output cannot become one of its locals
        if prod is not None and any(_softmax_of_filled(bound, a, mask) for a in prod.args):
            found[g] = z
    return found


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.drop: dict = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.drop:
            self.set_var_remap(binding.var, self.visit_expr(self.drop[binding.var]))
            return
        super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="EliminateMaskedFillGradient")
class EliminateMaskedFillGradient:
    """Rewrite every Relax function of the module (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)

        def prime(func: relax.Function) -> None:
            rewriter.drop = redundant_masks(func)

        return mutate_relax_functions(rewriter, mod, before_each=prime)
