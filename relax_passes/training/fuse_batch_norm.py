"""FuseBatchNorm: a training-mode batch norm as one ``tvm_evt.batch_norm`` call, before ``Gradient``.

torch.export writes a training batch norm as statistics and elementwise ops, and mixed precision
(`AutoMixedPrecision`) runs them in float32 around a low-precision activation::

    x32  = astype(x, float32)                 optional: absent when x is float32
    mean = mean(x32, axes, keepdims=True)
    var  = variance(x32, axes, keepdims=True)
    xhat = (x32 - mean) / sqrt(var + eps)     eps a scalar constant
    z    = xhat * gamma + beta                gamma, beta float32 in the statistics' shape
    zl   = astype(z, low)                     optional: folded when z has no other reader
  ->
    bn   = tvm_evt.batch_norm(x, gamma, beta, eps, dtype(zl or z), axes)
    zl   = bn[0];  mean = bn[1];  var = bn[2]

``Gradient`` then differentiates the op with its closed-form rule (`batch_norm_op`) instead of
the ops above one by one.  The values from ``var + eps`` to ``z`` must be read by the next step
only; ``mean`` and ``var`` may have other readers (the running statistics' updates).  The call
goes before the first binding after its operands are bound, where none of those readers may be;
all of it lies in one dataflow block.
"""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import batch_norm_op
from .._rewrite import binding_uses, flat_bindings, mutate_relax_functions, scalar_value, static_shape

ASTYPE = tvm.ir.Op.get("relax.astype")
MEAN = tvm.ir.Op.get("relax.mean")
VARIANCE = tvm.ir.Op.get("relax.variance")
ADD = tvm.ir.Op.get("relax.add")
SQRT = tvm.ir.Op.get("relax.sqrt")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
DIVIDE = tvm.ir.Op.get("relax.divide")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
FLOATS = batch_norm_op.FLOATS


@dataclasses.dataclass(frozen=True)
class BatchNormMatch:
    """One match: the call's result replaces ``anchor`` (``zl``, or ``z``)."""

    anchor: relax.Var
    x: relax.Expr  # the call's input: x (below the widening cast) or x32
    gamma: relax.Expr
    beta: relax.Expr
    eps: float
    axes: tuple
    out_dtype: str
    mean: relax.Var
    var: relax.Var
    absorbed: frozenset  # the bindings the call replaces (dead once it is emitted)


def _call(bound: dict, v, op: tvm.ir.Op, nargs: int | None = None) -> relax.Call | None:
    value = bound.get(v) if isinstance(v, relax.Var) else None
    if isinstance(value, relax.Call) and value.op == op and (nargs is None or len(value.args) == nargs):
        return value
    return None


def _axes(call: relax.Call, ndim: int) -> tuple | None:
    """The reduced axes of a keepdims mean / variance, else None."""
    if not bool(call.attrs.keepdims) or call.attrs.axis is None:
        return None
    return tuple(sorted(int(a) % ndim for a in call.attrs.axis))


