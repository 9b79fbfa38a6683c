"""Combine kernel objects into one self-contained relocatable object for a TVM static library.

``ld -r`` pulls the CUDA runtime (``libcudart_static.a``) into the object so the library that
``export_library`` links needs no ``-lcudart``; ``objcopy`` then keeps only the TVM FFI entry
symbols global, so the bundled runtime cannot interpose on another copy in the process.  The
driver calls CUTLASS makes directly go through ``driver_shim`` (no ``-lcuda`` needed).

Weak definitions (C++ COMDAT groups: inline functions, template instantiations, the
``DW.ref.__gxx_personality_v0`` personality reference) stay global.  The final link keeps one copy
of each COMDAT group; were ours local, a libstdc++ member linked statically (a toolchain with only
``libstdc++.a``, or ``-static-libstdc++``) would lose its copy and fail with "relocation
R_X86_64_PC32 against undefined hidden symbol `DW.ref.__gxx_personality_v0'".  They are hidden
(``-fvisibility=hidden``) or standard-library instantiations, so they interpose on nothing.  The
entry functions use the TVM FFI C ABI (no exceptions), so what the object still takes from
libstdc++ is the iostream CUTLASS's TMA descriptor error path prints with.
"""
from __future__ import annotations

import re
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
    objects = [*dict.fromkeys(objects), shim]  # kernels of one type share their unit's object
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
            keep = [name for s in symbols for name in (f"__tvm_ffi_{s}", f"__tvm_ffi__metadata_{s}")]
            keep_file = Path(tmp) / "keep.txt"
            keep_file.write_text("\n".join(keep + weak_definitions(combined)) + "\n")
            proc = subprocess.run([objcopy, f"--keep-global-symbols={keep_file}", str(combined)],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise BuildError(f"objcopy failed: {proc.stderr}")
            atomic_write(out, combined.read_bytes())
    return out


def weak_definitions(obj: Path) -> list[str]:
    """Names of the weak (and GNU-unique) symbols ``obj`` defines: its COMDAT members."""
    nm = shutil.which("nm")
    if not nm:
        raise BuildError("binutils (nm) are needed to link the kernel module")
    proc = subprocess.run([nm, "-g", "--defined-only", str(obj)], capture_output=True, text=True)
    if proc.returncode:
        raise BuildError(f"nm failed: {proc.stderr}")
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("W", "V", "u"):
            names.append(parts[2])
    return sorted(set(names))


# a CUTLASS kernel's entry as the host object registers it with the CUDA runtime (and as a
# profiler names it): ``void cutlass::device_kernel<Operator>(Operator::Params)``; other symbols
# with that prefix are nvcc's helpers (``..::Params __tmp``, ``__handle``)
_KERNEL_ENTRY = re.compile(rb"_ZN7cutlass13device_kernel[A-Za-z0-9_]+EvNT_6ParamsE(?![A-Za-z0-9_])")


def kernel_entries(obj: Path) -> list[str]:
    """The mangled names of the CUTLASS device kernels an object launches (what CUPTI and
    torch.profiler report), read from the host side's registration strings."""
    return sorted({m.group().decode() for m in _KERNEL_ENTRY.finditer(Path(obj).read_bytes())})
