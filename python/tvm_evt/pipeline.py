"""The ``evt`` Relax pipeline: ``tvm.compile(mod, target=..., relax_pipeline="evt")``.

tvm-evt runs in five phases, each one folder (``PHASES``; the order a training step goes through):

    import      python/tvm_evt/frontend.py, converters.py: torch.export -> Relax ``main``
    training    relax_passes/training: forward rewrites before ``Gradient`` (dropout as Philox
                masks, the custom ops: attention, implicit-GEMM convolution, batch norm), mixed
                precision and loss scaling, ``Gradient`` with our gradient rules, ``AppendOptimizer``
                (``tvm_evt.training.build_training_module`` runs this phase; ``relax_passes/ops``
                holds the custom ops with their legalisation and gradients)
    graph       relax_passes/graph: the EVT graph passes (loss elimination, decomposition, reduction
                elimination, layout folding, narrowing casts moved before layout ops)
    partition   relax_passes/partition: the ILP partitioner (GEMM + epilogue as Codegen="evt"
                functions), casts absorbed into epilogues, equal partitions merged; on the CPU
                route the partitions inlined back (the reference path)
    lower       relax_passes/lower: the CUDA route's offloads, kernel prebuild, row/column kernels
                and TIR schedules around TVM's own legalisation

What ``phases(target)`` runs after the training phase, in order:

    EVTGraphPasses     (graph) ``evt_graph_passes``
    FactorPointwiseAdjoints  (graph) a backward linear in dy through a pointwise chain as dy * J,
                       J from forward values (one tensor kept instead of the chain's intermediates)
    RecomputeActivationsInBackward  (partition; off by default) a saved activation that is a pointwise
                       function of a value kept anyway (gelu(x), gelu'(x)) computed again in the backward
    RegenerateInBackward  (partition) a saved value generated from a few bytes of the step's
                       arguments (a dropout keep mask from the seed) generated again in the backward
    PadUnalignedMatmuls  (partition; CUDA only) matmuls whose contiguous extents TMA cannot stride
                       over (a vocabulary of 50257, 100 classes, K = 147) zero-padded to 16 bytes
                       (and the output sliced back), so the partitioner gives them to CUTLASS
    SplitMatmulReduction  (partition; CUDA only) a matmul with a long reduction over few output tiles
                       (a weight gradient over every pixel of a batch) as a batch of K slices with
                       float32 partials and their sum, so its CTAs fill the GPU without queueing
    PartitionEVT       (partition) the ILP partitioner: GEMM + epilogue clusters as Codegen="evt" functions
    AbsorbPartitionInputCasts  a cast (or a ReLU mask's compare) that only feeds a partition's
                       epilogue moves into it
    DeduplicateEVTPartitions  structurally equal partitions merged (one CUTLASS build each)
    RecomputeSavedPointwise  (partition; off by default) kept pointwise chains of smaller tensors
                       recomputed in the backward
    Rematerialize      (partition) under ``compile_training(..., memory_budget=)``: forward values
                       recomputed in the backward instead of kept, chosen by an integer program
    -- CUDA (lower) --
    OffloadAttention   (first) fused attention calls as flash-attention kernels (relax.ext.evt_attention;
                       heads split from activations read in place, CancelTransposes), or plain ops the
                       partitioner sees where the kernels cannot take them
    OffloadConv        tvm_evt.conv2d / _dgrad / _wgrad calls as implicit-GEMM kernels (relax.ext.evt_conv),
                       or the im2col gather and a matmul where the kernels cannot take them
    PrebuildKernels    every kernel of the three codegens built in one parallel batch into the object cache
    RunCodegen         relax.ext.evt builds every partition (CUTLASS SM90 EVT kernels), evt_attention and
                       evt_conv their calls: each finds its kernels built
    LowerTakeBackward  embedding gradients as an atomic scatter-add (TVM's is one serial thread)
    SplitToSlices      a split as one slice per piece, each fusing into its reader (im2col's col2im)
    FuseSoftmaxDropout attention's softmax with its cast/dropout tail as one kernel (TVM's softmax is opaque)
    FuseLayerNorm      a decomposed layer norm left to TVM (statistics, normalize, affine, casts) as one kernel
    FuseLayerNormBackward  its input gradient (two row means and the combine) as one kernel
                       (these two, AbsorbPartitionInputCasts, SaveSoftmaxLowPrecision, the
                       vectorizing schedule rule and training.py's PadAttentionKeys can be
                       switched on or off: ``OPTIONAL``)
    GatherBeforeSlice  a pick (gather_elements) from a prefix slice reads the sliced tensor (a loss's
                       label logit from the padded logits: no copy of the slice for one element a row)
    SelectInDepthwiseDgrad  a clamp's gradient mask (ReLU6 before a depthwise convolution)
                       applied by the depthwise input gradient's kernel, not by a kernel of its own
    RecomputeElementwise  casts and centrings read by several kernels recomputed in each of them
                       instead of written once in float32 (batch norm's x32 and x - mean, a layer
                       norm's xhat from x and its statistics)
    FuseColumnMoments  (the graph phase's pass, again) a layer norm's dgamma and dbeta in one pass
    FuseColumnSums     column sums recomputing the same values in one pass
    SplitReduction     long few-output reductions (loss mean, bias gradients) in two float32 stages
    MeanAsScaledSum    a float32 mean of an elementwise result (RMSNorm's mean(x * x)), or one keeping the
                       innermost axis (a pool), as sum / n: FuseOps fuses the sum with that op, a column rule takes it
    MergeReducedAxes   a reduction over adjacent axes (a pool's H and W) over one merged axis of a reshape,
                       which the column and row reduction rules take
    LegalizeOps ...    TVM's CUDA legalisation: FuseOps (at most 64 ops a kernel), FuseTIR, then DLight's default GPU
                       schedules per function and rule (ScheduleTIRForGPU)
    SinkRecomputedValues  (after FuseTIR, budgeted functions only) recomputed copies FuseOps moved up
                       the backward go down to their first reader again, and readers that free more
                       than they allocate move up to their operands
    MergeSmallKernels  the small elementwise kernels FuseOps leaves apart (a batch norm's per-channel
                       statistics, running statistics and dgamma/dbeta views; step counters) as one
                       kernel per group that can run as one
    lowering/finalize  TVM's CUDA dataflow lowering and finalisation passes (inside ``graph_capture()``,
                       as ``compile_training(..., cuda_graph=True)`` builds, train_step's static regions
                       are lifted into CUDA graphs: ``CaptureStepGraphs``)
    PackMemoryArena    (after StaticPlanBlockMemory, on any target; with a memory budget or ``arena``)
                       the planned tensors at byte offsets of one arena, by their lifetimes
    CaptureStepGraphs  (for TVM's RewriteCUDAGraph) only train_step's static regions captured and its
                       storages lifted: TVM's pass merges every function's storages into one allocation
    -- any other target (the CPU reference path) --
    InlineEVTPartitions  (partition) the partitions' ops go back into the caller, lowered by TVM, so CI
                         checks on the CPU that the partitioned training graph computes the same values
    default_build      TVM's generic build pipeline (what tvm.compile uses for llvm: ``DEFAULT_BUILD``)

The target comes from ``tvm.target.Target.current()`` (``tvm.compile`` enters it), so dict and tag
targets (``{"kind": "cuda", "arch": "sm_90a"}``, ``"nvidia/nvidia-h100"``) both work.
"""
from __future__ import annotations

