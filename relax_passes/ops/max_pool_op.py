"""``tvm_evt.max_pool2d_backward(dy, x, y, window)``: the input gradient of a 2-D max pooling whose
windows overlap or leave gaps (ResNet's 3x3/2 stem pool), as two gathers.

``window`` is the shape expression ``[kh, kw, sh, sw, dh, dw, pt, pl, pb, pr, h_axis, w_axis]``
(kernel, strides, dilations, paddings top / left / bottom / right, the spatial axes of the 4-D
layout); ``x`` is the pooling's input, ``y`` its output and ``dy`` the output's gradient.  The
gradient of each window goes to its first tap, in scan order, whose value equals the window's
maximum (the padding counting as the dtype's lowest value), as torch routes it:

* ``first`` (one kernel over y): that tap's index ``i·kw + j`` for each window, ``kh·kw`` where
  no tap equals (a NaN window): a chain of selects over the taps, int8;
* ``gather`` (one kernel over x): each input element sums, in float32, ``dy`` over the windows
  that contain it and chose it: at most ``((kh-1)·dh // sh + 1) · ((kw-1)·dw // sw + 1)`` windows
  (4 for a 3x3/2 pool).  Window indices are clamped into the output so every load is in bounds;
  the select drops those that do not contain the element.

Both are injective: on CUDA ``VectorizedElementwise`` takes ``first`` channels-last (8 channels a
thread), and the channels-last ``gather`` has a form of its own (``gpu_gather``: each candidate
window's dy and taps loaded into registers as one vector).  Why: the general rule
(``gradient_rules._pool_grad``) writes one strided comparison and one zero-interleaving scatter
per tap, and they fuse with the input gradient's GEMM: on ResNet-50 at batch 128 (H200) the nine
"taken" masks took 0.70 ms a step, the GEMM's epilogue storing nine masked gradients 0.39 ms
(0.04 as a plain GEMM) and their scatter and sum 0.56 ms.  The two kernels take 0.13 + 0.31 ms
against 0.97 ms for torch's ``max_pool2d_with_indices_backward`` (``docs/bench/h200-2026-12-01c/``).
Both are opaque to ``FuseOps``: ``gather`` reads each of ``dy`` and ``first`` up to four times,
which a fused producer would compute again each time.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm import relax, s_tir, te, tirx

from .._rewrite import OPAQUE, emit_call_tir
from ..training.gradient_rules import register_op

OP = "tvm_evt.max_pool2d_backward"
F32 = "float32"
GATHER_ATTR = "tvm_evt.max_pool_gather"  # {"x", "y", "window", "dtype", "index"}: the gather's spec
THREADS = 256  # threads a block of the gather's CUDA form
VECTOR_BYTES = 16


@dataclasses.dataclass(frozen=True)
class Window:
    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pad: tuple[int, int, int, int]  # top, left, bottom, right
    axes: tuple[int, int]  # the H and W axes of the 4-D layout

    def expr(self) -> relax.ShapeExpr:
        return relax.ShapeExpr([*self.kernel, *self.stride, *self.dilation, *self.pad, *self.axes])

    @staticmethod
    def of(expr: relax.Expr) -> "Window":
        if not isinstance(expr, relax.ShapeExpr):
            raise ValueError(f"{OP}: the window must be a constant shape expression, got {type(expr).__name__}")
        v = [int(e) for e in expr.values]
        if len(v) != 12 or min(v[:6]) < 1 or min(v[6:10]) < 0 or sorted(v[10:]) != v[10:] or v[10] == v[11] \
                or not set(v[10:]) <= {0, 1, 2, 3}:
            raise ValueError(f"{OP}: window must be [kh, kw, sh, sw, dh, dw, 4 paddings >= 0, H axis < W axis], got {v}")
        return Window(tuple(v[0:2]), tuple(v[2:4]), tuple(v[4:6]), tuple(v[6:10]), tuple(v[10:12]))

    def reach(self, axis: int) -> int:
        """Windows along spatial `axis` (0: H, 1: W) that can contain one input position."""
        return (self.kernel[axis] - 1) * self.dilation[axis] // self.stride[axis] + 1

    def along(self, axis: int) -> tuple[int, int, int, int]:
        """(taps, stride, dilation, padding before) along spatial `axis` (0: H, 1: W)."""
        return self.kernel[axis], self.stride[axis], self.dilation[axis], self.pad[axis]


def max_pool2d_backward(dy: relax.Expr, x: relax.Expr, y: relax.Expr, window: Window) -> relax.Call:
    return relax.Call(tvm.ir.Op.get(OP), [dy, x, y, window.expr()])


def _shapes(call: relax.Call) -> tuple[list[int], list[int], Window]:
    dy, x, y = call.args[:3]
    shapes = []
    for arg, name in ((dy, "dy"), (x, "x"), (y, "y")):
        ty = arg.ty
        if not isinstance(ty, relax.TensorType) or ty.ndim != 4 or not all(isinstance(d, tirx.IntImm) for d in ty.shape):
            raise ValueError(f"{OP}: {name} must be a 4-D tensor of static shape, got {ty}")
        shapes.append([int(d) for d in ty.shape])
    window = Window.of(call.args[3])
    if shapes[0] != shapes[2]:
        raise ValueError(f"{OP}: dy {shapes[0]} and y {shapes[2]} differ in shape")
    if len({str(a.ty.dtype) for a in (dy, x, y)}) != 1:
        raise ValueError(f"{OP}: dy, x and y must share one dtype, got {[str(a.ty.dtype) for a in (dy, x, y)]}")
    x_shape, y_shape = shapes[1], shapes[2]
    if any(x_shape[a] != y_shape[a] for a in range(4) if a not in window.axes):
        raise ValueError(f"{OP}: x {x_shape} and y {y_shape} differ off the spatial axes {window.axes}")
    return x_shape, y_shape, window


def _infer(call: relax.Call, _bb) -> relax.TensorType:
    x_shape, _, _ = _shapes(call)
    return relax.TensorType(x_shape, str(call.args[1].ty.dtype))


def first_tap_tensors(x_shape, y_shape, window: Window, dtype: str) -> list[te.Tensor]:
    """x, y and, for each window, the index of its first tap equal to its maximum (``OP``)."""
    (kh, kw), (sh, sw), (dh, dw), (pt, pl, _, _), (ah, aw) = (window.kernel, window.stride, window.dilation,
                                                              window.pad, window.axes)
    taps = kh * kw
    index = "int8" if taps < 127 else "int32"
    x = te.placeholder(x_shape, dtype, name="x")
    y = te.placeholder(y_shape, dtype, name="y")

    def first(*i):
        i = list(i)
        found = tirx.const(taps, index)
        for t in reversed(range(taps)):  # the earliest equal tap is the outermost select
            at = list(i)
            at[ah] = i[ah] * sh - pt + (t // kw) * dh
            at[aw] = i[aw] * sw - pl + (t % kw) * dw
            inside = tirx.all(at[ah] >= 0, at[ah] < x_shape[ah], at[aw] >= 0, at[aw] < x_shape[aw])
            value = tirx.if_then_else(inside, x[tuple(at)], tirx.min_value(dtype))
            found = tirx.Select(value == y[tuple(i)], tirx.const(t, index), found)
        return found

    return [x, y, te.compute(y_shape, first, name="first")]


def _windows(pos, window: Window, axis: int, out: int, j):
    """Candidate `j` (0 .. reach-1; an int or an index expression) of the windows along spatial
    `axis` (0: H, 1: W; `out` windows) that may contain input position `pos`: (its index clamped
    into the output, whether it contains `pos`, the tap `pos` is in it)."""
    taps, stride, dil, pad = window.along(axis)
    padded = pos + pad
    o = tirx.floordiv(padded, stride) - j
    offset = padded - o * stride  # >= 0: o <= padded // stride
    ok = [o >= 0, o < out, offset < taps * dil] + ([tirx.floormod(offset, dil) == 0] if dil > 1 else [])
    tap = tirx.floordiv(offset, dil) if dil > 1 else offset
    return tirx.max(tirx.min(o, out - 1), 0), tirx.all(*ok), tap


def _chosen(first_at, dy_at, i, window: Window, y_shape, index: str, dtype: str):
    """dx at input index `i`: the float32 sum over the candidate windows (jh, jw) of dy where the
    window contains `i` and chose it; `first_at(at, j)` and `dy_at(at, j)` read candidate j's
    (``j = jh · reach_w + jw``) window `at` (i with its spatial indices replaced)."""
    (ah, aw), kw = window.axes, window.kernel[1]
    total = None
    for jh in range(window.reach(0)):
        oh, ok_h, th = _windows(i[ah], window, 0, y_shape[ah], jh)
        for jw in range(window.reach(1)):
            ow, ok_w, tw = _windows(i[aw], window, 1, y_shape[aw], jw)
            at = list(i)
            at[ah], at[aw] = oh, ow
            j = jh * window.reach(1) + jw
            tap = th * kw + tw  # int64, and outside 0..kh·kw-1 where the window does not contain i
            chose = tirx.all(ok_h, ok_w, first_at(at, j).astype("int64") == tap)
            term = tirx.Select(chose, dy_at(at, j).astype(F32), tirx.const(0.0, F32))
            total = term if total is None else total + term
    return total.astype(dtype)


def gather_tensors(x_shape, y_shape, window: Window, dtype: str, index: str) -> list[te.Tensor]:
    """dy, the first taps and dx: each input element's sum of dy over the windows that chose it."""
    dy = te.placeholder(y_shape, dtype, name="dy")
    first = te.placeholder(y_shape, index, name="first")
    dx = te.compute(x_shape, lambda *i: _chosen(lambda at, _: first[tuple(at)], lambda at, _: dy[tuple(at)], list(i),
                                                window, y_shape, index, dtype), name="dx")
    return [dy, first, dx]