def find_batch_norms(func: relax.Function) -> dict:
    """var of a binding -> the `BatchNormMatch`es whose calls go before it (module docstring)."""
    bindings, block_of = flat_bindings(func)
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    uses = binding_uses(func)
    readers = lambda v: uses.get(v, [])  # noqa: E731
    only = lambda v, reader: readers(v) == [index[reader]]  # noqa: E731
    found = {}
    for b in bindings:
        z = b.var
        add = _call(bound, z, ADD, 2)
        mul = None if add is None else _call(bound, add.args[0], MULTIPLY, 2)
        div = None if mul is None else _call(bound, mul.args[0], DIVIDE, 2)
        sub = None if div is None else _call(bound, div.args[0], SUBTRACT, 2)
        sqrt = None if div is None else _call(bound, div.args[1], SQRT, 1)
        eps_add = None if sqrt is None else _call(bound, sqrt.args[0], ADD, 2)
        if sub is None or eps_add is None:
            continue
        x32, mean_v = sub.args
        var_v = eps_add.args[0]
        mean, var = _call(bound, mean_v, MEAN), _call(bound, var_v, VARIANCE)
        eps = scalar_value(bound, eps_add.args[1])
        shape = static_shape(x32)
        if mean is None or var is None or eps is None or shape is None or str(x32.ty.dtype) != "float32":
            continue
        if not (mean.args[0].same_as(x32) and var.args[0].same_as(x32)):
            continue
        axes = _axes(mean, len(shape))
        if axes is None or axes != _axes(var, len(shape)) or len(axes) == len(shape):
            continue
        stat = tuple(1 if a in axes else s for a, s in enumerate(shape))
        gamma, beta = mul.args[1], add.args[1]
        if any(static_shape(t) != stat or str(t.ty.dtype) != "float32" for t in (gamma, beta)):
            continue
        eps_v, std_v, c_v, xhat_v, scaled_v = sqrt.args[0], div.args[1], div.args[0], mul.args[0], add.args[0]
        chain = [(eps_v, std_v), (std_v, xhat_v), (c_v, xhat_v), (xhat_v, scaled_v), (scaled_v, z)]
        if not all(isinstance(v, relax.Var) and only(v, r) for v, r in chain):
            continue
        anchor, out_dtype = z, "float32"
        z_readers = readers(z)
        if len(z_readers) == 1 and z_readers[0] < len(bindings):
            cast = bindings[z_readers[0]]
            if isinstance(cast.value, relax.Call) and cast.value.op == ASTYPE and str(cast.var.ty.dtype) in FLOATS:
                anchor, out_dtype = cast.var, str(cast.var.ty.dtype)
        x = x32
        widen = _call(bound, x32, ASTYPE, 1)
        if widen is not None and str(widen.args[0].ty.dtype) in FLOATS:
            x = widen.args[0]
        # the call goes before the first binding after its operands; mean, var and the result
        # become its outputs, so their other readers must not come earlier
        place = 1 + max((index[t] for t in (x, gamma, beta) if t in index), default=-1)
        absorbed = (mean_v, var_v, eps_v, std_v, c_v, xhat_v, scaled_v, z, anchor)
        internal = {index[v] for v in absorbed}
        others = [i for v in (mean_v, var_v, anchor) for i in readers(v) if i not in internal]
        if place >= len(bindings) or any(i < place for i in others):
            continue
        if len({block_of[v] for v in (*absorbed, bindings[place].var)}) != 1 or block_of[anchor] is None:
            continue  # one dataflow block
        found[bindings[place].var] = found.get(bindings[place].var, ()) + (BatchNormMatch(
            anchor, x, gamma, beta, eps, axes, out_dtype, mean_v, var_v, frozenset(absorbed)),)
    return found


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.matches: dict = {}
        self.absorbed: frozenset = frozenset()

    def prime(self, func: relax.Function) -> None:
        self.matches = find_batch_norms(func)
        self.absorbed = frozenset(v for ms in self.matches.values() for m in ms for v in m.absorbed)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        for m in self.matches.get(binding.var, ()):
            x, gamma, beta = (self.visit_expr(e) for e in (m.x, m.gamma, m.beta))
            bn = self.builder_.emit(batch_norm_op.batch_norm(x, gamma, beta, m.eps, m.axes, m.out_dtype))
            for var, i in ((m.anchor, 0), (m.mean, 1), (m.var, 2)):
                self.set_var_remap(var, self.builder_.emit(relax.TupleGetItem(bn, i)))
        if binding.var not in self.absorbed:
            super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="FuseBatchNorm")
class FuseBatchNorm:
    """Rewrite every training batch norm of every Relax function as a ``tvm_evt.batch_norm`` call."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod)
        mod = mutate_relax_functions(fuser, mod, before_each=fuser.prime)
        return relax.transform.DeadCodeElimination()(mod)
