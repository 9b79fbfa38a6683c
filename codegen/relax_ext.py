"""The BYOC entry ``relax.ext.evt``: what ``RunCodegen`` calls for functions annotated Codegen="evt".

What we found in TVM 0.27: ``RunCodegen`` calls ``relax.ext.<codegen>(functions, options,
constant_names)`` and expects a list of runtime modules; it rewrites each call site into a DPS call
of the ExternFunc named by the function's ``global_symbol`` (parameters, then outputs).  A module
from ``tvm.runtime.load_static_library(obj, names)`` (kind "static_library", the route TVM's own
CUTLASS BYOC uses in contrib/cutlass/build.py) survives ``export_library``: the object is linked into
the exported shared library and the VM finds ``__tvm_ffi_<symbol>`` there.  Such a module is not
runnable before export; ``Executable.jit()`` exports and reloads it.  Our object bundles the static
CUDA runtime (see ``build/link.py``) so the final link needs no ``-lcudart``.

Each kernel's configuration is one whose main loop gets 2+ shared-memory stages
(``legality.fitting_config``).  Should nvcc still reject a kernel, it is rebuilt once with the most
conservative configuration that fits (``backend.smem.conservative_config``); if that fails too, the
error names the partition, the configuration and nvcc's first error line.

``register()`` adds the three global functions; ``import tvm_evt`` calls it (and so does the
``evt`` pipeline), so ``RunCodegen`` finds them from the package's import on.
"""
from __future__ import annotations

import os

import tvm
import tvm_ffi
from tvm import relax

from . import select
from .backend import KernelConfig, default_config, emit, smem
from .backend.conv import emit_conv
from .backend.flash_attention import emit_attention
from .build import BuildError, build_each, kernel_entries, link_module
from .errors import CodegenError, Unsupported
from .frontend import from_function
from .frontend.attention_call import attention_of_function
from .frontend.conv_call import conv_of_function
from .ir import Partition
from .legality import fitting_config
from .passes import lower

CODEGEN_NAME = "evt"
GLOBAL_FUNC = f"relax.ext.{CODEGEN_NAME}"
# fused training attention calls (``tvm_evt.attention`` / ``_backward``): flash-attention kernels
ATTENTION_CODEGEN_NAME = "evt_attention"
ATTENTION_GLOBAL_FUNC = f"relax.ext.{ATTENTION_CODEGEN_NAME}"
# convolutions (``tvm_evt.conv2d`` / ``_dgrad`` / ``_wgrad``): CUTLASS SM90 implicit-GEMM kernels
CONV_CODEGEN_NAME = "evt_conv"
CONV_GLOBAL_FUNC = f"relax.ext.{CONV_CODEGEN_NAME}"


CONFIG_KEYS = ("tile", "cluster", "schedule", "raster", "decomposition", "splits", "epi_tile", "atomic_reduce")


def _config(options, partition) -> KernelConfig:
    """Explicit options (``tile``, ``schedule``, ...) win; then, with option ``select`` or
    ``TVM_EVT_SELECT=1``, the choice ``codegen.select`` persisted for this partition on this GPU;
    then ``select.heuristic_config`` (by problem shape).  A choice whose epilogue leaves the main
    loop fewer than 2 shared-memory stages is replaced by the first fallback that fits
    (``legality.fitting_config``)."""
    options = options or {}
    explicit = {k: options[k] for k in CONFIG_KEYS if k in options}
    if explicit:
        wanted = KernelConfig.from_json({**default_config(partition.gemm.dtype_a).to_json(), **explicit})
    elif _truthy(options.get("select", os.environ.get("TVM_EVT_SELECT", ""))):
        wanted = select.select_config(partition)
    else:
        wanted = select.heuristic_config(partition)
    lowered = partition if partition.visitor is not None else lower(partition)
    return fitting_config(lowered, wanted)


