"""TVM's CUDA kernels compiled once per source: a content-keyed cache in front of
``tvm_callback_cuda_compile``.

TVM's CUDA codegen hands the CUDA source of all of a module's TIR kernels to the global function
``tvm_callback_cuda_compile`` (``tvm/support/nvcc.py``: NVRTC to a cubin by default, or nvcc), on
every ``tvm.compile``.  The CUTLASS kernels are cached by ``cache.build_object``; without this, the
TVM kernels of a step compiled again (the same model, a warm cache) are compiled again too.

``install()`` puts a function of the same name in front of the one registered: it keys the call by
its source, its other arguments, the target TVM compiles for (``Target.current``), the compiler
settings TVM reads from the environment and the TVM and CUDA compiler versions, returns the binary
kept under ``$XDG_CACHE_HOME/tvm_evt/v*/tvm_cuda`` when there is one, else compiles with the
function it replaced and keeps the result (written atomically).  With ``TVM_KERNEL_DUMP`` set
(TVM then writes the compiler's files for profiling) it always compiles.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os

import tvm
import tvm_ffi

from .cache import atomic_write, cache_root

CALLBACK = "tvm_callback_cuda_compile"
SETTINGS = ("TVM_CUDA_COMPILE_MODE", "TVM_CUDA_PTXAS_REG_LEVEL", "TVM_CUDA_PTXAS_EXTRA_OPTS")
_installed: dict = {}  # "compile": the function this cache delegates to


def _versions() -> dict:
    out = {"tvm": tvm.__version__}
    for package in ("cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def key(args: tuple) -> str:
    """What the compiled binary depends on, hashed."""
    target = tvm.target.Target.current(allow_none=True)
    meta = {
        "args": [hashlib.sha256(str(a).encode()).hexdigest() for a in args],
        "target": str(target) if target is not None else None,
        "settings": {name: os.environ.get(name) for name in SETTINGS},
        "versions": _versions(),
    }
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


def _cached_compile(*args):
    compile_ = _installed["compile"]
    if os.environ.get("TVM_KERNEL_DUMP"):
        return compile_(*args)
    path = cache_root() / "tvm_cuda" / f"{key(args)}.bin"
    if path.exists():
        return bytearray(path.read_bytes())  # what TVM's compile_cuda returns
    binary = compile_(*args)
    atomic_write(path, bytes(binary))
    return binary


def install() -> bool:
    """Put the cache in front of ``tvm_callback_cuda_compile`` (once a process); False where TVM has
    no such function (a build without CUDA)."""
    if "compile" in _installed:
        return True
    try:  # registers TVM's function (it would refuse to register over this one later)
        import tvm.support.nvcc  # noqa: F401
    except ImportError:
        return False
    current = tvm_ffi.get_global_func(CALLBACK, allow_missing=True)
    if current is None:
        return False
    _installed["compile"] = current
    tvm_ffi.register_global_func(CALLBACK, _cached_compile, override=True)
    return True
