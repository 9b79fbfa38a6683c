"""FoldLayoutIntoMatmul: leave only the layout changes a matmul operand layout can absorb.

The EVT codegen frontend reads ``R.matmul(R.permute_dims(a), R.permute_dims(b))`` (last two
axes swapped) and row-major reshapes of matmul operands as operand layouts, so the
representation this pass aims for keeps at most ONE ``permute_dims``/``reshape`` between a
producer and its matmul, bound right before it.  Rewrites, each local to one binding:

* ``permute_dims(permute_dims(x, p), q)`` → ``permute_dims(x, [p[i] for i in q])``, or ``x``
  when the composition is the identity (e.g. the backward's transpose of a transposed weight);
* ``reshape(reshape(x, s1), s2)`` → ``reshape(x, s2)``; ``reshape(x, x.shape)`` → ``x``;
* ``permute_dims(x, identity)`` → ``x``; ``broadcast_to(x, x.shape)`` → ``x`` (the attention
  graphs broadcast batch operands to the shape they already have before every bmm);
* an elementwise binary op whose operand is ``broadcast_to(y, S)`` while the other operand
  alone already has the result shape uses ``y`` and the op's implicit broadcast instead (the
  loss seed ``broadcast_to(1/N, S) * d`` becomes ``(1/N) * d``: a scalar epilogue operand).

Nothing is moved across a matmul: what already sits adjacent to one stays adjacent.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, permute_axes, producer, static_shape as _shape

PERMUTE = tvm.ir.Op.get("relax.permute_dims")
RESHAPE = tvm.ir.Op.get("relax.reshape")
BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")

IMPLICIT_BROADCAST = frozenset(
    tvm.ir.Op.get(f"relax.{name}")
    for name in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "power")
)


@mutator
class _LayoutFolder(PyExprMutator):
    def _producer(self, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        return producer(self, expr, op)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op == PERMUTE:
            return self._permute(call)
        if call.op == RESHAPE:
            return self._reshape(call)
        if call.op == BROADCAST_TO:
            x = call.args[0]
            return x if _shape(x) is not None and _shape(x) == _shape(call) else call
        if call.op in IMPLICIT_BROADCAST:
            return self._drop_broadcast(call)
        return call

    def _permute(self, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        ndim = x.ty.ndim
        axes = permute_axes(call)
        inner = self._producer(x, PERMUTE)
        if inner is not None:
            x = inner.args[0]
            first = permute_axes(inner)
            axes = [first[a] for a in axes]
        if axes == list(range(ndim)):
            return x
        if inner is None:
            return call
        return relax.op.permute_dims(x, axes)

    def _reshape(self, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        inner = self._producer(x, RESHAPE)
        if inner is not None:
            x = inner.args[0]
        if _shape(x) is not None and _shape(x) == _shape(call):
            return x
        return relax.op.reshape(x, call.args[1]) if inner is not None else call

    def _drop_broadcast(self, call: relax.Call) -> relax.Expr:
        out = _shape(call)
        if out is None or len(call.args) != 2:
            return call
        args = list(call.args)
        for i in (0, 1):
            bcast = self._producer(args[i], BROADCAST_TO)
            if bcast is not None and _shape(args[1 - i]) == out:
                args[i] = bcast.args[0]
                return relax.Call(call.op, args, call.attrs)
        return call


@tvm.transform.module_pass(opt_level=0, name="FoldLayoutIntoMatmul")
class FoldLayoutIntoMatmul:
    """Compose permute/reshape chains and drop no-op layout ops in every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_LayoutFolder(mod), mod)