def _truthy(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def generate_sources(funcs, options=None) -> dict[str, str]:
    """symbol -> C++ source for each partition function; raises ``Unsupported`` with the reason."""
    return {symbol: source for symbol, (_, _, source) in generate_kernels(funcs, options).items()}


def generate_kernels(funcs, options=None) -> dict[str, tuple[Partition, KernelConfig, str]]:
    """symbol -> (lowered partition, configuration, C++ source) for each partition function."""
    kernels = {}
    for func in funcs:
        partition = lower(from_function(func))
        config = _config(options, partition)
        kernels[partition.symbol] = (partition, config, emit(partition, config))
    return kernels


def build_kernels(kernels: dict[str, tuple[Partition, KernelConfig, str]], jobs=None) -> dict:
    """symbol -> object; a kernel nvcc rejects is rebuilt once with the conservative configuration,
    and a second failure raises ``BuildError`` naming the partition, configuration and error."""
    results = build_each({s: src for s, (_, _, src) in kernels.items()}, jobs=jobs)
    for symbol, result in list(results.items()):
        if not isinstance(result, BuildError):
            continue
        partition, config, _ = kernels[symbol]
        retry = smem.conservative_config(partition, config.tile[2])
        if retry is None or retry == config:
            raise _build_failure(symbol, config, result, None)
        try:
            results[symbol] = build_each({symbol: emit(partition, retry)}, jobs=1)[symbol]
        except Unsupported as err:
            raise _build_failure(symbol, config, result, (retry, err.reason)) from result
        if isinstance(results[symbol], BuildError):
            raise _build_failure(symbol, config, result, (retry, results[symbol].first_error)) from result
    return results


def kernel_sources(mod: "tvm.IRModule") -> dict[str, str]:
    """symbol -> C++ of every kernel ``RunCodegen`` will ask the codegens for in ``mod``: the evt
    partitions under the configuration ``relax.ext.evt`` picks without options, the attention and
    the convolution calls.  A function its codegen cannot take is left out, for that codegen to
    report when ``RunCodegen`` calls it."""
    readers = {
        CODEGEN_NAME: lambda func: generate_sources([func]),
        ATTENTION_CODEGEN_NAME: lambda func: attention_sources([attention_of_function(func)]),
        CONV_CODEGEN_NAME: lambda func: conv_sources([conv_of_function(func)]),
    }
    sources = {}
    for _, func in mod.functions_items():
        codegen = func.attrs.get("Codegen") if isinstance(func, relax.Function) and func.attrs else None
        if codegen is not None and str(codegen) in readers:
            try:
                sources.update(readers[str(codegen)](func))
            except Unsupported:
                continue
    return sources


def unbuildable(mod: "tvm.IRModule", built: dict) -> dict[str, BuildError]:
    """{function name: error} of the ``Codegen="evt"`` functions of ``mod`` whose kernel failed in
    ``built`` (``prebuild``'s result) and fails again with the conservative configuration: what
    ``relax.ext.evt`` would raise for.  The kernels that build are in the object cache after it."""
    failed = {}
    if not any(isinstance(result, BuildError) for result in built.values()):
        return failed  # every kernel built: nothing to emit again
    for gv, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and func.attrs and func.attrs.get("Codegen") == CODEGEN_NAME):
            continue
        try:
            kernels = generate_kernels([func])
        except Unsupported:
            continue  # relax.ext.evt reports it
        if not any(isinstance(built.get(symbol), BuildError) for symbol in kernels):
            continue
        try:
            build_kernels(kernels, jobs=1)
        except BuildError as err:
            failed[gv.name_hint] = err
    return failed


def prebuild(mod: "tvm.IRModule", jobs: int | None = None) -> dict:
    """Build every kernel of ``mod`` (``kernel_sources``) in one parallel batch into the object
    cache.  ``RunCodegen`` calls ``relax.ext.evt``, ``evt_attention`` and ``evt_conv`` one after
    another, each building its own kernels in parallel: one wave of nvcc a codegen.  After this,
    each finds its kernels built.  Build errors are returned, not raised: the codegen that owns
    the kernel retries or reports it."""
    sources = kernel_sources(mod)
    return build_each(sources, jobs=jobs) if sources else {}


def _build_failure(symbol, config, err: BuildError, retry) -> BuildError:
    msg = f"relax.ext.evt: nvcc failed for partition {symbol} with {config.name}: {err.first_error}"
    if retry is not None:
        msg += f"; the retry with {retry[0].name} failed too: {retry[1]}"
    else:
        msg += "; no other configuration fits its shared memory"
    return BuildError(f"{msg}\n{err}", name=symbol, stderr=err.stderr)


