"""A channels-last 2-D convolution and its two gradients as Relax ops (``tvm_evt.conv2d*``).

Registered (once) when this module is imported::

    y  = tvm_evt.conv2d(x, w, geometry)                    x [N, H, W, C], w [K, R, S, C] -> [N, P, Q, K]
    dx = tvm_evt.conv2d_dgrad(dy, w, geometry, x_shape)    dy [N, P, Q, K]                -> [N, H, W, C]
    dw = tvm_evt.conv2d_wgrad(x, dy, geometry, w_shape)                                   -> [K, R, S, C]

``geometry`` is the ``relax.ShapeExpr`` ``[pad_top, pad_left, pad_bottom, pad_right, stride_h,
stride_w, dilation_h, dilation_w]`` (`Geometry`); ``x_shape`` / ``w_shape`` are the shapes of the
result, which the other operands do not fix.  Tensors share one float dtype, which is also the
result's; products accumulate in float32 and round once.  The convolution is the cross-correlation
of an NHWC ``conv2d`` with an OHWI kernel, ``groups`` 1.

Why ops: ``Conv2dToMatmul`` writes a convolution as an im2col gather and one GEMM, and on ResNet-50
conv3_x the gathers, their [N·P·Q, R·S·C] column matrices (231 MB each) and the gradient's col2im
sums were 0.89 ms of a 6.43 ms step on H200.  An implicit-GEMM kernel (CUTLASS SM90, TMA im2col:
``codegen/backend/conv.py``) reads the activation in place.  The gradient rule keeps the backward as
the two matching ops, so both gradients are implicit GEMMs too.

``decompose_conv2d*`` write each op with plain Relax ops -- the im2col gather, one matmul in
float32 rounded to the dtype, and for ``dgrad`` the col2im sum of the taps -- which is the ops'
``FLegalize`` (the CPU reference path) and ``OffloadConv``'s fallback, before the partitioner, for
calls the kernels cannot take.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx
from tvm.relax import op as R
from tvm.relax.op.grad import no_grad

from ...codegen.frontend.conv_call import DGRAD_OP, FPROP_OP, OPS, WGRAD_OP, output_extent
from ..partition.pad_unaligned_matmuls import alignment
from .._rewrite import static_shape
from ..training.gradient_rules import register_op

FPROP, DGRAD, WGRAD = FPROP_OP, DGRAD_OP, WGRAD_OP  # the names the codegen reads the calls by
FLOATS = ("float32", "float16", "bfloat16")


class ConvOpError(ValueError):
    """A ``tvm_evt.conv2d*`` call with malformed operands."""


@dataclass(frozen=True)
class Geometry:
    pad: tuple[int, int, int, int]  # top, left, bottom, right
    stride: tuple[int, int]
    dilation: tuple[int, int]

    def expr(self) -> relax.ShapeExpr:
        return relax.ShapeExpr([*self.pad, *self.stride, *self.dilation])

    @staticmethod
    def of(expr: relax.Expr) -> "Geometry":
        values = _ints(expr, "geometry")
        if len(values) != 8 or min(values[4:]) < 1 or min(values[:4]) < 0:
            raise ConvOpError(f"geometry must be [4 paddings >= 0, 2 strides >= 1, 2 dilations >= 1], got {values}")
        return Geometry(tuple(values[:4]), tuple(values[4:6]), tuple(values[6:]))

    def out(self, hw, rs) -> tuple[int, int]:
        """The output extent (P, Q) of an input (H, W) and a kernel (R, S)."""
        (pt, pl, pb, pr), (sh, sw), (dh, dw) = self.pad, self.stride, self.dilation
        return (output_extent(hw[0], pt, pb, rs[0], sh, dh), output_extent(hw[1], pl, pr, rs[1], sw, dw))


def _ints(expr: relax.Expr, what: str) -> list[int]:
    if not isinstance(expr, relax.ShapeExpr):
        raise ConvOpError(f"{what} must be a constant shape expression, got {type(expr).__name__}")
    try:
        return [int(v) for v in expr.values]
    except TypeError as err:
        raise ConvOpError(f"{what} must be static, got {expr}") from err


def _tensor(expr: relax.Expr, what: str) -> tuple[int, int, int, int]:
    shape = static_shape(expr)
    if shape is None or len(shape) != 4:
        raise ConvOpError(f"{what} must be a 4-D tensor of static shape, got {expr.ty}")
    return shape


def operand_shapes(call: relax.Call, kind: str, fits: Callable[[tuple, tuple], bool],
                   w_layout: str) -> tuple[tuple, tuple, tuple, Geometry]:
    """(x [N, H, W, C], w, y [N, P, Q, K], geometry) of a call of a convolution family's op of
    `kind` ("fprop" (x, w, geometry), "dgrad" (dy, w, geometry, x_shape) or "wgrad" (x, dy,
    geometry, w_shape)), checked; `fits(x, w)` tells whether the weight (`w_layout`, K first) goes
    with the input."""
    op = call.op.name
    geometry = Geometry.of(call.args[2])
    a, b = (_tensor(arg, name) for arg, name in zip(call.args[:2], {"fprop": ("x", "w"), "dgrad": ("dy", "w"),
                                                                   "wgrad": ("x", "dy")}[kind]))
    if str(call.args[0].ty.dtype) != str(call.args[1].ty.dtype) or str(call.args[0].ty.dtype) not in FLOATS:
        raise ConvOpError(f"{op}: operands must share one float dtype, got {call.args[0].ty} and {call.args[1].ty}")
    if kind == "fprop":
        x, w = a, b
    elif kind == "dgrad":
        w, x = b, tuple(_ints(call.args[3], "x_shape"))
    else:
        x, w = a, tuple(_ints(call.args[3], "w_shape"))
    if len(x) != 4 or len(w) != 4 or not fits(x, w):
        raise ConvOpError(f"{op}: x {list(x)} and w {list(w)} must be [N, H, W, C] and {w_layout}")
    y = (x[0], *geometry.out(x[1:3], w[1:3]), w[0])
    given = {"fprop": None, "dgrad": a, "wgrad": b}[kind]
    if min(y) < 1 or (given is not None and tuple(given) != y):
        raise ConvOpError(f"{op}: output {list(y)} of x {list(x)}, w {list(w)}, {geometry} does not match dy "
                          f"{list(given) if given else ''}")
    return tuple(x), tuple(w), y, geometry


def result_type(call: relax.Call, kind: str, shapes: tuple) -> relax.TensorType:
    """The type of a convolution family's call of `kind` whose `operand_shapes` are `shapes`."""
    x, w, y, _ = shapes
    return relax.TensorType(relax.ShapeExpr(list({"fprop": y, "dgrad": x, "wgrad": w}[kind])),
                            str(call.args[0].ty.dtype))


