"""RecomputeSavedPointwise: a forward value the backward reads that is a pointwise chain of a
smaller tensor is recomputed in the backward from that tensor instead of kept.

After the partitioner, the forward's TVM ops that make such values are plain Relax ops: a loss's
``exp(astype(z) - max)`` over the logits, kept in float32 for the softmax's gradient (4 bytes an
element, where the bf16 logits ``z`` take 2: 2 GB for BERT-Large's MLM head at batch 32 x 512),
a layer norm's float32 ``(astype(x) - mean) * rstd`` of a bf16 input.  Recomputed by the backward
kernel that reads them, they cost it fewer bytes (``z`` instead of ``exp``) and the forward no
store; the peak keeps half as many bytes.  Before the partitioner the copies would be taken into
the forward GEMM epilogue that makes the source, and stored again: hence after it.

A saved forward value ``v`` (bound up to the loss, read after it) is recomputed, with the chain
between it and its sources, when

* ``v`` and every binding between it and its sources is a pointwise op (``POINTWISE``: the code
  generator's elementwise ops, casts, ``where``) whose operands have ``v``'s shape or broadcast
  (a row's statistics, a scalar: read by the copies as they are); a source is the first operand
  of ``v``'s shape up the chain that is not such an op (a partition's output, a parameter);
* every reader of ``v`` after the loss is a pointwise op (a kernel the copy fuses into; not a
  GEMM partition, which would need ``v`` written out again), and
* the values with the same sources keep more bytes than the sources not kept anyway.

The copies are bound just before the first backward reader (``Rematerialize``'s rewrite), with
the forward's ops and dtypes: the numbers are the same.  Off by default (``recompute_saved``)
until timed on a GPU, except in a function with a memory budget (``budgeted_only``: the
rematerialisation's ``BUDGET_ATTR``), which runs it before ``Rematerialize``: each byte it frees
costs an elementwise recompute, where the rematerialisation's cost a GEMM's (BERT-Large at batch
219: 132 -> 114 GB kept for the backward before any is recomputed).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import POINTWISE as ELEMENTWISE, elements, flat_bindings, op_name
from .evt_cost import tensor_bytes
from .rematerialize import StepGraph, budgeted, rewrite, step_graphs

POINTWISE = ELEMENTWISE | {"relax.astype"}


class _Chains:
    """Which saved values of one step are pointwise chains, and what they start from."""

    def __init__(self, graph: StepGraph):
        self.graph = graph
        self.memo: dict = {}

    def pointwise(self, v) -> bool:
        node = self.graph.nodes.get(v)
        return node is not None and node.recomputable and op_name(node.value) in POINTWISE \
            and elements(v) is not None

    def sources(self, v) -> tuple[frozenset, frozenset] | None:
        """(sources of v's shape, the chain's bindings to copy) for a pointwise `v`, else None."""
        if v in self.memo:
            return self.memo[v]
        self.memo[v] = None  # (a chain never reads itself; this guards the recursion anyway)
        size = elements(v)
        sources, chain = set(), {v}
        for a in self.graph.nodes[v].operands:
            n = elements(a)
            if n is None or n > size:
                return None
            if n < size:
                continue  # it broadcasts: read as it is
            sub = self.sources(a) if self.pointwise(a) else None
            if sub is None:
                sources.add(a)
            else:
                sources |= sub[0]
                chain |= sub[1]
        self.memo[v] = (frozenset(sources), frozenset(chain))
        return self.memo[v]


def _pointwise_readers_only(func: relax.Function, graph: StepGraph) -> set:
    """Saved vars whose every reader after the loss is a pointwise op."""
    bindings = flat_bindings(func)[0]
    ok = {v: True for v in graph.saved}
    for b in bindings[graph.boundary + 1:]:
        reads = [v for v in relax.analysis.free_vars(b.value) if v in ok]
        if reads and op_name(b.value) not in POINTWISE:
            for v in reads:
                ok[v] = False
    return {v for v, good in ok.items() if good and v not in graph.pinned}


def plan(graph: StepGraph) -> set:
    """The forward bindings to copy into the backward (module docstring)."""
    chains = _Chains(graph)
    readers_ok = _pointwise_readers_only(graph.func, graph)
    groups: dict = {}
    for v in graph.saved:
        if v in readers_ok and chains.pointwise(v):
            found = chains.sources(v)
            if found is not None and v not in found[0]:
                groups.setdefault(found[0], []).append((v, found[1]))
    candidates = {v for members in groups.values() for v, _ in members}
    kept = {v for v in graph.saved if v not in candidates}  # what the backward reads anyway
    recompute: set = set()

    def extra(sources) -> list:  # the sources that would be kept only for this group
        return [s for s in sources if s in graph.nodes and s not in kept]

    # groups whose sources are kept anyway (or are parameters) first: they save every byte
    for sources, members in sorted(groups.items(), key=lambda kv: len(extra(kv[0]))):
        extra_now = extra(sources)
        if sum(tensor_bytes(s) for s in extra_now) < sum(tensor_bytes(v) for v, _ in members):
            kept |= set(extra_now)
            for _, chain in members:
                recompute |= chain
    return recompute - kept


@tvm.transform.module_pass(opt_level=0, name="RecomputeSavedPointwise")
class RecomputeSavedPointwise:
    """Recompute saved pointwise chains in the backward from their sources (module docstring);
    a function without a loss and a backward is left as it is, and with `budgeted_only` one
    without a memory budget (``BUDGET_ATTR``)."""

    def __init__(self, budgeted_only: bool = False):
        self.budgeted_only = budgeted_only

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        skip = (lambda func: not budgeted(func)) if self.budgeted_only else None
        updates = {gv: rewrite(mod, graph, copies) for gv, graph in step_graphs(mod, skip=skip)
                   if (copies := plan(graph))}
        for gv, func in updates.items():
            mod[gv] = func
        return relax.transform.DeadCodeElimination()(mod) if updates else mod
