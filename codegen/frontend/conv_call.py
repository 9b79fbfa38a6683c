"""Read a ``Codegen="evt_conv"`` function (one ``tvm_evt.conv2d``, ``conv2d_dgrad`` or
``conv2d_wgrad`` call on its parameters) into a ``ConvCall``; what the implicit-GEMM kernels
cannot take raises ``Unsupported`` with the reason (``supported`` says it without raising).

The ops' argument conventions are those of ``tvm_evt.relax_passes.ops.conv_op`` (read by op name, so
this module does not need the ops registered)::

    conv2d(x, w, geometry)                 -> y   [N, P, Q, K]
    conv2d_dgrad(dy, w, geometry, x_shape) -> dx  [N, H, W, C]
    conv2d_wgrad(x, dy, geometry, w_shape) -> dw  [K, R, S, C]

with ``geometry`` the ``relax.ShapeExpr`` [pad_top, pad_left, pad_bottom, pad_right, stride_h,
stride_w, dilation_h, dilation_w].

What CUTLASS's SM90 implicit GEMM (``sm90_implicit_gemm_gmma_ss_warpspecialized.hpp``,
``can_implement``, TMA im2col) takes, and so what ``supported`` checks:

* channels-last operands with 16-byte aligned rows: C and K multiples of 8 (bf16 / fp16);
* paddings in [0, 128]: TMA im2col's box corners are signed 8-bit per spatial dimension in 2-D
  ([-128, 127]): the lower corner is -pad (fprop, wgrad) or pad - (R-1)·d (dgrad), the upper
  pad - (R-1)·d (fprop, wgrad) or pad_lower - (R-1)·d + H - P (dgrad);
* filter offsets (R-1)·d below 255 (unsigned 8-bit in 2-D);
* dgrad with unit strides only: the SM90 kernel has no strided dgrad (CUTLASS's own SM90 tests run
  dgrad with strides 1; the strided dgrad kernel is SM100's);
* the GEMM's im2col extent (fprop, dgrad: M = N·P·Q / N·H·W; wgrad: its K = N·P·Q) below 2^31.
"""
from __future__ import annotations

import tvm
from tvm import relax

from ..errors import Unsupported
from ..ir.conv import ConvCall
from .op_call import only_call

FPROP_OP, DGRAD_OP, WGRAD_OP = "tvm_evt.conv2d", "tvm_evt.conv2d_dgrad", "tvm_evt.conv2d_wgrad"
OPS = {FPROP_OP: "fprop", DGRAD_OP: "dgrad", WGRAD_OP: "wgrad"}
DTYPES = ("bfloat16", "float16")
ALIGNMENT = 8  # elements of 16 bytes (TMA): channel counts must be multiples
PAD_LIMIT = 128  # |box corner| of 2-D TMA im2col (signed 8 bits a dimension)
OFFSET_LIMIT = 255  # filter offset ·d of 2-D TMA im2col (unsigned 8 bits a dimension)
INT32_MAX = 2**31 - 1


def output_extent(size: int, pad_lo: int, pad_hi: int, kernel: int, stride: int, dilation: int) -> int:
    """P (or Q) of an input extent H (or W): ``1 + (H + pads - ((R-1)·d + 1)) // s`` (CUTLASS's;
    ``conv_op.Geometry.out`` asks it too)."""
    return 1 + (size + pad_lo + pad_hi - ((kernel - 1) * dilation + 1)) // stride


def supported(call: ConvCall) -> str | None:
    """None where the SM90 implicit-GEMM kernels take `call`, else why not.  Pure Python, cheap:
    the partitioner asks it of every convolution."""
    if call.kind not in OPS.values():
        return f"kind {call.kind!r} (the kernels take fprop, dgrad, wgrad)"
    if call.dtype not in DTYPES:
        return f"dtype {call.dtype} (the kernels take {', '.join(DTYPES)})"
    shapes = (call.x, call.w, call.y, call.pad, call.stride, call.dilation)
    if [len(s) for s in shapes] != [4, 4, 4, 4, 2, 2]:
        return f"x {call.x}, w {call.w}, y {call.y}, pad {call.pad}, stride {call.stride}, " \
               f"dilation {call.dilation} are not 2-D convolution shapes"
    (n, h, wd, c), (k, r, s, wc), (yn, p, q, yk) = call.x, call.w, call.y
    if min(*call.x, *call.w, *call.y) < 1 or min(*call.stride, *call.dilation) < 1 or min(call.pad) < 0:
        return f"x {call.x}, w {call.w}, y {call.y}, pad {call.pad}, stride {call.stride}, " \
               f"dilation {call.dilation} are not a valid convolution"
    (pt, pl, pb, pr), (sh, sw), (dh, dw) = call.pad, call.stride, call.dilation
    want = (n, output_extent(h, pt, pb, r, sh, dh), output_extent(wd, pl, pr, s, sw, dw), k)
    if wc != c or (yn, p, q, yk) != want:
        return f"x {call.x}, w {call.w} and y {call.y} disagree (y should be {want})"
    if c % ALIGNMENT or k % ALIGNMENT:
        return f"channels C={c}, K={k} must be multiples of {ALIGNMENT} (16-byte TMA rows)"
    if call.kind == "dgrad" and (sh, sw) != (1, 1):
        return f"dgrad with stride {call.stride} (the SM90 kernel takes unit strides only)"
    if max(call.pad) > PAD_LIMIT:
        return f"padding {call.pad} exceeds {PAD_LIMIT} (TMA im2col)"
    for kernel, dilation, lo, hi, size, out in ((r, dh, pt, pb, h, p), (s, dw, pl, pr, wd, q)):
        span = (kernel - 1) * dilation
        if span >= OFFSET_LIMIT:
            return f"filter extent (R-1)·dilation = {span} must be below {OFFSET_LIMIT} (TMA im2col)"
        corners = (lo - span, lo - span + size - out) if call.kind == "dgrad" else (-lo, hi - span)
        if not all(-PAD_LIMIT <= corner < PAD_LIMIT for corner in corners):
            return f"im2col box corners {corners} outside [-{PAD_LIMIT}, {PAD_LIMIT - 1}] (TMA im2col: " \
                   f"padding {call.pad}, dilation {call.dilation}, filter {call.w[1:3]})"
    rows = {"fprop": n * p * q, "dgrad": n * h * wd, "wgrad": n * p * q}[call.kind]
    if rows > INT32_MAX:
        return f"the implicit GEMM's im2col extent {rows} exceeds 2^31 - 1"
    return None


