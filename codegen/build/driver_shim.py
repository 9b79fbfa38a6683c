"""Driver-API calls CUTLASS makes directly (``fill_workspace`` in cutlass/workspace.h), routed
through ``cudaGetDriverEntryPointByVersion`` so the kernel module needs no ``-lcuda`` at link time
(libcuda is found at run time by the bundled CUDA runtime).  Compiled once per toolkit and linked
into every module object; ``objcopy`` keeps these definitions local."""

SHIM_SOURCE = r"""
#include <cuda.h>
#include <cuda_runtime_api.h>

namespace {
template <class F>
F entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<F>(fn);
}
}  // namespace

extern "C" {
CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr p, unsigned int v, size_t n, CUstream s) {
  static auto fn = entry<CUresult (*)(CUdeviceptr, unsigned int, size_t, CUstream)>("cuMemsetD32Async");
  return fn ? fn(p, v, n, s) : CUDA_ERROR_NOT_FOUND;
}
CUresult CUDAAPI cuMemsetD16Async(CUdeviceptr p, unsigned short v, size_t n, CUstream s) {
  static auto fn = entry<CUresult (*)(CUdeviceptr, unsigned short, size_t, CUstream)>("cuMemsetD16Async");
  return fn ? fn(p, v, n, s) : CUDA_ERROR_NOT_FOUND;
}
CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s) {
  static auto fn = entry<CUresult (*)(CUdeviceptr, unsigned char, size_t, CUstream)>("cuMemsetD8Async");
  return fn ? fn(p, v, n, s) : CUDA_ERROR_NOT_FOUND;
}
CUresult CUDAAPI cuGetErrorString(CUresult error, const char** str) {
  static auto fn = entry<CUresult (*)(CUresult, const char**)>("cuGetErrorString");
  return fn ? fn(error, str) : CUDA_ERROR_NOT_FOUND;
}
}
"""
