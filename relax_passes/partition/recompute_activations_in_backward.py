"""RecomputeActivationsInBackward: an activation the backward reads, a pointwise function of
another value it keeps anyway, is computed again in the backward instead of kept (Tempo's
in-place GELU, NeurIPS'22, without its approximate inverse: the backward has the input).

An MLP's ``y = gelu(x)`` (``x = h W1 + b``) is read by the backward twice: ``gelu'(x)`` for the
input gradient, and ``y`` itself, the operand of the second layer's weight gradient.  Both are
functions of ``x``.  Left to the partitioner, the first layer's GEMM epilogue stores ``y`` (the
second layer's input) and ``gelu'(x)`` (moved next to ``x`` so the backward loads one tensor),
and the step keeps both until its backward: two tensors of the MLP's width per layer (BERT-Large at
batch 102: 20.5 of 49.5 GB saved).  After this pass it keeps ``x`` alone:

* a saved forward value ``v`` whose chain up to a saved value ``x`` of as many elements is
  pointwise (``POINTWISE``, casts, views; one forward operand each, the others constants) is
  bound again, with that chain, just before its first backward reader (``Rematerialize``'s rewrite);
* the backward's pointwise bindings computed from such ``x`` alone (the gradient rule's
  ``gelu'(x)``) are renamed as copies too.

Copies (``COPY_SUFFIX``) join no GEMM epilogue (``PartitionEVT``): there they would join the
forward GEMM that makes ``x`` and be stored again.  They run as TVM kernels in the backward, which
read ``x`` and write ``y`` and ``gelu'(x)`` for the backward GEMMs: an elementwise pass more per
activation (BERT-Large at batch 102: about 1.7 GB moved a layer) for a tensor less kept.  Off by
default (``recompute_activations``): on an H200 it made BERT-Large 6-7 % slower a sample (2.79
against 2.61-2.64 ms), and a memory budget reaches a larger batch faster.  The numbers are the
forward's: the same ops on the same values.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import COPY_SUFFIX, POINTWISE, VIEWS, elements, flat_bindings, is_copy, op_name
from .rematerialize import StepGraph, rewrite, step_graphs

CHAIN_OPS = POINTWISE | VIEWS | {"relax.astype"}


def _forward_operands(graph: StepGraph, v) -> list:
    return [a for a in graph.nodes[v].operands if a in graph.nodes]


def _chain_to_saved(graph: StepGraph, v, saved: set) -> list | None:
    """The bindings from `v` up to (not including) a saved var of as many elements, each a
    pointwise op of one forward operand; None where there is no such chain."""
    chain, u = [], v
    while True:
        node = graph.nodes[u]
        if op_name(node.value) not in CHAIN_OPS or not node.recomputable:
            return None
        operands = _forward_operands(graph, u)
        if len(operands) != 1 or elements(operands[0]) != elements(v):
            return None
        chain.append(u)
        u = operands[0]
        if u in saved:
            return chain
        if u not in graph.nodes:
            return None


def plan(graph: StepGraph) -> tuple[set, set]:
    """(the forward bindings to copy into the backward, the sources they are recomputed from)."""
    saved = set(graph.saved)
    recompute, sources = set(), set()
    for v in graph.saved:
        if v in graph.pinned:
            continue
        chain = _chain_to_saved(graph, v, saved)
        if chain is not None:
            recompute |= set(chain)
            sources.add(_forward_operands(graph, chain[-1])[0])
    return recompute, sources - recompute


@mutator
class _MarkCopies(PyExprMutator):
    """Rename the backward's pointwise bindings of `sources` alone as copies."""

    def __init__(self, mod: tvm.IRModule, marked: set):
        super().__init__(mod)
        self.marked = marked

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.marked:
            return super().visit_var_binding_(binding)
        value = self.visit_expr(binding.value)
        self.set_var_remap(binding.var, self.builder_.emit(value, name_hint=f"{binding.var.name}{COPY_SUFFIX}"))


def _backward_functions_of(func: relax.Function, boundary: int, sources: set) -> set:
    """Bindings after `boundary` (the loss's index) that are pointwise ops of `sources` (and of each
    other) and constants."""
    marked: set = set()
    for b in flat_bindings(func)[0][boundary + 1:]:
        if op_name(b.value) not in CHAIN_OPS or is_copy(b.var):
            continue
        reads = relax.analysis.free_vars(b.value)
        if reads and all(v in sources or v in marked for v in reads):
            marked.add(b.var)
    return marked


@tvm.transform.module_pass(opt_level=0, name="RecomputeActivationsInBackward")
class RecomputeActivationsInBackward:
    """Recompute saved activations in the backward from the values they are pointwise functions of
    (module docstring); a function without a loss and a backward is left as it is."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, graph in step_graphs(mod):
            recompute, sources = plan(graph)
            if not recompute:
                continue
            func = rewrite(mod, graph, recompute)  # (copies are bound after the loss: its index stays)
            marked = _backward_functions_of(func, graph.boundary, sources)
            updates[gv] = _MarkCopies(mod, marked).visit_expr(func) if marked else func
        for gv, func in updates.items():
            mod[gv] = func
        return relax.transform.DeadCodeElimination()(mod) if updates else mod
