"""The cost model of the EVT partitioner: global-memory bytes, and what an epilogue costs.

Byte model (used for the ILP objective and for comparing with TVM's ``FuseOps``): every kernel
reads each distinct tensor it takes once and writes each tensor that leaves it once; values that
stay inside a kernel cost nothing; a kernel made only of ``reshape`` is free (TVM rewrites it to a
view).  An unfused op is a kernel of its own, so the bytes a partition removes are

    sum(traffic(op) for op in partition) - traffic(partition).

The epilogue is not free: each compute node and each extra (auxiliary) store of an EVT epilogue
slows the kernel down, a reduction much more.  Those costs are in bytes-equivalent per element of
the node's output, fitted from the H100 measurements in ``CALIBRATION`` (see ``fit_epilogue_costs``)
and converted to the unit of the bytes the partition saves: bytes of TVM's own elementwise kernels,
which run at about 40 % of HBM bandwidth (``TVM_ELEMENTWISE_BYTES_PER_S``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

from .._rewrite import op_name

COST_MODEL_VERSION = 5  # part of the partition cache key: bump when anything below changes


# ------------------------------------------------------------------------------------ bytes
def dtype_bytes(dtype: str) -> int:
    if dtype == "bool":
        return 1
    return max(1, tvm.runtime.DataType(dtype).bits // 8)


def static_shape(expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, else None."""
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return None
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.ir.prim.expr.IntImm):
            return None
        dims.append(int(d))
    return tuple(dims)


def tensor_bytes(expr) -> int:
    """Bytes of a tensor (or of every tensor in a tuple); 0 when unknown or not a tensor."""
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TupleType):
        return sum(type_bytes(f) for f in ty.fields)
    return type_bytes(ty)


def type_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(type_bytes(f) for f in ty.fields)
    if not isinstance(ty, relax.TensorType) or ty.shape is None or not hasattr(ty.shape, "values"):
        return 0
    if any(not isinstance(d, tvm.ir.prim.expr.IntImm) for d in ty.shape.values):
        return 0
    return math.prod(int(d) for d in ty.shape.values) * dtype_bytes(str(ty.dtype))


def kernel_traffic(inputs: dict, outputs: dict) -> int:
    """Bytes moved by one kernel: {key: bytes} of the distinct tensors it reads and writes."""
    return sum(inputs.values()) + sum(outputs.values())


# ------------------------------------------------------------------------------ calibration
@dataclass(frozen=True)
class Measurement:
    """One H100 measurement of a fused GEMM + EVT epilogue against torch's cuBLAS GEMM followed by
    its own separate elementwise kernel (``reference_passes`` M x N tensors read or written)."""

    name: str
    m: int
    n: int
    k: int
    nodes: int  # compute nodes in the epilogue
    aux_stores: int  # stores besides the GEMM's output D
    fused_over_reference: float  # time(fused) / time(torch GEMM + separate kernel)
    source: str
    aux_loads: int = 0  # M x N tensors the epilogue loads
    reference_passes: int = 2  # M x N tensors the separate kernel moves


_SOURCE = (
    "H100 80GB HBM3, bf16, CUTLASS 4.2 SM90 EVT, best of the quick config table, vs torch 2.11 cuBLAS "
    "+ its separate kernel; scripts/bench_gemm.py --quick --jobs 16 at commit 6782c26"
)

