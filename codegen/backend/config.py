"""Kernel configuration: an input of the emitter, with a sensible default per operand type."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Schedule(enum.Enum):
    COOPERATIVE = "cooperative"  # KernelTmaWarpSpecializedCooperative + TmaWarpSpecializedCooperative
    PINGPONG = "pingpong"  # KernelTmaWarpSpecializedPingpong + TmaWarpSpecialized


class Raster(enum.Enum):
    HEURISTIC = "Heuristic"
    ALONG_M = "AlongM"
    ALONG_N = "AlongN"


class Decomposition(enum.Enum):
    """How output tiles and K are spread over the persistent CTAs (CUTLASS 3 tile schedulers)."""

    DATA_PARALLEL = "data_parallel"  # PersistentScheduler: one CTA per output tile
    STREAM_K = "stream_k"  # StreamKScheduler, DecompositionMode::StreamK (K split over CTAs)
    SPLIT_K = "split_k"  # StreamKScheduler, DecompositionMode::SplitK with ``splits`` pieces


@dataclass(frozen=True)
class KernelConfig:
    tile: tuple[int, int, int] = (128, 128, 64)
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: Schedule = Schedule.COOPERATIVE
    raster: Raster = Raster.HEURISTIC
    decomposition: Decomposition = Decomposition.DATA_PARALLEL
    splits: int = 1
    # The epilogue's subtile (M, N); None lets CUTLASS choose (EpilogueTileAuto: 128x32 cooperative,
    # 64x32 ping-pong for 16-bit D).  A smaller one shrinks the epilogue's shared memory (D, aux
    # load/store buffers), which the main loop's ``StageCountAutoCarveout`` turns into stages.
    epi_tile: tuple[int, int] | None = None
    # Row/column sums into float32 finished with atomics (``red.global.add``) instead of CUTLASS's
    # workspace + last-CTA pass: no per-tile workspace traffic or tile counters, but the order of
    # the partial sums (so the last bits of the result) varies from run to run.
    atomic_reduce: bool = False

    def __post_init__(self):
        if self.schedule is Schedule.COOPERATIVE and self.tile[0] % 128:
            raise ValueError("the cooperative schedule needs a tile M that is a multiple of 128")
        if any(c not in (1, 2, 4) for c in self.cluster) or self.cluster[2] != 1:
            raise ValueError(f"unsupported cluster shape {self.cluster}")
        if self.decomposition is not Decomposition.DATA_PARALLEL and self.schedule is not Schedule.COOPERATIVE:
            raise ValueError("stream-K and split-K need the cooperative schedule (CUTLASS's ping-pong has none)")
        if (self.splits > 1) != (self.decomposition is Decomposition.SPLIT_K) or self.splits < 1:
            raise ValueError("splits > 1 goes with (and only with) the split-K decomposition")
        if self.epi_tile is not None:
            em, en = self.epi_tile
            warps_m = 128 if self.schedule is Schedule.COOPERATIVE else 64  # rows of the consumer warpgroup(s)
            # en: CUTLASS's sm90_compute_tile_shape_or_override static_asserts N % 16 == 0
            if em != warps_m or self.tile[0] % em or self.tile[1] % en or en not in (16, 32, 64):
                raise ValueError(f"epilogue tile {self.epi_tile} does not divide the CTA tile {self.tile[:2]}")

    @property
    def name(self) -> str:
        """A short stable name, e.g. ``coop_128x256x64_c2x1`` or ``coop_128x128x64_c1x1_streamk``."""
        sched = "coop" if self.schedule is Schedule.COOPERATIVE else "pp"
        parts = [sched, "x".join(map(str, self.tile)), f"c{self.cluster[0]}x{self.cluster[1]}"]
        if self.raster is not Raster.HEURISTIC:
            parts.append(self.raster.value.lower())
        if self.decomposition is Decomposition.STREAM_K:
            parts.append("streamk")
        elif self.decomposition is Decomposition.SPLIT_K:
            parts.append(f"splitk{self.splits}")
        if self.epi_tile is not None:
            parts.append(f"e{self.epi_tile[0]}x{self.epi_tile[1]}")
        if self.atomic_reduce:
            parts.append("atomic")
        return "_".join(parts)

    def to_json(self) -> dict:
        return {
            "tile": list(self.tile), "cluster": list(self.cluster), "schedule": self.schedule.value,
            "raster": self.raster.value, "decomposition": self.decomposition.value, "splits": self.splits,
            **({"epi_tile": list(self.epi_tile)} if self.epi_tile is not None else {}),
            **({"atomic_reduce": True} if self.atomic_reduce else {}),
        }

    @classmethod
    def from_json(cls, d) -> "KernelConfig":
        """Inverse of ``to_json``; also reads BYOC options (any subset of the keys, as strings)."""
        base = cls()
        return cls(
            tile=tuple(int(x) for x in d.get("tile", base.tile)),
            cluster=tuple(int(x) for x in d.get("cluster", base.cluster)),
            schedule=Schedule(str(d.get("schedule", base.schedule.value))),
            raster=Raster(str(d.get("raster", base.raster.value))),
            decomposition=Decomposition(str(d.get("decomposition", base.decomposition.value))),
            splits=int(d.get("splits", base.splits)),
            epi_tile=_epi_tile(d.get("epi_tile")),
            atomic_reduce=str(d.get("atomic_reduce", False)).strip().lower() in ("1", "true", "yes", "on"),
        )


def _epi_tile(v) -> tuple[int, int] | None:
    """``[m, n]`` (JSON) or ``"m x n"``/``"mxn"`` (a BYOC option string); empty or "auto" is None."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "auto")):
        return None
    if isinstance(v, str):
        v = v.lower().replace(" ", "").split("x")
    m, n = (int(x) for x in v)
    return (m, n)


def default_config(dtype_a: str) -> KernelConfig:
    """128x128 cooperative tiles; K = 128 bytes of operand (64 for 16-bit, 32 for tf32)."""
    k = 32 if dtype_a == "float32" else 64
    return KernelConfig(tile=(128, 128, k))
