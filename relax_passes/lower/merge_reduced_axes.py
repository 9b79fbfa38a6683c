"""MergeReducedAxes: a reduction over several adjacent axes as one over a single axis of a reshape.

    s = sum(x, axis=[1, 2], keepdims=True)          x: [N, H, W, C]
  ->
    s = reshape(sum(reshape(x, [N, H·W, C]), axis=[1], keepdims=True), [N, 1, 1, C])

The schedule rules for column and row reductions (``ColumnReduction``, ``RowReduction``) take a
kernel of one reduction iterator; a reduction over H and W (a global average pool's, a
squeeze-and-excitation's on an NHWC activation) has two, and went to DLight's ``Reduction``,
which reads one element a thread: MobileNetV2's pool at batch 128 (16 MB) took 0.10 ms on H200,
EfficientNet-B0's 16 squeeze-and-excitation means 0.47 ms a step
(``docs/bench/h200-2026-12-01e/``, ``../h200-2026-12-01d/``).  The reshapes move no data (a
row-major merge of adjacent axes), and FuseOps fuses them with the reduction.

Sums, maxima, minima, products and means of a static shape whose reduced axes are one run of at
least two adjacent axes; on the CUDA route after ``MeanAsScaledSum``, just before ``LegalizeOps``
(the passes that match a reduction by its axes have run by then).
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import REDUCTIONS, mutate_relax_functions, static_shape



@mutator
class _Merger(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in REDUCTIONS or call.attrs.axis is None:
            return call
        x = call.args[0]
        shape, result = static_shape(x), static_shape(call)
        if shape is None or result is None:
            return call
        axes = sorted(int(a) % len(shape) for a in call.attrs.axis)
        if len(axes) < 2 or axes != list(range(axes[0], axes[-1] + 1)):
            return call
        first, last = axes[0], axes[-1]
        merged = [*shape[:first], math.prod(shape[first:last + 1]), *shape[last + 1:]]
        keep = bool(call.attrs.keepdims)
        flat = self.builder_.emit(relax.op.reshape(x, merged))
        reduced = REDUCTIONS[call.op](flat, [first], keep)
        return relax.op.reshape(self.builder_.emit(reduced), result) if keep else reduced


@tvm.transform.module_pass(opt_level=0, name="MergeReducedAxes")
class MergeReducedAxes:
    """Reductions over a run of adjacent axes as reductions over one merged axis (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Merger(mod), mod)
