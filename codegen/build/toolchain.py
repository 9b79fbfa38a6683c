"""Where nvcc, CUTLASS and the TVM FFI headers are, and their versions (all part of cache keys)."""
from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
NVCC_FLAGS = (
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-fvisibility=hidden",
)


def find_nvcc() -> str | None:
    env = os.environ.get("TVM_EVT_NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return None


@functools.cache
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release [\d.]+, V([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1]


def cuda_root(nvcc: str) -> Path:
    return Path(os.path.realpath(nvcc)).parent.parent


def cudart_static(nvcc: str) -> Path | None:
    """libcudart_static.a of the toolkit ``nvcc`` belongs to (nvcc may be a wrapper script)."""
    roots = [cuda_root(nvcc)]
    roots += [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    version = nvcc_version(nvcc).rsplit(".", 1)[0]
    roots.append(Path(f"/usr/local/cuda-{version}"))
    for root in roots:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            path = root / sub / "libcudart_static.a"
            if path.exists():
                return path
    return None


@functools.cache
def cutlass_version() -> str:
    return importlib.metadata.version("nvidia-cutlass")


@functools.cache
def include_dirs() -> tuple[str, ...]:
    import cutlass_library
    import tvm_ffi

    cutlass = Path(cutlass_library.__file__).parent / "source"
    ffi = Path(tvm_ffi.__file__).parent
    dirs = [cutlass / "include", cutlass / "tools" / "util" / "include", ffi / "include"]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"include directory {d} is missing")
    return tuple(str(d) for d in dirs)


def compile_command(nvcc: str, source: Path, output: Path) -> list[str]:
    includes = [f"-I{d}" for d in include_dirs()]
    return [nvcc, *ARCH_FLAGS, *NVCC_FLAGS, *includes, "-c", str(source), "-o", str(output)]
