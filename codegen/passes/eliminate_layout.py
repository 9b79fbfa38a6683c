"""Layout elimination: ``TensorInput -> Permute/Reshape*`` chains become strided loads.

The strides decide the load kind, as in CUTLASS's EVT: (0, 0) scalar broadcast, (0, 1) row
broadcast, (1, 0) column broadcast, (*, 1) row-major and (1, *) column-major aux load.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import Unsupported
from ..ir import (
    AuxLoad,
    ColBroadcast,
    LAYOUT_KINDS,
    Partition,
    Permute,
    Reshape,
    RowBroadcast,
    ScalarBroadcast,
    TensorInput,
    keep_nodes,
)
from ..ir.views import View, mnl_strides
from .base import EpiloguePass, InvariantError
from .propagate_shape_dtype import PropagateShapeDtype


def view_of(nodes, i: int) -> tuple[int, View]:
    """(parameter, view) of the layout chain ending at node ``i``."""
    node = nodes[i]
    if isinstance(node, TensorInput):
        return node.param, View.of(tuple(node.shape))
    param, view = view_of(nodes, node.inputs[0])
    if isinstance(node, Permute):
        return param, view.permute(node.axes)
    if isinstance(node, Reshape):
        return param, view.reshape(tuple(node.new_shape))
    raise InvariantError(f"node {i} ({node.kind}) is not a layout node")


def classify_load(param: int, stride, shape, dtype, what: str):
    sm, sn, sl = stride
    kw = dict(param=param, stride=(sm, sn, sl), shape=tuple(shape), dtype=dtype)
    if sm == 0 and sn == 0:
        return ScalarBroadcast(**kw)
    if sm == 0 and sn == 1:
        return RowBroadcast(**kw)
    if sm == 1 and sn == 0:
        return ColBroadcast(**kw)
    if sn == 1 or sm == 1:
        return AuxLoad(**kw)
    raise Unsupported(f"{what} has no unit stride along M or N (strides {stride})")


class EliminateLayout(EpiloguePass):
    dependencies = (PropagateShapeDtype,)

    def requires(self, p: Partition) -> None:
        if any(n.shape is None for n in p.epilogue.nodes):
            raise InvariantError("EliminateLayout needs shapes (run PropagateShapeDtype)")

    def call(self, p: Partition) -> Partition:
        nodes = list(p.epilogue.nodes)
        loads: dict[int, int] = {}  # layout node -> new load node
        for i, node in enumerate(list(nodes)):
            if isinstance(node, LAYOUT_KINDS):
                continue
            new_inputs = []
            for j in node.inputs:
                if isinstance(nodes[j], LAYOUT_KINDS):
                    if j not in loads:
                        param, view = view_of(nodes, j)
                        what = f"operand {p.params[param]!r}"
                        stride = mnl_strides(view, p.batch_shape, p.gemm.m, p.gemm.n, what)
                        nodes.append(classify_load(param, stride, view.shape, nodes[j].dtype, what))
                        loads[j] = len(nodes) - 1
                    j = loads[j]
                new_inputs.append(j)
            nodes[i] = replace(node, inputs=tuple(new_inputs))
        # drop layout nodes (now unused) and renumber
        keep = [i for i, n in enumerate(nodes) if not isinstance(n, LAYOUT_KINDS)]
        return replace(p, epilogue=keep_nodes(nodes, keep))

    def ensures(self, p: Partition) -> None:
        for i, node in enumerate(p.epilogue.nodes):
            if isinstance(node, LAYOUT_KINDS):
                raise InvariantError(f"node {i} ({node.kind}) survived layout elimination")