def family_call(op: str, a, b, geometry: Geometry, shape=None) -> relax.Call:
    """A call of a convolution family's op: fprop ``(x, w, geometry)``, dgrad ``(dy, w, geometry,
    x_shape)``, wgrad ``(x, dy, geometry, w_shape)``."""
    extra = [] if shape is None else [relax.ShapeExpr([int(d) for d in shape])]
    return relax.Call(tvm.ir.Op.get(op), [a, b, geometry.expr(), *extra])


def conv_shapes(call: relax.Call) -> tuple[tuple, tuple, tuple, Geometry]:
    """(x [N, H, W, C], w [K, R, S, C], y [N, P, Q, K], geometry) of any of the three ops, checked."""
    return operand_shapes(call, OPS[call.op.name], lambda x, w: x[3] == w[3], "[K, R, S, C]")


def _infer(call: relax.Call, _bb) -> relax.TensorType:
    return result_type(call, OPS[call.op.name], conv_shapes(call))


# ------------------------------------------------------------------------ calls from Python


def conv2d(x, w, geometry: Geometry) -> relax.Call:
    return family_call(FPROP, x, w, geometry)


def conv2d_dgrad(dy, w, geometry: Geometry, x_shape) -> relax.Call:
    return family_call(DGRAD, dy, w, geometry, x_shape)


