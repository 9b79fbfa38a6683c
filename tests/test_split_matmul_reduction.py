"""SplitMatmulReduction: a matmul with a long reduction over few output tiles as a batch of K
slices (float32 partials) and their sum; values unchanged, the batch a GEMM the codegen takes."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.codegen import select
from tvm_evt.relax_passes.partition.split_matmul_reduction import SplitMatmulReduction

SMS = 8  # a GPU of 8 SMs: one 128x128 output tile over K = 16384 takes 8 slices of 2048


@I.ir_module
class WeightGradient:  # dW = dYᵀ X, both stored [K, *]: a 1x1 convolution's over the batch's pixels
    @R.function
    def main(dy: R.Tensor((16384, 128), "bfloat16"), x: R.Tensor((16384, 128), "bfloat16")):
        with R.dataflow():
            dyt = R.permute_dims(dy, [1, 0])
            w = R.matmul(dyt, x)
            g = R.astype(w, "float32")
            R.output(g)
        return g


def test_a_weight_gradient_becomes_a_batch_of_k_slices_and_their_float32_sum():
    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((16384, 128), "bfloat16"), x: R.Tensor((16384, 128), "bfloat16")):
            with R.dataflow():
                dys = R.permute_dims(R.reshape(dy, (8, 2048, 128)), [0, 2, 1])
                p = R.matmul(dys, R.reshape(x, (8, 2048, 128)), out_dtype="float32")
                g = R.sum(p, axis=[0])  # its widening reader gets the float32 sum, unrounded
                R.output(g)
            return g

    after = SplitMatmulReduction(num_sms=SMS)(WeightGradient)
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(Expected))
    _same_values(WeightGradient, after)


@I.ir_module
class Bf16Result:  # read as bf16 as well: the sum is cast back to the GEMM's dtype for that reader
    @R.function
    def main(dy: R.Tensor((16384, 128), "bfloat16"), x: R.Tensor((16384, 128), "bfloat16")):
        with R.dataflow():
            dyt = R.permute_dims(dy, [1, 0])
            w = R.matmul(dyt, x)
            g = R.astype(w, "float32")
            h = R.multiply(w, w)
            R.output(g, h)
        return (g, h)


def test_a_reader_of_the_gemms_dtype_gets_the_sum_cast_back():
    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((16384, 128), "bfloat16"), x: R.Tensor((16384, 128), "bfloat16")):
            with R.dataflow():
                dys = R.permute_dims(R.reshape(dy, (8, 2048, 128)), [0, 2, 1])
                p = R.matmul(dys, R.reshape(x, (8, 2048, 128)), out_dtype="float32")
                s = R.sum(p, axis=[0])
                w = R.astype(s, "bfloat16")
                g = R.astype(w, "float32")  # read as bf16 too: rounded as the GEMM rounds
                h = R.multiply(w, w)
                R.output(g, h)
            return (g, h)

    tvm.ir.assert_structural_equal(SplitMatmulReduction(num_sms=SMS)(Bf16Result), relax.transform.Normalize()(Expected))


@I.ir_module
class WidenedInAnotherBlock:  # the gradient handed out of its block, widened after it
    @R.function
    def main(dy: R.Tensor((16384, 128), "bfloat16"), x: R.Tensor((16384, 128), "bfloat16")):
        with R.dataflow():
            dyt = R.permute_dims(dy, [1, 0])
            w = R.matmul(dyt, x)
            R.output(w)
        g = R.astype(w, "float32")
        return g


def test_a_widening_outside_the_block_reads_the_sum_cast_back():
    after = SplitMatmulReduction(num_sms=SMS)(WidenedInAnotherBlock)
    relax.analysis.well_formed(after)  # raises unless every value is defined in its scope
    ops = [e.op.name for e in _calls(after["main"])]
    assert ops.count("relax.astype") == 2 and "relax.sum" in ops  # sum -> bf16 in the block, -> f32 after
    _same_values(WeightGradient, after)


@I.ir_module
class KMajor:  # A[M, K] and Bᵀ stored [N, K], float32 out: no cast back
    @R.function
    def main(a: R.Tensor((128, 16384), "bfloat16"), b: R.Tensor((64, 16384), "bfloat16")):
        with R.dataflow():
            bt = R.permute_dims(b, [1, 0])
            w = R.matmul(a, bt, out_dtype="float32")
            R.output(w)
        return w


def test_k_major_operands_are_sliced_in_place():
    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((128, 16384), "bfloat16"), b: R.Tensor((64, 16384), "bfloat16")):
            with R.dataflow():
                as_ = R.permute_dims(R.reshape(a, (128, 8, 2048)), [1, 0, 2])
                bs = R.permute_dims(R.reshape(b, (64, 8, 2048)), [1, 2, 0])
                p = R.matmul(as_, bs, out_dtype="float32")
                w = R.sum(p, axis=[0])
                R.output(w)
            return w

    after = SplitMatmulReduction(num_sms=SMS)(KMajor)
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(Expected))
    _same_values(KMajor, after)


@I.ir_module
class Kept:  # what stays one GEMM: a short K, float32 operands, output tiles past a wave
    @R.function
    def main(x: R.Tensor((4096, 1024), "bfloat16"), w: R.Tensor((1024, 1024), "bfloat16"),
             f: R.Tensor((128, 16384), "float32"), g: R.Tensor((16384, 128), "float32"),
             dy: R.Tensor((16384, 512), "bfloat16"), y: R.Tensor((16384, 512), "bfloat16")):
        with R.dataflow():
            short = R.matmul(x, w)
            fp32 = R.matmul(f, g)
            dyt = R.permute_dims(dy, [1, 0])
            wide = R.matmul(dyt, y)
            R.output(short, fp32, wide)
        return (short, fp32, wide)


def test_short_reductions_float32_and_many_tiles_stay_one_gemm():
    tvm.ir.assert_structural_equal(SplitMatmulReduction(num_sms=SMS)(Kept), Kept)


def test_the_slices_fill_one_wave_of_the_gpu_and_are_at_least_min_slice_long():
    # ResNet-50's weight gradients on 132 SMs (slices as measured on an H200, 2026-12-01)
    assert select.k_slices(64, 256, 401408) == 128 and select.slice_tile(64, 256) == (128, 256, 64)
    assert select.k_slices(256, 64, 401408) == 64 and select.slice_tile(256, 64) == (128, 64, 64)
    assert select.k_slices(512, 256, 100352) == 16
    assert select.k_slices(512, 1024, 25088) == 4
    for m, n, k in [(64, 256, 401408), (128, 512, 100352), (1024, 256, 25088), (64, 152, 1605632)]:
        s = select.k_slices(m, n, k)
        tm, tn, _ = select.slice_tile(m, n)
        assert k % s == 0 and k // s >= select.MIN_SLICE and s * -(-m // tm) * -(-n // tn) <= select.H100_SMS
    assert select.k_slices(2048, 512, 6272) == 2  # 64 tiles: two slices fill the wave
    # 128 tiles fill a wave; XML-CNN's thin output keeps split-K 4; a short K; float32
    assert select.k_slices(2048, 1024, 6272) == 1
    assert select.k_slices(1024, 1024, 2048) == 1
    assert select.k_slices(32, 1200, 15904) == 1
    assert select.k_slices(128, 128, 16384, "float32") == 1


def test_the_sliced_batch_gets_the_slice_tile():
    from tvm_evt.codegen.frontend import from_function
    from tvm_evt.codegen.passes import lower

    after = SplitMatmulReduction(num_sms=SMS)(WeightGradient)["main"]
    bb = relax.BlockBuilder()
    dy, x = (relax.Var(n, relax.TensorType((16384, 128), "bfloat16")) for n in ("dy", "x"))
    with bb.function("evt_wgrad", [dy, x], attrs={"Composite": "evt.gemm_epilogue"}):
        with bb.dataflow():
            a = relax.op.permute_dims(relax.op.reshape(dy, (8, 2048, 128)), [0, 2, 1])
            out = bb.emit_output(relax.op.matmul(a, relax.op.reshape(x, (8, 2048, 128)), out_dtype="float32"))
        bb.emit_func_output(out)
    part = lower(from_function(bb.get()["evt_wgrad"]))
    assert (part.gemm.batch, part.gemm.m, part.gemm.n, part.gemm.k) == (8, 128, 128, 2048)
    assert part.gemm.layout_name == "NT"
    assert select.heuristic_config(part, num_sms=SMS).tile == select.slice_tile(128, 128)
    assert "relax.sum" in [e.op.name for e in _calls(after)]


def _calls(func):
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


def _run(mod, args):
    ex = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return out.numpy()


def _same_values(before, after):
    """`after` computes `before`'s result, against torch in float64 from the same bf16 inputs."""
    rng = np.random.default_rng(0)
    args = []
    for p in before["main"].params:
        shape, dtype = [int(d) for d in p.ty.shape.values], str(p.ty.dtype)
        x = rng.standard_normal(shape).astype("float32")
        args.append(x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x)
    want = _torch_reference(before, args)
    got = _run(after, args).astype("float64")
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 4e-3, err  # a bf16 rounding of the result


