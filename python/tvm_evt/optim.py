"""Optimizers for `compile_training` (their update is compiled into the training step)."""

from .relax_passes.training.optimizers import SGD, AdamW, DynamicLossScale

__all__ = ["SGD", "AdamW", "DynamicLossScale"]
