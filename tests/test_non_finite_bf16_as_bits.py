"""NonFiniteBF16AsBits: a bfloat16 infinity or NaN in a TIR kernel is written as its bit pattern,
which TVM 0.27's CUDA codegen prints as code nvcc takes ("__float2bfloat16_rn(inff)" it does not).
MobileNetV3's hardsigmoid, ``clamp(x, min=0)`` in the bf16 step, is such a kernel."""
import math
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T
from tvm.support import nvcc

from tvm_evt.relax_passes.lower.legalize_ops import legalize_ops
from tvm_evt.relax_passes.lower.non_finite_bf16_as_bits import BITS, NonFiniteBF16AsBits
from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU
from tvm_evt.relax_passes.training.gradient_rules import clip_grad

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
N = 4096


def test_non_finite_bfloat16_constants_become_bit_patterns_and_nothing_else_changes():
    @tvm.script.ir_module
    class Before:
        @T.prim_func
        def main(a: T.Buffer((8,), "bfloat16"), b: T.Buffer((8,), "bfloat16"), c: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = T.if_then_else(a[i] <= T.bfloat16("inf"), T.max(a[i], T.bfloat16("-inf")),
                                      T.bfloat16("nan")) + T.bfloat16(0.5)
                c[i] = T.min(T.Cast("float32", a[i]), T.float32("inf"))

    @tvm.script.ir_module
    class Expected:
        @T.prim_func
        def main(a: T.Buffer((8,), "bfloat16"), b: T.Buffer((8,), "bfloat16"), c: T.Buffer((8,), "float32")):
            for i in range(8):
                b[i] = T.if_then_else(a[i] <= T.reinterpret("bfloat16", T.uint16(0x7F80)),
                                      T.max(a[i], T.reinterpret("bfloat16", T.uint16(0xFF80))),
                                      T.reinterpret("bfloat16", T.uint16(0x7FC0))) + T.bfloat16(0.5)
                c[i] = T.min(T.Cast("float32", a[i]), T.float32("inf"))

    tvm.ir.assert_structural_equal(NonFiniteBF16AsBits()(Before), Expected)


def test_the_bit_patterns_are_bfloat16s_values():
    """bfloat16 is float32's upper half: each pattern is the float32 value's top 16 bits."""
    _, patterns = BITS["bfloat16"]
    for name, bits in patterns.items():
        upper = int(np.array([float(name)], dtype=np.float32).view(np.uint32)[0]) >> 16
        if name == "nan":
            assert bits >> 7 & 0xFF == 0xFF and bits & 0x7F, f"{bits:#x} is not a NaN"
        else:
            assert bits == upper, (name, hex(bits), hex(upper))


def _open_clamp() -> tvm.IRModule:
    """torch.clamp(x, min=0) in bf16 and its gradient's mask, as the importer and clip_grad write them."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N,), "bfloat16"))
    dy = relax.Var("dy", relax.TensorType((N,), "bfloat16"))
    with bb.function("main", [x, dy]):
        with bb.dataflow():
            clamp = R.clip(x, 0.0, math.inf)
            y = bb.emit(clamp)
            dx = bb.emit(clip_grad(y, clamp, dy, bb)[0])
            out = bb.emit_output((y, dx))
        bb.emit_func_output(out)
    return bb.get()


def _cuda_source(with_pass: bool) -> str:
    passes = [legalize_ops(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR(), ScheduleTIRForGPU(vectorize=True)]
    with CUDA:
        mod = tvm.transform.Sequential(passes + ([NonFiniteBF16AsBits()] if with_pass else []))(_open_clamp())
    funcs = {gv: f.with_attr("global_symbol", gv.name_hint) for gv, f in mod.functions_items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    assert funcs, "the clamp legalized to no kernel"
    return tvm.compile(tvm.IRModule(funcs), target=CUDA).mod.imports[0].inspect_source()


def test_an_open_clamp_in_bfloat16_prints_no_inff():
    assert "inff" in _cuda_source(with_pass=False)  # TVM 0.27's codegen alone
    assert "inff" not in _cuda_source(with_pass=True)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_an_open_clamp_in_bfloat16_compiles_with_nvcc():
    src = _cuda_source(with_pass=True)
    with CUDA:
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


def test_a_mobilenet_v3_block_on_the_bf16_cuda_route_prints_no_inff():
    """torchvision's MobileNetV3 block (hard-swish, squeeze-excitation with hard-sigmoid), as
    ``tests/test_cnn_layers.py`` writes it, partitioned for sm_90a in bf16: its TVM kernels as the
    CUDA route schedules them print as code nvcc takes; without this pass they held 58
    ``__float2bfloat16_rn(inff)`` on an H200 (torchvision's mobilenet_v3_small)."""
    import torch
    import torch.nn.functional as F

    from _te_kernels import cuda_route_source
    from tvm_evt.training import build_training_module, from_torch
    from test_cnn_layers import MODELS

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16).contiguous(memory_format=torch.channels_last)
    graph = build_training_module(from_torch(MODELS["mobilenet_v3_blocks"](), (x, torch.randint(0, 10, (4,))),
                                             F.cross_entropy), None, "bf16")
    assert "inff" in cuda_route_source(graph.mod, non_finite_as_bits=False)  # TVM 0.27's codegen alone
    assert "inff" not in cuda_route_source(graph.mod)