import dataclasses
import os

import tvm
from tvm import relax

from .relax_passes.graph.fuse_column_moments import LAYER_NORM, FuseColumnMoments
from .relax_passes.graph.factor_pointwise_adjoints import FactorPointwiseAdjoints
from .relax_passes.graph.graph_passes import evt_graph_passes
from .relax_passes.lower.bounded_fuse_ops import BoundedFuseOps
from .relax_passes.lower.capture_step_graphs import CUDA_GRAPH_CONFIG, CaptureStepGraphs  # TVM's RewriteCUDAGraph switch
from .relax_passes.lower.fuse_column_sums import FuseColumnSums
from .relax_passes.lower.fuse_layer_norm import FuseLayerNorm
from .relax_passes.lower.fuse_layer_norm_backward import FuseLayerNormBackward
from .relax_passes.lower.fuse_softmax_dropout import FuseSoftmaxDropout
from .relax_passes.lower.gather_before_slice import GatherBeforeSlice
from .relax_passes.lower.select_in_depthwise_dgrad import SelectInDepthwiseDgrad
from .relax_passes.lower.legalize_ops import legalize_ops
from .relax_passes.lower.lower_take_backward import LowerTakeBackward
from .relax_passes.lower.mean_as_scaled_sum import MeanAsScaledSum
from .relax_passes.lower.merge_reduced_axes import MergeReducedAxes
from .relax_passes.lower.merge_small_kernels import MergeSmallKernels
from .relax_passes.lower.non_finite_bf16_as_bits import NonFiniteBF16AsBits
from .relax_passes.lower.recompute_elementwise import RecomputeElementwise
from .relax_passes.lower.pack_memory_arena import PackMemoryArena
from .relax_passes.lower.sink_recomputed_values import SinkRecomputedValues
from .relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU
from .relax_passes.lower.split_reduction import SplitReduction
from .relax_passes.lower.split_to_slices import SplitToSlices
from .relax_passes.partition.absorb_partition_input_casts import AbsorbPartitionInputCasts
from .relax_passes.partition.deduplicate_partitions import DeduplicateEVTPartitions
from .relax_passes.partition.inline_partitions import InlineEVTPartitions
from .relax_passes.partition.pad_unaligned_matmuls import PadUnalignedMatmuls
from .relax_passes.partition.recompute_activations_in_backward import RecomputeActivationsInBackward
from .relax_passes.partition.regenerate_in_backward import RegenerateInBackward
from .relax_passes.partition.recompute_saved_pointwise import RecomputeSavedPointwise
from .relax_passes.partition.rematerialize import Rematerialize
from .relax_passes.partition.partition_evt import DEFAULT_TIME_LIMIT, PartitionEVT
from .relax_passes.partition.split_matmul_reduction import SplitMatmulReduction

