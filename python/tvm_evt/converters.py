"""Training-mode fixes for TVM 0.27's ``torch.export`` importer.

Pass :data:`CONVERT_MAP` as ``custom_convert_map`` to
``tvm.relax.frontend.torch.from_exported_program`` when importing a model exported with
``model.train()``. Each converter has the custom-converter signature
``fn(node: torch.fx.Node, importer) -> relax.Expr`` and reads its operands from ``importer.env``.

What the stock importer gets wrong, and what the converters here emit instead:

* **Dropout is the identity.** ``native_dropout``, ``dropout`` and ``dropout_`` become
  ``relax.op.nn.dropout(x, rate)`` (a later pass lowers it to a Philox RNG mask).
  ``feature_dropout``, ``alpha_dropout`` and ``feature_alpha_dropout``, which only survive with
  ``run_ep_decomposition=False``, keep their own semantics (per-channel mask, SELU-preserving
  affine correction) with the random mask drawn by ``relax.op.nn.dropout``. With the default
  decomposition those three become ``bernoulli.p(empty, 1 - p)``, which the stock importer maps to
  the identity of an uninitialised tensor; ``bernoulli.p`` here draws the mask the same way.
  Dropout with ``p == 0`` or ``train=False`` is the identity and emits no ``relax.nn.dropout``.
* **Training-mode BatchNorm.** ``_native_batch_norm_legit_functional`` comes back as
  ``(out, new_running_mean, 0, 0, 0)`` where torch has ``(out, save_mean, save_rstd,
  new_running_mean, new_running_var)``, so the running-stat outputs (indices 3 and 4) are zeros;
  ``relax.nn.batch_norm``'s own legalization would also update the running variance with the
  biased variance; and the undecomposed ``batch_norm.default`` is always imported in inference
  mode. Both are emitted here as explicit
  ``mean``/``variance``/``sqrt`` ops (all differentiable in Relax) that normalise with the batch
  statistics and return torch's five outputs ``(out, save_mean, save_rstd, new_running_mean,
  new_running_var)``, the running variance updated with Bessel's correction as torch does.
* **Missing pools.** ``adaptive_max_pool1d`` and ``adaptive_max_pool2d`` (XML-CNN's dynamic max
  pooling) become ``max_pool2d`` with kernel = stride = the window, preceded by a ``take`` that
  lays out the overlapping windows when the input length is not a multiple of the output length.
* **GroupNorm without affine parameters** fails to import (a null weight); here it gets ones and
  zeros, as the stock importer gives an instance norm.
* **detach is the identity**, so the gradient flows through ``x.detach()`` (and through a
  ``torch.no_grad()`` block, which ``run_decompositions`` inlines: ``frontend.detach_no_grad_blocks``
  detaches its outputs first).  Here it is ``relax.grad.no_grad``.
* **Upsampling** (``F.interpolate``, nearest, nearest-exact and bilinear) is a ``resize2d`` without
  a gradient rule, whose nearest mode also picks other rows than torch's for non-integer scales.
  Here it is ``take``s of constant rows and columns with torch's coordinates (bilinear: two a
  coordinate, weighted), whose gradient is a scatter-add.
* **hardtanh (ReLU6) is a clip**, whose gradient (torch.clamp's) reads the input.  Here it becomes
  ``tvm_evt.hardtanh``: the same values, torch's ``hardtanh_backward`` from the output.
* **addmm of 16-bit operands** (an ``nn.Linear`` in float16 or bfloat16) failed to import: the
  product in float32, the bias added in the operands' dtype.  Here both are in that dtype.
* **True division of integer tensors** (``a / b``) divides as integers, truncating.  Here the
  operands are cast to a float dtype first, as torch's result is.
* **Integer clamps with one bound** become a ``clip`` with an infinite other bound, which an
  integer legalization cannot cast.  Here they are ``maximum``/``minimum`` with integer constants.
* **Negative indices** of ``x[..., [-2], :]`` (``index.Tensor``) are read out of bounds by the
  ``take`` the stock importer emits.  Here they are counted from the end of their axis first.
* **SDPA with dropout or a custom scale** asserts (dropout) or ignores ``scale``.  Here it becomes
  one ``tvm_evt.attention`` call with all its arguments (masks built from constants read as the
  causal triangle or a key mask); only what that op cannot express is written out as
  ``matmul -> softmax -> dropout -> matmul``, with the reason kept for ``report()``.

How BatchNorm's buffer mutations appear: ``torch.export`` lists ``running_mean``,
``running_var`` and ``num_batches_tracked`` as ``BUFFER_MUTATION`` outputs, which in the graph are
``getitem(_native_batch_norm_legit_functional(...), 3)`` and ``(..., 4)`` and an ``add`` on the
counter. TVM's own ``from_exported_program`` binds every buffer as a constant (even with
``keep_params_as_input=True``) and keeps only ``USER_OUTPUT``/``LOSS_OUTPUT`` outputs, so its
``main`` returns just the loss and the new statistics are dead code; the loss is still exact
because training-mode BatchNorm never reads the running statistics.
``tvm_evt.frontend.import_exported_program`` instead keeps buffers as parameters and returns
the mutations after the loss, and then relies on indices 3 and 4 being right, as they are here.
:func:`buffer_mutations` lists the mutated buffers of an exported program in output order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import fx
from tvm import relax

from .errors import UnsupportedOpError, module_path

__all__ = ["CONVERT_MAP", "buffer_mutations"]

Converter = Callable[[fx.Node, object], object]

_SELU_ALPHA_SCALE = 1.7580993408473766  # SELU's alpha * scale, the fixed point alpha-dropout keeps


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _arg(node: fx.Node, index: int, name: str, default=None):
    """The ``index``-th argument of ``node``, or its keyword ``name``, or ``default``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _shape(x: relax.Expr) -> list[int]:
    return [int(s) for s in x.ty.shape.values]


