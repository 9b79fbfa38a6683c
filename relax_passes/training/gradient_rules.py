"""Gradient rules (FPrimalGradient) for Relax ops that TVM 0.27's `relax.transform.Gradient` lacks.

Importing this module registers every rule in `GRADIENT_RULES` (and the no-gradient ops in
`NO_GRAD_OPS`) at level `RULE_LEVEL`, above TVM's own level (10), so a rule here also replaces
TVM's where TVM's is wrong or incomplete: `relax.take` (N-D indices), `relax.where` (broadcast operands), `relax.nn.conv2d`
(dilation), `relax.nn.max_pool2d` / `avg_pool2d` (ceil_mode, windows that do not tile the input,
dilation), `relax.triu` (shares the tril rule).

A rule has TVM's signature `rule(orig_var, orig_call, output_grad, ctx) -> list[Expr]`: one partial
per argument of the call, `no_grad(arg)` for arguments that are not differentiable. Every backward
is written with Relax ops that `relax.transform.LegalizeOps` lowers on llvm; forward intermediates
(normalization statistics, attention probabilities) are recomputed from the inputs. Rules need
static shapes and raise `GradientRuleError` naming the op otherwise.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence

import numpy as np
import tvm_ffi
from tvm import relax, tirx
from tvm.ir import Call, Op
from tvm.relax import op as R
from tvm.relax.block_builder import BlockBuilder
from tvm.relax.expr import Expr, Var
from tvm.relax.op.base import register_gradient
from tvm.relax.op.grad import no_grad, take_backward

from .._rewrite import dtype_of, group_norm_view, op_name

__all__ = ["GRADIENT_RULES", "NO_GRAD_OPS", "RULE_LEVEL", "GradientRuleError", "register_op"]

RULE_LEVEL = 20
"""Registration level; TVM registers its own rules at 10, higher levels win."""

GradientRule = Callable[[Var, Call, Expr, BlockBuilder], list[Expr]]


class GradientRuleError(ValueError):
    """A gradient rule cannot differentiate this call (unsupported attribute or dynamic shape)."""


##################### Utilities #####################



def _lowest(dtype: str) -> float:
    """The most negative finite value of `dtype` (numpy alone does not know bfloat16)."""
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype).min)

def _op_name(call: Call) -> str:
    return op_name(call) or str(call.op)


def _fail(call: Call, why: str) -> GradientRuleError:
    return GradientRuleError(f"gradient of {_op_name(call)}: {why}")


def _shape(expr: Expr, call: Call) -> list[int]:
    """The static shape of a tensor argument of `call`."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise _fail(call, f"needs a tensor with known shape, got {ty}")
    dims = []
    for dim in ty.shape.values:
        if not isinstance(dim, tirx.IntImm):
            raise _fail(call, f"needs static shapes, got dimension {dim}")
        dims.append(int(dim))
    return dims


def _const(value: float, like: Expr) -> Expr:
    return relax.const(value, dtype_of(like))


def _prod(values: Sequence[int]) -> int:
    return functools.reduce(operator.mul, values, 1)


def _norm_axes(axes, ndim: int) -> list[int]:
    """Non-negative sorted axes; `None` means all axes."""
    if axes is None:
        return list(range(ndim))
    return sorted(int(a) % ndim for a in axes)


def _scalar(expr):
    """A Python number from an IntImm / FloatImm call argument."""
    return expr.value if hasattr(expr, "value") else expr


def _no_grads(call: Call) -> list[Expr]:
    return [no_grad(arg) for arg in call.args]


def _with_no_grads(call: Call, *grads: Expr) -> list[Expr]:
    """`grads` for the leading arguments, `no_grad` for the remaining (attribute-like) ones."""
    return list(grads) + [no_grad(arg) for arg in call.args[len(grads) :]]


def _fit(ctx: BlockBuilder, grad: Expr, target: Expr, call: Call) -> Expr:
    """Sum `grad` down to the shape of `target` where `target` was broadcast."""
    grad = ctx.normalize(grad)
    if _shape(grad, call) == _shape(target, call):
        return grad
    return R.collapse_sum_to(grad, target.ty.shape)


def _keep_reduced_dims(grad: Expr, axes: list[int], keepdims: bool, ndim: int) -> Expr:
    """Re-insert reduced axes (as size 1) into the gradient of a reduction."""
    if keepdims:
        return grad
    if len(axes) == ndim:
        return R.reshape(grad, [1] * ndim)
    return R.expand_dims(grad, axes)


##################### Elementwise #####################


def erf_grad(orig_var, orig_call, output_grad, ctx):
    """d erf(x) = 2 / sqrt(pi) * exp(-x^2)."""
    x = orig_call.args[0]
    return [output_grad * _const(2.0 / math.sqrt(math.pi), x) * R.exp(-(x * x))]


def rsqrt_grad(orig_var, orig_call, output_grad, ctx):
    """y = x^-1/2, dy/dx = -y^3 / 2."""
    return [output_grad * _const(-0.5, orig_var) * orig_var * orig_var * orig_var]


def square_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [output_grad * _const(2.0, x) * x]


def tan_grad(orig_var, orig_call, output_grad, ctx):
    return [output_grad * (_const(1.0, orig_var) + orig_var * orig_var)]


def asin_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [output_grad * R.rsqrt(_const(1.0, x) - x * x)]


def acos_grad(orig_var, orig_call, output_grad, ctx):
    """acos(x) = pi/2 - asin(x)."""
    return [R.negative(g) for g in asin_grad(orig_var, orig_call, output_grad, ctx)]


def asinh_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [output_grad * R.rsqrt(x * x + _const(1.0, x))]


def acosh_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [output_grad * R.rsqrt(x * x - _const(1.0, x))]


def atanh_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    return [output_grad / (_const(1.0, x) - x * x)]


def sinh_grad(orig_var, orig_call, output_grad, ctx):
    return [output_grad * R.cosh(orig_call.args[0])]


def cosh_grad(orig_var, orig_call, output_grad, ctx):
    return [output_grad * R.sinh(orig_call.args[0])]


