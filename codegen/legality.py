"""What an SM90 EVT epilogue can express: the query API for the partitioner.

``legality(func)`` runs the frontend, the passes and the emitter's checks on a candidate partition
and returns a ``Legality`` with the reason when it cannot be offloaded (the partition then stays
with TVM, never computed wrongly).  ``pattern_check`` plugs the same test into
``FuseOpsByPattern`` as a pattern's ``check``.  ``CAPABILITIES`` lists the rules as data.
"""
from __future__ import annotations

from dataclasses import dataclass

from .backend import KernelConfig
from .backend.sm90_emitter import Sm90Emitter
from .errors import Unsupported
from .frontend import SUPPORTED_EXTERNS, SUPPORTED_OPS, from_check_context, from_function
from .frontend.relax_partition import EPILOGUE_DTYPES, GEMM_DTYPES
from .ir import Partition
from .passes import lower


@dataclass(frozen=True)
class Capabilities:
    relax_ops: frozenset[str]
    extern_ops: frozenset[str]
    gemm_dtypes: frozenset[tuple[str, str]]
    epilogue_dtypes: frozenset[str]
    broadcasts: tuple[str, ...]
    reductions: tuple[str, ...]
    rules: tuple[str, ...]


CAPABILITIES = Capabilities(
    relax_ops=SUPPORTED_OPS,
    extern_ops=SUPPORTED_EXTERNS,
    gemm_dtypes=frozenset(GEMM_DTYPES),
    epilogue_dtypes=EPILOGUE_DTYPES,
    broadcasts=("MxN row-major", "MxN column-major", "row (length N)", "column (length M)", "scalar"),
    reductions=("sum", "max") + ("over M (row)", "over N (column)", "over M and N (scalar, fp32 only)"),
    rules=(
        "exactly one relax.matmul; its operands are parameters seen through permute_dims/reshape",
        "static shapes; contiguous extents of operands and M x N tensors are multiples of 16 bytes",
        "tf32 (float32) GEMMs need K-major A and B",
        "reductions are terminal (their result leaves the partition) and never over the batch",
        "intermediates may leave the partition (aux stores); at least one output is M x N",
        "every output depends on the matmul",
    ),
)


@dataclass(frozen=True)
class Legality:
    ok: bool
    reason: str = ""
    partition: Partition | None = None

    def __bool__(self) -> bool:
        return self.ok


def check_partition(partition: Partition, config: KernelConfig | None = None) -> Legality:
    try:
        lowered = lower(partition)
        emitter = Sm90Emitter(lowered, config)
        emitter.emit()
    except Unsupported as err:
        return Legality(False, err.reason)
    return Legality(True, partition=lowered)


def legality(func, config: KernelConfig | None = None) -> Legality:
    """Can the Relax partition ``func`` run as one SM90 GEMM + EVT kernel?"""
    try:
        partition = from_function(func)
    except Unsupported as err:
        return Legality(False, err.reason)
    return check_partition(partition, config)


def can_fuse(func, config: KernelConfig | None = None) -> bool:
    return legality(func, config).ok


def pattern_check(ctx) -> bool:
    """A ``FusionPattern.check``: accept the match only when the epilogue can express it."""
    try:
        partition = from_check_context(ctx)
    except Unsupported:
        return False
    return check_partition(partition).ok
