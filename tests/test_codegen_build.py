"""Build: the content-addressed cache (fast) and a real nvcc build of emitted kernels (slow)."""
import os
import shutil
import time

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.codegen import emit, from_function, lower
from tvm_evt.codegen.build import cache, kernel_entries, link_module, toolchain
from tvm_evt.codegen.frontend import DROPOUT_EXTERN


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_cache_root_and_atomic_write(cache_home):
    root = cache.cache_root()
    assert root.parent == cache_home / "tvm_evt"
    cache.atomic_write(root / "x.bin", b"abc")
    assert (root / "x.bin").read_bytes() == b"abc"
    assert [p.name for p in root.iterdir()] == ["x.bin"]  # no temporary left behind
    with cache.file_lock(root / "x.lock"):
        pass


def test_cache_key_covers_source_and_flags(monkeypatch):
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc absent")
    k1 = cache.cache_key("a", nvcc)
    assert k1 == cache.cache_key("a", nvcc) and k1 != cache.cache_key("b", nvcc)
    monkeypatch.setattr(toolchain, "NVCC_FLAGS", toolchain.NVCC_FLAGS + ("-G",))
    assert cache.cache_key("a", nvcc) != k1


def dropout_kernel():
    """fp16 TN: bias + gelu + Philox dropout, pre-dropout value stored, column sums."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, 64), "float16"))
    w = relax.Var("w", relax.TensorType((128, 64), "float16"))
    b = relax.Var("b", relax.TensorType((128,), "float16"))
    seed = relax.Var("seed", relax.TensorType((2,), "uint32"))
    with bb.function("evt_build_dropout", [x, w, b, seed]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            g = bb.emit(relax.op.nn.gelu(relax.op.add(y, b)))
            d = bb.emit(relax.call_pure_packed(
                DROPOUT_EXTERN, g, seed, relax.prim_value(1),
                relax.prim_value(0.1),
                ty_args=relax.TensorType((256, 128), "float16")))
            s = bb.emit(relax.op.sum(g, axis=[1]))
            out = bb.emit_output(relax.Tuple([d, g, s]))
        bb.emit_func_output(out)
    return lower(from_function(bb.get()["evt_build_dropout"]))


def batched_kernel():
    """bf16 NN batched: column-major aux load, a clamp's mask (two compares joined) and a where with
    a bool aux output, fp32 scalar sum."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 64, 256), "bfloat16"))  # (L, K, M): A is M-major
    w = relax.Var("w", relax.TensorType((64, 128), "bfloat16"))  # (K, N): B is N-major
    r = relax.Var("r", relax.TensorType((128, 256), "bfloat16"))  # (N, M) -> column-major M x N
    with bb.function("evt_build_batched", [x, w, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(relax.op.permute_dims(x, [0, 2, 1]), w))
            rt = relax.op.permute_dims(r, [1, 0])
            m = bb.emit(relax.op.logical_and(relax.op.greater(y, rt), relax.op.less(y, relax.const(4.0, "bfloat16"))))
            z = bb.emit(relax.op.where(m, y, relax.op.multiply(y, rt)))
            s = bb.emit(relax.op.sum(relax.op.astype(z, "float32"), axis=[1, 2]))
            out = bb.emit_output(relax.Tuple([z, m, s]))
        bb.emit_func_output(out)
    return lower(from_function(bb.get()["evt_build_batched"]))


def square_kernel():
    """tf32 TN ``acc * acc``: a two-op topological visitor (padded by the emitter)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((128, 32), "float32"))
    w = relax.Var("w", relax.TensorType((64, 32), "float32"))
    with bb.function("evt_build_square", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            out = bb.emit_output(relax.op.multiply(y, y))
        bb.emit_func_output(out)
    return lower(from_function(bb.get()["evt_build_square"]))


KERNEL = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIN4cute5tupleIJiiiiEEEvEEEEvNT_6ParamsE"


def test_kernel_entries_are_read_from_the_host_registration_strings(tmp_path):
    """What an nvcc object holds (checked on real builds by the slow test): the entry's mangled
    name, and nvcc's helper symbols with the same prefix, which are not kernels."""
    obj = tmp_path / "k.o"
    helper = KERNEL[: -len("EvNT_6ParamsE")] + "E6ParamsEE5__tmp"
    obj.write_bytes(b"\x7fELF\0" + KERNEL.encode() + b"\0" + helper.encode() + b"\0" + KERNEL.encode() + b"\0")
    assert kernel_entries(obj) == [KERNEL]


def test_evt_codegen_remembers_which_partition_each_kernel_runs(monkeypatch, tmp_path):
    from tvm_evt.codegen import relax_ext

    obj = tmp_path / "k.o"
    obj.write_bytes(b"\0" + KERNEL.encode() + b"\0")
    monkeypatch.setattr(relax_ext, "generate_kernels", lambda funcs, options: {"evt_part_7": None})
    monkeypatch.setattr(relax_ext, "build_kernels", lambda kernels, jobs=None: {"evt_part_7": obj})
    monkeypatch.setattr(relax_ext, "link_module", lambda objects, symbols: obj)
    monkeypatch.setattr(tvm.runtime, "load_static_library", lambda path, symbols: ("lib", symbols))
    monkeypatch.setattr(relax_ext, "_KERNEL_PARTITIONS", {})
    assert relax_ext.kernel_partitions(KERNEL) == []
    assert relax_ext.evt_codegen(["f"], None, None) == [("lib", ["evt_part_7"])]
    assert relax_ext.kernel_partitions(KERNEL) == ["evt_part_7"]
    assert relax_ext.kernel_partitions("fused_add_kernel") == []


@pytest.mark.slow
def test_nvcc_builds_emitted_kernels(cache_home):
    if toolchain.find_nvcc() is None or shutil.which("ld") is None:
        pytest.skip("nvcc absent")
    sources = {p.symbol: emit(p) for p in (dropout_kernel(), batched_kernel(), square_kernel())}
    start = time.monotonic()
    objects = cache.build_many(sources)
    first = time.monotonic() - start
    assert all(os.path.getsize(o) > 0 for o in objects.values())
    assert all(len(kernel_entries(o)) == 1 for o in objects.values())  # one GEMM kernel each
    start = time.monotonic()
    again = cache.build_many(sources)  # content-addressed: served from the cache
    assert again == objects and time.monotonic() - start < min(first, 10)
    module_obj = link_module(list(objects.values()), list(sources))
    syms = os.popen(f"nm -g --defined-only {module_obj}").read()
    for symbol in sources:
        assert f"__tvm_ffi_{symbol}" in syms
    assert " cudaLaunchKernel" not in syms  # the bundled CUDA runtime stays local
    lib = tvm.runtime.load_static_library(str(module_obj), list(sources))
    assert lib.kind == "static_library"
    # what export_library does with it: a plain shared link, then dlopen (no -lcudart, no -lcuda)
    import ctypes
    import subprocess

    import tvm_ffi  # noqa: F401  (libtvm_ffi provides the TVMFFI* symbols)

    so = cache_home / "kernels.so"
    subprocess.run(["g++", "-shared", "-o", str(so), str(module_obj)], check=True)
    handle = ctypes.CDLL(str(so))
    for symbol in sources:
        assert getattr(handle, f"__tvm_ffi_{symbol}")
    # a toolchain with only a static libstdc++ (the GPU host's /opt/gcc): COMDAT symbols such as
    # DW.ref.__gxx_personality_v0 must stay global or libstdc++.a's members lose their copies
    static_so = cache_home / "kernels_static_libstdcxx.so"
    subprocess.run(["g++", "-shared", "-static-libstdc++", "-o", str(static_so), str(module_obj)], check=True)
    # the C ABI entry checks its arguments and raises TVM FFI errors without a GPU
    fn = tvm_ffi.load_module(str(static_so))["evt_build_square"]
    with pytest.raises(TypeError, match="expects 3 tensors, got 0"):
        fn()
    x = tvm_ffi.from_dlpack(np.zeros((128, 32), np.float32))
    with pytest.raises(ValueError, match="parameter 0 must be on cuda"):
        fn(x, x, x)


@pytest.mark.slow
def test_nvcc_builds_every_shape_heuristic_configuration(cache_home):
    """Each configuration ``select.heuristic_config`` hands untuned builds compiles (no fallback)."""
    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc absent")
    import dataclasses

    from tvm_evt.codegen import bench, select

    cases = [("gemm", "wgrad", 1024, 1024, 16384), ("gemm", "fwd", 16384, 1024, 1024),
             ("gemm", "fwd", 16384, 4096, 1024), ("gemm", "fwd", 16384, 1024, 4096), ("gemm", "fwd", 16384, 64, 512),
             ("gemm", "fwd", 64, 512, 512), ("gemm", "wgrad", 512, 128, 100352), ("gemm", "wgrad", 768, 3072, 25216),
             ("relu_bwd", "dgrad", 16384, 1024, 4096), ("bias_gelu_aux", "fwd", 16384, 4096, 1024),
             ("gemm", "wgrad", 3072, 1024, 16384)]
    sources = {}
    for i, (epilogue, kind, m, n, k) in enumerate(cases):
        p = bench.Case("x", epilogue, bench.Problem("p", kind, m, n, k)).build().partition
        p = dataclasses.replace(p, symbol=f"evt_heuristic_{i}")
        sources[p.symbol] = (select.heuristic_config(p).name, emit(p, select.heuristic_config(p)))
    assert [name for name, _ in sources.values()] == [
        "coop_128x128x64_c1x1_splitk2", "pp_128x128x64_c1x1", "pp_128x128x64_c2x1", "coop_128x256x64_c1x1",
        "coop_128x64x64_c1x1", "pp_64x256x64_c1x1", "coop_128x64x64_c1x1_streamk", "coop_128x128x64_c1x1_streamk",
        "pp_128x128x64_c1x1_e64x16", "coop_128x256x64_c1x1", "coop_128x256x64_c1x1_streamk"]
    objects = cache.build_many({s: src for s, (_, src) in sources.items()})
    assert all(os.path.getsize(o) > 0 for o in objects.values())
