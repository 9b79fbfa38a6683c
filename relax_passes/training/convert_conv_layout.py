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
H100): a reduction over every axis reads the untransposed value.  The pass runs only where there
is a convolution to convert, so other models keep their graph untouched.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import has_call, mutate_relax_functions, producer, static_shape

CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
LAYOUTS = {"relax.nn.conv2d": ["NHWC", "OHWI"]}
# reductions whose result over every axis does not depend on the operand's layout
FULL_REDUCTIONS = tuple(tvm.ir.Op.get(f"relax.{name}") for name in ("sum", "mean", "max", "min", "prod"))


@mutator
class _SimplifyPermutes(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op in FULL_REDUCTIONS:
            return self._reduce_unpermuted(call)
        if call.op != PERMUTE:
            return call
        x = call.args[0]
        ndim = x.ty.ndim
        axes = list(range(ndim))[::-1] if call.attrs.axes is None else [int(a) % max(ndim, 1) for a in call.attrs.axes]
        if ndim == 0 or axes == list(range(ndim)):
            return x
        shape = static_shape(x)
        moved = [a for a in axes if shape is not None and shape[a] != 1]
        if shape is not None and moved == sorted(moved):  # only unit axes move: a reshape, no data movement
            return relax.op.reshape(x, [shape[a] for a in axes])
        return call

    def _reduce_unpermuted(self, call: relax.Call) -> relax.Expr:
        """A reduction over every axis reads its operand in any order: skip a transpose before it."""
        permute = producer(self, call.args[0], PERMUTE)
        ndim = call.args[0].ty.ndim
        axes = call.attrs.axis
        if permute is None or (axes is not None and sorted(int(a) % ndim for a in axes) != list(range(ndim))):
            return call
        return relax.Call(call.op, [permute.args[0], *call.args[1:]], call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="ConvertConvLayout")
class ConvertConvLayout:
    """NHWC/OHWI convolutions, layouts carried between them (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not any(isinstance(f, relax.Function) and has_call(f.body, CONV2D) for _, f in mod.functions_items()):
            return mod
        mod = relax.transform.ConvertLayout(LAYOUTS)(mod)
        return mutate_relax_functions(_SimplifyPermutes(mod), mod)
