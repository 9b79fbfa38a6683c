"""Passes over the epilogue IR, one per file; ``pipeline.lower`` runs them in order."""
from .base import EpiloguePass, InvariantError
from .dag_to_tree import DagToTree
from .eliminate_layout import EliminateLayout
from .fold_activation_gradient import FoldActivationGradient
from .inline_stores import InlineStores
from .pipeline import PIPELINE, lower
from .propagate_shape_dtype import PropagateShapeDtype

__all__ = [
    "DagToTree", "EliminateLayout", "EpiloguePass", "FoldActivationGradient", "InlineStores", "InvariantError", "PIPELINE",
    "PropagateShapeDtype", "lower",
]
