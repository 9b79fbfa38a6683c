"""The BYOC entry ``relax.ext.evt``: what ``RunCodegen`` calls for functions annotated Codegen="evt".

What we found in TVM 0.27: ``RunCodegen`` calls ``relax.ext.<codegen>(functions, options,
constant_names)`` and expects a list of runtime modules; it rewrites each call site into a DPS call
of the ExternFunc named by the function's ``global_symbol`` (parameters, then outputs).  A module
from ``tvm.runtime.load_static_library(obj, names)`` (kind "static_library", the route TVM's own
CUTLASS BYOC uses in contrib/cutlass/build.py) survives ``export_library``: the object is linked into
the exported shared library and the VM finds ``__tvm_ffi_<symbol>`` there.  Such a module is not
runnable before export; ``Executable.jit()`` exports and reloads it.  Our object bundles the static
CUDA runtime (see ``build/link.py``) so the final link needs no ``-lcudart``.

Registration is explicit (``register()``), not an import side effect.
"""
from __future__ import annotations

import os

import tvm
import tvm_ffi

from . import select
from .backend import KernelConfig, default_config, emit
from .build import build_many, link_module
from .errors import Unsupported
from .frontend import from_function
from .passes import lower

CODEGEN_NAME = "evt"
GLOBAL_FUNC = f"relax.ext.{CODEGEN_NAME}"


CONFIG_KEYS = ("tile", "cluster", "schedule", "raster", "decomposition", "splits", "epi_tile")


def _config(options, partition) -> KernelConfig:
    """Explicit options (``tile``, ``schedule``, ...) win; then, with option ``select`` or
    ``TVM_EVT_SELECT=1``, the choice ``codegen.select`` persisted for this partition on this GPU;
    then the default."""
    options = options or {}
    explicit = {k: options[k] for k in CONFIG_KEYS if k in options}
    if explicit:
        return KernelConfig.from_json({**default_config(partition.gemm.dtype_a).to_json(), **explicit})
    if _truthy(options.get("select", os.environ.get("TVM_EVT_SELECT", ""))):
        return select.select_config(partition)
    return default_config(partition.gemm.dtype_a)


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def generate_sources(funcs, options=None) -> dict[str, str]:
    """symbol -> C++ source for each partition function; raises ``Unsupported`` with the reason."""
    sources = {}
    for func in funcs:
        partition = lower(from_function(func))
        sources[partition.symbol] = emit(partition, _config(options, partition))
    return sources


def evt_codegen(funcs, options, constant_names):
    """``relax.ext.evt``: build every partition and return one static-library module."""
    funcs = list(funcs)
    if not funcs:
        return []
    options = dict(options.items()) if options is not None else {}
    try:
        sources = generate_sources(funcs, options)
    except Unsupported as err:
        raise tvm.error.TVMError(
            f"relax.ext.evt: a partition cannot be offloaded: {err.reason} "
            "(partition with tvm_evt.codegen.legality.pattern_check to leave it to TVM)"
        ) from err
    objects = build_many(sources, jobs=options.get("jobs"))
    obj = link_module([objects[s] for s in sources], list(sources))
    return [tvm.runtime.load_static_library(str(obj), list(sources))]


def register() -> None:
    """Register ``relax.ext.evt`` (idempotent)."""
    tvm_ffi.register_global_func(GLOBAL_FUNC, evt_codegen, override=True)
