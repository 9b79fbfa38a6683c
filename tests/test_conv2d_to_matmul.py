import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.training.conv2d_to_matmul import Conv2dToMatmul

CASES = [  # (x shape, w shape, stride, padding, dilation)
    ((2, 8, 6, 6), (5, 8, 1, 1), 1, 0, 1),  # 1x1
    ((2, 8, 7, 7), (5, 8, 1, 1), 2, 0, 1),  # 1x1, stride 2 (ResNet's downsampling shortcut)
    ((2, 4, 8, 8), (6, 4, 3, 3), 1, 1, 1),  # 3x3 same
    ((2, 4, 9, 9), (6, 4, 3, 3), 2, 1, 1),  # 3x3 stride 2
    ((1, 3, 9, 10), (4, 3, 3, 2), (2, 1), (1, 0, 2, 1), (2, 1)),  # asymmetric everything
    ((2, 3, 8, 12), (7, 3, 4, 4), 4, 0, 1),  # non-overlapping patches (ViT)
]


def _conv_module(xs, ws, stride, padding, dilation, nhwc=False):
    """conv2d of NCHW x and OIHW w; with `nhwc`, of the same tensors held NHWC and OHWI."""
    bb = relax.BlockBuilder()
    if nhwc:
        xs, ws = (xs[0], xs[2], xs[3], xs[1]), (ws[0], ws[2], ws[3], ws[1])
    x = relax.Var("x", relax.TensorType(xs, "float32"))
    w = relax.Var("w", relax.TensorType(ws, "float32"))
    layouts = dict(data_layout="NHWC", kernel_layout="OHWI") if nhwc else {}
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.conv2d(x, w, strides=stride, padding=padding, dilation=dilation,
                                                  **layouts))
        bb.emit_func_output(y)
    return bb.get()


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _ops(mod):
    return [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_conv2d_becomes_one_matmul_with_the_same_result(case, nhwc):
    before = _conv_module(*case, nhwc=nhwc)
    after = Conv2dToMatmul()(before)
    ops = _ops(after)
    assert "relax.nn.conv2d" not in ops and ops.count("relax.matmul") == 1, ops
    if nhwc:  # channel-contiguous windows, an NHWC result: the weight's transpose is the only one
        patches = case == CASES[-1]  # (and the reorder of non-overlapping patches)
        assert ops.count("relax.permute_dims") == 1 + patches, ops
    rng = np.random.default_rng()
    args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype("float32") for p in before["main"].params]
    np.testing.assert_allclose(_run(after, args), _run(before, args), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("from_nwc", [False, True])
@pytest.mark.parametrize("k,stride,padding,dilation", [(2, 1, 0, 1), (8, 1, 0, 1), (3, 2, (1, 2), 2)])
def test_conv1d_becomes_one_matmul_with_the_same_result(k, stride, padding, dilation, from_nwc):
    """Gathered channels-last; with `from_nwc` the input is an NWC tensor's transpose (XML-CNN's
    embedding), read as that tensor: the only transposes left are the weight's and the result's."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 20, 6) if from_nwc else (2, 6, 20), "float32"))
    w = relax.Var("w", relax.TensorType((5, 6, k), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            ncw = bb.emit(relax.op.permute_dims(x, [0, 2, 1])) if from_nwc else x
            y = bb.emit_output(relax.op.nn.conv1d(ncw, w, strides=stride, padding=padding, dilation=dilation))
        bb.emit_func_output(y)
    before = bb.get()
    after = relax.transform.DeadCodeElimination()(Conv2dToMatmul()(before))
    ops = _ops(after)
    assert "relax.nn.conv1d" not in ops and ops.count("relax.matmul") == 1, ops
    assert ops.count("relax.permute_dims") == 4 - from_nwc, ops  # (input,) weight OIW->OWI, its ᵀ, result
    rng = np.random.default_rng()
    args = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype("float32") for p in before["main"].params]
    np.testing.assert_allclose(_run(after, args), _run(before, args), rtol=1e-4, atol=1e-4)


def test_large_overlapping_windows_and_groups_stay_conv2d():
    stem = _conv_module((1, 3, 16, 16), (8, 3, 7, 7), 2, 3, 1)  # 49 taps
    tvm.ir.assert_structural_equal(Conv2dToMatmul()(stem), stem)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.Var("w", relax.TensorType((4, 1, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.conv2d(x, w, padding=1, groups=4))
        bb.emit_func_output(y)
    depthwise = bb.get()
    tvm.ir.assert_structural_equal(Conv2dToMatmul()(depthwise), depthwise)



def test_nhwc_window_gather_moves_whole_channel_vectors(monkeypatch):
    """NHWC taps stack on their own axis, so the gather kernel (relu, pad, slices, concat, as the
    CUDA pipeline fuses them, the GEMM's reshape left to its partition) picks its tap by an outer
    index and VectorizedElementwise gives it 16-byte vectors.  Stacked along C, the tap varied
    along the innermost axis and the rule declined it (ResNet-50 conv3_x on H100: 0.48 ms for a
    231 MB gather, one element a thread)."""
    from tvm.s_tir import dlight as dl

    from tvm_evt import models, tuning
    from tvm_evt.relax_passes.lower.vectorized_elementwise import VectorizedElementwise

    from tvm_evt import pipeline

    monkeypatch.setenv(pipeline.DISABLE_ENV, "implicit_conv")  # the im2col route (on by default: kernels)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    _, graph = tuning.training_graph(models.ZOO["resnet_basic"](), "bf16")
    fused = tuning.tir_module(graph.mod, cuda)
    gathers = [gv for gv, f in fused.functions_items() if "concatenate" in gv.name_hint]
    assert gathers
    with cuda:
        for gv in gathers:
            out = dl.ApplyDefaultSchedule(VectorizedElementwise())(tvm.IRModule({"main": fused[gv]}))["main"]
            # 16 bytes: 8 bf16 lanes, or 4 where the gather reads the fp32 input
            assert re.search(r"T.vectorized\(T.int64\((8|4)\)\)", out.script()), gv.name_hint
