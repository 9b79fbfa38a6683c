"""Combine kernel objects into one self-contained relocatable object for a TVM static library.

``ld -r`` pulls the CUDA runtime (``libcudart_static.a``) into the object so the library that
``export_library`` links needs no ``-lcudart``; ``objcopy`` then keeps only the TVM FFI entry
symbols global, so the bundled runtime cannot interpose on another copy in the process.  The
driver calls CUTLASS makes directly go through ``driver_shim`` (no ``-lcuda`` needed).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from . import toolchain
from .cache import BuildError, atomic_write, build_object, cache_key, cache_root, file_lock
from .driver_shim import SHIM_SOURCE


def link_module(objects: list[Path], symbols: list[str], nvcc: str | None = None) -> Path:
    nvcc = nvcc or toolchain.find_nvcc()
    cudart = toolchain.cudart_static(nvcc)
    if cudart is None:
        raise BuildError("libcudart_static.a not found next to nvcc")
    ld, objcopy = shutil.which("ld"), shutil.which("objcopy")
    if not ld or not objcopy:
        raise BuildError("binutils (ld, objcopy) are needed to link the kernel module")
    shim, _ = build_object(SHIM_SOURCE, "driver_shim", nvcc)
    objects = [*objects, shim]
    key = cache_key("\n".join([*map(str, sorted(objects)), *sorted(symbols), str(cudart)]), nvcc)
    root = cache_root()
    out = root / f"module-{key}.o"
    if out.exists():
        return out
    with file_lock(root / f"module-{key}.lock"):
        if out.exists():
            return out
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            combined = Path(tmp) / "combined.o"
            cmd = [ld, "-r", "-o", str(combined), *map(str, objects), str(cudart)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise BuildError(f"ld -r failed: {proc.stderr}")
            keep = []
            for s in symbols:
                keep += [f"--keep-global-symbol=__tvm_ffi_{s}", f"--keep-global-symbol=__tvm_ffi__metadata_{s}"]
            proc = subprocess.run([objcopy, *keep, str(combined)], capture_output=True, text=True)
            if proc.returncode:
                raise BuildError(f"objcopy failed: {proc.stderr}")
            atomic_write(out, combined.read_bytes())
    return out
