"""Store inlining: a store passes its input through, so the other readers of a stored value read
the store instead.  Stores then sit on the path to their readers (CUTLASS's EVT shape) and a
value stored twice becomes a chain of stores.  The D store (written by the collective epilogue
from the visitor tree's result) gets a value of its own: when its input has other readers, an
identity cast is inserted so the tree's root is read by D alone."""
from __future__ import annotations

from dataclasses import replace

from ..ir import AuxStore, Compute, OpKind, Partition, Reduction, canonicalize
from .base import EpiloguePass, InvariantError
from .eliminate_layout import EliminateLayout


def d_store(p: Partition) -> int:
    found = [
        i for i, n in enumerate(p.epilogue.nodes) if isinstance(n, AuxStore) and n.output == p.d_output
    ]
    if len(found) != 1:
        raise InvariantError(f"expected one D store for output {p.d_output}, found {len(found)}")
    return found[0]


class InlineStores(EpiloguePass):
    dependencies = (EliminateLayout,)

    def call(self, p: Partition) -> Partition:
        nodes = list(p.epilogue.nodes)
        d = d_store(p)
        for s, store in enumerate(p.epilogue.nodes):
            if s == d or not isinstance(store, (AuxStore, Reduction)):
                continue
            src = nodes[s].inputs[0]
            for u, node in enumerate(nodes):
                if u != s and src in node.inputs:
                    nodes[u] = replace(node, inputs=tuple(s if j == src else j for j in node.inputs))
        root = nodes[d].inputs[0]
        if any(root in n.inputs for u, n in enumerate(nodes) if u != d):
            src = nodes[root]
            nodes.append(Compute(op=OpKind.CAST, inputs=(root,), dtype=src.dtype, shape=src.shape))
            nodes[d] = replace(nodes[d], inputs=(len(nodes) - 1,))
        return replace(p, epilogue=canonicalize(nodes))

    def ensures(self, p: Partition) -> None:
        g = p.epilogue
        d = d_store(p)
        root = g.nodes[d].inputs[0]
        if g.users[root] != (d,):
            raise InvariantError(f"the D store's input %{root} has other readers {g.users[root]}")
        for s in g.stores():
            if s == d:
                continue
            src = g.nodes[s].inputs[0]
            if set(g.users[src]) != {s} or len(g.users[src]) != 1:
                raise InvariantError(f"stored value %{src} still has readers besides store %{s}")
