"""DecomposeMatmulBias: the bias add of a linear layer as an explicit epilogue of its matmul.

torch.export's ``linear`` arrives as ``add(bias, matmul(x, permute_dims(w)))`` — bias first.
This pass puts the matmul (the accumulator) first, ``add(matmul(x, w'), bias)``, in every Relax
function, so the GEMM + bias epilogue reads the same way everywhere (accumulator, then the
row-broadcast operand) and a single pattern covers both spellings.  Only ``add`` with exactly
one matmul operand whose result shape equals the matmul's is touched; the bias gradient
(``collapse_sum_to`` of the output gradient) is made an explicit column ``sum`` by
EliminateReduction.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, static_shape as _shape

ADD = tvm.ir.Op.get("relax.add")
MATMUL = tvm.ir.Op.get("relax.matmul")


@mutator
class _BiasOrderer(PyExprMutator):
    def _is_matmul(self, expr: relax.Expr) -> bool:
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        return isinstance(bound, relax.Call) and bound.op == MATMUL

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != ADD:
            return call
        bias, acc = call.args
        if self._is_matmul(acc) and not self._is_matmul(bias):
            if _shape(acc) is not None and _shape(acc) == _shape(call):
                return relax.op.add(acc, bias)
        return call


@tvm.transform.module_pass(opt_level=0, name="DecomposeMatmulBias")
class DecomposeMatmulBias:
    """Order every matmul + bias add of every Relax function as ``add(matmul, bias)``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_BiasOrderer(mod), mod)
