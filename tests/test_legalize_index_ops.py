"""legalize_ops (the CUDA route's LegalizeOps): an arange is a kernel FuseOps fuses into its readers,
not a constant they load; with it the cross-entropy gradient's one-hot kernel reads only its logits
along the vocabulary, in 16-byte vectors."""
import shutil

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.support import nvcc

from tvm_evt.relax_passes.lower.legalize_index_ops import legalize_ops
from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
ROWS, CLASSES = 64, 4096  # above what TVM's FoldConstant folds (about a thousand elements)


def _one_hot_gradient() -> tvm.IRModule:
    """softmax(z) - one_hot(label), as DecomposeCrossEntropy writes the cross-entropy's gradient."""
    bb = relax.BlockBuilder()
    z = relax.Var("z", relax.TensorType((ROWS, CLASSES), "bfloat16"))
    label = relax.Var("label", relax.TensorType((ROWS, 1), "int64"))
    lse = relax.Var("lse", relax.TensorType((ROWS, 1), "float32"))
    with bb.function("main", [z, label, lse]):
        with bb.dataflow():
            iota = bb.emit(R.reshape(R.arange(0, CLASSES, 1, dtype="int64"), [1, CLASSES]))
            hit = bb.emit(R.astype(R.equal(iota, label), "float32"))
            p = bb.emit(R.exp(R.subtract(R.astype(z, "float32"), lse)))
            out = bb.emit_output(R.astype(R.subtract(p, hit), "bfloat16"))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(legalize) -> dict:
    passes = [legalize, relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR(), ScheduleTIRForGPU(vectorize=True)]
    with CUDA:
        mod = tvm.transform.Sequential(passes)(_one_hot_gradient())
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _shapes(func) -> list:
    return [tuple(int(d) for d in buf.shape) for buf in func.params]


def test_the_one_hot_kernel_computes_the_class_index():
    (_, func), = _kernels(legalize_ops()).items()
    assert _shapes(func) == [(ROWS, 1), (ROWS, CLASSES), (ROWS, 1), (ROWS, CLASSES)]  # label, z, lse, out
    assert "T.vectorized(8)" in func.script().replace("T.int64(8)", "8")
    # TVM's own rule folds the arange into a constant the kernel loads
    (_, tvm_func), = _kernels(relax.transform.LegalizeOps()).items()
    assert (1, CLASSES) in _shapes(tvm_func)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_the_one_hot_kernel_compiles_with_nvcc():
    (_, func), = _kernels(legalize_ops()).items()
    src = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=CUDA)
    src = src.mod.imports[0].inspect_source()
    assert "uint4" in src  # 8 bf16 logits loaded and 8 gradients stored as 16-byte vectors
    with CUDA:
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
