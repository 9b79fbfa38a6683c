"""Helpers shared by the tests of our DLight rules and CUDA schedules: schedule a TE kernel with
one rule, run the scheduled kernel on the GPU against TVM's own llvm build of the same kernel, or
check a schedule on the CPU with its thread bindings made serial loops."""

from __future__ import annotations

import re

import tvm
from tvm import te
from tvm.s_tir import dlight as dl

CUDA = {"kind": "cuda", "arch": "sm_90a"}


def schedule(tensors, rule) -> tvm.IRModule:
    """`tensors` (inputs, then the output) as one PrimFunc, scheduled by `rule` alone."""
    mod = tvm.IRModule({"main": te.create_prim_func(tensors)})
    with tvm.target.Target(CUDA):
        return dl.ApplyDefaultSchedule(rule)(mod)


def serial(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """A scheduled CUDA PrimFunc with its thread bindings made serial loops: the sequential meaning
    the schedule keeps, buildable for llvm (not for kernels whose threads cooperate explicitly)."""
    return tvm.script.from_source(re.sub(r'T\.thread_binding\((.*?), thread="[\w.]+"\)', r"T.serial(\1)",
                                         func.script()))


def run_on_llvm(func: tvm.tirx.PrimFunc, arrays) -> list:
    """`func` built for llvm and run on copies of `arrays` (its parameters, outputs included): the
    arrays after the call, as numpy."""
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a.copy()) for a in arrays]
    kernel(*tensors)
    return [t.numpy() for t in tensors]


def assert_matches_llvm_on_gpu(scheduled: tvm.IRModule, tensors, rtol: float = 0.0) -> None:
    """The scheduled CUDA kernel's output equals the llvm build's on fresh random inputs (bool
    inputs: fair coins), with both outputs poisoned with NaN first: bit for bit, or within `rtol`
    (sums in another order)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    lib = tvm.compile(scheduled, target=tvm.target.Target(CUDA))
    ref = tvm.compile(tvm.IRModule({"main": te.create_prim_func(tensors)}), target="llvm")
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    ins = [torch.rand([int(s) for s in t.shape]) < 0.5 if str(t.dtype) == "bool" else
           torch.randn([int(s) for s in t.shape], dtype=torch_dtype[str(t.dtype)]) for t in tensors[:-1]]
    out = tensors[-1]
    shape, dtype = [int(s) for s in out.shape], torch_dtype[str(out.dtype)]
    got = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    lib["main"](*[tvm.runtime.from_dlpack(t.cuda()) for t in ins], tvm.runtime.from_dlpack(got))
    want = torch.full(shape, float("nan"), dtype=dtype)
    ref["main"](*[tvm.runtime.from_dlpack(t) for t in ins], tvm.runtime.from_dlpack(want))
    torch.cuda.synchronize()
    if rtol:
        torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=rtol * float(want.abs().max()))
    else:
        assert torch.equal(got.cpu(), want)


def cuda_route_source(training_mod: tvm.IRModule, non_finite_as_bits: bool = True) -> str:
    """The CUDA source of the TVM kernels the CUDA route builds for a training module (sm_90a):
    its passes up to ``ScheduleTIRForGPU`` and ``NonFiniteBF16AsBits`` (or without that pass),
    without nvcc or a GPU."""
    import warnings

    from tvm_evt import tuning
    from tvm_evt.relax_passes.lower.non_finite_bf16_as_bits import NonFiniteBF16AsBits
    from tvm_evt.training import runtime_module

    target = tvm.target.Target(CUDA)
    before, schedule = tuning.until_scheduling(target)
    with target, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kernels left to one thread say so
        mod = schedule(tvm.transform.Sequential(before)(runtime_module(training_mod)))
        if non_finite_as_bits:
            mod = NonFiniteBF16AsBits()(mod)
    kernels = {gv: f.with_attr("global_symbol", gv.name_hint) for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    return tvm.compile(tvm.IRModule(kernels), target=target).mod.imports[0].inspect_source()


def assert_nvcc_builds(source: str) -> None:
    """nvcc compiles `source` for sm_90a (the caller skips where there is no nvcc)."""
    from tvm.support import nvcc

    with tvm.target.Target(CUDA):
        assert nvcc.compile_cuda(source, target_format="cubin", compiler="nvcc")
