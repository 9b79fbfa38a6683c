"""The cache in front of TVM's ``tvm_callback_cuda_compile`` (codegen/build/tvm_cuda_cache.py):
a source compiled once per target and compiler settings, kept atomically, the compiler's result
returned as it made it.  A stand-in compiler replaces TVM's (NVRTC needs a GPU machine)."""
import pytest
import tvm
import tvm_ffi

from tvm_evt.codegen.build import tvm_cuda_cache


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The cache installed in front of a compiler that records its calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TVM_KERNEL_DUMP", raising=False)
    calls = []

    def compile_(code):
        calls.append(code)
        return bytearray(f"cubin of {code} for {tvm.target.Target.current()}".encode())

    monkeypatch.setitem(tvm_cuda_cache._installed, "compile", compile_)
    return calls, tmp_path


def test_a_source_is_compiled_once_per_target_and_settings(stand_in, monkeypatch):
    calls, root = stand_in
    hopper, ampere = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}), tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    with hopper:
        first = tvm_cuda_cache._cached_compile("__global__ void k() {}")
        again = tvm_cuda_cache._cached_compile("__global__ void k() {}")
        other = tvm_cuda_cache._cached_compile("__global__ void j() {}")
    with ampere:
        tvm_cuda_cache._cached_compile("__global__ void k() {}")
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")
    with hopper:
        tvm_cuda_cache._cached_compile("__global__ void k() {}")
    assert calls == ["__global__ void k() {}", "__global__ void j() {}", "__global__ void k() {}",
                     "__global__ void k() {}"]
    assert first == again and isinstance(again, bytearray) and first != other
    kept = list((tvm_cuda_cache.cache_root() / "tvm_cuda").iterdir())
    assert len(kept) == 4 and not [p for p in kept if p.name.endswith(".tmp")]


def test_a_kernel_dump_always_compiles(stand_in, monkeypatch):
    calls, _ = stand_in
    monkeypatch.setenv("TVM_KERNEL_DUMP", "1")
    for _ in range(2):
        tvm_cuda_cache._cached_compile("__global__ void k() {}")
    assert len(calls) == 2


def test_install_puts_the_cache_in_front_of_tvms_function(monkeypatch, tmp_path):
    """What TVM's codegen calls by name answers from the cache (here without compiling)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TVM_KERNEL_DUMP", raising=False)
    monkeypatch.setattr(tvm_cuda_cache, "_installed", {})
    before = tvm_ffi.get_global_func(tvm_cuda_cache.CALLBACK, allow_missing=True)
    try:
        assert tvm_cuda_cache.install() and tvm_cuda_cache.install()  # once a process
        tvm_cuda_cache.atomic_write(tvm_cuda_cache.cache_root() / "tvm_cuda" / f"{tvm_cuda_cache.key(('src',))}.bin",
                                    b"kept cubin")
        assert bytes(tvm_ffi.get_global_func(tvm_cuda_cache.CALLBACK)("src")) == b"kept cubin"
    finally:
        if before is not None:  # leave TVM's function registered for the other tests
            tvm_ffi.register_global_func(tvm_cuda_cache.CALLBACK, before, override=True)
