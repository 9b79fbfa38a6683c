"""legalize_ops (both routes' LegalizeOps): an arange is a kernel FuseOps fuses into its readers,
not a constant they load; with it the cross-entropy gradient's one-hot kernel reads only its logits
along the vocabulary, in 16-byte vectors.  Group and instance norms take their variance in two
passes: right where a group's mean is far from zero against its spread."""
import shutil

import numpy as np
import torch

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.support import nvcc

from tvm_evt.relax_passes.lower.legalize_ops import legalize_ops
from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU
from tvm_evt.training import cpu_target

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


NORMS = {  # op: (relax call, torch float64 reference, input shape, number of gamma/beta elements)
    "group_norm": (lambda x, g, b: R.nn.group_norm(x, g, b, 4, 1, [2, 3], 1e-5),
                   lambda x, g, b: torch.nn.functional.group_norm(x, 4, g, b, 1e-5), (2, 8, 5, 6), 8),
    "group_norm_channels_last": (lambda x, g, b: R.nn.group_norm(x, g, b, 2, 3, [1, 2], 1e-5),
                                 lambda x, g, b: torch.nn.functional.group_norm(
                                     x.permute(0, 3, 1, 2), 2, g, b, 1e-5).permute(0, 2, 3, 1), (2, 5, 6, 8), 8),
    "instance_norm": (lambda x, g, b: R.nn.instance_norm(x, g, b, 1, [2, 3], 1e-5),
                      lambda x, g, b: torch.nn.functional.instance_norm(x, weight=g, bias=b, eps=1e-5), (2, 8, 5, 6), 8),
    "batch_statistics": (lambda x, g, b: R.nn.instance_norm(x, g, b, 1, [0, 2, 3], 1e-5),
                         lambda x, g, b: torch.nn.functional.batch_norm(x, None, None, g, b, True, eps=1e-5),
                         (2, 8, 5, 6), 8),
}


def _run_norm(name: str, x: np.ndarray, g: np.ndarray, b: np.ndarray, legalize) -> np.ndarray:
    build = NORMS[name][0]
    params = [relax.Var(n, relax.TensorType(a.shape, str(a.dtype))) for n, a in zip("xgb", (x, g, b))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(build(*params)))
    mod = legalize(bb.get())
    assert not any(isinstance(f, relax.Function) and "nn." in f.script() for _, f in mod.functions_items())
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(cpu_target())), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in (x, g, b))).numpy()


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_norms_match_torch_far_from_zero(name, offset):
    """Inputs `offset` standard deviations from zero: TVM's E[x^2] - E[x]^2 is 6 % off at 300, the
    two-pass variance within float32's rounding of the inputs themselves."""
    _, reference, shape, channels = NORMS[name]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) + offset).astype("float32") * np.float32(0.01)
    g, b = (rng.standard_normal(channels).astype("float32") for _ in range(2))
    expected = reference(*(torch.tensor(a, dtype=torch.float64) for a in (x, g, b))).numpy()
    got = _run_norm(name, x, g, b, legalize_ops())
    # x's own float32 rounding, relative to its spread: 300 * 2^-24 of a unit-variance x-hat
    assert np.abs(got - expected).max() <= 1e-4 * (1 + offset / 30), name


