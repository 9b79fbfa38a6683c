"""Training-mode batch norm as one Relax op, ``tvm_evt.batch_norm``, with a compact gradient.

Registered (once) when this module is imported::

    (y, mean, var) = tvm_evt.batch_norm(x, gamma, beta, eps, out_dtype, *axes)

* ``x``: a float tensor (float32, float16 or bfloat16); ``eps``: a float32 prim value;
  ``out_dtype``: ``y``'s dtype as an int64 prim value indexing ``FLOATS``; ``axes``: the reduced
  axes as int64 prim values (every axis but the channel axis: ``0, 1, 2`` for NHWC, ``0, 2, 3``
  for NCHW).  `batch_norm` builds a call from Python values.
* ``gamma``, ``beta``, ``mean``, ``var``: float32 in the statistics' keepdims shape (``x``'s shape
  with the reduced axes 1: ``[1, 1, 1, C]``).

Computed in float32 from ``x32 = astype(x, float32)``, over the ``M`` elements of each channel::

    mean = mean(x32, axes)                    var = mean(x32 * x32, axes) - mean * mean  (biased)
    y    = astype((x32 - mean) / sqrt(var + eps) * gamma + beta, out_dtype)

(the moments as `DecomposeBatchNorm` writes them: one pass over ``x``, what a GEMM epilogue or a
one-pass kernel computes).  ``decompose_batch_norm`` binds exactly this with plain Relax ops; it
is the op's ``FLegalize`` and `DecomposeBatchNorm`'s rewrite.

The gradient rule gives the input gradient in the closed form instead of differentiating those
ops one by one (which wrote eight float32 M×C intermediates and six column sums per batch norm,
each re-reading them: 206 MB a read at ResNet-50's 100352×512)::

    g   = astype(dy, float32)                  c = x32 - mean,  rstd = 1 / sqrt(var + eps)
    dβ  = Σ g                                  dγ = rstd · Σ g·c
    dx  = γ·rstd · (g - dβ / M - c · rstd · dγ / M)  [+ dmean / M + dvar · 2c / M]

two column sums that read ``dy`` and ``x`` in their own dtype, and one elementwise pass.  Gradients
reaching ``mean`` and ``var`` (a training graph only feeds them to the running statistics, which
the loss does not read) are added where the adjoint is not a constant zero.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.relax.op.grad import no_grad

from .._rewrite import op_name, static_shape
from ..training.gradient_rules import register_op

OP = "tvm_evt.batch_norm"
FLOATS = ("float32", "float16", "bfloat16")


class BatchNormOpError(ValueError):
    """A ``tvm_evt.batch_norm`` call with malformed operands."""


def batch_norm(x, gamma, beta, eps: float, axes, out_dtype: str) -> relax.Call:
    """A ``tvm_evt.batch_norm`` call; its value is ``(y, mean, var)``."""
    if str(out_dtype) not in FLOATS:
        raise _fail(f"out_dtype {out_dtype} is not one of {', '.join(FLOATS)}")
    eps = float(np.float32(eps))  # the float32 the kernels compute with, however it was spelled
    prims = [relax.prim_value(eps, "float32"), relax.prim_value(FLOATS.index(str(out_dtype)), "int64")]
    prims += [relax.prim_value(int(a), "int64") for a in sorted(int(a) for a in axes)]
    return relax.Call(tvm.ir.Op.get(OP), [x, gamma, beta, *prims])


def _fail(why: str) -> BatchNormOpError:
    return BatchNormOpError(f"{OP}: {why}")


def attrs(call: relax.Call) -> tuple[float, str, list[int]]:
    """(eps, out_dtype, reduced axes) of a call."""
    if len(call.args) < 6:
        raise _fail(f"expected x, gamma, beta, eps, out_dtype and the reduced axes; got {len(call.args)} arguments")
    eps, dtype, *axes = call.args[3:]
    if not isinstance(eps, tvm.tirx.FloatImm):
        raise _fail(f"eps must be a float32 prim value, got {eps}")
    if not isinstance(dtype, tvm.tirx.IntImm) or not 0 <= dtype.value < len(FLOATS):
        raise _fail(f"out_dtype must be an int prim value indexing {FLOATS}, got {dtype}")
    if not all(isinstance(a, tvm.tirx.IntImm) for a in axes):
        raise _fail(f"the reduced axes must be int prim values, got {axes}")
    return float(eps.value), FLOATS[dtype.value], [int(a.value) for a in axes]


def _static(expr: relax.Expr, what: str) -> list[int]:
    shape = static_shape(expr)
    if shape is None:
        raise _fail(f"{what} must be a tensor of static shape, got {expr.ty}")
    return list(shape)


def _check(call: relax.Call) -> tuple[float, str, list[int], list[int]]:
    """(eps, out_dtype, axes, the statistics' shape), the operands checked."""
    eps, out_dtype, axes = attrs(call)
    x, gamma, beta = call.args[:3]
    shape = _static(x, "x")
    if str(x.ty.dtype) not in FLOATS or out_dtype not in FLOATS:
        raise _fail(f"x is {x.ty.dtype}, out_dtype {out_dtype}; expected {', '.join(FLOATS)}")
    if not axes or any(a < 0 or a >= len(shape) for a in axes) or len(set(axes)) != len(axes) \
            or len(axes) == len(shape):
        raise _fail(f"reduced axes {axes} must be distinct axes of x {shape}, keeping at least one")
    stat = [1 if a in axes else s for a, s in enumerate(shape)]
    for what, t in (("gamma", gamma), ("beta", beta)):
        if _static(t, what) != stat or str(t.ty.dtype) != "float32":
            raise _fail(f"{what} must be float32 {stat}, got {t.ty}")
    return eps, out_dtype, axes, stat


def _infer(call: relax.Call, _bb) -> relax.TupleType:
    _, out_dtype, _, stat = _check(call)
    x = call.args[0]
    return relax.TupleType([relax.TensorType(x.ty.shape, out_dtype), relax.TensorType(stat, "float32"),
                            relax.TensorType(stat, "float32")])


def _f32(bb, x):
    return x if str(x.ty.dtype) == "float32" else bb.emit(R.astype(x, "float32"))


def moments(bb: relax.BlockBuilder, x: relax.Expr, axes, keepdims: bool) -> tuple[relax.Var, relax.Call]:
    """``mean(x)`` (bound in `bb`) and the biased ``var(x)`` over `axes` in one pass, as the call
    ``mean(x * x) - mean(x) * mean(x)`` (its operands bound in `bb`, the call itself not)."""
    emit = bb.emit
    mean = emit(R.mean(x, axes, keepdims=keepdims))
    mean_sq = emit(R.mean(emit(R.multiply(x, x)), axes, keepdims=keepdims))
    return mean, R.subtract(mean_sq, emit(R.multiply(mean, mean)))


def decompose_batch_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``tvm_evt.batch_norm`` in plain Relax ops, bound in `bb`: the ``(y, mean, var)`` tuple."""
    eps, out_dtype, axes, _ = _check(call)
    x, gamma, beta = call.args[:3]
    emit = bb.emit
    x32 = _f32(bb, x)
    mean, var = moments(bb, x32, axes, keepdims=True)
    var = emit(var)
    std = emit(R.sqrt(emit(R.add(var, relax.const(eps, "float32")))))
    xhat = emit(R.divide(emit(R.subtract(x32, mean)), std))
    y = emit(R.add(emit(R.multiply(xhat, gamma)), beta))
    if out_dtype != "float32":
        y = emit(R.astype(y, out_dtype))
    return relax.Tuple([y, mean, var])


def _is_zero(ctx: relax.BlockBuilder, expr: relax.Expr) -> bool:
    """A constant-zero adjoint (what `Gradient` gives an output nothing differentiable reads),
    seen through the bindings of `ctx`."""
    while isinstance(expr, (relax.Var, relax.TupleGetItem)):
        if isinstance(expr, relax.TupleGetItem):
            tup = expr.tuple_value
            tup = ctx.lookup_binding(tup) if isinstance(tup, relax.Var) else tup
            if not isinstance(tup, relax.Tuple):
                return False
            expr = tup.fields[expr.index]
            continue
        expr = ctx.lookup_binding(expr)
        if expr is None:
            return False
    if op_name(expr) == "relax.zeros":
        return True
    if isinstance(expr, tvm.ir.GenericConst):
        return not expr.value.numpy().any()
    return False


def _field(output_grad, i: int, ctx):
    if isinstance(output_grad, relax.Tuple):
        return output_grad.fields[i]
    return relax.TupleGetItem(output_grad, i)


def batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """``[dx, dgamma, dbeta]`` in the closed form of the module docstring, as plain Relax ops."""
    eps, _, axes, _ = _check(orig_call)
    x, gamma = orig_call.args[:2]
    m = math.prod(_static(x, "x")[a] for a in axes)
    dy = ctx.emit(_field(output_grad, 0, ctx))
    mean = ctx.emit(relax.TupleGetItem(orig_var, 1))
    var = ctx.emit(relax.TupleGetItem(orig_var, 2))
    f32 = lambda v: relax.const(v, "float32")  # noqa: E731
    rstd = ctx.emit(R.divide(f32(1.0), R.sqrt(R.add(var, f32(eps)))))
    g = ctx.emit(R.astype(dy, "float32")) if str(dy.ty.dtype) != "float32" else dy
    c = ctx.emit(R.subtract(_f32(ctx, x), mean))
    dbeta = ctx.emit(R.sum(g, axes, keepdims=True))
    sgc = ctx.emit(R.sum(R.multiply(g, c), axes, keepdims=True))
    dgamma = ctx.emit(R.multiply(sgc, rstd))
    a = ctx.emit(R.multiply(gamma, rstd))  # [1, .., C] factors of the elementwise pass
    b = ctx.emit(R.multiply(a, R.divide(dbeta, f32(m))))
    k = ctx.emit(R.multiply(a, R.multiply(rstd, R.divide(dgamma, f32(m)))))
    dx = R.subtract(R.subtract(R.multiply(g, a), b), R.multiply(c, k))
    dmean, dvar = _field(output_grad, 1, ctx), _field(output_grad, 2, ctx)
    if not _is_zero(ctx, dmean):
        dx = R.add(dx, R.divide(dmean, f32(m)))
    if not _is_zero(ctx, dvar):
        dx = R.add(dx, R.multiply(c, R.multiply(dvar, f32(2.0 / m))))
    dx = ctx.emit(dx)
    if str(x.ty.dtype) != "float32":
        dx = ctx.emit(R.astype(dx, str(x.ty.dtype)))
    return [dx, dgamma, dbeta] + [no_grad(arg) for arg in orig_call.args[3:]]


# ------------------------------------------------------------------------------- registration


register_op(OP, "training-mode batch norm: (y, batch mean, biased batch var)", _infer, decompose_batch_norm,
            batch_norm_grad)