def evt_codegen(funcs, options, constant_names):
    """``relax.ext.evt``: build every partition and return one static-library module."""
    funcs = list(funcs)
    if not funcs:
        return []
    options = dict(options.items()) if options is not None else {}
    try:
        kernels = generate_kernels(funcs, options)
    except Unsupported as err:
        raise CodegenError(
            f"relax.ext.evt: a partition cannot be offloaded: {err.reason} "
            "(partition with tvm_evt.codegen.legality.pattern_check to leave it to TVM)"
        ) from err
    jobs = options.get("jobs")
    try:
        objects = build_kernels(kernels, jobs=int(jobs) if jobs is not None else None)
    except BuildError as err:
        raise CodegenError(str(err)) from err
    _record_entries(objects)
    obj = link_module([objects[s] for s in kernels], list(kernels))
    return [tvm.runtime.load_static_library(str(obj), list(kernels))]


# mangled CUTLASS kernel name -> the partitions built into it in this process (profiles name
# every CUTLASS kernel ``cutlass::device_kernel<GemmUniversal<...>>``; this says which it is)
_KERNEL_PARTITIONS: dict[str, set[str]] = {}


def _record_entries(objects: dict) -> None:
    """Note which symbols' objects launch which CUTLASS kernels (``kernel_partitions``)."""
    for symbol, path in objects.items():
        for entry in kernel_entries(path):
            _KERNEL_PARTITIONS.setdefault(entry, set()).add(symbol)


def kernel_partitions(kernel_name: str) -> list[str]:
    """The evt partitions (or convolution calls) this process built whose CUTLASS kernel is
    `kernel_name` (as a profiler reports it), else []."""
    return sorted(_KERNEL_PARTITIONS.get(kernel_name, ()))


def _build_library(sources: dict[str, str], codegen: str) -> "tvm.runtime.Module":
    """One static library of the kernels in `sources` (symbol -> C++), built in parallel through
    the object cache; ``export_library`` links it."""
    objects = build_each(sources)
    for symbol, result in objects.items():
        if isinstance(result, BuildError):
            raise BuildError(f"relax.ext.{codegen}: nvcc failed for {symbol}: {result.first_error}\n{result}",
                             name=symbol, stderr=result.stderr)
    _record_entries(objects)  # the convolutions' CUTLASS kernels, named in profiles
    obj = link_module([objects[s] for s in sources], list(sources))
    return tvm.runtime.load_static_library(str(obj), list(sources))


def attention_sources(calls) -> dict[str, str]:
    """symbol -> C++ of the flash-attention kernels of ``calls`` (``AttentionCall``s)."""
    return {call.symbol: emit_attention(call) for call in calls}


def conv_sources(calls) -> dict[str, str]:
    """symbol -> C++ of the implicit-GEMM convolution kernels of ``calls`` (``ConvCall``s)."""
    return {call.symbol: emit_conv(call) for call in calls}


def build_attention(calls) -> "tvm.runtime.Module":
    """One static library holding the flash-attention kernels of ``calls`` (``AttentionCall``s)."""
    return _build_library(attention_sources(calls), ATTENTION_CODEGEN_NAME)


def build_conv(calls) -> "tvm.runtime.Module":
    """One static library holding the implicit-GEMM convolution kernels of ``calls`` (``ConvCall``s)."""
    return _build_library(conv_sources(calls), CONV_CODEGEN_NAME)


def _call_codegen(codegen: str, read, build):
    """``relax.ext.<codegen>`` for functions that each hold one op call: `read` each function
    into its call (raising ``Unsupported``), `build` all calls into one static library."""

    def run(funcs, options, constant_names):
        funcs = list(funcs)
        if not funcs:
            return []
        try:
            return [build([read(func) for func in funcs])]
        except Unsupported as err:
            raise CodegenError(f"relax.ext.{codegen}: {err.reason}") from err
        except BuildError as err:
            raise CodegenError(str(err)) from err

    run.__name__ = f"{codegen}_codegen"
    return run


# every fused attention call (Codegen="evt_attention") as flash-attention kernels, and every
# convolution call (Codegen="evt_conv") as a CUTLASS SM90 implicit-GEMM kernel, one library each
attention_codegen = _call_codegen(ATTENTION_CODEGEN_NAME, attention_of_function, build_attention)
conv_codegen = _call_codegen(CONV_CODEGEN_NAME, conv_of_function, build_conv)


def register() -> None:
    """Register ``relax.ext.evt``, ``relax.ext.evt_attention`` and ``relax.ext.evt_conv`` (idempotent)."""
    tvm_ffi.register_global_func(GLOBAL_FUNC, evt_codegen, override=True)
    tvm_ffi.register_global_func(ATTENTION_GLOBAL_FUNC, attention_codegen, override=True)
    tvm_ffi.register_global_func(CONV_GLOBAL_FUNC, conv_codegen, override=True)
