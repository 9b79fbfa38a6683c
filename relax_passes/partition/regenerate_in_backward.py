"""RegenerateInBackward: a value the forward generates from a few bytes of the step's arguments (a
dropout keep mask from the step's seed), which the backward reads, is generated again in the
backward instead of kept from the forward to it.

``LowerDropout`` writes each dropout site as ``keep = call_tir(dropout_keep_.., (seed, site))``, a
bool mask of the activation's shape, which the forward's ``where(keep, x, 0)`` and the gradient
rule's ``where(keep, dy, 0)`` both read.  The mask is a pure function of the 8-byte seed (the
Philox convention of ``relax_passes/training/philox.py``), so the step need not keep it across the
forward: BERT-Large keeps two [tokens, 1024] masks a layer (2.6 GB at batch 102, 1 byte an element),
which this pass turns into a mask kernel in the backward (it writes the mask once more, before the
GEMM epilogue that reads it).  Tempo (NeurIPS'22) keeps dropout masks as bits; FlashAttention,
like the attention kernels here, regenerates them.

The rule is the graph property, not dropout by name: a saved forward value that is a call of the
step's arguments alone (no forward value among its operands), pure, whose tensor operands have at
most ``OPERAND_SHARE`` of its bytes (a generator, not a cast of a weight: that would read more
than it keeps), is bound again just before its first backward reader (``Rematerialize``'s
rewrite; a copy, ``COPY_SUFFIX``, which joins no GEMM epilogue and which ``SinkRecomputedValues``
keeps next to its readers).  The numbers are the forward's: the same call on the same arguments.
A function with a memory budget is left to ``Rematerialize``, whose plan recomputes masks with the
rest (it finds lower plans without these copies: a 4-layer MLP with dropout, 2.87 against 2.95 MB
at its lowest).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .evt_cost import tensor_bytes
from .rematerialize import StepGraph, budgeted, rewrite, step_graphs, tensor_args

OPERAND_SHARE = 1 / 16  # a generated value's tensor operands: at most this share of its own bytes


def plan(graph: StepGraph) -> set:
    """The saved forward calls to generate again in the backward."""
    out = set()
    for v in graph.saved:
        node = graph.nodes[v]
        if v in graph.pinned or not node.recomputable or node.operands or not isinstance(node.value, relax.Call):
            continue
        own = tensor_bytes(v)
        if own and sum(tensor_bytes(a) for a in tensor_args(node.value)) <= OPERAND_SHARE * own:
            out.add(v)
    return out


@tvm.transform.module_pass(opt_level=0, name="RegenerateInBackward")
class RegenerateInBackward:
    """Generate saved values of the step's arguments alone again in the backward (module
    docstring); a function without a loss and a backward is left as it is."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # under a memory budget Rematerialize's plan decides what is recomputed, masks too
        updates = {gv: rewrite(mod, graph, regenerate) for gv, graph in step_graphs(mod, skip=budgeted)
                   if (regenerate := plan(graph))}
        for gv, func in updates.items():
            mod[gv] = func
        return mod