def _tensor_shape(expr, what: str, op: str) -> tuple[int, int, int, int]:
    try:
        shape = tuple(int(d) for d in expr.ty.shape)
    except (TypeError, AttributeError) as err:
        raise Unsupported(f"{op}: {what} has no static shape") from err
    if len(shape) != 4:
        raise Unsupported(f"{op}: {what} must be 4-D, got {list(shape)}")
    return shape


def _ints(expr, what: str, op: str, count: int) -> tuple[int, ...]:
    if not isinstance(expr, relax.ShapeExpr):
        raise Unsupported(f"{op}: {what} must be a constant shape expression, got {type(expr).__name__}")
    try:
        values = tuple(int(v) for v in expr.values)
    except TypeError as err:
        raise Unsupported(f"{op}: {what} must be static, got {expr}") from err
    if len(values) != count:
        raise Unsupported(f"{op}: {what} must have {count} values, got {list(values)}")
    return values


def conv_of_call(call: relax.Call, symbol: str = "conv") -> ConvCall:
    """The ``ConvCall`` of one op call (tensor arguments may be any expressions); raises
    ``Unsupported`` naming the op where the kernels cannot take it (``supported``'s reason)."""
    op = call.op.name if isinstance(call.op, tvm.ir.Op) else None
    if op not in OPS:
        raise Unsupported(f"{op or call.op} is not a convolution op")
    kind = OPS[op]
    expect = 3 if kind == "fprop" else 4
    if len(call.args) != expect:
        raise Unsupported(f"{op}: expected {expect} arguments, got {len(call.args)}")
    names = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}[kind]
    a, b = (_tensor_shape(arg, name, op) for arg, name in zip(call.args[:2], names))
    dtypes = {str(arg.ty.dtype) for arg in call.args[:2]}
    if len(dtypes) != 1:
        raise Unsupported(f"{op}: {names[0]} and {names[1]} have different dtypes {sorted(dtypes)}")
    geometry = _ints(call.args[2], "geometry", op, 8)
    if kind == "fprop":
        x, w = a, b
        y = (x[0], output_extent(x[1], geometry[0], geometry[2], w[1], geometry[4], geometry[6]),
             output_extent(x[2], geometry[1], geometry[3], w[2], geometry[5], geometry[7]), w[0])
    elif kind == "dgrad":
        y, w, x = a, b, _ints(call.args[3], "x_shape", op, 4)
    else:
        x, y, w = a, b, _ints(call.args[3], "w_shape", op, 4)
    spec = ConvCall(symbol=symbol, kind=kind, dtype=dtypes.pop(), x=x, w=w, y=y, pad=geometry[:4],
                    stride=geometry[4:6], dilation=geometry[6:])
    reason = supported(spec)
    if reason is not None:
        raise Unsupported(f"{op}: {reason}")
    return spec


def conv_of_function(func: relax.Function) -> ConvCall:
    """The ``ConvCall`` of a partition function: one op call whose tensor arguments are the
    function's parameters in ``ConvCall.inputs`` order (the DPS order the entry binds), its other
    arguments constant shapes."""
    symbol, call, _ = only_call(func, OPS, "convolution")
    spec = conv_of_call(call, symbol)
    if len(func.params) != 2 or not all(arg.same_as(p) for arg, p in zip(call.args[:2], func.params)):
        raise Unsupported(f"{symbol}: the call's tensor arguments must be the parameters {spec.inputs} in order")
    return spec