def _torch_reference(mod, args):
    t = [torch.from_numpy(a.astype("float32")).double() for a in args]
    if mod is WeightGradient:
        return (t[0].T @ t[1]).numpy()
    return (t[0] @ t[1].T).numpy()


@pytest.mark.parametrize("layout", ["NT", "TN"])
def test_the_codegen_takes_the_sliced_gemm(layout):
    from tvm_evt.relax_passes.partition.split_matmul_reduction import _legal

    if layout == "NT":  # stored Aᵀ [K, M] and B [K, N]
        a = (relax.Var("a", relax.TensorType((16384, 128), "bfloat16")), [1, 0])
        b = (relax.Var("b", relax.TensorType((16384, 64), "bfloat16")), None)
    else:  # stored A [M, K] and Bᵀ [N, K]
        a = (relax.Var("a", relax.TensorType((128, 16384), "bfloat16")), None)
        b = (relax.Var("b", relax.TensorType((64, 16384), "bfloat16")), [1, 0])
    assert _legal(a, b, 128, 64, 16384, 8)


@pytest.mark.gpu
def test_a_step_with_split_weight_gradients_trains_as_torch_fp32(monkeypatch):
    """torchvision's ResNet-18 at 32 x 128²: the stem's weight gradient (64 x 152 over 131072
    pixels) and the 1x1 downsamples' run as K-slice batches; the bf16 step against torch fp32."""
    pytest.importorskip("torchvision")
    import copy

    import tvm_evt
    from tvm_evt import models
    from tvm_evt.relax_passes.partition import split_matmul_reduction as split

    from _torch_ref import assert_bf16_step_close

    planned = []
    real_plan = split.plan
    monkeypatch.setattr(split, "plan", lambda *a: planned.append(real_plan(*a)) or planned[-1])
    torch.manual_seed(0)
    entry = models.torchvision_model("resnet18", batch=32, image=128, classes=100)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    assert step.target.kind.name == "cuda"
    assert sum(p is not None for p in planned) >= 2, planned
    assert_bf16_step_close(step, entry, entry.example_inputs())
