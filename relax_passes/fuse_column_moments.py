"""FuseColumnMoments: a batch norm's two column sums of one direction as one pass over its input.

Batch-norm statistics and gradients come out of `batch_norm_op` (and `DecomposeBatchNorm`) as
pairs of reductions over every axis but the channel axis that read the same tensor::

    forward   mean(v, A),  mean(v * v, A)                  v = x or astype(x, float32)
    backward  sum(g, A),   sum(g * (w - mu), A)            g = dy or astype(dy, float32), w alike

Each pair becomes one ``call_tir`` of `column_moments` (its GPU form reads ``x``, or ``dy`` and
``x``, once, in their own dtypes) at the place of the pair's first reduction; a mean is the sum
times 1/M.  The pairs are found by this table of (name, the second reduction's operand, what
the kernel reads) over channel-last reductions with ``keepdims`` that `column_moments.supported`
accepts; anything else is left as it is.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import column_moments
from ._rewrite import flat_bindings, mutate_relax_functions, static_shape

REDUCE = {tvm.ir.Op.get("relax.sum"): "sum", tvm.ir.Op.get("relax.mean"): "mean"}
MULTIPLY = tvm.ir.Op.get("relax.multiply")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
ASTYPE = tvm.ir.Op.get("relax.astype")
FLOATS = ("float32", "float16", "bfloat16")


def _call(value, op) -> bool:
    return isinstance(value, relax.Call) and value.op == op


class _Function:
    """The bindings of one function, and the pairs found in them."""

    def __init__(self, func: relax.Function):
        self.bindings = flat_bindings(func)[0]
        self.index = {b.var: i for i, b in enumerate(self.bindings)}
        self.value = {b.var: b.value for b in self.bindings}

    def read(self, var):
        """What a kernel reads for `var`: the operand of a widening ``astype`` to float32, else itself."""
        value = self.value.get(var)
        if _call(value, ASTYPE) and str(value.attrs.dtype) == "float32" and isinstance(value.args[0], relax.Var):
            return value.args[0]
        return var

    def before(self, var, i: int) -> bool:
        return self.index.get(var, -1) < i  # a parameter, or bound before binding i

    def square(self, v):
        """``p`` of ``v = p * p``."""
        value = self.value.get(v)
        if _call(value, MULTIPLY) and value.args[0].same_as(value.args[1]):
            return value.args[0]
        return None

    def centered(self, v):
        """``(g, w, mu)`` of ``v = g * (w - mu)`` (either operand order)."""
        value = self.value.get(v)
        if not _call(value, MULTIPLY):
            return None
        for g, c in (value.args, value.args[::-1]):
            diff = self.value.get(c)
            if isinstance(g, relax.Var) and _call(diff, SUBTRACT) and all(isinstance(a, relax.Var) for a in diff.args):
                return g, diff.args[0], diff.args[1]
        return None


def _moments(fn: _Function, v):
    """``v = p * p``: the pair is (mean(p), mean(p * p)); the kernel reads p."""
    p = fn.square(v)
    return None if p is None else (p, [fn.read(p)])


def _centered_moments(fn: _Function, v):
    """``v = g * (w - mu)``: the pair is (sum(g), sum(g * (w - mu))); the kernel reads g, w, mu."""
    found = fn.centered(v)
    if found is None:
        return None
    g, w, mu = found
    return g, [fn.read(g), fn.read(w), mu]


# (name, the second reduction's operand -> (the first reduction's operand, kernel inputs) or None)
PAIRS = (("moments", _moments), ("centered moments", _centered_moments))


def _reduction(binding):
    """(kind, operand, axes) of a float32 keepdims sum/mean of a var over explicit axes, else None."""
    value = binding.value
    if not (isinstance(value, relax.Call) and value.op in REDUCE and isinstance(value.args[0], relax.Var)):
        return None
    if not bool(value.attrs.keepdims) or value.attrs.axis is None or str(binding.var.ty.dtype) != "float32":
        return None
    ndim = value.args[0].ty.ndim
    return REDUCE[value.op], value.args[0], tuple(sorted(int(a) % ndim for a in value.attrs.axis))


def plan(func: relax.Function) -> dict:
    """first reduction's var -> (its var, the second's var, kind, kernel inputs, rows M)."""
    fn = _Function(func)
    firsts: dict = {}  # (kind, what it reads, axes) -> binding indices
    for i, b in enumerate(fn.bindings):
        red = _reduction(b)
        if red is not None:  # keyed by what it reads: AccumulateInFloat32 widens dy for Σ dy afresh
            kind, operand, axes = red
            firsts.setdefault((kind, fn.read(operand), axes), []).append(i)
    out, taken = {}, set()  # taken: the reductions already in a pair
    for j, b in enumerate(fn.bindings):
        red = _reduction(b)
        if red is None:
            continue
        kind, v, axes = red
        for _name, match in PAIRS:
            found = match(fn, v)
            if found is None:
                continue
            first_operand, inputs = found
            # the first plain reduction of the same value no pair has taken (one gradient can feed
            # two batch norms: a residual block's last and its shortcut's)
            i = next((i for i in firsts.get((kind, fn.read(first_operand), axes), [])
                      if i != j and fn.bindings[i].var not in taken), None)
            shape = static_shape(inputs[0])
            if i is None or b.var in taken or shape is None or not column_moments.supported(list(shape), list(axes)):
                continue
            first = fn.bindings[i].var
            at = min(i, j)
            if not all(fn.before(x, at) for x in inputs):
                continue
            if str(inputs[0].ty.dtype) not in FLOATS:
                continue
            if len(inputs) == 3 and (static_shape(inputs[1]) != shape or str(inputs[2].ty.dtype) != "float32"
                                     or list(static_shape(inputs[2]) or ()) != column_moments.keep_shape(shape)):
                continue
            out[fn.bindings[at].var] = (first, b.var, kind, inputs, math.prod(shape[:-1]))
            taken |= {first, b.var}
            break
    return out


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.pairs: dict = {}
        self.done: set = set()

    def prime(self, func) -> None:
        self.pairs, self.done = plan(func), set()

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.done:
            return  # the pair's other reduction, already emitted
        pair = self.pairs.get(binding.var)
        if pair is None:
            super().visit_var_binding_(binding)
            return
        first, second, kind, inputs, rows = pair
        s = column_moments.emit_moments(self.builder_, *[self.visit_expr(x) for x in inputs])
        if kind == "mean":
            inv = relax.const(1.0 / rows, "float32")
            s = [self.builder_.emit(relax.op.multiply(t, inv)) for t in s]
        for var, new in zip((first, second), s):
            self.set_var_remap(var, new)
            self.done.add(var)


@tvm.transform.module_pass(opt_level=0, name="FuseColumnMoments")
class FuseColumnMoments:
    """Make every pair of batch-norm column sums of every Relax function one `column_moments` call."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod)
        return mutate_relax_functions(fuser, mod, fuser.prime)
