"""The cost model of the EVT partitioner: global-memory bytes, and what an epilogue costs.

Byte model (used for the ILP objective and for comparing with TVM's ``FuseOps``): every kernel
reads each distinct tensor it takes once and writes each tensor that leaves it once; values that
stay inside a kernel cost nothing; a kernel made only of ``reshape`` is free (TVM rewrites it to a
view).  An unfused op is a kernel of its own, so the bytes a partition removes are

    sum(traffic(op) for op in partition) - traffic(partition).

The epilogue is not free: each compute node and each extra (auxiliary) store of an EVT epilogue
slows the kernel down.  Those costs are in bytes-equivalent per element of the node's output, fitted
from the H100 measurements in ``CALIBRATION`` (see ``fit_epilogue_costs``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

COST_MODEL_VERSION = 1  # part of the partition cache key: bump when anything below changes


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
        return sum(_type_bytes(f) for f in ty.fields)
    return _type_bytes(ty)


def _type_bytes(ty) -> int:
    if isinstance(ty, relax.TupleType):
        return sum(_type_bytes(f) for f in ty.fields)
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
    """One H100 measurement of a fused GEMM + EVT epilogue against cuBLAS + a separate kernel."""

    name: str
    m: int
    n: int
    k: int
    nodes: int  # compute nodes in the epilogue
    aux_stores: int  # stores besides the GEMM's output D
    fused_over_reference: float  # time(fused) / time(cuBLAS GEMM with bias + separate GELU)
    source: str


_SOURCE = (
    "H100 SXM5, bf16, CUTLASS 4.2 SM90 EVT (TMA warp-specialized, 128x256 tile) vs cuBLAS 12 GEMM "
    "with bias + separate GELU kernel; bias+GELU epilogue with two stores (pre-activation, output)"
)

CALIBRATION: tuple[Measurement, ...] = (
    Measurement("ffn_up", 16384, 4096, 1024, nodes=2, aux_stores=1, fused_over_reference=1.20, source=_SOURCE),
    Measurement("ffn_down", 16384, 1024, 4096, nodes=2, aux_stores=1, fused_over_reference=1.20, source=_SOURCE),
    Measurement("qkv", 16384, 3072, 1024, nodes=2, aux_stores=1, fused_over_reference=0.76, source=_SOURCE),
)
"""Measured by the codegen engineer on an H100 (the only numbers we have).  The sign flips with
the shape (wave quantization and the persistent kernel's overlap of stores with the next tile's
main loop), which no per-element cost can express; the fit below takes the mean."""

# The roofline used to turn the measured ratios into bytes-equivalent (H100 SXM5 datasheet; the
# GEMM rate is what cuBLAS reaches on these shapes, ~70 % of the 989 TFLOP/s dense bf16 peak).
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_GEMM_FLOP_PER_S = 0.7 * 989e12
CALIBRATION_DTYPE_BYTES = 2


def fit_epilogue_costs(measurements=CALIBRATION) -> tuple[float, float]:
    """(cost per epilogue node, cost per aux store), in bytes-equivalent per output element.

    For each measurement: reference time = GEMM (roofline) + the separate GELU kernel (reads and
    writes M x N); the fused kernel's overhead beyond the GEMM, in bytes at HBM speed, minus the
    bytes its stores move, is what the epilogue costs.  The mean over the measurements is split
    evenly between the nodes and the aux stores of the measured epilogue (the data cannot separate
    them: every measurement has the same epilogue)."""
    overheads = []
    for ms in measurements:
        mn = ms.m * ms.n
        gemm = 2 * mn * ms.k / H100_BF16_GEMM_FLOP_PER_S
        gelu = 2 * mn * CALIBRATION_DTYPE_BYTES / H100_HBM_BYTES_PER_S
        fused = ms.fused_over_reference * (gemm + gelu)
        extra_bytes = (fused - gemm) * H100_HBM_BYTES_PER_S / mn
        stored = ms.aux_stores * CALIBRATION_DTYPE_BYTES  # the aux stores' own bytes
        overheads.append((extra_bytes - stored) / (ms.nodes + ms.aux_stores))
    per_unit = max(0.0, sum(overheads) / len(overheads))
    return per_unit, per_unit


EPILOGUE_NODE_COST, AUX_STORE_COST = fit_epilogue_costs()
"""Bytes-equivalent per output element: charged for each compute node of an epilogue and for each
store beyond the GEMM's output D."""


def node_cost(elements: int) -> float:
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
            if isinstance(value.op, tvm.ir.Op) and value.op.name in FREE_OPS:
                continue
            total += sum(tensor_bytes(t) for t in _tensor_leaves(value, [])) + tensor_bytes(b.var)
    return total
