"""DecomposeCrossEntropy: log_softmax / NLL and their backward as row reductions + elementwise.

The graphs of our pipeline spell cross-entropy as torch exports it,
``lp = log_softmax(z, a); nll = -gather_elements(lp, idx, a)``, and its adjoint (our
``gather_elements`` rule) as ``dlp = scatter_elements(zeros_like(lp), idx, g, a, "add")``.
This pass rewrites, in every Relax function:

* ``scatter_elements(zeros_like(t), idx, u, a)`` with ``idx`` of extent 1 along ``a`` (one
  class per row) → ``where(iota_a == idx, u, 0)``: the one-hot times the upstream gradient,
  an elementwise epilogue instead of a scatter (``idx`` must lie in ``[0, C)``, as
  gather_elements already requires);
* ``log_softmax(z, a)`` → ``(z - m) - l`` with ``m = max(z, a)`` and ``l = log(sum(exp(z - m),
  a))``, row values (rounded as torch rounds it); the row sum reads ``z`` and ``m`` and fuses its
  ``exp`` (the exponentials are never stored);
* ``gather_elements(log_softmax(z, a), idx, a)`` (the NLL's pick) → ``(gather_elements(z, idx, a)
  - m) - l``: the whole ``log_softmax`` is not computed when nothing else reads it (with ``z =
  astype(z16)``, the pick of ``z16``, cast: no float32 copy of the logits for the gather);
* ``softmax(z, a)``, when ``log_softmax(z, a)`` came first in the same function (EliminateLoss
  puts it on the backward path) → ``exp((z - m) - l)``: the gradient reads ``z`` and two row
  values.

A causal LM's loss over a [16384, 50257] vocabulary (GPT-2 medium, 16 x 1024 tokens): the
earlier spelling, ``(z - m) - log(s)`` and ``exp(z - m) / s`` sharing ``exp(z - m)``, stored the
float32 exponentials and the whole log-softmax (a 1-layer model's loss kernels moved 24.5 GB a
step in ``tuning.kernel_traffic``'s model).

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
GATHER_ELEMENTS = tvm.ir.Op.get("relax.gather_elements")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
ASTYPE = tvm.ir.Op.get("relax.astype")
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
        self.rows: dict = {}  # (new z, axis) -> (z - m, log of the row sum), once emitted

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        original = call
        call = super().visit_call_(call)
        if call.op == LOG_SOFTMAX:
            z = call.args[0]
            shifted, log_total = self._rows(z, int(call.attrs.axis) % z.ty.ndim)
            return relax.op.subtract(shifted, log_total)
        if call.op == SOFTMAX:
            x, z = original.args[0], call.args[0]
            axis = int(call.attrs.axis) % x.ty.ndim
            if (x, axis) in self.paired:
                shifted, log_total = self._rows(z, axis)
                return relax.op.exp(self.builder_.emit(relax.op.subtract(shifted, log_total)))
        if call.op == GATHER_ELEMENTS:
            return self._pick(call)
        if call.op == SCATTER_ELEMENTS:
            return self._one_hot(call)
        return call

    def _rows(self, z: relax.Expr, axis: int) -> tuple[relax.Expr, relax.Expr]:
        """(z - m, log(sum(exp(z - m)))) along `axis` (keepdims; m the row max), emitted once per
        (z, axis); torch's log_softmax rounds as ``(z - m) - log(s)`` does."""
        if (z, axis) not in self.rows:
            emit = self.builder_.emit
            shifted = emit(relax.op.subtract(z, emit(relax.op.max(z, [axis], keepdims=True))))
            total = emit(relax.op.sum(emit(relax.op.exp(shifted)), [axis], keepdims=True))
            self.rows[z, axis] = (shifted, emit(relax.op.log(total)))
        return self.rows[z, axis]

    def _pick(self, call: relax.Call) -> relax.Expr:
        """gather_elements((z - m) - log_total, idx, a), both row values along a ->
        (gather_elements(z, idx, a) - m) - log_total: the pick reads z, not the log-softmax.  Also
        through a cast of the log-softmax (mixed precision's, before a low-precision NLL): the
        pick is cast instead."""
        data, idx = call.args
        value = self.lookup_binding(data) if isinstance(data, relax.Var) else None
        cast = None
        if isinstance(value, relax.Call) and value.op == ASTYPE and isinstance(value.args[0], relax.Var):
            cast, value = value, self.lookup_binding(value.args[0])
        if not (isinstance(value, relax.Call) and value.op == SUBTRACT):
            return call
        shifted, log_total = value.args
        axis = int(call.attrs.axis) % data.ty.ndim
        site = next((key for key, rows in self.rows.items()
                     if key[1] == axis and rows[0].same_as(shifted) and rows[1].same_as(log_total)), None)
        if site is None:
            return call
        m = self.lookup_binding(shifted).args[1]
        emit = self.builder_.emit
        z = site[0]
        widened = self.lookup_binding(z) if isinstance(z, relax.Var) else None
        if isinstance(widened, relax.Call) and widened.op == ASTYPE:  # float32 logits cast from bf16: pick
            picked = emit(relax.op.astype(emit(relax.op.gather_elements(widened.args[0], idx, axis)),
                                          z.ty.dtype))  # the bf16 ones, not a float32 copy
        else:
            picked = emit(relax.op.gather_elements(z, idx, axis))
        pick = relax.op.subtract(emit(relax.op.subtract(picked, m)), log_total)
        return pick if cast is None else relax.op.astype(emit(pick), cast.attrs.dtype)

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
            decomposer.rows = {}

        return mutate_relax_functions(decomposer, mod, pair_log_softmax)
