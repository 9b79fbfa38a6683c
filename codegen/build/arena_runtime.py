"""``tvm_evt.arena_tensor``: a tensor at a byte offset of one memory arena (``PackMemoryArena``'s plan).

``R.memory.alloc_tensor(storage, offset, ...)`` records a non-zero offset as the tensor's
``byte_offset`` (TVM's ``StorageObj::AllocTensor`` on every device but Hexagon), and every kernel TVM
generates asserts ``byte_offset == 0``; the CUTLASS kernels read ``data`` alone.  So a tensor placed
inside an arena is made by this function instead: its ``data`` is the arena's plus the offset, its
``byte_offset`` 0, and it keeps the arena alive.  It allocates nothing and launches nothing, so
``RewriteCUDAGraph`` captures it like a kernel call (it runs once, when the graph is captured).

The C++ source is compiled with the host C++ compiler (``$CXX``, else ``c++`` or ``g++``) against
the TVM FFI headers, cached by content in ``$XDG_CACHE_HOME/tvm_evt`` and loaded into the process
(``load``), which registers the function for the VM to find.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .cache import BuildError, atomic_write, cache_root, file_lock

FUNCTION = "tvm_evt.arena_tensor"

SOURCE = r"""
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/reflection/registry.h>

namespace {
using tvm::ffi::Tensor;

// The bytes [offset, offset + size) of `arena` as a tensor of its own: it owns no memory and holds
// a reference to the arena.
struct ArenaSlice {
  Tensor arena;
  void AllocData(DLTensor* tensor, int64_t offset) {
    tensor->data = static_cast<char*>(arena.data_ptr()) + arena.GetDLTensorPtr()->byte_offset + offset;
  }
  void FreeData(DLTensor*) {}
};

Tensor ArenaTensor(Tensor arena, int64_t offset, tvm::ffi::Shape shape, DLDataType dtype) {
  int64_t bytes = (static_cast<int64_t>(dtype.bits) * dtype.lanes + 7) / 8;
  for (int64_t extent : shape) bytes *= extent;
  TVM_FFI_ICHECK(arena.ndim() == 1 && offset >= 0 && offset + bytes <= arena.size(0))
      << "tvm_evt.arena_tensor: bytes [" << offset << ", " << offset + bytes
      << ") lie outside the arena of " << arena.size(0) << " bytes";
  return Tensor::FromNDAlloc(ArenaSlice{arena}, shape, dtype, arena.device(), offset);
}
}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  tvm::ffi::reflection::GlobalDef().def("tvm_evt.arena_tensor", ArenaTensor);
}
"""


def compiler() -> str | None:
    """The host C++ compiler: ``$CXX``, else ``c++`` or ``g++`` on the path."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _ffi_dirs() -> tuple[Path, Path]:
    import tvm_ffi

    root = Path(tvm_ffi.__file__).parent
    return root / "include", root / "lib"


def _command(cxx: str, source: Path, output: Path) -> list[str]:
    include, lib = _ffi_dirs()
    return [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include}", str(source), "-o", str(output),
            f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"]


def _key(cxx: str) -> str:
    import tvm_ffi

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    meta = {"source": SOURCE, "compiler": version, "tvm_ffi": tvm_ffi.__version__,
            "command": _command("cxx", Path("s"), Path("o"))[1:-1]}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


@functools.cache
def load() -> Path:
    """Build (or find cached) and load the library that registers ``FUNCTION``; its path.  Raises
    `BuildError` when there is no C++ compiler or it fails."""
    cxx = compiler()
    if cxx is None:
        raise BuildError(f"{FUNCTION}: no C++ compiler found (set $CXX, or install c++/g++)")
    key = _key(cxx)
    root = cache_root() / "arena"
    library = root / f"arena_{key}.so"
    if not library.exists():
        with file_lock(root / f"{key}.lock"):
            if not library.exists():
                atomic_write(root / f"arena_{key}.cc", SOURCE.encode())
                with tempfile.TemporaryDirectory(dir=root) as tmp:
                    out = Path(tmp) / "arena.so"
                    proc = subprocess.run(_command(cxx, root / f"arena_{key}.cc", out), capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise BuildError(f"{FUNCTION}: {cxx} failed:\n{proc.stderr[-4000:]}", name=FUNCTION,
                                         stderr=proc.stderr)
                    os.replace(out, library)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)  # its static initialiser registers FUNCTION
    return library
