"""SplitReduction: large reductions to few outputs as two reductions, in float32.

DLight schedules a reduction by its outputs: a block per output row, or a thread per output
column.  A reduction with few outputs and a long reduced extent leaves the GPU idle, and one that
also has an epilogue (``mean``: sum then divide, to a 0-d output) is taken by no rule at all and
runs on a single GPU thread: on H100 the MSE loss of a BERT-Large layer (``mean`` of 16.7 M
elements) took ~30 s per call that way.  Bias and LayerNorm-weight gradients (``sum`` over 16384
token rows to 1024 columns) got 64 blocks.

Here ``sum`` / ``mean`` / ``max`` / ``min`` over all axes, or over a leading prefix of the axes,
with a long reduced extent ``R`` and few kept elements ``O``, becomes

    x[R, O] -> reshape [R / c, c, O] -> reduce axis 1 -> [R / c, O] -> reduce axis 0 -> [O]

with the chunk ``c`` chosen so the first stage has enough partial results to fill the GPU; both
stages are ones DLight schedules well (row reductions by cross-thread reduction, column reductions
with a thread per partial).  ``sum`` and ``mean`` of 16-bit tensors accumulate in float32 (TVM's
legalisation of a bf16 ``sum`` accumulates in bf16: 16384 bias-gradient terms lose most of their
bits) and cast the result back; ``mean`` divides the float32 sum by ``R``.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._rewrite import mutate_relax_functions, producer, static_shape

RESHAPE = tvm.ir.Op.get("relax.reshape")

# op name -> (relax builder, its stages are sums) ; mean is a sum divided by the count
REDUCTIONS = {
    "relax.sum": (relax.op.sum, True),
    "relax.mean": (relax.op.sum, True),
    "relax.max": (relax.op.max, False),
    "relax.min": (relax.op.min, False),
}
MIN_REDUCED = 4096  # shorter reductions are cheap in one pass
MAX_KEPT = 16384  # more outputs than this already give DLight enough parallel work
TARGET_PARTIALS = 1 << 17  # first-stage partial results wanted (threads of a column reduction)
ROW_CHUNK = 1024  # elements each first-stage partial reduces when everything is reduced
MIN_CHUNK = 16


def _reduced_prefix(call: relax.Call, ndim: int) -> int | None:
    """k when the call reduces axes 0..k-1 (all axes: k = ndim), else None."""
    axis = call.attrs.axis
    if axis is None:
        return ndim
    axes = sorted(int(a) % ndim for a in axis)
    return len(axes) if axes == list(range(len(axes))) else None


def chunk(reduced: int, kept: int) -> int | None:
    """Elements each first-stage partial reduces: a divisor of ``reduced``, or None (no split)."""
    if reduced < MIN_REDUCED or kept > MAX_KEPT:
        return None
    want = ROW_CHUNK if kept == 1 else max(MIN_CHUNK, reduced * kept // TARGET_PARTIALS)
    want = min(want, reduced // 2)
    for c in range(want, MIN_CHUNK - 1, -1):
        if reduced % c == 0:
            return c
    return None


@mutator
class _Splitter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in REDUCTIONS:
            return call
        x = call.args[0]
        shape, out_shape = static_shape(x), static_shape(call)
        if shape is None or out_shape is None or not shape:
            return call
        k = _reduced_prefix(call, len(shape))
        if k is None or k == 0:
            return call
        reduced, rest = math.prod(shape[:k]), list(shape[k:])
        c = chunk(reduced, math.prod(rest))
        if c is None:
            return call
        reduce, is_sum = REDUCTIONS[call.op.name]
        dtype, out_dtype = str(x.ty.dtype), str(call.ty.dtype)
        acc = "float32" if is_sum and dtype in ("bfloat16", "float16") else dtype
        emit = self.builder_.emit
        # reshape first, then cast: the reshape stays a view and FuseOps puts the (elementwise)
        # cast into the reduction's kernel; cast first, the injective reshape stopped that and a
        # float32 copy of the whole input was written (BERT-Large: 6 such copies, 0.57 ms a step)
        inner = producer(self, x, RESHAPE)  # a reshape of a reshape is one view
        parts = emit(relax.op.reshape(inner.args[0] if inner is not None else x, [reduced // c, c] + rest))
        src = emit(relax.op.astype(parts, acc)) if acc != dtype else parts
        partial = emit(reduce(src, axis=[1]))
        out = emit(reduce(partial, axis=[0]))
        if call.op.name == "relax.mean":
            out = emit(relax.op.divide(out, relax.const(float(reduced), acc)))
        if acc != out_dtype:
            out = emit(relax.op.astype(out, out_dtype))
        if tuple(rest) != out_shape:  # keepdims
            out = relax.op.reshape(out, out_shape)
        return out


@tvm.transform.module_pass(opt_level=0, name="SplitReduction")
class SplitReduction:
    """Split long few-output reductions of every Relax function into two stages."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Splitter(mod), mod)
