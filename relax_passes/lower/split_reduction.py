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

from .._rewrite import binding_uses, mutate_relax_functions, op_name, producer, static_shape
from ..partition.evt_cost import tensor_bytes
from .recompute_elementwise import CHEAP

RESHAPE = tvm.ir.Op.get("relax.reshape")
# elementwise ops a split reduction's view is pushed above (``_Splitter._view``), at most MAX_PUSH deep:
# the ones RecomputeElementwise copies into each reader
ELEMENTWISE = CHEAP
MAX_PUSH = 16

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
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.readers: dict = {}  # var -> the bindings that read it, in the function being rewritten

    def prime(self, func: relax.Function) -> None:
        self.readers = {v: set(i) for v, i in binding_uses(func).items()}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) not in REDUCTIONS:
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
        parts = self._view(x, [reduced // c, c] + rest)
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

    # -- the reduced input as a view of the split shape
    def _elementwise(self, x: relax.Expr, depth: int, view: list[int]) -> relax.Call | None:
        """The elementwise call (``ELEMENTWISE``) bound to `x`, within ``MAX_PUSH`` ops of the
        reduction, whose other operands are scalar constants or broadcasts that stay broadcasts
        in the split `view` (``_operand_view``), else None."""
        if depth >= MAX_PUSH or not isinstance(x, relax.Var):
            return None
        call = self.lookup_binding(x)
        if op_name(call) not in ELEMENTWISE:
            return None
        shape = static_shape(x)
        if all(static_shape(a) == shape or _is_scalar(a) or _operand_view(a, shape, view) is not None
               for a in call.args):
            return call
        return None

    def _leaves(self, x: relax.Expr, view: list[int], depth: int = 0) -> list:
        call = self._elementwise(x, depth, view)
        if call is None:
            return [x]
        return [leaf for a in call.args if not _is_scalar(a) for leaf in self._leaves(a, view, depth + 1)]

    def _view(self, x: relax.Expr, shape: list[int], depth: int = 0, made: dict | None = None) -> relax.Expr:
        """``reshape(x, shape)``, pushed above the elementwise ops that make `x` (batch norm's
        ``x*x``, a widening cast, a weight gradient's ``dy*x``) when the reduction is `x`'s only
        reader or they read no more bytes than `x` has: reshaped after them (an injective op),
        they were a kernel of their own writing a copy; reshaped before, the reshape is a view
        and FuseOps puts them into the reduction's kernel."""
        made = {} if made is None else made  # each value viewed once (x * x)
        if x in made:
            return made[x]
        call = self._elementwise(x, depth, shape)  # shape = [R / c, c] + the kept axes
        if call is not None and depth == 0 and len(self.readers.get(x, ())) != 1 \
                and sum(tensor_bytes(leaf) for leaf in set(self._leaves(x, shape))) > tensor_bytes(x):
            call = None  # `x` is written for other readers anyway: reading it costs less
        if call is None:
            inner = producer(self, x, RESHAPE)  # a reshape of a reshape is one view
            view = self.builder_.emit(relax.op.reshape(inner.args[0] if inner is not None else x, shape))
        else:
            args = []
            for a in call.args:
                if _is_scalar(a):
                    args.append(a)
                elif static_shape(a) != static_shape(x):  # a broadcast operand
                    args.append(self.builder_.emit(relax.op.reshape(a, _operand_view(a, static_shape(x), shape))))
                else:
                    args.append(self._view(a, shape, depth + 1, made))
            view = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
        made[x] = view
        return view


def _is_scalar(expr: relax.Expr) -> bool:
    """A constant of one element and no more axes than a split reduction's input view."""
    return isinstance(expr, tvm.ir.GenericConst) and expr.value.numpy().size == 1 and expr.value.numpy().ndim <= 1


def _operand_view(expr: relax.Expr, shape: tuple, view: list[int]) -> list[int] | None:
    """The split view of an operand broadcast to the reduced input's `shape`, when it stays a
    broadcast there (`view` = ``[R / c, c] + kept axes``), else None:

    * a statistic of the kept axes (batch norm's ``[1, 1, 1, C]``): ``[1, 1] + kept``;
    * a statistic of the rows (a layer norm's ``mean``, ``[..., 1]``) where the last axis is the
      only one kept: ``[R / c, c, 1]``;
    * everything reduced, the chunk one row (``c`` = the last extent): a row statistic or a vector
      along the last axis (a layer norm's ``gamma``), ``[R / c or 1, c or 1]``."""
    own = static_shape(expr)
    if own is None or len(own) != len(shape) or own == tuple(shape):
        return None
    kept = len(view) - 2
    if all(d == 1 for d in own[: len(own) - kept]) and own[len(own) - kept:] == shape[len(shape) - kept:]:
        return [1, 1] + view[2:]
    if kept == 1 and own[:-1] == shape[:-1] and own[-1] == 1:
        return view[:2] + [1]
    if kept == 0 and view[1] == shape[-1] and own[-1] in (1, shape[-1]):
        if all(d == 1 for d in own[:-1]) or own[:-1] == shape[:-1]:
            return [view[0] if own[:-1] == shape[:-1] else 1, view[1] if own[-1] != 1 else 1]
    return None


@tvm.transform.module_pass(opt_level=0, name="SplitReduction")
class SplitReduction:
    """Split long few-output reductions of every Relax function into two stages."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        splitter = _Splitter(mod)
        return mutate_relax_functions(splitter, mod, before_each=splitter.prime)
