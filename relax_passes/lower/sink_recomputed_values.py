"""SinkRecomputedValues: each value recomputed in the backward is computed again just before its
first reader, after ``FuseOps`` has moved it.

``Rematerialize`` and ``RecomputeSavedPointwise`` bind a copy of a forward value just before the
backward readers that need it, so that the copy is alive only there.  ``FuseOps`` rebuilds the
dataflow block in its own order: a copy that is a kernel it does not fuse (a GEMM partition's or
an attention's call) can come out right after the loss with its first reader, while a weight
gradient that reads it last comes out at the end of the block.  Every copy is then alive across
most of the backward, and the step keeps more than it did without them (BERT-Large, batch 32,
20 GB budget: the estimated peak went from 19.0 to 27.7 GB in ``FuseOps``; batch 204, 72 GB: 159 GB
estimated, 152 GB planned, and the step ran out of the H200's memory; 68 GB estimated after this
pass).

In a function with a memory budget (``BUDGET_ATTR``) or with copies (``RecomputeSavedPointwise``,
``RecomputeActivationsInBackward`` and ``RegenerateInBackward`` make them without a budget too: the
last, on by default, in every step with dropout; BERT-Large at batch 32, FuseOps
moved RecomputeActivationsInBackward's 24 copies of gelu(x) up to the loss, and the packed arena
stayed as large as without them), in the loss's dataflow block and after the loss:

* ``hoist``: a binding that frees more bytes than it allocates (the last reader of operands larger
  than its result) moves up to just after its last operand, the first first;
* ``sink``: each copy (named with ``COPY_SUFFIX``) and each projection of one moves down to just
  before its first reader, the latest first, so that a copy follows its projections down.

Moving a binding up past none of its operands, or down past none of its readers, keeps the block
well formed.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import flat_bindings, is_copy
from ..partition.evt_cost import tensor_bytes
from ..partition.rematerialize import budgeted, loss_var


def _is_copy(binding: relax.VarBinding, copies: set) -> bool:
    """A copy's binding, or a projection of one of `copies`."""
    value = binding.value
    if is_copy(binding.var):
        return True
    return isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var) \
        and value.tuple_value in copies


def _has_copies(func) -> bool:
    """Does the Relax function `func` bind a copy (a var named with ``COPY_SUFFIX``)?"""
    return isinstance(func, relax.Function) and any(is_copy(b.var) for b in flat_bindings(func)[0])


def hoist(order: list, start: int) -> list:
    """`order` with each binding at or after `start` that frees more bytes than it allocates (it is
    the last reader of operands larger than its result: a weight gradient of a recomputed
    activation) moved up to just after its last operand, the first first."""
    reads = {b.var: list(relax.analysis.free_vars(b.value)) for b in order}

    def last_readers() -> dict:
        return {v: j for j, o in enumerate(order) for v in reads[o.var]}

    last = last_readers()
    for i in range(start, len(order)):
        var = order[i].var
        freed = sum(tensor_bytes(v) for v in reads[var] if last.get(v) == i)
        if freed <= tensor_bytes(var):
            continue
        operands = set(reads[var])
        to = max([j for j in range(start, i) if order[j].var in operands], default=start - 1) + 1
        if to < i:
            order.insert(to, order.pop(i))
            last = last_readers()
    return order


def sink(block: relax.DataflowBlock, start: int) -> relax.DataflowBlock:
    """`block` with its bindings at or after position `start` hoisted (`hoist`), then the copies
    among them moved down to their first readers."""
    order = hoist(list(block.bindings), start)
    reads = {b.var: set(relax.analysis.free_vars(b.value)) for b in order}
    copies: dict = {}  # (in binding order)
    for b in order[start:]:
        if isinstance(b, relax.VarBinding) and _is_copy(b, copies):
            copies[b.var] = None
    for var in reversed(copies):  # the latest first: a copy's projections are already where they go
        at = next(i for i, b in enumerate(order) if b.var.same_as(var))
        reader = next((i for i in range(at + 1, len(order)) if var in reads[order[i].var]), None)
        if reader is None or reader == at + 1:
            continue
        order.insert(reader - 1, order.pop(at))
    return relax.DataflowBlock(order)


@tvm.transform.module_pass(opt_level=0, name="SinkRecomputedValues")
class SinkRecomputedValues:
    """Move recomputed values down to their first readers (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not (budgeted(func) or _has_copies(func)):
                continue
            bindings, _ = flat_bindings(func)
            loss = loss_var(func, bindings)
            blocks = list(func.body.blocks)
            for bi, block in enumerate(blocks):
                at = next((i for i, b in enumerate(block.bindings) if b.var.same_as(loss)), None)
                if at is not None and isinstance(block, relax.DataflowBlock):
                    blocks[bi] = sink(block, at + 1)
                    updates[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                                 func.is_pure, func.attrs, func.span)
        for gv, func in updates.items():
            mod[gv] = func
        # the new SeqExpr's type is filled in, as for any expression built outside a BlockBuilder
        return relax.transform.Normalize()(mod) if updates else mod