PIPELINE_NAME = "evt"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stage of the pipeline: the package under ``tvm_evt`` that holds it and the passes of
    ours (``tvm.transform`` pass names) that run in it, in order."""

    name: str
    package: str
    passes: tuple[str, ...]


PHASES = (
    Phase("import", "frontend", ()),
    Phase("training", "relax_passes.training",
          ("RecognizeActivations", "LowerDropout", "ExpandSmallPower", "RecognizeRMSNorm", "FoldNormAffine", "SplitFusedProjection", "ConvertConvLayout", "CancelTransposes",
           "Conv2dToMatmul", "FuseAttention", "GroupAttentionHeads", "PadAttentionKeys", "AutoMixedPrecision", "ScaleLoss",
           "FuseBatchNorm", "AppendOptimizer", "SplitAdjoint", "AppendBucketUpdates")),
    Phase("graph", "relax_passes.graph",
          ("EliminateLoss", "DecomposeCrossEntropy", "DecomposeLayerNorm", "DecomposeBatchNorm",
           "DecomposeMatmulBias", "EliminateReduction", "EliminateSoftmaxBackwardReduction",
           "AccumulateInFloat32", "FuseColumnMoments", "SaveSoftmaxLowPrecision", "SaveNormalizedLowPrecision",
           "EliminateMaskedFillGradient",
           "SwapTransposedMatmul", "FoldLayoutIntoMatmul", "NarrowBeforeLayout", "FoldConstants",
           "FactorPointwiseAdjoints")),
    Phase("partition", "relax_passes.partition",
          ("PadUnalignedMatmuls", "SplitMatmulReduction", "PartitionEVT", "AbsorbPartitionInputCasts", "DeduplicateEVTPartitions",
           "RecomputeActivationsInBackward", "RegenerateInBackward", "RecomputeSavedPointwise", "Rematerialize",
           "InlineEVTPartitions")),
    Phase("lower", "relax_passes.lower",
          ("OffloadAttention", "OffloadConv", "PrebuildKernels", "LowerTakeBackward", "SplitToSlices",
           "FuseSoftmaxDropout", "FuseLayerNorm", "FuseLayerNormBackward", "GatherBeforeSlice", "SelectInDepthwiseDgrad",
           "RecomputeElementwise",
           "FuseColumnSums", "SplitReduction", "MeanAsScaledSum", "MergeReducedAxes", "BoundedFuseOps", "SinkRecomputedValues",
           "MergeSmallKernels", "ScheduleTIRForGPU", "NonFiniteBF16AsBits", "PackMemoryArena", "CaptureStepGraphs")),
)

# Rewrites a process can switch on or off, to bisect a problem or to measure what each gives:
# ``TVM_EVT_DISABLE=layer_norm,vectorize`` and ``TVM_EVT_ENABLE=pad_keys`` (comma-separated
# names, or ``all``; a name in both is off).  Those on by default passed the whole-step GPU check
# (tests/test_gpu_training.py) alone and together, except ``depthwise_select`` and ``merge_small``,
# checked on a GPU in torchvision's MobileNetV2 bf16 step against fp32 with each other and the rest
# (tests/test_gpu_library_models.py, 2026-12-01); one off by default has not been run on a GPU.
DISABLE_ENV = "TVM_EVT_DISABLE"
ENABLE_ENV = "TVM_EVT_ENABLE"


@dataclasses.dataclass(frozen=True)
class Rewrite:
    description: str
    default: bool = True


OPTIONAL = {
    "layer_norm": Rewrite("FuseLayerNorm / FuseLayerNormBackward: a layer norm and its input gradient as one "
                          "kernel each"),
    "vectorize": Rewrite("VectorizedElementwise: 16-byte vector loads/stores for contiguous injective kernels"),
    "input_casts": Rewrite("AbsorbPartitionInputCasts: casts that only feed an epilogue done inside it"),
    "softmax_bf16": Rewrite("SaveSoftmaxLowPrecision: the softmax gradient reads P as rounded to bf16"),
    "pad_keys": Rewrite("PadAttentionKeys: attention key lengths that are not a multiple of 16 (197) padded to one, so its "
                        "GEMMs run on CUTLASS (H100: ViT-B/16 9.77 -> 8.08 ms per step)"),
    "activations": Rewrite("RecognizeActivations: an activation written out as elementwise ops (transformers' "
                           "NewGELUActivation / FastGELUActivation, an erf GELU) as its Relax op before Gradient, "
                           "whose gradient reads x alone (GPT-2 medium's FFN1 forward stored six [16384, 4096] "
                           "intermediates, 14.0 + 9.4 ms a step on H200 with the FFN2 dX; not yet timed as the op)"),
    "nhwc": Rewrite("ConvertConvLayout (NHWC/OHWI) before Conv2dToMatmul: channel-contiguous im2col, no transposes "
                    "between convolutions (H100: ResNet-50 conv3_x 43.15 -> 24.71 ms per step)"),
    "flash_attention": Rewrite("FuseAttention: the attention core (QK^T, scale, causal mask, softmax, dropout, PV) "
                               "of bf16/fp16 steps with head dim 32, 64, 80, 96 or 128 as one tvm_evt.attention op "
                               "before Gradient (SDPA is one from import), run by flash-attention kernels on CUDA "
                               "(off: OffloadAttention writes every call out as plain ops) (H100 bf16: BERT-Large 5.77 -> 4.79, "
                               "GPT-2 medium 8.00 -> 4.98, ViT-B/16 7.12 -> 5.89 ms per step)"),
    "split_projection": Rewrite("SplitFusedProjection: a linear layer whose output is split along its features "
                                "(a fused QKV projection) as one linear layer per piece, so no split copies its output "
                                "and no concatenation rebuilds its gradient (H100 bf16: GPT-2 medium 3.93 -> 3.87 ms "
                                "per step)"),
    "fold_norm": Rewrite("FoldNormAffine (+ SaveNormalizedLowPrecision): a layer norm that only linear layers read has "
                         "its scale and shift folded into their weights, so the step keeps its bf16 xhat alone across "
                         "the forward instead of its input and output (H200 bf16, GPT-2 medium block 8 x 1024: "
                         "measured peak 587.4 -> 570.6 MB, 1.738 -> 1.814 ms per step; ViT-B/16 block at batch 128: "
                         "932.8 -> 872.0 MB, 3.503 -> 3.578 ms: about 75 us of extra weight-sized kernels either way, "
                         "so it is opt-in)", default=False),
    "rms_norm": Rewrite("RecognizeRMSNorm: an RMS norm written out as elementwise ops and a mean (transformers' "
                        "LlamaRMSNorm) as relax.nn.rms_norm before Gradient, whose input gradient FuseLayerNormBackward "
                        "makes one row kernel (H200 bf16, Llama 4 x 4096 at 8192 tokens: kernels busy 85.42 -> "
                        "84.32 ms a step, step 86.33 -> 86.25 ms; interleaved in one process 89.34 -> 89.10; "
                        "docs/bench/h200-2026-11-30d/)"),
    "weight_copies": Rewrite("AppendOptimizer(weight_copies=True): a float32 weight a bf16/fp16 step casts for its "
                             "GEMMs is kept as that copy, written by the optimizer update, instead of cast again "
                             "each step (a kernel a weight reading 4 bytes an element and writing 2) (H200 bf16, "
                             "Llama 4 x 4096: kernels busy 84.61 -> 83.65 ms a step, step 85.92 -> 85.59 ms; "
                             "docs/bench/h200-2026-11-30d/)"),
    "implicit_conv": Rewrite("Conv2dToMatmul(implicit=True): an NHWC convolution with overlapping windows (3x3) "
                             "of a bf16/fp16 step as tvm_evt.conv2d, run with its two gradients as CUTLASS SM90 "
                             "implicit-GEMM kernels on CUDA (OffloadConv): no im2col gathers or col2im sums "
                             "(H100 bf16: ResNet-50 conv3_x 7.83 -> 7.05 ms per step)"),
    "depthwise": Rewrite("Conv2dToMatmul(depthwise=True): an NHWC depthwise convolution (groups = its channels) as "
                         "tvm_evt.depthwise_conv2d, whose forward and two gradients run as direct channels-last kernels "
                         "(relax_passes/ops/depthwise_conv_op.py) instead of TVM's conv2d, conv2d_transpose and grouped "
                         "weight-gradient conv2d (H200 bf16: torchvision MobileNetV2 took 1391 ms a step before)"),
    "ln_epilogue": Rewrite("FuseLayerNormBackward(epilogue=True): the elementwise ops that alone read a layer norm's "
                           "input gradient (a residual gradient's add, a cast, dropout's scale and mask) done in its "
                           "row kernel, which writes their result instead (modelled TIR traffic: GPT-2 medium -134 MB a "
                           "step; H100 bf16: its two kernels 0.122 -> 0.072 ms, GPT-2 medium 3.59 -> 3.54 ms per "
                           "step)"),
    "norm_output": Rewrite("FuseLayerNormBackward(norm_output=True): a norm's bf16/fp16 result that backward "
                           "weight-gradient GEMMs read is written again by its gradient kernel, from the xhat it "
                           "already computes, and those GEMMs move after it, so the step keeps the norm's input "
                           "and statistics across the forward and not also its result (H200 bf16, BERT-Large "
                           "32 x 512: 19.5 -> 17.9 GB, step 86.49 -> 86.52/86.49 ms; largest batch in 80 GB 155 -> "
                           "173; docs/bench/h200x2-2026-11-30i/)"),
    "batch_norm": Rewrite("FuseBatchNorm: a training batch norm as one tvm_evt.batch_norm op before Gradient, "
                          "whose closed-form gradient sums dy and dy*(x - mean) and makes dx in one pass "
                          "(H100 bf16, with RecomputeElementwise: ResNet-50 conv3_x 19.16 -> 12.03 ms per step)"),
    "cuda_graph": Rewrite("compile_training on CUDA, except fp16: the step runs in place (optimizer update and "
                          "write-back over its state) and TVM's RewriteCUDAGraph captures its kernels into CUDA "
                          "graphs that later steps replay (H100 bf16: ResNet-50 conv3_x 6.75 -> 6.08, BERT-Large "
                          "3.22 -> 3.18 ms per step)"),
    "recompute_sigmoid": Rewrite("RecomputeElementwise(sigmoid=True): a sigmoid read by several kernels (SiLU's "
                                 "gradient in a batch norm's column sums and input-gradient pass) computed again "
                                 "in each from its input, not written and read back (H200 bf16, timm "
                                 "EfficientNet-B0 at batch 128: 18.32 -> 16.81 ms a step, kernels 18.64 -> 17.18 "
                                 "ms; docs/bench/h200-2026-12-01d/)"),
    "depthwise_select": Rewrite("SelectInDepthwiseDgrad: a clamp's gradient mask (ReLU, ReLU6, hardtanh before a "
                                "depthwise convolution) applied by the depthwise input gradient's kernel, which "
                                "reads the activation instead of storing its sum for a select kernel to read "
                                "back (H200 bf16, MobileNetV2's seven shapes at batch 128: 1.035 -> 0.616 ms, "
                                "results equal bit for bit; docs/bench/h200-2026-12-01d/depthwise-select/; MobileNetV2's "
                                "ReLU6 gradients' select kernels 0.72 -> 0.04 ms a step, docs/bench/h200-2026-12-01e/)"),
    "recompute_statistics": Rewrite("RecomputeElementwise(statistics=True): small per-channel values (batch-norm "
                                    "statistics) recomputed in each reader where that takes their kernel away "
                                    "(ResNet-50 conv3_x: 247 -> 208 kernels a step; not yet timed on a GPU)",
                                    default=False),
    "merge_small": Rewrite("MergeSmallKernels: the small elementwise kernels FuseOps leaves one an op (a batch "
                           "norm's per-channel statistics, running statistics, dgamma/dbeta copies; step counters) "
                           "merged into one kernel per group that can run as one (a MobileNetV2 replica's step: "
                           "1039 -> 581 kernels; H200 bf16, torchvision MobileNetV2 at batch 128: 1175 -> 706 launches "
                           "a step, with depthwise_select and the clamp masks in epilogues 12.34 -> 11.41 ms; "
                           "docs/bench/h200-2026-12-01e/)"),
    "partition_row_kernels": Rewrite("PartitionEVT(row_kernels=True): the ops a layer norm gradient's row kernel "
                                     "(FuseLayerNormBackward, after the partitioner) computes in passing cost no "
                                     "kernel of their own, so no GEMM epilogue takes one only to store it "
                                     "(BERT-Large's FFN1 dX stores dy, not also dy * gamma; H100 bf16, off/on/off: "
                                     "GPT-2 medium 3.40/3.38 -> 3.34, ViT-B/16 3.68/3.68 -> 3.65, BERT-Large "
                                     "3.07/3.06 -> 3.08 ms per step)"),
    "pad_matmuls": Rewrite("PadUnalignedMatmuls: on CUDA, matmuls whose operands' or output's contiguous extent is "
                           "not a multiple of 16 bytes (GPT-2's vocabulary of 50257: its LM head and gradients) "
                           "zero-padded to one, the output sliced back, so they run on CUTLASS instead of TVM's "
                           "generic kernels (not yet timed on a GPU)"),
    "split_k": Rewrite("SplitMatmulReduction: on CUDA, a matmul with a long reduction over at most half a wave "
                       "of output tiles (ResNet-50's weight gradients, 64x256 over 401408 pixels) as a batch of K "
                       "slices writing float32 partials and a TVM sum of them (H200 bf16, ResNet-50 batch 128: "
                       "the weight-gradient GEMMs 2.78 -> 1.47 ms, the step 21.14 -> 19.95 ms; "
                       "docs/bench/h200-2026-12-01b/)"),
    "factor_adjoints": Rewrite("FactorPointwiseAdjoints: a backward linear in its incoming gradient dy through a "
                               "pointwise chain of at most 8 ops (a SiLU gate written out as ops) as dy * J, J "
                               "computed in the forward, which keeps J instead of the chain's intermediates "
                               "(H200 bf16: LlamaForCausalLM 4x4096 95.78 -> 90.98 ms per step)"),
    "recompute_activations": Rewrite("RecomputeActivationsInBackward: a saved activation that is a pointwise function of "
                                     "a value the step keeps anyway (an MLP's gelu(x) and gelu'(x) of its kept x) "
                                     "computed again in the backward by TVM kernels instead of stored by the forward "
                                     "GEMM's epilogue (hf_bert_large 1 layer, batch 2 x 256: two [2, 256, 1024] tensors "
                                     "kept become one; H200, BERT-Large: 6-7 % slower a sample, batch 183 in 80 GB where "
                                     "the default fits 131)", default=False),
    "regenerate": Rewrite("RegenerateInBackward: a saved value generated from a few bytes of the step's arguments "
                          "(a dropout keep mask from the seed) generated again in the backward instead of kept "
                          "across the forward (BERT-Large: two bool [tokens, 1024] masks a layer; batch 131 planned "
                          "78.3 -> 68.2 GB; H200, a BERT-Large layer bf16 at 16 x 512: the same losses, 1.64 -> "
                          "1.59 ms, measured peak 547 -> 503 MB)"),
    "recompute_saved": Rewrite("RecomputeSavedPointwise: forward values the backward reads that are pointwise "
                               "chains of a smaller tensor (a loss's float32 exp over the bf16 logits, a layer "
                               "norm's float32 normalised input) recomputed in the backward kernels that read them "
                               "(hf_bert_large, 1 layer, batch 2 x 128: the MLM head's 31 MB exp no longer kept; "
                               "not yet timed on a GPU); off, it still runs where compile_training has a "
                               "memory_budget", default=False),
    "arena": Rewrite("PackMemoryArena: the tensors StaticPlanBlockMemory plans, packed at byte offsets of one arena "
                     "by their lifetimes instead of in per-dtype storages reused at offset 0, where that lowers the "
                     "planned peak (BERT-Large bf16 batch 102, CUDA graphs: planned 79.8 -> 62.0 GB; batch 204, "
                     "rematerialised for 72 GB: 81.2 GB of storages for at most 52.9 GB alive at once; H200: a BERT "
                     "layer's captured step computes what TVM's plan computes, in less memory); off, it still runs "
                     "where compile_training has a memory_budget"),
    "column_sums": Rewrite("FuseColumnSums: float32 column sums (and total sums) of values recomputed from shared "
                           "stored tensors as one column_sums kernel reading them once (the loss and the last layer "
                           "norm's dgamma and dbeta; H100 bf16: BERT-Large 3.17/3.18 -> 3.11, ViT-B/16 4.07/4.05 -> "
                           "3.76 ms per step)"),
}


def _switched(env: str) -> set[str]:
    names = {w.strip() for w in os.environ.get(env, "").split(",") if w.strip()}
    unknown = names - set(OPTIONAL) - {"all"}
    if unknown:
        raise ValueError(f"{env}={os.environ[env]!r}: unknown name(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(OPTIONAL)}, all")
    return names


def pass_context(config: dict | None = None, instruments: list | None = None) -> tvm.transform.PassContext:
    """The current PassContext with `config` added to its configuration and `instruments` to its
    instruments (a context entered inside another replaces it rather than adding to it)."""
    cur = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(opt_level=cur.opt_level, required_pass=list(cur.required_pass),
                                     disabled_pass=list(cur.disabled_pass),
                                     instruments=list(cur.instruments) + list(instruments or ()),
                                     config={**dict(cur.config.items()), **(config or {})})


def graph_capture() -> tvm.transform.PassContext:
    """The current PassContext with TVM's CUDA-graph rewrite switched on (a build inside it lifts
    the static regions of each function into captured CUDA graphs)."""
    return pass_context(config={CUDA_GRAPH_CONFIG: True})


def enabled(name: str) -> bool:
    """Is the optional rewrite `name` (a key of ``OPTIONAL``) on in this process?"""
    if name not in OPTIONAL:
        raise KeyError(f"unknown optional rewrite {name!r}; known: {', '.join(OPTIONAL)}")
    off, on = _switched(DISABLE_ENV), _switched(ENABLE_ENV)
    if name in off or "all" in off:
        return False
    return name in on or "all" in on or OPTIONAL[name].default


def graph_passes() -> list:
    """The EVT graph passes (``relax_passes/graph``) as one pass."""
    return [evt_graph_passes(save_softmax_low_precision=enabled("softmax_bf16"),
                             save_normalized_low_precision=enabled("fold_norm"))]


def pre_partition_passes() -> list:
    """The graph passes up to (not including) the partitioner."""
    return graph_passes() + [
        # linear backward regions through pointwise chains as dy * J (after the graph passes' CSE)
        *([FactorPointwiseAdjoints()] if enabled("factor_adjoints") else []),
        # saved activations recomputed in the backward from the values they are pointwise functions of
        *([RecomputeActivationsInBackward()] if enabled("recompute_activations") else []),
        # values generated from the step's arguments alone (dropout keep masks): generated again in the backward
        *([RegenerateInBackward()] if enabled("regenerate") else []),
        relax.transform.CanonicalizeBindings(),  # var-to-var bindings hide producers
    ]


def front_passes(time_limit: float = DEFAULT_TIME_LIMIT, use_cache: bool = True,
                 functions: tuple[str, ...] | None = None, target: tvm.target.Target | None = None) -> list:
    """The graph passes, then the partitioner.  Given a CUDA `target`, matmuls TMA cannot stride
    over are padded first (``pad_matmuls``), and the partitioner is told which ops that route's
    layer-norm gradient kernels compute in passing (``partition_row_kernels``)."""
    cuda = target is not None and target.kind.name == "cuda"
    row_kernels = cuda and enabled("layer_norm") and enabled("partition_row_kernels")
    return pre_partition_passes() + [
        *([PadUnalignedMatmuls(functions=functions)] if cuda and enabled("pad_matmuls") else []),
        *([SplitMatmulReduction(functions=functions)] if cuda and enabled("split_k") else []),
        PartitionEVT(time_limit=time_limit, use_cache=use_cache, functions=functions,
                     row_kernels=row_kernels, row_kernel_epilogue=row_kernels and enabled("ln_epilogue")),
        *([AbsorbPartitionInputCasts()] if enabled("input_casts") else []),  # casts done in epilogues
        DeduplicateEVTPartitions(),  # equal partitions (layers, adjoint vs step) built once
        # saved pointwise chains of smaller tensors (a loss's float32 exp) recomputed in the backward:
        # in every training function, or in those with a memory budget only
        RecomputeSavedPointwise(budgeted_only=not enabled("recompute_saved")),
        # forward values recomputed in the backward where train_step has a memory budget
        Rematerialize(),
    ]


def phases(target: tvm.target.Target, time_limit: float = DEFAULT_TIME_LIMIT,
           use_cache: bool = True) -> list:
    front = front_passes(time_limit, use_cache, target=target)
    if target.kind.name == "cuda":
        from tvm.relax.backend.cuda import pipeline as cuda

        from .codegen import relax_ext
        from .relax_passes.lower.offload_attention import OffloadAttention
        from .relax_passes.lower.offload_conv import OffloadConv
        from .relax_passes.lower.prebuild_kernels import PrebuildKernels

        relax_ext.register()
        return (
            # fused attention calls -> flash-attention kernels (Codegen="evt_attention"), or plain
            # ops before the partitioner where the kernels cannot take them
            [OffloadAttention(kernels=enabled("flash_attention"))]
            # tvm_evt.conv2d* calls -> implicit-GEMM kernels (Codegen="evt_conv"), or im2col + matmul
            + [OffloadConv()]
            + front
            + cuda.library_dispatch_passes(target)
            # every kernel built in one parallel batch, then each codegen finds its own built
            + [PrebuildKernels(), relax.transform.RunCodegen()]
            + [  # TVM's CUDA legalisation, with DLight applied per function and rule
                LowerTakeBackward(),  # embedding gradients: atomic scatter-add, not one thread
                SplitToSlices(),  # concat's gradient (im2col's col2im): pieces that fuse into their readers
                FuseSoftmaxDropout(),  # attention softmax + cast/mask/scale: one row-per-block kernel
                # layer norm statistics + normalize/affine/casts, and its input gradient: a kernel each
                *([FuseLayerNorm(), FuseLayerNormBackward(epilogue=enabled("ln_epilogue"),
                                                          norm_output=enabled("norm_output"))]
                  if enabled("layer_norm") else []),
                GatherBeforeSlice(),  # a loss's pick of the label logit reads the padded logits, not a copy
                # ReLU6's gradient select after a depthwise input gradient: done by that kernel
                *([SelectInDepthwiseDgrad()] if enabled("depthwise_select") else []),
                # casts and centrings read by several kernels: recomputed in each, not stored in float32
                RecomputeElementwise(statistics=enabled("recompute_statistics"), sigmoid=enabled("recompute_sigmoid")),
                # a layer norm's dgamma and dbeta: one pass over its output gradient and input
                FuseColumnMoments(LAYER_NORM, stored=True),
                # column sums recomputing the same values from the same tensors (a loss, dgamma, dbeta): one pass
                *([FuseColumnSums()] if enabled("column_sums") else []),
                SplitReduction(),  # loss mean / bias gradients: two stages DLight fills the GPU with
                # a float32 mean of an elementwise result (RMSNorm's mean(x * x)) as sum / n, which FuseOps
                # fuses with that op (it fuses no producer into TVM's mean)
                MeanAsScaledSum(),
                MergeReducedAxes(),  # a reduction over H and W over one axis: the column rule's
                legalize_ops(),  # TVM's, with an arange a kernel FuseOps fuses into its readers and two-pass group norms
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                BoundedFuseOps(),  # <= 64 ops per kernel: DLight's rules stall on hundreds
                relax.transform.FuseTIR(),
                SinkRecomputedValues(),  # copies FuseOps moved up the backward: down to their readers again
                # per-channel statistics and counters: one kernel a group, not one an op
                *([MergeSmallKernels()] if enabled("merge_small") else []),
                ScheduleTIRForGPU(vectorize=enabled("vectorize")),
                NonFiniteBF16AsBits(),  # bfloat16 infinities the CUDA codegen would print as "inff"
            ]
            + cuda.dataflow_lower_passes(target)
            + finalize(cuda.finalize_passes(target))
        )
    return front + [
        InlineEVTPartitions(),  # the CPU reference: TVM computes the partitions' ops
        relax.transform.DeadCodeElimination(),
        *finalize([make() for make in DEFAULT_BUILD]),
    ]


# TVM's relax.pipeline.default_build_pipeline(), which tvm.compile runs for llvm, as its passes (it is
# one opaque pass there): the CPU route ends with them, with ours in place (``finalize``)
DEFAULT_BUILD = (
    lambda: relax.backend.DispatchSampling(),
    lambda: relax.backend.DispatchSortScan(),
    legalize_ops,  # TVM's LegalizeOps with our rules (relax_passes/lower/legalize_ops.py)
    lambda: relax.transform.RewriteDataflowReshape(),
    lambda: relax.transform.ToNonDataflow(),
    lambda: relax.transform.RemovePurityChecking(),
    lambda: relax.transform.CallTIRRewrite(),
    lambda: relax.transform.StaticPlanBlockMemory(),
    lambda: relax.transform.RewriteCUDAGraph(),
    lambda: relax.transform.LowerAllocTensor(),
    lambda: relax.transform.KillAfterLastUse(),
    lambda: relax.transform.LowerRuntimeBuiltin(),
    lambda: relax.transform.ComputePrimValue(),
    lambda: relax.transform.VMShapeLower(),
    lambda: relax.transform.AttachGlobalSymbol(),
)
PLANNER = "StaticPlanBlockMemory"


CUDA_GRAPHS = "RewriteCUDAGraph"


def finalize(passes: list) -> list:
    """TVM's finalisation `passes` with ours: ``PackMemoryArena`` right after its memory planner (in
    every function with ``arena`` on, else in those with a memory budget), and ``CaptureStepGraphs``
    for its ``RewriteCUDAGraph`` (which would merge ``main_adjoint``'s storages into the step's)."""
    names = [p.info.name for p in passes]
    for name in (PLANNER, CUDA_GRAPHS):
        if name not in names:
            raise RuntimeError(f"TVM's build passes changed: no {name} among {names}")
    passes = [CaptureStepGraphs() if name == CUDA_GRAPHS else p for p, name in zip(passes, names)]
    at = names.index(PLANNER) + 1
    return passes[:at] + [PackMemoryArena(budgeted_only=not enabled("arena"))] + passes[at:]


def evt_pipeline(time_limit: float = DEFAULT_TIME_LIMIT, use_cache: bool = True):
    """The registered ``evt`` pipeline (a module pass reading the current target)."""

    @tvm.transform.module_pass(opt_level=0, name="EVTPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("the evt pipeline needs a target: tvm.compile(mod, target=...)")
        cache_tvm_kernels(target)
        with target:
            return tvm.transform.Sequential(phases(target, time_limit, use_cache))(mod)

    return _pipeline


def cache_tvm_kernels(target: tvm.target.Target) -> None:
    """On CUDA, the build's TVM kernels compiled once per source (``codegen/build/tvm_cuda_cache.py``:
    TVM compiles them all again on every ``tvm.compile``)."""
    if target.kind.name == "cuda":
        from .codegen.build import tvm_cuda_cache

        tvm_cuda_cache.install()


def tvm_default_cuda_pipeline():
    """TVM's default Relax CUDA pipeline (no graph passes, no partitioning, DLight for every
    kernel: the ``tvm_default`` baseline of ``scripts/bench.py``), with DLight applied per
    function and rule (`ScheduleTIRForGPU`): TVM's own ``ApplyDefaultSchedule`` stops the build
    when its Reduction rule trips an rfactor check, which it does on training graphs (BERT)."""

    @tvm.transform.module_pass(opt_level=0, name="TVMDefaultCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from tvm.relax.backend.cuda import pipeline as cuda

        target = tvm.target.Target.current()
        tvm_legalize = cuda.legalize_passes(target)
        legalize = [p for p in tvm_legalize if p.info.name != "ApplyDefaultSchedule"]
        if len(legalize) != len(tvm_legalize) - 1:
            raise RuntimeError("TVM's CUDA legalize passes changed: expected one ApplyDefaultSchedule")
        with target:
            return tvm.transform.Sequential(
                cuda.library_dispatch_passes(target) + legalize + [ScheduleTIRForGPU(), NonFiniteBF16AsBits()]
                + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target)
            )(mod)

    return _pipeline


if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:  # registering twice raises (module reload)
    relax.register_pipeline(PIPELINE_NAME)(evt_pipeline)