def conv2d_wgrad(x, dy, geometry: Geometry, w_shape) -> relax.Call:
    return family_call(WGRAD, x, dy, geometry, w_shape)


# ---------------------------------------------------------------------- im2col decomposition


def taps(emit, x, spatial, kernel, out, stride, dilation) -> list:
    """One strided slice of `x` over its `spatial` (height, width) axes per kernel tap, kernel
    rows then columns: the input each tap of an `out`-sized convolution output reads."""
    found = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            begin = [i * dilation[0], j * dilation[1]]
            end = [b + (e - 1) * s + 1 for b, e, s in zip(begin, out, stride)]
            found.append(emit(relax.op.strided_slice(x, spatial, begin, end, stride)))
    return found


def windows_nhwc(emit, x, xs, kernel, out, stride, dilation, pad, max_taps: int | None = None):
    """``[N*P*Q, R*S*C]`` im2col columns of an NHWC input (kernel row, column, then channel: the
    order of an OHWI weight's rows), or None where the window has more than `max_taps` taps."""
    (n, h, wd, c), (kh, kw), (oh, ow) = xs, kernel, out
    stride, dilation, pad = list(stride), list(dilation), list(pad)
    rows = n * oh * ow
    if (kh, kw) == (1, 1) and not any(pad):
        if stride != [1, 1]:
            (x,) = taps(emit, x, [1, 2], kernel, out, stride, dilation)
        return emit(relax.op.reshape(x, [rows, c]))
    if stride == [kh, kw] and dilation == [1, 1] and not any(pad) and (oh * kh, ow * kw) == (h, wd):
        patches = emit(relax.op.reshape(x, [n, oh, kh, ow, kw, c]))
        patches = emit(relax.op.permute_dims(patches, [0, 1, 3, 2, 4, 5]))
        return emit(relax.op.reshape(patches, [rows, kh * kw * c]))
    if max_taps is not None and kh * kw > max_taps:
        return None
    if any(pad):
        x = emit(relax.op.nn.pad(x, [0, 0, pad[0], pad[2], pad[1], pad[3], 0, 0]))
    # each tap [N, OH, OW, 1, C], stacked on that new axis: the gather kernel picks its tap by
    # an outer index, so it moves whole 16-byte channel vectors (VectorizedElementwise); stacked
    # along C, the choice varied along the innermost axis and the kernel ran one element a
    # thread (ResNet-50 conv3_x: 0.48 ms for a 231 MB [100352, 1152] bf16 gather on H100)
    stacked = [emit(relax.op.expand_dims(t, 3)) for t in taps(emit, x, [1, 2], kernel, out, stride, dilation)]
    cols = emit(relax.op.concat(stacked, axis=3)) if len(stacked) > 1 else stacked[0]  # [N, OH, OW, KH*KW, C]
    return emit(relax.op.reshape(cols, [rows, kh * kw * c]))


