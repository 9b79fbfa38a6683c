"""EliminateReduction: reassociate what feeds a reduction so that the reduction shrinks or goes.

A reduction is a kernel boundary for epilogue fusion (EVT reduces only in the epilogue of the
producing GEMM, along a row or a column).  This pass removes reductions that need not exist and
moves loop-invariant factors out of the ones that do.  For ``r = sum(t, A)`` (``mean`` alike):

* ``t = sum(x, B)``                    → one ``sum(x, B ∪ A)`` (sum of a sum; mean of a mean);
* ``t = a * b`` or ``a / b`` with ``b`` constant along every axis of ``A`` (a broadcast dim or
  a scalar)                            → ``sum(a, A) * b`` / ``sum(a, A) / b``;
* ``t = broadcast_to(x, S)`` with ``x`` of extent 1 on ``A``  → ``x * |A|`` (mean: ``x``);
* every axis of ``A`` has extent 1     → ``reshape(t)``, no reduction at all;
* ``t = where(iota == idx, u, 0)`` along the single axis ``A`` (the one-hot of
  DecomposeCrossEntropy) with ``u``, ``idx`` of extent 1 there  → ``u``: the sum of a one-hot
  (of its cast ``astype(..., d)``: ``astype(u, d)``; mixed precision casts a bf16 NLL's one-hot
  gradient to float32 for the log-softmax gradient, which sums it over the vocabulary).

``collapse_sum_to(x, s)`` (Gradient's reduction of a broadcast operand) becomes ``x`` when the
shapes agree and otherwise the explicit ``sum`` over the broadcast axes plus a reshape, so the
rules above and the partitioner see a plain row/column reduction.  Results keep their shape;
when the new expression has another (but equally sized) shape a ``reshape`` restores it.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, producer, static_shape as _shape

SUM = tvm.ir.Op.get("relax.sum")
MEAN = tvm.ir.Op.get("relax.mean")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
DIVIDE = tvm.ir.Op.get("relax.divide")
BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")
COLLAPSE_SUM_TO = tvm.ir.Op.get("relax.collapse_sum_to")
WHERE = tvm.ir.Op.get("relax.where")
EQUAL = tvm.ir.Op.get("relax.equal")
ARANGE = tvm.ir.Op.get("relax.arange")
RESHAPE = tvm.ir.Op.get("relax.reshape")
ASTYPE = tvm.ir.Op.get("relax.astype")

REDUCE = {SUM: relax.op.sum, MEAN: relax.op.mean}


def _aligned(shape: tuple[int, ...], ndim: int) -> tuple[int, ...] | None:
    """`shape` right-aligned to rank `ndim` (numpy broadcasting), or None if it is longer."""
    return (1,) * (ndim - len(shape)) + shape if len(shape) <= ndim else None


def _reduce_axes(call: relax.Call, ndim: int) -> list[int]:
    axis = call.attrs.axis
    return list(range(ndim)) if axis is None else sorted({int(a) % ndim for a in axis})


def _is_zero(expr: relax.Expr) -> bool:
    if not isinstance(expr, tvm.ir.GenericConst):
        return False
    value = expr.value.numpy()
    return value.ndim == 0 and float(value) == 0.0


@mutator
class _ReductionEliminator(PyExprMutator):
    def _producer(self, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        return producer(self, expr, op)

    def _fit(self, expr: relax.Expr, out: tuple[int, ...]) -> relax.Expr:
        """`expr` with shape `out` (same element count) — a reshape if it differs."""
        expr = self.builder_.normalize(expr)
        if _shape(expr) == out:
            return expr
        return relax.op.reshape(self.builder_.emit(expr) if isinstance(expr, relax.Call) else expr, out)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == COLLAPSE_SUM_TO:
            return self._collapse_sum(call)
        if call.op in REDUCE:
            return self._reduce(call)
        return call

    def _collapse_sum(self, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        src, out = _shape(x), _shape(call)
        if src is None or out is None:
            return call
        if src == out:
            return x
        target = _aligned(out, len(src))
        axes = [a for a in range(len(src)) if target[a] == 1 and src[a] != 1]
        axes += [a for a in range(len(src) - len(out))]
        return self._fit(relax.op.sum(x, sorted(set(axes)), keepdims=False), out)

    def _reduce(self, call: relax.Call) -> relax.Expr:
        t = call.args[0]
        src, out = _shape(t), _shape(call)
        if src is None or out is None:
            return call
        axes = _reduce_axes(call, len(src))
        keepdims = bool(call.attrs.keepdims)
        if all(src[a] == 1 for a in axes):
            return self._fit(t, out)
        for rule in (self._nested, self._factor_out, self._broadcast, self._one_hot):
            new = rule(call, t, src, axes, keepdims, out)
            if new is not None:
                return new
        return call

    def _nested(self, call, t, src, axes, keepdims, out):
        inner = self._producer(t, call.op)
        if inner is None:
            return None
        x = inner.args[0]
        xshape = _shape(x)
        if xshape is None:
            return None
        first = _reduce_axes(inner, len(xshape))
        kept = list(range(len(xshape))) if inner.attrs.keepdims else [
            a for a in range(len(xshape)) if a not in first
        ]
        union = sorted(set(first) | {kept[a] for a in axes})
        return self._fit(REDUCE[call.op](x, union, keepdims=False), out)

    def _factor_out(self, call, t, src, axes, keepdims, out):
        for op in (MULTIPLY, DIVIDE):
            prod = self._producer(t, op)
            if prod is None:
                continue
            for i in (1, 0) if op == MULTIPLY else (1,):
                a, b = prod.args[1 - i], prod.args[i]
                ashape, bshape = _shape(a), _shape(b)
                if ashape != src or bshape is None:
                    continue
                bfull = _aligned(bshape, len(src))
                if bfull is None or any(bfull[x] != 1 for x in axes):
                    continue
                reduced = self.builder_.emit(REDUCE[call.op](a, axes, keepdims=keepdims))
                if not keepdims:
                    b = self._fit(b, tuple(e for x, e in enumerate(bfull) if x not in axes))
                    b = self.builder_.emit(b) if isinstance(b, relax.Call) else b
                return relax.Call(op, [reduced, b]) if i == 1 else relax.Call(op, [b, reduced])
        return None

    def _broadcast(self, call, t, src, axes, keepdims, out):
        bcast = self._producer(t, BROADCAST_TO)
        if bcast is None:
            return None
        x = bcast.args[0]
        xshape = _shape(x)
        xfull = None if xshape is None else _aligned(xshape, len(src))
        if xfull is None or any(xfull[a] != 1 for a in axes):
            return None
        if call.op == SUM:
            count = math.prod(src[a] for a in axes)
            x = self.builder_.emit(relax.op.multiply(x, relax.const(count, str(x.ty.dtype))))
        kept = [1 if a in axes else e for a, e in enumerate(src)]
        if math.prod(xshape) != math.prod(kept):  # x is also broadcast along kept axes
            x = self.builder_.emit(relax.op.broadcast_to(x, kept))
        return self._fit(x, out)

    def _one_hot(self, call, t, src, axes, keepdims, out):
        if call.op != SUM or len(axes) != 1:
            return None
        (axis,) = axes
        cast = self._producer(t, ASTYPE)  # a cast of the one-hot (mixed precision's): the sum's u is cast
        sel = self._producer(cast.args[0] if cast is not None else t, WHERE)
        if sel is None or not _is_zero(sel.args[2]):
            return None
        cond, u = self._producer(sel.args[0], EQUAL), sel.args[1]
        if cond is None:
            return None
        lhs, rhs = cond.args
        for iota, idx in ((lhs, rhs), (rhs, lhs)):
            if not self._is_iota(iota, axis, src) or _shape(idx) is None:
                continue
            ushape, ishape = _shape(u), _aligned(_shape(idx), len(src))
            if ushape is None or ishape is None or ishape[axis] != 1:
                continue
            ufull = _aligned(ushape, len(src))
            if ufull is None or ufull[axis] != 1 or math.prod(ufull) != math.prod(out):
                continue
            if [e for a, e in enumerate(ufull) if a != axis] != [e for a, e in enumerate(src) if a != axis]:
                continue
            if cast is not None:
                u = self.builder_.emit(relax.op.astype(u, cast.attrs.dtype))
            return self._fit(u, out)
        return None

    def _is_iota(self, expr: relax.Expr, axis: int, src: tuple[int, ...]) -> bool:
        """`expr` is ``arange(0, src[axis], 1)`` laid out along `axis` (extent 1 elsewhere)."""
        shape = _shape(expr)
        full = None if shape is None else _aligned(shape, len(src))
        if full is None or full[axis] != src[axis] or math.prod(full) != src[axis]:
            return False
        reshape = self._producer(expr, RESHAPE)
        base = reshape.args[0] if reshape is not None else expr
        rng = self._producer(base, ARANGE)
        if rng is None:
            return False
        start, _end, step = (_int(a) for a in rng.args)
        return start == 0 and step == 1


def _int(expr) -> int | None:
    """The integer of an IntImm or a PrimValue holding one, else None."""
    while not isinstance(expr, int):
        if not hasattr(expr, "value"):
            return None
        expr = expr.value
    return expr


@tvm.transform.module_pass(opt_level=0, name="EliminateReduction")
class EliminateReduction:
    """Remove or shrink the reductions of every Relax function (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_ReductionEliminator(mod), mod)
