"""Epilogue IR: node kinds, the DAG, the partition, the visitor tree.  Knows nothing of C++ or Relax."""
from .graph import EpilogueGraph, GemmSpec, Partition, TensorDesc, canonicalize, keep_nodes
from .nodes import (
    AccFetch,
    AuxLoad,
    AuxStore,
    ColBroadcast,
    Compute,
    Dropout,
    LAYOUT_KINDS,
    LOAD_KINDS,
    Node,
    Permute,
    Reduction,
    Reshape,
    RowBroadcast,
    ScalarBroadcast,
    STORE_KINDS,
    TensorInput,
)
from .ops import COMPARISONS, LOGICAL, OpKind, ReduceAxis, ReduceFn, arity
from .tree import EVTNode, TopoVisitor, Visitor, tree_nodes

__all__ = [
    "AccFetch", "AuxLoad", "AuxStore", "ColBroadcast", "Compute", "Dropout", "EVTNode",
    "EpilogueGraph", "GemmSpec", "LAYOUT_KINDS", "LOAD_KINDS", "Node", "OpKind", "Partition",
    "Permute", "Reduction", "ReduceAxis", "ReduceFn", "Reshape", "RowBroadcast", "STORE_KINDS",
    "ScalarBroadcast", "TensorDesc", "TensorInput", "TopoVisitor", "Visitor", "COMPARISONS", "LOGICAL",
    "arity", "canonicalize", "keep_nodes", "tree_nodes",
]