def _remainder_grad(rounding: Callable) -> GradientRule:
    """``a - rounding(a / b) * b`` (``floor_mod``: torch's ``remainder``; ``mod``: ``fmod``), the
    rounded quotient piecewise constant: da = dy, db = -rounding(a / b) dy.  Integer operands (index
    arithmetic) take no gradient."""

    def rule(orig_var, orig_call, output_grad, ctx):
        a, b = orig_call.args
        if not str(dtype_of(orig_var)).startswith(("float", "bfloat")):
            return _no_grads(orig_call)
        quotient = rounding(R.divide(a, b))
        return [_fit(ctx, output_grad, a, orig_call), _fit(ctx, R.negative(output_grad * quotient), b, orig_call)]

    return rule


def atan2_grad(orig_var, orig_call, output_grad, ctx):
    """atan2(a, b): da = b / (a^2 + b^2), db = -a / (a^2 + b^2)."""
    a, b = orig_call.args
    scale = output_grad / (a * a + b * b)
    return [_fit(ctx, scale * b, a, orig_call), _fit(ctx, R.negative(scale * a), b, orig_call)]


def gelu_grad(orig_var, orig_call, output_grad, ctx):
    """y = x/2 (1 + erf(x/sqrt2)); dy/dx = (1 + erf(x/sqrt2))/2 + x exp(-x^2/2)/sqrt(2 pi)."""
    x = orig_call.args[0]
    cdf = _const(0.5, x) * (_const(1.0, x) + R.erf(x * _const(math.sqrt(0.5), x)))
    pdf = R.exp(x * x * _const(-0.5, x)) * _const(1.0 / math.sqrt(2.0 * math.pi), x)
    return [output_grad * (cdf + x * pdf)]


def gelu_tanh_grad(orig_var, orig_call, output_grad, ctx):
    """y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)."""
    x = orig_call.args[0]
    c, a = math.sqrt(2.0 / math.pi), 0.044715
    t = R.tanh(_const(c, x) * x * (_const(1.0, x) + _const(a, x) * x * x))
    one = _const(1.0, x)
    du = _const(c, x) * (one + _const(3.0 * a, x) * x * x)
    # the derivative as one factor (codegen's FoldActivationGradient folds it into one node)
    return [output_grad * (_const(0.5, x) * (one + t + x * (one - t * t) * du))]


def relu_grad(orig_var, orig_call, output_grad, ctx):
    """Pass the gradient where relu's *output* is positive (torch's ``threshold_backward``: 0 at
    x = 0).  TVM's rule masks with the input ``x < 0`` instead, which keeps ``x`` alive until the
    backward pass beside the output the next layer saves anyway: then ``x`` has two readers and
    ``FuseOps`` cannot put the relu into the kernel that computes ``x`` (ResNet-50's stage ran four
    standalone relu passes over 100352x512 tensors, 0.27 ms a step)."""
    zero = _const(0.0, orig_var)
    return [R.where(R.greater(orig_var, zero), output_grad, zero)]


def leakyrelu_grad(orig_var, orig_call, output_grad, ctx):
    x = orig_call.args[0]
    alpha = float(orig_call.attrs.alpha)
    return [R.where(R.greater(x, _const(0.0, x)), output_grad, output_grad * _const(alpha, x))]


def softplus_grad(orig_var, orig_call, output_grad, ctx):
    """torch semantics: sigmoid(beta x) below the threshold, 1 above it."""
    x = orig_call.args[0]
    beta, threshold = float(orig_call.attrs.beta), float(orig_call.attrs.threshold)
    bx = x * _const(beta, x)
    return [R.where(R.greater(bx, _const(threshold, x)), output_grad, output_grad * R.sigmoid(bx))]


def where_grad(orig_var, orig_call, output_grad, ctx):
    """``where(cond, a, b)``: the output gradient where `cond` holds to `a`, elsewhere to `b`, each
    summed down to its operand's shape where the operand was broadcast (TVM's rule returns the
    output's shape: T5's position bias [1, H, q, k] under its [B, 1, 1, k] key mask)."""
    cond, a, b = orig_call.args
    zero = _const(0.0, output_grad)  # the gradient's dtype (float32 under a bf16 operand in a mixed step)
    to_a = R.where(cond, output_grad, zero)
    to_b = R.where(cond, zero, output_grad)
    return [no_grad(cond), _fit(ctx, to_a, a, orig_call), _fit(ctx, to_b, b, orig_call)]


def clip_grad(orig_var, orig_call, output_grad, ctx):
    """Pass the gradient where min <= x <= max (torch.clamp)."""
    x, lo, hi = orig_call.args
    inside = R.logical_and(
        R.greater_equal(x, _const(float(_scalar(lo)), x)), R.less_equal(x, _const(float(_scalar(hi)), x))
    )
    return [R.where(inside, output_grad, _const(0.0, x)), no_grad(lo), no_grad(hi)]


##################### Reductions #####################


