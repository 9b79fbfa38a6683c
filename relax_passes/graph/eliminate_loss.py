"""EliminateLoss: the backward of the loss head reads no value computed only for the loss.

``relax.transform.Gradient`` differentiates the loss expression literally, so the adjoint of
the loss head re-reads forward values that exist only to produce the loss scalar, and carries
the seed ``ones(())`` through a chain of scalar ops.  This pass rewrites, in every Relax
function (``main_adjoint``, ``train_step``, ...):

* ``exp(log_softmax(z, a))`` → ``softmax(z, a)``: the cross-entropy / NLL adjoint
  ``dlp - sum(dlp) * exp(lp)`` needs the probabilities, not the log-probabilities the loss
  value is gathered from.  With DecomposeCrossEntropy it reads ``softmax(z) - one_hot``;
* ``power(d, e)`` with ``e`` folding to 1 → ``d``: the MSE adjoint ``2 * power(d, 2 - 1)``;
* the loss seed ``ones(())`` → the scalar constant 1, and scalar arithmetic on scalar
  constants, also under a ``broadcast_to`` (``broadcast_to(1 / N, S) * 2``), is folded, so
  the whole loss-gradient seed is one constant ``2 / N`` (FoldLayoutIntoMatmul then drops the
  broadcast: ``d * (2 / N)``).

The loss value itself stays: a function that returns it (``train_step``, ``main_adjoint``)
still computes it, only the backward no longer depends on it; where nothing returns it,
DeadCodeElimination removes the log_softmax / gather / nll chain.
"""

from __future__ import annotations

import operator

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions

EXP = tvm.ir.Op.get("relax.exp")
LOG_SOFTMAX = tvm.ir.Op.get("relax.nn.log_softmax")
POWER = tvm.ir.Op.get("relax.power")
ONES = tvm.ir.Op.get("relax.ones")
BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")

SCALAR_ARITH = {
    tvm.ir.Op.get("relax.add"): operator.add,
    tvm.ir.Op.get("relax.subtract"): operator.sub,
    tvm.ir.Op.get("relax.multiply"): operator.mul,
    tvm.ir.Op.get("relax.divide"): operator.truediv,
}


@mutator
class _LossEliminator(PyExprMutator):
    def _bound(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is not None:
                return value
        return expr

    def _scalar(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of a floating scalar constant (looking through bindings), else None."""
        expr = self._bound(expr)
        if isinstance(expr, tvm.ir.GenericConst):
            value = expr.value.numpy()
            if value.ndim == 0 and value.dtype.kind == "f":
                return value
        return None

    def _uniform(self, expr: relax.Expr) -> tuple[np.ndarray, relax.Expr] | None:
        """(value, shape) of ``broadcast_to(scalar constant, shape)``, else None."""
        bound = self._bound(expr)
        if isinstance(bound, relax.Call) and bound.op == BROADCAST_TO:
            value = self._scalar(bound.args[0])
            if value is not None:
                return value, bound.args[1]
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == EXP:
            lsm = self._bound(call.args[0])
            if isinstance(lsm, relax.Call) and lsm.op == LOG_SOFTMAX:
                return relax.op.nn.softmax(lsm.args[0], int(lsm.attrs.axis))
        elif call.op == POWER:
            exponent = self._scalar(call.args[1])
            if exponent is not None and float(exponent) == 1.0:
                return call.args[0]
        elif call.op == ONES and call.ty.ndim == 0 and str(call.ty.dtype).startswith("float"):
            return relax.const(1.0, str(call.ty.dtype))
        elif call.op in SCALAR_ARITH:
            return self._fold(call)
        return call

    def _fold(self, call: relax.Call) -> relax.Expr:
        fn = SCALAR_ARITH[call.op]
        lhs, rhs = call.args
        a, b = self._scalar(lhs), self._scalar(rhs)
        dtype = str(call.ty.dtype)
        if a is not None and b is not None:
            return relax.const(np.asarray(fn(a, b), dtype=dtype), dtype)
        ua, ub = self._uniform(lhs), self._uniform(rhs)
        if ua is not None and b is not None:
            return relax.op.broadcast_to(relax.const(np.asarray(fn(ua[0], b), dtype=dtype), dtype), ua[1])
        if a is not None and ub is not None:
            return relax.op.broadcast_to(relax.const(np.asarray(fn(a, ub[0]), dtype=dtype), dtype), ub[1])
        return call


@tvm.transform.module_pass(opt_level=0, name="EliminateLoss")
class EliminateLoss:
    """Cut the loss-gradient path free of the loss value in every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_LossEliminator(mod), mod)
