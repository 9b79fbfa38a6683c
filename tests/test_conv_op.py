"""tvm_evt.conv2d and its gradient ops (relax_passes/ops/conv_op.py), Conv2dToMatmul(implicit=True),
and a ResNet step with implicit-GEMM convolutions on the CPU reference path."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_evt
from tvm_evt import models, pipeline
from tvm_evt.relax_passes.ops import conv_op
from tvm_evt.relax_passes.training.conv2d_to_matmul import Conv2dToMatmul

from _torch_ref import no_dropout, rel_err

LLVM = tvm.target.Target({"kind": "llvm"})
GEOMETRIES = [  # n, h, w, c, k, r, s, pad (top, left, bottom, right), stride, dilation
    (2, 8, 8, 16, 8, 3, 3, (1, 1, 1, 1), (1, 1), (1, 1)),
    (2, 9, 7, 8, 16, 3, 3, (1, 1, 1, 1), (2, 2), (1, 1)),  # odd extents, stride 2: rows no window reads
    (2, 9, 7, 8, 16, 3, 2, (2, 0, 1, 1), (2, 1), (2, 1)),  # uneven padding, dilation
    (1, 6, 6, 8, 8, 1, 1, (0, 0, 0, 0), (1, 1), (1, 1)),
    # channel vectors narrower than 16 bytes: one gather kernel, K = R*S*C padded to whole 16 bytes
    (2, 15, 13, 3, 8, 7, 7, (3, 3, 3, 3), (2, 2), (1, 1)),  # a 7x7/2 stem
    (1, 9, 10, 3, 4, 3, 3, (2, 0, 1, 1), (2, 1), (2, 1)),  # uneven padding, dilation
    (2, 7, 7, 2, 8, 2, 2, (0, 0, 0, 0), (1, 1), (1, 1)),  # K = 8: no padding columns
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[:7])) + f"_s{g[8][0]}{g[8][1]}")
def test_conv2d_op_and_its_gradient_match_torch(geometry):
    """conv2d, conv2d_dgrad and conv2d_wgrad, legalized on llvm through the im2col decomposition,
    against float64 torch: the loss sum(y*y) and both gradients."""
    n, h, w, c, k, r, s, pad, stride, dilation = geometry
    g = conv_op.Geometry(pad, stride, dilation)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, h, w, c], "float32"))
    wt = relax.Var("w", relax.TensorType([k, r, s, c], "float32"))
    with bb.function("main", [x, wt]):
        with bb.dataflow():
            y = bb.emit(conv_op.conv2d(x, wt, g))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main")(bb.get())
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    rng = np.random.default_rng(0)
    xn, wn = rng.standard_normal((n, h, w, c), "float32"), rng.standard_normal((k, r, s, c), "float32")
    loss, (dx, dw) = vm["main_adjoint"](tvm.runtime.tensor(xn), tvm.runtime.tensor(wn))

    xt = torch.tensor(xn, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_()
    wt_ = torch.tensor(wn, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_()
    padded = torch.nn.functional.pad(xt, (pad[1], pad[3], pad[0], pad[2]))
    yt = torch.nn.functional.conv2d(padded, wt_, stride=stride, dilation=dilation)
    (yt * yt).sum().backward()
    assert rel_err(torch.from_numpy(loss.numpy()), (yt * yt).sum().detach()) <= 1e-5
    assert rel_err(torch.from_numpy(dx.numpy()), xt.grad.permute(0, 2, 3, 1)) <= 1e-5
    assert rel_err(torch.from_numpy(dw.numpy()), wt_.grad.permute(0, 2, 3, 1)) <= 1e-5


def test_conv2d_op_rejects_a_mismatched_gradient():
    dy = relax.Var("dy", relax.TensorType([2, 8, 8, 4], "float32"))
    w = relax.Var("w", relax.TensorType([4, 3, 3, 8], "float32"))
    g = conv_op.Geometry((0, 0, 0, 0), (1, 1), (1, 1))  # no padding: 8x8 gives 6x6, not dy's 8x8
    with pytest.raises(Exception, match="does not match dy"):
        relax.BlockBuilder().normalize(conv_op.conv2d_dgrad(dy, w, g, [2, 8, 8, 8]))


def test_implicit_conv2d_to_matmul_keeps_overlapping_windows_as_one_op():
    """With implicit=True a 3x3 NHWC convolution becomes one tvm_evt.conv2d."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 8, 16), "float32"), w: R.Tensor((32, 3, 3, 16), "float32")):
            y = R.nn.conv2d(x, w, padding=[1, 0, 1, 2], data_layout="NHWC", kernel_layout="OHWI")
            return y

    bb = relax.BlockBuilder()
    x, w = (relax.Var(n, p.ty) for n, p in zip("xw", Before["main"].params))
    with bb.function("main", [x, w]):
        y = bb.emit(conv_op.conv2d(x, w, conv_op.Geometry((1, 0, 1, 2), (1, 1), (1, 1))))
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(Conv2dToMatmul(implicit=True)(Before)["main"], bb.get()["main"])
    # without implicit it is the im2col gather and a matmul
    plain = _ops(Conv2dToMatmul()(Before)["main"])
    assert conv_op.FPROP not in plain and "relax.concat" in plain and "relax.matmul" in plain


