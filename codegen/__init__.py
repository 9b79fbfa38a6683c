"""EVT codegen: epilogue IR, CUTLASS SM90 emitter, nvcc build cache (tvm_evt.codegen)."""
