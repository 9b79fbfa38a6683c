"""DecomposeBatchNorm: batch statistics as the one-pass moments Σx and Σx².

``tvm_evt.batch_norm`` calls (`FuseBatchNorm`, before ``Gradient``) become their plain ops here,
already in this form (`batch_norm_op.decompose_batch_norm`); their gradients were written in plain
ops by the op's gradient rule.

Our frontend imports training-mode batch norm already decomposed by torch.export into
``mean(x, A)``, ``variance(x, A)`` and elementwise ops; ``variance`` is a two-pass reduction
(it needs the mean first), which no GEMM / conv epilogue can produce.  This pass rewrites
every ``variance(x, A, keepdims)`` into the two one-pass moments

    variance(x, A) → mean(x * x, A) - mean(x, A) * mean(x, A)

which an EVT epilogue computes as two column reductions of the producing conv/GEMM
(``mean(x, A)`` is spelled like the batch mean, so EliminateCommonSubexpr shares it).  The
biased (population) variance is what ``relax.variance`` computes, so the result is exact up to
float rounding; the moment form loses precision when |mean| ≫ std, as in any one-pass
BatchNorm kernel (cuDNN, CUTLASS EVT).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import batch_norm_op
from .._rewrite import mutate_relax_functions

VARIANCE = tvm.ir.Op.get("relax.variance")
BATCH_NORM = tvm.ir.Op.get(batch_norm_op.OP)


@mutator
class _VarianceDecomposer(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == BATCH_NORM:
            return batch_norm_op.decompose_batch_norm(self.builder_, call)
        if call.op != VARIANCE:
            return call
        x = call.args[0]
        axis = call.attrs.axis
        axes = None if axis is None else [int(a) for a in axis]
        return batch_norm_op.moments(self.builder_, x, axes, bool(call.attrs.keepdims))[1]


@tvm.transform.module_pass(opt_level=0, name="DecomposeBatchNorm")
class DecomposeBatchNorm:
    """Rewrite every ``relax.variance`` of every Relax function into Σx and Σx² moments, and every
    ``tvm_evt.batch_norm`` call into plain ops."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_VarianceDecomposer(mod), mod)