def gather_windows(bb: relax.BlockBuilder, x, xs, kernel, out, stride, dilation, pad) -> tuple[relax.Expr, int]:
    """(``[N*P*Q, Kp]`` im2col columns of an NHWC input, ``Kp``) as one gather kernel whose row is a
    window (kernel row, column, then channel, as `windows_nhwc`), zero past ``R*S*C`` up to the
    next whole 16 bytes (``alignment``, what the GEMM kernels need) and where the window overlaps
    the padding.

    For channel vectors narrower than 16 bytes (a 7x7 stem on 3 channels): `windows_nhwc`'s
    per-tap strided slices then write [N, P, Q, C] slabs of 6-byte vectors, and the GEMM's
    unaligned K = R*S*C is padded by another copy (ResNet-50, batch 128, H200: 2.73 + 0.99 ms a
    step for its stem's [1605632, 147] columns).  Here each row is written once, contiguously,
    already padded, and the padded input is never materialised."""
    (n, h, wd, c), (kh, kw), (oh, ow) = xs, kernel, out
    (pt, pl, _, _), (sh, sw), (dh, dw) = pad, stride, dilation
    taps_c = kh * kw * c
    dtype = str(x.ty.dtype)
    width = -(-taps_c // alignment(dtype)) * alignment(dtype)

    def gather(data: te.Tensor) -> te.Tensor:
        def element(row, col):
            img, pix = row // (oh * ow), row % (oh * ow)
            i = pix // ow * sh - pt + col // (kw * c) * dh
            j = pix % ow * sw - pl + col // c % kw * dw
            inside = tirx.all(col < taps_c, i >= 0, i < h, j >= 0, j < wd)
            return tirx.if_then_else(inside, data[img, i, j, col % c], tirx.const(0, dtype))

        # int64 extents, as LegalizeOps gives its consumers (FuseTIR requires a fused group's
        # buffers of one Relax var to agree)
        return te.compute((tirx.IntImm("int64", n * oh * ow), tirx.IntImm("int64", width)), element, name="im2col")

    return bb.emit(bb.call_te(gather, x, primfunc_name_hint="im2col")), width


def _narrow_vectors(c: int, dtype: str, kernel) -> bool:
    """Does `windows_nhwc` gather overlapping windows of channel vectors narrower than 16 bytes
    (`gather_windows` takes those)?"""
    return tuple(kernel) != (1, 1) and c % alignment(dtype) != 0


def _columns(bb: relax.BlockBuilder, x, xs, kernel, out, g: "Geometry") -> tuple[relax.Expr, int]:
    """(im2col columns of `x`, their width): `gather_windows` for narrow channel vectors, else
    `windows_nhwc` (K = R*S*C)."""
    if _narrow_vectors(xs[3], str(x.ty.dtype), kernel):
        return gather_windows(bb, x, xs, kernel, out, g.stride, g.dilation, g.pad)
    cols = windows_nhwc(bb.emit, x, xs, kernel, out, g.stride, g.dilation, g.pad)
    return cols, kernel[0] * kernel[1] * xs[3]


def _gemm(emit, a, b, dtype):
    """``a @ b`` accumulated in float32, rounded to `dtype` once (what the kernels compute)."""
    y = emit(R.matmul(a, b, out_dtype="float32"))
    return y if dtype == "float32" else emit(R.astype(y, dtype))


def decompose_conv2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    (n, h, wd, c), (k, r, s, _), (_, p, q, _), g = conv_shapes(call)
    x, w = call.args[:2]
    emit = bb.emit
    cols, width = _columns(bb, x, (n, h, wd, c), (r, s), (p, q), g)
    w2 = emit(R.reshape(w, [k, r * s * c]))
    if width != r * s * c:  # zero rows against the columns' zero padding
        w2 = emit(R.nn.pad(w2, [0, 0, 0, width - r * s * c]))
    w2 = emit(R.permute_dims(w2, [1, 0]))
    return R.reshape(_gemm(emit, cols, w2, str(x.ty.dtype)), [n, p, q, k])


def decompose_conv2d_wgrad(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    (n, h, wd, c), (k, r, s, _), (_, p, q, _), g = conv_shapes(call)
    x, dy = call.args[:2]
    emit = bb.emit
    cols, width = _columns(bb, x, (n, h, wd, c), (r, s), (p, q), g)
    dyt = emit(R.permute_dims(emit(R.reshape(dy, [n * p * q, k])), [1, 0]))
    dw = _gemm(emit, dyt, cols, str(x.ty.dtype))
    if width != r * s * c:  # the padding columns' gradient: dropped
        dw = emit(R.strided_slice(dw, [1], [0], [r * s * c]))
    return R.reshape(dw, [k, r, s, c])


def decompose_conv2d_dgrad(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """dcols = dy · w (float32), then col2im: each tap's [N, P, Q, C] slab strided into the padded
    input at its offset (zeros between the strides), summed, the padding cropped."""
    (n, h, wd, c), (k, r, s, _), (_, p, q, _), g = conv_shapes(call)
    dy, w = call.args[:2]
    emit = bb.emit
    (pt, pl, pb, pr), (sh, sw), (dh, dw) = g.pad, g.stride, g.dilation
    hp, wp = h + pt + pb, wd + pl + pr
    dcols = emit(R.matmul(emit(R.reshape(dy, [n * p * q, k])), emit(R.reshape(w, [k, r * s * c])),
                          out_dtype="float32"))
    dcols = emit(R.reshape(dcols, [n, p, q, r * s, c]))
    total = None
    for tap in range(r * s):
        i, j = divmod(tap, s)
        slab = emit(R.squeeze(emit(R.strided_slice(dcols, [3], [tap], [tap + 1])), [3]))  # [N, P, Q, C]
        if (sh, sw) != (1, 1):  # zeros between the rows and columns a strided window reads
            slab = emit(R.reshape(emit(R.nn.pad(emit(R.reshape(slab, [n, p, 1, q, 1, c])),
                                                [0, 0, 0, 0, 0, sh - 1, 0, 0, 0, sw - 1, 0, 0])),
                                  [n, p * sh, q * sw, c]))
        top, left = i * dh, j * dw
        # the slab covers rows top .. top + P*sh - 1 of the padded input (the last sh - 1 are zeros)
        rows, cols = min(p * sh, hp - top), min(q * sw, wp - left)
        if (rows, cols) != (p * sh, q * sw):
            slab = emit(R.strided_slice(slab, [1, 2], [0, 0], [rows, cols]))
        placed = emit(R.nn.pad(slab, [0, 0, top, hp - top - rows, left, wp - left - cols, 0, 0]))
        total = placed if total is None else emit(R.add(total, placed))
    if any(g.pad):
        total = emit(R.strided_slice(total, [1, 2], [pt, pl], [pt + h, pl + wd]))
    dtype = str(dy.ty.dtype)
    return total if dtype == "float32" else R.astype(total, dtype)


def _phase(size: int, pad_lo: int, kernel: int, stride: int, out: int, a: int) -> tuple[int, int, int, int, int]:
    """One axis of stride phase `a` of a dgrad: (first tap, taps, pad_lo', pad_hi', rows computed).

    The input rows ``i·stride + a`` are reached only by the taps ``first + stride·t`` (``first =
    (a + pad_lo) % stride``), from output rows ``i + pad_lo' - t`` (``pad_lo' = (a + pad_lo) //
    stride``): a unit-stride dgrad with that sub-filter.  It computes the phase's first ``rows``
    rows, whose pad_hi' >= 0 makes its output extent `out`; the phase's other rows (past every
    window) have zero gradient.  ``rows`` is 0 where no tap reaches the phase."""
    first, lo = (a + pad_lo) % stride, (a + pad_lo) // stride
    taps = max(0, (kernel - first + stride - 1) // stride)
    extent = max(0, (size - a + stride - 1) // stride)
    rows = max(0, min(extent, out - lo + taps - 1)) if taps else 0
    return first, taps, lo, out - rows - lo + taps - 1, rows


def split_strided_dgrad(emit, call: relax.Call, lower) -> relax.Expr | None:
    """A strided ``conv2d_dgrad`` as its stride phases, each a unit-stride dgrad (`lower` emits
    one and returns its value), interleaved; None where the call has unit strides or a dilation.

    The SM90 implicit-GEMM kernels take unit-stride dgrads only; a strided one otherwise runs as
    the [N·P·Q, R·S·C] float32 product and its col2im (ResNet-50 conv3_x, H100: 0.195 + 0.219 ms
    for its stride-2 3x3 convolution).  Input rows ``h = i·s + a`` of phase ``a`` take only the
    taps ``r ≡ a + pad (mod s)`` (`_phase`), so each of the ``sh·sw`` phases is a dgrad with stride
    1 of the sub-filter ``w[:, r0::sh, s0::sw, :]`` (for a 3x3 filter, stride 2: 1x1, 1x2, 2x1 and
    2x2).  The phases are interleaved by one concatenation and reshape, an injective producer that
    TVM fuses into the elementwise consumer of dx."""
    (n, h, wd, c), (k, r, s, _), (_, p, q, _), g = conv_shapes(call)
    (pt, pl, pb, pr), (sh, sw), (dh, dw) = g.pad, g.stride, g.dilation
    if (sh, sw) == (1, 1) or (dh, dw) != (1, 1):
        return None
    dy, w = call.args[:2]
    dtype = str(dy.ty.dtype)
    hm, wm = -(-h // sh), -(-wd // sw)  # rows and columns of the largest phase
    rows = []
    for a in range(sh):
        r0, rt, top, bottom, ha = _phase(h, pt, r, sh, p, a)
        cols = []
        for b in range(sw):
            s0, st, left, right, wb = _phase(wd, pl, s, sw, q, b)
            if ha and wb:
                sub = emit(R.strided_slice(w, [1, 2], [r0, s0], [r, s], [sh, sw]))  # [K, rt, st, C]
                geometry = Geometry((top, left, bottom, right), (1, 1), (1, 1))
                phase = lower(conv2d_dgrad(dy, sub, geometry, (n, ha, wb, c)))
                if (ha, wb) != (hm, wm):  # rows past every window (and a shorter phase): zeros
                    phase = emit(R.nn.pad(phase, [0, 0, 0, hm - ha, 0, wm - wb, 0, 0]))
            else:
                phase = emit(R.zeros(relax.ShapeExpr([n, hm, wm, c]), dtype))
            cols.append(emit(R.reshape(phase, [n, hm, 1, wm, 1, c])))
        rows.append(emit(R.concat(cols, axis=4)) if sw > 1 else cols[0])
    dx = emit(R.reshape(emit(R.concat(rows, axis=2)) if sh > 1 else rows[0], [n, hm * sh, wm * sw, c]))
    return dx if (hm * sh, wm * sw) == (h, wd) else R.strided_slice(dx, [1, 2], [0, 0], [h, wd])


# -------------------------------------------------------------------------------- gradient


def conv2d_grad(orig_var, orig_call, output_grad, ctx):
    """``[dx, dw]`` as the two gradient ops (implicit GEMMs in their own right)."""
    x_shape, w_shape, _, geometry = conv_shapes(orig_call)
    x, w = orig_call.args[:2]
    dy = output_grad
    if str(dy.ty.dtype) != str(x.ty.dtype):
        dy = ctx.emit(R.astype(dy, str(x.ty.dtype)))
    return [conv2d_dgrad(dy, w, geometry, x_shape), conv2d_wgrad(x, dy, geometry, w_shape), no_grad(orig_call.args[2])]


# ------------------------------------------------------------------------------ registration

DECOMPOSE = {FPROP: decompose_conv2d, DGRAD: decompose_conv2d_dgrad, WGRAD: decompose_conv2d_wgrad}

register_op(FPROP, "NHWC x OHWI 2-D cross-correlation (implicit GEMM)", _infer, decompose_conv2d, conv2d_grad)
register_op(DGRAD, "input gradient of tvm_evt.conv2d", _infer, decompose_conv2d_dgrad)
register_op(WGRAD, "weight gradient of tvm_evt.conv2d", _infer, decompose_conv2d_wgrad)
