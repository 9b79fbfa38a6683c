"""LegalizeOps with the project's rules in place of TVM's for a few ops (both routes).

Ops with no 16-bit float form on TVM's CUDA route (``FLOAT32_ONLY``: atan2, the finiteness tests,
rounding, ...) computed on float32 copies of their operands.

Index generators as kernels.  TVM 0.27 legalizes ``relax.arange`` with constant bounds to a
constant tensor (``relax.const(np.arange(...))``); a kernel that reads it then loads what it could
compute from its own index.  The cross-entropy's one-hot compares the classes' ``arange`` with the
labels in its gradient kernel over [tokens, vocabulary]: the folded int64 row, read along the
vocabulary, made that bf16 kernel's vectors two lanes wide (8 bytes an element; Llama's at 8192 x
32000, GPT-2's at 16384 x 50257).  Here an ``arange`` becomes ``topi.arange``'s kernel
(``call_tir`` with no tensor arguments), which ``FuseOps`` fuses into its readers as index
arithmetic.  TVM's ``FoldConstant`` after legalization still folds one of up to about a thousand
elements (ImageNet's 1000 classes): there the row is small and stays in cache.

Group and instance norms in two passes.  TVM's ``topi.nn.group_norm`` and ``instance_norm`` take
the variance as ``E[x^2] - E[x]^2`` in float32: where a group's mean is large against its spread
the two cancel (a mean 300 standard deviations from zero gives results 6 % off, and a variance can
come out negative).  Here the variance is the mean of the centred squares, as torch computes it and
as the gradient rules recompute it; gamma and beta apply whatever ``scale`` and ``center`` say, as
in TVM's rules (the gradient rules refuse those flags).  float16 inputs are normalized in float32.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax, te, topi

from .._rewrite import group_norm_view, static_shape


def _bound(arg):
    """An arange bound as TE takes it: its PrimValue's value (an IntImm or FloatImm, or a symbolic
    expression)."""
    return getattr(arg, "value", arg)


def _arange(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    start, end, step = (_bound(a) for a in call.args)
    return bb.call_te(topi.arange, start, end, step, str(call.attrs.dtype), primfunc_name_hint="arange")


def _normalize(x: te.Tensor, gamma: te.Tensor, beta: te.Tensor, view: list, axes: list, param_axes: list,
               epsilon: float) -> te.Tensor:
    """``(x - mean) * rsqrt(var + eps) * gamma + beta`` on `x` seen as `view`, the statistics over
    `axes` (two passes, in float32), gamma and beta laid along `param_axes` of the view."""
    data = topi.reshape(x, view)
    if data.dtype != "float32":
        data = topi.cast(data, "float32")
    count = tvm.tirx.const(float(math.prod(int(view[a]) for a in axes)), "float32")
    mean = topi.divide(topi.sum(data, axes, keepdims=True), count)
    centered = topi.subtract(data, mean)
    var = topi.divide(topi.sum(topi.multiply(centered, centered), axes, keepdims=True), count)
    xhat = topi.multiply(centered, topi.rsqrt(topi.add(var, tvm.tirx.const(epsilon, "float32"))))
    pshape = [view[a] if a in param_axes else 1 for a in range(len(view))]
    scale, shift = (topi.reshape(topi.cast(p, "float32"), pshape) for p in (gamma, beta))
    out = topi.add(topi.multiply(xhat, scale), shift)
    return topi.reshape(topi.cast(out, x.dtype), x.shape)


def _static_shape(call: relax.Call) -> list[int]:
    shape = static_shape(call.args[0])
    if shape is None:
        raise ValueError(f"{call.op.name}: a static input shape is needed, got {call.args[0].ty}")
    return list(shape)


def _group_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    shape, attrs = _static_shape(call), call.attrs
    ndim = len(shape)
    channel, groups = int(attrs.channel_axis) % ndim, int(attrs.num_groups)
    if shape[channel] % groups:
        raise ValueError(f"relax.nn.group_norm: {shape[channel]} channels in {groups} groups")
    view, axes = group_norm_view(shape, channel, groups, [int(a) % ndim for a in attrs.axes])
    return bb.call_te(_normalize, *call.args, view, axes, [channel, channel + 1], float(attrs.epsilon),
                      primfunc_name_hint="group_norm")


def _instance_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    shape, attrs = _static_shape(call), call.attrs
    ndim = len(shape)
    axes = sorted(int(a) % ndim for a in attrs.axes)
    return bb.call_te(_normalize, *call.args, shape, axes, [int(attrs.channel_axis) % ndim], float(attrs.epsilon),
                      primfunc_name_hint="instance_norm")


# Ops TVM 0.27's CUDA route has no 16-bit float form of: its legalisation refuses the finiteness
# tests ("not supported for isnan op"), its codegen has no bf16 atan2, asin, acos, their
# hyperbolic kinds, rounding (``hnearbyint`` is no CUDA function) or vector remainder.  Their
# 16-bit float operands are widened to float32, TVM's own rule computes the op, and a float
# result is narrowed back: a step built from bf16 weights (no ``AutoMixedPrecision`` to route
# them to float32 first) then compiles, and its values are the float32 op's, rounded once.
FLOAT32_ONLY = frozenset({
    "relax.atan2", "relax.asin", "relax.acos", "relax.asinh", "relax.acosh", "relax.atanh", "relax.sinh",
    "relax.cosh", "relax.isnan", "relax.isinf", "relax.isfinite", "relax.round", "relax.mod",
})
NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def _in_float32(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """`call` by TVM's rule for its op on float32 copies of its 16-bit float operands, a float
    result narrowed back to its dtype (``FLOAT32_ONLY``)."""
    default = call.op.get_attr("FLegalize")
    narrow = [str(a.ty.dtype) in NARROW_FLOATS for a in call.args]
    if not any(narrow):
        return default(bb, call)
    args = [bb.emit(bb.call_te(topi.cast, a, "float32", primfunc_name_hint="cast")) if n else a
            for a, n in zip(call.args, narrow)]
    result = default(bb, bb.normalize(relax.Call(call.op, args, call.attrs, call.ty_args)))
    dtype = str(call.ty.dtype)
    if dtype not in NARROW_FLOATS:
        return result  # the finiteness tests' booleans
    return bb.call_te(topi.cast, bb.emit(result), dtype, primfunc_name_hint="cast")


LEGALIZE = {"relax.arange": _arange, "relax.nn.group_norm": _group_norm, "relax.nn.instance_norm": _instance_norm,
            **{name: _in_float32 for name in FLOAT32_ONLY}}


def legalize_ops() -> tvm.transform.Pass:
    """``relax.transform.LegalizeOps`` with ``LEGALIZE`` in place of TVM's rules for those ops."""
    return relax.transform.LegalizeOps(customize_legalize_map=LEGALIZE)
