"""PrebuildKernels: the kernels of all three codegens (evt partitions, attention and convolution
calls) in one build batch, with exactly the sources each codegen then builds, so that RunCodegen
finds them in the object cache; functions a codegen cannot take are left to it."""
import tvm
from tvm import relax
from tvm.relax import op as R

from test_conv_op import _conv_step_module
from test_offload_attention import _training_module
from tvm_evt.codegen import relax_ext
from tvm_evt.relax_passes.lower.offload_attention import OffloadAttention
from tvm_evt.relax_passes.lower.offload_conv import OffloadConv
from tvm_evt.relax_passes.lower.prebuild_kernels import PrebuildKernels


def _evt_partition(name: str, k: int = 64) -> relax.Function:
    """relu(a @ b) as a Codegen="evt" partition"""
    a = relax.Var("a", relax.TensorType((256, k), "float16"))
    b = relax.Var("b", relax.TensorType((k, 128), "float16"))
    bb = relax.BlockBuilder()
    with bb.function("f", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(R.nn.relu(R.matmul(a, b)))
        bb.emit_func_output(out)
    return bb.get()["f"].with_attrs({"Codegen": relax_ext.CODEGEN_NAME, "global_symbol": name})


def _codegen_functions(mod: tvm.IRModule) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs and "Codegen" in f.attrs}


def _module() -> tvm.IRModule:
    """The codegen functions of an attention step, a convolution step and one evt partition (only
    those: the pass reads nothing else)"""
    funcs = {**_codegen_functions(OffloadAttention()(_training_module("bfloat16"))),
             **_codegen_functions(OffloadConv()(_conv_step_module(64))),
             "evt_relu": _evt_partition("evt_relu")}
    return tvm.IRModule({tvm.ir.GlobalVar(name): f for name, f in funcs.items()})


def test_one_batch_holds_every_codegens_kernels_as_they_build_them(monkeypatch):
    mod = _module()
    kinds = {str(f.attrs["Codegen"]) for f in mod.functions.values()}
    assert kinds == {"evt", "evt_attention", "evt_conv"}
    batches = []
    monkeypatch.setattr(relax_ext, "build_each", lambda sources, jobs=None: batches.append(dict(sources)) or {})
    out = PrebuildKernels()(mod)
    assert out.same_as(mod)  # the module is returned as it is
    assert len(batches) == 1
    (built,) = batches
    assert len(built) == len(mod.functions) == 7  # 3 attention calls, 3 convolutions, 1 partition

    # what each codegen builds when RunCodegen calls it: the same symbols and sources
    by_codegen = {}
    for f in mod.functions.values():
        by_codegen.setdefault(str(f.attrs["Codegen"]), []).append(f)
    expected = relax_ext.generate_sources(by_codegen["evt"])
    expected.update({c.symbol: relax_ext.emit_attention(c) for c in map(relax_ext.attention_of_function,
                                                                          by_codegen["evt_attention"])})
    expected.update({c.symbol: relax_ext.emit_conv(c) for c in map(relax_ext.conv_of_function,
                                                                     by_codegen["evt_conv"])})
    assert built == expected


def test_a_function_its_codegen_cannot_take_is_left_to_it(monkeypatch):
    """An evt partition whose operands CUTLASS cannot take (K = 3: rows not 16-byte aligned)
    is not built here; relax.ext.evt reports it when RunCodegen calls it."""
    bad = _evt_partition("evt_unaligned", k=3)
    try:
        relax_ext.generate_sources([bad])
    except relax_ext.Unsupported:
        pass
    else:
        raise AssertionError("the unaligned partition was expected to be unsupported")
    mod = tvm.IRModule({tvm.ir.GlobalVar("evt_unaligned"): bad, tvm.ir.GlobalVar("evt_relu"): _evt_partition("evt_relu")})
    batches = []
    monkeypatch.setattr(relax_ext, "build_each", lambda sources, jobs=None: batches.append(dict(sources)) or {})
    PrebuildKernels()(mod)
    assert [sorted(b) for b in batches] == [["evt_relu"]]


def test_a_partition_whose_kernel_does_not_build_runs_as_tvm_kernels(monkeypatch):
    """nvcc rejects the partition's kernel under both configurations: one warning names the
    partition and nvcc's first error line, its ops go back into the caller, and the step computes
    relu(a @ b) all the same."""
    import numpy as np
    import pytest

    from tvm_evt.codegen.build import BuildError
    from tvm_evt.relax_passes.lower.prebuild_kernels import KernelBuildWarning

    a = relax.Var("a", relax.TensorType((256, 64), "float16"))
    b = relax.Var("b", relax.TensorType((64, 128), "float16"))
    bb = relax.BlockBuilder()
    gv = bb.add_func(_evt_partition("evt_relu"), "evt_relu")
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(gv, [a, b]))
        bb.emit_func_output(out)
    mod = bb.get()

    def reject(sources, jobs=None):
        return {s: BuildError("nvcc failed", name=s, stderr="kernel.cu(12): error: no suitable conversion\n")
                for s in sources}

    monkeypatch.setattr(relax_ext, "build_each", reject)
    with pytest.warns(KernelBuildWarning, match=r"evt_relu did not build \(kernel.cu\(12\): error: no suitable"):
        out = PrebuildKernels()(mod)
    assert not _codegen_functions(out)
    ex = tvm.compile(out, target="llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.random.rand(256, 64).astype("float16")
    y = np.random.rand(64, 128).astype("float16")
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)).numpy()
    ref = np.maximum(x.astype("float32") @ y.astype("float32"), 0)
    np.testing.assert_allclose(got.astype("float32"), ref, rtol=2e-2, atol=2e-2)
