"""FuseColumnMoments: two column sums over the same tensor as one pass over it.

Batch-norm statistics and gradients come out of `batch_norm_op` (and `DecomposeBatchNorm`) as
pairs of reductions over every axis but the channel axis that read the same tensor, and so do a
layer norm's parameter gradients (its mean and rstd are per row, ``[..., 1]``)::

    batch norm, forward   mean(v, A),  mean(v * v, A)                 v = x or astype(x, float32)
    batch norm, backward  sum(g, A),   sum(g * (w - mu), A)           g = dy or astype(dy, float32), w alike
    layer norm, backward  sum(g, A),   sum(g * ((w - mu) * rstd), A)

Each pair becomes one ``call_tir`` of `column_moments` (its GPU form reads ``x``, or ``dy`` and
``x``, once, in their own dtypes) at the place of the pair's first reduction; a mean is the sum
times 1/M.  The pairs are found by this table of (name, the second reduction's operand, what
the kernel reads) over channel-last reductions (with ``keepdims`` or without) that
`column_moments.supported` accepts; anything else is left as it is.

The evt graph passes fuse the batch-norm pairs.  The layer-norm pair is fused on the CUDA route
after ``FuseLayerNorm`` and ``RecomputeElementwise`` (``FuseColumnMoments(LAYER_NORM,
stored=True)``), where ``xhat`` is recomputed from the input and the row statistics, and only
when the kernel reads tensors in memory anyway (``stored``: parameters, kernels' outputs and the
values a kernel of its own reads, such as ViT-B/16's bf16 input): BERT-Large's last layer
norm's ``g`` is the loss gradient, which each sum recomputes from the layer norm's input and the
target, and one kernel reading it would have it written in float32 for it alone.
"""
from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..lower import column_moments
from .._rewrite import bind_as, flat_bindings, kernel_inputs, mutate_relax_functions, static_shape
from .._rewrite import stored as is_stored  # (plan's `stored` is a flag)

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
        self.kernel_read = kernel_inputs(self.bindings)
        self.index = {b.var: i for i, b in enumerate(self.bindings)}
        self.value = {b.var: b.value for b in self.bindings}

    def read(self, var):
        """What a kernel reads for `var`: the operand of a widening ``astype`` to float32, else itself."""
        value = self.value.get(var)
        if _call(value, ASTYPE) and str(value.attrs.dtype) == "float32" and isinstance(value.args[0], relax.Var):
            return value.args[0]
        return var

    def stored(self, var) -> bool:
        """Is `var` in memory anyway: a parameter, a kernel's output or input, or a reshape of one
        (``_rewrite.stored``)?"""
        return is_stored(self.value, var, self.kernel_read)

    def before(self, var, i: int) -> bool:
        return self.index.get(var, -1) < i  # a parameter, or bound before binding i

    def square(self, v):
        """``p`` of ``v = p * p``."""
        value = self.value.get(v)
        if _call(value, MULTIPLY) and value.args[0].same_as(value.args[1]):
            return value.args[0]
        return None

    def product(self, v, factor):
        """``(g, found)`` of ``v = g * c`` (either operand order) where ``factor(c)`` is ``found``."""
        value = self.value.get(v)
        if not _call(value, MULTIPLY):
            return None
        for g, c in (value.args, value.args[::-1]):
            found = factor(c) if isinstance(g, relax.Var) else None
            if found is not None:
                return g, found
        return None

    def difference(self, c):
        """``(w, mu)`` of ``c = w - mu``."""
        diff = self.value.get(c)
        if _call(diff, SUBTRACT) and all(isinstance(a, relax.Var) for a in diff.args):
            return tuple(diff.args)
        return None

    def centered(self, v):
        """``(g, w, mu)`` of ``v = g * (w - mu)``."""
        found = self.product(v, self.difference)
        return None if found is None else (found[0], *found[1])

    def normalized(self, v):
        """``(g, w, mu, rstd)`` of ``v = g * ((w - mu) * rstd)``."""
        found = self.product(v, lambda c: self.product(c, self.difference))
        if found is None:
            return None
        g, (rstd, (w, mu)) = found
        return g, w, mu, rstd


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


