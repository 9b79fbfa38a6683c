"""ConvertConvLayout: convolutions to NHWC/OHWI, with the layout carried between them.

TVM's ``ConvertLayout`` rewrites each ``conv2d`` to NHWC input and output and OHWI weights and
carries the layout through the ops that allow it (batch-norm statistics and affine, ReLU,
residual adds), transposing only where a layout-bound op or the function's result needs NCHW.
Run before ``Conv2dToMatmul``, that makes every im2col gather channel-contiguous and removes the
NHWC<->NCHW transposes around each convolution GEMM.

Fixed after it: TVM 0.27's ``ConvertLayout`` also wraps 0-d tensors (a loss computed from NCHW
values) in ``permute_dims``, whose gradient then fails ("Index -2 out of bounds"): such identity
permutes are dropped; and the per-channel vectors of batch norm, ``[1, C, 1, 1]`` <->
``[1, 1, 1, C]``, are permuted where only unit axes move: those become reshapes, which move no
data and fuse with their neighbours; and a loss reduced over every axis of an NHWC value
(ResNet's MSE against an NCHW target) was transposed back to NCHW first (0.36 ms for 411 MB on
H100): a reduction over every axis reads the untransposed value, and so does one over some axes
where the axes it keeps stay in order (the global average pool over H and W, which ConvertLayout
wrote NCHW for: MobileNetV2's last clip stored a transposed float32 copy that a pool kernel of a
block per channel and image read, 0.05 + 0.10 ms a step on H200); and an op ConvertLayout has no
layout rule for (ReLU6's ``clip``) it keeps in NCHW between two transposes: the second transpose
is moved back through such elementwise ops, to cancel the first (``_undo``).  The pass runs only
where there is a convolution to convert, so other models keep their graph untouched.  Where
TVM's pass fails on a graph (``std::bad_alloc`` on transformers' Swin), the module stays NCHW, with
a warning.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import (POINTWISE, REDUCTIONS, has_call, mutate_relax_functions, op_name, permute_axes,
                        static_shape)

CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
# a transposed convolution keeps NCHW/IOHW: TVM's layout inference otherwise hands it an NHWC input
# from the convolution before, which neither its gradient rule nor its legalization takes
LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"], "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}
# elementwise ops a permute moves through (their other operands: scalars, or tensors of the same shape)
ELEMENTWISE = POINTWISE | {"relax.clip", "relax.astype", "tvm_evt.hardtanh"}
MAX_SINK = 16  # elementwise ops a permute is moved back through at most


@mutator
class _SimplifyPermutes(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.undone: dict = {}  # (expr, axes) -> its permute, rebuilt without one (`_undo`)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op in REDUCTIONS:
            return self._reduce_unpermuted(call)
        if call.op != PERMUTE:
            return call
        x = call.args[0]
        ndim = x.ty.ndim
        axes = list(range(ndim))[::-1] if call.attrs.axes is None else [int(a) % max(ndim, 1) for a in call.attrs.axes]
        if ndim == 0 or axes == list(range(ndim)):
            return x
        undone = self._undo(x, axes, [MAX_SINK])
        if undone is not None:
            return undone
        shape = static_shape(x)
        moved = [a for a in axes if shape is not None and shape[a] != 1]
        if shape is not None and moved == sorted(moved):  # only unit axes move: a reshape, no data movement
            return relax.op.reshape(x, [shape[a] for a in axes])
        return call

    def _undo(self, expr: relax.Expr, axes: list[int], budget: list[int]) -> relax.Expr | None:
        """``permute_dims(expr, axes)`` without a transpose, or None: where `expr` is a permute that
        `axes` inverts, its operand; where it is an elementwise op (``ELEMENTWISE``) whose tensor
        operands are all so undone, the op on the undone operands.

        TVM's ``ConvertLayout`` keeps an op without a layout rule in the original layout between
        two transposes: ReLU6's ``clip`` in MobileNetV2 (and the residual add after it) ran NCHW,
        each a transpose kernel before and after (H200, batch 128: 4 of 28 ms a step)."""
        key = (expr, tuple(axes))
        if key not in self.undone:
            self.undone[key] = self._rebuild(expr, axes, budget)
        return self.undone[key]

    def _rebuild(self, expr: relax.Expr, axes: list[int], budget: list[int]) -> relax.Expr | None:
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        if not isinstance(value, relax.Call) or budget[0] <= 0:
            return None
        budget[0] -= 1
        if value.op == PERMUTE:
            inner = permute_axes(value)
            return value.args[0] if [inner[a] for a in axes] == list(range(len(axes))) else None
        if op_name(value) not in ELEMENTWISE:
            return None
        shape, args = static_shape(value), []
        for arg in value.args:
            if not isinstance(arg.ty, relax.TensorType) or arg.ty.ndim == 0:
                args.append(arg)  # a scalar, or clip's bounds
                continue
            if shape is None or static_shape(arg) != shape:
                return None  # a broadcast operand would need its own permute
            undone = self._undo(arg, axes, budget)
            if undone is None:
                return None
            args.append(undone)
        return self.builder_.emit(relax.Call(value.op, args, value.attrs, value.ty_args))

    def _reduce_unpermuted(self, call: relax.Call) -> relax.Expr:
        """A reduction over axes A of ``permute_dims(x, p)``, or of elementwise ops of such permutes
        (``_undo``), is one over the axes ``p[a]`` of the unpermuted value, where the axes it keeps
        stay in x's order; then it reads that value, and no transpose is made for it: a reduction
        over every axis, or the global average pool ``mean(·, [2, 3])`` of an NHWC value, which
        ConvertLayout wrote NCHW (after ReLU6's clip, which it keeps NCHW) for the pool to read.
        With ``keepdims``, a reshape of the result, which moves only unit axes."""
        operand, shape = call.args[0], static_shape(call)
        p = self._permutation(operand, [MAX_SINK])
        if p is None or (call.attrs.keepdims and shape is None):
            return call
        ndim = len(p)
        reduced = list(range(ndim)) if call.attrs.axis is None else sorted(int(a) % ndim for a in call.attrs.axis)
        kept = [p[i] for i in range(ndim) if i not in reduced]
        if kept != sorted(kept):
            return call
        unpermuted = self._undo(operand, [p.index(i) for i in range(ndim)], [MAX_SINK])
        if unpermuted is None:
            return call
        axes = None if call.attrs.axis is None else sorted(p[a] for a in reduced)
        result = REDUCTIONS[call.op](unpermuted, axes, bool(call.attrs.keepdims))
        return relax.op.reshape(self.builder_.emit(result), shape) if call.attrs.keepdims else result

    def _permutation(self, expr: relax.Expr, budget: list[int]) -> list[int] | None:
        """The axes of the first permute found under `expr` through elementwise ops, or None."""
        value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr
        if not isinstance(value, relax.Call) or budget[0] <= 0:
            return None
        budget[0] -= 1
        if value.op == PERMUTE:
            return permute_axes(value)
        if op_name(value) not in ELEMENTWISE:
            return None
        for arg in value.args:
            if isinstance(arg.ty, relax.TensorType) and arg.ty.ndim == expr.ty.ndim:
                found = self._permutation(arg, budget)
                if found is not None:
                    return found
        return None


@tvm.transform.module_pass(opt_level=0, name="ConvertConvLayout")
class ConvertConvLayout:
    """NHWC/OHWI convolutions, layouts carried between them (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(isinstance(f, relax.Function) and has_call(f.body, CONV2D) for _, f in mod.functions_items()):
            return mod
        try:
            converted = relax.transform.ConvertLayout(LAYOUTS)(mod)
        except tvm.error.InternalError as err:  # TVM's pass failing on a graph leaves it NCHW
            warnings.warn(f"ConvertConvLayout: TVM's ConvertLayout failed ({str(err).strip()[:200]}); the "
                          "convolutions stay NCHW", stacklevel=2)
            return mod
        return mutate_relax_functions(_SimplifyPermutes(converted), converted)