CALIBRATION: tuple[Measurement, ...] = (
    # bias + GELU + pre-activation store; torch: F.linear (bias in cuBLASLt), gelu: 0.2799 / 0.2890 ms
    Measurement("ffn1_bias_gelu_aux", 16384, 4096, 1024, nodes=2, aux_stores=1, fused_over_reference=0.969,
                source=_SOURCE),
    # dX * gelu'(pre); torch: matmul, gelu_backward: 0.3062 / 0.3244 ms
    Measurement("ffn2_dx_gelu_backward", 16384, 4096, 1024, nodes=1, aux_stores=0, fused_over_reference=0.944,
                source=_SOURCE, aux_loads=1, reference_passes=3),
    # dX * (pre > 0); torch: matmul, threshold_backward: 0.2197 / 0.3213 ms
    Measurement("ffn2_dx_relu_backward", 16384, 4096, 1024, nodes=1, aux_stores=0, fused_over_reference=0.684,
                source=_SOURCE, aux_loads=1, reference_passes=3),
    # bias + dropout + residual; torch: F.linear, dropout (+ mask), add: 0.2618 / 0.2488 ms
    Measurement("ffn2_bias_dropout_residual", 16384, 1024, 4096, nodes=3, aux_stores=0, fused_over_reference=1.052,
                source=_SOURCE, aux_loads=1, reference_passes=5),
)
"""The sign flips with the shape (wave quantization and the persistent kernel's overlap of stores
with the next tile's main loop), which no per-element cost can express; the fit takes the mean."""

# The roofline used to turn the measured ratios into bytes-equivalent (H100 SXM5 datasheet; the
# GEMM rate is what cuBLAS reaches on these shapes, ~70 % of the 989 TFLOP/s dense bf16 peak).
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_GEMM_FLOP_PER_S = 0.7 * 989e12
CALIBRATION_DTYPE_BYTES = 2

# What the ops a partition takes away cost where they would otherwise run: TVM's DLight-scheduled
# elementwise kernels, measured in the BERT-Large training step on H100 (torch.profiler, commit
# after 6782c26): gelu 268 MB in 0.261 ms, the fused GELU gradient 403 MB in 0.282 ms, the attention
# scale + cast 805 MB in 0.539 ms -> 1.0-1.5 TB/s, far from HBM's 3.35.  A byte they no longer move
# saves 3.35 / 1.3 times the time a byte of epilogue overhead (at HBM speed) costs.
TVM_ELEMENTWISE_BYTES_PER_S = 1.3e12

# A row/column reduction in the epilogue (measured: the FFN2 dX column sum, M x N = 16384 x 4096):
# with the default configuration (what an untuned build runs) 0.5942 ms against that
# configuration's main loop alone 0.2184 ms (tuned, atomic: 0.3239 against 0.1756), while a
# separate reduction only re-reads the M x N tensor once.
REDUCTION_OVERHEAD_MS = (0.5942 - 0.2184, 16384 * 4096)


def fit_epilogue_costs(measurements=CALIBRATION) -> tuple[float, float]:
    """(cost per epilogue node, cost per aux store), in bytes-equivalent at HBM speed per output element.

    For each measurement: reference time = GEMM (roofline) + the separate kernel (its M x N
    passes at HBM speed); the fused kernel's overhead beyond the GEMM, in bytes at HBM speed, minus
    the bytes its aux loads and stores move, is what the epilogue costs.  The mean over the
    measurements is split evenly between the nodes and the aux stores (the data cannot separate
    them)."""
    overheads = []
    for ms in measurements:
        mn = ms.m * ms.n
        gemm = 2 * mn * ms.k / H100_BF16_GEMM_FLOP_PER_S
        separate = ms.reference_passes * mn * CALIBRATION_DTYPE_BYTES / H100_HBM_BYTES_PER_S
        fused = ms.fused_over_reference * (gemm + separate)
        extra_bytes = (fused - gemm) * H100_HBM_BYTES_PER_S / mn
        moved = (ms.aux_stores + ms.aux_loads) * CALIBRATION_DTYPE_BYTES
        overheads.append((extra_bytes - moved) / (ms.nodes + ms.aux_stores))
    per_unit = max(0.0, sum(overheads) / len(overheads))
    return per_unit, per_unit


