"""The epilogue DAG and the partition it belongs to."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from functools import cached_property

from .nodes import AccFetch, AuxStore, Node, Reduction
from .tree import Visitor


@dataclass(frozen=True)
class EpilogueGraph:
    """Nodes in topological order; ``nodes[i].inputs`` only name indices below ``i``."""

    nodes: tuple[Node, ...]

    def __post_init__(self):
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                if not 0 <= j < i:
                    raise ValueError(f"node {i} ({node.kind}) reads node {j}: not topological")

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the nodes reading it (one entry per operand use, ascending)."""
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for j in node.inputs:
                users[j].append(i)
        return tuple(tuple(u) for u in users)

    @property
    def acc(self) -> int:
        found = [i for i, n in enumerate(self.nodes) if isinstance(n, AccFetch)]
        if len(found) != 1:
            raise ValueError(f"epilogue must fetch the accumulator exactly once, found {len(found)}")
        return found[0]

    def stores(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.nodes) if isinstance(n, (AuxStore, Reduction)))

    def replace(self, nodes) -> "EpilogueGraph":
        return EpilogueGraph(tuple(nodes))

    def __str__(self) -> str:
        lines = []
        for i, n in enumerate(self.nodes):
            attrs = ", ".join(
                f"{f.name}={getattr(n, f.name)!r}"
                for f in fields(n)
                if f.name not in ("inputs", "dtype", "shape")
            )
            ins = ", ".join(f"%{j}" for j in n.inputs)
            lines.append(f"%{i} = {n.kind}({ins}{'; ' if ins and attrs else ''}{attrs}) : {n.shape} {n.dtype}")
        return "\n".join(lines)


def _sort_key(node: Node, remap: dict[int, int]) -> tuple:
    attrs = tuple(
        (f.name, repr(getattr(node, f.name))) for f in fields(node) if f.name != "inputs"
    )
    return (node.kind, tuple(remap[j] for j in node.inputs), attrs)


def canonicalize(nodes) -> EpilogueGraph:
    """Renumber nodes in the canonical topological order.

    ``nodes`` may be in any order (inputs are indices into ``nodes``).  Kahn's algorithm; among ready nodes the smallest ``(kind, renumbered inputs, attributes)`` goes
    first, so two graphs that differ only in binding order get the same numbering (and emit the same
    C++, which keeps the build cache hot).  Identical duplicate nodes keep their relative order.
    """
    nodes = tuple(nodes.nodes if isinstance(nodes, EpilogueGraph) else nodes)
    n = len(nodes)
    pending = [len(set(node.inputs)) for node in nodes]
    users: list[set[int]] = [set() for _ in nodes]
    for i, node in enumerate(nodes):
        for j in node.inputs:
            users[j].add(i)
    remap: dict[int, int] = {}
    ready = [(_sort_key(node, remap), i) for i, node in enumerate(nodes) if pending[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        remap[i] = len(order)
        order.append(i)
        for u in sorted(users[i]):
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (_sort_key(nodes[u], remap), u))
    if len(order) != n:
        raise ValueError("epilogue graph has a cycle")
    return EpilogueGraph(
        tuple(_with_inputs(nodes[i], tuple(remap[j] for j in nodes[i].inputs)) for i in order)
    )


def keep_nodes(nodes, keep) -> EpilogueGraph:
    """The nodes at indices ``keep`` (which hold the inputs of each), renumbered, in canonical order."""
    keep = sorted(keep)
    index = {old: new for new, old in enumerate(keep)}
    return canonicalize([_with_inputs(nodes[i], tuple(index[j] for j in nodes[i].inputs)) for i in keep])


def _with_inputs(node: Node, inputs: tuple[int, ...]) -> Node:
    from dataclasses import replace

    return replace(node, inputs=inputs)


@dataclass(frozen=True)
class TensorDesc:
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class GemmSpec:
    """The main loop: D[l, m, n] = sum_k A[l, m, k] * B[l, k, n].

    Strides are element strides into the parameter's memory, ``a_stride = (m, k, l)`` and
    ``b_stride = (n, k, l)`` (CUTLASS's (MN, K, L) convention); a batch stride of 0 broadcasts the
    operand over the batch.  ``a_stride[1] == 1`` means A is K-major (CUTLASS "T", RowMajor);
    ``b_stride[1] == 1`` means B is K-major (CUTLASS "N" for B, ColumnMajor).
    """

    a_param: int
    b_param: int
    m: int
    n: int
    k: int
    batch: int
    a_stride: tuple[int, int, int]
    b_stride: tuple[int, int, int]
    dtype_a: str
    dtype_b: str
    dtype_acc: str = "float32"

    @property
    def a_k_major(self) -> bool:
        return self.a_stride[1] == 1

    @property
    def b_k_major(self) -> bool:
        return self.b_stride[1] == 1

    @property
    def layout_name(self) -> str:
        """BLAS-style name: first letter A (T = K-major), second B (N = K-major)."""
        return ("T" if self.a_k_major else "N") + ("N" if self.b_k_major else "T")


@dataclass(frozen=True)
class Partition:
    """One GEMM + epilogue partition, ready for the passes and the emitter.

    ``d_output`` names the output written by the collective epilogue's D store (an ``AuxStore``
    node with that output); every other output is an aux store or a reduction.
    """

    symbol: str
    params: tuple[TensorDesc, ...]
    outputs: tuple[TensorDesc, ...]
    batch_shape: tuple[int, ...]
    gemm: GemmSpec
    epilogue: EpilogueGraph
    d_output: int
    visitor: "Visitor | None" = None  # set by DagToTree

    @property
    def problem_shape(self) -> tuple[int, int, int, int]:
        return (self.gemm.m, self.gemm.n, self.gemm.k, self.gemm.batch)
