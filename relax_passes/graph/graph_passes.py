"""evt_graph_passes: the training-graph rewrites that expose EVT epilogue fusion, in order.

Run on a module after Gradient / AppendOptimizer (``main``, ``main_adjoint``, ``train_step``);
every pass rewrites every Relax function of the module and keeps its outputs numerically.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .accumulate_in_float32 import AccumulateInFloat32
from .decompose_batch_norm import DecomposeBatchNorm
from .decompose_cross_entropy import DecomposeCrossEntropy
from .decompose_layer_norm import DecomposeLayerNorm
from .decompose_matmul_bias import DecomposeMatmulBias
from .eliminate_loss import EliminateLoss
from .eliminate_masked_fill_gradient import EliminateMaskedFillGradient
from .eliminate_reduction import EliminateReduction
from .eliminate_softmax_backward_reduction import EliminateSoftmaxBackwardReduction
from .fold_constants import FoldConstants
from .fold_layout import FoldLayoutIntoMatmul
from .fuse_column_moments import FuseColumnMoments
from .narrow_before_layout import NarrowBeforeLayout
from .save_normalized_low_precision import SaveNormalizedLowPrecision
from .save_softmax_low_precision import SaveSoftmaxLowPrecision
from .swap_transposed_matmul import SwapTransposedMatmul


def evt_graph_passes(save_softmax_low_precision: bool = False,
                     save_normalized_low_precision: bool = False) -> tvm.transform.Sequential:
    """The ordered graph passes run before partitioning for EVT (`save_softmax_low_precision`,
    `save_normalized_low_precision`: add SaveSoftmaxLowPrecision / SaveNormalizedLowPrecision,
    which change the softmax's / an affine-free layer norm's gradient inputs by a bf16 rounding)."""
    return tvm.transform.Sequential(
        [
            # backward of the loss head free of the loss value; seed constants folded
            EliminateLoss(),
            # epilogue-friendly forms: reductions + elementwise, bias as a GEMM epilogue
            DecomposeCrossEntropy(),
            DecomposeLayerNorm(),
            DecomposeBatchNorm(),
            DecomposeMatmulBias(),
            relax.transform.CanonicalizeBindings(),
            # reductions that need not exist go, then layout chains collapse onto matmuls
            EliminateReduction(),
            EliminateSoftmaxBackwardReduction(),  # attention: rowsum(P*dP) -> rowsum(dO*O)
            AccumulateInFloat32(),  # the backward's bf16 sums (bias, batch norm) add in fp32
            FuseColumnMoments(),  # a batch norm's two column sums of a direction: one pass over its input
            *([SaveSoftmaxLowPrecision()] if save_softmax_low_precision else []),  # dS reads bf16 P
            # an affine-free layer norm's gradient reads the bf16 xhat its GEMMs read
            *([SaveNormalizedLowPrecision()] if save_normalized_low_precision else []),
            EliminateMaskedFillGradient(),  # causal masks: P is already 0 where dS was masked
            SwapTransposedMatmul(),  # (x^T dy)^T -> dy^T x: weight gradients need no transpose
            FoldLayoutIntoMatmul(),
            NarrowBeforeLayout(),  # float32 inputs cast to bf16 before they are transposed
            FoldConstants(),  # relax.transform.FoldConstant, legalizing only what can fold
            # forward statistics shared with their backward recomputation, dead loss code gone
            relax.transform.EliminateCommonSubexpr(),
            relax.transform.CanonicalizeBindings(),
            # the layout chains CSE joined: the backward's transpose of a forward permute_dims
            # (q @ k^T's dQ = dS @ k) is one of the forward's transposed operand, composed away
            FoldLayoutIntoMatmul(),
            relax.transform.DeadCodeElimination(),
        ],
        name="EVTGraphPasses",
    )
