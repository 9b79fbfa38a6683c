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


@dataclass(frozen=True)
class KernelConfig:
    tile: tuple[int, int, int] = (128, 128, 64)
    cluster: tuple[int, int, int] = (1, 1, 1)
    schedule: Schedule = Schedule.COOPERATIVE
    raster: Raster = Raster.HEURISTIC

    def __post_init__(self):
        if self.schedule is Schedule.COOPERATIVE and self.tile[0] % 128:
            raise ValueError("the cooperative schedule needs a tile M that is a multiple of 128")
        if any(c not in (1, 2, 4) for c in self.cluster) or self.cluster[2] != 1:
            raise ValueError(f"unsupported cluster shape {self.cluster}")


def default_config(dtype_a: str) -> KernelConfig:
    """128x128 cooperative tiles; K = 128 bytes of operand (64 for 16-bit, 32 for tf32)."""
    k = 32 if dtype_a == "float32" else 64
    return KernelConfig(tile=(128, 128, k))
