"""What an SM90 EVT epilogue can express: the query API for the partitioner.

``legality(func)`` runs the frontend, the passes and the emitter's checks on a candidate partition
and returns a ``Legality`` with the reason when it cannot be offloaded (the partition then stays
with TVM, never computed wrongly).  ``pattern_check`` plugs the same test into
``FuseOpsByPattern`` as a pattern's ``check``.  ``CAPABILITIES`` lists the rules as data.
"""
from __future__ import annotations

from dataclasses import dataclass

from .backend import KernelConfig, default_config, smem
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
        "operand strides are nonzero over M, N and K (no broadcast operand, no extent-1 K)",
        "reductions are terminal (their result leaves the partition) and never over the batch",
        "intermediates may leave the partition (aux stores); at least one output is M x N",
        "every output depends on the matmul",
        "shared memory: with some configuration (the default first, then narrower epilogue subtiles "
        "and CTA tiles) the epilogue's D, aux-load and aux-store buffers leave room for 2 main-loop "
        f"stages within {smem.SM90_SMEM_CAPACITY} bytes per CTA",
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
        Sm90Emitter(lowered, config).emit()  # the node, dtype and alignment rules
        chosen = fitting_config(lowered, config)
        if chosen != (config or default_config(lowered.gemm.dtype_a)):
            Sm90Emitter(lowered, chosen).emit()
    except Unsupported as err:
        return Legality(False, err.reason)
    return Legality(True, partition=lowered)


def fitting_config(lowered: Partition, config: KernelConfig | None = None) -> KernelConfig:
    """``config`` (default: the default configuration) or the first fallback whose main loop gets
    2+ shared-memory stages (``backend.smem.fit_config``); ``Unsupported`` naming the byte counts
    when none does."""
    config = config or default_config(lowered.gemm.dtype_a)
    chosen = smem.fit_config(lowered, config)
    if chosen is None:
        tightest = min((smem.usage(lowered, c) for c in smem.fallbacks(config)), key=lambda u: u.epilogue_bytes)
        raise Unsupported(
            "the epilogue needs too much shared memory for 2 main-loop stages in any configuration: "
            f"{smem.usage(lowered, config).describe()}; smallest: {tightest.describe()}"
        )
    return chosen


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
