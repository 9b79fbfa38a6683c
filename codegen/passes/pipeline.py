"""The lowering from a parsed partition to an emittable one, as one list of named steps."""
from __future__ import annotations

from ..ir import Partition
from .base import EpiloguePass
from .dag_to_tree import DagToTree
from .eliminate_layout import EliminateLayout
from .fold_activation_gradient import FoldActivationGradient
from .inline_stores import InlineStores
from .propagate_shape_dtype import PropagateShapeDtype

PIPELINE: tuple[type[EpiloguePass], ...] = (
    PropagateShapeDtype,  # every node gets its logical shape and dtype
    EliminateLayout,  # transposes/reshapes of inputs become load strides and load kinds
    PropagateShapeDtype,  # re-check after the rewrite
    FoldActivationGradient,  # gelu'(x) spelled out by the gradient rules becomes one node
    InlineStores,  # stores pass their value on, so stored values have one reader
    DagToTree,  # multi-reader regions become topological visitors; builds partition.visitor
)


def lower(partition: Partition, dump=None) -> Partition:
    """Run ``PIPELINE``; ``dump(name, partition)`` is called after each step when given."""
    done: list[type] = []
    for pass_cls in PIPELINE:
        pass_ = pass_cls()
        missing = [d.__name__ for d in pass_.dependencies if d not in done]
        if missing:
            raise RuntimeError(f"{pass_.name} needs {missing} first")
        partition = pass_(partition)
        done.append(pass_cls)
        if dump is not None:
            dump(pass_.name, partition)
    return partition
