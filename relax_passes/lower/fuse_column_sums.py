"""FuseColumnSums: float32 sums over every row of values recomputed from the same tensors, as one
pass over those tensors.

At BERT-Large's loss three reductions recompute the same values from the last layer norm's bf16
input ``x``, its row statistics, γ, β and the float32 target ``t`` (``RecomputeElementwise``
copies the chain into each)::

    y = (astype(x) - mean) * rstd * γ + β,   e = y - t,   g = 2 e / N
    loss = mean(e * e)          dβ = Σ_rows g          dγ = Σ_rows g * ((astype(x) - mean) * rstd)

Each became a kernel reading ``x`` and ``t``: 101 MB a read on H100, ~35 us.  Here such
reductions become one ``column_sums`` call (its kernel reads the *leaves* once and sums every
*term*): a reduction qualifies when

* it is a float32 ``sum``/``mean`` of a static ``[..., C]`` value over every axis but the last,
  or over every axis (``loss``: the column sums, then a sum of C numbers);
* its operand is a prologue (``_prologue.inline_prologue``: elementwise float32 ops it alone
  reads) over leaves that are stored anyway (parameters, kernels' outputs and inputs, reshapes of
  them: ``_rewrite.stored``) and broadcast to the shape one of the ways the kernel reads
  (``column_sums.leaf_class``), at least one of them the full shape.

Reductions over the same shape that share a full-size leaf form a group (up to ``MAX_TERMS``); a
group of two or more is one call at the place of its first member, its leaves bound before it.
A lone reduction is left to the reduction schedules.  CUDA route, after ``RecomputeElementwise``
and ``FuseColumnMoments`` (which takes a layer norm's dγ and dβ over a stored gradient), before
``SplitReduction``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from . import column_sums
from ._prologue import Prologue, inline_prologue, leaf_index, scalar_constant, unique_leaves
from .._rewrite import (bind_as, binding_uses, flat_bindings, kernel_inputs, mutate_relax_functions, op_name,
                       static_shape, stored)

REDUCE = {"relax.sum": "sum", "relax.mean": "mean"}
MAX_TERMS = 4  # sums one kernel takes: 4 KB of shared memory each
F32 = "float32"


def _reduction(binding) -> tuple[str, relax.Var, bool] | None:
    """(sum or mean, operand, over every axis) of a float32 reduction over every axis but the last
    of a static ``[..., C]`` value, or over every axis; else None."""
    value = binding.value
    if op_name(value) not in REDUCE or not isinstance(value.args[0], relax.DataflowVar):
        return None
    shape = static_shape(value.args[0])
    if shape is None or len(shape) < 2 or str(binding.var.ty.dtype) != F32 or static_shape(binding.var) is None:
        return None
    axes = None if value.attrs.axis is None else sorted(int(a) % len(shape) for a in value.attrs.axis)
    total = axes is None or axes == list(range(len(shape)))
    if not total and axes != list(range(len(shape) - 1)):
        return None
    if not total and math.prod(static_shape(binding.var)) != shape[-1]:
        return None
    return REDUCE[op_name(value)], value.args[0], total


def term(p: Prologue, leaves: list):
    """``p.root`` as a ``column_sums`` term over `leaves`."""
    index = leaf_index(leaves)
    calls = dict(p.calls)

    def of(e):
        if e in calls:
            call = calls[e]
            name = op_name(call)[len("relax."):]
            args = [of(a) for a in call.args]
            return [name, *args, str(call.attrs.dtype)] if name == "astype" else [name, *args]
        c = scalar_constant(e)
        if c is not None:
            return ["const", c, str(e.ty.dtype)]
        return ["in", index(e)]

    return of(p.root)


@dataclass(frozen=True)
class _Sum:
    """One qualifying reduction: its binding's index and var, sum or mean, whether over every
    axis, its operand's shape and prologue."""

    i: int
    var: relax.Var
    kind: str
    total: bool
    shape: tuple
    prologue: Prologue

    def full_leaves(self) -> list:
        return [e for e in self.prologue.leaves if column_sums.leaf_class(static_shape(e), self.shape) == "full"]


def plan(func: relax.Function) -> list[list[_Sum]]:
    """The groups of reductions (binding order) that become one ``column_sums`` call each."""
    bindings, block_of = flat_bindings(func)
    uses = binding_uses(func)
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    kernel_read = kernel_inputs(bindings)

    def readers(var):
        return [bindings[i].var if i < len(bindings) else None for i in uses.get(var, [])]

    sums = []
    for i, b in enumerate(bindings):
        red = _reduction(b)
        if red is None:
            continue
        kind, operand, total = red
        shape = static_shape(operand)
        p = inline_prologue(operand, bound, readers, {b.var}, shape)
        if not p.calls or not all(block_of.get(v) == block_of.get(b.var) for v in p.vars):
            continue
        if not all(stored(bound, e, kernel_read) and static_shape(e) is not None for e in p.leaves):
            continue
        if not column_sums.supported(list(shape), [static_shape(e) for e in p.leaves]):
            continue
        s = _Sum(i, b.var, kind, total, shape, p)
        if s.full_leaves():
            sums.append(s)
    groups: list[list[_Sum]] = []
    for s in sums:  # first fit: a group of the same shape and dataflow block sharing a full-size leaf,
        # with room, where the call (at the group's first member) finds this one's leaves bound
        home = next((g for g in groups if g[0].shape == s.shape and len(g) < MAX_TERMS
                     and block_of.get(g[0].var) == block_of.get(s.var)  # the call's outputs stay in its block
                     and any(e.same_as(f) for m in g for e in m.full_leaves() for f in s.full_leaves())
                     and all(index.get(e, -1) < g[0].i for e in s.prologue.leaves)), None)
        if home is None:
            groups.append([s])
        else:
            home.append(s)
    return [g for g in groups if len(g) >= 2]


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.first: dict = {}  # first member's var -> its group
        self.done: set = set()

    def prime(self, func) -> None:
        self.first = {g[0].var: g for g in plan(func)}
        self.done = set()

    def visit_var_binding_(self, binding) -> None:
        if binding.var in self.done:
            return  # a group's later member, already emitted with its first
        group = self.first.get(binding.var)
        if group is None:
            super().visit_var_binding_(binding)
            return
        shape = [int(d) for d in group[0].shape]
        c, elements = shape[-1], math.prod(shape)
        leaves = unique_leaves(*(s.prologue for s in group))
        terms = [term(s.prologue, leaves) for s in group]
        outs = [[c] if s.total else list(static_shape(s.var)) for s in group]
        func = column_sums.sums_primfunc(shape, [(static_shape(e), str(e.ty.dtype)) for e in leaves], terms, outs)
        bb = self.builder_
        got = column_sums.emit_sums(bb, [self.visit_expr(e) for e in leaves], func)
        for s, v in zip(group, got):
            if s.total:
                v = bb.emit(relax.op.sum(v))
                if static_shape(s.var) != ():
                    v = bb.emit(relax.op.reshape(v, static_shape(s.var)))
            if s.kind == "mean":
                v = bb.emit(relax.op.multiply(v, relax.const(1.0 / (elements if s.total else elements // c), F32)))
            self.set_var_remap(s.var, bind_as(bb, s.var, v))
            self.done.add(s.var)


@tvm.transform.module_pass(opt_level=0, name="FuseColumnSums")
class FuseColumnSums:
    """Make each group of float32 column (or total) sums of values recomputed from shared tensors
    of every Relax function one ``column_sums`` call (the module docstring); the recomputations
    only they read go."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod)
        return relax.transform.DeadCodeElimination()(mutate_relax_functions(fuser, mod, fuser.prime))
