"""Conv2dToMatmul: 2-D (and 1-D) convolutions as one GEMM over gathered input windows (im2col).

TVM 0.27 has no GPU schedule for ``conv2d`` beyond DLight's fallback, and the convolutions that
the gradient rules emit for weight gradients reduce over batch x height x width in one serial
loop per output element: on H100 one weight gradient of the ResNet-50 conv3_x stage took 169 ms
of a 315 ms step.  Run before ``Gradient``, this pass writes each forward ``conv2d`` as

    cols = windows(x)  [N*OH*OW, C*KH*KW]     w2 = reshape(w, [O, C*KH*KW])ᵀ
    y    = matmul(cols, w2) -> [N, OH, OW, O] -> NCHW

so the forward and both gradients (``cols``ᵀ·dY and dY·w2ᵀ, then the window gather's own
gradient) are GEMMs the EVT partitioner offloads.  ``windows`` is chosen by the window shape:

* 1x1: a strided slice (stride > 1) and a transpose;
* non-overlapping patches (stride = kernel, no padding, dilation 1, as in ViT's patch embedding):
  a reshape and a transpose;
* otherwise, at most ``MAX_WINDOW`` kernel taps: pad, one strided slice per tap, stacked.

Only ``groups == 1`` NCHW/OIHW convolutions with static shapes are rewritten (and NCW/OIW
``conv1d``: XML-CNN); the rest stay convolutions, an NHWC one written back as NCHW between
transposes (the layout TVM's ``conv2d`` gradient takes).  A ``conv1d`` goes channels-last first: its
input transposed to NWC (an input that is itself the transpose of an NWC tensor, as XML-CNN's
embedding, is read as that tensor, so the gradient stays NWC too), its weight to OWI, then
gathered as an NHWC conv2d of height 1 (below).  Gathered channel-major from NCW, each of
XML-CNN's 8-tap windows read 8 neighbours 500 elements apart per output row: 0.33 ms for an
85 MB gather on H100.  The gathered columns
are KH*KW times the input (3x3: 9x) in memory.

NHWC/OHWI convolutions (``relax.transform.ConvertLayout`` makes them, with the layout carried
through batch norm, ReLU and residual adds between them) are rewritten too, and more cheaply:
each tap is a channel-contiguous slice, the taps concatenate along the channels into rows of
``[KH, KW, C]`` (an OHWI weight's order), and the GEMM's ``[N*OH*OW, O]`` is already NHWC; no
transpose on either side.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import conv_op, depthwise_conv_op
from .._rewrite import mutate_relax_functions, permute_axes, producer, static_shape
from ..ops.conv_op import taps as _taps

CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
CONV1D = tvm.ir.Op.get("relax.nn.conv1d")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
MAX_WINDOW = 9  # taps gathered by strided slices (3x3); larger overlapping windows stay conv2d
NHWC = ("NHWC", "OHWI", "NHWC")  # what relax.transform.ConvertLayout makes (pipeline.OPTIONAL "nhwc")


def _ints(values) -> list[int]:
    return [int(v) for v in values]


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, implicit: bool = False, depthwise: bool = False):
        super().__init__(mod)
        self.implicit = implicit
        self.depthwise = depthwise

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op not in (CONV2D, CONV1D):
            return call
        x, w = call.args
        xs, ws, ys = static_shape(x), static_shape(w), static_shape(call)
        a = call.attrs
        layouts = ("NCHW", "OIHW", "NCHW") if call.op == CONV2D else ("NCW", "OIW", "NCW")
        given = (a.data_layout, a.kernel_layout, a.out_layout or a.data_layout)
        nhwc = call.op == CONV2D and given == NHWC
        out_dtype = a.out_dtype if a.out_dtype and str(a.out_dtype) else None
        stride, dilation, pad = _ints(a.strides), _ints(a.dilation), _ints(a.padding)
        geometry = conv_op.Geometry(tuple(pad), tuple(stride), tuple(dilation))
        if nhwc and self.depthwise and xs is not None and ws is not None and ys is not None \
                and depthwise_conv_op.is_depthwise(xs, ws, int(a.groups)) and out_dtype in (None, str(x.ty.dtype)):
            return depthwise_conv_op.depthwise_conv2d(x, w, geometry)  # a direct kernel, and its gradients
        if xs is None or ws is None or ys is None or int(a.groups) != 1 or (given != layouts and not nhwc):
            return self._differentiable(call) if nhwc else call
        emit = self.builder_.emit
        if nhwc and self.implicit and _gathers(ws[1:3], stride, dilation, pad, xs[1:3], ys[1:3]) \
                and out_dtype in (None, str(x.ty.dtype)):  # the window gather stays inside the kernel
            return conv_op.conv2d(x, w, geometry)
        if nhwc:  # channels innermost: the windows are channel-contiguous and the output needs no transpose
            y = self._nhwc_gemm(x, xs, w, ws, ys, stride, dilation, pad, out_dtype)
            return self._differentiable(call) if y is None else relax.op.reshape(y, [xs[0], *ys[1:3], ws[0]])
        if call.op == CONV1D:  # an NHWC conv2d of height 1 between NCW <-> NWC transposes
            (n, c, wd), (o, _, k), (_, _, ow) = xs, ws, ys
            nwc = producer(self, x, PERMUTE)  # x = NWC^T (XML-CNN's embedding): read the NWC tensor
            nwc = nwc.args[0] if nwc is not None and permute_axes(nwc) == [0, 2, 1] else \
                emit(relax.op.permute_dims(x, [0, 2, 1]))
            owi = emit(relax.op.reshape(emit(relax.op.permute_dims(w, [0, 2, 1])), [o, 1, k, c]))
            y = self._nhwc_gemm(emit(relax.op.reshape(nwc, [n, 1, wd, c])), (n, 1, wd, c), owi, (o, 1, k, c),
                                (n, 1, ow, o), [1, *stride], [1, *dilation], [0, pad[0], 0, pad[1]], out_dtype)
            return call if y is None else relax.op.permute_dims(emit(relax.op.reshape(y, [n, ow, o])), [0, 2, 1])
        (n, c, h, wd), (o, _, kh, kw), (_, _, oh, ow) = xs, ws, ys
        cols = self._windows(x, xs, (kh, kw), (oh, ow), stride, dilation, pad)  # pad: top, left, bottom, right
        if cols is None:
            return call
        w2 = emit(relax.op.permute_dims(emit(relax.op.reshape(w, [o, c * kh * kw])), [1, 0]))
        y = emit(relax.op.matmul(cols, w2, out_dtype=out_dtype))
        y = emit(relax.op.reshape(y, [n, oh, ow, o]))
        return relax.op.permute_dims(y, [0, 3, 1, 2])

    def _differentiable(self, call: relax.Call) -> relax.Expr:
        """An NHWC/OHWI ``conv2d`` left as a convolution (grouped, depthwise, or windows of more than
        ``MAX_WINDOW`` taps such as a 7x7 stem), as the NCHW/OIHW one between transposes: TVM's
        ``conv2d`` gradient takes only that layout, so the layout ConvertConvLayout chose must not
        reach ``Gradient`` on a convolution this pass does not rewrite."""
        emit, a = self.builder_.emit, call.attrs
        x = emit(relax.op.permute_dims(call.args[0], [0, 3, 1, 2]))
        w = emit(relax.op.permute_dims(call.args[1], [0, 3, 1, 2]))
        y = emit(relax.op.nn.conv2d(x, w, strides=a.strides, padding=a.padding, dilation=a.dilation,
                                    groups=int(a.groups), out_dtype=a.out_dtype if a.out_dtype and str(a.out_dtype) else None))
        return relax.op.permute_dims(y, [0, 2, 3, 1])

    def _nhwc_gemm(self, x, xs, w, ws, ys, stride, dilation, pad, out_dtype):
        """An NHWC/OHWI convolution as one GEMM, its ``[N*OH*OW, O]`` result, or None (windows
        too large)."""
        emit = self.builder_.emit
        (_, _, _, c), (o, kh, kw, _), (_, oh, ow, _) = xs, ws, ys
        cols = self._windows_nhwc(x, xs, (kh, kw), (oh, ow), stride, dilation, pad)
        if cols is None:
            return None
        w2 = emit(relax.op.permute_dims(emit(relax.op.reshape(w, [o, kh * kw * c])), [1, 0]))
        return emit(relax.op.matmul(cols, w2, out_dtype=out_dtype))

    def _windows(self, x, xs, kernel, out, stride, dilation, pad):
        """``[N*OH*OW, C*KH*KW]`` columns (channel-major, then kernel row, column), or None."""
        emit = self.builder_.emit
        (n, c, h, wd), (kh, kw), (oh, ow) = xs, kernel, out
        rows = n * oh * ow
        if (kh, kw) == (1, 1) and not any(pad):
            if stride != [1, 1]:
                (x,) = _taps(emit, x, [2, 3], kernel, out, stride, dilation)
            return emit(relax.op.reshape(emit(relax.op.permute_dims(x, [0, 2, 3, 1])), [rows, c]))
        if stride == [kh, kw] and dilation == [1, 1] and not any(pad) and (oh * kh, ow * kw) == (h, wd):
            patches = emit(relax.op.reshape(x, [n, c, oh, kh, ow, kw]))
            patches = emit(relax.op.permute_dims(patches, [0, 2, 4, 1, 3, 5]))
            return emit(relax.op.reshape(patches, [rows, c * kh * kw]))
        if kh * kw > MAX_WINDOW:
            return None
        if any(pad):
            x = emit(relax.op.nn.pad(x, [0, 0, 0, 0, pad[0], pad[2], pad[1], pad[3]]))
        taps = [emit(relax.op.expand_dims(tap, 2)) for tap in _taps(emit, x, [2, 3], kernel, out, stride, dilation)]
        stacked = emit(relax.op.concat(taps, axis=2))  # [N, C, KH*KW, OH, OW]
        cols = emit(relax.op.permute_dims(stacked, [0, 3, 4, 1, 2]))
        return emit(relax.op.reshape(cols, [rows, c * math.prod(kernel)]))

    def _windows_nhwc(self, x, xs, kernel, out, stride, dilation, pad):
        """``[N*OH*OW, KH*KW*C]`` columns of an NHWC input (`conv_op.windows_nhwc`), or None."""
        return conv_op.windows_nhwc(self.builder_.emit, x, xs, kernel, out, stride, dilation, pad, MAX_WINDOW)


def _gathers(kernel, stride, dilation, pad, size, out) -> bool:
    """Does im2col need a gather of overlapping windows (not a 1x1 slice, not disjoint patches)?"""
    if tuple(kernel) == (1, 1) and not any(pad):
        return False
    return not (list(stride) == list(kernel) and list(dilation) == [1, 1] and not any(pad)
                and (out[0] * kernel[0], out[1] * kernel[1]) == tuple(size))


@tvm.transform.module_pass(opt_level=0, name="Conv2dToMatmul")
class Conv2dToMatmul:
    """Rewrite the eligible ``conv2d`` / ``conv1d`` calls of every Relax function (see the module
    docstring).  With `implicit`, an NHWC ``conv2d`` whose windows overlap becomes one
    ``tvm_evt.conv2d`` op instead (`conv_op`: implicit-GEMM kernels on CUDA, whose gradient rule
    gives the two gradient ops), and its im2col gathers are never written.  With `depthwise`, an
    NHWC depthwise ``conv2d`` (``groups`` = its input channels) becomes ``tvm_evt.depthwise_conv2d``
    (`depthwise_conv_op`: direct kernels for it and its two gradients)."""

    def __init__(self, implicit: bool = False, depthwise: bool = False):
        self.implicit = implicit
        self.depthwise = depthwise

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Rewriter(mod, self.implicit, self.depthwise), mod)