def test_implicit_conv2d_to_matmul_leaves_gemm_like_convolutions_to_matmul():
    """A 1x1 convolution gathers nothing: it stays a plain GEMM (whose epilogue the partitioner
    can fuse) with implicit=True too."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 8, 16), "float32"), w: R.Tensor((8, 1, 1, 16), "float32")):
            y = R.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="OHWI")
            return y

    ops = _ops(Conv2dToMatmul(implicit=True)(Before)["main"])
    assert conv_op.FPROP not in ops and "relax.matmul" in ops and "relax.nn.conv2d" not in ops


def _ops(func) -> list[str]:
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_bf16_resnet_step_with_implicit_convolutions_agrees_with_fp32(monkeypatch):
    """resnet_basic in bf16 with ``implicit_conv`` (the default): its 3x3 convolutions are tvm_evt.conv2d ops in
    the step, their gradients the two gradient ops, no im2col concatenation is left, and loss and
    gradients are as close to the fp32 step as the bf16 step with im2col GEMMs is (on this small
    batch-norm net bf16 itself is ~8 % off fp32; the CPU reference legalizes the ops)."""
    torch.manual_seed(0)
    entry = models.ZOO["resnet_basic"]()
    no_dropout(entry.model)
    inputs = entry.example_inputs()
    compile_ = lambda **kw: tvm_evt.compile_training(copy.deepcopy(entry.model), inputs, loss_fn=entry.loss_fn,
                                                     target=LLVM, **kw)
    fp32 = compile_()
    monkeypatch.setenv(pipeline.DISABLE_ENV, "implicit_conv")
    im2col = compile_(precision="bf16")
    monkeypatch.delenv(pipeline.DISABLE_ENV)
    low = compile_(precision="bf16")  # implicit_conv is on by default
    ops = _ops(low.graph.mod["train_step"])
    assert ops.count(conv_op.FPROP) == 2 and ops.count(conv_op.WGRAD) == 2
    assert ops.count(conv_op.DGRAD) == 1  # the first convolution reads the image: no input gradient
    assert "relax.concat" not in ops and "relax.nn.conv2d" not in ops
    assert conv_op.FPROP not in _ops(im2col.graph.mod["train_step"])
    (loss32, grads32), (loss_ref, grads_ref), (loss, grads) = (s.loss_and_grads(*inputs) for s in (fp32, im2col, low))
    names = sorted(grads32)
    flat = lambda gs: torch.cat([gs[n].flatten().double() for n in names])
    assert rel_err(loss, loss32) <= max(2e-2, 1.25 * rel_err(loss_ref, loss32))
    assert rel_err(flat(grads), flat(grads32)) <= max(2e-2, 1.25 * rel_err(flat(grads_ref), flat(grads32)))


def _conv_step_module(channels: int) -> tvm.IRModule:
    """main(x, w1, w2): two 3x3 bf16 convolutions of `channels` channels and their gradients."""
    bb = relax.BlockBuilder()
    g = conv_op.Geometry((1, 1, 1, 1), (1, 1), (1, 1))
    x = relax.Var("x", relax.TensorType([2, 8, 8, channels], "bfloat16"))
    w1 = relax.Var("w1", relax.TensorType([channels, 3, 3, channels], "bfloat16"))
    w2 = relax.Var("w2", relax.TensorType([channels, 3, 3, channels], "bfloat16"))
    with bb.function("main", [x, w1, w2]):
        with bb.dataflow():
            y = bb.emit(conv_op.conv2d(bb.emit(conv_op.conv2d(x, w1, g)), w2, g))
            loss = bb.emit_output(relax.op.sum(relax.op.astype(y, "float32")))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main")(bb.get())


def test_offload_conv_shares_one_kernel_function_per_distinct_call():
    """Equal calls (two 3x3 64-channel convolutions; their input and weight gradients) share a
    Codegen="evt_conv" function each: fprop, dgrad, wgrad."""
    from tvm_evt.relax_passes.lower.offload_conv import CODEGEN, OffloadConv

    offload = OffloadConv()
    mod = offload(_conv_step_module(64))
    kernels = {gv.name_hint: f for gv, f in mod.functions_items()
               if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN}
    # named after the function that first calls them (main holds the forward convolutions too)
    assert sorted(kernels) == ["main_adjoint_conv_dgrad1", "main_adjoint_conv_wgrad2", "main_conv0"], sorted(kernels)
    assert offload.fallbacks == []
    adjoint = _ops(mod["main_adjoint"])
    assert not any(op.startswith("tvm_evt.conv2d") for op in adjoint)
    calls = []
    relax.analysis.post_order_visit(mod["main_adjoint"], lambda e: calls.append(e.op.name_hint)
                                    if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) else None)
    # two forward convolutions, the second's input gradient (the first reads the parameter x,
    # whose gradient Gradient also asks for), two weight gradients
    assert sorted(calls) == sorted(["main_conv0"] * 2 + ["main_adjoint_conv_dgrad1"] * 2
                                   + ["main_adjoint_conv_wgrad2"] * 2), calls


def test_offload_conv_decomposes_what_the_kernels_cannot_take():
    """4 channels are not 16-byte rows: every call becomes the im2col gather and a matmul (whose
    values test_conv2d_op_and_its_gradient_match_torch checks), with the reason kept."""
    from tvm_evt.relax_passes.lower.offload_conv import OffloadConv

    before = _conv_step_module(4)
    offload = OffloadConv()
    after = offload(before)
    assert not any(op.startswith("tvm_evt.conv2d") for op in _ops(after["main_adjoint"]))
    assert "relax.matmul" in _ops(after["main_adjoint"])
    assert offload.fallbacks and all("multiples of 8" in why for why in offload.fallbacks), offload.fallbacks


def test_offload_conv_splits_a_long_weight_gradient_or_leaves_it_to_the_gemm():
    """ResNet-50 conv3_x's 3x3 weight gradient (128 x 1152 over K = 100352) is 9 tiles of the
    convolution kernel, which has no split-K: the kernel splits it over the batch (13 chunks, 117
    CTAs).  One image of 128x128 cannot be split: it becomes im2col + GEMM (stream-K there).  The
    forward convolution and input gradient (784 tiles) are kernels as they are."""
    from tvm_evt.codegen.backend import conv
    from tvm_evt.codegen.frontend.conv_call import conv_of_call
    from tvm_evt.relax_passes.lower.offload_conv import too_few_tiles

    g = conv_op.Geometry((1, 1, 1, 1), (1, 1), (1, 1))
    x = relax.Var("x", relax.TensorType([128, 28, 28, 128], "bfloat16"))
    w = relax.Var("w", relax.TensorType([128, 3, 3, 128], "bfloat16"))
    bb = relax.BlockBuilder()
    specs = [conv_of_call(bb.normalize(c)) for c in (
        conv_op.conv2d(x, w, g), conv_op.conv2d_dgrad(x, w, g, [128, 28, 28, 128]),
        conv_op.conv2d_wgrad(x, x, g, [128, 3, 3, 128]))]
    assert [too_few_tiles(s) for s in specs] == [None, None, None]
    assert [conv.splits(s) for s in specs] == [1, 1, 13] and conv.tiles(specs[2]) == 9
    one = relax.Var("one", relax.TensorType([1, 128, 128, 64], "bfloat16"))
    lone = conv_of_call(bb.normalize(conv_op.conv2d_wgrad(one, one, g, [64, 3, 3, 64])))
    assert conv.splits(lone) == 1 and "9 CTAs" in too_few_tiles(lone) and "16384" in too_few_tiles(lone)


STRIDED = [  # n, h, w, c, k, r, s, pad, stride: dgrads split into stride phases
    (2, 8, 8, 8, 16, 3, 3, (1, 1, 1, 1), (2, 2)),  # ResNet-50's downsampling 3x3 (56 -> 28, scaled down)
    (2, 9, 7, 8, 16, 3, 3, (1, 1, 1, 1), (2, 2)),  # odd extents: phases of unequal size, a cropped tail
    (1, 11, 10, 8, 8, 3, 2, (2, 0, 1, 1), (3, 2)),  # uneven padding, stride 3: a phase past every window
    (2, 8, 8, 8, 8, 1, 1, (0, 0, 0, 0), (2, 2)),  # 1x1, stride 2: three phases no tap reaches
    (1, 12, 12, 8, 8, 5, 5, (2, 2, 2, 2), (4, 4)),  # 16 phases of 1x1 and 2x2 sub-filters
]


@pytest.mark.parametrize("geometry", STRIDED, ids=lambda g: "x".join(map(str, g[:7])) + f"_s{g[8][0]}{g[8][1]}")
def test_split_strided_dgrad_matches_torch(geometry):
    """split_strided_dgrad writes a strided dgrad as unit-stride dgrads of sub-filters (each kept
    as the op here, legalized on llvm) interleaved: against float64 torch's input gradient."""
    n, h, w, c, k, r, s, pad, stride = geometry
    g = conv_op.Geometry(pad, stride, (1, 1))
    p, q = g.out((h, w), (r, s))
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType([n, p, q, k], "float32"))
    wt = relax.Var("w", relax.TensorType([k, r, s, c], "float32"))
    phases = []
    with bb.function("main", [dy, wt]):
        with bb.dataflow():
            call = bb.normalize(conv_op.conv2d_dgrad(dy, wt, g, [n, h, w, c]))
            dx = conv_op.split_strided_dgrad(bb.emit, call, lambda ph: phases.append(ph) or bb.emit(ph))
            out = bb.emit_output(dx)
        bb.emit_func_output(out)
    mod = bb.get()
    assert all(conv_op.Geometry.of(ph.args[2]).stride == (1, 1) for ph in phases)
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    rng = np.random.default_rng(1)
    dyn, wn = rng.standard_normal((n, p, q, k), "float32"), rng.standard_normal((k, r, s, c), "float32")
    got = vm["main"](tvm.runtime.tensor(dyn), tvm.runtime.tensor(wn)).numpy()

    xt = torch.zeros(n, c, h, w, dtype=torch.float64, requires_grad=True)
    padded = torch.nn.functional.pad(xt, (pad[1], pad[3], pad[0], pad[2]))
    yt = torch.nn.functional.conv2d(padded, torch.tensor(wn, dtype=torch.float64).permute(0, 3, 1, 2), stride=stride)
    yt.backward(torch.tensor(dyn, dtype=torch.float64).permute(0, 3, 1, 2))
    assert rel_err(torch.from_numpy(got), xt.grad.permute(0, 2, 3, 1)) <= 1e-5