def _dtype(x: relax.Expr) -> str:
    return str(x.ty.dtype)


def _const(value: float, like: relax.Expr) -> relax.Constant:
    return relax.const(value, _dtype(like))


def buffer_mutations(exported_program: torch.export.ExportedProgram) -> list[str]:
    """Names of the buffers the program mutates (``running_mean`` etc.), in output order.

    Only a functionalized program lists them: call it on ``ep.run_decompositions()``; the
    training IR that ``torch.export.export`` returns still mutates buffers in place.
    """
    kind = torch.export.graph_signature.OutputKind.BUFFER_MUTATION
    return [
        spec.target
        for spec in exported_program.graph_signature.output_specs
        if spec.kind is kind
    ]


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------


def _dropout_args(node: fx.Node) -> tuple[float, bool]:
    p = float(_arg(node, 1, "p", 0.5))
    train = _arg(node, 2, "train", True)
    return p, bool(train) if train is not None else True


def _keep_mask(importer, like: relax.Expr, shape: Sequence[int], p: float) -> relax.Expr:
    """A float tensor of ``shape`` with each element 1 with probability ``1 - p``, else 0."""
    bb = importer.block_builder
    dtype = _dtype(like)
    if p <= 0.0:
        return bb.emit(relax.op.ones(relax.ShapeExpr(shape), dtype))
    if p >= 1.0:
        return bb.emit(relax.op.zeros(relax.ShapeExpr(shape), dtype))
    ones = bb.emit(relax.op.ones(relax.ShapeExpr(shape), dtype))
    keep = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.dropout(ones, p)), 1))
    # relax.nn.dropout's mask is float, a lowered one may be bool: cast either way.  The mask is
    # drawn, a function of no input: no_grad, so that Gradient stops at it (a float mask multiplied
    # into x, as the decomposition of an in-place dropout has it, would else send it an adjoint,
    # and Gradient has no rule for the RNG kernel LowerDropout makes of it)
    return bb.emit(relax.op.grad.no_grad(bb.emit(relax.op.astype(keep, dtype))))


def _trivial_dropout(importer, x: relax.Expr, p: float, train: bool) -> relax.Expr | None:
    """The result of a dropout that draws nothing (eval mode or p == 0: x; p >= 1: zeros),
    else None."""
    if not train or p == 0.0:
        return x
    if p >= 1.0:
        return importer.block_builder.emit(relax.op.zeros_like(x))
    return None


def _dropout_tensor(importer, x: relax.Expr, p: float, train: bool) -> relax.Expr:
    trivial = _trivial_dropout(importer, x, p, train)
    if trivial is not None:
        return trivial
    bb = importer.block_builder
    return bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.dropout(x, p)), 0))


def _convert_dropout(node: fx.Node, importer) -> relax.Expr:
    """``aten.dropout(x, p, train) -> Tensor`` (also ``dropout_``)."""
    p, train = _dropout_args(node)
    return _dropout_tensor(importer, importer.env[node.args[0]], p, train)


def _convert_native_dropout(node: fx.Node, importer) -> relax.Expr:
    """``aten.native_dropout(x, p, train) -> (Tensor, bool mask)``."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    p, train = _dropout_args(node)
    if not train or p == 0.0 or p >= 1.0:
        keep = 0.0 if p >= 1.0 and train else 1.0
        out = _dropout_tensor(importer, x, p, train)
        mask = bb.emit(relax.op.full_like(x, _const(keep, x), dtype="bool"))
    else:
        pair = bb.emit(relax.op.nn.dropout(x, p))
        out = bb.emit(relax.TupleGetItem(pair, 0))
        mask = bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(pair, 1)), "bool"))
    return bb.emit(relax.Tuple([out, mask]))


def _feature_noise_shape(x: relax.Expr) -> list[int]:
    """Per-channel noise shape: ``(N, C, 1, ...)``, or ``(C, 1, ...)`` for unbatched input."""
    shape = _shape(x)
    keep = 2 if len(shape) > 2 else 1
    return shape[:keep] + [1] * (len(shape) - keep)


def _convert_feature_dropout(node: fx.Node, importer) -> relax.Expr:
    """``aten.feature_dropout(x, p, train)``: drop whole channels (``nn.Dropout2d``)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    p, train = _dropout_args(node)
    trivial = _trivial_dropout(importer, x, p, train)
    if trivial is not None:
        return trivial
    mask = _keep_mask(importer, x, _feature_noise_shape(x), p)
    return bb.emit(relax.op.multiply(x, relax.op.multiply(mask, _const(1.0 / (1.0 - p), x))))


def _make_alpha_dropout(per_channel: bool) -> Converter:
    """``alpha_dropout``: ``a * (x * b + alpha' * (b - 1 + p))`` with ``b ~ Bernoulli(1 - p)``,
    ``a = 1 / sqrt((alpha'^2 p + 1)(1 - p))``, exactly as ATen's ``_dropout_impl``."""

    def convert(node: fx.Node, importer) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        p, train = _dropout_args(node)
        trivial = _trivial_dropout(importer, x, p, train)
        if trivial is not None:
            return trivial
        shape = _feature_noise_shape(x) if per_channel else _shape(x)
        b = _keep_mask(importer, x, shape, p)
        a = 1.0 / math.sqrt((_SELU_ALPHA_SCALE**2 * p + 1.0) * (1.0 - p))
        kept = bb.emit(relax.op.multiply(x, b))
        shift = bb.emit(
            relax.op.multiply(relax.op.add(b, _const(p - 1.0, x)), _const(_SELU_ALPHA_SCALE, x))
        )
        return bb.emit(relax.op.multiply(relax.op.add(kept, shift), _const(a, x)))

    return convert


