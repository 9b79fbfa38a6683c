"""Shared memory of an SM90 GEMM + EVT kernel, as CUTLASS 4.2 lays it out, and the configurations
that fit.

The main loop gets what the epilogue leaves: the kernel template builds the main loop with
``StageCountAutoCarveout<sizeof(CollectiveEpilogue::SharedStorage)>``, so

    stages = (232448 - round_up(epilogue, 128)) // (round_up((TM*TK*bits_a + TN*TK*bits_b)/8, 128) + 16)

(``compute_stage_count_or_override`` in gemm/collective/builders/sm90_gmma_builder.inl; 232448 B =
227 KiB is ``sm90_smem_capacity_bytes``; 16 B are the stage's full/empty barriers), and the
collective main loop static_asserts ``Stages >= 2``.

The epilogue (collective/sm90_epilogue_tma_warpspecialized.hpp, builders/sm90_builder.inl):

* epilogue tile: ``EpilogueTileAuto`` is (min(128, TM), gcd(min(32, TN), TN)) for the cooperative
  schedule, (min(64, TM), gcd(min(N', TN), TN)) for ping-pong (N' = 64 for 8-bit D, else 32);
  ``EpiTiles = TM*TN / (EM*EN)``;
* stages: C is void in our kernels, so ``StagesD = min(EpiTiles, 2)``, ``StagesC = min(EpiTiles, 4)``;
* the D buffer: ``StagesD`` epilogue tiles of D elements (a union with the empty C buffer);
* the fusion's storage (``Sm90VisitorImpl``: a ``cute::tuple`` of the nodes' storages, children
  before their node): an ``Sm90AuxLoad`` holds ``StagesC`` epilogue tiles (``AuxLoadDescriptor``),
  an ``Sm90AuxStore`` ``StagesD`` tiles (``AuxStoreDescriptor``), each aligned to its swizzle
  (128 B to 1 KiB); an ``Sm90RowBroadcast`` TN elements; everything else (accumulator, column and
  scalar broadcasts, compute, dropout, and the reductions, which are atomic, so they never use
  the D buffer as scratch) has none;
* the load pipeline's barriers: 16 B per C stage.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..ir import AuxLoad, AuxStore, EVTNode, Partition, RowBroadcast
from .config import KernelConfig, Schedule
from .functors import BITS

SM90_SMEM_CAPACITY = 232448  # cutlass::gemm::collective::detail::sm90_smem_capacity_bytes (227 KiB)
MIN_STAGES = 2  # the collective main loop's static_assert
BARRIER_BYTES = 16  # PipelineTmaAsync<1>::SharedStorage: one full and one empty 8-byte barrier


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _bytes(dtype: str) -> int:
    return BITS[dtype] // 8


def swizzle_alignment(contiguous_bytes: int) -> int:
    """``alignment_for_swizzle`` of the smem atom ``ss_smem_selector`` picks for a tile whose
    contiguous extent is ``contiguous_bytes``: SW128 (1 KiB), SW64, SW32, or interleaved (128 B)."""
    for width, align in ((128, 1024), (64, 512), (32, 256)):
        if contiguous_bytes % width == 0:
            return align
    return 128


# ------------------------------------------------------------------------------- struct layout
@dataclass(frozen=True)
class _Storage:
    size: int
    align: int


_EMPTY = None  # an empty struct (takes no room inside a cute::tuple)


def _struct(fields: list[_Storage]) -> _Storage:
    offset, align = 0, 1
    for f in fields:
        offset = _round_up(offset, f.align) + f.size
        align = max(align, f.align)
    return _Storage(_round_up(offset, align), align)


def _tuple(members: list[_Storage | None]) -> _Storage | None:
    """``cute::tuple`` (cute/container/tuple.hpp, ``eso::ESO``): empty members take no room; the
    first non-empty member, then the rest as a nested struct."""
    if not members or all(m is _EMPTY for m in members):
        return _EMPTY
    first, rest = members[0], members[1:]
    tail = _tuple(rest)
    return _struct([f for f in (first, tail) if f is not _EMPTY])


# ---------------------------------------------------------------------------------------- model
def epilogue_tile(config: KernelConfig, d_dtype: str) -> tuple[int, int]:
    """The epilogue subtile CUTLASS uses (``sm90_compute_tile_shape_or_override``)."""
    if config.epi_tile is not None:
        return config.epi_tile
    tm, tn, _ = config.tile
    if config.schedule is Schedule.COOPERATIVE:
        return (min(128, tm), math.gcd(min(32, tn), tn))
    n_perf = 64 if BITS[d_dtype] == 8 and tn % 64 == 0 else 32
    return (min(64, tm), math.gcd(min(n_perf, tn), tn))


@dataclass(frozen=True)
class SmemUsage:
    """The shared memory of one kernel configuration; ``fits`` when the main loop gets 2+ stages."""

    config: KernelConfig
    epi_tile: tuple[int, int]
    stages_c: int  # aux-load (and C) pipeline depth
    stages_d: int  # aux-store (and D) pipeline depth
    parts: tuple[tuple[str, int], ...]  # epilogue buffers: (what, bytes)
    epilogue_bytes: int  # sizeof(CollectiveEpilogue::SharedStorage)
    epilogue_tensors: tuple[int, int]  # its TensorStorage: (bytes, alignment)
    stage_bytes: int  # one main-loop stage: A and B tiles + barriers
    stages: int  # what StageCountAutoCarveout gives the main loop

    @property
    def kernel_bytes(self) -> int:
        """``GemmKernel::SharedStorageSize`` with ``max(stages, MIN_STAGES)`` main-loop stages: the
        pipelines' barriers (main loop, C load, load order, ping-pong math order, tile scheduler),
        then the epilogue's and the main loop's tensors, aligned to the strictest swizzle."""
        stages = max(self.stages, MIN_STAGES)
        pingpong = self.config.schedule is Schedule.PINGPONG
        front = 16 * stages + 16 * self.stages_c + 16 + (32 if pingpong else 0) + 16
        epi_bytes, epi_align = self.epilogue_tensors
        align = max(epi_align, 128)
        mainloop = stages * (self.stage_bytes - BARRIER_BYTES)
        return _round_up(front, align) + _round_up(_round_up(epi_bytes, 128) + mainloop, align)

    @property
    def fits(self) -> bool:
        return self.stages >= MIN_STAGES and self.kernel_bytes <= SM90_SMEM_CAPACITY

    def describe(self) -> str:
        parts = ", ".join(f"{what} {n:,} B" for what, n in self.parts)
        return (
            f"{self.config.name}: epilogue {self.epilogue_bytes:,} B (tile {self.epi_tile[0]}x{self.epi_tile[1]}, "
            f"{self.stages_c} load / {self.stages_d} store stages: {parts}) leaves "
            f"{SM90_SMEM_CAPACITY - _round_up(self.epilogue_bytes, 128):,} B of {SM90_SMEM_CAPACITY:,} B: "
            f"{self.stages} main-loop stage(s) of {self.stage_bytes:,} B, need {MIN_STAGES}"
        )


def _d_dtype(p: Partition) -> str:
    return next(n.dtype for n in p.epilogue.nodes if isinstance(n, AuxStore) and n.output == p.d_output)


def usage(partition: Partition, config: KernelConfig) -> SmemUsage:
    """Shared memory of ``partition`` (lowered) built with ``config``."""
    if partition.visitor is None:
        raise ValueError("the shared-memory model needs a lowered partition (tvm_evt.codegen.passes.lower)")
    g = partition.gemm
    tm, tn, tk = config.tile
    d_dtype = _d_dtype(partition)
    em, en = epilogue_tile(config, d_dtype)
    epi_tiles = (tm // em) * (tn // en)
    stages_d, stages_c = min(epi_tiles, 2), min(epi_tiles, 4)
    parts: list[tuple[str, int]] = []

    def node_storage(i: int) -> _Storage | None:
        node = partition.epilogue.nodes[i]
        if isinstance(node, (AuxLoad, AuxStore)):
            stages = stages_c if isinstance(node, AuxLoad) else stages_d
            size = _bytes(node.dtype)
            contiguous = em * size if isinstance(node, AuxLoad) and node.column_major else en * size
            nbytes = em * en * stages * size
            parts.append((f"%{i} {node.kind} {stages}x{em}x{en}x{size}", nbytes))
            return _Storage(nbytes, swizzle_alignment(contiguous))
        if isinstance(node, RowBroadcast):
            nbytes = tn * _bytes(node.dtype)
            parts.append((f"%{i} RowBroadcast {tn}x{_bytes(node.dtype)}", nbytes))
            return _Storage(nbytes, 16)
        return _EMPTY

    def visitor_storage(v) -> _Storage | None:
        if isinstance(v, EVTNode):  # Sm90TreeVisitor: Sm90VisitorImpl<children..., node>
            if not v.children:
                return node_storage(v.node)
            return _tuple([visitor_storage(c) for c in v.children] + [node_storage(v.node)])
        ops = [node_storage(op) if isinstance(op, int) else visitor_storage(op) for op in v.ops]
        return _tuple(ops)  # Sm90TopologicalVisitor (the emitter's padding AccFetch is empty)

    fusion = visitor_storage(partition.visitor) or _Storage(1, 1)  # an empty struct member: 1 byte
    d_size = _bytes(d_dtype)
    d_bytes = em * en * stages_d * d_size
    parts.insert(0, (f"D {stages_d}x{em}x{en}x{d_size}", d_bytes))
    d_align = swizzle_alignment(en * d_size)
    collective = _Storage(_round_up(d_bytes, d_align), d_align)  # union with the empty C buffer
    tensors = _struct([collective, fusion])
    epilogue = _struct([tensors, _Storage(2 * 8 * stages_c, 8)])  # + the C load pipeline's barriers
    stage = _round_up((tm * tk * BITS[g.dtype_a] + tn * tk * BITS[g.dtype_b]) // 8, 128)  # tf32: 32 bits
    stage_bytes = stage + BARRIER_BYTES
    stages = (SM90_SMEM_CAPACITY // 128 * 128 - _round_up(epilogue.size, 128)) // stage_bytes
    return SmemUsage(config, (em, en), stages_c, stages_d, tuple(parts), epilogue.size,
                     (tensors.size, tensors.align), stage_bytes, stages)


# ------------------------------------------------------------------------------ choosing configs
def _narrow(cfg: KernelConfig) -> KernelConfig | None:
    """``cfg`` with the narrowest epilogue subtile CUTLASS accepts (N = 16)."""
    rows = 128 if cfg.schedule is Schedule.COOPERATIVE else 64
    if cfg.epi_tile == (rows, 16) or cfg.tile[1] % 16:
        return None
    return dataclasses.replace(cfg, epi_tile=(rows, 16))


def fallbacks(cfg: KernelConfig) -> list[KernelConfig]:
    """``cfg``, then configurations with less epilogue shared memory, in a fixed order.

    First the same CTA tile with a narrow epilogue subtile; then tile N halved (down to 64), each
    with the automatic and the narrow subtile; then the conservative configurations.
    """
    out = [cfg]
    tm, tn, tk = cfg.tile
    tiles = [tn]
    while tiles[-1] > 64 and tiles[-1] % 2 == 0:
        tiles.append(tiles[-1] // 2)
    for n in tiles:
        base = cfg if n == tn else dataclasses.replace(cfg, tile=(tm, n, tk), epi_tile=None)
        out += [base, _narrow(base)]
    out += conservative_configs(tk)
    return list(dict.fromkeys(c for c in out if c is not None))


def conservative_configs(tile_k: int) -> list[KernelConfig]:
    """The smallest-epilogue configurations: a 128x64 cooperative tile and a 64x64 ping-pong tile,
    each with a 16-column epilogue subtile, no cluster, data-parallel."""
    return [
        KernelConfig(tile=(128, 64, tile_k), epi_tile=(128, 16)),
        KernelConfig(tile=(64, 64, tile_k), schedule=Schedule.PINGPONG, epi_tile=(64, 16)),
    ]


def fit_config(partition: Partition, config: KernelConfig) -> KernelConfig | None:
    """``config`` when its main loop gets 2+ stages, else the first of ``fallbacks(config)`` that
    does (deterministic), else None (no configuration can build the partition)."""
    return next((cfg for cfg in fallbacks(config) if usage(partition, cfg).fits), None)


def conservative_config(partition: Partition, tile_k: int) -> KernelConfig | None:
    """The first conservative configuration that fits (the retry after an nvcc failure)."""
    return next((c for c in conservative_configs(tile_k) if usage(partition, c).fits), None)
