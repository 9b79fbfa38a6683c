"""The visitor tree the emitter walks: the epilogue DAG after ``DagToTree``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EVTNode:
    """``Sm90EVT<node, children...>``, or the bare node type when it has no children."""

    node: int
    children: tuple["Visitor", ...] = ()


@dataclass(frozen=True)
class TopoVisitor:
    """``Sm90TopologicalVisitor``: ``ops`` in topological order, the last one is the output.

    An op is either a graph node index (evaluated on the outputs of the ops named in ``edges``) or
    a complete sub-visitor (with an empty edge list).
    """

    ops: tuple["int | Visitor", ...]
    edges: tuple[tuple[int, ...], ...]
    output: int  # the graph node the visitor yields


Visitor = EVTNode | TopoVisitor


def tree_nodes(v: Visitor) -> list[int]:
    """Every graph node the visitor evaluates, in visiting order."""
    if isinstance(v, EVTNode):
        out = []
        for c in v.children:
            out += tree_nodes(c)
        return out + [v.node]
    out = []
    for op in v.ops:
        out += [op] if isinstance(op, int) else tree_nodes(op)
    return out