def _convert_bernoulli_p(node: fx.Node, importer) -> relax.Expr:
    """``aten.bernoulli.p(x, p)``: a 0/1 tensor shaped like ``x``, 1 with probability ``p``.

    This is how the default decomposition writes ``feature_dropout``/``alpha_dropout``; the
    sample is the keep-mask of a ``relax.nn.dropout`` with rate ``1 - p``.
    """
    x = importer.env[node.args[0]]
    p = float(_arg(node, 1, "p", 0.5))
    return _keep_mask(importer, x, _shape(x), 1.0 - p)


# --------------------------------------------------------------------------------------------
# BatchNorm
# --------------------------------------------------------------------------------------------


def _batch_norm_train(
    importer,
    x: relax.Expr,
    weight: relax.Expr | None,
    bias: relax.Expr | None,
    running_mean: relax.Expr | None,
    running_var: relax.Expr | None,
    momentum: float,
    eps: float,
) -> tuple[relax.Expr, ...]:
    """Batch-statistics BatchNorm: ``(out, save_mean, save_rstd, new_mean, new_var)``."""
    bb = importer.block_builder
    shape = _shape(x)
    channels = shape[1]
    axes = [0] + list(range(2, len(shape)))
    count = int(np.prod([shape[a] for a in axes]))
    bshape = [1, channels] + [1] * (len(shape) - 2)

    mean = bb.emit(relax.op.mean(x, axes, keepdims=True))
    var = bb.emit(relax.op.variance(x, axes, keepdims=True))
    std = bb.emit(relax.op.sqrt(relax.op.add(var, _const(eps, x))))
    out = bb.emit(relax.op.divide(relax.op.subtract(x, mean), std))
    if weight is not None:
        out = bb.emit(relax.op.multiply(out, relax.op.reshape(weight, bshape)))
    if bias is not None:
        out = bb.emit(relax.op.add(out, relax.op.reshape(bias, bshape)))

    save_mean = bb.emit(relax.op.reshape(mean, [channels]))
    save_rstd = bb.emit(relax.op.divide(_const(1.0, x), relax.op.reshape(std, [channels])))
    new_mean, new_var = running_mean, running_var
    if running_mean is not None:
        new_mean = bb.emit(
            relax.op.add(
                relax.op.multiply(running_mean, _const(1.0 - momentum, x)),
                relax.op.multiply(save_mean, _const(momentum, x)),
            )
        )
    if running_var is not None:
        unbiased = momentum * count / max(count - 1, 1)
        new_var = bb.emit(
            relax.op.add(
                relax.op.multiply(running_var, _const(1.0 - momentum, x)),
                relax.op.multiply(relax.op.reshape(var, [channels]), _const(unbiased, x)),
            )
        )
    return out, save_mean, save_rstd, new_mean, new_var


def _batch_norm_eval(
    importer,
    x: relax.Expr,
    weight: relax.Expr | None,
    bias: relax.Expr | None,
    running_mean: relax.Expr,
    running_var: relax.Expr,
    eps: float,
) -> relax.Expr:
    bb = importer.block_builder
    shape = _shape(x)
    bshape = [1, shape[1]] + [1] * (len(shape) - 2)
    std = relax.op.sqrt(relax.op.add(relax.op.reshape(running_var, bshape), _const(eps, x)))
    out = bb.emit(
        relax.op.divide(relax.op.subtract(x, relax.op.reshape(running_mean, bshape)), std)
    )
    if weight is not None:
        out = bb.emit(relax.op.multiply(out, relax.op.reshape(weight, bshape)))
    if bias is not None:
        out = bb.emit(relax.op.add(out, relax.op.reshape(bias, bshape)))
    return out


def _optional(importer, node: fx.Node, index: int) -> relax.Expr | None:
    arg = node.args[index] if len(node.args) > index else None
    return importer.env[arg] if arg is not None else None


def _convert_batch_norm_functional(node: fx.Node, importer) -> relax.Expr:
    """``_native_batch_norm_legit_functional(x, w, b, rm, rv, training, momentum, eps)``."""
    x = importer.env[node.args[0]]
    weight, bias = _optional(importer, node, 1), _optional(importer, node, 2)
    running_mean, running_var = importer.env[node.args[3]], importer.env[node.args[4]]
    training = _arg(node, 5, "training", True)
    momentum = float(_arg(node, 6, "momentum", 0.1))
    eps = float(_arg(node, 7, "eps", 1e-5))
    bb = importer.block_builder
    if training:
        outputs = _batch_norm_train(
            importer, x, weight, bias, running_mean, running_var, momentum, eps
        )
    else:
        out = _batch_norm_eval(importer, x, weight, bias, running_mean, running_var, eps)
        empty = bb.emit(relax.op.zeros(relax.ShapeExpr([0]), _dtype(x)))
        outputs = (out, empty, empty, running_mean, running_var)
    return bb.emit(relax.Tuple(list(outputs)))


def _convert_batch_norm(node: fx.Node, importer) -> relax.Expr:
    """``batch_norm(x, w, b, rm, rv, training, momentum, eps, cudnn_enabled) -> Tensor``.

    This op updates the running statistics in place (it appears only without decomposition,
    before functionalization); like the importer's other in-place ops, the update rebinds the
    buffers' nodes in ``importer.env`` so later reads see the new values.
    """
    x = importer.env[node.args[0]]
    weight, bias = _optional(importer, node, 1), _optional(importer, node, 2)
    running_mean, running_var = _optional(importer, node, 3), _optional(importer, node, 4)
    training = bool(_arg(node, 5, "training", False))
    momentum = _arg(node, 6, "momentum", 0.1)
    eps = float(_arg(node, 7, "eps", 1e-5))
    if not training and running_mean is not None:
        return _batch_norm_eval(importer, x, weight, bias, running_mean, running_var, eps)
    momentum = 0.1 if momentum is None else float(momentum)
    out, _, _, new_mean, new_var = _batch_norm_train(
        importer, x, weight, bias, running_mean, running_var, momentum, eps
    )
    if running_mean is not None:
        importer.env[node.args[3]] = new_mean
    if running_var is not None:
        importer.env[node.args[4]] = new_var
    return out