_TVM_SCALE = TVM_ELEMENTWISE_BYTES_PER_S / H100_HBM_BYTES_PER_S
_NODE, _STORE = fit_epilogue_costs()
EPILOGUE_NODE_COST, AUX_STORE_COST = _NODE * _TVM_SCALE, _STORE * _TVM_SCALE
"""Bytes-equivalent per output element, in the unit of the bytes TVM's kernels move: charged for
each compute node of an epilogue and for each store beyond the GEMM's output D."""
FUSE_REDUCTIONS = False
"""Whether reductions may join an epilogue at all.  Off.  When it was first measured, every
fused reduction was slower than a separate one: the FFN2 dX column sum ran at 0.78x of torch's
matmul + sum when tuned, and at 0.43x with the default configuration (bench_gemm). In the
BERT-Large step (batch 32, seq 512), fusing reductions (the softmax-backward row sum into the
batched attention GEMM, the LayerNorm weight gradients) made one CUTLASS kernel take 1.93 ms. The
step went 11.61 -> 11.64 ms; before, no kernel had exceeded 0.67 ms.

Since then, tuned atomic column sums beat torch (H100, 2026-11-27, docs/bench/h100-2026-11-27):
FFN2 dX 0.228 against 0.253 ms, FFN1 dX 0.198 against 0.209. But they add 0.02-0.05 ms to the
GEMM alone (0.178 ms). That is about what the step's separate TVM sums of the same tensors take
(0.014 ms for 16384x1024, 0.049 for 16384x4096), so fusing would gain nothing there. And an
untuned build, which has no atomic variant, would lose."""
REDUCTION_COST = REDUCTION_OVERHEAD_MS[0] * 1e-3 * H100_HBM_BYTES_PER_S / REDUCTION_OVERHEAD_MS[1] * _TVM_SCALE
"""Bytes-equivalent per element of the reduced M x N tile, for a reduction in the epilogue."""

FREE_NODE_OPS = frozenset({"relax.reshape", "relax.permute_dims"})  # folded into strides
WIDENING_CONSUMERS = frozenset({"relax.nn.softmax"})
"""Ops whose kernel reads a 16-bit input through a widening ``astype`` (FuseSoftmaxDropout on the
CUDA route, FuseOps' injective producers elsewhere): such a cast stays out of epilogues, so the GEMM
stores the narrow value."""
REDUCTION_OPS = frozenset({"relax.sum", "relax.max"})
TVM_REDUCTION_OPS = REDUCTION_OPS | frozenset({"relax.mean", "relax.min", "relax.prod", "relax.variance", "relax.std"})
"""Reductions of TVM kernels: FuseOps gives each one its elementwise producers."""


def node_cost(elements: int, op: str | None = None) -> float:
    """What epilogue node ``op`` (a Relax op name) costs on an M x N tile of ``elements``."""
    if op in FREE_NODE_OPS:
        return 0.0
    if op in REDUCTION_OPS:
        return REDUCTION_COST * elements
    return EPILOGUE_NODE_COST * elements


def aux_store_cost(elements: int) -> float:
    return AUX_STORE_COST * elements


# ------------------------------------------------------------------ bytes of a lowered graph
FREE_OPS = frozenset({"relax.reshape"})  # views: no kernel runs


def _tensor_leaves(expr, out: list) -> list:
    if isinstance(expr, relax.Call):
        for a in expr.args:
            _tensor_leaves(a, out)
    elif isinstance(expr, relax.Tuple):
        for f in expr.fields:
            _tensor_leaves(f, out)
    elif isinstance(expr, (relax.Var, tvm.ir.expr.Constant)) and not any(expr.same_as(o) for o in out):
        out.append(expr)
    return out


def function_traffic(func: relax.Function) -> int:
    """Modelled global-memory bytes of ``func`` where every call is one kernel (after FuseOps,
    or after partitioning: a partition is one kernel): distinct tensors read + tensors written."""
    total = 0
    for block in func.body.blocks:
        for b in block.bindings:
            value = getattr(b, "value", None)
            if not isinstance(value, relax.Call):
                continue
            if op_name(value) in FREE_OPS:
                continue
            total += sum(tensor_bytes(t) for t in _tensor_leaves(value, [])) + tensor_bytes(b.var)
    return total
