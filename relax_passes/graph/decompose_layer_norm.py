"""DecomposeLayerNorm: forward ``layer_norm`` into its row statistics and an elementwise tail.

``R.nn.layer_norm(x, gamma, beta, axes, eps)`` becomes, over the normalized ``axes``
(keepdims)::

    mean     = mean(x, axes)                       # row reduction
    centered = x - mean
    rstd     = rsqrt(mean(centered * centered, axes) + eps)
    y        = centered * rstd * reshape(gamma) + reshape(beta)

spelled exactly as `gradient_rules.layer_norm_grad` spells its recomputation (the backward is
already reductions + elementwise), so EliminateCommonSubexpr computes ``mean`` / ``rstd`` once
for forward and backward, and each piece is a row reduction or an epilogue op.  ``scale`` /
``center`` false drop the gamma / beta term.  ``R.nn.rms_norm(x, w, axes, eps)`` likewise, as
`gradient_rules.rms_norm_grad` spells it::

    rstd = rsqrt(mean(x * x, axes) + eps)
    y    = x * rstd * reshape(w)
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions

LAYER_NORM = tvm.ir.Op.get("relax.nn.layer_norm")
RMS_NORM = tvm.ir.Op.get("relax.nn.rms_norm")


@mutator
class _LayerNormDecomposer(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in (LAYER_NORM, RMS_NORM) or not isinstance(call.args[0].ty.shape, relax.ShapeExpr):
            return call
        x, gamma = call.args[:2]
        attrs = call.attrs
        shape = [int(s) for s in x.ty.shape.values]
        ndim = len(shape)
        axes = sorted(int(a) % ndim for a in attrs.axes)
        bshape = [shape[a] if a in axes else 1 for a in range(ndim)]
        eps = relax.const(float(attrs.epsilon), str(x.ty.dtype))
        emit = self.builder_.emit
        if call.op == RMS_NORM:
            square = emit(relax.op.multiply(x, x))
            rstd = emit(relax.op.rsqrt(emit(relax.op.add(emit(relax.op.mean(square, axes, keepdims=True)), eps))))
            return relax.op.multiply(emit(relax.op.multiply(x, rstd)), emit(relax.op.reshape(gamma, bshape)))
        beta = call.args[2]
        mean = emit(relax.op.mean(x, axes, keepdims=True))
        centered = emit(relax.op.subtract(x, mean))
        square = emit(relax.op.multiply(centered, centered))
        var = emit(relax.op.mean(square, axes, keepdims=True))
        rstd = emit(relax.op.rsqrt(emit(relax.op.add(var, eps))))
        y = relax.op.multiply(centered, rstd)
        if attrs.scale:
            y = relax.op.multiply(emit(y), emit(relax.op.reshape(gamma, bshape)))
        if attrs.center:
            y = relax.op.add(emit(y), emit(relax.op.reshape(beta, bshape)))
        return y


@tvm.transform.module_pass(opt_level=0, name="DecomposeLayerNorm")
class DecomposeLayerNorm:
    """Decompose every ``relax.nn.layer_norm`` and ``relax.nn.rms_norm`` of every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_LayerNormDecomposer(mod), mod)