# --------------------------------------------------------------------------------------------
# Adaptive max pooling
# --------------------------------------------------------------------------------------------


def _adaptive_windows(length: int, out: int) -> tuple[list[int] | None, int]:
    """Indices that lay PyTorch's adaptive windows end to end, and the (padded) window size.

    Window ``i`` covers ``[floor(i * L / O), ceil((i + 1) * L / O))``; short windows repeat their
    last index, which leaves their maximum unchanged. ``None`` when the windows tile evenly.
    """
    if length % out == 0:
        return None, length // out
    bounds = [((i * length) // out, -((-(i + 1) * length) // out)) for i in range(out)]
    window = max(end - start for start, end in bounds)
    indices = []
    for start, end in bounds:
        indices += list(range(start, end)) + [end - 1] * (window - (end - start))
    return indices, window


def _check_indices_unused(node: fx.Node) -> None:
    for user in node.users:
        if user.target is not operator.getitem:
            raise NotImplementedError(f"{node.target}: only getitem users are supported")
        if user.args[1] == 1 and user.users:
            raise NotImplementedError(f"{node.target}: the indices output is not supported")


def _adaptive_max_pool(importer, x: relax.Expr, output_size: Sequence[int]) -> relax.Expr:
    """Adaptive max pooling over the last ``len(output_size)`` (1 or 2) axes of ``x``."""
    bb = importer.block_builder
    shape = _shape(x)
    spatial = len(output_size)
    kernel = []
    for axis, out in zip(range(len(shape) - spatial, len(shape)), output_size):
        indices, window = _adaptive_windows(shape[axis], int(out))
        if indices is not None:
            x = bb.emit(relax.op.take(x, relax.const(np.array(indices, "int64")), axis=axis))
        kernel.append(window)
    # Pool as NCHW: fold leading axes into N, C and give 1-D input a unit height.
    lead = shape[: len(shape) - spatial]
    pooled_shape = _shape(x)[len(shape) - spatial :]
    if spatial == 1:
        pooled_shape, kernel = [1, *pooled_shape], [1, *kernel]
    nc = [int(np.prod(lead[:-1], dtype=np.int64)), lead[-1]]
    x = bb.emit(relax.op.reshape(x, nc + pooled_shape))
    y = bb.emit(relax.op.nn.max_pool2d(x, pool_size=kernel, strides=kernel, layout="NCHW"))
    return bb.emit(relax.op.reshape(y, lead + [int(s) for s in output_size]))


def _make_adaptive_max_pool(spatial: int) -> Converter:
    def convert(node: fx.Node, importer) -> tuple[relax.Expr, None]:
        _check_indices_unused(node)
        output_size = node.args[1]
        if isinstance(output_size, int):
            output_size = [output_size] * spatial
        return _adaptive_max_pool(importer, importer.env[node.args[0]], output_size), None

    return convert


# --------------------------------------------------------------------------------------------
# Concatenation
# --------------------------------------------------------------------------------------------


def _convert_hardtanh(node: fx.Node, importer) -> relax.Expr:
    """``hardtanh(x, min_val=-1, max_val=1)`` (ReLU6: 0, 6) as ``tvm_evt.hardtanh``, whose gradient
    reads its output (`hardtanh_op`); ``clamp`` stays a ``clip``."""
    from .relax_passes.ops.hardtanh_op import hardtanh

    x = importer.env[node.args[0]]
    lo, hi = float(_arg(node, 1, "min_val", -1.0)), float(_arg(node, 2, "max_val", 1.0))
    if not lo < hi:  # torch's own result there is max_val everywhere, its gradient 0
        return importer.block_builder.emit(relax.op.clip(x, lo, hi))
    return importer.block_builder.emit(hardtanh(x, lo, hi))


def _convert_elu(node: fx.Node, importer) -> relax.Expr:
    """``elu(x, alpha=1, scale=1, input_scale=1)``: ``scale * x`` above 0, ``scale * alpha *
    (exp(input_scale * x) - 1)`` below, written ``scale * (relu(x) + alpha * (exp(input_scale *
    min(x, 0)) - 1))`` so the exponential never overflows on the branch not taken.  SELU decomposes
    to it with ``scale`` 1.0507 (the stock converter drops ``scale`` and ``input_scale``: SELU's
    results were 5 % small above 0)."""
    x = importer.env[node.args[0]]
    alpha, scale, input_scale = (float(_arg(node, i, n, 1.0)) for i, n in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    bb = importer.block_builder
    negative = relax.op.exp(relax.op.multiply(relax.op.minimum(x, _const(0.0, x)), _const(input_scale, x)))
    out = relax.op.add(relax.op.nn.relu(x), relax.op.multiply(relax.op.subtract(negative, _const(1.0, x)), _const(alpha, x)))
    return bb.emit(out if scale == 1.0 else relax.op.multiply(out, _const(scale, x)))


# --------------------------------------------------------------------------------------------
# Upsampling
# --------------------------------------------------------------------------------------------


def _source_index(size_in: int, size_out: int, scale, align_corners: bool, exact: bool, linear: bool):
    """torch's source coordinate of each output position along one axis (ATen's
    ``area_pixel_compute_scale`` / ``area_pixel_compute_source_index`` and the nearest modes'
    ``nearest_idx``), in float32 as ATen computes it for float32 tensors."""
    f32 = np.float32
    dst = np.arange(size_out, dtype=f32)
    if align_corners:
        step = f32((size_in - 1) / (size_out - 1)) if size_out > 1 else f32(0)
        return dst * step
    step = f32(1.0 / scale) if scale else f32(size_in / size_out)
    if not linear:  # nearest: floor(dst * step); nearest-exact: floor((dst + 0.5) * step)
        return np.floor((dst + f32(0.5 if exact else 0.0)) * step)
    return np.maximum(step * (dst + f32(0.5)) - f32(0.5), f32(0))


def _make_upsample(linear: bool, exact: bool = False) -> Converter:
    """``upsample_{nearest,bilinear}2d`` and ``_upsample_nearest_exact2d`` (``.vec``: output size or
    scale factors) with torch's coordinates, as ``take``s of constant rows and columns (bilinear: two
    per axis, weighted).  TVM's ``resize2d`` has no gradient rule, and its nearest mode rounds
    half-pixel coordinates where torch floors (``size=10`` from 7 picks other rows); a ``take``'s
    gradient is a scatter-add, which the CUDA route has a kernel for."""

    def convert(node: fx.Node, importer) -> relax.Expr:
        x = importer.env[node.args[0]]
        shape = _shape(x)
        if len(shape) != 4:
            raise NotImplementedError(f"upsample: a {len(shape)}-D input (2-D images only)")
        size = _arg(node, 1, "output_size")
        align_corners = bool(_arg(node, 2, "align_corners", False)) if linear else False
        scales = _arg(node, 3 if linear else 2, "scale_factors")
        if size is None and scales is None:
            raise NotImplementedError("upsample: neither an output size nor scale factors")
        bb = importer.block_builder
        y = x
        for k, axis in enumerate((2, 3)):
            scale = float(scales[k]) if scales is not None and size is None else None
            out = int(size[k]) if size is not None else int(math.floor(shape[axis] * scale))
            src = _source_index(shape[axis], out, scale, align_corners, exact, linear)
            if not linear:
                rows = np.minimum(src.astype("int64"), shape[axis] - 1)
                y = bb.emit(relax.op.take(y, relax.const(rows.astype("int32")), axis=axis))
                continue
            lo = np.minimum(np.floor(src).astype("int64"), shape[axis] - 1)
            hi = np.minimum(lo + 1, shape[axis] - 1)
            frac = (src - lo.astype(np.float32)).astype(np.float32)
            weights = [relax.const((w.reshape([-1] + [1] * (3 - axis))).astype(_dtype(x)))
                       for w in (np.float32(1) - frac, frac)]
            taken = [bb.emit(relax.op.multiply(bb.emit(relax.op.take(y, relax.const(i.astype("int32")), axis=axis)), w))
                     for i, w in zip((lo, hi), weights)]
            y = bb.emit(relax.op.add(*taken))
        return y

    return convert


def _make_extremum(op: Callable) -> Converter:
    """``amax`` / ``amin`` (``dim`` a list, empty for all; ``keepdim``), which the stock importer lacks
    (``logsumexp`` decomposes into ``amax``, ``exp``, ``sum``, ``log``)."""

    def convert(node: fx.Node, importer) -> relax.Expr:
        x = importer.env[node.args[0]]
        dims = _arg(node, 1, "dim", []) or None
        dims = [int(dims)] if isinstance(dims, int) else dims
        return importer.block_builder.emit(op(x, dims, bool(_arg(node, 2, "keepdim", False))))

    return convert


def _convert_detach(node: fx.Node, importer) -> relax.Expr:
    """``detach`` (``x.detach()``, and what `frontend.detach_no_grad_blocks` puts after a
    ``torch.no_grad()`` block) as ``no_grad``: the same values, no gradient.  The stock importer
    makes it the identity, and the gradient then flows where torch's does not."""
    return importer.block_builder.emit(relax.op.grad.no_grad(importer.env[node.args[0]]))


def _convert_cat(node: fx.Node, importer) -> relax.Expr:
    """``cat(tensors, dim)`` with torch's legacy rule: 1-D tensors of shape (0,) are skipped
    (a key/value cache starts as ``torch.tensor([])``, then each layer concatenates its keys)."""
    tensors = [importer.env[t] for t in node.args[0]]
    dim = int(_arg(node, 1, "dim", 0))
    kept = [t for t in tensors if _shape(t) != [0]] or tensors[:1]
    if len(kept) == 1:
        return kept[0]
    rank = len(_shape(kept[0]))
    return importer.block_builder.emit(relax.op.concat(kept, axis=dim % rank))


# --------------------------------------------------------------------------------------------
# True division of integers
# --------------------------------------------------------------------------------------------


def _convert_true_divide(node: fx.Node, importer) -> relax.Expr:
    """``div`` without a rounding mode (``a / b``) is true division: with an integer tensor its
    result is a float, of the other operand's float dtype or torch's default one.  The stock
    conversion divides an integer tensor as integers, truncating (DeBERTa-v2's log-bucketed relative
    positions then failed in ``log``; elsewhere the quotient is silently wrong).  Here integer
    operands are cast to that float dtype first; float operands go to the stock conversion."""
    operands = [importer.env[a] if isinstance(a, fx.Node) else a for a in node.args[:2]]
    tensors = [e for e in operands if isinstance(e, relax.Expr)]
    integral = [e for e in tensors if _dtype(e).startswith(("int", "uint", "bool"))]
    if not integral:
        return importer._binary_op(relax.op.divide, operator.truediv)(node)
    floats = [_dtype(e) for e in tensors if e not in integral]
    dtype = floats[0] if floats else str(torch.get_default_dtype()).replace("torch.", "")
    bb = importer.block_builder
    a, b = (bb.emit(relax.op.astype(e, dtype)) if isinstance(e, relax.Expr) and _dtype(e) != dtype
            else e if isinstance(e, relax.Expr) else relax.const(float(e), dtype) for e in operands)
    return bb.emit(relax.op.divide(a, b))


def _convert_addmm(node: fx.Node, importer) -> relax.Expr:
    """``addmm(input, mat1, mat2, beta=1, alpha=1)``: ``beta * input + alpha * (mat1 @ mat2)`` in
    the operands' dtype, as the mixed-precision graphs compute a bf16 linear layer.  The stock
    conversion takes the product in float32 and adds the bias in its own dtype: a bf16 or fp16
    ``nn.Linear`` (a model in ``.to(torch.float16)``) failed to import ("Binary operators must
    have the same datatype")."""
    bias, a, b = (importer.env[n] for n in node.args[:3])
    beta, alpha = _arg(node, 3, "beta", 1), _arg(node, 4, "alpha", 1)
    bb = importer.block_builder
    total = None
    if alpha != 0:
        total = bb.emit(relax.op.matmul(a, b))
        if alpha != 1:
            total = bb.emit(relax.op.multiply(total, _const(float(alpha), total)))
    if beta != 0:
        term = bias if beta == 1 else bb.emit(relax.op.multiply(bias, _const(float(beta), bias)))
        total = term if total is None else bb.emit(relax.op.add(term, total))
    return total


def _make_bool_binary(logical, arithmetic, py_op) -> Converter:
    """``mul``/``add`` of two bool tensors is torch's logical and/or (a bool result); the stock
    conversion multiplied bools, which LLVM's code generator rejects with an internal error
    (``torch.logaddexp``'s decomposition multiplies two masks).  Other operands: the stock
    conversion."""

    def convert(node: fx.Node, importer) -> relax.Expr:
        operands = [importer.env[a] if isinstance(a, fx.Node) else a for a in node.args[:2]]
        if all(isinstance(e, relax.Expr) and _dtype(e) == "bool" for e in operands):
            return importer.block_builder.emit(logical(*operands))
        return importer._binary_op(arithmetic, py_op)(node)

    return convert


# --------------------------------------------------------------------------------------------
# Clamping integer tensors
# --------------------------------------------------------------------------------------------


def _make_clamp(bounds: Callable[[fx.Node], tuple], stock: str) -> Converter:
    """``clamp``/``clamp_min``/``clamp_max`` of an integer tensor by integer bounds (relative
    positions clamped to a window) as ``maximum``/``minimum`` with integer constants.  The stock
    conversion is a ``clip`` with -inf or inf for a missing bound, which an integer tensor's
    legalization cannot cast ("Cannot convert infinity to BigInt").  Everything else is converted
    by the stock importer's `stock` method."""

    def convert(node: fx.Node, importer) -> relax.Expr:
        x, (lo, hi) = importer.env[node.args[0]], bounds(node)
        integral = lambda b: b is None or (isinstance(b, int) and not isinstance(b, bool))  # noqa: E731
        if not _dtype(x).startswith(("int", "uint")) or not (integral(lo) and integral(hi)):
            return getattr(importer, stock)(node)
        bb, dtype = importer.block_builder, _dtype(x)
        if lo is not None:
            x = bb.emit(relax.op.maximum(x, relax.const(lo, dtype)))
        if hi is not None:
            x = bb.emit(relax.op.minimum(x, relax.const(hi, dtype)))
        return x

    return convert


# --------------------------------------------------------------------------------------------
# Advanced indexing
# --------------------------------------------------------------------------------------------


def _convert_select(node: fx.Node, importer) -> relax.Expr:
    """``select(x, dim, index)`` (``x[:, -1]``): a negative index counts from the end.  The stock
    conversion took index -1 as it is, in TVM's unchecked ``take``: an LSTM's last step read the
    memory before its output (a loss of 9.9e6 where torch's is 1.98, then a corrupted heap)."""
    x = importer.env[node.args[0]]
    shape = _shape(x)
    dim = int(node.args[1]) % len(shape)
    index, size = int(node.args[2]), shape[dim]
    if not -size <= index < size:
        raise IndexError(f"select: index {index} out of range for dimension {dim} of size {size}")
    return importer.block_builder.emit(relax.op.take(x, relax.const(index % size, "int64"), dim))


def _convert_index_tensor(node: fx.Node, importer) -> relax.Expr:
    """``index.Tensor(x, indices)`` with a negative index counted from the end of its axis, as
    torch counts it (``x[..., [-2], :]``: the key of Falcon's multi-query attention).  The stock
    conversion's ``take`` and ``index_tensor`` read a negative index out of bounds (wrong values,
    then a corrupted heap).  Each integer index tensor is read as ``where(i < 0, i + extent, i)``
    (folded where the indices are constants) and the stock conversion runs on those.  An index
    tensor given for two axes of different extents is refused; boolean masks are left to the stock
    conversion."""
    data, indices = importer.env[node.args[0]], list(node.args[1])
    given = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if any(_dtype(importer.env[i]) == "bool" for _, i in given):
        return importer._index_tensor(node)
    shape, bb = _shape(data), importer.block_builder
    extents: dict = {}
    for axis, i in given:
        if extents.setdefault(i, shape[axis]) != shape[axis]:
            raise UnsupportedOpError("aten.index.Tensor", module_path(node),
                                     f"one index tensor for axes of extents {extents[i]} and {shape[axis]} of a "
                                     f"{shape} tensor: its negative indices would wrap differently")
    saved = {i: importer.env[i] for i in extents}
    try:
        for i, extent in extents.items():
            idx, dtype = saved[i], _dtype(saved[i])
            wrapped = relax.op.add(idx, relax.const(extent, dtype))
            importer.env[i] = bb.emit(relax.op.where(relax.op.less(idx, relax.const(0, dtype)), wrapped, idx))
        return importer._index_tensor(node)
    finally:
        importer.env.update(saved)


# --------------------------------------------------------------------------------------------
# Embedding lookups
# --------------------------------------------------------------------------------------------


def _convert_embedding(node: fx.Node, importer) -> relax.Expr:
    """``embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)`` as a ``take`` whose
    gradient skips the positions that look up ``padding_idx`` (torch leaves that row's gradient 0)::

        out = where(indices == padding_idx, no_grad(take(w, i)), take(w, i))

    the same values forward; backward, the padding positions send the weight nothing.  The lookup
    itself is the importer's (int32 indices, flattened, one ``take``).
    ``scale_grad_by_freq`` (a gradient scaled by each index's count in the batch) is refused.
    """
    weight, indices = (importer.env[a] for a in node.args[:2])
    padding_idx = int(_arg(node, 2, "padding_idx", -1))
    if _arg(node, 3, "scale_grad_by_freq", False):
        raise NotImplementedError("embedding: scale_grad_by_freq=True (a gradient scaled by index counts) "
                                  "is not supported")
    bb = importer.block_builder
    looked_up = importer._embedding_impl(indices, weight)  # pylint: disable=protected-access
    if padding_idx < 0:
        return looked_up
    if padding_idx >= _shape(weight)[0]:
        raise NotImplementedError(f"embedding: padding_idx {padding_idx} outside the {_shape(weight)[0]} rows")
    pad = bb.emit(relax.op.expand_dims(relax.op.equal(indices, relax.const(padding_idx, _dtype(indices))), -1))
    frozen = bb.emit(relax.op.grad.no_grad(looked_up))
    return bb.emit(relax.op.where(pad, frozen, looked_up))


def _convert_native_group_norm(node: fx.Node, importer) -> relax.Expr:
    """``native_group_norm(x, weight, bias, N, C, HxW, groups, eps)``'s output.  The stock converter
    passes a missing weight or bias (``GroupNorm(affine=False)``) on as a null expression; here they
    are ones and zeros, as the stock importer writes an instance norm's."""
    x = importer.env[node.args[0]]
    channels, ndim = _shape(x)[1], len(_shape(x))
    weight, bias = (importer.env[a] if a is not None else relax.const(np.full(channels, fill), _dtype(x))
                    for a, fill in ((_arg(node, 1, "weight"), 1.0), (_arg(node, 2, "bias"), 0.0)))
    return importer.block_builder.emit(relax.op.nn.group_norm(
        x, weight, bias, num_groups=int(_arg(node, 6, "group")), channel_axis=1, axes=list(range(2, ndim)),
        epsilon=float(_arg(node, 7, "eps", 1e-5))))


# --------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------


def constant_value(node) -> torch.Tensor | None:
    """The value of the fx value `node` where it is computed from constants only (no placeholder
    among its ancestors: transformers' masks built from ``arange``), evaluated with torch; else None."""
    if not isinstance(node, fx.Node):
        return None
    order, seen, stack = [], set(), [node]
    while stack:  # the ancestors, then a topological order of them (the graph's own)
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function":
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    order = [n for n in node.graph.nodes if n in seen]
    values = {}
    try:
        for n in order:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: values[a])
            values[n] = n.target(*args, **kwargs)
    except Exception:  # pylint: disable=broad-except  (an op torch cannot run here: not constant for us)
        return None
    value = values[node]
    return value if isinstance(value, torch.Tensor) else None


def _attention_call(node: fx.Node, importer, q, k, v, scale: float, causal: bool, dropout_p: float):
    """``tvm_evt.attention`` for an SDPA whose mask the op takes; or the reason it does not."""
    from .relax_passes.ops import attention_op

    if len(_shape(q)) != 4 or len(_shape(k)) != 4 or _shape(k)[0] != _shape(q)[0] or _shape(q)[1] % _shape(k)[1] \
            or _shape(v)[:3] != _shape(k)[:3] or _shape(k)[3] != _shape(q)[3]:
        return (f"q {_shape(q)}, k {_shape(k)}, v {_shape(v)} are not [B, H, S, D] with one head dimension "
                f"(and key/value heads dividing the query heads)")
    if _dtype(q) not in attention_op.FLOATS or _dtype(k) != _dtype(q) or _dtype(v) != _dtype(q):
        return f"dtypes {_dtype(q)}, {_dtype(k)}, {_dtype(v)}"
    if not scale > 0:
        return f"scale {scale}"
    b, h, sq, _ = _shape(q)
    sk = _shape(k)[2]
    bias = None
    attn_mask = _arg(node, 3, "attn_mask")
    if attn_mask is not None:
        value = constant_value(attn_mask)
        if value is None:
            return "the mask is computed from the inputs (a per-batch padding mask, say)"
        form = attention_op.mask_form(value.numpy() if value.dtype == torch.bool else value.float().numpy(),
                                      [b, h, sq, sk])
        if isinstance(form, str):
            return form
        mask_causal, bias = form
        if mask_causal and causal:
            return "a causal mask with is_causal"
        causal = causal or mask_causal
        if bias is not None:
            bias = relax.const(bias)
    if causal and sq > sk:
        return f"causal attention of {sq} queries over {sk} keys (a query would see no key)"
    call = attention_op.attention(q, k, v, attention_op.no_seed(), scale, causal, dropout_p, 0, bias)
    bb = importer.block_builder
    return bb.emit(relax.TupleGetItem(bb.emit(call), 0))


def _convert_sdpa(node: fx.Node, importer) -> relax.Expr:
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``
    as one ``tvm_evt.attention`` call with its arguments: the scale, ``is_causal``, the dropout rate
    (its seed and site filled in by `LowerDropout`), k and v with their own heads for ``enable_gqa``
    (the op's grouped-query form), and a mask computed from constants only (`constant_value`) when
    ``attention_op.mask_form`` finds it a key mask and/or the causal triangle.  Whether a kernel takes
    the call is decided on the CUDA route (``OffloadAttention``: the op decomposes where not).

    Any other SDPA (a mask computed from the inputs, a learned one, not 4-D) is written out::

        S = (q @ kᵀ) * scale;  S = where(triu(1), -inf, S) if is_causal;  S = S + mask (float) or
        where(mask, S, -inf) (bool);  P = dropout(softmax(S));  O = P @ v

    and the reason kept in ``importer.attention_fallbacks`` (module path, reason), which
    ``report()["attention"]`` lists.
    """
    dropout_p = float(_arg(node, 4, "dropout_p", 0.0))
    is_causal = bool(_arg(node, 5, "is_causal", False))
    scale = _arg(node, 6, "scale")
    bb = importer.block_builder
    q, k, v = (importer.env[a] for a in node.args[:3])
    scale = 1.0 / math.sqrt(_shape(q)[-1]) if scale is None else float(scale)
    fused = _attention_call(node, importer, q, k, v, scale, is_causal, dropout_p)
    if not isinstance(fused, str):
        return fused
    getattr(importer, "attention_fallbacks", []).append((node, fused))
    if _arg(node, 7, "enable_gqa", False):  # written out, k and v repeated over the query heads
        from .relax_passes.ops import attention_op

        k, v = (attention_op.repeat_heads(bb, x, _shape(q)[-3]) for x in (k, v))
    attn_mask = _arg(node, 3, "attn_mask")
    mask = importer.env[attn_mask] if attn_mask is not None else None
    q_shape, k_shape = _shape(q), _shape(k)
    axes = list(range(len(k_shape)))
    axes[-1], axes[-2] = axes[-2], axes[-1]
    scores = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, axes)))
    scores = bb.emit(relax.op.multiply(scores, _const(scale, q)))
    seq_q, seq_k = q_shape[-2], k_shape[-2]
    if is_causal:  # torch's is_causal: query i sees keys j <= i (top-left aligned)
        upper = relax.const(np.triu(np.ones((seq_q, seq_k), dtype=bool), 1))
        scores = bb.emit(relax.op.where(upper, _const(-np.inf, q), scores))
    if mask is not None:
        if _dtype(mask) == "bool":
            scores = bb.emit(relax.op.where(mask, scores, _const(-np.inf, q)))
        else:
            scores = bb.emit(relax.op.add(scores, mask))
    probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
    probs = _dropout_tensor(importer, probs, dropout_p, True)
    return bb.emit(relax.op.matmul(probs, v))


# --------------------------------------------------------------------------------------------
# The map
# --------------------------------------------------------------------------------------------

CONVERT_MAP: dict[str, Converter] = {
    # dropout family
    "dropout.default": _convert_dropout,
    "dropout_.default": _convert_dropout,
    "native_dropout.default": _convert_native_dropout,
    "feature_dropout.default": _convert_feature_dropout,
    "feature_dropout_.default": _convert_feature_dropout,
    "alpha_dropout.default": _make_alpha_dropout(per_channel=False),
    "alpha_dropout_.default": _make_alpha_dropout(per_channel=False),
    "feature_alpha_dropout.default": _make_alpha_dropout(per_channel=True),
    "feature_alpha_dropout_.default": _make_alpha_dropout(per_channel=True),
    "bernoulli.p": _convert_bernoulli_p,
    # activations: hardtanh whose gradient reads its output; ELU with its scales (SELU)
    "hardtanh.default": _convert_hardtanh,
    "hardtanh_.default": _convert_hardtanh,
    "elu.default": _convert_elu,
    "elu_.default": _convert_elu,
    # batch norm in training mode
    "_native_batch_norm_legit_functional.default": _convert_batch_norm_functional,
    "batch_norm.default": _convert_batch_norm,
    # group norm without affine parameters
    "native_group_norm.default": _convert_native_group_norm,
    # XML-CNN's dynamic max pooling
    "adaptive_max_pool1d.default": _make_adaptive_max_pool(spatial=1),
    "adaptive_max_pool2d.default": _make_adaptive_max_pool(spatial=2),
    # interpolation with torch's coordinates, as takes
    "upsample_nearest2d.vec": _make_upsample(linear=False),
    "_upsample_nearest_exact2d.vec": _make_upsample(linear=False, exact=True),
    "upsample_bilinear2d.vec": _make_upsample(linear=True),
    # detach stops the gradient
    "detach.default": _convert_detach,
    "detach_.default": _convert_detach,
    # reductions the stock importer lacks
    "amax.default": _make_extremum(relax.op.max),
    "amin.default": _make_extremum(relax.op.min),
    # concatenation that skips legacy empty (0,) tensors
    "cat.default": _convert_cat,
    # embedding lookups: padding_idx's row gets no gradient
    "embedding.default": _convert_embedding,
    # advanced indexing and select with negative indices
    "index.Tensor": _convert_index_tensor,
    "select.int": _convert_select,
    # a linear layer in its operands' dtype (fp16/bf16 ones did not import)
    "addmm.default": _convert_addmm,
    # true division of integer tensors gives floats
    "div.Tensor": _convert_true_divide,
    "div.Scalar": _convert_true_divide,
    # arithmetic of two bool tensors is logic
    "mul.Tensor": _make_bool_binary(relax.op.logical_and, relax.op.multiply, operator.mul),
    "add.Tensor": _make_bool_binary(relax.op.logical_or, relax.op.add, operator.add),
    # integer tensors clamped on one side
    "clamp.default": _make_clamp(lambda n: (_arg(n, 1, "min"), _arg(n, 2, "max")), "_clamp"),
    "clamp_min.default": _make_clamp(lambda n: (_arg(n, 1, "min"), None), "_clamp_min"),
    "clamp_max.default": _make_clamp(lambda n: (None, _arg(n, 1, "max")), "_clamp_max"),
    # attention, in the form FuseAttention takes to the flash-attention kernels
    "scaled_dot_product_attention.default": _convert_sdpa,
}
"""Converters to pass as ``custom_convert_map``; keys are ATen ``overloadpacket.overload`` names."""
