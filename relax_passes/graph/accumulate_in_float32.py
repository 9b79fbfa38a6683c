"""AccumulateInFloat32: low-precision ``sum`` / ``mean`` read their input widened to fp32.

AutoMixedPrecision runs the forward graph's reductions in fp32, but the backward graph that
``Gradient`` writes afterwards reduces in whatever dtype the gradient has: the adjoint of a
broadcast bf16 operand (a bias, batch norm's scale and shift, the per-channel statistics) is a
``collapse_sum_to`` of a bf16 tensor, which EliminateReduction makes a bf16 ``sum``.  TVM
legalizes that with a bf16 accumulator on CUDA and LLVM alike: 4096 bf16 ones sum to 256, and
a batch-norm scale gradient over N·H·W positions keeps about two correct digits.  PyTorch's
autocast accumulates such sums in fp32 and rounds only the result.  This pass does the same:

    sum(x: bf16, A)  →  astype(sum(astype(x, float32), A), bfloat16)       (mean alike)

The widening cast costs no memory traffic: FuseOps computes it inside the reduction's kernel
(PartitionEVT keeps casts that only reductions read out of GEMM epilogues, and SplitReduction
views above them), so the kernel reads the same bf16 bytes and adds in fp32.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions

LOW_PRECISION = ("bfloat16", "float16")
REDUCE = {
    tvm.ir.Op.get("relax.sum"): relax.op.sum,
    tvm.ir.Op.get("relax.mean"): relax.op.mean,
}


@mutator
class _Widener(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in REDUCE:
            return call
        x = call.args[0]
        dtype = str(x.ty.dtype) if isinstance(x.ty, relax.TensorType) else None
        if dtype not in LOW_PRECISION:
            return call
        axis = None if call.attrs.axis is None else [int(a) for a in call.attrs.axis]
        wide = self.builder_.emit(relax.op.astype(x, "float32"))
        total = self.builder_.emit(REDUCE[call.op](wide, axis, keepdims=bool(call.attrs.keepdims)))
        return relax.op.astype(total, dtype)


@tvm.transform.module_pass(opt_level=0, name="AccumulateInFloat32")
class AccumulateInFloat32:
    """Widen the input of every bf16 / fp16 ``sum`` and ``mean`` of every Relax function to fp32."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Widener(mod), mod)
