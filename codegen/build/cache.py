"""Content-addressed object cache in ``$XDG_CACHE_HOME/tvm_evt`` (default ``~/.cache/tvm_evt``).

A key hashes the source, the nvcc command's flags, the nvcc, CUTLASS and codegen versions.  Entries
are written atomically (temporary file + ``os.replace``) under a per-key ``flock``, so concurrent
processes building the same kernel compile it once and never read a partial object.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..backend.sm90_emitter import CODEGEN_VERSION
from . import toolchain
from .units import translation_units


class BuildError(RuntimeError):
    """nvcc rejected an emitted kernel (a codegen bug); the message holds the compiler output."""

    def __init__(self, message: str, name: str | None = None, stderr: str = ""):
        super().__init__(message)
        self.name = name
        self.stderr = stderr

    @property
    def first_error(self) -> str:
        """The first line of the compiler output that reports an error (else the first line)."""
        text = self.stderr or str(self)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tvm_evt" / f"v{CODEGEN_VERSION}"


def cache_key(source: str, nvcc: str) -> str:
    meta = {
        "source": hashlib.sha256(source.encode()).hexdigest(),
        "arch": toolchain.ARCH_FLAGS,
        "flags": toolchain.NVCC_FLAGS,
        "nvcc": toolchain.nvcc_version(nvcc),
        "cutlass": toolchain.cutlass_version(),
        "codegen": CODEGEN_VERSION,
    }
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def build_object(source: str, name: str = "kernel", nvcc: str | None = None) -> tuple[Path, bool]:
    """Compile ``source`` to an object (or reuse the cached one).  Returns (path, was_cached)."""
    nvcc = nvcc or toolchain.find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set TVM_EVT_NVCC or CUDA_HOME)")
    key = cache_key(source, nvcc)
    root = cache_root()
    obj = root / f"{key}.o"
    if obj.exists():
        return obj, True
    with file_lock(root / f"{key}.lock"):
        if obj.exists():  # built by another process while we waited
            return obj, True
        atomic_write(root / f"{key}.cu", source.encode())
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            out = Path(tmp) / "kernel.o"
            cmd = toolchain.compile_command(nvcc, root / f"{key}.cu", out)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"nvcc failed for {name} ({root / f'{key}.cu'}):\n{proc.stderr[-8000:]}",
                                 name=name, stderr=proc.stderr)
            os.replace(out, obj)
    return obj, False


def build_many(sources: dict[str, str], jobs: int | None = None, progress: bool = True) -> dict[str, Path]:
    """Build independent kernels in parallel (nvcc processes), showing progress on stderr; raises
    the first ``BuildError`` after every kernel was tried."""
    results = build_each(sources, jobs, progress)
    for name, result in results.items():
        if isinstance(result, BuildError):
            raise result
    return results


def build_each(sources: dict[str, str], jobs: int | None = None,
               progress: bool = True) -> dict[str, Path | BuildError]:
    """``build_many`` that returns each kernel's object or its ``BuildError`` (nothing raised).

    Kernels of one CUTLASS type are compiled as one translation unit (``units``) and share its
    object; where a unit of several fails, each of its kernels is compiled alone, so each gets
    its own object or error."""
    units = translation_units(sources)
    jobs = jobs or max(1, min(len(units), os.cpu_count() or 1))
    results: dict[str, Path | BuildError] = {}
    start = time.monotonic()

    def build(name, src):
        try:
            return build_object(src, name)
        except BuildError as err:
            return err, False

    def one(unit):
        names, src = unit
        t0 = time.monotonic()
        label = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more of its type"
        path, cached = build(label, src)
        if len(names) == 1 or not isinstance(path, BuildError):
            return names, {n: path for n in names}, cached, time.monotonic() - t0
        return names, {n: build(n, sources[n])[0] for n in names}, False, time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for done, (names, paths, cached, secs) in enumerate(pool.map(one, units), 1):
            results.update(paths)
            if progress:
                failed = [p for p in paths.values() if isinstance(p, BuildError)]
                how = ("FAILED: " + failed[0].first_error if failed
                       else "cached" if cached else f"built in {secs:.0f}s")
                what = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} of its type)"
                print(
                    f"[tvm_evt] {done}/{len(units)} {what}: {how} "
                    f"({time.monotonic() - start:.0f}s elapsed)",
                    file=sys.stderr,
                    flush=True,
                )
    return {name: results[name] for name in sources}