def test_a_float16_group_norm_is_normalized_in_float32():
    """Statistics in float32, the result rounded to float16 once."""
    rng = np.random.default_rng(1)
    x, g, b = ((rng.standard_normal(s) + 3).astype("float16") for s in ((2, 8, 4, 4), (8,), (8,)))
    expected = torch.nn.functional.group_norm(*(torch.tensor(a, dtype=torch.float64) for a in (x,)), 4,
                                              torch.tensor(g, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                              1e-5).numpy()
    params = [relax.Var(n, relax.TensorType(a.shape, "float16")) for n, a in zip("xgb", (x, g, b))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        bb.emit_func_output(bb.emit(R.nn.group_norm(*params, 4, 1, [2, 3], 1e-5)))
    vm = relax.VirtualMachine(tvm.compile(legalize_ops()(bb.get()), target=tvm.target.Target(cpu_target())), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(a) for a in (x, g, b))).numpy().astype("float64")
    assert np.abs(got - expected).max() <= 2 ** -11 * np.abs(expected).max()  # one float16 rounding of the result


# ----------------------------------------------------------- ops without a 16-bit form on CUDA
def _narrow_ops(dtype: str) -> tvm.IRModule:
    """atan2, a rounding, a remainder and the finiteness tests on `dtype` tensors, no
    AutoMixedPrecision in front to widen them."""
    bb = relax.BlockBuilder()
    x, y = (relax.Var(n, relax.TensorType((64, 256), dtype)) for n in ("x", "y"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(R.atan2(x, y))
            r = bb.emit(R.add(R.round(x), R.mod(y, R.const(0.7, dtype))))
            h = bb.emit(R.add(R.asinh(x), R.sinh(y)))
            bad = bb.emit(R.logical_or(R.isnan(x), R.isinf(y)))
            out = bb.emit_output(relax.Tuple([a, r, h, bad, R.isfinite(x)]))
        bb.emit_func_output(out)
    return bb.get()


def test_ops_without_a_bf16_form_are_computed_on_float32_copies():
    from tvm_evt.relax_passes.lower.legalize_ops import FLOAT32_ONLY

    mod = legalize_ops()(_narrow_ops("bfloat16"))
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    for name in ("atan2", "tir_round", "mod", "tir_isnan", "tir_isinf", "tir_isfinite", "tir_asinh", "tir_sinh"):
        (func,) = [f for n, f in kernels.items() if n == name]
        assert "bfloat16" not in func.script(), name
    assert {"relax.atan2", "relax.isnan", "relax.round", "relax.mod"} <= FLOAT32_ONLY


def test_ops_without_a_bf16_form_compute_what_float32_does_rounded_once():
    import ml_dtypes

    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((64, 256)).astype(ml_dtypes.bfloat16) for _ in range(2))
    x[0, :3] = [np.nan, np.inf, -np.inf]
    y[1, :2] = [np.inf, np.nan]
    ex = tvm.compile(legalize_ops()(_narrow_ops("bfloat16")), target=tvm.target.Target(cpu_target()))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
    tx, ty = torch.from_numpy(x.astype("float32")), torch.from_numpy(y.astype("float32"))
    c = float(torch.tensor(0.7).bfloat16())  # the constant as the bf16 graph holds it
    want = [torch.atan2(tx, ty), torch.round(tx) + torch.fmod(ty, c), torch.asinh(tx) + torch.sinh(ty),
            torch.isnan(tx) | torch.isinf(ty), torch.isfinite(tx)]
    for i, w in enumerate(want):
        g = torch.from_numpy(got[i].numpy().astype("float32") if w.dtype != torch.bool else got[i].numpy())
        if w.dtype == torch.bool:
            assert torch.equal(g, w), i
        else:  # each result rounded once to bf16 (the sum in bf16 after two such roundings)
            w = w.to(torch.bfloat16).float()
            fin = torch.isfinite(w)
            assert torch.equal(fin, torch.isfinite(g)), i
            assert torch.allclose(g[fin], w[fin], rtol=2 ** -7, atol=2 ** -7), i


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_ops_without_a_bf16_form_build_for_cuda_in_bf16():
    from _te_kernels import assert_nvcc_builds

    passes = [legalize_ops(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
              relax.transform.FuseTIR(), ScheduleTIRForGPU(vectorize=True)]
    with CUDA:
        mod = tvm.transform.Sequential(passes)(_narrow_ops("bfloat16"))
    kernels = {gv: f.with_attr("global_symbol", gv.name_hint) for gv, f in mod.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc)}
    assert_nvcc_builds(tvm.compile(tvm.IRModule(kernels), target=CUDA).mod.imports[0].inspect_source())
