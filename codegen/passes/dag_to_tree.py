"""DAG -> tree: wrap every region where a value has several readers into a topological visitor.

For a node ``v`` with several uses, its region is every node on a path from ``v`` to its immediate
post-dominator ``d`` (with a virtual exit after all sinks; when ``d`` is the exit the region is all
of ``v``'s descendants).  Overlapping regions merge; each becomes one ``Sm90TopologicalVisitor``
whose output is the one region node read from outside.  Everything else is a plain ``Sm90EVT``
tree rooted at the D store's input.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir import EVTNode, Partition, TopoVisitor, tree_nodes
from .base import EpiloguePass, InvariantError
from .inline_stores import InlineStores, d_store

_EXIT = -1


def _descendants(users) -> list[set[int]]:
    desc: list[set[int]] = [set() for _ in users]
    for i in reversed(range(len(users))):
        desc[i] = {i}.union(*[desc[u] for u in users[i]]) if users[i] else {i}
    return desc


def _immediate_post_dominators(users) -> list[int]:
    n = len(users)
    pdom: list[frozenset] = [frozenset()] * n
    for i in reversed(range(n)):
        succ = set(users[i])
        if not succ:
            pdom[i] = frozenset({i, _EXIT})
        else:
            pdom[i] = frozenset({i}) | frozenset.intersection(*[pdom[s] for s in succ])
    ipdom = []
    for i in range(n):
        rest = [x for x in pdom[i] if x != i and x != _EXIT]
        ipdom.append(min(rest) if rest else _EXIT)
    return ipdom


def regions(p: Partition) -> list[set[int]]:
    """The merged multi-use regions of the partition's epilogue (empty when it is a tree)."""
    g = p.epilogue
    users = g.users
    root_store = d_store(p)
    desc = _descendants(users)
    ipdom = _immediate_post_dominators(users)
    found: list[set[int]] = []
    for v, u in enumerate(users):
        if len(u) < 2:
            continue
        d = ipdom[v]
        if d == _EXIT:
            region = set(desc[v])
        else:
            region = {x for x in desc[v] if d in desc[x]}
        region.discard(root_store)
        found.append(region)
    # sinks other than the D store need a visitor that visits them: region of the whole DAG tail
    merged: list[set[int]] = []
    for region in found:
        overlapping = [m for m in merged if m & region]
        for m in overlapping:
            merged.remove(m)
            region |= m
        merged.append(region)
    return merged


class DagToTree(EpiloguePass):
    """Produces ``partition.visitor``; the epilogue graph itself is unchanged."""

    dependencies = (InlineStores,)

    def call(self, p: Partition) -> Partition:
        g = p.epilogue
        root_store = d_store(p)
        comps = regions(p)
        dangling = [i for i, u in enumerate(g.users) if not u and i != root_store]
        if dangling and not comps:
            raise InvariantError(f"sinks {dangling} are not reachable from the D store's tree")
        output_of: dict[int, set[int]] = {}
        member: dict[int, int] = {}
        for ci, comp in enumerate(comps):
            outs = [x for x in comp if any(u not in comp for u in g.users[x])]
            if len(outs) != 1:
                raise InvariantError(f"region {sorted(comp)} has outputs {sorted(outs)}, need one")
            output_of[outs[0]] = comp
            for x in comp:
                member[x] = ci

        def build(x: int):
            if x in output_of:
                return topo(x, output_of[x])
            if x in member:
                raise InvariantError(f"node %{x} is read from outside its region")
            return EVTNode(x, tuple(build(i) for i in g.nodes[x].inputs))

        def topo(out: int, comp: set[int]) -> TopoVisitor:
            ops: list = []
            edges: list[tuple[int, ...]] = []
            pos: dict[int, int] = {}
            for u in sorted(comp - {out}) + [out]:
                edge = []
                for i in g.nodes[u].inputs:
                    if i not in comp:
                        ops.append(build(i))
                        edges.append(())
                        pos_i = len(ops) - 1
                    else:
                        pos_i = pos[i]
                    edge.append(pos_i)
                ops.append(u)
                edges.append(tuple(edge))
                pos[u] = len(ops) - 1
            return TopoVisitor(tuple(ops), tuple(edges), out)

        root = g.nodes[root_store].inputs[0]
        return replace(p, visitor=build(root))

    def ensures(self, p: Partition) -> None:
        if p.visitor is None:
            raise InvariantError("DagToTree produced no visitor")
        seen = tree_nodes(p.visitor)
        expected = [i for i in range(len(p.epilogue.nodes)) if i != d_store(p)]
        if sorted(seen) != expected:
            raise InvariantError(f"visitor tree covers {sorted(seen)}, expected each of {expected} once")
        _check_single_use(p.visitor, p)


def _check_single_use(v, p: Partition) -> None:
    """Outside topological visitors every value must have exactly one reader."""
    if isinstance(v, EVTNode):
        node = p.epilogue.nodes[v.node]
        if len(v.children) not in (0, len(node.inputs)):
            raise InvariantError(f"EVT node %{v.node} has {len(v.children)} children")
        for c in v.children:
            _check_single_use(c, p)
    else:
        for op in v.ops:
            if not isinstance(op, int):
                _check_single_use(op, p)
