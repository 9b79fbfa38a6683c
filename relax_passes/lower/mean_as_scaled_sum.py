"""MeanAsScaledSum: a float32 ``mean`` of an elementwise op's result as ``sum(...) / n``, so that
FuseOps fuses the elementwise op into the reduction.

TVM 0.27 legalizes ``mean`` as one PrimFunc (the sum, then the divide), which AnnotateTIROpPattern
marks kOutEWiseFusable, and FuseOps fuses no producer into such a function: RMSNorm's
``mean(x * x)`` wrote ``x * x`` out in float32 and read it back, a kernel of its own (Llama's
4 x 2048 x 4096 activations: 0.40 GB a norm, three norms a layer with the final one; modelled).
``sum`` is kCommReduce, into which FuseOps fuses elementwise producers; the divide joins the
mean's readers.

    m = mean(multiply(x, x), axis=[-1], keepdims=True)
  ->
    m = divide(sum(multiply(x, x), axis=[-1], keepdims=True), 4096.0)

A float32 mean over axes that keep the innermost one (a column mean: a global average pool's
``[N, H, W, C]`` over H and W) becomes ``sum / n`` whatever its operand: as one PrimFunc (the sum,
then the divide) no column rule takes it (``ColumnReduction`` takes one reduction block), and
DLight's ``Reduction`` read one element a thread (MobileNetV2's pool, 16 MB: 0.10 ms on H200,
``docs/bench/h200-2026-12-01e/``); the sum alone is a column sum.

float32 means only (``n`` and the quotient as exact as TVM's own divide); a mean over the innermost
axis whose operand is not an elementwise op's result stays.  On the CUDA route, last before ``LegalizeOps``: the passes
that match a ``mean`` (FuseLayerNorm, SplitReduction, ...) have run by then.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import POINTWISE, dtype_of, mutate_relax_functions, op_name, static_shape

MEAN = tvm.ir.Op.get("relax.mean")


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != MEAN or dtype_of(call) != "float32":
            return call
        x = call.args[0]
        shape = static_shape(x)
        bound = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if shape is None:
            return call
        axes = range(len(shape)) if call.attrs.axis is None else [int(a) % len(shape) for a in call.attrs.axis]
        if op_name(bound) not in POINTWISE and (not shape or len(shape) - 1 in axes):
            return call
        n = math.prod(shape[a] for a in axes)
        total = self.builder_.emit(relax.op.sum(x, call.attrs.axis, bool(call.attrs.keepdims)))
        return relax.op.divide(total, relax.const(float(n), "float32"))


@tvm.transform.module_pass(opt_level=0, name="MeanAsScaledSum")
class MeanAsScaledSum:
    """Rewrite each float32 ``mean`` of an elementwise op's result as ``sum / n`` (see the module
    docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Rewriter(mod), mod)