def max_min_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient split evenly over the positions equal to the extremum (torch.amax / amin)."""
    x = orig_call.args[0]
    ndim = len(_shape(x, orig_call))
    axes = _norm_axes(orig_call.attrs.axis, ndim)
    keepdims = bool(orig_call.attrs.keepdims)
    y = _keep_reduced_dims(orig_var, axes, keepdims, ndim)
    grad = _keep_reduced_dims(output_grad, axes, keepdims, ndim)
    hit = R.astype(R.equal(x, y), dtype_of(x))
    count = R.sum(hit, axes, keepdims=True)
    return [hit * grad / count]


##################### Normalization #####################


def _normalize_backward(grad, x, scale, axes, epsilon, xhat=None):
    """dx and xhat for y = xhat * scale, xhat = (x - mean) * rsqrt(var + eps) over `axes`; `xhat`
    given (the forward's own value) is read instead of recomputed from x."""
    mean = R.mean(x, axes, keepdims=True)
    centered = x - mean
    rstd = R.rsqrt(R.mean(centered * centered, axes, keepdims=True) + _const(epsilon, x))
    xhat = centered * rstd if xhat is None else xhat
    gy = grad * scale if scale is not None else grad
    dx = rstd * (gy - R.mean(gy, axes, keepdims=True) - xhat * R.mean(gy * xhat, axes, keepdims=True))
    return dx, xhat


def _param_grad(value: Expr, param: Expr, keep_axes: list[int], ndim: int, call: Call) -> Expr:
    """Sum `value` over all axes but `keep_axes` and reshape to the parameter's shape."""
    reduce_axes = [a for a in range(ndim) if a not in keep_axes]
    summed = R.sum(value, reduce_axes) if reduce_axes else value
    return R.reshape(summed, _shape(param, call))


def layer_norm_grad(orig_var, orig_call, output_grad, ctx):
    x, gamma, beta = orig_call.args
    shape = _shape(x, orig_call)
    ndim = len(shape)
    axes = _norm_axes(orig_call.attrs.axes, ndim)
    bshape = [shape[a] if a in axes else 1 for a in range(ndim)]
    scale = R.reshape(gamma, bshape) if orig_call.attrs.scale else None
    # affine-free, the output is xhat itself (FoldNormAffine's layer norms): the gradient reads it,
    # and rstd, instead of recomputing xhat from x, so x need not outlive the forward
    # (SaveNormalizedLowPrecision then reads the bf16 copy the next GEMM reads)
    affine_free = not (orig_call.attrs.scale or orig_call.attrs.center)
    dx, xhat = _normalize_backward(output_grad, x, scale, axes, float(orig_call.attrs.epsilon),
                                   xhat=orig_var if affine_free else None)
    dgamma = (
        _param_grad(output_grad * xhat, gamma, axes, ndim, orig_call)
        if orig_call.attrs.scale
        else no_grad(gamma)
    )
    dbeta = (
        _param_grad(output_grad, beta, axes, ndim, orig_call)
        if orig_call.attrs.center
        else no_grad(beta)
    )
    return [dx, dgamma, dbeta]


def rms_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = x * r * w, r = rsqrt(mean(x^2) + eps): dx = r (g w - xhat mean(g w xhat))."""
    x, weight = orig_call.args
    shape = _shape(x, orig_call)
    ndim = len(shape)
    axes = _norm_axes(orig_call.attrs.axes, ndim)
    bshape = [shape[a] if a in axes else 1 for a in range(ndim)]
    rstd = R.rsqrt(R.mean(x * x, axes, keepdims=True) + _const(float(orig_call.attrs.epsilon), x))
    xhat = x * rstd
    gw = output_grad * R.reshape(weight, bshape)
    dx = rstd * (gw - xhat * R.mean(gw * xhat, axes, keepdims=True))
    return [dx, _param_grad(output_grad * xhat, weight, axes, ndim, orig_call)]


def _affine_attrs(call: Call):
    """The attributes of a group or instance norm whose gamma and beta apply: TVM's legalization of
    both applies them whatever ``scale`` and ``center`` say, so a gradient that honoured those would
    not be the gradient of what runs (TVM's importer always sets both, with ones and zeros where the
    module has no affine parameters)."""
    if not (call.attrs.scale and call.attrs.center):
        raise _fail(call, "scale=False or center=False: TVM's legalization applies gamma and beta regardless")
    return call.attrs


def instance_norm_grad(orig_var, orig_call, output_grad, ctx):
    """y = xhat * gamma + beta, xhat normalized over ``axes``, gamma and beta along ``channel_axis``:
    InstanceNorm, and a training-mode BatchNorm without running statistics (its ``axes`` take the
    batch too), as TVM's importer writes them."""
    x, gamma, beta = orig_call.args
    attrs = _affine_attrs(orig_call)
    shape = _shape(x, orig_call)
    ndim = len(shape)
    axes, channel = _norm_axes(attrs.axes, ndim), int(attrs.channel_axis) % ndim
    bshape = [shape[a] if a == channel else 1 for a in range(ndim)]
    dx, xhat = _normalize_backward(output_grad, x, R.reshape(gamma, bshape), axes, float(attrs.epsilon))
    return [dx, _param_grad(output_grad * xhat, gamma, [channel], ndim, orig_call),
            _param_grad(output_grad, beta, [channel], ndim, orig_call)]


def group_norm_grad(orig_var, orig_call, output_grad, ctx):
    """GroupNorm: the channel axis split into (groups, channels of a group), each group normalized
    over its channels and ``axes``; gamma and beta per channel.  The layer norm's gradient on that
    view, reshaped back."""
    x, gamma, beta = orig_call.args
    attrs = _affine_attrs(orig_call)
    shape = _shape(x, orig_call)
    ndim = len(shape)
    channel, groups = int(attrs.channel_axis) % ndim, int(attrs.num_groups)
    if shape[channel] % groups:
        raise _fail(orig_call, f"{shape[channel]} channels in {groups} groups")
    view, axes = group_norm_view(shape, channel, groups, _norm_axes(attrs.axes, ndim))
    bshape = [d if a in (channel, channel + 1) else 1 for a, d in enumerate(view)]
    dy = R.reshape(output_grad, view)
    dx, xhat = _normalize_backward(dy, R.reshape(x, view), R.reshape(gamma, bshape), axes, float(attrs.epsilon))
    keep = [channel, channel + 1]
    return [R.reshape(dx, shape), _param_grad(dy * xhat, gamma, keep, ndim + 1, orig_call),
            _param_grad(dy, beta, keep, ndim + 1, orig_call)]


def batch_norm_grad(orig_var, orig_call, output_grad, ctx):
    """Gradient w.r.t. data, gamma and beta through the normalized output (tuple field 0).

    Training mode normalizes with the batch statistics; the running-statistics outputs are
    buffers and carry no gradient. Inference mode normalizes with the moving statistics.
    """
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    attrs = orig_call.attrs
    shape = _shape(x, orig_call)
    ndim = len(shape)
    axis = int(attrs.axis) % ndim
    reduce_axes = [a for a in range(ndim) if a != axis]
    bshape = [shape[a] if a == axis else 1 for a in range(ndim)]
    grad = relax.TupleGetItem(output_grad, 0)
    scale = R.reshape(gamma, bshape) if attrs.scale else None
    if attrs.training:
        dx, xhat = _normalize_backward(grad, x, scale, reduce_axes, float(attrs.epsilon))
    else:
        rstd = R.rsqrt(R.reshape(moving_var, bshape) + _const(float(attrs.epsilon), x))
        xhat = (x - R.reshape(moving_mean, bshape)) * rstd
        dx = grad * rstd * scale if scale is not None else grad * rstd
    dgamma = _param_grad(grad * xhat, gamma, [axis], ndim, orig_call) if attrs.scale else no_grad(gamma)
    dbeta = _param_grad(grad, beta, [axis], ndim, orig_call) if attrs.center else no_grad(beta)
    return [dx, dgamma, dbeta, no_grad(moving_mean), no_grad(moving_var)]


def dropout_grad(orig_var, orig_call, output_grad, ctx):
    """out = x * mask / (1 - rate), mask the 0/1 keep mask (tuple field 1): dx = g * mask / (1 - rate).

    TVM's default legalization of relax.nn.dropout is the inference identity (mask of ones,
    no scaling); a training lowering must realize the documented semantics above.
    """
    x = orig_call.args[0]
    rate = float(orig_call.attrs.rate)
    keep_scale = 1.0 / (1.0 - rate) if rate < 1.0 else 0.0
    grad = relax.TupleGetItem(output_grad, 0)
    mask = relax.TupleGetItem(orig_var, 1)
    return [grad * R.astype(mask, dtype_of(x)) * _const(keep_scale, x)]


##################### Attention #####################


def attention_grad(orig_var, orig_call, output_grad, ctx):
    """relax.nn.attention / attention_bias over [batch, seq, head, dim] (BSNH) tensors.

    Recomputes the probabilities s = softmax(mask(q k^T * scale + bias)); with do in BNSH:
    dv = s^T do, dp = s * (do v^T - rowsum(do v^T * s)), dq = dp k * scale, dk = dp^T q * scale.
    """
    attrs = orig_call.attrs
    if attrs.window_size is not None:
        raise _fail(orig_call, "sliding-window attention is not supported")
    q, k, v = orig_call.args[:3]
    bias = orig_call.args[3] if len(orig_call.args) > 3 else None
    _, seq, _, head_dim = _shape(q, orig_call)
    seq_kv = _shape(k, orig_call)[1]
    scale = float(attrs.scale) if attrs.scale is not None else 1.0 / math.sqrt(head_dim)

    def bnsh(t):
        return R.permute_dims(t, [0, 2, 1, 3])

    def t_last(t):
        return R.permute_dims(t, [0, 1, 3, 2])

    qt, kt, vt, dout = bnsh(q), bnsh(k), bnsh(v), bnsh(output_grad)
    scores = R.matmul(qt, t_last(kt)) * _const(scale, q)
    if bias is not None:
        scores = scores + bias
    if attrs.causal_mask is not None:
        if attrs.causal_mask == "TopLeft":
            offset = 0
        elif attrs.causal_mask == "BottomRight":
            offset = abs(seq - seq_kv)
        else:
            raise _fail(orig_call, f"unknown causal_mask {attrs.causal_mask!r}")
        keep = np.tril(np.ones((seq, seq_kv), dtype=bool), k=offset)
        lowest = _lowest(dtype_of(q))
        scores = R.where(relax.const(keep, "bool"), scores, _const(lowest, q))
    probs = ctx.normalize(R.nn.softmax(scores, axis=-1))
    dprobs = R.matmul(dout, t_last(vt))
    dscores = ctx.normalize(probs * (dprobs - R.sum(dprobs * probs, [-1], keepdims=True)))
    dq = R.matmul(dscores, kt) * _const(scale, q)
    dk = R.matmul(t_last(dscores), qt) * _const(scale, q)
    dv = R.matmul(t_last(probs), dout)
    grads = [bnsh(dq), bnsh(dk), bnsh(dv)]
    if bias is not None:
        grads.append(_fit(ctx, dscores, bias, orig_call))
    return grads


##################### Manipulation #####################


def reshape_like_input_grad(orig_var, orig_call, output_grad, ctx):
    """squeeze / flatten: reshape the gradient back to the input shape."""
    x = orig_call.args[0]
    return _with_no_grads(orig_call, R.reshape(output_grad, _shape(x, orig_call)))


def tile_grad(orig_var, orig_call, output_grad, ctx):
    """View the output as interleaved (repeat_i, dim_i) pairs and sum the repeat axes."""
    x = orig_call.args[0]
    shape = _shape(x, orig_call)
    repeats = [int(r) for r in orig_call.attrs.repeats]
    rank = max(len(shape), len(repeats))
    shape_p = [1] * (rank - len(shape)) + shape
    repeats_p = [1] * (rank - len(repeats)) + repeats
    pairs = [d for r, s in zip(repeats_p, shape_p) for d in (r, s)]
    summed = R.sum(R.reshape(output_grad, pairs), list(range(0, 2 * rank, 2)))
    return [R.reshape(summed, shape)]


def repeat_grad(orig_var, orig_call, output_grad, ctx):
    """repeat_interleave: split each axis element into (dim, repeats) and sum the repeats."""
    x = orig_call.args[0]
    shape = _shape(x, orig_call)
    repeats = int(orig_call.attrs.repeats)
    if orig_call.attrs.axis is None:
        summed = R.sum(R.reshape(output_grad, [_prod(shape), repeats]), [1])
        return [R.reshape(summed, shape)]
    axis = int(orig_call.attrs.axis) % len(shape)
    split = shape[: axis + 1] + [repeats] + shape[axis + 1 :]
    return [R.sum(R.reshape(output_grad, split), [axis + 1])]


def tril_triu_grad(orig_var, orig_call, output_grad, ctx):
    """tril/triu are masks: apply the same mask to the gradient."""
    fn = R.tril if _op_name(orig_call) == "relax.tril" else R.triu
    x, k = orig_call.args
    return [fn(output_grad, k), no_grad(k)]


def pad_grad(orig_var, orig_call, output_grad, ctx):
    """Constant padding: slice the input window out of the gradient."""
    attrs = orig_call.attrs
    if attrs.pad_mode != "constant":
        raise _fail(orig_call, f"pad_mode {attrs.pad_mode!r} is not supported")
    x = orig_call.args[0]
    shape = _shape(x, orig_call)
    widths = [int(w) for w in attrs.pad_width]
    before = widths[0::2]
    if any(w < 0 for w in widths):
        raise _fail(orig_call, "negative pad widths are not supported")
    axes = list(range(len(shape)))
    end = [b + d for b, d in zip(before, shape)]
    return _with_no_grads(orig_call, R.strided_slice(output_grad, axes, before, end))


def _scatter_axis(grad: Expr, axis: int, begin: int, stride: int, size: int, call: Call, ctx) -> Expr:
    """Place `grad` (n entries on `axis`) at positions begin + i * stride of a zero axis of `size`."""
    grad = ctx.normalize(grad)
    shape = _shape(grad, call)
    n = shape[axis]
    if n == 0:
        return R.zeros([size if a == axis else d for a, d in enumerate(shape)], dtype_of(grad))
    if stride < 0:
        grad = R.flip(grad, axis)
        begin, stride = begin + (n - 1) * stride, -stride
    if stride > 1:
        pad_width = [0] * (2 * (len(shape) + 1))
        pad_width[2 * (axis + 1) + 1] = stride - 1
        spread = R.nn.pad(R.expand_dims(grad, axis + 1), pad_width)
        merged = shape[:axis] + [n * stride] + shape[axis + 1 :]
        grad = R.strided_slice(R.reshape(spread, merged), [axis], [0], [(n - 1) * stride + 1])
    pad_width = [0] * (2 * len(shape))
    pad_width[2 * axis] = begin
    pad_width[2 * axis + 1] = size - begin - ((n - 1) * stride + 1)
    return R.nn.pad(grad, pad_width)


def strided_slice_grad(orig_var, orig_call, output_grad, ctx):
    """Scatter the gradient back axis by axis (zero-interleave for strides, pad for offsets).

    The output length of each sliced axis is read from the output shape, so only `begin` needs
    normalizing (negative wrap and clamping as in the forward op).
    """
    x, axes, begin = orig_call.args[:3]
    strides = orig_call.args[4] if len(orig_call.args) > 4 else None
    shape = _shape(x, orig_call)
    ndim = len(shape)
    axes = [int(_scalar(a)) % ndim for a in axes]
    begin = [int(_scalar(b)) for b in begin]
    strides = [int(_scalar(s)) for s in strides] if strides is not None else [1] * len(axes)
    grad = output_grad
    for axis, start, stride in zip(axes, begin, strides):
        dim = shape[axis]
        start = start + dim if start < 0 else start
        start = min(max(start, 0), dim if stride > 0 else dim - 1)
        grad = _scatter_axis(grad, axis, start, stride, dim, orig_call, ctx)
    return _with_no_grads(orig_call, grad)


def flip_grad(orig_var, orig_call, output_grad, ctx):
    return [R.flip(output_grad, int(orig_call.attrs.axis))]


def slice_scatter_grad(orig_var, orig_call, output_grad, ctx):
    """``slice_scatter(x, src, start, end, step, axis)`` (a circular convolution's padding): the
    gradient of `x` is `output_grad` with the slice zeroed, that of `src` the slice itself."""
    x, src, start, end, step = orig_call.args
    axis = int(orig_call.attrs.axis)
    bounds = [int(_scalar(v)) for v in (start, end, step)]
    zeros = R.zeros(src.ty.shape, src.ty.dtype)
    return [R.slice_scatter(output_grad, zeros, *bounds, axis=axis),
            R.strided_slice(output_grad, [axis], [bounds[0]], [bounds[1]], [bounds[2]]),
            no_grad(start), no_grad(end), no_grad(step)]


def gather_elements_grad(orig_var, orig_call, output_grad, ctx):
    x, indices = orig_call.args
    axis = int(orig_call.attrs.axis)
    dx = R.scatter_elements(R.zeros_like(x), indices, output_grad, axis, reduction="add")
    return [dx, no_grad(indices)]


def topk_grad(orig_var, orig_call, output_grad, ctx):
    """Scatter-add the gradient of the values into the selected positions."""
    x = orig_call.args[0]
    attrs = orig_call.attrs
    axis = int(attrs.axis)
    if attrs.ret_type == "both":
        grad = relax.TupleGetItem(output_grad, 0)
        indices = relax.TupleGetItem(orig_var, 1)
    elif attrs.ret_type == "values":
        grad = output_grad
        indices = R.topk(x, int(attrs.k), axis, "indices", bool(attrs.largest), str(attrs.dtype))
    else:
        return [no_grad(x)]
    return [R.scatter_elements(R.zeros_like(x), indices, grad, axis, reduction="add")]


def take_grad(orig_var, orig_call, output_grad, ctx):
    """Scatter-add into the table; indices of any rank (TVM's take_backward needs 1-D)."""
    x, indices = orig_call.args
    shape = _shape(x, orig_call)
    idx_shape = _shape(indices, orig_call)
    n = _prod(idx_shape)
    flat_indices = R.reshape(indices, [n])
    if orig_call.attrs.axis is None:
        grad = take_backward(R.reshape(output_grad, [n]), R.reshape(x, [_prod(shape)]), flat_indices, 0)
        return [R.reshape(grad, shape), no_grad(indices)]
    axis = int(orig_call.attrs.axis) % len(shape)
    grad = R.reshape(output_grad, shape[:axis] + [n] + shape[axis + 1 :])
    return [take_backward(grad, x, flat_indices, axis), no_grad(indices)]


##################### Convolution and pooling #####################


def _as_2d(ctx: BlockBuilder, t: Expr) -> Expr:
    return ctx.normalize(R.expand_dims(t, [2]))


def conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """NCHW/OIHW conv2d: dx = conv2d_transpose(g, w), dw = conv2d(x as CNHW, g as IOHW).

    TVM's own rule derives conv2d_transpose's output_padding from the undilated kernel extent,
    which is wrong (and rejected) for dilation > 1; here the extent is (k - 1) * dilation + 1.
    """
    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "OIHW", "NCHW"):
        raise _fail(orig_call, "only NCHW data / OIHW kernel layouts are supported")
    data, weight = orig_call.args
    batch, in_channel, *in_size = _shape(data, orig_call)
    out_channel, _, *kernel = _shape(weight, orig_call)
    out_size = _shape(orig_var, orig_call)[2:]
    strides = [int(v) for v in attrs.strides]
    dilation = [int(v) for v in attrs.dilation]
    padding = [int(v) for v in attrs.padding]  # top, left, bottom, right
    groups = int(attrs.groups)
    out_dtype = attrs.out_dtype if str(attrs.out_dtype) else None

    output_padding = [
        n - ((o - 1) * s - padding[i] - padding[i + 2] + (k - 1) * d + 1)
        for i, (n, o, s, k, d) in enumerate(zip(in_size, out_size, strides, kernel, dilation))
    ]
    data_grad = R.nn.conv2d_transpose(
        output_grad, weight, strides, padding, output_padding, dilation, groups,
        "NCHW", "IOHW", "NCHW", out_dtype,
    )

    if groups != 1:
        data = R.reshape(data, [batch, groups, in_channel // groups] + in_size)
        data = R.permute_dims(data, [1, 0, 2, 3, 4])
        data = R.reshape(data, [batch * groups, in_channel // groups] + in_size)
    weight_grad = ctx.normalize(
        R.nn.conv2d(
            data, output_grad, strides=dilation, padding=padding, dilation=strides,
            groups=groups, data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW",
            out_dtype=out_dtype,
        )
    )
    if _shape(weight_grad, orig_call)[2:] != kernel:
        weight_grad = R.strided_slice(weight_grad, [2, 3], [0, 0], kernel)
    return [data_grad, weight_grad]


def conv2d_transpose_grad(orig_var, orig_call, output_grad, ctx):
    """NCHW/IOHW conv2d_transpose (``nn.ConvTranspose2d``) is the input gradient of the conv2d
    with the same weight (read as OIHW), stride, padding, dilation and groups: its input gradient
    is that conv2d of `output_grad`, and its weight gradient that conv2d's weight gradient with
    `output_grad` as its input and the transposed convolution's input as its output gradient."""
    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCHW", "IOHW", "NCHW"):
        raise _fail(orig_call, "only NCHW data / IOHW kernel layouts are supported")
    data, weight = orig_call.args
    out_dtype = attrs.out_dtype if str(attrs.out_dtype) else None
    conv = ctx.normalize(R.nn.conv2d(
        output_grad, weight, [int(v) for v in attrs.strides], [int(v) for v in attrs.padding],
        [int(v) for v in attrs.dilation], int(attrs.groups), out_dtype=out_dtype))
    if _shape(conv, orig_call) != _shape(data, orig_call):
        raise _fail(orig_call, f"the adjoint convolution gives {_shape(conv, orig_call)}, not the input's "
                    f"{_shape(data, orig_call)}")
    _, weight_grad = conv2d_grad(relax.Var("conv2d_transpose_input", data.ty), conv, data, ctx)
    return [conv, weight_grad]


def conv1d_grad(orig_var, orig_call, output_grad, ctx):
    """NCW/OIW conv1d as a conv2d of height 1."""
    attrs = orig_call.attrs
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
        raise _fail(orig_call, "only NCW data / OIW kernel layouts are supported")
    data, weight = orig_call.args
    pad_l, pad_r = (int(p) for p in attrs.padding)
    call_2d = ctx.normalize(
        R.nn.conv2d(
            _as_2d(ctx, data),
            _as_2d(ctx, weight),
            strides=(1, int(attrs.strides[0])),
            padding=(0, pad_l, 0, pad_r),
            dilation=(1, int(attrs.dilation[0])),
            groups=int(attrs.groups),
            out_dtype=attrs.out_dtype if str(attrs.out_dtype) else None,
        )
    )
    out_2d = relax.Var("conv1d_as_2d", call_2d.ty)  # only its shape is read
    ddata, dweight = conv2d_grad(out_2d, call_2d, _as_2d(ctx, output_grad), ctx)
    return [R.squeeze(ddata, [2]), R.squeeze(dweight, [2])]


def _avg_pool_divisor(size, out, kernel, stride, pad_before, pad_after, include_pad) -> np.ndarray:
    """Per-output divisor along one axis, as torch's avg_pool computes it."""
    div = np.zeros(out)
    for o in range(out):
        start = o * stride - pad_before
        end = min(start + kernel, size + pad_after)
        div[o] = end - start if include_pad else min(end, size) - max(start, 0)
    return div


def _tiled_max_pool_grad(x: Expr, grad: Expr, spatial: list[int], kernel: list[int],
                         in_shape: list[int], out_shape: list[int]) -> Expr:
    """Max pooling whose windows tile the input (kernel = stride, no padding or dilation), as one
    argmax over each window: the gradient goes to the window's first maximum, as torch routes it.

    Each spatial axis of length ``o * k`` is split into ``(o, k)`` (unit ``k`` dropped), the window
    axes moved last and flattened to one axis of ``prod(kernel)``; the non-window axes are then
    exactly the output's.  A few kernels whatever the window size, where the general rule below
    emits some per kernel offset (XML-CNN's adaptive pooling of 499 positions into 8 windows of 63
    made ~500 kernels of it).
    """
    split, window_axes = [], []
    for a, n in enumerate(in_shape):
        if a in spatial and kernel[spatial.index(a)] > 1:
            k = kernel[spatial.index(a)]
            split += [n // k, k]
            window_axes.append(len(split) - 1)
        else:
            split.append(n)
    perm = [a for a in range(len(split)) if a not in window_axes] + window_axes
    inverse = [perm.index(a) for a in range(len(split))]
    size = _prod(kernel)
    windows = R.reshape(x, split)
    if perm != sorted(perm):
        windows = R.permute_dims(windows, perm)
    windows = R.reshape(windows, [*out_shape, size])
    if dtype_of(x) in ("bfloat16", "float16"):  # exact; TVM 0.27's llvm build fails a bf16 argmax
        windows = R.astype(windows, "float32")
    first = R.argmax(windows, axis=-1, keepdims=True)
    at_first = R.equal(first, relax.const(np.arange(size, dtype="int64")))
    routed = R.where(at_first, R.reshape(grad, [*out_shape, 1]), _const(0.0, x))
    routed = R.reshape(routed, [split[a] for a in perm])
    if perm != sorted(perm):
        routed = R.permute_dims(routed, inverse)
    return R.reshape(routed, in_shape)


def _pool_grad(kind: str) -> GradientRule:
    """max/avg pooling of any rank, written as one strided window per kernel offset (max pooling
    over windows that tile the input: one argmax, ``_tiled_max_pool_grad``; any other 2-D max
    pooling: ``tvm_evt.max_pool2d_backward``, two gathers).

    For kernel offset r the window values are xw_r = x_padded[r*dilation :: stride]. Max pooling
    routes the gradient to the first offset (in scan order, as torch does) whose value equals the
    output; average pooling spreads g / divisor. Each offset's contribution is scattered back with
    zero-interleave + pad, and the padding is cropped. Replaces TOPI's pool_grad, which drops
    gradient when windows do not tile the input exactly (ceil_mode, trailing elements) and
    ignores dilation.
    """

    def rule(orig_var, orig_call, output_grad, ctx):
        attrs = orig_call.attrs
        layout = str(attrs.layout)
        if str(attrs.out_layout) != layout:
            raise _fail(orig_call, "differing layout and out_layout are not supported")
        x = orig_call.args[0]
        in_shape, out_shape = _shape(x, orig_call), _shape(orig_var, orig_call)
        spatial = [a for a, letter in enumerate(layout) if letter in "DHW"]
        nd = len(spatial)
        kernel = [int(k) for k in attrs.pool_size]
        strides = [int(s) for s in attrs.strides]
        dilation = [int(d) for d in attrs.dilation]
        padding = [int(p) for p in attrs.padding]
        before, after = padding[:nd], padding[nd:]
        sizes = [in_shape[a] for a in spatial]
        outs = [out_shape[a] for a in spatial]
        canvas = [
            max(b + n, (o - 1) * s + (k - 1) * d + 1)
            for b, n, o, s, k, d in zip(before, sizes, outs, strides, kernel, dilation)
        ]
        pad_width = [0] * (2 * len(in_shape))
        for a, b, n, c in zip(spatial, before, sizes, canvas):
            pad_width[2 * a], pad_width[2 * a + 1] = b, c - b - n

        if kind == "max" and not any(padding) and all(d == 1 for d in dilation) and kernel == strides \
                and all(n == o * k for n, o, k in zip(sizes, outs, kernel)):
            return [_tiled_max_pool_grad(x, output_grad, spatial, kernel, in_shape, out_shape)]
        if kind == "max" and orig_call.op.name == "relax.nn.max_pool2d":
            from ..ops import max_pool_op  # registers the op; ops/ imports this module

            window = max_pool_op.applies(layout, kernel, strides, padding, dilation)
            if window is not None:
                dy = output_grad if dtype_of(output_grad) == dtype_of(x) else R.astype(output_grad, dtype_of(x))
                return [max_pool_op.max_pool2d_backward(ctx.normalize(dy), x, orig_var, window)]
        if kind == "max":
            lowest = _lowest(dtype_of(x))
            x_padded = ctx.normalize(R.nn.pad(x, pad_width, "constant", lowest))
        else:
            if any(d != 1 for d in dilation):
                raise _fail(orig_call, "dilation is not supported for average pooling")
            divisor = functools.reduce(
                np.multiply.outer,
                [
                    _avg_pool_divisor(n, o, k, s, b, p, bool(attrs.count_include_pad))
                    for n, o, k, s, b, p in zip(sizes, outs, kernel, strides, before, after)
                ],
            )
            bshape = [1] * len(in_shape)
            for a, o in zip(spatial, outs):
                bshape[a] = o
            spread = output_grad * relax.const((1.0 / divisor).reshape(bshape).astype(dtype_of(x)))

        total, taken = None, None
        for offset in itertools.product(*[range(k) for k in kernel]):
            begin = [r * d for r, d in zip(offset, dilation)]
            if kind == "max":
                end = [b + (o - 1) * s + 1 for b, o, s in zip(begin, outs, strides)]
                window = R.strided_slice(x_padded, spatial, begin, end, strides)
                hit = R.astype(R.equal(window, orig_var), dtype_of(x))
                if taken is not None:
                    hit = hit * (_const(1.0, x) - taken)
                hit = ctx.normalize(hit)
                taken = hit if taken is None else ctx.normalize(taken + hit)
                contribution = output_grad * hit
            else:
                contribution = spread
            for a, b, s, c in zip(spatial, begin, strides, canvas):
                contribution = _scatter_axis(contribution, a, b, s, c, orig_call, ctx)
            total = contribution if total is None else total + contribution
        end = [b + n for b, n in zip(before, sizes)]
        return [R.strided_slice(total, spatial, before, end)]

    return rule


def _adaptive_matrix(size_in: int, size_out: int) -> np.ndarray:
    """A[o, i] = 1 / |bin o| for i in bin o = [floor(o*in/out), ceil((o+1)*in/out))."""
    mat = np.zeros((size_out, size_in))
    for o in range(size_out):
        lo, hi = (o * size_in) // size_out, -((-(o + 1) * size_in) // size_out)
        mat[o, lo:hi] = 1.0 / (hi - lo)
    return mat


def adaptive_avg_pool_grad(orig_var, orig_call, output_grad, ctx):
    """Adaptive average pooling is linear per spatial axis: dx = A^T g along each axis."""
    attrs = orig_call.attrs
    if attrs.layout != attrs.out_layout:
        raise _fail(orig_call, "differing layout and out_layout are not supported")
    x = orig_call.args[0]
    in_shape, out_shape = _shape(x, orig_call), _shape(orig_var, orig_call)
    grad = output_grad
    ndim = len(in_shape)
    for axis, letter in enumerate(str(attrs.layout)):
        if letter not in "DHW" or in_shape[axis] == out_shape[axis]:
            continue  # not spatial, or identity bins
        mat = _adaptive_matrix(in_shape[axis], out_shape[axis]).astype(dtype_of(x))
        # move `axis` last, multiply by A (out x in), move back
        perm = [a for a in range(ndim) if a != axis] + [axis]
        inv = [perm.index(a) for a in range(ndim)]
        moved = R.matmul(R.permute_dims(grad, perm), relax.const(mat))
        grad = R.permute_dims(moved, inv)
    return [grad]


##################### Registration #####################

GRADIENT_RULES: dict[str, GradientRule] = {
    # elementwise
    "relax.erf": erf_grad,
    "relax.rsqrt": rsqrt_grad,
    "relax.square": square_grad,
    "relax.tan": tan_grad,
    "relax.asin": asin_grad,
    "relax.acos": acos_grad,
    "relax.asinh": asinh_grad,
    "relax.acosh": acosh_grad,
    "relax.atanh": atanh_grad,
    "relax.sinh": sinh_grad,
    "relax.cosh": cosh_grad,
    "relax.floor_mod": _remainder_grad(R.floor),
    "relax.mod": _remainder_grad(R.trunc),
    "relax.atan2": atan2_grad,
    "relax.clip": clip_grad,
    "relax.where": where_grad,
    "relax.nn.gelu": gelu_grad,
    "relax.nn.gelu_tanh": gelu_tanh_grad,
    "relax.nn.relu": relu_grad,
    "relax.nn.leakyrelu": leakyrelu_grad,
    "relax.nn.softplus": softplus_grad,
    # reductions
    "relax.max": max_min_grad,
    "relax.min": max_min_grad,
    # normalization, dropout, attention
    "relax.nn.layer_norm": layer_norm_grad,
    "relax.nn.rms_norm": rms_norm_grad,
    "relax.nn.batch_norm": batch_norm_grad,
    "relax.nn.instance_norm": instance_norm_grad,
    "relax.nn.group_norm": group_norm_grad,
    "relax.nn.dropout": dropout_grad,
    "relax.nn.attention": attention_grad,
    "relax.nn.attention_bias": attention_grad,
    # manipulation and indexing
    "relax.squeeze": reshape_like_input_grad,
    "relax.flatten": reshape_like_input_grad,
    "relax.tile": tile_grad,
    "relax.repeat": repeat_grad,
    "relax.tril": tril_triu_grad,
    "relax.triu": tril_triu_grad,
    "relax.nn.pad": pad_grad,
    "relax.strided_slice": strided_slice_grad,
    "relax.slice_scatter": slice_scatter_grad,
    "relax.flip": flip_grad,
    "relax.gather_elements": gather_elements_grad,
    "relax.topk": topk_grad,
    "relax.take": take_grad,
    # convolution and pooling
    "relax.nn.conv1d": conv1d_grad,
    "relax.nn.conv2d": conv2d_grad,
    "relax.nn.conv2d_transpose": conv2d_transpose_grad,
    "relax.nn.max_pool1d": _pool_grad("max"),
    "relax.nn.max_pool2d": _pool_grad("max"),
    "relax.nn.max_pool3d": _pool_grad("max"),
    "relax.nn.avg_pool1d": _pool_grad("avg"),
    "relax.nn.avg_pool2d": _pool_grad("avg"),
    "relax.nn.avg_pool3d": _pool_grad("avg"),
    "relax.nn.adaptive_avg_pool1d": adaptive_avg_pool_grad,
    "relax.nn.adaptive_avg_pool2d": adaptive_avg_pool_grad,
    "relax.nn.adaptive_avg_pool3d": adaptive_avg_pool_grad,
}

NO_GRAD_OPS: tuple[str, ...] = (
    "relax.arange",
    "relax.argmax",
    "relax.argmin",
    "relax.logical_and",
    "relax.logical_or",
    "relax.logical_xor",
    "relax.logical_not",
    "relax.isnan",
    "relax.isinf",
    "relax.isfinite",
    "relax.sign",
    "relax.floor",
    "relax.ceil",
    "relax.round",
    "relax.trunc",
    "relax.floor_divide",  # piecewise constant, as torch's div(rounding_mode="floor") differentiates it
    "relax.one_hot",
    "relax.grad.no_grad",  # a value read as a constant (an embedding's padding positions)
    "relax.bitwise_not",  # integer and boolean masks (cross-entropy's ignore_index with label smoothing)
    "relax.bitwise_and",
    "relax.bitwise_or",
    "relax.bitwise_xor",
    "relax.left_shift",
    "relax.right_shift",
)
"""Ops whose outputs are integer/boolean or piecewise constant: no gradient flows to inputs."""


def _set_attr(op: Op, key: str, value, level: int = 10) -> None:
    if op.has_attr(key):  # a reload of the defining module: replace, not stack
        op.reset_attr(key)
    op.set_attr(key, value, level)


def register_op(name: str, description: str, infer: Callable, legalize: Callable,
                gradient: GradientRule | None = None) -> Op:
    """Register one of our own Relax ops (``tvm_evt.*``): pure, printed as ``T.<name>``, its type
    inferred by `infer`, lowered by `legalize`, differentiated by `gradient` at `RULE_LEVEL`.
    Registering again (a module reload) replaces the attributes."""
    if name not in set(Op.list_op_names()):
        tvm_ffi.get_global_func("ir.RegisterOp")(name, description)
    op = Op.get(name)
    _set_attr(op, "TScriptPrinterName", name)  # printed as T.<name>(...), without the printer's warning
    _set_attr(op, "FInferType", infer)
    _set_attr(op, "FPurity", True)
    _set_attr(op, "FLegalize", legalize)
    if gradient is not None:
        _set_attr(op, "FPrimalGradient", gradient, RULE_LEVEL)
    return op


def _no_grad_rule(orig_var, orig_call, output_grad, ctx):
    return _no_grads(orig_call)


def _register_all() -> None:
    for name, rule in GRADIENT_RULES.items():
        register_gradient(name, rule, level=RULE_LEVEL)
    for name in NO_GRAD_OPS:
        register_gradient(name, _no_grad_rule, level=RULE_LEVEL)


_register_all()