def _strided_dgrad_module(batch: int, out: int, channels: int) -> tvm.IRModule:
    """main(dy, w): the input gradient of a stride-2 3x3 bf16 convolution (pad 1) whose output is
    out x out, with `channels` channels in and out."""
    g = conv_op.Geometry((1, 1, 1, 1), (2, 2), (1, 1))
    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType([batch, out, out, channels], "bfloat16"))
    wt = relax.Var("w", relax.TensorType([channels, 3, 3, channels], "bfloat16"))
    with bb.function("main", [dy, wt]):
        with bb.dataflow():
            dx = bb.emit_output(conv_op.conv2d_dgrad(dy, wt, g, [batch, 2 * out, 2 * out, channels]))
        bb.emit_func_output(dx)
    return bb.get()


def test_offload_conv_splits_a_strided_dgrad_into_unit_stride_kernels():
    """ResNet-50 conv3_x's stride-2 3x3 dgrad (28x28 -> 56x56, 128 channels) becomes four
    unit-stride dgrad kernels (sub-filters 1x1, 1x2, 2x1, 2x2) instead of the im2col fallback."""
    from tvm_evt.relax_passes.lower.offload_conv import CODEGEN, OffloadConv

    offload = OffloadConv()
    mod = offload(_strided_dgrad_module(8, 28, 128))
    kernels = {gv.name_hint: f for gv, f in mod.functions_items()
               if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN}
    assert offload.fallbacks == [] and len(kernels) == 4, (offload.fallbacks, sorted(kernels))
    filters = sorted(tuple(int(d) for d in f.params[1].ty.shape)[1:3] for f in kernels.values())
    assert filters == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert "relax.matmul" not in _ops(mod["main"])


