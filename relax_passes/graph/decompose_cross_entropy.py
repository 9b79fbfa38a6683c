"""DecomposeCrossEntropy: log_softmax / NLL and their backward as row reductions + elementwise.

The graphs of our pipeline spell cross-entropy as torch exports it,
``lp = log_softmax(z, a); nll = -gather_elements(lp, idx, a)``, and its adjoint (our
``gather_elements`` rule) as ``dlp = scatter_elements(zeros_like(lp), idx, g, a, "add")``.
This pass rewrites, in every Relax function:

* ``scatter_elements(zeros_like(t), idx, u, a)`` with ``idx`` of extent 1 along ``a`` (one
  class per row) → ``where(iota_a == idx, u, 0)``: the one-hot times the upstream gradient,
  an elementwise epilogue instead of a scatter (``idx`` must lie in ``[0, C)``, as
  gather_elements already requires);
* ``log_softmax(z, a)`` → ``(z - m) - log(sum(exp(z - m), a))`` with ``m = max(z, a)``;
* ``softmax(z, a)``, when ``log_softmax(z, a)`` is in the same function (EliminateLoss puts
  it on the backward path) → ``exp(z - m) / sum(exp(z - m), a)``, spelled like the line above
  so EliminateCommonSubexpr shares ``m`` and the row sum between loss and gradient.

With EliminateReduction (``sum`` of the one-hot is ``u``) the logits gradient reads
``one_hot * g - g * softmax(z)``: softmax minus one-hot, scaled.  Attention softmaxes (no
log_softmax of the same tensor) are left alone.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, static_shape as _shape, sub_expressions

LOG_SOFTMAX = tvm.ir.Op.get("relax.nn.log_softmax")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
SCATTER_ELEMENTS = tvm.ir.Op.get("relax.scatter_elements")
ZERO_FILLS = frozenset(tvm.ir.Op.get(name) for name in ("relax.zeros_like", "relax.zeros"))


def _log_softmax_sites(func: relax.Function) -> set[tuple[relax.Expr, int]]:
    """(input, axis) of every log_softmax in `func`, axis normalized."""
    sites = set()
    for expr in sub_expressions(func.body):
        if isinstance(expr, relax.Call) and expr.op == LOG_SOFTMAX:
            x = expr.args[0]
            sites.add((x, int(expr.attrs.axis) % x.ty.ndim))
    return sites


@mutator
class _CrossEntropyDecomposer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.paired: set[tuple[relax.Expr, int]] = set()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        original = call
        call = super().visit_call_(call)
        if call.op == LOG_SOFTMAX:
            shifted, total = self._row_sum_exp(call.args[0], int(call.attrs.axis))
            return relax.op.subtract(shifted, self.builder_.emit(relax.op.log(total)))
        if call.op == SOFTMAX:
            x = original.args[0]
            if (x, int(call.attrs.axis) % x.ty.ndim) in self.paired:
                shifted, total = self._row_sum_exp(call.args[0], int(call.attrs.axis))
                return relax.op.divide(self.builder_.emit(relax.op.exp(shifted)), total)
        if call.op == SCATTER_ELEMENTS:
            return self._one_hot(call)
        return call

    def _row_sum_exp(self, z: relax.Expr, axis: int) -> tuple[relax.Expr, relax.Expr]:
        axis %= z.ty.ndim
        emit = self.builder_.emit
        shifted = emit(relax.op.subtract(z, emit(relax.op.max(z, [axis], keepdims=True))))
        total = emit(relax.op.sum(emit(relax.op.exp(shifted)), [axis], keepdims=True))
        return shifted, total

    def _one_hot(self, call: relax.Call) -> relax.Expr:
        data, idx, updates = call.args
        fill = self.lookup_binding(data) if isinstance(data, relax.Var) else data
        if not (isinstance(fill, relax.Call) and fill.op in ZERO_FILLS):
            return call
        if str(call.attrs.reduction) not in ("add", "update"):
            return call
        out, ishape = _shape(call), _shape(idx)
        if out is None or ishape is None or _shape(updates) != ishape or len(ishape) != len(out):
            return call
        axis = int(call.attrs.axis) % len(out)
        if ishape[axis] != 1 or any(ishape[a] != out[a] for a in range(len(out)) if a != axis):
            return call
        emit = self.builder_.emit
        iota = emit(relax.op.arange(0, out[axis], 1, dtype=str(idx.ty.dtype)))
        iota = emit(relax.op.reshape(iota, [out[axis] if a == axis else 1 for a in range(len(out))]))
        hit = emit(relax.op.equal(iota, idx))
        return relax.op.where(hit, updates, relax.const(0, str(updates.ty.dtype)))


@tvm.transform.module_pass(opt_level=0, name="DecomposeCrossEntropy")
class DecomposeCrossEntropy:
    """Decompose log_softmax, its paired softmax and the NLL one-hot scatter (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        decomposer = _CrossEntropyDecomposer(mod)

        def pair_log_softmax(func):
            decomposer.paired = _log_softmax_sites(func)

        return mutate_relax_functions(decomposer, mod, pair_log_softmax)
