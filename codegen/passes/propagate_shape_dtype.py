"""Shape & dtype propagation: every node gets its logical shape and element type."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import Unsupported
from ..ir import (
    AccFetch,
    AuxStore,
    COMPARISONS,
    LOGICAL,
    Compute,
    Dropout,
    OpKind,
    Partition,
    Permute,
    Reduction,
    ReduceAxis,
    Reshape,
    TensorInput,
    arity,
    canonicalize,
)
from .base import EpiloguePass, InvariantError


def broadcast_shapes(*shapes):
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError as err:
        raise Unsupported(f"operand shapes {shapes} do not broadcast") from err


class PropagateShapeDtype(EpiloguePass):
    def call(self, p: Partition) -> Partition:
        out_shape = tuple(p.batch_shape) + (p.gemm.m, p.gemm.n)
        nodes = list(p.epilogue.nodes)
        for i, node in enumerate(nodes):
            ins = [nodes[j] for j in node.inputs]
            if isinstance(node, AccFetch):
                shape, dtype = out_shape, node.dtype or p.gemm.dtype_acc
            elif isinstance(node, TensorInput):
                desc = p.params[node.param]
                shape, dtype = desc.shape, desc.dtype
            elif isinstance(node, Permute):
                shape, dtype = tuple(ins[0].shape[a] for a in node.axes), ins[0].dtype
            elif isinstance(node, Reshape):
                if int(np.prod(node.new_shape)) != int(np.prod(ins[0].shape)):
                    raise Unsupported(f"reshape {ins[0].shape} -> {node.new_shape}")
                shape, dtype = node.new_shape, ins[0].dtype
            elif isinstance(node, Compute):
                if len(ins) != arity(node.op):
                    raise InvariantError(f"{node.op} takes {arity(node.op)} operands, got {len(ins)}")
                shape = broadcast_shapes(*[x.shape for x in ins])
                dtype = self._compute_dtype(node, ins)
            elif isinstance(node, (Dropout, AuxStore)):
                shape, dtype = ins[0].shape, ins[0].dtype
            elif isinstance(node, Reduction):
                shape, dtype = self._reduced_shape(ins[0].shape, node.axis), node.dtype or ins[0].dtype
            else:  # loads created by EliminateLayout keep what they were given
                shape, dtype = node.shape, node.dtype
            nodes[i] = replace(node, shape=tuple(shape), dtype=dtype)
        return replace(p, epilogue=canonicalize(nodes))

    @staticmethod
    def _compute_dtype(node: Compute, ins) -> str:
        if node.op is OpKind.CAST:
            if node.dtype is None:
                raise InvariantError("cast without a target dtype")
            return node.dtype
        values = ins[1:] if node.op is OpKind.WHERE else ins
        dtypes = {x.dtype for x in values}
        if len(dtypes) != 1:
            raise Unsupported(f"{node.op.value} mixes dtypes {sorted(dtypes)}")
        dtype = "bool" if node.op in COMPARISONS | LOGICAL else dtypes.pop()
        if node.dtype is not None and node.dtype != dtype:
            raise Unsupported(f"{node.op.value} yields {dtype}, annotated {node.dtype}")
        return dtype

    @staticmethod
    def _reduced_shape(shape, axis: ReduceAxis):
        batch = tuple(shape[:-2])
        return {
            ReduceAxis.ROW: batch + (shape[-1],),
            ReduceAxis.COL: batch + (shape[-2],),
            ReduceAxis.SCALAR: batch,
        }[axis]

    def ensures(self, p: Partition) -> None:
        for i, node in enumerate(p.epilogue.nodes):
            if node.shape is None or node.dtype is None:
                raise InvariantError(f"node {i} ({node.kind}) has no shape/dtype after propagation")
