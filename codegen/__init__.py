"""EVT codegen: epilogue IR, CUTLASS SM90 emitter, nvcc build cache (tvm_evt.codegen).

Layout (CUTLASS Python EVT's split): ``frontend`` parses a Relax partition, ``ir`` holds the
epilogue DAG, ``passes`` rewrite it (one per file, ``passes.pipeline`` lists them), ``backend``
emits C++, ``build`` compiles and caches it, ``relax_ext`` is the BYOC entry, ``legality`` the
query API for the partitioner, ``reference`` the numpy semantics, ``philox`` the dropout RNG.
"""
from .backend import Decomposition, KernelConfig, Raster, Schedule, default_config, emit
from .errors import Unsupported
from .frontend import from_function
from .legality import CAPABILITIES, Legality, can_fuse, legality, pattern_check
from .passes import lower

__all__ = [
    "CAPABILITIES", "Decomposition", "KernelConfig", "Legality", "Raster", "Schedule", "Unsupported", "can_fuse",
    "default_config", "emit", "from_function", "legality", "lower", "pattern_check",
]
