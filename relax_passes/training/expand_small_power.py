"""ExpandSmallPower: ``power(x, c)`` with a small constant exponent as multiplies / sqrt.

TVM 0.27's CUDA lowering of ``power`` returns NaN for a negative base even when the exponent
is an integer (measured on H100/H200: ``power(x, 2.0)`` of ``randn`` inputs), which turns
``torch.nn.MSELoss`` into NaN on the GPU.  Integer exponents 1..4 become products of ``x``,
0.5 / -0.5 / -1 become ``sqrt`` / ``rsqrt`` / ``1 / x``; any other exponent is left alone.
The products are also friendlier to epilogue fusion and to the gradient (no ``power`` rule).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions

POWER = tvm.ir.Op.get("relax.power")


def _scalar_const(expr) -> float | None:
    if isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


@mutator
class _Expander(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != POWER:
            return call
        c = _scalar_const(call.args[1])
        x = call.args[0]
        if c is None or x.ty.ndim != call.ty.ndim or str(x.ty.dtype) != str(call.ty.dtype):
            return call  # broadcasting or dtype-promoting powers keep their own semantics
        if c == int(c) and 1 <= c <= 4:
            out = x
            for _ in range(int(c) - 1):
                out = self.builder_.emit(relax.op.multiply(out, x))
            return out
        if c == 0.5:
            return relax.op.sqrt(x)
        if c == -0.5:
            return relax.op.rsqrt(x)
        if c == -1.0:
            return relax.op.divide(relax.const(1.0, str(x.ty.dtype)), x)
        return call


@tvm.transform.module_pass(opt_level=0, name="ExpandSmallPower")
class ExpandSmallPower:
    """Rewrite constant small-exponent powers in every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Expander(mod), mod)