def _normalized_moments(fn: _Function, v):
    """``v = g * ((w - mu) * rstd)``: the pair is (sum(g), sum(v)); the kernel reads g, w, mu, rstd."""
    found = fn.normalized(v)
    if found is None:
        return None
    g, w, mu, rstd = found
    return g, [fn.read(g), fn.read(w), mu, rstd]


def _stats_fit(inputs, shape) -> bool:
    """The second tensor has the first's shape, and the float32 statistics the shapes of their kind."""
    if len(inputs) == 1:
        return True
    stat = column_moments.keep_shape(shape) if len(inputs) == 3 else column_moments.row_shape(shape)
    return static_shape(inputs[1]) == shape and all(
        str(s.ty.dtype) == "float32" and list(static_shape(s) or ()) == stat for s in inputs[2:])


# (name, the second reduction's operand -> (the first reduction's operand, kernel inputs) or None)
PAIRS = (("moments", _moments), ("centered moments", _centered_moments),
         ("normalized moments", _normalized_moments))
BATCH_NORM = ("moments", "centered moments")
LAYER_NORM = ("normalized moments",)


def _reduction(binding):
    """(kind, operand, axes) of a float32 sum/mean of a var over explicit axes, else None."""
    value = binding.value
    if not (isinstance(value, relax.Call) and value.op in REDUCE and isinstance(value.args[0], relax.Var)):
        return None
    if value.attrs.axis is None or str(binding.var.ty.dtype) != "float32":
        return None
    ndim = value.args[0].ty.ndim
    return REDUCE[value.op], value.args[0], tuple(sorted(int(a) % ndim for a in value.attrs.axis))


def plan(func: relax.Function, pairs=BATCH_NORM, stored: bool = False) -> dict:
    """first reduction's var -> (its var, the second's var, kind, kernel inputs, rows M, sums'
    shape) for the `pairs` (names in ``PAIRS``); with `stored`, only pairs whose kernel reads
    tensors that are stored anyway (``_Function.stored``)."""
    unknown = set(pairs) - {name for name, _ in PAIRS}
    if unknown:
        raise ValueError(f"FuseColumnMoments: unknown pair(s) {sorted(unknown)}; known: {[n for n, _ in PAIRS]}")
    matchers = [match for name, match in PAIRS if name in pairs]
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
        for match in matchers:
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
            if str(inputs[0].ty.dtype) not in FLOATS or not _stats_fit(inputs, shape):
                continue
            if stored and not all(fn.stored(x) for x in inputs):
                continue
            out_shape = static_shape(b.var)
            if out_shape is None or static_shape(first) != out_shape:
                continue
            out[fn.bindings[at].var] = (first, b.var, kind, inputs, math.prod(shape[:-1]), list(out_shape))
            taken |= {first, b.var}
            break
    return out


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod, pairs, stored):
        super().__init__(mod)
        self.names, self.stored = pairs, stored  # which PAIRS to look for
        self.pairs: dict = {}
        self.done: set = set()

    def prime(self, func) -> None:
        self.pairs, self.done = plan(func, self.names, self.stored), set()

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.done:
            return  # the pair's other reduction, already emitted
        pair = self.pairs.get(binding.var)
        if pair is None:
            super().visit_var_binding_(binding)
            return
        first, second, kind, inputs, rows, out_shape = pair
        s = column_moments.emit_moments(self.builder_, *[self.visit_expr(x) for x in inputs], out=out_shape)
        if kind == "mean":
            inv = relax.const(1.0 / rows, "float32")
            s = [self.builder_.emit(relax.op.multiply(t, inv)) for t in s]
        for var, new in zip((first, second), s):
            self.set_var_remap(var, bind_as(self.builder_, var, new))
            self.done.add(var)


@tvm.transform.module_pass(opt_level=0, name="FuseColumnMoments")
class FuseColumnMoments:
    """Make every pair of column sums over one tensor of every Relax function one `column_moments`
    call: the `pairs` of ``PAIRS`` (default the batch norm's), with `stored` only those reading
    stored tensors (``plan``); the products only the pair read go."""

    def __init__(self, pairs=BATCH_NORM, stored: bool = False):
        self.pairs, self.stored = tuple(pairs), stored

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod, self.pairs, self.stored)
        return relax.transform.DeadCodeElimination()(mutate_relax_functions(fuser, mod, fuser.prime))