def gather_lanes(x_shape, window: Window, dtype: str) -> int:
    """Channels a thread of the gather's CUDA form takes as one 16-byte vector: the layout must be
    channels-last (both spatial axes before the innermost) with the channels a multiple of them; 0
    where it is not (DLight's rules take the portable form)."""
    lanes = VECTOR_BYTES // (tvm.DataType(dtype).bits // 8)
    return lanes if window.axes == (1, 2) and x_shape[3] % lanes == 0 else 0


def gpu_gather(spec: dict) -> tirx.PrimFunc:
    """The gather's CUDA form (channels-last): a thread takes one input pixel's `lanes` channels.
    The windows it may be in (clamped into the output) are read into registers first, dy as one
    16-byte vector a window and the first taps as one 8-byte one (``dyw``, ``tapw``: [N, H, W, J,
    C] stages computed at the thread), then each channel's sum is made in float32 and the result
    stored as one vector.  The portable form reads each window's dy and tap element by element
    (VectorizedElementwise stages a value read at several places): ResNet-50's stem pool, batch
    128 on H200, 0.64 ms for 205 MB written."""
    x_shape, y_shape, dtype, index = spec["x"], spec["y"], spec["dtype"], spec["index"]
    window = Window.of(relax.ShapeExpr(spec["window"]))
    (ah, aw), reach_w, count = window.axes, window.reach(1), window.reach(0) * window.reach(1)
    lanes = gather_lanes(x_shape, window, dtype)
    dy = te.placeholder(y_shape, dtype, name="dy")
    first = te.placeholder(y_shape, index, name="first")
    n, h, w, c = x_shape

    def window_of(b, i, j, jj, ch):
        oh = _windows(i, window, 0, y_shape[ah], tirx.floordiv(jj, reach_w))[0]
        ow = _windows(j, window, 1, y_shape[aw], tirx.floormod(jj, reach_w))[0]
        return b, oh, ow, ch

    staged = (n, h, w, count, c)
    dyw = te.compute(staged, lambda b, i, j, jj, ch: dy[window_of(b, i, j, jj, ch)], name="dyw")
    tapw = te.compute(staged, lambda b, i, j, jj, ch: first[window_of(b, i, j, jj, ch)], name="tapw")
    dx = te.compute(x_shape, lambda *i: _chosen(lambda at, j: tapw[i[0], i[1], i[2], j, i[3]],
                                                lambda at, j: dyw[i[0], i[1], i[2], j, i[3]], list(i), window,
                                                y_shape, index, dtype), name="dx")
    sch = s_tir.Schedule(te.create_prim_func([dy, first, dx]))
    compute = sch.get_sblock("dx")
    store = sch.cache_write(compute, 0, "local")
    b, i, j, ch = sch.get_loops(store)
    co, lane = sch.split(ch, [None, lanes])
    bx, tx = sch.split(sch.fuse(b, i, j, co), [None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lane)
    sch.compute_at(compute, tx)
    for loop in sch.get_loops(compute)[2:]:
        sch.unroll(loop)
    for name in ("dyw", "tapw"):
        stage = sch.get_sblock(name)
        sch.compute_at(stage, tx)
        sch.set_scope(stage, 0, "local")
        *outer, candidates, channels = sch.get_loops(stage)
        sch.unroll(candidates)
        sch.vectorize(channels)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).without_attr("global_symbol")


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The CUDA form of a gather tagged ``GATHER_ATTR`` (``ScheduleTIRForGPU``)."""
    return gpu_gather(json.loads(str(func.attrs[GATHER_ATTR])))


def _primfunc(tensors: list[te.Tensor]) -> tirx.PrimFunc:
    return te.create_prim_func(tensors).without_attr("global_symbol").with_attr("op_pattern", OPAQUE)


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x_shape, y_shape, window = _shapes(call)
    dy, x, y = call.args[:3]
    dtype = str(x.ty.dtype)
    x_t, y_t, first = first_tap_tensors(x_shape, y_shape, window, dtype)
    index = str(first.dtype)
    gv = bb.add_func(_primfunc([x_t, y_t, first]), "max_pool2d_first_tap")
    (taps,) = emit_call_tir(bb, gv, [x, y], [relax.TensorType(y_shape, index)])
    gather = _primfunc(gather_tensors(x_shape, y_shape, window, dtype, index))
    # channels-last with int8 taps (its 8-byte vectors; windows of 127 taps or more take int32):
    # ScheduleTIRForGPU swaps in gpu_gather
    if index == "int8" and gather_lanes(x_shape, window, dtype):
        spec = {"x": x_shape, "y": y_shape, "window": [int(v) for v in window.expr().values], "dtype": dtype,
                "index": index}
        gather = gather.with_attr(GATHER_ATTR, json.dumps(spec))
    gv = bb.add_func(gather, "max_pool2d_backward")
    (out,) = emit_call_tir(bb, gv, [dy, taps], [relax.TensorType(x_shape, dtype)])
    return out


register_op(OP, "the input gradient of a 2-D max pooling, as a gather of each window's first maximum",
            _infer, _legalize)


def applies(layout: str, kernel, strides, padding, dilation) -> Window | None:
    """The window of a ``relax.nn.max_pool2d`` (`padding`: top, left, bottom, right) that this op
    takes: a 4-D layout with its spatial axes in order (NCHW, NHWC); None otherwise."""
    if len(layout) != 4 or sorted(layout) != sorted("NCHW") or len(padding) != 4:
        return None
    axes = (layout.index("H"), layout.index("W"))
    if axes[0] > axes[1]:
        return None
    return Window(tuple(int(k) for k in kernel), tuple(int(s) for s in strides), tuple(int(d) for d in dilation),
                  tuple(int(p) for p in padding), axes)
