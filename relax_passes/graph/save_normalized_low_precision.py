"""SaveNormalizedLowPrecision: an affine-free layer norm's gradient reads its output as rounded for the GEMM.

`FoldNormAffine` leaves layer norms whose output ``xhat`` only matmuls read (the scale and shift
went into their weights), and ``gradient_rules.layer_norm_grad`` reads that output for the
gradient.  Under mixed precision the forward rounds ``xhat`` to bf16 for the GEMMs, whose weight
gradients keep that copy anyway; this pass makes the float32 readers of ``xhat`` after the copy
(the layer norm's gradient) read ``astype(copy, float32)``, so the step keeps the copy and the
row's ``rstd`` where it kept the layer norm's input and output.  The values change by the bf16
rounding of ``xhat`` (relative 2^-9), the rounding the weight gradients read it with.

``xhat`` is found as `DecomposeLayerNorm` spells it: ``(x - mean(x)) * rsqrt(...)`` over the last
axis, and its copy also through the reshape to the GEMM's [tokens, H] (widened back as a view).
The same rewrite as `SaveSoftmaxLowPrecision`, for other values.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import mutate_relax_functions
from ..lower.fuse_layer_norm import _is_last_axis_mean
from .save_softmax_low_precision import LowPrecisionReader

MULTIPLY = tvm.ir.Op.get("relax.multiply")
RSQRT = tvm.ir.Op.get("relax.rsqrt")
SUBTRACT = tvm.ir.Op.get("relax.subtract")


def _is(bound: dict, var, op):
    value = bound.get(var) if isinstance(var, relax.Var) else None
    return value if isinstance(value, relax.Call) and value.op == op else None


def normalized_rows(bindings: list) -> set:
    """The vars bound to ``(x - mean(x, last axis)) * rsqrt(...)``: a layer norm's ``xhat``."""
    bound = {b.var: b.value for b in bindings}
    found = set()
    for b in bindings:
        product = _is(bound, b.var, MULTIPLY)
        if product is None:
            continue
        centered, rstd = product.args
        sub = _is(bound, centered, SUBTRACT)
        mean = bound.get(sub.args[1]) if sub is not None else None
        if (_is_last_axis_mean(mean, b.var.ty.ndim) and mean.args[0].same_as(sub.args[0])
                and _is(bound, rstd, RSQRT) is not None):
            found.add(b.var)
    return found


@tvm.transform.module_pass(opt_level=0, name="SaveNormalizedLowPrecision")
class SaveNormalizedLowPrecision:
    """Readers of a float32 layer-norm ``xhat`` that also has a 16-bit copy read the widened copy."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = LowPrecisionReader(mod)
        return mutate_relax_functions(rewriter, mod,
                                      before_each=lambda f: rewriter.prime(f, normalized_rows, through_reshape=True))