def test_training_report_lists_a_strided_dgrad_by_its_stride_phases():
    from tvm_evt.report import conv_calls

    rows = conv_calls(_strided_dgrad_module(8, 28, 128)["main"])
    assert [(r["op"], r["w"][1:3], r["kernel"], r["stride_phase_of"]) for r in rows] == [
        ("dgrad", [1, 1], True, [8, 56, 56, 128]), ("dgrad", [1, 2], True, [8, 56, 56, 128]),
        ("dgrad", [2, 1], True, [8, 56, 56, 128]), ("dgrad", [2, 2], True, [8, 56, 56, 128])], rows


def test_offload_conv_keeps_a_strided_dgrad_whole_where_a_phase_has_no_kernel():
    """4 channels are not 16-byte rows: no phase would run as a kernel, so the strided dgrad is
    one im2col product and col2im (not one per phase), with the reason kept."""
    from tvm_evt.relax_passes.lower.offload_conv import OffloadConv

    offload = OffloadConv()
    mod = offload(_strided_dgrad_module(2, 4, 4))
    assert _ops(mod["main"]).count("relax.matmul") == 1, _ops(mod["main"])
    assert len(offload.fallbacks) == 1 and "multiples of 8" in offload.fallbacks[0], offload.fallbacks


def test_narrow_channel_windows_are_one_gather_padded_to_whole_vectors():
    """A 7x7/2 bf16 convolution of a 3-channel image (12-byte rows of taps) legalizes to one
    ``im2col`` gather kernel whose rows are 152 wide (147 taps x channels, zero to a multiple of
    8) and a matmul over that K, against a zero-padded weight: no per-tap slices or concatenation,
    and no K the GEMM kernels would have to pad again."""
    x = relax.Var("x", relax.TensorType([2, 16, 16, 3], "bfloat16"))
    w = relax.Var("w", relax.TensorType([8, 7, 7, 3], "bfloat16"))
    dy = relax.Var("dy", relax.TensorType([2, 8, 8, 8], "bfloat16"))
    g = conv_op.Geometry((3, 3, 3, 3), (2, 2), (1, 1))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, dy]):
        y = bb.emit(conv_op.decompose_conv2d(bb, conv_op.conv2d(x, w, g)))
        dw = bb.emit(conv_op.decompose_conv2d_wgrad(bb, conv_op.conv2d_wgrad(x, dy, g, [8, 7, 7, 3])))
        bb.emit_func_output(relax.Tuple([y, dw]))
    mod = bb.get()
    ops = _ops(mod["main"])
    assert "relax.concat" not in ops and ops.count("relax.strided_slice") == 1  # dW's padding columns dropped
    assert ops.count("relax.nn.pad") == 1  # the weight's zero rows
    gathers = [gv for gv in mod.get_global_vars() if gv.name_hint.startswith("im2col")]
    assert len(gathers) == 1  # one PrimFunc, called by both decompositions
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and e.op == tvm.ir.Op.get("relax.call_tir") and e.args[0].same_as(gathers[0])
                                    else None)
    assert [[int(d) for d in c.ty.shape.values] for c in calls] == [[128, 152], [128, 152]]
    matmuls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: matmuls.append(e) if isinstance(e, relax.Call)
                                    and e.op == tvm.ir.Op.get("relax.matmul") else None)
    assert [[int(d) for d in a.ty.shape.values] for m in matmuls for a in m.args] == \
        [[128, 152], [152, 8], [8, 128], [128, 152]]
