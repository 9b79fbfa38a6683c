"""Backend: per-node SM90 visitor types and the kernel emitter (knows nothing of Relax)."""
from . import smem
from .config import Decomposition, KernelConfig, Raster, Schedule, default_config
from .sm90_emitter import CODEGEN_VERSION, Sm90Emitter, atomic_reduction, emit

__all__ = ["smem", "CODEGEN_VERSION", "Decomposition", "KernelConfig", "Raster", "Schedule", "Sm90Emitter", "default_config", "emit"]
